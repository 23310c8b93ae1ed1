"""`offseason collect`: a live OTLP/HTTP receiver that writes each finished trace into the inbox.

Reads OTLP/HTTP `POST /v1/traces` and `POST /v1/logs` (protobuf or JSON, plain or gzip) from any
OpenTelemetry SDK or Collector (`OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318`). Writes each
finished trace, spans and log records grouped by trace id, into inbox JSONL files
`<inbox>/otlp-<UTC time>-<n>.jsonl` (renamed into place, never half written), with a fsynced
journal (`.offseason/collect/journal-*.log`) so an acknowledged span survives a kill -9. Sheds
load with 429/503/413; an optional bearer token (`runtime.collect.token_env`).

    offseason collect                    # until Ctrl-C or SIGTERM; runtime.collect in params.yaml
    offseason collect --port 0           # a free port (printed)
    offseason collect --status           # the running receiver's counters

Details: docs/traces.md, "How the live receiver works (flows/intake/collect.py)"; for more
traffic than one process takes, an OpenTelemetry Collector in front ("Live: offseason collect").
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, LogsData, ResourceLogs, ScopeLogs
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, TracesData

from flows.project.workspace import COLLECT_HELD, WorkspaceError
from stages import config as cfg
from stages import io

# After the root span came, wait this long for spans of the trace still on their way (a child
# exported by another service, or in the SDK's next batch) before writing it.
ROOT_WAIT = 1.0
TICK = 0.2  # how often finished traces are looked for
# at most this many traces an inbox file (~17 MB of OTLP JSON for agent turns of four spans):
# ingest reads an OTLP file whole, so its memory grows with the largest file
FILE_TRACES = 5_000
SEGMENT_BYTES = 64 << 20  # the journal is compacted past this size (or twice what it kept)
RETRY_AFTER = 5  # seconds, in 429/503 answers
RECENT = 1 << 16  # trace ids remembered after writing, to count spans that come too late
PROTOBUF = "application/x-protobuf"
# uvicorn's C event loop and HTTP parser (dependencies): a third less CPU a request than asyncio's
# loop and h11 (BENCHMARKS.md, "Traces in live")
FAST = {"loop": "uvloop", "http": "httptools"}


class Refused(Exception):
    """A request answered with an error status; `message` says why and what to do."""

    def __init__(self, status: int, counter: str, message: str, retry: bool = False):
        """`counter`: the status counter it adds to; `retry`: a Retry-After header is sent."""
        super().__init__(message)
        self.status, self.counter, self.message, self.retry = status, counter, message, retry


# --- decoding ---------------------------------------------------------------------------------

def status_url(settings) -> str:
    """Where a receiver with `runtime.collect` settings answers `GET /status` (a wildcard
    address is asked on loopback).
    """
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{settings.port}/status"


def decode(body: bytes, content_type: str, encoding: str, limit: int,
           kind: type = ExportTraceServiceRequest
           ) -> tuple[ExportTraceServiceRequest | ExportLogsServiceRequest, bytes]:
    """The request a body holds (`kind`: ExportTraceServiceRequest for /v1/traces,
    ExportLogsServiceRequest for /v1/logs), and its protobuf bytes (for the journal); Refused for
    a body that cannot be read, naming what is wrong.
    """
    encoding = encoding.strip().lower()
    if encoding == "gzip":
        inflater = zlib.decompressobj(wbits=31)
        try:
            body = inflater.decompress(body, limit + 1)  # a gzip bomb stops at the limit
        except zlib.error as err:
            raise Refused(400, "bad_request", f"Content-Encoding gzip: not gzip data ({err})"
                          ) from None
        if len(body) > limit or inflater.unconsumed_tail:
            raise Refused(413, "too_large", f"the body is over runtime.collect.max_request_bytes="
                          f"{limit} once decompressed; export smaller batches (the SDK's "
                          f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE)")
        if not inflater.eof:
            raise Refused(400, "bad_request", "Content-Encoding gzip: the gzip stream is cut "
                          "short")
    elif encoding not in ("", "identity"):
        raise Refused(415, "unsupported", f"Content-Encoding {encoding!r}: only gzip or none")
    media = content_type.split(";")[0].strip().lower()
    request, name = kind(), kind.DESCRIPTOR.name
    if media in (PROTOBUF, "application/protobuf"):
        try:
            request.ParseFromString(body)
        except DecodeError as err:
            raise Refused(400, "bad_request", f"not an {name} protobuf ({err})") from None
        return request, body
    if media == "application/json":
        try:
            json_format.ParseDict(_ids_to_base64(json.loads(body)), request,
                                  ignore_unknown_fields=True)
        except (ValueError, TypeError, AttributeError, json_format.ParseError) as err:
            raise Refused(400, "bad_request", f"not an OTLP JSON {name} "
                          f"({str(err)[:300]})") from None
        return request, request.SerializeToString()
    raise Refused(415, "unsupported", f"Content-Type {content_type!r}: send {PROTOBUF} or "
                  f"application/json")


_ID_KEYS = ("traceId", "spanId", "parentSpanId")
# where the ids are: spans (and their links), log records
_ITEMS = (("resourceSpans", "scopeSpans", "spans"), ("resourceLogs", "scopeLogs", "logRecords"))


def _convert_ids(document: dict, convert) -> dict:
    """`convert` applied in place to every trace and span id of an OTLP JSON document."""
    for resources_key, scopes_key, items_key in _ITEMS:
        for resource in document.get(resources_key) or []:
            for scope in resource.get(scopes_key) or []:
                for item in scope.get(items_key) or []:
                    for fix in (item, *(item.get("links") or [])):
                        for key in _ID_KEYS:
                            if fix.get(key):
                                fix[key] = convert(fix[key])
    return document


def _ids_to_base64(document: dict) -> dict:
    """OTLP JSON writes trace and span ids in hex, where protobuf's JSON mapping expects base64
    for bytes fields: converted in place, spans (and their links) and log records.
    """
    return _convert_ids(document, lambda value: base64.b64encode(bytes.fromhex(value)).decode())


def otlp_json(resources: list[ResourceSpans], logs: list[ResourceLogs] = ()) -> dict:
    """Resource spans, and resource logs of the same trace, as one OTLP JSON document
    (`resourceSpans`, `resourceLogs`): hex ids, integer enums.
    """
    document = {**json_format.MessageToDict(TracesData(resource_spans=resources),
                                            use_integers_for_enums=True),
                **json_format.MessageToDict(LogsData(resource_logs=logs),
                                            use_integers_for_enums=True)}
    return _convert_ids(document, lambda value: base64.b64decode(value).hex())


# --- grouping spans and log records into traces (no I/O) ----------------------------------------

@dataclass
class Trace:
    """The spans and log records of one trace held so far, as resource spans and resource logs
    (one of each per request that carried some).
    """

    resources: list[ResourceSpans] = field(default_factory=list)
    span_ids: set[bytes] = field(default_factory=set)
    logs: list[ResourceLogs] = field(default_factory=list)
    log_keys: set[bytes] = field(default_factory=set)  # `log_key` of each log record held
    root: bool = False  # its root span came
    last: float = 0.0  # when its last new span or log record came (time.monotonic)


def log_key(record: LogRecord) -> bytes:
    """A log record's identity (it has no id of its own): a hash of its bytes, so an exporter's
    retry is held once and a written record is known again at journal replay.
    """
    return hashlib.blake2b(record.SerializeToString(deterministic=True), digest_size=8).digest()


_NO_TRACE = bytes(16)  # an all-zero trace id: "no trace" (a log record outside any span)


class Traces:
    """Spans and log records grouped by trace id until their trace is finished. Thread-safe:
    requests are queued on the event loop (`receive`), grouped and taken when finished by the
    writer's thread, and snapshotted by the journal's.

    A trace is finished by its spans: once its root span came and `ROOT_WAIT` seconds passed
    without a new span or log record of it, or `idle_seconds` without one when no root came. Log
    records (the GenAI instrumentations' message events) may come before or after the spans;
    those that come within that wait are written with them.
    """

    def __init__(self, idle_seconds: float):
        """Empty; a trace without a root span is finished after `idle_seconds` without a span."""
        self.idle_seconds = idle_seconds
        self.pending: dict[bytes, Trace] = {}
        self.writing: dict[bytes, Trace] = {}  # taken to be written, not yet recorded as written
        self.spans = 0  # in pending and writing
        self.log_records = 0  # in pending and writing
        # requests received, not yet grouped: grouping costs 6-8 us a span in Python, so it is
        # done off the request's path (a request is answered once its bytes are journaled)
        self.inbound: deque[tuple[ExportTraceServiceRequest | ExportLogsServiceRequest, bytes,
                                  int]] = deque()
        self.queued, self.queued_logs = 0, 0  # spans, and log records, in inbound
        # spans and log records queued since start (for the journal's compaction)
        self.received = 0
        self.recent: OrderedDict[bytes, None] = OrderedDict()  # written lately
        self.lock = threading.Lock()

    def receive(self, request: ExportTraceServiceRequest | ExportLogsServiceRequest,
                raw: bytes) -> int:
        """Queue a request (and its protobuf bytes) for `group`; the number of spans (or log
        records) in it.
        """
        logs = isinstance(request, ExportLogsServiceRequest)
        if logs:
            n = sum(len(scope.log_records) for resource in request.resource_logs
                    for scope in resource.scope_logs)
        else:
            n = sum(len(scope.spans) for resource in request.resource_spans
                    for scope in resource.scope_spans)
        with self.lock:
            self.inbound.append((request, raw, n))
            if logs:
                self.queued_logs += n
            else:
                self.queued += n
            self.received += n
        return n

    def group(self, now: float) -> dict:
        """Group the queued requests' spans and log records (`add`); the counts summed."""
        totals = dict.fromkeys(("new", "duplicate", "invalid", "late", "new_logs",
                                "duplicate_logs", "untraced_logs", "late_logs"), 0)
        while True:
            with self.lock:  # one request at a time: a snapshot sees each either queued or held
                if not self.inbound:
                    return totals
                request, _, n = self.inbound.popleft()
                if isinstance(request, ExportLogsServiceRequest):
                    self.queued_logs -= n
                else:
                    self.queued -= n
                for key, value in self._add(request, now).items():
                    totals[key] += value

    def add(self, request: ExportTraceServiceRequest | ExportLogsServiceRequest, now: float
            ) -> dict:
        """Hold the request's spans; counts of those new, seen before (an exporter's retry),
        invalid (a trace id not 16 bytes or a span id not 8: dropped) and late (of a trace
        already written: held again, and written as a trace of its own). For log records, the
        same counts as `new_logs`, `duplicate_logs`, `late_logs`, and `untraced_logs`: records
        of no trace (no trace id, or all zeros), dropped: they are not trace data.
        """
        with self.lock:
            return self._add(request, now)

    def _add(self, request: ExportTraceServiceRequest | ExportLogsServiceRequest, now: float
             ) -> dict:
        if isinstance(request, ExportLogsServiceRequest):
            return self._add_logs(request, now)
        counts = {"new": 0, "duplicate": 0, "invalid": 0, "late": 0}
        for resource in request.resource_spans:
            # this resource's spans by trace, each trace getting its own copy of the resource
            parts: dict[bytes, ResourceSpans] = {}
            for scope in resource.scope_spans:
                scoped: dict[bytes, ScopeSpans] = {}
                for span in scope.spans:
                    trace_id, span_id = span.trace_id, span.span_id  # each read makes a bytes
                    if len(trace_id) != 16 or len(span_id) != 8:
                        counts["invalid"] += 1
                        continue
                    trace = self._held(trace_id, counts, "late")
                    if span_id in trace.span_ids:
                        counts["duplicate"] += 1
                        continue
                    trace.span_ids.add(span_id)
                    trace.root = trace.root or not span.parent_span_id
                    trace.last = now
                    counts["new"] += 1
                    into = scoped.get(trace_id)
                    if into is None:
                        part = parts.get(trace_id)
                        if part is None:
                            part = parts[trace_id] = ResourceSpans(
                                resource=resource.resource, schema_url=resource.schema_url)
                        into = scoped[trace_id] = part.scope_spans.add(
                            scope=scope.scope, schema_url=scope.schema_url)
                    into.spans.append(span)
            for trace_id, part in parts.items():
                self.pending[trace_id].resources.append(part)
        self.spans += counts["new"]
        return counts

    def _add_logs(self, request: ExportLogsServiceRequest, now: float) -> dict:
        counts = {"new_logs": 0, "duplicate_logs": 0, "untraced_logs": 0, "late_logs": 0}
        for resource in request.resource_logs:
            parts: dict[bytes, ResourceLogs] = {}
            for scope in resource.scope_logs:
                scoped: dict[bytes, ScopeLogs] = {}
                for record in scope.log_records:
                    if len(record.trace_id) != 16 or record.trace_id == _NO_TRACE:
                        counts["untraced_logs"] += 1
                        continue
                    trace = self._held(record.trace_id, counts, "late_logs")
                    key = log_key(record)
                    if key in trace.log_keys:
                        counts["duplicate_logs"] += 1
                        continue
                    trace.log_keys.add(key)
                    trace.last = now
                    counts["new_logs"] += 1
                    into = scoped.get(record.trace_id)
                    if into is None:
                        part = parts.get(record.trace_id)
                        if part is None:
                            part = parts[record.trace_id] = ResourceLogs(
                                resource=resource.resource, schema_url=resource.schema_url)
                        into = scoped[record.trace_id] = part.scope_logs.add(
                            scope=scope.scope, schema_url=scope.schema_url)
                    into.log_records.append(record)
            for trace_id, part in parts.items():
                self.pending[trace_id].logs.append(part)
        self.log_records += counts["new_logs"]
        return counts

    def _held(self, trace_id: bytes, counts: dict, late: str) -> Trace:
        """The pending trace of this id, a new one if none (counted `late` if written lately)."""
        trace = self.pending.get(trace_id)
        if trace is None:
            trace = self.pending[trace_id] = Trace()
            if trace_id in self.recent:
                counts[late] += 1
        return trace

    def finished(self, now: float, everything: bool = False, closing: bool = False
                 ) -> list[tuple[bytes, Trace]]:
        """Take the finished traces (all of them with `everything`) to be written; each stays
        counted (and in journal snapshots) until `written` or `put_back`. `closing`: the
        receiver stops, so a trace whose root ended goes without waiting ROOT_WAIT for late
        spans (it waited for the next start before, the cycle in between not seeing it).
        """
        with self.lock:
            # a trace whose earlier spans are still being written waits for them (late spans)
            done = [(trace_id, trace) for trace_id, trace in self.pending.items()
                    if trace_id not in self.writing and (
                        everything or (closing and trace.root)
                        or now - trace.last >= (ROOT_WAIT if trace.root
                                                else self.idle_seconds))]
            for trace_id, trace in done:
                del self.pending[trace_id]
                self.writing[trace_id] = trace
        return done

    def written(self, trace_id: bytes) -> None:
        """The trace is in the inbox and recorded so in the journal: forget its spans."""
        with self.lock:
            trace = self.writing.pop(trace_id)
            self.spans -= len(trace.span_ids)
            self.log_records -= len(trace.log_keys)
            self.recent[trace_id] = None
            if len(self.recent) > RECENT:
                self.recent.popitem(last=False)

    def put_back(self, trace_id: bytes) -> None:
        """Writing the trace failed (a full disk): hold it again, to be tried later."""
        with self.lock:
            trace = self.writing.pop(trace_id)
            held = self.pending.get(trace_id)
            if held is None:
                self.pending[trace_id] = trace
            else:  # spans and log records that came meanwhile: merged, each once
                held.resources = trace.resources + held.resources
                held.span_ids |= trace.span_ids
                held.logs = trace.logs + held.logs
                held.log_keys |= trace.log_keys
                held.root = held.root or trace.root

    def drop(self, trace_id: bytes, span_ids: set[bytes], log_keys: set[bytes] = frozenset()
             ) -> None:
        """Journal replay: these spans and log records of the trace were written before; no
        longer held.
        """
        with self.lock:
            trace = self.pending.get(trace_id)
            if trace is None:
                return
            gone, gone_logs = trace.span_ids & span_ids, trace.log_keys & log_keys
            if not gone and not gone_logs:
                return
            trace.span_ids -= gone
            trace.log_keys -= gone_logs
            self.spans -= len(gone)
            self.log_records -= len(gone_logs)
            if not trace.span_ids and not trace.log_keys:
                del self.pending[trace_id]
                return
            kept = []
            for resource in trace.resources:
                for scope in resource.scope_spans:
                    keep = [s for s in scope.spans if s.span_id not in gone]
                    del scope.spans[:]
                    scope.spans.extend(keep)
                if any(scope.spans for scope in resource.scope_spans):
                    kept.append(resource)
            trace.resources = kept
            trace.root = any(not s.parent_span_id for r in kept for sc in r.scope_spans
                             for s in sc.spans)
            kept_logs = []
            for resource in trace.logs:
                for scope in resource.scope_logs:
                    keep = [r for r in scope.log_records if log_key(r) not in gone_logs]
                    del scope.log_records[:]
                    scope.log_records.extend(keep)
                if any(scope.log_records for scope in resource.scope_logs):
                    kept_logs.append(resource)
            trace.logs = kept_logs

    def held(self) -> int:
        """Spans and log records held, grouped or still queued (the caller holds the lock)."""
        return self.spans + self.log_records + self.queued + self.queued_logs

    def snapshot(self) -> list[tuple[bytes, bytes]]:
        """Every span and log record held (queued, pending or being written), as journal
        records: (SPANS, a serialized ExportTraceServiceRequest) or (LOGS, an
        ExportLogsServiceRequest).
        """
        with self.lock:
            records = [(LOGS if isinstance(request, ExportLogsServiceRequest) else SPANS, raw)
                       for request, raw, _ in self.inbound]
            for trace in (*self.pending.values(), *self.writing.values()):
                if trace.resources:
                    records.append((SPANS, ExportTraceServiceRequest(
                        resource_spans=trace.resources).SerializeToString()))
                if trace.logs:
                    records.append((LOGS, ExportLogsServiceRequest(
                        resource_logs=trace.logs).SerializeToString()))
            return records

    def counts(self) -> dict:
        """Traces, spans and log records held now (those not yet grouped included)."""
        with self.lock:
            return {"pending_traces": len(self.pending) + len(self.writing),
                    "pending_spans": self.spans + self.queued,
                    "pending_log_records": self.log_records + self.queued_logs}


# --- the journal ------------------------------------------------------------------------------

# record kinds: a request's spans; a request's log records; a trace now in the inbox (its trace
# id, its number of spans, span ids, log record keys); the same from before log records were
# held (trace id, span ids), still read at replay
SPANS, LOGS, WRITTEN, _WRITTEN_SPANS = b"S", b"L", b"D", b"W"
_HEAD = struct.Struct(">cII")  # kind, payload length, CRC-32 of the payload


def written_record(trace_id: bytes, trace: Trace) -> bytes:
    """The WRITTEN record's payload for a trace: all it held is in the inbox."""
    return (trace_id + struct.pack(">I", len(trace.span_ids)) + b"".join(sorted(trace.span_ids))
            + b"".join(sorted(trace.log_keys)))


class Journal:
    """Append-only, fsynced record files. One thread writes: whatever was appended while it
    fsynced goes out with the next fsync (group commit), so concurrent requests share the cost.
    """

    def __init__(self, folder: Path, traces: Traces):
        """Replay `folder`'s segments into `traces`, then start a fresh, compacted segment."""
        self.folder, self.traces = folder, traces
        folder.mkdir(parents=True, exist_ok=True)
        self.queue: list[tuple[bytes, concurrent.futures.Future]] = []
        self.cond = threading.Condition()
        self.closed = False
        self.recovered, self.recovered_logs = self._replay()
        self.fd, self.size = -1, 0
        self._compact()
        self.thread = threading.Thread(target=self._run, name="collect-journal", daemon=True)
        self.thread.start()

    def segments(self) -> list[Path]:
        """The journal's files, oldest first."""
        return sorted(self.folder.glob("journal-*.log"))

    def _replay(self) -> tuple[int, int]:
        """Spans and log records of every segment back into `traces` (minus those recorded
        written); a record cut short or corrupt ends its segment's reading: it was never
        acknowledged. The numbers of spans and of log records held then.
        """
        for path in self.segments():
            for kind, payload in records(path.read_bytes()):
                if kind in (SPANS, LOGS):
                    request = (ExportTraceServiceRequest if kind == SPANS
                               else ExportLogsServiceRequest)()
                    request.ParseFromString(payload)
                    self.traces.add(request, time.monotonic())
                elif kind == WRITTEN:
                    (spans,) = struct.unpack_from(">I", payload, 16)
                    ends = 20 + 8 * spans
                    self.traces.drop(payload[:16], _ids(payload, 20, ends),
                                     _ids(payload, ends, len(payload)))
                elif kind == _WRITTEN_SPANS:
                    self.traces.drop(payload[:16], _ids(payload, 16, len(payload)))
        counts = self.traces.counts()
        return counts["pending_spans"], counts["pending_log_records"]

    def _compact(self) -> None:
        """A new segment holding only the spans still held; the older segments removed."""
        old = self.segments()
        number = int(old[-1].stem.split("-")[1]) + 1 if old else 1
        path = self.folder / f"journal-{number:08d}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # traces hold PII
        with self.traces.lock:  # about what the snapshot holds, and where what comes after starts
            held, received_at = self.traces.held(), self.traces.received
        data = b"".join(record(kind, p) for kind, p in self.traces.snapshot())
        try:
            os.write(fd, data)
            os.fsync(fd)
            io.fsync_folder(self.folder)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.size, self.held_at, self.received_at = fd, len(data), held, received_at
        # the next compaction once the segment doubled: when most of it is still held (a burst),
        # compacting at a fixed size would rewrite it after every batch
        self.compact_at = max(SEGMENT_BYTES, 2 * self.size)
        for stale in old:  # only now: until the new segment is durable they hold the spans
            stale.unlink()
        io.fsync_folder(self.folder)

    def append(self, kind: bytes, payload: bytes) -> concurrent.futures.Future:
        """Queue a record; the future is done once it is on disk (or failed with the OSError)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            if self.closed:
                raise OSError("the journal is closed (collect is stopping)")
            # framed (CRC-32) by the journal's thread: zlib.crc32 costs ~0.2 ms a 256 kB request
            # and releases the GIL, so there it runs beside the event loop instead of on it
            self.queue.append((kind, payload, done))
            self.cond.notify()
        return done

    def queued_bytes(self) -> int:
        """Bytes appended but not on disk yet."""
        with self.cond:
            return sum(_HEAD.size + len(p) for _, p, _ in self.queue)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                batch, self.queue = self.queue, []
                if not batch and self.closed:
                    return
            parts = [part for kind, payload, _ in batch
                     for part in (_HEAD.pack(kind, len(payload), zlib.crc32(payload)), payload)]
            size = sum(map(len, parts))
            try:
                _write_all(self.fd, parts)
                os.fsync(self.fd)
            except OSError as err:
                # a full disk: cut the segment back to its last whole record, so that the records
                # after this failed batch stay readable at replay
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, self.size)
                for _, _, done in batch:
                    done.set_exception(err)
                continue
            self.size += size
            for _, _, done in batch:
                done.set_result(None)
            if self.size > self.compact_at and self._mostly_held():
                # compacting now would rewrite most of the segment (a burst not yet written
                # into the inbox): again once it doubled
                self.compact_at = 2 * self.size
            elif self.size > self.compact_at:
                try:
                    self._compact()
                except OSError as err:  # the old segments still hold everything: go on with them
                    print(f"collect: compacting the journal in {self.folder} failed ({err}); "
                          f"it keeps growing until that works", file=sys.stderr, flush=True)

    def _mostly_held(self) -> bool:
        """Whether more than half of the spans and log records this segment journaled are still
        held.
        """
        with self.traces.lock:
            journaled = self.held_at + self.traces.received - self.received_at
            return 2 * self.traces.held() > journaled

    def close(self) -> None:
        """Write what is queued, then stop."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()
        os.close(self.fd)


def record(kind: bytes, payload: bytes) -> bytes:
    """One journal record: its head (kind, length, CRC-32) and payload."""
    return _HEAD.pack(kind, len(payload), zlib.crc32(payload)) + payload


def records(data: bytes):
    """A journal segment's (kind, payload) records in order; one cut short or corrupt ends the
    segment (it was never acknowledged). The reader of `record`'s writing (and erase's).
    """
    at = 0
    while at + _HEAD.size <= len(data):
        kind, size, crc = _HEAD.unpack_from(data, at)
        payload = data[at + _HEAD.size: at + _HEAD.size + size]
        if len(payload) != size or zlib.crc32(payload) != crc:
            return
        at += _HEAD.size + size
        yield kind, payload


def _ids(payload: bytes, start: int, end: int) -> set[bytes]:
    """The 8-byte ids (span ids, log record keys) packed in payload[start:end]."""
    return {payload[i:i + 8] for i in range(start, end, 8)}


def _write_all(fd: int, parts: list[bytes]) -> None:
    """Write the parts in order, without joining them first (a burst's batch is tens of MB)."""
    limit = os.sysconf("SC_IOV_MAX")
    for at in range(0, len(parts), limit):
        chunk = parts[at:at + limit]
        written = os.writev(fd, chunk)
        total = sum(map(len, chunk))
        if written < total:  # short only on a full disk; the rest by plain writes (or the error)
            rest = b"".join(chunk)[written:]
            while rest:
                rest = rest[os.write(fd, rest):]


# --- writing finished traces ------------------------------------------------------------------

def write_file(inbox: Path, documents: list[dict], number: int) -> Path:
    """Traces as one JSONL inbox file (an OTLP JSON document a line, as a Collector's file
    exporter writes), whole: a hidden temporary file (which ingest and DVC skip), fsynced,
    renamed. The name sorts by time and never repeats, so a file already ingested is never
    replaced (ingest knows inbox files by name).
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    path = inbox / f"otlp-{stamp}-{number:04d}.jsonl"
    io.write_lines_durably(path, (json.dumps(document, separators=(",", ":")).encode() + b"\n"
                                  for document in documents))
    return path


# --- the receiver -----------------------------------------------------------------------------

class Collector:
    """The receiver's state: held traces, the journal, the counters; `app` serves it."""

    def __init__(self, settings: cfg.Collect, inbox: Path, spool: Path):
        """Lock `spool` (one receiver per journal), replay its journal, start the writer."""
        self.settings, self.inbox, self.spool = settings, inbox, spool
        inbox.mkdir(parents=True, exist_ok=True)
        spool.mkdir(parents=True, exist_ok=True)
        self.lock_file = open(spool / "lock", "w")
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_file.close()
            raise WorkspaceError(f"{spool}: another `offseason collect` uses this journal; "
                                 f"stop it first (one receiver per workspace)") from None
        (spool / COLLECT_HELD.name).unlink(missing_ok=True)  # what it held is this one's now
        self.token = os.environ.get(settings.token_env, "")
        self.counters = dict.fromkeys(
            ("requests", "bytes", "spans", "duplicate_spans", "invalid_spans", "late_spans",
             "log_records", "duplicate_log_records", "untraced_log_records", "late_log_records",
             "traces_written", "files_written", "write_errors"), 0)
        self.rejected = dict.fromkeys(("unauthorized", "queue_full", "disk_full", "too_large",
                                       "bad_request", "unsupported"), 0)
        self.started = time.time()
        self.traces = Traces(settings.idle_seconds)
        self.journal = Journal(spool / "journal", self.traces)
        self.counters["recovered_spans"] = self.journal.recovered
        self.counters["recovered_log_records"] = self.journal.recovered_logs
        self.free_checked, self.disk_short = 0.0, ""
        self.stopping = threading.Event()
        self.gathered: list[tuple[bytes, Trace]] = []  # finished, waiting for their file
        self.gathering_since = 0.0
        self.writer = threading.Thread(target=self._write_loop, name="collect-writer", daemon=True)
        self.writer.start()

    # the writer thread
    def _write_loop(self) -> None:
        while not self.stopping.wait(TICK):
            self.write_finished()

    def write_finished(self, everything: bool = False, closing: bool = False) -> int:
        """Group what came; once the oldest finished trace waited `runtime.collect.file_seconds`
        (or with `everything`), write the finished traces into the inbox and record them in the
        journal (`closing`: see `Traces.finished`). The number of traces written.
        """
        now = time.monotonic()
        counts = self.traces.group(now)
        for key, name in (("duplicate", "duplicate_spans"), ("invalid", "invalid_spans"),
                          ("late", "late_spans"), ("duplicate_logs", "duplicate_log_records"),
                          ("untraced_logs", "untraced_log_records"),
                          ("late_logs", "late_log_records")):
            self.counters[name] += counts[key]
        finished = self.traces.finished(now, closing=closing)
        if finished and not self.gathered:
            self.gathering_since = now
        self.gathered += finished
        if not self.gathered or (now - self.gathering_since < self.settings.file_seconds
                                 and not everything):
            return 0
        gathered, self.gathered = self.gathered, []
        for number, at in enumerate(range(0, len(gathered), FILE_TRACES)):
            if not self._write(gathered[at:at + FILE_TRACES], number):
                for trace_id, _ in gathered[at + FILE_TRACES:]:  # kept for the next try too
                    self.traces.put_back(trace_id)
                return at
        return len(gathered)

    def _write(self, traces: list[tuple[bytes, Trace]], number: int) -> bool:
        """One inbox file of these traces, recorded in the journal; False if it failed (they are
        held again, and tried again shortly).
        """
        try:
            # one file: ingest reads each trace by its own convention, and quarantines alone
            # a trace it cannot read
            # a trace's spans and log records in one document: ingest joins the GenAI events
            # of log records to their spans only within one file
            write_file(self.inbox, [otlp_json(trace.resources, trace.logs) for _, trace in traces],
                       number)  # fsynced
        except Exception as err:  # a full disk, say: kept (and journaled), tried again shortly
            self.counters["write_errors"] += 1
            for trace_id, _ in traces:
                self.traces.put_back(trace_id)
            print(f"collect: could not write {len(traces)} traces into {self.inbox} ({err}); "
                  f"kept, tried again shortly", file=sys.stderr, flush=True)
            return False
        try:
            futures = [self.journal.append(WRITTEN, written_record(trace_id, trace))
                       for trace_id, trace in traces]
            for future in futures:
                future.result()
        except OSError as err:
            # the files are in the inbox; without the record a restart writes them again, which
            # ingest counts as duplicates: nothing is lost
            print(f"collect: could not record written traces in the journal ({err})",
                  file=sys.stderr, flush=True)
        for trace_id, _ in traces:
            self.traces.written(trace_id)
        self.counters["traces_written"] += len(traces)
        self.counters["files_written"] += 1
        return True

    def close(self) -> None:
        """Stop writing: every trace whose root ended goes into the inbox now; the unfinished
        ones stay in the journal for the next start, said on stderr and in `held.json` (which
        `offseason run` reports until collect starts again).
        """
        self.stopping.set()
        self.writer.join()
        written = self.counters["traces_written"]
        self.write_finished(everything=True, closing=True)
        self.journal.close()
        held = self.traces.counts()
        note = self.spool / COLLECT_HELD.name
        if held["pending_traces"]:
            io.write_json(note, {**held, "stopped": datetime.now(timezone.utc).isoformat(
                timespec="seconds")})
        else:
            note.unlink(missing_ok=True)
        print(f"collect: stopped; {self.counters['traces_written'] - written} finished traces "
              f"written on the way out" + (
                  f"; {held['pending_traces']} unfinished traces ({held['pending_spans']} spans) "
                  f"kept in {self.spool}, written once they finish after `offseason collect` "
                  f"starts again" if held["pending_traces"] else ""), file=sys.stderr, flush=True)
        self.lock_file.close()

    # requests
    def check_token(self, authorization: str) -> None:
        """Refused (401) unless the bearer token matches, when one is set."""
        if self.token and not hmac.compare_digest(authorization.encode(),
                                                  f"Bearer {self.token}".encode()):
            raise Refused(401, "unauthorized", f"missing or wrong bearer token (the one in "
                          f"${self.settings.token_env} where collect runs); send the header "
                          f"'Authorization: Bearer <token>' (OTEL_EXPORTER_OTLP_HEADERS="
                          f"Authorization=Bearer%20<token>)")

    def check_room(self) -> None:
        """Refused (429/503, with Retry-After) when the held spans and log records, or the disk,
        are at their limit.
        """
        held = self.traces.counts()
        if held["pending_spans"] + held["pending_log_records"] >= self.settings.max_pending_spans:
            raise Refused(429, "queue_full", f"{self.settings.max_pending_spans} spans and log "
                          f"records wait for their traces to finish (runtime.collect."
                          f"max_pending_spans); retry later", retry=True)
        now = time.monotonic()
        if now - self.free_checked > 1.0:  # statvfs per request would cost more than it tells
            self.free_checked, self.disk_short = now, ""
            for where in (self.spool, self.inbox):
                free = shutil.disk_usage(where).free
                if free < self.settings.min_free_mb << 20:
                    self.disk_short = (f"{where}: {free >> 20} MB free, under "
                                       f"runtime.collect.min_free_mb={self.settings.min_free_mb}; "
                                       f"free space there (run a cycle: ingest reads the inbox)")
        if self.disk_short:
            raise Refused(503, "disk_full", self.disk_short, retry=True)

    async def export(self, body: bytes, content_type: str, encoding: str, logs: bool = False
                     ) -> tuple[bytes, str]:
        """Accept one request's spans (or, with `logs`, log records): held, journaled and
        fsynced; the response body and type.
        """
        request, raw = decode(body, content_type, encoding, self.settings.max_request_bytes,
                              ExportLogsServiceRequest if logs else ExportTraceServiceRequest)
        # queued before it is journaled, so that a journal compaction in between (a snapshot of
        # what is held) cannot miss it; if journaling fails it may still be written (the client
        # retries: its spans are then duplicates, dropped by span id or log record hash, or by
        # ingest)
        n = self.traces.receive(request, raw)
        if n:
            try:
                await asyncio.wrap_future(self.journal.append(LOGS if logs else SPANS, raw))
            except OSError as err:
                self.disk_short = f"{self.spool}: writing the journal failed ({err})"
                self.free_checked = time.monotonic()
                raise Refused(503, "disk_full", self.disk_short, retry=True) from None
        self.counters["log_records" if logs else "spans"] += n
        response = ExportLogsServiceResponse() if logs else ExportTraceServiceResponse()
        if content_type.split(";")[0].strip().lower() == "application/json":
            return json.dumps(json_format.MessageToDict(response)).encode(), "application/json"
        return response.SerializeToString(), PROTOBUF

    def status(self) -> dict:
        """The counters, the held traces and where they go."""
        return {**self.counters, "rejected": dict(self.rejected), **self.traces.counts(),
                "journal_queued_bytes": self.journal.queued_bytes(),
                "journal_bytes": self.journal.size,  # what a restart would replay
                "disk": self.disk_short or "ok", "inbox": str(self.inbox),
                "uptime_seconds": round(time.time() - self.started, 1)}


def app(collector: Collector):
    """The ASGI application: POST /v1/traces, POST /v1/logs, GET /status."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def refused(err: Refused) -> Response:
        collector.rejected[err.counter] += 1
        headers = {"Retry-After": str(RETRY_AFTER)} if err.retry else {}
        if err.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse({"code": err.status, "message": err.message}, err.status, headers)

    async def receive(request: Request) -> Response:
        collector.counters["requests"] += 1
        try:
            collector.check_token(request.headers.get("authorization", ""))
            collector.check_room()
            limit = collector.settings.max_request_bytes
            if int(request.headers.get("content-length") or 0) > limit:
                raise Refused(413, "too_large", f"the body is over runtime.collect."
                              f"max_request_bytes={limit}; export smaller batches")
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise Refused(413, "too_large", f"the body is over runtime.collect."
                                  f"max_request_bytes={limit}; export smaller batches")
            collector.counters["bytes"] += len(body)
            content, media = await collector.export(
                bytes(body), request.headers.get("content-type", ""),
                request.headers.get("content-encoding", ""), request.url.path == "/v1/logs")
        except Refused as err:
            return refused(err)
        return Response(content, 200, media_type=media)

    async def status(request: Request) -> Response:
        try:
            collector.check_token(request.headers.get("authorization", ""))
        except Refused as err:
            return refused(err)
        return JSONResponse(collector.status())

    return Starlette(routes=[Route("/v1/traces", receive, methods=["POST"]),
                             Route("/v1/logs", receive, methods=["POST"]),
                             Route("/status", status, methods=["GET"])])


def serve(settings: cfg.Collect, inbox: Path, spool: Path) -> int:
    """Receive until Ctrl-C or SIGTERM; the traces still held wait in the journal."""
    import uvicorn

    collector = Collector(settings, inbox, spool)
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.host, settings.port))
        except OSError as err:
            sock.close()
            raise WorkspaceError(f"runtime.collect: cannot listen on {settings.host}:"
                                  f"{settings.port} ({err.strerror}); is another receiver on it? "
                                  f"Choose another with --port") from None
        sock.listen(2048)  # before the banner: a client that read it can connect at once
        host, port = sock.getsockname()[:2]
        if collector.token:
            guard = f"bearer token from ${settings.token_env}"
        else:
            guard = f"no token (${settings.token_env} is not set)"
        print(f"collect: listening on http://{host}:{port}/v1/traces and /v1/logs ({guard}); "
              f"finished traces go to {inbox}/; {collector.counters['recovered_spans']} spans "
              f"and {collector.counters['recovered_log_records']} log records recovered from "
              f"the journal", flush=True)
        server = uvicorn.Server(uvicorn.Config(app(collector), log_level="warning",
                                               access_log=False, lifespan="off", **FAST))
        # uvicorn stops gracefully on SIGINT/SIGTERM, then raises the signal again for the
        # handler it found: this one, which ends the process through the `finally` below (the
        # default handler would end it at once, before the finished traces are written)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _stopped)
        server.run(sockets=[sock])
    finally:
        collector.close()
    return 0


def beside(root: Path) -> subprocess.Popen:
    """`offseason collect` as a child of another long-running command (`offseason serve
    --collect`), in an interpreter of its own so that receiving shares the GIL with no flow run;
    returns once it listens (its first line, passed on).
    """
    child = subprocess.Popen([sys.executable, "-m", "flows.cli", "collect"], cwd=root,
                             stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if "listening" not in line:
        child.wait()
        raise WorkspaceError(f"offseason collect did not start (exit {child.returncode}; its "
                             f"error is above); run `offseason collect` alone to see it")
    print(line, end="", flush=True)
    return child


def stop(child: subprocess.Popen) -> None:
    """Stop a receiver started by `beside` as Ctrl-C would: what is finished is written first."""
    child.terminate()
    child.wait(timeout=60)


def _stopped(signum: int, frame) -> None:
    raise SystemExit(0)


class NotRunning(WorkspaceError):
    """No receiver answers at the status address."""


def read_status(url: str, token: str) -> dict:
    """A running receiver's counters (GET /status); NotRunning when none answers there."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(url, headers=headers, timeout=5)
    except httpx.HTTPError as err:
        raise NotRunning(f"{url}: no `offseason collect` answers there ({err}); start one, or "
                         f"give --host/--port of the running one") from None
    if response.status_code == 401:
        raise WorkspaceError(f"{url}: 401: set the receiver's token in the environment variable "
                             f"that runtime.collect.token_env names")
    if response.status_code != 200:
        raise WorkspaceError(f"{url}: HTTP {response.status_code}: is that `offseason collect`?")
    return response.json()


def status_text(status: dict) -> str:
    """The counters, for a terminal."""
    rejected = ", ".join(f"{k} {v}" for k, v in status["rejected"].items() if v) or "none"
    return (f"collect: {status['spans']} spans and {status['log_records']} log records accepted "
            f"in {status['requests']} requests ({status['bytes']} bytes), "
            f"{status['traces_written']} traces written in {status['files_written']} files to "
            f"{status['inbox']}; held now: {status['pending_traces']} traces, "
            f"{status['pending_spans']} spans, {status['pending_log_records']} log records; "
            f"rejected: {rejected}; duplicate spans {status['duplicate_spans']}, late "
            f"{status['late_spans']}, invalid {status['invalid_spans']}; log records duplicate "
            f"{status['duplicate_log_records']}, late {status['late_log_records']}, of no trace "
            f"(dropped) {status['untraced_log_records']}; recovered at start "
            f"{status['recovered_spans']} spans, {status['recovered_log_records']} log records; "
            f"disk {status['disk']}; up {status['uptime_seconds']} s")

