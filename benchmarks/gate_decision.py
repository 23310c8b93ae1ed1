"""How long one gate decision takes: 3 suites x 200 pass/fail items, every rule, the defaults.

Run: `.venv/bin/python benchmarks/gate_decision.py [--repeats 20]`
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    """Time `stages.gate.decide` on simulated per-item results, sequential none and lord."""
    import numpy as np

    from stages import config as cfg
    from stages import gate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    pairs = []
    for suite in ("arith", "code", "toolcall"):
        champion = (rng.random(200) < 0.55).astype(float)
        candidate = np.where(rng.random(200) < 0.85, champion, 1 - champion)
        for i, (c, h) in enumerate(zip(candidate, champion)):
            row = {"suite": suite, "id": f"{suite}-{i}", "format": 1.0, "tool_ok": 1.0}
            pairs.append(({**row, "correct": float(c), "tokens": 30},
                          {**row, "correct": float(h), "tokens": 28}))
    solved = {(c["suite"], c["id"]) for c, h in pairs if h["correct"] == 1.0}
    for sequential in ("none", "lord"):
        config = cfg.Gate(sequential=sequential, forgetting_min_items=30)
        history = [{"level": 0.001, "passed": i % 5 == 0} for i in range(51)]
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            gate.decide(config, 0, pairs, solved, [], False, None, history)
            times.append(time.perf_counter() - started)
        print(f"sequential {sequential}: median {1000 * sorted(times)[len(times) // 2]:.1f} ms, "
              f"max {1000 * max(times):.1f} ms over {args.repeats} decisions (3 suites x 200 "
              f"items, forgetting set of {len(solved)}, 51 earlier decisions)")


if __name__ == "__main__":
    main()
