"""Erasure at scale (issue 52): one person out of a million ingested traces, and what keeping the
index costs ingest.

    .venv/bin/python benchmarks/erase.py                        # 1,000,000 traces; 100,000 ingested
    .venv/bin/python benchmarks/erase.py --traces 100000 --ingest-traces 20000 --rounds 1

**Erase one person.** Builds, directly with pyarrow (no ingest run: a million traces take ingest
minutes), what a workspace holds after ingesting `--traces` traces from `--files` inbox files of
`--users` users: `data/traces/` with a part (trace_id, source_file, source_line, user_text,
messages: about 600 bytes a trace) and an erasure index (a row per user, session and trace, salted,
as stages/ingest.py writes it) per inbox file, and `data/ingested.parquet` holding every trace (the
largest file an erasure rewrites). Then, in a fresh process whose peak memory is its own, the steps
of `offseason erase --user` that grow with the data (flows/orchestration/erase.py): the index lookup
(`lookup` + `widen`) and the rewrite of every file holding the person's rows (`rewrite_traces`,
`rewrite_data`). Not timed: `dvc commit`/`push`, git and MLflow, which hash or copy the rewritten
files as a cycle's commit does.

**The index's cost per cycle.** Ingest (stages/ingest.py `run`) of `--ingest-traces` synthetic chat
traces with a user and a session each, with the erasure salt (the index kept) and without (none),
each in a fresh process, alternated, best of `--rounds`. Prints Markdown tables.
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
sys.path.insert(0, str(ROOT))

PERSON = "u-bench-person"


def build_workspace(root: Path, traces: int, files: int, users: int) -> int:
    """data/traces/ (parts and index parts) and data/ingested.parquet for `traces` traces; the
    person's traces: one in every tenth file. Returns how many the person has.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages import erasure

    key = erasure.salt(root)
    folder = root / "data" / "traces"
    folder.mkdir(parents=True)
    rng = random.Random(0)
    per_file = traces // files
    filler = "Thanks, and can you round it to hundreds? " * 8
    ingested = pq.ParquetWriter(root / "data" / "ingested.parquet", pa.schema([
        ("trace_id", pa.string()), ("source_file", pa.string()), ("source_line", pa.int64()),
        ("user_text", pa.string()), ("messages", pa.string())]))
    mine = 0
    for f in range(files):
        name = f"traffic-{f:04d}.jsonl"
        ids, lines, texts, messages, index = [], [], [], [], []
        for line in range(1, per_file + 1):
            trace_id = f"bench-{f:04d}-{line:06d}"
            user = PERSON if (f % 10 == 0 and line == 1) else f"u-{rng.randrange(users):07d}"
            mine += user == PERSON
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            text = f"Hi! What is {a} * {b}? I need it for an invoice."
            ids.append(trace_id)
            lines.append(line)
            texts.append(text)
            messages.append(json.dumps([{"role": "user", "content": text},
                                        {"role": "assistant", "content": f"{a * b}. {filler}"}]))
            for kind, value in (("user", user), ("session", f"s-{user}-{f}"),
                                ("trace", trace_id)):
                index.append((erasure.digest(key, kind, value), kind, trace_id))
        table = pa.table({"trace_id": ids, "source_file": [name] * per_file,
                          "source_line": lines, "user_text": texts, "messages": messages})
        pq.write_table(table, folder / f"part-{name}.parquet")
        ingested.write_table(table)
        subjects, kinds, traces_of = zip(*index)
        pq.write_table(pa.table({  # as ingest writes it: sorted, small row groups
            "subject": list(subjects), "kind": list(kinds), "trace_id": list(traces_of),
            "content_hash": [None] * len(index), "source_file": [name] * len(index),
            "source_line": [lines[i // 3] for i in range(len(index))],
            "format": ["openai-chat"] * len(index), "status": ["accepted"] * len(index)},
            schema=erasure.INDEX).sort_by("subject"),
            folder / f"{erasure.INDEX_PREFIX}{name}.parquet", row_group_size=erasure.INDEX_ROW_GROUP)
    ingested.close()
    return mine


ERASE = """
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import pyarrow.dataset  # (imported by lookup on first use: not the lookup's time)
from flows.orchestration import erase
from stages import erasure
root = Path({work!r})
key = erasure.salt(root)
started = time.perf_counter()
found = erase.widen(root, key, erase.lookup(root, erasure.digest(key, "user", {person!r})))
found_s = time.perf_counter() - started
removed = erase.rewrite_traces(root, found, {{}})
removed.update(erase.rewrite_data(root, found))
total_s = time.perf_counter() - started
print(json.dumps({{"traces": len(found.traces), "lookup_s": found_s, "total_s": total_s,
                  "removed": removed,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def erase_one(traces: int, files: int, users: int) -> dict:
    """Build the workspace, then erase the person in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        mine = build_workspace(work, traces, files, users)
        built = time.perf_counter() - started
        size = sum(p.stat().st_size for p in (work / "data").rglob("*.parquet")) / 2 ** 20
        out = subprocess.run([sys.executable, "-c", ERASE.format(
            root=str(ROOT), work=str(work), person=PERSON)], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["traces"] == mine, (result["traces"], mine)
        return {**result, "mine": mine, "built_s": built, "data_mb": size}


def write_inbox(inbox: Path, n: int, files: int) -> None:
    """`n` chat traces with a user and a session each, over `files` inbox files."""
    rng = random.Random(0)
    inbox.mkdir(parents=True)
    per = n // files
    for f in range(files):
        with (inbox / f"traffic-{f:03d}.jsonl").open("w") as out:
            for i in range(f * per, (f + 1) * per):
                a, b = rng.randint(1, 999), rng.randint(1, 999)
                user = f"u-{rng.randrange(n // 10):07d}"
                out.write(json.dumps({
                    "id": f"bench-{i:08d}", "user": user, "session_id": f"s-{user}-{i % 7}",
                    "model": "agent-v3", "created_at": "2026-11-30T12:00:00Z", "messages": [
                        {"role": "user", "content": f"Hi! What is {a} * {b}? For an invoice."},
                        {"role": "assistant", "content": f"{a} times {b} is {a * b}."}],
                    "feedback": {"thumbs_up": i % 3 != 0}}) + "\n")


INGEST = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from stages import config as cfg, ingest
out = Path({out!r})
started, cpu = time.perf_counter(), time.process_time()
metrics = ingest.run(cfg.Ingest(), Path({inbox!r}), out / "traces", out / "ingested.parquet",
                     out / "quarantine.jsonl", {key})
print(json.dumps({{"seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu,
                  "accepted": metrics["accepted"]}}))
"""


def ingest_cost(n: int, files: int, rounds: int) -> dict:
    """Best ingest seconds (wall, and CPU: steadier on a shared host) with the index kept and
    without, alternated in fresh processes.
    """
    best = {f"{label} {what}": float("inf") for label in ("with index", "without")
            for what in ("wall", "cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        inbox = Path(tmp) / "inbox"
        write_inbox(inbox, n, files)
        for r in range(rounds):
            for label, key in (("without", "None"), ("with index", "b'bench-salt'")):
                out = Path(tmp) / f"out-{label.replace(' ', '-')}-{r}"
                result = subprocess.run([sys.executable, "-c", INGEST.format(
                    root=str(ROOT), out=str(out), inbox=str(inbox), key=key)],
                    capture_output=True, text=True)
                if result.returncode:
                    raise SystemExit(result.stderr[-3000:])
                took = json.loads(result.stdout.strip().splitlines()[-1])
                best[f"{label} wall"] = min(best[f"{label} wall"], took["seconds"])
                best[f"{label} cpu"] = min(best[f"{label} cpu"], took["cpu"])
    return best


def main() -> None:
    """Both measurements, as Markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--ingest-traces", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-ingest", action="store_true")
    args = parser.parse_args()

    one = erase_one(args.traces, args.files, args.users)
    print(f"| traces | files | parquet under data/ | the person's traces | index lookup | "
          f"lookup + rewrite | peak memory |\n|---|---|---|---|---|---|---|\n"
          f"| {args.traces:,} | {args.files} | {one['data_mb']:.0f} MB | {one['traces']} | "
          f"{one['lookup_s']:.2f} s | {one['total_s']:.1f} s | {one['peak_mb']:.0f} MB |")
    print(f"(built in {one['built_s']:.0f} s; files rewritten: {len(one['removed'])})\n")
    if args.skip_ingest:
        return
    cost = ingest_cost(args.ingest_traces, 10, args.rounds)
    print(f"| ingest of {args.ingest_traces:,} traces, best of {args.rounds} | without the index "
          f"| with it | cost |\n|---|---|---|---|")
    for what in ("wall", "cpu"):
        without, with_index = cost[f"without {what}"], cost[f"with index {what}"]
        print(f"| {what} seconds | {without:.2f} | {with_index:.2f} | "
              f"{with_index / without - 1:+.1%} |")


if __name__ == "__main__":
    main()
