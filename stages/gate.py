"""Gate: the candidate against the champion on the held-out benchmark, with a paired interval.

Reads `models/candidate`, `models/champion` and `data/benchmarks/<environment>.jsonl`. Both models
answer every item greedily (so the scores are reproducible); writes per-item results to
`data/gate.parquet` and the verdict to `metrics/gate.json`: `passed`, `candidate_score` and
`champion_score` (pass@1), the difference with its paired bootstrap interval, the rule and the
reason. The candidate passes when the interval's lower bound exceeds `gate.min_improvement`, so a
lucky draw on 200 items does not replace the champion. A candidate identical to the champion (the
train stage had nothing to learn from) never passes.

    python -m stages.gate models/candidate models/champion data/benchmarks/arith.jsonl data/gate.parquet metrics/gate.json
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from stages import config as cfg
from stages import generate, io, tinylm
from stages.environments import ENVIRONMENTS


def weights_hash(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def score(model_dir: Path, env, items: list[dict], seed: int) -> list[tuple[float, str]]:
    model, tokenizer = tinylm.load(model_dir)
    episodes = generate.generate(model, tokenizer, env, [env.prompt(i["question"]) for i in items],
                                 temperature=0.0, max_new_tokens=48, seed=seed, batch_size=1024,
                                 progress=False)
    return [(env.verify(i["question"], str(i["answer"]), e.completion) or 0.0, e.completion)
            for i, e in zip(items, episodes)]


def paired_interval(a: np.ndarray, b: np.ndarray, samples: int, confidence: float, seed: int):
    """Bootstrap interval of mean(a - b), resampling items (pairs) together."""
    diff = a - b
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(samples, len(diff)))].mean(axis=1)
    tail = (1 - confidence) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def run(base: cfg.Base, config: cfg.Gate, candidate: Path, champion: Path, benchmark: Path,
        items_out: Path) -> dict:
    """Score both models and decide; returns the verdict."""
    tinylm.set_threads(base.threads)
    env = ENVIRONMENTS[base.environment]
    if not benchmark.exists():
        raise FileNotFoundError(f"{benchmark}: benchmark not found; write it with "
                                f"`python -m stages.{env.NAME} --write-benchmark {benchmark}`")
    items = io.read_jsonl(benchmark)
    if config.benchmark_size:
        items = items[:config.benchmark_size]
    if not items:
        raise ValueError(f"{benchmark}: the benchmark is empty; the gate needs items to compare on")
    cand = score(candidate, env, items, base.seed)
    champ = score(champion, env, items, base.seed)
    a = np.array([s for s, _ in cand])
    b = np.array([s for s, _ in champ])
    low, high = paired_interval(a, b, config.bootstrap_samples, config.confidence, base.seed)
    unchanged = weights_hash(candidate) == weights_hash(champion)
    passed = (not unchanged) and low > config.min_improvement
    rule = (f"pass when the {config.confidence:.0%} paired bootstrap interval of "
            f"candidate - champion pass@1 has its lower bound above {config.min_improvement}")
    if unchanged:
        reason = "the candidate is the champion unchanged (nothing was trained)"
    elif passed:
        reason = f"lower bound {low:+.3f} > {config.min_improvement}"
    else:
        reason = f"lower bound {low:+.3f} <= {config.min_improvement}: not clearly better"
    io.write_parquet(items_out, pa.Table.from_pylist([
        {"id": item["id"], "question": item["question"], "candidate": float(sa),
         "champion": float(sb), "candidate_completion": ca, "champion_completion": cb}
        for item, (sa, ca), (sb, cb) in zip(items, cand, champ)]))
    return {"passed": bool(passed), "candidate_score": round(float(a.mean()), 4),
            "champion_score": round(float(b.mean()), 4),
            "difference": round(float((a - b).mean()), 4),
            "interval": [round(low, 4), round(high, 4)], "confidence": config.confidence,
            "items": len(items), "benchmark": benchmark.name, "rule": rule, "reason": reason}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("candidate", "champion", "benchmark", "items", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    verdict = run(cfg.load("base", args.params), cfg.load("gate", args.params), args.candidate,
                  args.champion, args.benchmark, args.items)
    io.write_json(args.metrics, verdict)
    print(f"gate: candidate {verdict['candidate_score']:.3f} vs champion "
          f"{verdict['champion_score']:.3f} -> {'PASS' if verdict['passed'] else 'FAIL'} "
          f"({verdict['reason']})", file=sys.stderr)


if __name__ == "__main__":
    main()
