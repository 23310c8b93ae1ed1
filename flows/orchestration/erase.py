"""`offseason erase`: a deletion request removes a person's traces from what offseason keeps.

Finds the person by the index ingest keeps beside each inbox file's part (`data/traces/index-*`,
salted hashes: stages/erasure.py), then, under the cycle lock (never while a cycle runs):

1. **Tombstone** (`data/tombstones.jsonl`, git-tracked: salted hashes, reason, date, no personal
   data): ingest drops a tombstoned subject's or trace's records before writing them anywhere,
   validate, train's replay and the benchmark refresh drop tombstoned traces, `offseason pull`
   skips them: the data enters no later cycle.
2. **Rewrite** every current file that holds the rows, each whole (a temporary file renamed):
   the inbox files, `data/traces/` (parts, duplicates, index, manifest), every Parquet and JSONL
   file under `data/` with a `trace_id` or `task_id` (ingested, validated, held-out pool,
   quarantine, rollouts, rewards, replay, train episodes, benchmarks), the collect journal and
   pull's state; then `dvc commit` of the stages that hold them, `dvc push`, and a git commit,
   as a cycle commits.
3. **Purge** the older versions: every DVC object git history records for those paths (dvc.lock
   and the `.dvc` files of every commit) whose content holds the rows is deleted from the cache
   and each local remote, and recorded in the tombstones as erased (`offseason lineage --verify`
   says "erased", not "missing"); DVC's run-cache goes (it names the old objects); MLflow
   artifacts holding the rows are deleted, and runs whose logged data holds them are deleted
   for good (`mlflow gc`).
4. **Models** (`erase.models`): the generations that learned from the traces are listed;
   keep (serve on, excluded from the next cycle), flag (named in the receipt, erasures.jsonl
   and `lineage --trace`),
   or rollback (the champion goes back to the newest generation that never saw them).
5. **Upstream** (flows/orchestration/upstream.py): the traces `offseason pull` brought in,
   found (service, project) before anything is rewritten; with `--upstream` deleted in
   Langfuse or LangSmith through the vendor's SDK, the request and answer recorded; both delete
   asynchronously, so `--status` asks again until each is confirmed gone. Without it, the
   receipt lists them as left. A service unreachable or refusing keeps the request open.
6. **Receipt**: `.offseason/erasures/<id>.json` and `.txt`, and a line in `erasures.jsonl`
   (git-tracked, no personal data: received and done dates, per service asked: when, the
   answer, when confirmed); `<id>.upstream.json` keeps the trace ids asked about until then.
   A kill at any point and the same command again finishes the same erasure
   (`.offseason/erasures/<subject>.pending.json` holds what was found until it is done).

    offseason erase --user ID [--reason TEXT] [--dry-run]
    offseason erase --trace ID | --session ID | --field NAME=VALUE [--upstream]
    offseason erase --status             # open requests against erase.deadline_days; asks the
                                         # services again about deletions asked upstream
"""

from __future__ import annotations

import base64
import datetime as dt
import gzip
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from flows.audit import lineage
from flows.orchestration import upstream as vendors
from flows.project.workspace import COLLECT_SPOOL, WorkspaceError, dvc, dvc_remotes, git
from stages import erasure, io

LOG = "erasures.jsonl"  # git-tracked: each request, received and done, no personal data
RECEIPTS = Path(".offseason") / "erasures"
LINE_FORMATS = ("openai-chat", "openai-responses")
# folders of data/ that hold no rows of traces (pages, profiles of counts, environments' tasks)
NOT_ROWS = ("data/inbox", "data/traces", "data/docs", "data/profiles", "data/tasks")


class EraseError(WorkspaceError):
    """An erasure that cannot go on; the message says what to do."""


def fault(phase: str) -> None:
    """Tests kill an erasure midway, as `kill -9` does: OFFSEASON_FAIL_AT=erase:<phase>
    (rewrite, commit, purge) SIGKILLs this process there.
    """
    if os.environ.get("OFFSEASON_FAIL_AT") == f"erase:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def now() -> str:
    """The time, UTC, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Found:
    """A person's traces: their ids as the files keep them, their places (inbox file, line), the
    inbox files and their formats.
    """

    traces: set[str] = field(default_factory=set)
    places: set[tuple[str, int]] = field(default_factory=set)
    files: dict[str, str] = field(default_factory=dict)
    index_rows: int = 0

    def to_json(self) -> dict:
        """As the pending file keeps it."""
        return {"traces": sorted(self.traces), "places": sorted(map(list, self.places)),
                "files": self.files, "index_rows": self.index_rows}

    @classmethod
    def from_json(cls, data: dict) -> Found:
        """Back from the pending file."""
        return cls(set(data["traces"]), {(f, int(n)) for f, n in data["places"]},
                   dict(data["files"]), data["index_rows"])

    def holds(self, row: dict) -> bool:
        """Whether a row (of any file offseason writes) is one of these traces'."""
        trace = row.get("trace_id")
        if trace is None and "task_id" in row:
            trace = erasure.trace_of_task(row.get("task_id"), row.get("environment"))
        if trace is not None and str(trace) in self.traces:
            return True
        place = (row.get("source_file"), row.get("source_line"))
        return place in self.places


def subject_of(args_kind: str, value: str) -> tuple[str, str]:
    """(kind, value) from the command line: user, session, trace, or field NAME=VALUE."""
    if args_kind == "field":
        name, eq, found = value.partition("=")
        if not eq or not name:
            raise EraseError(f"--field {value!r}: write NAME=VALUE, e.g. --field "
                             f"customer_id=C-1042 (NAME as erase.subject_fields lists it)")
        return f"field:{name}", found
    return args_kind, value


def lookup(root: Path, subject: str | set[str]) -> Found:
    """The traces the index holds for a subject hash (or any of a set): one filtered read of
    each index part.
    """
    found = Found()
    folder = root / "data" / "traces"
    parts = sorted(folder.glob(f"{erasure.INDEX_PREFIX}*.parquet")) if folder.is_dir() else []
    if not parts:
        return found
    import pyarrow.dataset as ds

    wanted = ds.field("subject") == subject if isinstance(subject, str) else \
        ds.field("subject").isin(sorted(subject))
    table = ds.dataset([str(p) for p in parts], schema=erasure.INDEX, format="parquet").to_table(
        filter=wanted)
    for row in table.to_pylist():
        found.index_rows += 1
        if row["trace_id"] is not None:
            found.traces.add(row["trace_id"])
        found.places.add((row["source_file"], row["source_line"]))
        found.files[row["source_file"]] = row["format"]
    return found


def widen(root: Path, key: bytes, found: Found) -> Found:
    """Every index row of the traces found (a trace's other subjects' rows, its duplicates)."""
    hashes = {erasure.digest(key, "trace", t) for t in found.traces}
    if hashes:  # one read of the index for all of them
        more = lookup(root, hashes)
        found.traces |= more.traces
        found.places |= more.places
        found.files.update(more.files)
    return found


# --- the tombstones ---------------------------------------------------------------------------

def tombstone(root: Path, entries: list[dict]) -> None:
    """Add tombstones (each once), the file rewritten whole."""
    path = root / erasure.TOMBSTONES
    rows = io.read_jsonl(path) if path.exists() else []
    have = {(r.get("hash"), r.get("object")) for r in rows}
    rows += [e for e in entries if (e.get("hash"), e.get("object")) not in have]
    io.write_jsonl(path, rows)


def erased_objects(root: Path) -> dict[str, dict]:
    """The DVC objects erasures deleted, by md5: {path, erasure, date}."""
    path = root / erasure.TOMBSTONES
    rows = io.read_jsonl(path) if path.exists() else []
    return {r["object"]: r for r in rows if r.get("object")}


# --- rewriting the current files --------------------------------------------------------------

def _read_raw(path: Path) -> tuple[bytes, bool]:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data), True
    return data, False


def _write_raw(path: Path, data: bytes, zipped: bool) -> None:
    if zipped:
        data = gzip.compress(data, mtime=0)
    io.write_lines_durably(path, [data])


def id_forms(traces: set[str]) -> set[str]:
    """The ids as files may write them: as they are, and an OTLP id's hex as base64 too."""
    forms = set(traces)
    for trace in traces:
        try:
            forms.add(base64.b64encode(bytes.fromhex(trace)).decode())
        except ValueError:
            pass
    return forms


def _names_any(value, ids: set[str]) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item in ids:
                return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return False


_SPANS = (("resourceSpans", "scopeSpans", "spans"), ("resourceLogs", "scopeLogs", "logRecords"))


def _drop_otlp(document: dict, ids: set[str]) -> bool:
    """Remove the spans and log records of `ids` from an OTLP JSON document in place; whether
    anything was removed.
    """
    removed = False
    for resources_key, scopes_key, items_key in _SPANS:
        for resource in document.get(resources_key) or []:
            for scope in resource.get(scopes_key) or []:
                items = scope.get(items_key) or []
                kept = [i for i in items if str(i.get("traceId")) not in ids]
                if len(kept) != len(items):
                    scope[items_key] = kept
                    removed = True
    return removed


def rewrite_inbox_file(path: Path, fmt: str, lines: set[int], ids: set[str]) -> int:
    """The inbox file without the rows: a line format's lines by number, a span format's records
    (an OTLP document's spans) by trace id. Written whole; removed when nothing is left. The
    number of lines dropped or changed.
    """
    data, zipped = _read_raw(path)
    raw_lines = data.split(b"\n")
    if fmt in LINE_FORMATS and not (data.lstrip()[:1] == b"[" and len(raw_lines) > 1 and
                                    not raw_lines[0].strip().endswith(b"}")):
        kept = [line for number, line in enumerate(raw_lines, start=1) if number not in lines]
        changed = len(raw_lines) - len(kept)
    else:
        kept, changed = [], 0
        for line in raw_lines:
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                kept.append(line)
                continue
            if isinstance(record, dict) and any(k in record for k, _, _ in _SPANS):
                if _drop_otlp(record, ids):
                    changed += 1
                    line = json.dumps(record, ensure_ascii=False).encode()
                kept.append(line)
            elif record is not None and _names_any(record, ids):
                changed += 1
            else:
                kept.append(line)
    if not changed:
        return 0
    out = b"\n".join(kept)
    if not out.strip():
        path.unlink()
        io.fsync_folder(path.parent)
    else:
        _write_raw(path, out, zipped)
    return changed


def _sha256(path: Path) -> str | None:
    import hashlib

    if not path.exists():
        return None
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _nothing(path: Path) -> None:
    pass


def filter_parquet(path: Path, found: Found, intend=_nothing) -> int:
    """The Parquet file without the rows of the traces found; the number of rows removed.
    `intend(path)` is called before the file is replaced.
    """
    schema = pq.read_schema(path)
    names = [n for n in ("trace_id", "task_id", "environment", "source_file", "source_line")
             if n in schema.names]
    if not {"trace_id", "task_id", "source_file"} & set(names):
        return 0
    keys = pq.read_table(path, columns=names).to_pylist()
    mask = [not found.holds(row) for row in keys]
    if all(mask):
        return 0
    table = pq.read_table(path).filter(pa.array(mask, pa.bool_()))
    intend(path)
    groups = erasure.INDEX_ROW_GROUP if path.name.startswith(erasure.INDEX_PREFIX) else None
    io.write_parquet(path, table.replace_schema_metadata(schema.metadata), groups)
    return mask.count(False)


def filter_jsonl(path: Path, found: Found, intend=_nothing) -> int:
    """The JSONL file without the rows of the traces found; the number of rows removed.
    `intend(path)` is called before the file is replaced.
    """
    try:
        rows = io.read_jsonl(path)
    except ValueError:  # not rows of JSON: no trace of ours in it
        return 0
    kept = [r for r in rows if not (isinstance(r, dict) and found.holds(r))]
    if len(kept) == len(rows):
        return 0
    intend(path)
    io.write_jsonl(path, kept)
    return len(rows) - len(kept)


def rewrite_traces(root: Path, found: Found, inbox_digests: dict[str, str | None],
                   intend=_nothing) -> dict:
    """data/traces/ without the rows: parts, duplicates, index; the manifest's counts and the
    rewritten inbox files' digests (ingest would warn of a file changed since it read it).
    """
    folder = root / "data" / "traces"
    removed = {}
    for path in sorted(folder.glob("*.parquet")):
        n = filter_parquet(path, found, intend)
        if n:
            removed[str(path.relative_to(root))] = n
    manifest_path = folder / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        for name, entry in manifest.items():
            if name in inbox_digests:
                entry["sha256"] = inbox_digests[name]
            part = folder / entry["part"]
            accepted = pq.read_metadata(part).num_rows if part.exists() else entry["accepted"]
            if accepted < entry["accepted"]:  # the part's rows as they are now (a killed
                # run's rewrite of it counted too)
                entry["erased"] = entry.get("erased", 0) + entry["accepted"] - accepted
                entry["accepted"] = accepted
        intend(manifest_path)
        io.write_json(manifest_path, manifest)
    return removed


def rewrite_data(root: Path, found: Found, intend=_nothing) -> dict:
    """Every other Parquet and JSONL file under data/ without the rows (benchmarks included)."""
    removed = {}
    for path in sorted((root / "data").rglob("*")):
        rel = str(path.relative_to(root))
        if not path.is_file() or path.name.startswith(".") or \
                any(rel == f or rel.startswith(f + "/") for f in NOT_ROWS):
            continue
        if path.suffix == ".parquet":
            n = filter_parquet(path, found, intend)
        elif path.suffix == ".jsonl" and rel != str(erasure.TOMBSTONES):
            n = filter_jsonl(path, found, intend)
        else:
            continue
        if n:
            removed[rel] = n
    return removed


def rewrite_collect_journal(root: Path, found: Found) -> tuple[int, str | None]:
    """The collect journal's segments without the spans and log records of the traces (their
    OTLP ids); (records changed, or why it was left: a receiver running).
    """
    folder = root / COLLECT_SPOOL / "journal"
    segments = sorted(folder.glob("journal-*.log")) if folder.is_dir() else []
    if not segments:
        return 0, None
    import fcntl

    lock = open(root / COLLECT_SPOOL / "lock", "a")
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0, (f"`offseason collect` is running and holds its journal ({folder}); stop "
                       f"it and run this erase again to finish")
        from flows.intake import collect

        raw_ids = set()
        for trace in found.traces:
            try:
                raw_ids.add(bytes.fromhex(trace))
            except ValueError:
                pass
        changed = 0
        for path in segments:
            out = []
            for kind, payload in collect.records(path.read_bytes()):
                if kind in (collect.SPANS, collect.LOGS):
                    request = (collect.ExportTraceServiceRequest if kind == collect.SPANS
                               else collect.ExportLogsServiceRequest)()
                    request.ParseFromString(payload)
                    if _drop_request(request, raw_ids, kind == collect.SPANS):
                        changed += 1
                        payload = request.SerializeToString()
                elif kind in (collect.WRITTEN, collect._WRITTEN_SPANS) and \
                        payload[:16] in raw_ids:
                    changed += 1
                    continue
                out.append(collect.record(kind, payload))
            if changed:
                io.write_lines_durably(path, out)
        return changed, None
    finally:
        lock.close()


def _drop_request(request, raw_ids: set[bytes], spans: bool) -> bool:
    removed = False
    for resource in (request.resource_spans if spans else request.resource_logs):
        for scope in (resource.scope_spans if spans else resource.scope_logs):
            items = scope.spans if spans else scope.log_records
            keep = [i for i in items if i.trace_id not in raw_ids]
            if len(keep) != len(items):
                removed = True
                copies = [type(i)() for i in keep]
                for copy, item in zip(copies, keep):
                    copy.CopyFrom(item)
                del items[:]
                items.extend(copies)
    return removed


def rewrite_pull_state(root: Path, found: Found) -> int:
    """The pull state's remembered ids without the traces' (pull skips tombstoned traces itself)."""
    changed = 0
    for path in sorted((root / ".offseason" / "pull").glob("*.json")):
        state = json.loads(path.read_text())
        ids = state.get("ids") or {}
        kept = {i: t for i, t in ids.items() if i not in found.traces}
        if len(kept) != len(ids):
            changed += len(ids) - len(kept)
            io.write_json(path, {**state, "ids": kept})
    return changed


# --- committing, as a cycle does --------------------------------------------------------------

def stages_touching(root: Path, paths: set[str]) -> list[str]:
    """The stages of dvc.lock with a dep or an out at (or above) any of `paths`."""
    lock = yaml.safe_load((root / "dvc.lock").read_text()) if (root / "dvc.lock").exists() \
        else {}
    names = []
    for name, stage in (lock.get("stages") or {}).items():
        recorded = [i["path"] for kind in ("deps", "outs") for i in stage.get(kind) or []]
        if any(p == r or p.startswith(r.rstrip("/") + "/") for p in paths for r in recorded):
            names.append(name)
    return names


def commit(root: Path, changed: set[str], message: str) -> list[dict]:
    """`dvc commit` of the stages and pointers holding `changed`, `dvc push`, git commit; what
    is left: the default remote when the push failed (an unreachable remote keeps the request
    open).
    """
    stages = stages_touching(root, changed)
    targets = list(stages)
    if any(p == "data/inbox" or p.startswith("data/inbox/") for p in changed) and \
            (root / "data" / "inbox.dvc").exists():
        targets.append("data/inbox.dvc")
    if targets:
        dvc(root, "commit", "--force", "--quiet", *targets)
    fault("commit")
    left = []
    default, remotes = dvc_remotes(root)
    if default:
        try:
            dvc(root, "push")
        except WorkspaceError as err:  # the new versions not there, the old ones not purged
            url = remotes.get(default, {}).get("url", "?")
            left.append({"what": f"the DVC remote {default} ({url})", "open": True,
                         "why": "unreachable: " + " ".join(str(err).split())[:400],
                         "todo": "make it reachable, then run this erase again to finish"})
    tracked = [p for p in ("dvc.lock", "data/inbox.dvc", str(erasure.TOMBSTONES), LOG)
               if (root / p).exists()]
    tracked += sorted(p for p in changed if git(root, "ls-files", "--", p))
    git(root, "add", "--", *tracked)
    git(root, "commit", "--quiet", "--allow-empty", "-m", message, "--", *tracked)
    return left


# --- purging older versions -------------------------------------------------------------------

def _recorded(root: Path, paths: set[str]) -> dict[str, str]:
    """Every (md5 -> path) git history records for `paths` (dvc.lock and the .dvc pointers of
    every commit), folders expanded to their files where the manifest is still stored.
    """
    found: dict[str, str] = {}
    commits = git(root, "rev-list", "--all").split()
    seen_docs: set[bytes] = set()
    for commit_id in commits:
        for doc in ("dvc.lock", "data/inbox.dvc"):
            data = lineage.show(root, commit_id, doc)
            if not data or data in seen_docs:
                continue
            seen_docs.add(data)
            parsed = yaml.safe_load(data) or {}
            entries = [o for s in (parsed.get("stages") or {}).values()
                       for kind in ("deps", "outs") for o in s.get(kind) or []] \
                if doc == "dvc.lock" else [{**o, "path": "data/inbox"} for o in
                                           parsed.get("outs") or []]
            for entry in entries:
                path, md5 = entry.get("path"), entry.get("md5")
                if not md5 or not any(path == p or p.startswith(path + "/") or
                                      path.startswith(p + "/") for p in paths):
                    continue
                if md5.endswith(".dir"):
                    data_dir = lineage.read_object(root, md5)
                    for item in json.loads(data_dir) if data_dir else []:
                        found.setdefault(item["md5"], f"{path}/{item['relpath']}")
                else:
                    found.setdefault(md5, path)
    return found


def _object_holds(data: bytes, path: str, found: Found, needles: list[bytes]) -> bool:
    """Whether a stored object (a version of `path`) holds any of the traces' rows."""
    if data[:4] == b"PAR1":
        table = lineage.read_parquet(data, None)
        names = [n for n in ("trace_id", "task_id", "environment", "source_file", "source_line")
                 if n in table.column_names]
        return any(found.holds(r) for r in table.select(names).to_pylist()) if names else False
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            pass
    return any(n in data for n in needles)


def purge(root: Path, paths: set[str], found: Found, needles: list[bytes], erasure_id: str
          ) -> tuple[list[dict], list[dict]]:
    """Delete every stored DVC object (cache and local remotes) that git history records for
    `paths` and that holds the rows; DVC's run-cache too. (what was deleted, what was left)
    """
    current: set[str] = set()
    for path in paths:
        local = root / path
        if local.is_file():
            current.add(lineage.md5_of(local.read_bytes()))
    doomed = {}
    for md5, path in sorted(_recorded(root, paths).items()):
        if md5 in current:
            continue
        data = lineage.read_object(root, md5)
        if data is not None and _object_holds(data, path, found, needles):
            doomed[md5] = path
    # tombstoned before deleted: a run killed midway leaves no object missing unexplained
    tombstone(root, [{"object": md5, "path": path, "erasure": erasure_id, "date": now()}
                     for md5, path in sorted(doomed.items())])
    deleted, left = [], []
    for md5, path in sorted(doomed.items()):
        for name, store in lineage.stores(root).items():
            obj = lineage.object_path(store, md5)
            if obj.exists():
                try:
                    obj.unlink()
                except OSError as err:
                    left.append({"what": f"{path} ({md5}) in the DVC {name}",
                                 "why": str(err), "todo": f"delete {obj} by hand"})
                    continue
                deleted.append({"md5": md5, "path": path, "store": name})
                fault("purge")
    for name, store in lineage.stores(root).items():
        runs = store / "runs"
        if runs.is_dir():  # the run-cache names old outputs: a restore must not look for them
            shutil.rmtree(runs)
    default, remotes = dvc_remotes(root)
    for name, settings in remotes.items():
        if "://" in settings.get("url", ""):
            left.append({"what": f"the DVC remote {name} ({settings['url']})", "why": "not a "
                         "local folder: erase purges local stores only", "todo": "delete the "
                         "objects listed in the receipt from it with its own tools"})
    return deleted, left


def purge_mlflow(root: Path, needles: list[bytes]) -> tuple[dict, list[dict]]:
    """MLflow artifacts holding the rows deleted; runs whose params or tags hold them deleted
    for good (`mlflow gc`). (what was done, what was left)
    """
    done: dict = {"artifacts": [], "runs": []}
    left: list[dict] = []
    store = root / "mlartifacts"
    if store.is_dir():
        for path in sorted(store.rglob("*")):
            if path.is_file() and any(n in path.read_bytes() for n in needles):
                path.unlink()
                done["artifacts"].append(str(path.relative_to(root)))
    uri = os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    db = root / "mlflow.db"
    if not uri.startswith("sqlite:///"):
        problem = _unreachable(uri)
        if problem:  # what it holds is unknown: the request stays open
            left.append({"what": f"the MLflow server {uri}", "open": True,
                         "why": f"unreachable: {problem}", "todo": "make it reachable, then "
                         "run this erase again to finish"})
        else:
            left.append({"what": f"the MLflow server {uri}", "why": "erase searches a local "
                         "SQLite store only", "todo": "search its runs' params, tags and "
                         "artifacts for the traces and delete them there"})
        return done, left
    if not db.exists():
        return done, left
    runs: set[str] = set()
    with sqlite3.connect(db) as con:
        for table in ("params", "tags"):
            for needle in needles:
                runs |= {r[0] for r in con.execute(
                    f"SELECT run_uuid FROM {table} WHERE instr(value, ?) > 0",
                    (needle.decode(errors="ignore"),))}
    if runs:
        import mlflow

        client = mlflow.MlflowClient(uri)
        for run_id in sorted(runs):
            client.delete_run(run_id)
        subprocess.run([sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", uri,
                        "--run-ids", ",".join(sorted(runs))], cwd=root, check=True,
                       capture_output=True)
        done["runs"] = sorted(runs)
    return done, left


def _unreachable(uri: str) -> str | None:
    """Why an MLflow server does not answer its /health, or None when it does."""
    import urllib.error
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10):
            return None
    except (urllib.error.URLError, OSError) as err:
        return str(getattr(err, "reason", err))


# --- models -----------------------------------------------------------------------------------

def generations_of(root: Path, found: Found) -> dict:
    """The generations that learned from the traces (read before anything is purged)."""
    from flows.orchestration.promotion import champion_generation

    try:
        champion = champion_generation(root)
    except Exception:  # no promotion log yet: no champion to speak of
        champion = None
    tags = {f"gen-{champion}"} if champion is not None else set()
    direct, affected = set(), set()
    for trace in sorted(found.traces):
        try:
            seen = lineage.trace(root, trace, tags)
        except lineage.LineageError:
            continue
        direct |= set(seen["direct"])
        affected |= set(seen["generations"])
    order = sorted(affected, key=lambda t: int(t[4:]))
    return {"generations": order, "direct": sorted(direct, key=lambda t: int(t[4:])),
            "champion": None if champion is None else f"gen-{champion}",
            "champion_affected": champion is not None and f"gen-{champion}" in affected}


def apply_policy(root: Path, policy: str, models: dict, reason: str, model_name: str) -> dict:
    """What the policy does to the generations listed: keep, flag, or rollback."""
    decision = {"policy": policy, **models, "action": "none"}
    if not models["generations"]:
        decision["action"] = "none: no generation learned from the traces"
        return decision
    if policy == "keep":
        decision["action"] = ("kept serving; the traces are excluded from every later cycle")
    elif policy == "flag":
        decision["action"] = ("flagged: " + ", ".join(models["generations"]) + " learned from "
                              "erased traces (named in this receipt, erasures.jsonl and "
                              "`offseason lineage --trace`); excluded from every later cycle")
    elif models["champion_affected"]:
        from flows.orchestration import promotion

        # the generations that were champions (a rejected one cannot serve), newest last
        champions = sorted({e["champion_generation"] for e in promotion.log_entries(root)
                            if e.get("action") in ("init", "promote", "rollback")})
        clean = [g for g in champions if f"gen-{g}" not in models["generations"]]
        now_serving = promotion.champion_generation(root)
        if f"gen-{now_serving}" not in models["generations"]:  # a rerun: rolled back already
            decision["action"] = f"rolled back to gen-{now_serving}"
        elif not clean:
            decision["action"] = "rollback impossible: every generation learned from them"
        else:
            entry = promotion.rollback(root, model_name, f"erasure: {reason}", "offseason erase",
                                       clean[-1])
            decision["action"] = f"rolled back to gen-{clean[-1]}"
            decision["rollback"] = {k: entry.get(k) for k in ("generation", "from_generation",
                                                               "at")}
    else:
        decision["action"] = "no rollback needed: the champion never saw the traces"
    return decision


# --- the request ------------------------------------------------------------------------------

def _log_rows(root: Path) -> list[dict]:
    path = root / LOG
    return io.read_jsonl(path) if path.exists() else []


def _log(root: Path, entry: dict) -> None:
    """Add or replace (by id) the request's line in erasures.jsonl."""
    rows = [r for r in _log_rows(root) if r["id"] != entry["id"]] + [entry]
    io.write_jsonl(root / LOG, rows)


def scan_parts(root: Path, trace_id: str) -> Found:
    """A trace the index does not know (ingested before it was kept): its rows in the parts."""
    found = Found()
    folder = root / "data" / "traces"
    for path in sorted(folder.glob("*.parquet")) if folder.is_dir() else []:
        if path.name.startswith(erasure.INDEX_PREFIX):
            continue
        rows = pq.read_table(path, columns=["trace_id", "source_file", "source_line"]).to_pylist()
        for row in rows:
            if row["trace_id"] == trace_id:
                found.traces.add(trace_id)
                found.places.add((row["source_file"], row["source_line"]))
                found.files.setdefault(row["source_file"], _format_of(path))
    return found


def _format_of(path: Path) -> str:
    names = pq.read_schema(path).names
    if "format" not in names:
        return "unknown"
    column = pq.read_table(path, columns=["format"]).column(0).to_pylist()
    return column[0] if column else "unknown"


def needles_of(root: Path, found: Found, value: str) -> list[bytes]:
    """What marks the rows in bytes no schema reads (raw inbox versions, MLflow): the trace ids
    as JSON strings, the subject's own value, and the conversations' first user turns.
    """
    needles = {json.dumps(t).encode() for t in id_forms(found.traces)}
    if len(value) >= 6:
        needles.add(value.encode())
    folder = root / "data" / "traces"
    for path in sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []:
        table = pq.read_table(path, columns=["trace_id", "user_text"])
        for row in table.to_pylist():
            if row["trace_id"] in found.traces and row["user_text"] and \
                    len(row["user_text"]) >= 12:
                needles.add(row["user_text"].encode())
    return sorted(needles)


def erase(root: Path, kind: str, value: str, reason: str, config, model_name: str,
          dry_run: bool = False, upstream: bool = False) -> dict:
    """Erase one subject's traces (see the module's docstring); returns the receipt. With
    `upstream`, the traces `offseason pull` brought in are deleted in their service too.
    """
    key = erasure.salt(root)
    try:  # another salt than the index's would find nothing and report the person erased
        erasure.same_salt(root / "data" / "traces", key)
    except erasure.SaltMismatch as err:
        raise EraseError(str(err)) from None
    kind, value = subject_of(kind, value)
    subject = erasure.digest(key, kind, value)
    pending_path = root / RECEIPTS / f"{subject}.pending.json"
    if pending_path.exists():  # a run killed midway: the same erasure, finished
        pending = json.loads(pending_path.read_text())
        found, models = Found.from_json(pending["found"]), pending["models"]
        erasure_id, received = pending["id"], pending["received"]
        needles = [bytes.fromhex(n) for n in pending["needles"]]
        groups = pending.get("upstream") or []
    else:
        found = widen(root, key, lookup(root, subject))
        if kind == "trace" and not found.traces:
            found = widen(root, key, scan_parts(root, value))
        models = generations_of(root, found) if found.traces else \
            {"generations": [], "direct": [], "champion": None, "champion_affected": False}
        received = now()
        erasure_id = f"erasure-{received[:19].replace(':', '').replace('-', '')}-{subject[:8]}"
        needles = needles_of(root, found, value) if found.traces or found.places else []
        # where pull brought them from: read before the inbox files and pull's state lose them
        groups = vendors.origins(root, found.traces, set(found.files))
    receipt = {"id": erasure_id, "subject": {"kind": kind.split(":")[0] if ":" not in kind
                                             else kind, "hash": subject},
               "reason": reason, "received": received, "dry_run": dry_run,
               "found": {"traces": len(found.traces), "index_rows": found.index_rows,
                         "inbox_files": sorted(found.files),
                         "trace_hashes": sorted(erasure.digest(key, "trace", t)
                                                for t in found.traces)},
               "models": models, "removed": {}, "purged": [], "mlflow": {}, "left": [],
               "upstream": [_summary(g) for g in groups]}
    if dry_run:
        receipt["status"] = "dry run: nothing changed"
        return receipt
    if not found.traces and not found.places:
        already = subject in erasure.read_tombstones(root)
        receipt.update(status="already erased" if already else "nothing found",
                       done=now())
        receipt["left"].append({"what": "nothing", "why": "the index holds no trace of this "
                                "subject" + (" any more: an earlier erasure removed them"
                                             if already else ""),
                                "todo": "tell the person offseason holds no data of theirs"
                                if not already else "nothing"})
        _finish(root, receipt)
        return receipt
    pending_path.parent.mkdir(parents=True, exist_ok=True)
    if not pending_path.exists():
        # the inbox files as they were: a rerun rewrites (by line number) only those still so
        pending = {"id": erasure_id, "received": received, "found": found.to_json(),
                   "models": models, "needles": [n.hex() for n in needles], "upstream": groups,
                   "inbox": {name: _sha256(root / "data" / "inbox" / name)
                             for name in sorted(found.files)}, "touched": []}
        io.write_json(pending_path, pending)
    touched = set(pending["touched"])

    def intend(path: Path) -> None:
        """Record a file before it is replaced: a run killed after replacing it, before its
        `dvc commit`, leaves the rerun knowing what to commit.
        """
        rel = str(path.relative_to(root))
        if rel not in touched:
            touched.add(rel)
            io.write_json(pending_path, {**pending, "touched": sorted(touched)})
    date = now()
    tombstone(root, [{"hash": subject, "kind": kind, "erasure": erasure_id, "reason": reason,
                      "date": date}] +
              [{"hash": h, "kind": "trace", "erasure": erasure_id, "reason": reason,
                "date": date} for h in receipt["found"]["trace_hashes"]])
    _log(root, {"id": erasure_id, "subject_hash": subject, "kind": kind, "received": received,
                "done": None, "status": "open", "traces": len(found.traces)})

    # the current files, each rewritten whole
    removed: dict[str, int] = {}
    inbox = root / "data" / "inbox"
    digests = {}
    ids = id_forms(found.traces)
    for name, fmt in sorted(found.files.items()):
        path = inbox / name
        # by line number: only a file as it was found (a killed run may have rewritten it)
        if path.exists() and _sha256(path) == pending["inbox"].get(name):
            lines = {n for f, n in found.places if f == name}
            intend(path)
            n = rewrite_inbox_file(path, fmt, lines, ids)
            if n:
                removed[f"data/inbox/{name}"] = n
        digests[name] = _sha256(path)
    fault("rewrite")
    removed.update(rewrite_traces(root, found, digests, intend))
    removed.update(rewrite_data(root, found, intend))
    journal, journal_left = rewrite_collect_journal(root, found)
    if journal:
        removed[str(COLLECT_SPOOL / "journal")] = journal
    if journal_left:
        receipt["left"].append({"what": "the collect journal", "why": journal_left,
                                "todo": "stop `offseason collect`, then run this erase again"})
    pulled = rewrite_pull_state(root, found)
    if pulled:
        removed[".offseason/pull"] = pulled
    receipt["removed"] = removed
    receipt["left"] += commit(root, set(removed) | touched, f"erase: {erasure_id}: {len(found.traces)} trace(s) of one "
                               f"{kind.split(':')[0]} removed from every current file")

    # older versions: DVC objects, MLflow
    receipt["purged"], left = purge(root, {"data"}, found, needles, erasure_id)
    receipt["left"] += left
    receipt["mlflow"], left = purge_mlflow(root, needles)
    receipt["left"] += left
    receipt["models"] = apply_policy(root, config.models, models, reason, model_name)
    if config.models == "keep" or config.models == "flag":
        if models["champion_affected"]:
            receipt["left"].append({
                "what": f"the champion {models['champion']}", "why": "it learned from the "
                "traces; erase.models is " + config.models, "todo": "the next cycle trains "
                "without them; `offseason rollback` or erase.models: rollback takes it out of "
                "service at once"})
    receipt["upstream"], left = ask_upstream(root, erasure_id, groups, upstream)
    receipt["left"] += left
    receipt["left"].append({"what": "copies outside offseason", "why": "a tracing service "
                            "offseason did not pull them from, backups, models already shipped",
                            "todo": "delete them there (Langfuse, LangSmith: their delete API)"})
    if _conclude(root, receipt):
        _forget(root, erasure_id)
        pending_path.unlink(missing_ok=True)
    return receipt


def _conclude(root: Path, receipt: dict) -> bool:
    """The receipt's status from what is left, written and committed; whether it is done. An
    item left `open` (unreachable, or refusing) keeps the request open, never reported done.
    """
    blocking = [f"{item['what']} " + (item["open"] if isinstance(item["open"], str)
                                      else "unreachable")
                for item in receipt["left"] if item.get("open")]
    if blocking:  # the pending file stays for the rerun
        receipt.update(status="open: " + "; ".join(blocking), done=None)
    else:
        receipt.update(status="done", done=receipt.get("done") or now())
    _finish(root, receipt)
    return not blocking


# --- the services pull brought the traces from (flows/orchestration/upstream.py) ---------------

def _upstream_path(root: Path, erasure_id: str) -> Path:
    """The upstream groups of a request, trace ids and all: local, never committed; the ids go
    once the service confirms them gone.
    """
    return root / RECEIPTS / f"{erasure_id}.upstream.json"


def _waiting(group: dict) -> bool:
    """Whether a group's deletion was asked and is not yet confirmed."""
    return bool(group.get("asked")) and not group.get("confirmed")


def _forget(root: Path, erasure_id: str) -> None:
    """The trace ids of a request done: kept only for the groups whose deletion is still to be
    confirmed (`--status` asks about them); the file goes when none is.
    """
    path = _upstream_path(root, erasure_id)
    if not path.exists():
        return
    groups = json.loads(path.read_text())["groups"]
    if not any(_waiting(g) for g in groups):
        path.unlink()
        return
    io.write_json(path, {"id": erasure_id, "groups": [
        g if _waiting(g) else {**g, "traces": []} for g in groups]})


def _summary(group: dict) -> dict:
    """A group as the receipt and erasures.jsonl record it: counts, no ids."""
    return {"service": group["service"], "project": group.get("project") or None,
            "project_id": group.get("project_id"), "traces": group["count"],
            "host": group.get("host"), "request": group.get("request"),
            "asked": group.get("asked"), "answer": group.get("answer"),
            "asynchronous": vendors.ASYNC[group["service"]], "refused": group.get("refused"),
            "checked": group.get("checked"), "still_there": group.get("still_there"),
            "confirmed": group.get("confirmed")}


def ask_upstream(root: Path, erasure_id: str, groups: list[dict], ask: bool
                 ) -> tuple[list[dict], list[dict]]:
    """With `ask`, each group's service is asked to delete its traces (once: a rerun keeps what
    was asked); (the groups as the receipt records them, what is left). Without it, what is left
    says they are still there and how to delete them.
    """
    path = _upstream_path(root, erasure_id)
    if path.exists():  # a rerun: what was asked and answered stays as it was
        groups = json.loads(path.read_text())["groups"]
    left = []
    for group in groups:
        what = f"{vendors.label(group)} ({group['count']} trace(s) offseason pulled from there)"
        if group.get("asked"):
            if not group.get("confirmed"):
                left.append({"what": what, "service": group["service"],
                             "why": f"deletion asked {group['asked']} ({group['answer']}); "
                             f"{vendors.ASYNC[group['service']]}",
                             "todo": "`offseason erase --status` asks again until it confirms "
                             "them gone"})
            continue
        if not ask:  # once done, offseason keeps no id of them: say so while it still can
            left.append({"what": what, "service": group["service"], "why": "still there: "
                         "offseason deleted only its own copies and keeps no id of them",
                         "todo": f"delete them in {vendors.NAMES[group['service']]} (by the "
                         "person's user or session id); --upstream deletes them through the "
                         "vendor's API: on a rerun while this request is open, or on the next "
                         "request (`--dry-run` lists the pulled traces first)"})
            continue
        try:
            group.update(vendors.delete(group), asked=now(), refused=None)
        except vendors.Refused as err:
            group["refused"] = err.why
            left.append({"what": what, "service": group["service"], "open": "not deleted",
                         "why": err.why, "todo": err.todo})
            continue
        left.append({"what": what, "service": group["service"],
                     "why": f"deletion asked {group['asked']} ({group['answer']}); "
                     f"{vendors.ASYNC[group['service']]}",
                     "todo": "`offseason erase --status` asks again until it confirms them gone"})
    if groups:
        path.parent.mkdir(parents=True, exist_ok=True)
        io.write_json(path, {"id": erasure_id, "groups": groups})
    return [_summary(g) for g in groups], left


def awaiting_upstream(root: Path) -> bool:
    """Whether a deletion asked upstream is not yet confirmed."""
    return any(_waiting(g) for row in _log_rows(root) for g in row.get("upstream") or [])


def recheck_upstream(root: Path) -> list[str]:
    """Every request whose upstream deletion was asked and not yet confirmed: the service asked
    again; a group confirmed gone is recorded (its ids forgotten; the receipt, and erasures.jsonl
    committed). One line per group asked again.
    """
    lines = []
    for row in _log_rows(root):
        path, receipt_path = _upstream_path(root, row["id"]), root / RECEIPTS / f"{row['id']}.json"
        if not path.exists() or not receipt_path.exists():
            continue
        groups = json.loads(path.read_text())["groups"]
        waiting = [g for g in groups if _waiting(g)]
        if not waiting:
            continue
        confirmed_now = False
        for group in waiting:
            try:
                still = vendors.confirm(group)
            except vendors.Refused as err:
                lines.append(f"{row['id']}: {vendors.label(group)} not asked again: {err.why}; "
                             f"fix that, then run `offseason erase --status` again")
                continue
            group.update(checked=now(), still_there=len(still))
            if still:
                lines.append(f"{row['id']}: {vendors.label(group)}: {len(still)} of "
                             f"{group['count']} trace(s) still there, deletion pending (asked "
                             f"{group['asked']})")
            else:
                group.update(confirmed=group["checked"], traces=[])
                confirmed_now = True
                lines.append(f"{row['id']}: {vendors.label(group)}: confirmed gone "
                             f"({group['count']} trace(s))")
        io.write_json(path, {"id": row["id"], "groups": groups})
        if not any(_waiting(g) for g in groups):  # every deletion confirmed: no id kept
            path.unlink()
        receipt = json.loads(receipt_path.read_text())
        receipt["upstream"] = [_summary(g) for g in groups]
        confirmed = {vendors.label(g) for g in groups if g.get("confirmed")}
        receipt["left"] = [i for i in receipt["left"] if not (
            i.get("service") and i["what"].split(" (")[0] in confirmed)]
        if confirmed_now:  # erasures.jsonl records it, committed
            _conclude(root, receipt)
        else:  # the receipt says when it was asked again; the log's line is as it was
            _write_receipt(root, receipt)
    return lines


def _finish(root: Path, receipt: dict) -> None:
    """The receipt (JSON and text) and its line in erasures.jsonl, committed."""
    _write_receipt(root, receipt)
    models = receipt.get("models") or {}
    _log(root, {"id": receipt["id"], "subject_hash": receipt["subject"]["hash"],
                "kind": receipt["subject"]["kind"], "received": receipt["received"],
                "done": receipt.get("done"), "status": receipt["status"],
                "traces": receipt["found"]["traces"],
                "trace_hashes": receipt["found"]["trace_hashes"],
                "generations": models.get("generations") or [],
                "policy": models.get("policy"), "action": models.get("action"),
                "upstream": [{k: g.get(k) for k in ("service", "project", "project_id",
                                                    "traces", "asked", "answer", "refused",
                                                    "confirmed")}
                             for g in receipt.get("upstream") or []],
                "left": [item["what"] for item in receipt["left"]]})
    # the tombstones of the objects purged since the rewrite's commit
    tracked = [p for p in (LOG, str(erasure.TOMBSTONES)) if (root / p).exists()]
    git(root, "add", "--", *tracked)
    git(root, "commit", "--quiet", "-m", f"erase: {receipt['id']} {receipt['status']}", "--",
        *tracked)


def _write_receipt(root: Path, receipt: dict) -> None:
    """The receipt, JSON and text (local: .offseason/erasures/)."""
    folder = root / RECEIPTS
    folder.mkdir(parents=True, exist_ok=True)
    io.write_json(folder / f"{receipt['id']}.json", receipt)
    io.write_text(folder / f"{receipt['id']}.txt", text(receipt) + "\n")


def text(receipt: dict) -> str:
    """The receipt for a person to read."""
    found = receipt["found"]
    lines = [f"{receipt['id']}: {receipt['status']}",
             f"  subject        {receipt['subject']['kind']} (salted hash "
             f"{receipt['subject']['hash']})",
             f"  received       {receipt['received']}", f"  done           "
             f"{receipt.get('done') or '-'}",
             f"  reason         {receipt['reason'] or '-'}",
             f"  found          {found['traces']} trace(s) in "
             f"{len(found['inbox_files'])} inbox file(s)"]
    for path, n in sorted((receipt.get("removed") or {}).items()):
        lines.append(f"  removed        {path}: {n} row(s)")
    for item in receipt.get("purged") or []:
        lines.append(f"  purged         {item['path']} version {item['md5']} from the DVC "
                     f"{item['store']}")
    ml = receipt.get("mlflow") or {}
    for path in ml.get("artifacts") or []:
        lines.append(f"  purged         MLflow artifact {path}")
    for run_id in ml.get("runs") or []:
        lines.append(f"  purged         MLflow run {run_id} (deleted for good)")
    models = receipt.get("models") or {}
    if models.get("generations"):
        lines.append(f"  models         learned from them: {', '.join(models['generations'])}; "
                     f"policy {models.get('policy')}: {models.get('action')}")
    elif models.get("action"):
        lines.append(f"  models         {models['action']}")
    for group in receipt.get("upstream") or []:
        lines.append(f"  upstream       {vendors.label(group)}: {group['traces']} trace(s) "
                     + (f"asked {group['asked']} ({group['request']} at {group['host']}: "
                        f"{group['answer']}); " + (f"confirmed gone {group['confirmed']}"
                                                    if group.get("confirmed") else
                                                    "deletes asynchronously: pending")
                        if group.get("asked") else
                        f"not deleted: {group['refused']}" if group.get("refused") else
                        "not asked (--upstream)"))
    for item in receipt.get("left") or []:
        lines.append(f"  left           {item['what']}: {item['why']}; to do: {item['todo']}")
    return "\n".join(lines)


def status(root: Path, deadline_days: int, recheck: bool = False) -> tuple[str, int]:
    """The requests of erasures.jsonl, open ones against the deadline, and the deletions asked
    upstream (with `recheck`, the services asked again first: `recheck_upstream`); (text, open
    count).
    """
    lines = recheck_upstream(root) if recheck else []
    rows = _log_rows(root)
    today = dt.datetime.now(dt.timezone.utc)
    open_count, waiting = 0, 0
    for row in rows:
        received = dt.datetime.fromisoformat(row["received"])
        due = received + dt.timedelta(days=deadline_days)
        if row.get("done"):
            lines.append(f"{row['id']}: {row['status']} ({row['traces']} trace(s); received "
                         f"{row['received']}, done {row['done']})")
        else:
            open_count += 1
            left = (due - today).days
            lines.append(f"{row['id']}: OPEN since {row['received']}, due {due.date()} ("
                         + (f"{left} day(s) left" if left >= 0 else f"{-left} day(s) OVERDUE")
                         + ")" + (f"; {row['status']}" if row.get("status", "open") != "open"
                                  else "")
                         + ": run the same `offseason erase` again to finish it")
        for group in row.get("upstream") or []:
            name = f"  upstream {vendors.label(group)}: {group['traces']} trace(s) "
            if group.get("confirmed"):
                lines.append(name + f"confirmed gone {group['confirmed']}")
            elif group.get("asked"):
                waiting += 1
                lines.append(name + f"deletion PENDING (asked {group['asked']}; "
                             f"{vendors.ASYNC[group['service']]}): `offseason erase --status` "
                             f"asks again")
            else:
                lines.append(name + (f"NOT deleted ({group['refused']})" if group.get("refused")
                                     else "still there (erased without --upstream)") +
                             (": run the same `offseason erase` with --upstream" if not
                              row.get("done") else f": delete them in "
                              f"{vendors.NAMES[group['service']]}"))
    if not rows:
        lines.append("no erasure requests recorded")
    lines.append(f"{open_count} open, {len(rows) - open_count} done (deadline "
                 f"{deadline_days} days: erase.deadline_days)"
                 + (f"; {waiting} upstream deletion(s) pending" if waiting else ""))
    return "\n".join(lines), open_count


def erased_trace(root: Path, trace_id: str) -> dict | None:
    """The request that erased a trace, by its salted hash, or None."""
    key = erasure.salt(root)
    wanted = erasure.digest(key, "trace", trace_id)
    return next((r for r in _log_rows(root) if wanted in (r.get("trace_hashes") or [])), None)
