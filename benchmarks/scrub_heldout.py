"""The scrubber's hits and misses on the peers' cases and on clean code, through the ingest stage,
on the part its rules were tuned on and on the part held out from tuning (issue 54).

    .venv/bin/python benchmarks/scrub_heldout.py                    # the table, both parts
    .venv/bin/python benchmarks/scrub_heldout.py --part tuning --misses tuning   # while tuning

Cases: tests/fixtures/pii/*.jsonl, the test cases gitleaks, Presidio and detect-secrets publish,
each marked `part: tuning` or `held-out` by extract.py beside them (by rule file, plugin test and
list, or the value a Presidio case holds: never a copy of one case on both sides; the README
there says how). Rules are changed looking at the tuning part only; of the held-out part only the
aggregates below are read (`--misses` refuses it).

What counts is what ingest keeps. Each distinct text becomes one trace (an openai-chat line, the
text as the user's message) in an inbox that `stages.ingest.run` ingests: once with no kind of
scrubbing switched on (the reference: the text as ingest keeps it), once with every kind (the
positives), and once per kind alone (the negatives of that kind: an IP address in a gitleaks fp is
an address, not a false secret). A positive passes when none of its expected text is left where
it was: no 4 consecutive characters (all of it, if shorter) of the secret the peer names (gitleaks'
`secretGroup`, detect-secrets' reported value, Presidio's span) survive in place, the kept text
read as the reference with placeholders put in. A negative passes when its text comes back as
the reference. Every negative counts, none left out.

Clean code: every non-blank line of the C++ headers g++ ships (/usr/include/c++/<newest>) and of
CPython's standard library (its tests and site-packages left out), scrubbed as ingest scrubs each
string of a trace (`Scrubber.walk`), one scrubber a line; a file is held out when the CRC32 of its
path (below the corpus's root) is 0 modulo 3.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import sysconfig
import tempfile
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import config as cfg  # noqa: E402
from stages import ingest  # noqa: E402
from stages.traces.pii import KINDS, Scrubber  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "pii"
PARTS = ("tuning", "held-out")
SURVIVING_RUN = 4  # this many consecutive characters of a secret left in place: it survived

# The providers whose keys stages/traces/pii.py looks for by their own format (its `_TOKENS` and
# `MARKED` as of issue 24, commit ca7c171): a gitleaks rule or detect-secrets plugin whose id
# begins with one of these is "named", the others are found by context (a secret's name, its
# shape and entropy) or not at all.
NAMED = ("anthropic", "openai", "aws", "github", "gitlab", "slack", "gcp", "google", "stripe",
         "huggingface", "npm", "pypi", "sendgrid", "sendinblue", "dockerhub", "docker", "artifactory",
         "1password", "onepassword", "adobe", "age-secret", "airtable", "alibaba", "authress",
         "clickhouse", "clojars", "cloudflare-origin", "databricks", "digitalocean", "doppler",
         "duffel", "dynatrace", "facebook", "flutterwave", "flyio", "frameio", "freemius", "harness",
         "heroku", "infracost", "intra42", "grafana", "linear", "notion", "octopus", "openshift",
         "perplexity", "planetscale", "postman", "prefect", "pulumi", "readme", "rubygems",
         "scalingo", "sentry", "settlemint", "shippo", "shopify", "sourcegraph", "square", "twilio",
         "vault", "hashicorp", "yandex", "jwt", "private-key", "private_key", "putty",
         "microsoft-teams", "discord", "zapier", "azure", "terraform", "maxmind", "telegram",
         "curl", "basic_auth", "brevo")

# (row, goal, how the figure compares: a share that must be at least, or at most, the goal)
ROWS = (("IP addresses (Presidio) scrubbed", 0.98, ">="),
        ("phone numbers (Presidio) scrubbed", 0.98, ">="),
        ("e-mail, card numbers (Presidio) scrubbed", 0.98, ">="),
        ("gitleaks true positives, named providers", 0.95, ">="),
        ("gitleaks true positives, other providers", 0.95, ">="),
        ("gitleaks false positives left unchanged", 0.95, ">="),
        ("detect-secrets true positives, named providers", 0.80, ">="),
        ("detect-secrets true positives, others", 0.80, ">="),
        ("detect-secrets false positives (secrets) left unchanged", 0.95, ">="),
        ("detect-secrets ip_public negatives left unchanged", None, ">="),
        ("clean C++ lines changed", 0.001, "<="),
        ("clean Python lines changed", 0.001, "<="))


def load() -> list[dict]:
    """Every case of the three fixtures."""
    return [json.loads(line) for name in ("gitleaks", "presidio", "detect_secrets")
            for line in (FIXTURES / f"{name}.jsonl").open()]


def named(case: dict) -> bool:
    """True if the case's rule or plugin is a provider's that pii.py names (`NAMED`)."""
    return case["rule"].lower().startswith(NAMED)


def row(case: dict) -> str | None:
    """The row of the table a case counts in (None: Presidio's negatives, and its weak spans)."""
    source, kind, positive = case["source"], case["kind"], case["positive"]
    if source == "presidio":
        if not positive or case.get("weak"):
            return None
        return {"ip": ROWS[0][0], "phone": ROWS[1][0]}.get(kind, ROWS[2][0])
    if source == "gitleaks":
        return ROWS[5][0] if not positive else ROWS[3][0] if named(case) else ROWS[4][0]
    if kind == "ip":
        return ROWS[9][0] if not positive else None
    return ROWS[8][0] if not positive else ROWS[6][0] if named(case) else ROWS[7][0]


def ingested(texts: list[str], kinds: set[str]) -> dict[str, str | None]:
    """{text: the user's message as ingest keeps it with `kinds` scrubbed} (None: quarantined).
    Each trace's answer is its number: two texts that scrub alike are no duplicates of each other.
    """
    config = cfg.Ingest(**{f"scrub_{kind}s": kind in kinds for kind in KINDS})
    with tempfile.TemporaryDirectory(prefix="scrub-heldout-") as folder:
        work = Path(folder)
        (work / "inbox").mkdir()
        with (work / "inbox" / "cases.jsonl").open("w") as out:
            for i, text in enumerate(texts):
                out.write(json.dumps({"id": f"case{i}", "messages": [
                    {"role": "user", "content": text}, {"role": "assistant", "content": f"case {i}"}]}) + "\n")
        ingest.run(config, work / "inbox", work / "traces", work / "ingested.parquet", work / "q.jsonl")
        import pyarrow.parquet as pq

        rows = pq.read_table(work / "ingested.parquet", columns=["trace_id", "messages"]).to_pylist()
    kept = {row["trace_id"]: json.loads(row["messages"])[0]["content"] for row in rows}
    return {text: kept.get(f"case{i}") for i, text in enumerate(texts)}


_PLACEHOLDER = re.compile(r"<(?:SECRET|EMAIL|CARD|IP|PHONE)_\d+>")


def _kept_mask(reference: str, kept: str) -> list[bool] | None:
    """For each character of the reference, whether it is still in the kept text: the kept text
    read as the reference with some pieces replaced by placeholders (None: it is not that, e.g.
    JSON escapes were undone before scrubbing).
    """
    pieces = _PLACEHOLDER.split(kept)
    if len(pieces) == 1:
        return [True] * len(reference) if kept == reference else None
    pattern = "(.+?)".join(map(re.escape, pieces))
    match = re.fullmatch(pattern, reference, re.S)
    if match is None:
        return None
    mask = [True] * len(reference)
    for group in range(1, len(pieces)):
        mask[match.start(group):match.end(group)] = [False] * (match.end(group) - match.start(group))
    return mask


def survives(secret: str, reference: str, kept: str) -> bool:
    """True if SURVIVING_RUN consecutive characters of the secret (all of it, if shorter) are
    left in place in the kept text.
    """
    need = min(SURVIVING_RUN, len(secret))
    mask = _kept_mask(reference, kept)
    starts = [m.start() for m in re.finditer(re.escape(secret), reference)]
    if mask is None or not starts:  # read by the text alone
        bare = _PLACEHOLDER.sub("\0", kept)
        return any(secret[i:i + need] in bare for i in range(len(secret) - need + 1))
    for start in starts:
        run = 0
        for kept_char in mask[start:start + len(secret)]:
            run = run + 1 if kept_char else 0
            if run >= need:
                return True
    return False


def judge(cases: list[dict]) -> list[tuple[dict, bool]]:
    """(case, passed) for every case that counts in a row, scrubbed through ingest."""
    counted = [c for c in cases if row(c)]
    texts = sorted({c["text"] for c in counted})
    reference = ingested(texts, set())
    runs = {"all": ingested(sorted({c["text"] for c in counted if c["positive"]}), set(KINDS))}
    for kind in sorted({c["kind"] for c in counted if not c["positive"]}):
        runs[kind] = ingested(sorted({c["text"] for c in counted
                                      if not c["positive"] and c["kind"] == kind}), {kind})
    out = []
    for case in counted:
        ref = reference[case["text"]]
        if case["positive"]:
            kept = runs["all"][case["text"]]
            secret = case.get("span") or case.get("secret")
            if kept is None or ref is None:
                passed = False  # quarantined: counted as a miss (the case was not read)
            elif secret:
                passed = not survives(secret, ref, kept)
            else:  # the peer names no secret (2 cases): a placeholder of its kind must appear
                passed = f"<{case['kind'].upper()}_" in kept
        else:
            kept = runs[case["kind"]][case["text"]]
            passed = kept == ref
        out.append((case, passed))
    return out


def code_files() -> dict[str, list[tuple[str, Path]]]:
    """{"C++" / "Python": [(path below its root, path)]}: the clean code corpora."""
    out = {}
    cpp = sorted(Path("/usr/include/c++").glob("*"))
    if cpp:
        out["C++"] = [(str(p.relative_to(cpp[-1])), p) for p in sorted(cpp[-1].rglob("*")) if p.is_file()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    out["Python"] = [(str(p.relative_to(stdlib)), p) for p in sorted(stdlib.rglob("*.py"))
                     if not skip & set(p.relative_to(stdlib).parts)]
    return out


def code_part(relative: str) -> str:
    """The part a clean code file is in, by the CRC32 of its path below the corpus's root."""
    return "held-out" if zlib.crc32(relative.encode()) % 3 == 0 else "tuning"


def code_changes(part: str) -> dict[str, tuple[int, int, list[str]]]:
    """{"C++" / "Python": (lines changed, lines, the changed lines)} of one part's files."""
    out = {}
    for corpus, files in code_files().items():
        changed, total, lines = 0, 0, []
        for relative, path in files:
            if code_part(relative) != part:
                continue
            for line in path.read_text(errors="replace").splitlines():
                if not line.strip():
                    continue
                total += 1
                if Scrubber(set(KINDS)).walk(line) != line:
                    changed += 1
                    lines.append(f"{relative}: {line.strip()[:120]}")
        out[corpus] = (changed, total, lines)
    return out


def table(part: str, cases: list[dict] | None = None, code: bool = True) -> dict[str, tuple[int, int]]:
    """{row: (passed or changed, total)} for one part."""
    cases = [c for c in (cases if cases is not None else load()) if c["part"] == part]
    passed, total = Counter(), Counter()
    for case, ok in judge(cases):
        total[row(case)] += 1
        passed[row(case)] += ok
    out = {name: (passed[name], total[name]) for name, _, _ in ROWS if total[name]}
    if code:
        for corpus, (changed, lines, _) in code_changes(part).items():
            out[f"clean {corpus} lines changed"] = (changed, lines)
    return out


def meets(name: str, figure: tuple[int, int]) -> bool | None:
    """Whether the row's figure meets its goal (None: no goal)."""
    goal, sense = next((g, s) for n, g, s in ROWS if n == name)
    if goal is None:
        return None
    share = figure[0] / figure[1]
    return share >= goal if sense == ">=" else share <= goal


def markdown(tables: dict[str, dict[str, tuple[int, int]]]) -> str:
    """The tables of the parts side by side, one row per figure, with its goal."""
    lines = ["| kind | " + " | ".join(tables) + " | goal |", "|---|" + "---|" * len(tables) + "---|"]
    for name, goal, sense in ROWS:
        cells = []
        for figures in tables.values():
            if name not in figures:
                cells.append("-")
                continue
            k, n = figures[name]
            digits = 3 if name.startswith("clean") else 1
            mark = {True: "", False: " (short)", None: ""}[meets(name, (k, n))]
            cells.append(f"{100 * k / n:.{digits}f} % ({k:,} / {n:,}){mark}")
        target = "-" if goal is None else f"{sense.replace('>=', '≥').replace('<=', '≤')} {100 * goal:g} %"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table for both parts (and the tuning part's misses, if asked)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--misses", choices=["tuning"],
                        help="also list the misses of this part, case by case (never the held-out part)")
    parser.add_argument("--part", choices=PARTS, action="append",
                        help="only this part's table (default: both)")
    parser.add_argument("--no-code", action="store_true", help="leave the clean code corpora out")
    args = parser.parse_args(argv)
    cases = load()
    tables = {part: table(part, cases, code=not args.no_code) for part in args.part or PARTS}
    print(markdown(tables))
    if args.misses:
        for case, ok in judge([c for c in cases if c["part"] == args.misses]):
            if not ok:
                print(f"miss: {row(case)} | {case['rule']} | {case['text'][:160]!r} | "
                      f"{(case.get('span') or case.get('secret') or '')[:60]!r}")
        if not args.no_code:
            for corpus, (_, _, lines) in code_changes(args.misses).items():
                for line in lines:
                    print(f"changed {corpus}: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
