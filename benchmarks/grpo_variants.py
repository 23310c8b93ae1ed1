"""GRPO's variants on the demo: the first cycle's gain of each, with nothing but its knobs set.

    .venv/bin/python benchmarks/grpo_variants.py            # every variant below
    .venv/bin/python benchmarks/grpo_variants.py bnpo dapo  # some of them

One project in a temporary folder (the shipped params.yaml: arith under `environments:`, the demo's
chat model): `offseason init` and `offseason simulate` once, then per variant a copy of it with
`train.algorithm: grpo` and the variant's `train.grpo` keys, and one `offseason run`. Prints, per
variant, generation 0's and generation 1's pass@1 on the 200-item benchmark, the gain, the verdict,
and the train stage's tokens/s (Markdown, then JSON). CPU, about 3 minutes each
on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import copy_project, make_project, offseason  # noqa: E402

VARIANTS = {
    "bnpo": {},  # the defaults
    "grpo": {"loss_type": "grpo"},
    "dapo": {"loss_type": "dapo"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "bnpo, clip_high 0.28": {"clip_high": 0.28},
    "bnpo, scale_rewards batch": {"scale_rewards": "batch"},
}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen variants and print the table; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help=f"default: all of {', '.join(VARIANTS)}")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = parser.parse_args(argv)
    chosen = args.variants or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; one of {list(VARIANTS)}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="offseason-grpo-"))
    base = make_project(work / "base", {})
    offseason(base, "init")
    offseason(base, "simulate")
    results = {}
    try:
        for name in chosen:
            project = copy_project(base, work / name.replace(" ", "_").replace(",", ""))
            params = yaml.safe_load((project / "params.yaml").read_text())
            params["train"]["algorithm"] = "grpo"
            params["train"]["grpo"].update(VARIANTS[name])
            (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            started = time.time()
            offseason(project, "run")
            gate = json.loads((project / "metrics" / "gate.json").read_text())
            train = json.loads((project / "metrics" / "train.json").read_text())
            results[name] = {
                "gen0": gate["champion_score"], "gen1": gate["candidate_score"],
                "points": round(100 * (gate["candidate_score"] - gate["champion_score"]), 1),
                "promoted": gate["passed"], "seconds": round(time.time() - started),
                "tokens_per_second": train.get("tokens_per_second")}
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("| variant (train.grpo) | gen-0 | gen-1 | points | verdict | train tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['gen0']:.1%} | {r['gen1']:.1%} | {r['points']:+.1f} | "
              f"{'promoted' if r['promoted'] else 'rejected'} | {r['tokens_per_second']} |")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
