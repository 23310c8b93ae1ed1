"""The PII scrubber on clean code: lines/s and the share of lines it changes.

    .venv/bin/python benchmarks/scrub.py

Reads the C++ standard library headers the compiler ships (/usr/include/c++/<newest>) and
CPython's standard library (its test suites and site-packages left out), then scrubs every
non-blank line as ingest does (`stages.traces.pii`: the cheap `maybe_pii` gate, then the
patterns of every kind), one `Scrubber` per line. Prints a Markdown table: lines, seconds,
lines/s, lines changed per kind. Reading the files is not timed.
"""

from __future__ import annotations

import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.traces.pii import KINDS, Scrubber, maybe_pii  # noqa: E402


def corpora() -> dict[str, list[str]]:
    """{name: its non-blank lines}."""
    out = {}
    cpp = sorted(Path("/usr/include/c++").glob("*"))
    if cpp:
        out[f"C++ headers ({cpp[-1]})"] = [
            line for p in sorted(cpp[-1].rglob("*")) if p.is_file()
            for line in p.read_text(errors="replace").splitlines() if line.strip()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    out["CPython stdlib"] = [
        line for p in sorted(stdlib.rglob("*.py")) if not skip & set(p.relative_to(stdlib).parts)
        for line in p.read_text(errors="replace").splitlines() if line.strip()]
    return out


def main() -> int:
    """Time the scrubber on each corpus and print the table."""
    print("| corpus | lines | seconds | lines/s | changed (per kind) |")
    print("|---|---|---|---|---|")
    for name, lines in corpora().items():
        changed = dict.fromkeys(KINDS, 0)
        start = time.perf_counter()
        for line in lines:
            if maybe_pii(line):
                scrubber = Scrubber(set(KINDS))
                if scrubber.text(line) != line:
                    for kind, count in scrubber.counts.items():
                        changed[kind] += count > 0
        seconds = time.perf_counter() - start
        kinds = ", ".join(f"{k} {v}" for k, v in changed.items() if v) or "none"
        print(f"| {name} | {len(lines)} | {seconds:.2f} | {len(lines) / seconds:,.0f} | "
              f"{sum(changed.values())} ({100 * sum(changed.values()) / len(lines):.3f} %: "
              f"{kinds}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
