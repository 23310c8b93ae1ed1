"""Erasure's part in the stages: salted subject hashes, the index ingest keeps, the tombstones.

A deletion request names a person by a user id, a session id, a trace id or a field of the
records (`erase.subject_fields`). Ingest writes, beside each inbox file's part in `data/traces/`,
`index-<file>.parquet`: one row per (subject, trace) with the subject as a salted hash (HMAC-SHA256
under the workspace's salt: no personal data, and no dictionary of ids reverses it), the trace id
as the parts keep it, its content hash, and where it came from (file, line, format, and whether it
was accepted, a duplicate or quarantined). `offseason erase` (flows/orchestration/erase.py) reads
those rows to find a person's traces in every file, then writes tombstones to
`data/tombstones.jsonl` (git-tracked: salted hashes, reason, date): ingest drops a record whose
subject or trace is tombstoned before it is written anywhere, so the data never enters another
cycle; validate, train's replay and the benchmark refresh drop tombstoned traces where they read
rows. Reads and writes no file but the salt.

The salt is a secret: `OFFSEASON_ERASURE_SALT` in the environment, else `.offseason/erasure.salt`
(git-ignored; made on first use). Lose it and the index and tombstones can no longer be matched
against new records: back it up with the project's other secrets. Each index part carries a check
value of the salt that wrote it (an HMAC of a fixed text: it reveals nothing), so a checkout with
another salt (a fresh clone, where a new one would be made) is refused by ingest and erase
(`same_salt`) instead of indexing under a second salt and finding none of the earlier traces.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

import pyarrow as pa

SALT_ENV = "OFFSEASON_ERASURE_SALT"
SALT_FILE = Path(".offseason") / "erasure.salt"
TOMBSTONES = Path("data") / "tombstones.jsonl"
INDEX_PREFIX = "index-"  # data/traces/index-<inbox file>.parquet
# each index part sorted by subject in row groups this small: a lookup of one subject reads one
# row group per part, the others skipped by their min/max statistics (0.2 s for a person among a
# million traces' 3 million rows, against 0.5-0.7 s reading every row: BENCHMARKS.md)
INDEX_ROW_GROUP = 4096
INDEX = pa.schema([("subject", pa.string()), ("kind", pa.string()), ("trace_id", pa.string()),
                   ("content_hash", pa.string()), ("source_file", pa.string()),
                   ("source_line", pa.int64()), ("format", pa.string()),
                   ("status", pa.string())])
# where a record names its user and its session, by format: OpenAI's `user` (the end-user id the
# API takes), Langfuse's `userId`/`sessionId`, OpenTelemetry's `user.id`/`session.id`, and the
# usual spellings under `metadata`
USER_KEYS = ("user", "user_id", "userId", "metadata.user_id", "metadata.userId", "user.id",
             "enduser.id")
SESSION_KEYS = ("session_id", "sessionId", "conversation_id", "thread_id", "metadata.session_id",
                "metadata.sessionId", "session.id")
KINDS = ("user", "session", "trace")  # and field:<name>, one per erase.subject_fields entry


SALT_CHECK = b"offseason.salt_check"  # an index part's schema metadata: `salt_check` of its salt


class SaltMismatch(RuntimeError):
    """The index was written under another salt than this checkout's; the message says what to do."""


def salt_check(key: bytes) -> str:
    """A check value of the salt `key`: equal for equal salts, and no help to find the salt."""
    return hmac.new(key, b"offseason: the erasure salt's check value", hashlib.sha256
                    ).hexdigest()[:16]


def same_salt(traces: Path, key: bytes) -> None:
    """Raise SaltMismatch when an index part in `traces` (data/traces/) was written under another
    salt than `key`: a checkout whose salt file is missing (a fresh clone) made a new one, and
    would index under it and find no earlier trace, while the tombstones stop matching. Parts
    written before the check value was kept are not checked. Reads the parts' footers only.
    """
    import pyarrow.parquet as pq

    mine = salt_check(key)
    for part in sorted(traces.glob(f"{INDEX_PREFIX}*.parquet")) if traces.is_dir() else []:
        theirs = (pq.read_schema(part).metadata or {}).get(SALT_CHECK)
        if theirs is not None and theirs.decode() != mine:
            raise SaltMismatch(
                f"{part} was indexed under another erasure salt than this checkout's (check "
                f"value {theirs.decode()} there, {mine} here): .offseason/erasure.salt is not the "
                f"one the earlier cycles used (a fresh clone makes a new one). Copy "
                f".offseason/erasure.salt from the machine that ran them, or set {SALT_ENV} to "
                f"its value, then run again; under another salt, erase would find none of the "
                f"earlier traces and erased people's new traces would pass the tombstones")


def salt(root: Path = Path(".")) -> bytes:
    """The workspace's salt: the environment's, else the file's (made, whole, on first use)."""
    if os.environ.get(SALT_ENV):
        return os.environ[SALT_ENV].encode()
    path = root / SALT_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # O_EXCL: two first users at once agree on the one that was written
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(32) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
    return path.read_text().strip().encode()


_KEYED: dict[bytes, hmac.HMAC] = {}  # per salt, the HMAC with the key absorbed: copied per digest


def digest(key: bytes, kind: str, value) -> str:
    """The salted hash of one subject (`kind`: user, session, trace or field:<name>)."""
    keyed = _KEYED.get(key)
    if keyed is None:  # (hmac.new per digest: a third of what keeping the index cost ingest)
        keyed = _KEYED.setdefault(key, hmac.new(key, digestmod=hashlib.sha256))
    h = keyed.copy()
    h.update(f"{kind}\0{value}".encode())
    return h.hexdigest()[:32]


def hasher(key: bytes):
    """`digest` under one salt, each user, session and field value hashed once (they repeat
    across a file's traces; a trace id does not, and is not kept).
    """
    seen: dict[tuple[str, str], str] = {}

    def hashed(kind: str, value) -> str:
        if kind == "trace":
            return digest(key, kind, value)
        found = seen.get((kind, value))
        if found is None:
            found = seen[(kind, value)] = digest(key, kind, value)
        return found

    return hashed


def lookup(record, path: str):
    """The value at a dotted key of a JSON object (`metadata.user_id`), a key holding dots
    (`user.id`, as OpenTelemetry attributes are named) first; None where there is none.
    """
    if not isinstance(record, dict):
        return None
    if path in record:
        return record[path]
    head, dot, rest = path.partition(".")
    return lookup(record.get(head), rest) if dot else None


def _plain(value) -> str | None:
    if value is None or value == "" or isinstance(value, (dict, list, bool)):
        return None
    return str(value)


# (kind, ((key, the head of a dotted key or None), ...)): what `subjects` reads, split once
_KIND_KEYS = tuple((kind, tuple((k, k.partition(".")[0] if "." in k else None) for k in keys))
                   for kind, keys in (("user", USER_KEYS), ("session", SESSION_KEYS)))


def subjects(trace: dict | None, record, fields: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(kind, value) of every subject a trace names: its id, its user, its session, and the
    `fields` asked for, from the normalized trace and from its raw record (a line format's).
    """
    found = []
    trace = trace or {}
    sources = [s for s in (trace, record if isinstance(record, dict) else None,
                           (record or {}).get("metadata") if isinstance(record, dict) else None)
               if isinstance(s, dict)]
    for kind, keys in _KIND_KEYS:
        for source in sources:
            for key, head in keys:
                # a plain get first: `lookup` (dotted paths) only where the path's head is there
                value = source.get(key)
                if value is None and head is not None and head in source:
                    value = lookup(source, key)
                value = _plain(value)
                if value is not None and (kind, value) not in found:
                    found.append((kind, value))
    for name in fields:
        for source in sources:
            value = _plain(lookup(source, name))
            if value is not None and (f"field:{name}", value) not in found:
                found.append((f"field:{name}", value))
    return found


def trace_of_task(task_id: str | None, environment: str | None) -> str | None:
    """The trace a task came from (as flows/audit/lineage.py's `trace_id_of`): on the tag path
    the task id is the trace id; on the chat path `<environment>:trace:<trace id>`, and a task of
    an environment's own task file names no trace.
    """
    if task_id is None:
        return None
    if task_id.startswith("trace:"):  # a held-out trace's task (validate's pool, a benchmark)
        return task_id[len("trace:"):]
    if not environment:
        _, marker, trace_id = task_id.partition(":trace:")
        return trace_id if marker else task_id
    _, marker, trace_id = task_id.partition(":trace:")
    return trace_id if marker else None


def read_tombstones(root: Path = Path(".")) -> set[str]:
    """The tombstoned hashes (subjects and traces) of `data/tombstones.jsonl`; none without it."""
    path = root / TOMBSTONES
    if not path.exists():
        return set()
    rows = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    return {row["hash"] for row in rows if row.get("hash")}  # (the rest: erased DVC objects)


class Tombstones:
    """What a stage checks rows against: the tombstoned hashes and the salt they were made with."""

    def __init__(self, root: Path = Path(".")):
        """The tombstones of the project at `root` (the salt is read only where there are some)."""
        self.hashes = read_tombstones(root)
        self.key = salt(root) if self.hashes else b""

    def __bool__(self) -> bool:
        """Whether anything is tombstoned at all (else no row needs hashing)."""
        return bool(self.hashes)

    def erased(self, pairs) -> bool:
        """Whether any of the (kind, value) subjects is tombstoned."""
        return any(digest(self.key, kind, value) in self.hashes for kind, value in pairs)

    def trace_erased(self, trace_id: str | None) -> bool:
        """Whether the trace with this id is tombstoned."""
        return bool(self.hashes) and trace_id is not None and \
            digest(self.key, "trace", trace_id) in self.hashes

    def keep_table(self, table: pa.Table) -> pa.Table:
        """The rows of a table whose trace (its `trace_id`, else its `task_id`) is not erased."""
        if not self.hashes:
            return table
        if "trace_id" in table.column_names:
            traces = table.column("trace_id").to_pylist()
        elif "task_id" in table.column_names:
            envs = table.column("environment").to_pylist() if "environment" in \
                table.column_names else [None] * table.num_rows
            traces = [trace_of_task(t, e) for t, e in zip(table.column("task_id").to_pylist(),
                                                           envs)]
        else:
            return table
        mask = [not self.trace_erased(t) for t in traces]
        return table if all(mask) else table.filter(pa.array(mask, pa.bool_()))

    def keep_rows(self, rows: list[dict]) -> list[dict]:
        """The rows (dicts with `trace_id` or `task_id`) whose trace is not erased."""
        if not self.hashes:
            return rows
        return [r for r in rows if not self.trace_erased(
            r["trace_id"] if "trace_id" in r else trace_of_task(r.get("task_id"),
                                                                r.get("environment")))]
