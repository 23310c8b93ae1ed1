"""The PII scrubber: lines/s and the share of lines it changes, beside an older revision and peers.

    .venv/bin/python benchmarks/scrub.py                      # this tree, on clean code
    .venv/bin/python benchmarks/scrub.py --before 263c968     # and that revision's pii.py
    /tmp/peers-venv/bin/python benchmarks/scrub.py --before 263c968 --peers   # and the peers

Corpora: the C++ standard library headers the compiler ships (/usr/include/c++/<newest>),
CPython's standard library (its test suites and site-packages left out), a code sample (every
50th line of those two), and the peers' cases (every line of tests/fixtures/pii/*.jsonl:
secrets, e-mail addresses, phone and card numbers, IP addresses); the last two together are the
mixed corpus, half code, half what a scrubber is for. Every non-blank line is
scrubbed as ingest does (`stages.traces.pii`: the cheap `maybe_pii` gate, then the patterns of
every kind), one `Scrubber` per line; the best of `--repeat` runs is kept. Reading the files is
not timed.

`--before REV` adds the scrubber as it was at REV (its pii.py read with `git show`). `--peers`
adds, on the mixed corpus only (the code sample and the cases), Microsoft Presidio's four pattern recognizers for the kinds
offseason scrubs (email, credit card, IP, phone: `analyze` of each on each line, detection only,
no NLP engine: no spaCy model is installed) and Yelp detect-secrets' `scan_line` with its default
plugins. The peers are no dependency of offseason: install them in a separate environment
(`python -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install presidio-analyzer
detect-secrets`) and run this script with its interpreter. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.traces import pii  # noqa: E402


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
    cases = [json.loads(line)["text"] for p in sorted((ROOT / "tests/fixtures/pii").glob("*.jsonl"))
             for line in p.open()]
    out["code sample"] = [line for lines in list(out.values()) for line in lines[::50]]
    out["the peers' cases"] = [line for text in cases for line in text.splitlines() if line.strip()]
    return out


def revision(rev: str) -> types.ModuleType:
    """stages/traces/pii.py as it was at `rev`, as a module."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:stages/traces/pii.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(f"pii_{rev}")
    exec(compile(source, f"{rev}:stages/traces/pii.py", "exec"), module.__dict__)
    return module


def offseason(module: types.ModuleType):
    """A function scrubbing one line with `module` as ingest does: (changed, kinds found)."""
    kinds = set(module.KINDS)

    def scrub(line: str) -> tuple[bool, set[str]]:
        if not module.maybe_pii(line):
            return False, set()
        scrubber = module.Scrubber(kinds)
        changed = scrubber.text(line) != line
        return changed, {k for k, n in scrubber.counts.items() if n} if changed else set()
    return scrub


def presidio():
    """Presidio's email, credit card, IP and phone recognizers on one line."""
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EmailRecognizer,
        IpRecognizer,
        PhoneRecognizer,
    )
    recognizers = [EmailRecognizer(), CreditCardRecognizer(), IpRecognizer(), PhoneRecognizer()]
    names = {"EMAIL_ADDRESS": "email", "CREDIT_CARD": "card", "IP_ADDRESS": "ip", "PHONE_NUMBER": "phone"}

    def scrub(line: str) -> tuple[bool, set[str]]:
        found = {names[r.entity_type] for rec in recognizers
                 for r in rec.analyze(line, rec.supported_entities, None)}
        return bool(found), found
    scrub("warm up: a@example.com")  # its e-mail check loads the public suffix list once
    return scrub


def detect_secrets():
    """detect-secrets' default plugins on one line."""
    from detect_secrets.core.scan import scan_line
    from detect_secrets.settings import default_settings

    def scrub(line: str) -> tuple[bool, set[str]]:
        with default_settings():
            found = list(scan_line(line))
        return bool(found), {"secret"} if found else set()
    return scrub


def measure(scrub, lines: list[str], repeat: int) -> tuple[float, int, dict[str, int]]:
    """(best seconds over `repeat` runs, lines changed, lines changed per kind)."""
    best = float("inf")
    for _ in range(repeat):
        changed, kinds = 0, {}
        start = time.perf_counter()
        for line in lines:
            hit, found = scrub(line)
            changed += hit
            for kind in found:
                kinds[kind] = kinds.get(kind, 0) + 1
        best = min(best, time.perf_counter() - start)
    return best, changed, kinds


def main(argv: list[str] | None = None) -> int:
    """Time each scrubber on each corpus and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", metavar="REV", help="also the scrubber at this git revision")
    parser.add_argument("--peers", action="store_true",
                        help="also Presidio and detect-secrets on the mixed corpus (installed apart)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per scrubber and corpus (best kept)")
    args = parser.parse_args(argv)
    scrubbers = {"offseason (this tree)": offseason(pii)}
    if args.before:
        scrubbers[f"offseason at {args.before}"] = offseason(revision(args.before))
    peers = {}
    if args.peers:
        from importlib.metadata import version
        peers[f"Presidio {version('presidio-analyzer')}, 4 pattern recognizers"] = presidio()
        peers[f"detect-secrets {version('detect-secrets')}, default plugins"] = detect_secrets()
    print("| scrubber | corpus | lines | seconds | lines/s | lines changed (per kind) |")
    print("|---|---|---|---|---|---|")
    rates, timed = {}, {}
    for corpus, lines in corpora().items():
        mixed = corpus in ("code sample", "the peers' cases")
        todo = {**scrubbers, **(peers if mixed else {})}
        for name, scrub in todo.items():
            seconds, changed, kinds = measure(scrub, lines, 1 if name in peers else args.repeat)
            rates[name, corpus] = len(lines) / seconds
            timed[name, corpus] = (len(lines), seconds)
            per_kind = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"
            print(f"| {name} | {corpus} | {len(lines):,} | {seconds:.2f} | {len(lines) / seconds:,.0f} | "
                  f"{changed:,} ({100 * changed / len(lines):.3f} %: {per_kind}) |")
    print()
    for name in {**scrubbers, **peers}:  # the mixed corpus: code sample and cases together
        parts = [timed[name, corpus] for corpus in ("code sample", "the peers' cases")]
        rates[name, "mixed"] = sum(n for n, _ in parts) / sum(t for _, t in parts)
        print(f"{name}, mixed: {rates[name, 'mixed']:,.0f} lines/s  ")
    for name in peers:
        for corpus in ("code sample", "the peers' cases", "mixed"):
            print(f"offseason (this tree) / {name}, {corpus}: "
                  f"{rates['offseason (this tree)', corpus] / rates[name, corpus]:,.0f}x  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
