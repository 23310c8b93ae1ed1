"""What the cost ledger, the estimate and the budget checks add to a cycle (BENCHMARKS.md, "The
cost ledger's overhead").

On a project with committed cycles (after `offseason demo`, or tests/flows/audit/test_lineage.py's), times
each piece the cost work adds to one cycle, as often as a cycle does it, against that project's
last cycle (the sum of its stages' wall seconds in metrics/cost.json: a lower bound of the cycle's
time, so the share is an upper bound):

- the estimate before the cycle (`flows.orchestration.cost.estimate`: git reads of the last three ledgers, the
  inbox's lines) and the ledger after it (`flows.orchestration.cost.ledger`);
- each budgeted stage's meter (`stages.budget.Meter.of`, with a budget set: the cycle's earlier
  stages' metrics against HEAD's through git) and its checks (`Meter.check`: rusage), once per
  optimizer step, rollout batch and episode of the last cycle;
- each stage's `resources()` and the train stage's token counting per batch (`loss_tokens` and
  the attention-mask sums of `StepLog`) on a batch of the demo's size.

    .venv/bin/python benchmarks/cost_overhead.py PROJECT [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]


def timed(fn, repeats: int) -> float:
    """The median seconds of `fn()` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    """Time the pieces and print them as JSON, with their share of the last cycle."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("project", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import dataclasses
    import os

    import torch

    from flows.orchestration import cost
    from flows.project import params as settings
    from stages import budget as budgets
    from stages import io
    from stages.training import trainers

    root = args.project.resolve()
    os.chdir(root)
    configs = settings.load_all(root / "params.yaml")
    spent = json.loads((root / "metrics/cost.json").read_text())
    metrics = {name: json.loads((root / "metrics" / f"{name}.json").read_text())
               for name in cost.STAGES if (root / "metrics" / f"{name}.json").exists()}
    train = metrics.get("train", {})
    checks = (train.get("steps") or 0) + metrics.get("rollout", {}).get("episodes", 0) * 2
    batch = {"input_ids": torch.zeros(64, 80, dtype=torch.long),
             "attention_mask": torch.ones(64, 80, dtype=torch.long),
             "labels": torch.zeros(64, 80, dtype=torch.long)}
    limited = dataclasses.replace(configs["budget"], max_usd=1e9)
    meter = budgets.Meter("train", limited, configs["cost"])
    pieces = {
        "estimate (once)": timed(lambda: cost.estimate(root, configs), args.repeats),
        "ledger (once)": timed(lambda: cost.ledger(metrics, dict.fromkeys(metrics, True),
                                                   configs["cost"]), args.repeats),
        "meters with a budget (3 stages)": 3 * timed(
            lambda: budgets.earlier_spend(root, "train"), args.repeats),
        f"budget checks ({checks}: steps + episodes x 2)": checks * timed(
            lambda: meter.check("", ""), args.repeats * 100),
        "resources() (7 stages)": 7 * timed(io.resources, args.repeats * 100),
        f"token counting ({train.get('steps') or 0} steps of 64 x 80)":
            (train.get("steps") or 0) * timed(
                lambda: (sum(int(v.sum()) for k, v in batch.items() if k.endswith("attention_mask")),
                         trainers.loss_tokens(batch)), args.repeats * 100),
    }
    cycle = spent["total"]["wall_seconds"]
    total = sum(pieces.values())
    print(json.dumps({"project": str(root), "last_cycle_stage_wall_seconds": cycle,
                      "pieces_ms": {k: round(v * 1000, 2) for k, v in pieces.items()},
                      "total_ms": round(total * 1000, 1),
                      "share_of_cycle_percent": round(100 * total / cycle, 3)}, indent=2))


if __name__ == "__main__":
    main()
