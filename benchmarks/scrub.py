"""The PII scrubber: lines/s and the share of lines it changes, beside an older revision and peers.

    .venv/bin/python benchmarks/scrub.py                      # this tree, on clean code
    .venv/bin/python benchmarks/scrub.py --before 263c968     # and that revision's pii.py
    /tmp/peers-venv/bin/python benchmarks/scrub.py --before 263c968 --peers   # and the peers

Corpora: the C++ standard library headers the compiler ships (/usr/include/c++/<newest>),
CPython's standard library (its test suites and site-packages left out), a code sample (every
50th line of those two), agent traces (every string of the messages, tools and feedback that
ingest reads from Langfuse's 20 framework downloads in tests/fixtures/traces/langfuse_frameworks:
system prompts, tool schemas, questions, tool calls and results, answers) and the peers' cases
(every line of tests/fixtures/pii/*.jsonl: secrets, e-mail addresses, phone and card numbers, IP
addresses). The code sample and the cases together are the mixed corpus, half code, half what a
scrubber is for; "mixed with agent traces" adds the traces. Every non-blank line is scrubbed as
ingest does (`stages.traces.pii`: the cheap `maybe_pii` gate, then the patterns of every kind),
one `Scrubber` per line; the best of `--repeat` runs is kept, for every scrubber alike (until stop 31
the peers ran once: Presidio's later runs are up to 8 % faster than its first, which flattered
offseason's ratio). Reading the files is not timed.

`--before REV` adds the scrubber as it was at REV (its pii.py read with `git show`). `--peers`
adds, on the code sample, the agent traces and the cases: Microsoft Presidio as its README runs
it (`AnalyzerEngine().analyze(line, language="en")`, its default English recognizers, with a
blank spaCy pipeline as the NLP engine because spaCy's trained models are not on PyPI: no
named-entity model, so a lower bound on Presidio's cost), Presidio's four pattern recognizers for
the kinds offseason scrubs alone (email, credit card, IP, phone: `analyze` of each on each line,
the cheapest Presidio there is), and Yelp detect-secrets' `scan_line` with its default plugins.
The peers are no dependency of offseason: install them in a separate environment (`python -m
venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install presidio-analyzer detect-secrets
hyperscan`; spaCy comes with Presidio; `hyperscan` is offseason's own dependency, without which
its scrubber there would run its slower `re` path: the script says which it ran) and run this
script with its interpreter, which reads the agent traces through offseason's own .venv. Prints
a Markdown table.
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
    out["agent traces"] = agent_traces()
    out["the peers' cases"] = [line for text in cases for line in text.splitlines() if line.strip()]
    return out


def agent_traces() -> list[str]:
    """The lines ingest scrubs in real agent traces: Langfuse's downloads of one trace from each of
    20 frameworks' integration examples (tests/fixtures/traces/langfuse_frameworks, copied from
    langfuse/langfuse), read by ingest's own readers; every string of each trace's messages, tools
    and feedback (system prompts, tool schemas, questions, tool calls and results, answers).
    """
    try:
        from stages import config as cfg
        from stages import ingest
    except ImportError:  # the peers' environment lacks offseason's dependencies: read them there
        venv = ROOT / ".venv" / "bin" / "python"
        out = subprocess.run([str(venv), __file__, "--agent-traces"], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out)

    lines: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            lines.extend(line for line in value.splitlines() if line.strip())
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    folder = ROOT / "tests/fixtures/traces/langfuse_frameworks"
    for path in sorted(folder.glob("*.trace.json")):
        for _, _, trace in ingest.traces_of_file(path, cfg.Ingest()):
            if isinstance(trace, dict):  # the beeai download is quarantined: no messages
                walk({key: trace.get(key) for key in ("messages", "tools", "feedback")})
    return lines


# the corpora the peers run on, and the mixes of them whose rates are compared
MIXES = {"mixed": ("code sample", "the peers' cases"),
         "mixed with agent traces": ("code sample", "agent traces", "the peers' cases")}


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


def presidio_engine():
    """Presidio as its README runs it, `AnalyzerEngine().analyze(text, language="en")`: every
    recognizer of its default English registry (18: e-mail, phone, card, IP, URL, dates, IBAN,
    crypto wallets, US and UK ids ...), context words, spaCy's tokenizer; but a blank spaCy
    pipeline (`spacy.blank("en")`) for the NLP engine, because its statistical models are not on
    PyPI: no named-entity model runs, so this is a lower bound on what Presidio as deployed costs.
    """
    import tempfile

    import spacy
    from presidio_analyzer import AnalyzerEngine
    from presidio_analyzer.nlp_engine import SpacyNlpEngine

    with tempfile.TemporaryDirectory(prefix="spacy-blank-en-") as folder:  # loaded, then gone
        spacy.blank("en").to_disk(folder)
        engine = SpacyNlpEngine(models=[{"lang_code": "en", "model_name": folder}])
        analyzer = AnalyzerEngine(nlp_engine=engine, supported_languages=["en"])
    names = {"EMAIL_ADDRESS": "email", "CREDIT_CARD": "card", "IP_ADDRESS": "ip", "PHONE_NUMBER": "phone"}

    def scrub(line: str) -> tuple[bool, set[str]]:
        found = {names.get(r.entity_type, "other") for r in analyzer.analyze(line, language="en")}
        return bool(found), found
    scrub("warm up: a@example.com")
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
    parser.add_argument("--agent-traces", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agent_traces:  # for agent_traces() run from the peers' environment
        print(json.dumps(agent_traces()))
        return 0
    scrubbers = {"offseason (this tree)": offseason(pii)}
    if args.before:
        scrubbers[f"offseason at {args.before}"] = offseason(revision(args.before))
    peers = {}
    if args.peers:
        from importlib.metadata import version
        peers[f"Presidio {version('presidio-analyzer')}, AnalyzerEngine (no NER model)"] = \
            presidio_engine()
        peers[f"Presidio {version('presidio-analyzer')}, 4 pattern recognizers"] = presidio()
        peers[f"detect-secrets {version('detect-secrets')}, default plugins"] = detect_secrets()
    print("| scrubber | corpus | lines | seconds | lines/s | lines changed (per kind) |")
    print("|---|---|---|---|---|---|")
    rates, timed = {}, {}
    for corpus, lines in corpora().items():
        todo = {**scrubbers, **(peers if any(corpus in parts for parts in MIXES.values()) else {})}
        for name, scrub in todo.items():
            seconds, changed, kinds = measure(scrub, lines, args.repeat)
            rates[name, corpus] = len(lines) / seconds
            timed[name, corpus] = (len(lines), seconds)
            per_kind = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"
            print(f"| {name} | {corpus} | {len(lines):,} | {seconds:.2f} | {len(lines) / seconds:,.0f} | "
                  f"{changed:,} ({100 * changed / len(lines):.3f} %: {per_kind}) |")
    print()
    pii.maybe_pii("")  # (compiles the scan where it can be)
    print("offseason's cheap test (this tree): " + (
        "one Hyperscan scan" if pii._SCAN[0] else "the `re` searches (no `hyperscan` in this environment)") + "  ")
    for name in {**scrubbers, **peers}:
        for mix, parts in MIXES.items():
            counted = [timed[name, corpus] for corpus in parts]
            rates[name, mix] = sum(n for n, _ in counted) / sum(t for _, t in counted)
            print(f"{name}, {mix}: {rates[name, mix]:,.0f} lines/s  ")
    for name in peers:
        for corpus in (*MIXES["mixed with agent traces"], *MIXES):
            print(f"offseason (this tree) / {name}, {corpus}: "
                  f"{rates['offseason (this tree)', corpus] / rates[name, corpus]:,.0f}x  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
