r"""Champion scores: the champion's per-item results on every benchmark suite, once per champion.

Reads `models/champion` and the benchmarks of the `environments:`; writes
`data/champion_scores.parquet` (per item: suite, id, correct, reward, ... and the weights hash),
`metrics/champion_scores.json`, `data/forgetting.jsonl` (a persistent output: every item some
champion solved) and the held-out judge's paid judgments to `--judgments`. DVC runs it only when
the champion, the benchmarks, the environments or this code change; greedy, with `base.seed`,
exactly as the gate scores the candidate.

    python -m stages.champion_scores models/champion data/champion_scores.parquet data/forgetting.jsonl \
        metrics/champion_scores.json --judgments data/champion_judgments --judged-before data/gate_judgments

Details: docs/cycle.md, "How the champion is scored (stages/champion_scores.py)".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa

from stages import config as cfg
from stages import gate, io, tinylm


def run(base: cfg.Base, config: cfg.Gate, champion: Path, scores_out: Path, forgetting: Path,
        specs: dict, rollout: cfg.Rollout, root: Path | None = None) -> dict:
    """Score the champion on the benchmark of every environment of `specs` (the `environments:`
    section), as the gate scores a candidate, and extend the forgetting set; returns the metrics.
    """
    tinylm.set_threads(base.threads)
    weights = gate.weights_hash(champion)
    items, scored, _ = gate.score_all(champion, config, base.seed, specs, rollout, root)
    rows = [{**row, "champion_weights": weights} for row in scored]
    io.write_parquet(scores_out, pa.Table.from_pylist(rows))
    kept = {(r["suite"], r["id"]): r for r in
            (io.read_jsonl(forgetting) if forgetting.exists() else [])}
    added = 0
    for r in rows:
        if r["correct"] != 1.0:
            continue
        entry = kept.setdefault((r["suite"], r["id"]), {
            "suite": r["suite"], "id": r["id"], "question": r["question"], "solved_by": []})
        added += not entry["solved_by"]
        if weights[:16] not in entry["solved_by"]:
            entry["solved_by"].append(weights[:16])
    io.write_jsonl(forgetting, list(kept.values()))
    per_suite = {}
    for name in items:
        scored = [r["correct"] for r in rows if r["suite"] == name and r["correct"] is not None]
        per_suite[name] = {"items": len(items[name]),
                           "pass_at_1": round(sum(scored) / len(scored), 4) if scored else None}
    return {"champion_weights": weights, "suites": per_suite,
            "forgetting_items": len(kept), "forgetting_added": added}


def main(argv: list[str] | None = None) -> None:
    """Score the champion on the benchmark suites (the DVC stage's command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("champion", "scores", "forgetting", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    from stages.envs import judge

    # a promoted candidate's answers were judged by the gate
    judge.cache_arguments(parser, "data/champion_judgments", "data/gate_judgments")
    args = parser.parse_args(argv)
    io.watch_gpus()  # per GPU busy seconds, peak memory (the cost ledger); none: nothing

    # an environment's reward calls the held-out judge here
    judge.for_benchmarks(args.judgments, tuple(args.judged_before))
    metrics = run(cfg.load("base", args.params), cfg.load("gate", args.params), args.champion,
                  args.scores, args.forgetting, cfg.environments(args.params),
                  cfg.load("rollout", args.params), Path(args.params).resolve().parent)
    io.write_metrics(args.metrics, {**metrics, **judge.spent()})
    suites = ", ".join(
        f"{name} {'-' if suite['pass_at_1'] is None else format(suite['pass_at_1'], '.1%')} "
        f"pass@1 over {suite['items']} items" for name, suite in metrics["suites"].items())
    print(f"champion_scores: {suites or 'no suite'}; forgetting set "
          f"{metrics['forgetting_items']} items (+{metrics['forgetting_added']})", file=sys.stderr)


if __name__ == "__main__":
    with io.explained("champion_scores"):
        main()
    io.exit_soon()
