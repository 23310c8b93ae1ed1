"""Sandboxed verifications per second against bare `subprocess.run` of the same tests.

    .venv/bin/python benchmarks/sandbox.py                 # prints a Markdown table for BENCHMARKS.md
    .venv/bin/python benchmarks/sandbox.py --rounds 2 --workers 2

Each verification is one task of the code suites (data/tasks/code.jsonl and
data/benchmarks/code.jsonl) with its reference solution: write the solution and its tests to a
fresh temporary directory and run the tests in a new process of the real interpreter
(`stages.envs.sandbox.interpreter()`, the same in every row). The baseline is a bare
`subprocess.run([python, "-I", "-B", "-c", <load the tests, run them>])` in that directory (the same
unittest calls the sandbox's harness makes, without its report); the sandboxed rows are
`stages.envs.sandbox.run_tests` under bubblewrap, the unshare sandbox and "rlimit" (no isolation). `--workers` threads
run verifications at once (2: one per core of the project's machines; the work is in the child
processes, so threads do not serialize it). The rows take turns, `--rounds` times, and each row's
median rate is printed, so a neighbour's load spike does not land on one row only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.envs import contract, sandbox  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


BARE = ("import sys, unittest; sys.path.append('.'); import test_solution; "
        "r = unittest.TextTestRunner().run(unittest.defaultTestLoader.loadTestsFromModule("
        "test_solution)); sys.exit(not r.wasSuccessful())")


def jobs() -> list[tuple[str, str]]:
    """The (reference solution, tests) pairs of the coding task and benchmark suites."""
    tasks = [t for p in ("data/tasks/code.jsonl", "data/benchmarks/code.jsonl")
             for t in contract.load_tasks(REPO / p, "code")]
    pairs = []
    for task in tasks:
        answer = json.loads(task["answer"])
        pairs.append((answer["solution"], answer["tests"]))
    return pairs


def bare(code: str, tests: str) -> bool:
    """Run one pair's tests in a bare subprocess, the baseline; True if they pass."""
    with tempfile.TemporaryDirectory() as work:
        Path(work, "solution.py").write_text(code)
        Path(work, "test_solution.py").write_text(tests)
        # a new session as the sandbox's: with the kernel's autogroup scheduling each session
        # gets its own CPU share, so on a busy machine a baseline left in ours would run slower
        result = subprocess.run([sandbox.interpreter(), "-I", "-B", "-c", BARE],
                                cwd=work, capture_output=True, timeout=30, start_new_session=True)
        return result.returncode == 0


def timed(label: str, fn, pairs, workers: int) -> float:
    """Verify all pairs with `fn` on `workers` threads and print the rate; returns seconds."""
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        ok = list(pool.map(lambda pair: fn(*pair), pairs))
    seconds = time.perf_counter() - started
    if not all(ok):
        raise SystemExit(f"{label}: {ok.count(False)} of {len(ok)} reference solutions failed")
    return len(pairs) / seconds


def main(argv: list[str] | None = None) -> None:
    """Compare the sandbox's isolations with a bare subprocess and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="turns of each row (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="verifications at once (default 2)")
    args = parser.parse_args(argv)
    pairs = jobs()
    rows = {"bare subprocess.run (baseline)": bare}
    kinds = ["rlimit"] + [kind for kind, problem in (("unshare", sandbox.unshare_problem),
                                                     ("bwrap", sandbox.bwrap_problem))
                          if problem() is None]
    for kind in kinds:
        def verify(code, tests, kind=kind):
            return sandbox.run_tests(code, tests, isolation=kind).passed
        rows[f"sandbox, {kind}"] = verify
    print(f"{len(pairs)} verifications a turn, {args.rounds} turns, {args.workers} at once, "
          f"interpreter {sandbox.interpreter()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    bare(*pairs[0])  # warm the page cache for every row alike
    rates = {label: [] for label in rows}
    for turn in range(args.rounds):
        for label, fn in rows.items():
            rates[label].append(timed(label, fn, pairs, args.workers))
        print(f"turn {turn + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end\n")
    base = statistics.median(rates["bare subprocess.run (baseline)"])
    print("| what | verifications/s (median of turns) | vs bare |")
    print("|---|---|---|")
    for label, values in rates.items():
        rate = statistics.median(values)
        print(f"| {label} | {rate:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
