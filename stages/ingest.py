"""Ingest: new traces from the inbox into a normalized, deduplicated, scrubbed Parquet dataset.

Reads `data/inbox/*.jsonl` (OpenAI chat JSONL; raw files are never modified) and the dataset of
earlier cycles in `data/traces/` (a persistent DVC output: one Parquet part per inbox file plus a
manifest). Writes the new part(s), `data/ingested.parquet` (this cycle's new traces, in the schema
of `stages/traces.py`), `data/quarantine/ingest.jsonl` (lines that are not traces, with file, line
and reason) and `metrics/ingest.json`. Every line read ends up accepted, quarantined or counted as
a duplicate (of a line in this batch or of a trace ingested in an earlier cycle), and the counts add
up. A file ingested in an earlier cycle is not read again.

Idempotent: each part records the inbox snapshot it was ingested from, so a stage killed midway and
run again produces the same outputs.

    python -m stages.ingest data/inbox data/traces data/ingested.parquet data/quarantine/ingest.jsonl metrics/ingest.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import io
from stages.traces import SCHEMA, BadRecord, parse_openai_chat

MANIFEST = "manifest.json"


def inbox_files(inbox: Path) -> list[Path]:
    return sorted(p for p in inbox.iterdir() if p.is_file() and p.suffix == ".jsonl")


def inbox_key(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def run(config: cfg.Ingest, inbox: Path, traces: Path, ingested: Path, quarantine: Path) -> dict:
    """Ingest the inbox files not yet in `traces`; returns the stage metrics."""
    if not inbox.is_dir():
        raise FileNotFoundError(f"{inbox}: inbox folder not found; put trace files there "
                                f"(or run `offseason simulate`)")
    files = inbox_files(inbox)
    key = inbox_key(files)
    traces.mkdir(parents=True, exist_ok=True)
    manifest_path = traces / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    # Parts from earlier cycles are history: their hashes are the duplicate set. Parts written from
    # this same inbox snapshot (a killed run) are recomputed, which gives the same result.
    earlier = {name: entry for name, entry in manifest.items() if entry["inbox_key"] != key}
    seen = set()
    for name in earlier:
        seen.update(pq.read_table(traces / earlier[name]["part"], columns=["content_hash"])
                    .column("content_hash").to_pylist())

    totals = {"rows_read": 0, "accepted": 0, "quarantined": 0, "duplicates": 0}
    redactions = {"email": 0}
    bad_rows, new_tables, per_file = [], [], {}
    for path in files:
        if path.name in earlier:
            continue
        rows, counts = [], {"rows_read": 0, "accepted": 0, "quarantined": 0, "duplicates": 0}
        with path.open(encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                counts["rows_read"] += 1
                try:
                    row, found = parse_openai_chat(line, path.name, number, config.scrub_emails)
                    if row["n_messages"] > config.max_messages:
                        raise BadRecord(f"{row['n_messages']} messages, more than "
                                        f"ingest.max_messages={config.max_messages}")
                except BadRecord as err:
                    counts["quarantined"] += 1
                    bad_rows.append({"source_file": path.name, "source_line": number,
                                     "stage": "ingest", "reason": str(err),
                                     "raw": line.strip()[:2000]})
                    continue
                if row["content_hash"] in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(row["content_hash"])
                for kind, n in found.items():
                    redactions[kind] += n
                counts["accepted"] += 1
                rows.append(row)
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        part = f"part-{path.stem}.parquet"
        io.write_parquet(traces / part, table)
        manifest[path.name] = {"part": part, "inbox_key": key, **counts}
        new_tables.append(table)
        per_file[path.name] = counts
        for name, value in counts.items():
            totals[name] += value
    io.write_json(manifest_path, manifest)  # last: the parts it names are whole

    table = pa.concat_tables(new_tables) if new_tables else SCHEMA.empty_table()
    io.write_parquet(ingested, table)
    io.write_jsonl(quarantine, bad_rows)
    assert totals["rows_read"] == totals["accepted"] + totals["quarantined"] + totals["duplicates"]
    return {**totals, "new_files": len(per_file), "files_seen_before": len(earlier),
            "per_format": {"openai-chat": totals},
            "pii_redactions": redactions, "total_traces": sum(
                e["accepted"] for e in manifest.values())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("inbox", "traces", "ingested", "quarantine", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("ingest", args.params), args.inbox, args.traces, args.ingested,
                  args.quarantine)
    io.write_json(args.metrics, metrics)
    print(f"ingest: {metrics['rows_read']} lines read from {metrics['new_files']} new file(s): "
          f"{metrics['accepted']} accepted, {metrics['quarantined']} quarantined, "
          f"{metrics['duplicates']} duplicates; {metrics['pii_redactions']['email']} e-mail "
          f"address(es) scrubbed", file=sys.stderr)


if __name__ == "__main__":
    main()
