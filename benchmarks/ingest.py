"""Ingest and validate throughput and peak memory on synthetic OpenAI chat traces.

    .venv/bin/python benchmarks/ingest.py --traces 1000000     # the issue's target: < 2 min, < 2 GB
    .venv/bin/python benchmarks/ingest.py --traces 8000 --files 8000   # one trace per inbox file

Writes N traces of six messages each (user, assistant tool call, tool, assistant, user, assistant;
about 600 bytes a line, some with an e-mail address or a phone number) to a temporary inbox, then
times, each in a fresh process so peak memory is its own: a plain `json.loads` loop over the file
(the baseline), the ingest stage, and the validate stage. Prints a Markdown table. `--files`
spreads the traces over that many inbox files (a Collector's file exporter rotating, or many
small exports): ingest writes a part per file.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_traces(path: Path, n: int) -> None:
    """Write `n` synthetic chat traces (a few with PII to scrub) to a JSONL file."""
    rng = random.Random(0)
    with path.open("w") as out:
        for i in range(n):
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            extra = " reply to ann.lee@example.com" if i % 50 == 0 else (
                " or call +1 415 555 0134" if i % 70 == 0 else "")
            out.write(json.dumps({"id": f"bench-{i:08d}", "model": "agent-v3",
                                  "created_at": "2026-11-30T12:00:00Z", "messages": [
                {"role": "user", "content": f"Hi! What is {a} * {b}? I need it for an invoice.{extra}"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{i}", "type": "function",
                    "function": {"name": "calculator",
                                 "arguments": json.dumps({"expression": f"{a}*{b}"})}}]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a * b)},
                {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
                {"role": "user", "content": "Thanks, and can you round it to hundreds?"},
                {"role": "assistant", "content": f"About {round(a * b, -2)}."}],
                "feedback": {"thumbs_up": i % 3 != 0}}) + "\n")


def timed(code: str) -> tuple[float, float]:
    """Seconds and peak RSS (MB) of a child Python running `code` (imports included)."""
    started = time.time()
    code += "\nimport resource\nprint('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode:
        raise SystemExit(f"benchmark step failed:\n{result.stderr[-3000:]}")
    out = result.stdout
    seconds = time.time() - started
    peak = int(out.rsplit("PEAK ", 1)[1]) / 1024
    return seconds, peak


def main() -> None:
    """Time the ingest stage on `--traces` synthetic traces and print the rate."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=1, help="inbox files to spread them over")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "inbox").mkdir()
        data = tmp / "inbox" / "traces.jsonl"
        write_traces(data, args.traces)
        size = data.stat().st_size / 1e6
        if args.files > 1:  # the same lines, dealt round the files
            lines = data.read_text().splitlines(keepends=True)
            data.unlink()
            for f in range(args.files):
                (tmp / "inbox" / f"traces-{f:06d}.jsonl").write_text("".join(lines[f::args.files]))
            data = tmp / "inbox" / "traces-*.jsonl"
        rows = []
        seconds, peak = timed(f"import glob, json\nfor name in sorted(glob.glob({str(data)!r})):\n"
                              f"    for line in open(name): json.loads(line)")
        rows.append(("plain json.loads loop (baseline)", seconds, peak))
        seconds, peak = timed(
            "from pathlib import Path\nfrom stages import ingest, config\n"
            f"t = Path({str(tmp)!r})\n"
            "m = ingest.run(config.Ingest(), t / 'inbox', t / 'traces', t / 'ingested.parquet', "
            "t / 'q.jsonl')\nassert m['accepted'] + m['duplicates'] + m['quarantined'] == "
            "m['rows_read']\nprint(m['accepted'], m['duplicates'], m['pii_redactions'])")
        rows.append(("ingest stage", seconds, peak))
        seconds, peak = timed(
            "from pathlib import Path\nfrom stages import validate, config\n"
            f"t = Path({str(tmp)!r})\n"
            "m = validate.run(config.Base(), config.Validate(), t / 'ingested.parquet', "
            "t / 'validated.parquet', t / 'qv.jsonl', t / 'profiles', t / 'docs')\nprint(m['accepted'], m['quarantined'])")
        rows.append(("validate stage (Great Expectations)", seconds, peak))
    print(f"\n{args.traces:,} traces in {args.files:,} file(s), {size:.0f} MB of JSONL\n")
    print("| step | seconds | traces/s | peak memory (MB) |")
    print("|---|---|---|---|")
    for name, seconds, peak in rows:
        print(f"| {name} | {seconds:.1f} | {args.traces / seconds:,.0f} | {peak:,.0f} |")


if __name__ == "__main__":
    main()
