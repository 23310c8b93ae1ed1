"""Ingest: new traces from the inbox into a normalized, deduplicated, scrubbed Parquet dataset.

Reads every file in `data/inbox/` (plain or gzip, never modified), detects its format (openai-chat,
openai-responses, openinference, otel-genai, langfuse, langsmith: a reader each in
`stages/traces/sources/`), maps each trace onto `stages/traces/schema.py`, scrubs PII and secrets
(`stages/traces/pii.py`) and drops duplicates by content hash. Writes `data/traces/` (a persistent
output: the history duplicates are checked against), `data/ingested.parquet` (this cycle's new
traces), `data/quarantine/ingest.jsonl` (every unreadable row, with where, what and the fix) and
`metrics/ingest.json`. Idempotent: a stage killed midway and run again gives the same outputs.

    python -m stages.ingest data/inbox data/traces data/ingested.parquet data/quarantine/ingest.jsonl metrics/ingest.json

Details: docs/traces.md, "How the ingest stage works (stages/ingest.py)".
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stages import config as cfg
from stages import erasure, io
from stages.traces.pii import KINDS, Scrubber, excerpt
from stages.traces.schema import (
    CAPTURE,
    READER_ERRORS,
    SCHEMA,
    BadRecord,
    NoContent,
    feedback_problem,
    make_row,
)
from stages.traces.sources import (
    langfuse,
    langsmith,
    openai_chat,
    openai_responses,
    openinference,
    otel_genai,
    otlp,
)

MANIFEST = "manifest.json"
FEEDBACK_SHAPE = ('A rating is {"thumbs_up": true or false}, or {"scores": {"<name>": a number in '
                  '[0, 1] or a boolean}} with reward.feedback_score naming the score (docs/traces.md, '
                  '"Traces in")')
# a file's duplicates beside its part (`duplicates-<file>.parquet`): each row's id and place, and
# the id of the trace it repeats, so `offseason lineage --trace` can follow a duplicate's id; and
# its user's rating (scrubbed JSON, as the part keeps it), which the kept trace does not carry
DUPLICATES = pa.schema([("trace_id", pa.string()), ("source_file", pa.string()),
                        ("source_line", pa.int64()), ("duplicate_of", pa.string()),
                        ("feedback", pa.string())])
BATCH = 5000
# Deeper JSON than any trace format nests is junk, and would overflow recursive code downstream.
MAX_DEPTH = 100
DETECT_WITHIN = 100  # records looked at for one a format recognizes, before "unknown format"
# Detection order matters: OpenInference exports are OTLP too, but carry its span kinds.
LINE_FORMATS = {m.NAME: m for m in (openai_chat, openai_responses)}
TRACE_FORMATS = {m.NAME: m for m in (openinference, otel_genai, langfuse, langsmith)}
FORMATS = [openai_chat, openai_responses, openinference, otel_genai, langfuse, langsmith]


# what to change for a line that is no JSON value, by how it failed
_REEXPORT = "re-export the file whole from its source (a line cut short, or two run together)"


class Unreadable:
    """A line that is not a JSON value; `reason` says why, `fix` what to change."""

    def __init__(self, reason: str, raw: str, parsed: bool = False, fix: str = _REEXPORT,
                 cut: bool = False):
        """A line refused for `reason`; `parsed` if it decoded before being refused; `cut`: the
        file ends here, cut off (a trace of a span format may be missing spans).
        """
        # parsed: decoded whole, then refused (nested too deep, an unpaired surrogate)
        self.reason, self.raw, self.parsed, self.fix, self.cut = reason, raw, parsed, fix, cut


@dataclass(frozen=True)
class Refusal:
    """A row that cannot become a trace: why, its raw text, the trace id it names (None where
    it names none) and what to change (None: its format's own `FIX`).
    """

    reason: str
    raw: str
    trace_id: str | None = None
    fix: str | None = None
    record: object = None  # a line format's raw record: the subjects erasure indexes


BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which some exporters put first
# ingest reads each inbox file once, by its name: a whole copy of a cut file needs a new one
WHOLE_AGAIN = ("copy the whole file into the inbox again under a new name (ingest reads each "
               "file name once; a copy or a gzip stream was interrupted)")


def _open(path: Path):
    with path.open("rb") as handle:
        magic = handle.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else path.open("rb")


def read_records(path: Path, max_line_bytes: int) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON value or Unreadable) for each non-blank line of a JSONL file; for
    a file that is one JSON document spread over lines, its items ("line" is the item number).
    """
    try:
        with _open(path) as handle:
            head = handle.read(1 << 16).removeprefix(BOM).lstrip()
    except (OSError, EOFError):  # a truncated gzip stream: read the lines before the cut
        head = b""
    if head[:1] in (b"[", b"{") and not _is_json(head.split(b"\n", 1)[0]):
        document = _read_document(path, max_line_bytes * 10)
        if isinstance(document, Unreadable):  # one document, refused whole: one row
            yield 1, document
            return
        if document is not None:
            yield from _items(1, document, numbered=True)
            return
        later = [line for line in head.split(b"\n")[1:6] if line.strip()]
        if later and not any(_is_json(line) for line in later):
            # not JSON lines either: one document, cut off or broken, is one row, not a
            # quarantined row for each of its lines
            yield 1, Unreadable(
                f"not valid JSON: the file is one JSON document over several lines and does not "
                f"parse as a whole ({_document_error(path, max_line_bytes * 10)})",
                _excerpt_bytes(head),
                fix="re-export the file whole from its source (a copy cut off?)")
            return
    number = 0
    try:
        with _open(path) as handle:
            for number, raw in enumerate(handle, start=1):
                if number == 1:  # a byte order mark (Windows tools write one) is no JSON
                    raw = raw.removeprefix(BOM)
                if raw.strip():
                    yield from _items(number, _parse_line(raw, max_line_bytes))
    except (OSError, EOFError) as err:
        yield number + 1, Unreadable(f"file cut off after line {number}: {err}", "",
                                     fix=WHOLE_AGAIN, cut=True)


def _items(number: int, value, numbered: bool = False) -> Iterator[tuple[int, object]]:
    """A JSON array holds records; anything else is one record."""
    if isinstance(value, list):
        if not value and not numbered:  # a line is counted, even one that holds no record
            yield number, Unreadable("an empty JSON array: no trace in it", "[]",
                                     fix="leave empty batches out of the export")
        for i, item in enumerate(value, start=1):
            yield (i if numbered else number), item
    else:
        yield number, value


def _excerpt_bytes(raw: bytes) -> str:
    """`excerpt` of the first bytes of a line or file (decoded; cut where no secret is split)."""
    text = raw[:8000].decode("utf-8", "replace")
    return excerpt(text, 2000 if len(raw) <= 8000 else min(2000, len(text) - 1))


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


def _parse_line(raw: bytes, max_line_bytes: int):
    if len(raw) > max_line_bytes:
        return Unreadable(f"line of {len(raw):,} bytes is longer than ingest.max_line_bytes="
                          f"{max_line_bytes:,}", _excerpt_bytes(raw),
                          fix="raise ingest.max_line_bytes in params.yaml if such traces are "
                          "real, or export smaller batches a line")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return Unreadable(f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})",
                          _excerpt_bytes(raw),
                          fix="write the export as UTF-8 (JSON's encoding)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return Unreadable(f"not valid JSON ({err.msg} at column {err.colno})", excerpt(text))
    except ValueError as err:  # valid JSON that Python will not convert: a number of 5000 digits
        return Unreadable(f"not readable JSON ({str(err)[:200]})", excerpt(text))
    except RecursionError:
        return Unreadable(f"JSON nested deeper than {MAX_DEPTH} levels", excerpt(text),
                          fix=_NO_TRACE)
    # cheap tests first: most lines have neither many brackets nor \u escapes
    if text.count("[") + text.count("{") > MAX_DEPTH and json_depth(value) > MAX_DEPTH:
        return Unreadable(f"JSON nested deeper than {MAX_DEPTH} levels", excerpt(text), parsed=True,
                          fix=_NO_TRACE)
    if ("\\ud" in text or "\\uD" in text) and _lone_surrogate(value):
        return Unreadable("an unpaired UTF-16 surrogate escape (\\ud800-\\udfff): not valid "
                          "Unicode text", excerpt(text), parsed=True,
                          fix="fix what writes it: it cut a character in half (text truncated "
                          "by UTF-16 units)")
    return value


# no trace format nests this deep: not a trace
_NO_TRACE = "take this line out of the inbox: no trace format nests so deep"


def json_depth(value) -> int:
    """How deeply a JSON value nests, without recursion (so it cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (value.values() if isinstance(value, dict)
                                                  else value))
    return deepest


def _lone_surrogate(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _read_document(path: Path, limit: int):
    """The file as one JSON value, or None if it is not one (then it is read line by line)."""
    try:
        with _open(path) as handle:
            raw = handle.read(limit + 1).removeprefix(BOM)
    except (OSError, EOFError):  # a gzip stream cut short: no whole document in it
        return None
    if len(raw) > limit:
        return None
    value = _parse_line(raw, limit + 1)
    return None if isinstance(value, Unreadable) and not value.parsed else value


def _document_error(path: Path, limit: int) -> str:
    """Why the file does not parse as one JSON document, in JSON's words."""
    try:
        with _open(path) as handle:
            raw = handle.read(limit + 1).removeprefix(BOM)
    except (OSError, EOFError) as err:
        return f"the file is cut off: {err}"
    if len(raw) > limit:
        return f"over {limit:,} bytes"
    try:
        json.loads(raw)
    except (ValueError, RecursionError) as err:
        return str(err)
    return "unknown"


def detect(record) -> str | None:
    """The name of the format a record is in, or None if no source reads it."""
    return next((m.NAME for m in FORMATS if m.detect(record)), None)


def _keys(record) -> str:
    return (f"keys {sorted(record)[:8]}" if isinstance(record, dict)
            else f"a JSON {type(record).__name__}")


def traces_of_file(path: Path, config: cfg.Ingest) -> Iterator[tuple[int, str, dict | Refusal]]:
    """(line, format, normalized trace or the Refusal that quarantines it) for one file."""
    records = read_records(path, config.max_line_bytes)  # a generator: line formats stream
    fmt, held = None, []
    # the first record a format recognizes decides: a junk first line does not sink the file
    for number, record in records:
        held.append((number, record))
        if not isinstance(record, Unreadable):
            fmt = detect(record)
            if fmt is not None or len(held) >= DETECT_WITHIN:
                break
    if fmt is None:
        expected = ", ".join(m.NAME for m in FORMATS)
        first = next((r for _, r in held if not isinstance(r, Unreadable)), None)
        for number, record in chain(held, records):
            yield number, "unknown", _unreadable(record) if isinstance(record, Unreadable) else \
                Refusal(f"unknown format (first record has {_keys(first)}); expected one of "
                        f"{expected}", _raw(record), fix="convert the file into one of those "
                        "formats (docs/traces.md, \"Traces in\"), or take it out of the inbox")
        return
    if fmt in LINE_FORMATS:
        module = LINE_FORMATS[fmt]
        for number, record in chain(held, records):
            if isinstance(record, Unreadable):
                yield number, fmt, _unreadable(record)
                continue
            own_id = record.get("id") if isinstance(record, dict) else None
            try:
                if not isinstance(record, dict):
                    raise BadRecord(f"a line must be a JSON object, got {type(record).__name__}")
                if own_id is None:
                    record = {**record, "id": f"{path.name}:{number}"}
                # the raw record rides along: its user and fields are erasure's subjects
                yield number, fmt, {**module.parse(record), "record": record}
            except READER_ERRORS as err:
                yield number, fmt, dataclasses.replace(
                    _refusal(fmt, err, _raw(record), None if own_id is None else str(own_id)),
                    record=record)
        return
    # Span-based formats: the records of one trace can be anywhere in the file, so it is read
    # whole, then trace by trace: one trace that cannot be read is quarantined alone.
    stream = list(chain(held, records))
    otlp_file = otlp.detect(held[-1][1])  # else Phoenix spans, Langfuse or LangSmith records
    good = []
    for number, record in stream:
        if isinstance(record, Unreadable):
            yield number, fmt, _unreadable(record)
        elif otlp_file and not otlp.detect(record):
            other = detect(record)
            yield number, other or "unknown", Refusal(
                f"not an OTLP JSON document ({_keys(record)}"
                + (f", a {other} record" if other else "") + ") among OTLP ones", _raw(record),
                fix="put records of another format in a file of their own")
        else:
            good.append((number, record))
    if not good:
        return
    cut = next((record for _, record in stream if isinstance(record, Unreadable) and record.cut),
               None)
    if cut is not None:  # a trace's spans may lie on both sides of the cut: none is whole for sure
        for number, record in good:
            yield number, fmt, Refusal(f"{cut.reason}; the file holds the spans of traces in any "
                                       f"order, so none of them is known whole", _raw(record),
                                       fix=WHOLE_AGAIN)
        return
    try:
        if otlp_file:
            results = otlp_traces([r for _, r in good])
        else:
            results = [(tid, fmt, r) for tid, r in TRACE_FORMATS[fmt].parse_each(
                [r for _, r in good])]
    except READER_ERRORS as err:  # a record that names no trace: the file cannot be split
        for number, record in good:
            refusal = _refusal(fmt, err, _raw(record))
            yield number, fmt, Refusal(f"{refusal.reason} (the file's {len(good)} records are "
                                       f"quarantined together)", refusal.raw, fix=refusal.fix)
        return
    starts = first_lines({str(tid) for tid, _, _ in results}, good)
    for trace_id, trace_fmt, result in results:
        number = starts.get(str(trace_id), good[0][0])
        if isinstance(result, Exception):
            record = next(r for n, r in good if n == number)
            yield number, trace_fmt, _refusal(trace_fmt, result, _raw(record), str(trace_id))
        else:
            yield number, trace_fmt, result


def otlp_traces(documents: list[dict]) -> list[tuple[str, str, dict | Exception]]:
    """(trace id, convention, normalized trace or the error) for each trace of OTLP JSON
    documents, each trace read by the convention its own spans follow (OpenInference spans carry
    `openinference.span.kind`; the others are read as GenAI, current or deprecated names), and
    GenAI events in log records joined to their spans. A trace that fits no convention is one
    error; a trace with no GenAI span or event at all (a health check) is left out.
    """
    out = []
    for trace_id, document in otlp.by_trace(documents).items():
        errors = []
        for module in ([openinference] if openinference.detect(document) else []) + [otel_genai]:
            results = module.parse_each([document] if module is openinference else document)
            found = [r for _, r in results if not isinstance(r, Exception)]
            if found:
                out.append((trace_id, module.NAME, found[0]))
                break
            errors += [(module.NAME, r) for _, r in results]
        else:
            if errors:
                out.append((trace_id, errors[0][0], errors[0][1]))
    return out


def _unreadable(record: Unreadable) -> Refusal:
    return Refusal(record.reason, record.raw, fix=record.fix)


def _refusal(fmt: str, err: Exception, raw: str, trace_id: str | None = None) -> Refusal:
    """A reader's error as a Refusal: its message, and the fix it names (a NoContent's: the
    format's content-capture switch), else none (then the format's own FIX applies).
    """
    if isinstance(err, NoContent):
        return Refusal(str(err), raw, trace_id, err.fix or CAPTURE[fmt])
    if isinstance(err, BadRecord):
        return Refusal(str(err), raw, trace_id, err.fix)
    # a record shaped in a way the reader did not foresee: quarantined and named, never a crash
    return Refusal(f"the {fmt} reader could not map this record ({type(err).__name__}: {err})",
                   raw, trace_id, "report it with this row (the reader did not foresee the "
                   "record's shape); meanwhile the record stays here")


def quarantine_reason(file: str, line: int, fmt: str, refusal: Refusal) -> str:
    """The reason a quarantine row gives: where (the file; the trace id where one is known,
    else the line, and a line format's line always), what is wrong, and what to change.
    """
    reason, trace_id = refusal.reason, refusal.trace_id
    if trace_id is not None:  # named once
        reason = reason.removeprefix(f"trace {trace_id}: ").removeprefix(f"trace {trace_id} ")
    where = f"{file}, trace {trace_id}" if trace_id is not None and fmt in TRACE_FORMATS else \
        f"{file} line {line}" + ("" if trace_id is None else f", trace {trace_id}")
    module = LINE_FORMATS.get(fmt) or TRACE_FORMATS.get(fmt)
    fix = refusal.fix or (module.FIX if module else "take it out of the inbox")
    return f"{where}: {reason}; to fix: {fix}"


def first_lines(ids: set[str], records: list[tuple[int, object]]) -> dict[str, int]:
    """The first line on which each trace id appears as a value: one pass over the records
    (searching each id in each line's text would be quadratic in a file of many traces).
    """
    found: dict[str, int] = {}

    def walk(value, number: int) -> None:
        if isinstance(value, str):
            if value in ids and value not in found:
                found[value] = number
        elif isinstance(value, list):
            for item in value:
                walk(item, number)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, number)

    for number, record in records:
        if len(found) == len(ids):
            break
        walk(record, number)
    return found


def _raw(record) -> str:
    if isinstance(record, Unreadable):
        return record.raw
    return excerpt(json.dumps(record, ensure_ascii=False))


def inbox_files(inbox: Path) -> list[Path]:
    """The inbox's files, hidden ones left out, in name order."""
    return sorted(p for p in inbox.iterdir() if p.is_file() and not p.name.startswith("."))


def inbox_key(files: list[Path]) -> tuple[str, dict[str, str]]:
    """A SHA-256 over the files' names and contents, the inbox's identity; and each file's own
    SHA-256 by name.
    """
    digest, digests = hashlib.sha256(), {}
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            own = hashlib.file_digest(handle, "sha256").digest()
        digest.update(own)
        digests[path.name] = own.hex()
    return digest.hexdigest(), digests


class Writer:
    """Rows to a Parquet file in batches, renamed into place when closed."""

    def __init__(self, path: Path):
        """A writer to a temporary file beside `path`."""
        self.path = path
        self.tmp = io.tmp_name(path)
        self.writer = pq.ParquetWriter(self.tmp, SCHEMA)
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        """Add a row, writing a batch when enough are held."""
        self.rows.append(row)
        if len(self.rows) >= BATCH:
            try:
                self.flush()
            except BaseException:  # e.g. the disk is full: leave nothing half-written behind
                self.tmp.unlink(missing_ok=True)
                raise

    def flush(self) -> None:
        """Write the rows held so far."""
        if self.rows:
            # column by column: several times faster than Table.from_pylist on dicts
            columns = {name: [row[name] for row in self.rows] for name in SCHEMA.names}
            self.writer.write_table(pa.Table.from_pydict(columns, schema=SCHEMA))
            self.rows = []

    def abort(self) -> None:
        """Drop what was written (the stage failed); the final path is not touched."""
        try:
            self.writer.close()
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """Write the rest and close the file (removed if that fails)."""
        try:
            self.flush()
            self.writer.close()
        except BaseException:  # e.g. the disk is full: leave nothing half-written behind
            self.tmp.unlink(missing_ok=True)
            raise
        os.replace(self.tmp, self.path)


def _counts() -> dict:
    return {"rows_read": 0, "accepted": 0, "quarantined": 0, "duplicates": 0, "erased": 0}


def run(config: cfg.Ingest, inbox: Path, traces: Path, ingested: Path, quarantine: Path,
        key: bytes | None = None, subject_fields: tuple[str, ...] = (),
        tombstones: erasure.Tombstones | None = None) -> dict:
    """Ingest the inbox files not yet in `traces`; returns the stage metrics. With the erasure
    salt `key`, each file's subjects are indexed beside its part (`stages/erasure.py`) and a
    record whose subject or trace is in `tombstones` is dropped, counted as `erased`.
    """
    if not inbox.is_dir():
        raise FileNotFoundError(f"{inbox}: inbox folder not found; put trace files there "
                                f"(or run `offseason simulate`)")
    files = inbox_files(inbox)
    inbox_id, digests = inbox_key(files)
    traces.mkdir(parents=True, exist_ok=True)
    manifest_path = traces / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    # Parts from earlier cycles are history: their hashes are the duplicate set. Parts written from
    # this same inbox snapshot (a killed run) are recomputed, which gives the same result.
    earlier = {name: entry for name, entry in manifest.items() if entry["inbox_key"] != inbox_id}
    seen: set[bytes] = set()
    for entry in earlier.values():
        column = pq.read_table(traces / entry["part"], columns=["content_hash"]).column(0)
        seen.update(bytes.fromhex(h) for h in column.to_pylist())
    repeats: dict[str, list[dict]] = {}  # inbox file -> its duplicates (`duplicates_of`)
    if key is not None:  # the salt that wrote the index so far, or a refusal saying what to do
        erasure.same_salt(traces, key)
    hashed = None if key is None else erasure.hasher(key)  # the index's salted subjects

    kinds = {kind for kind in KINDS if getattr(config, f"scrub_{kind}s")}
    totals, per_format = _counts(), {}
    redactions = dict.fromkeys(KINDS, 0)
    bad_rows, new_files, rated_repeats = [], 0, 0
    unread = {"traces": 0, "reasons": {}, "first": None}  # feedback no stage reads (`feedback_problem`)
    out = Writer(ingested)
    writers = [out]
    try:
        for path in files:
            if path.name in earlier:
                continue
            new_files += 1
            # the whole name: a Collector's rotated backups (traces.2026-12-05T01.jsonl, ...)
            # share the text before their first dot
            part = f"part-{path.name}.parquet"
            writer, counts = Writer(traces / part), _counts()
            writers.append(writer)
            # erasure's rows for this file (with `key`), column by column (a dict a row, made
            # into a table, was a third of what keeping the index cost)
            index: dict[str, list] = {name: [] for name in erasure.INDEX.names}
            for number, fmt, item in traces_of_file(path, config):
                fmt_counts = per_format.setdefault(fmt, _counts())
                for bucket in (counts, fmt_counts):
                    bucket["rows_read"] += 1
                pairs = []
                if key is not None:
                    raw = item if isinstance(item, Refusal) else None
                    pairs = erasure.subjects(None if raw else item, raw.record if raw else
                                             item.get("record"), subject_fields)
                    own = raw.trace_id if raw else item.get("trace_id")
                    pairs += [("trace", str(own))] if own is not None else []
                    if tombstones and tombstones.erased(pairs):
                        # a tombstoned person's record: written nowhere, not even to quarantine
                        for bucket in (counts, fmt_counts):
                            bucket["erased"] += 1
                        continue
                scrubber = Scrubber(kinds)
                refusal = item if isinstance(item, Refusal) else None
                if refusal is None:
                    try:
                        row = make_row(item, path.name, number, fmt, scrubber)
                        if row["n_messages"] > config.max_messages:
                            raise BadRecord(f"{row['n_messages']} messages, more than "
                                            f"ingest.max_messages={config.max_messages}",
                                            fix="raise ingest.max_messages in params.yaml if "
                                            "conversations this long are the agent's work")
                    except BadRecord as err:
                        trace_id = item.get("trace_id")
                        # a line format's stand-in id (<file>:<line>) names nothing
                        named = None if trace_id in (None, f"{path.name}:{number}") else str(trace_id)
                        refusal = _refusal(fmt, err, excerpt(json.dumps(item, default=str)), named)
                if refusal is not None:
                    for bucket in (counts, fmt_counts):
                        bucket["quarantined"] += 1
                    # one scrubber for the row: its id, reason and text name a datum alike
                    shown = Scrubber(kinds)
                    bad_rows.append({"source_file": path.name, "source_line": number, "format": fmt,
                                     "trace_id": None if refusal.trace_id is None
                                     else shown.text(str(refusal.trace_id)), "stage": "ingest",
                                     "reason": shown.text(quarantine_reason(path.name, number, fmt,
                                                                            refusal)),
                                     "raw": shown.text(refusal.raw)})
                    _index(index, hashed, pairs, bad_rows[-1]["trace_id"], None, path.name, number,
                           fmt, "quarantined")
                    continue
                if key is not None and ("trace", row["trace_id"]) not in pairs:
                    pairs.append(("trace", row["trace_id"]))  # the id as the parts keep it
                digest = bytes.fromhex(row["content_hash"])
                if digest in seen:
                    _index(index, hashed, pairs, row["trace_id"], row["content_hash"], path.name,
                           number, fmt, "duplicate")
                    for bucket in (counts, fmt_counts):
                        bucket["duplicates"] += 1
                    feedback = item.get("feedback")
                    if isinstance(feedback, dict) and (isinstance(feedback.get("thumbs_up"), bool)
                                                       or feedback.get("scores")):
                        rated_repeats += 1  # kept in its duplicates part, learned from nowhere
                    repeats.setdefault(path.name, []).append({
                        "trace_id": row["trace_id"], "source_file": path.name,
                        "source_line": number, "duplicate_of": row["content_hash"],
                        "feedback": row["feedback"]})
                    continue
                seen.add(digest)
                problem = feedback_problem(item.get("feedback"))
                if problem is not None:
                    unread["traces"] += 1
                    unread["reasons"][problem[0]] = unread["reasons"].get(problem[0], 0) + 1
                    unread["first"] = unread["first"] or \
                        f"{path.name} line {number}: {Scrubber(kinds).text(problem[1])}"
                for kind, n in scrubber.counts.items():
                    redactions[kind] += n
                for bucket in (counts, fmt_counts):
                    bucket["accepted"] += 1
                _index(index, hashed, pairs, row["trace_id"], row["content_hash"], path.name, number,
                       fmt, "accepted")
                writer.add(row)
                out.add(row)
            writer.close()
            manifest[path.name] = {"part": part, "inbox_key": inbox_id,
                                   "sha256": digests[path.name], **counts}
            if key is not None:
                manifest[path.name]["index_part"] = f"{erasure.INDEX_PREFIX}{path.name}.parquet"
                io.write_parquet(traces / manifest[path.name]["index_part"],
                                 pa.table(index, schema=erasure.INDEX.with_metadata(
                                     {erasure.SALT_CHECK: erasure.salt_check(key)})
                                     ).sort_by("subject"),
                                 row_group_size=erasure.INDEX_ROW_GROUP)
            for name, value in counts.items():
                totals[name] += value
        out.close()
    except BaseException:  # a full disk, say: no temporary file is left behind
        for writer in writers:
            writer.abort()
        raise
    duplicates_of(traces, manifest, repeats)
    io.write_json(manifest_path, manifest)  # last: the parts it names are whole
    io.write_jsonl(quarantine, bad_rows)
    assert totals["rows_read"] == totals["accepted"] + totals["quarantined"] + \
        totals["duplicates"] + totals["erased"]
    # a file read by an earlier cycle and changed since (a line deleted for an erasure, traces
    # appended): ingest reads each name once, so the change is in no cycle (manifests before
    # stop 31 kept no digest of their files)
    changed = sorted(name for name, entry in earlier.items()
                     if name in digests and entry.get("sha256") not in (None, digests[name]))
    return {**totals, "new_files": new_files, "files_seen_before": len(earlier),
            "files_changed_since_read": changed,
            "per_format": per_format, "pii_redactions": redactions, "feedback_unread": unread,
            "duplicates_rated": rated_repeats,
            "total_traces": sum(e["accepted"] for e in manifest.values())}


def _index(columns: dict[str, list], key, pairs: list[tuple[str, str]], trace_id,
           content_hash, file: str, line: int, fmt: str, status: str) -> None:
    """Erasure's index rows of one record: each of its subjects, salted (`key`: the run's
    `erasure.hasher`, or None: no index), with where it went.
    """
    if key is None:
        return
    n = len(pairs)
    columns["subject"].extend(key(kind, value) for kind, value in pairs)
    columns["kind"].extend(kind for kind, _ in pairs)
    for name, value in (("trace_id", trace_id), ("content_hash", content_hash),
                        ("source_file", file), ("source_line", line), ("format", fmt),
                        ("status", status)):
        columns[name].extend([value] * n)


def duplicates_of(traces: Path, manifest: dict, repeats: dict[str, list[dict]]) -> None:
    """Write each inbox file's duplicates beside its part, `duplicate_of` turned from the content
    hash into the id of the trace kept with it (one accepted row per hash, in some part). Looked
    up once, after the parts are written: a map of every hash to its id while reading cost 220 MB
    a million traces, for the few that repeat.
    """
    if not repeats:
        return
    wanted = {row["duplicate_of"] for rows in repeats.values() for row in rows}
    value_set = pa.array(sorted(wanted), pa.string())
    kept = {}
    for entry in manifest.values():
        # batch by batch, the hashes matched in Arrow: every row as Python strings was the stage's
        # peak memory (500 MB more a million traces, all at the end)
        part = pq.ParquetFile(traces / entry["part"], pre_buffer=False, buffer_size=1 << 20)
        for batch in part.iter_batches(columns=["content_hash", "trace_id"], batch_size=8192):
            found = batch.filter(pc.is_in(batch.column(0), value_set=value_set))
            kept.update(zip(found.column(0).to_pylist(), found.column(1).to_pylist()))
    for name, rows in repeats.items():
        for row in rows:
            row["duplicate_of"] = kept[row["duplicate_of"]]
        manifest[name]["duplicates_part"] = f"duplicates-{name}.parquet"
        io.write_parquet(traces / manifest[name]["duplicates_part"],
                         pa.Table.from_pylist(rows, DUPLICATES))


def parser() -> argparse.ArgumentParser:
    """The stage's command line, as dvc.yaml writes it (the CLI reads the inbox's path with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("inbox", "traces", "ingested", "quarantine", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Ingest the inbox (the DVC stage's command line)."""
    args = parser().parse_args(argv)
    try:
        metrics = run(cfg.load("ingest", args.params), args.inbox, args.traces, args.ingested,
                      args.quarantine, erasure.salt(),
                      tuple(cfg.load("erase", args.params).subject_fields),
                      erasure.Tombstones())
    except erasure.SaltMismatch as err:  # what to do, not a traceback (as io.explained does)
        print(f"ingest: error: {err}", file=sys.stderr)
        sys.exit(1)
    io.write_metrics(args.metrics, metrics)
    print(f"ingest: {metrics['rows_read']} rows read from {metrics['new_files']} new file(s): "
          f"{metrics['accepted']} accepted, {metrics['quarantined']} quarantined, "
          f"{metrics['duplicates']} duplicates; PII scrubbed: "
          f"{', '.join(f'{k} {v}' for k, v in metrics['pii_redactions'].items() if v) or 'none'}",
          file=sys.stderr)
    if metrics["files_changed_since_read"]:
        print(f"ingest: warning: {', '.join(metrics['files_changed_since_read'])} changed since a "
              f"cycle read it; ingest reads each file name once, so the change is in no cycle: "
              f"put new traces in a file of a new name (a trace removed from a file stays in "
              f"what ingest kept of it, {args.traces}/, and in the cycles that learned from it: "
              f"`offseason lineage --trace`)", file=sys.stderr)
    if metrics["duplicates_rated"]:
        print(f"ingest: {metrics['duplicates_rated']} duplicate(s) carried a rating (thumbs_up or "
              f"scores): ingest keeps a conversation's first copy, so those ratings are kept in "
              f"{args.traces}/duplicates-<file>.parquet and not learned from; have the logger "
              f"write a rating onto the conversation it rates, or send it once", file=sys.stderr)
    unread = metrics["feedback_unread"]
    if unread["traces"]:
        print(f"ingest: warning: {unread['traces']} accepted trace(s) carry feedback that gives no "
              f"rating ({', '.join(f'{k} {v}' for k, v in unread['reasons'].items())}; first: "
              f"{unread['first']}): they are learned from as unrated. {FEEDBACK_SHAPE}",
              file=sys.stderr)


if __name__ == "__main__":
    with io.explained("ingest"):
        main()
    io.exit_soon()
