"""`offseason pull langfuse|langsmith`: traces from a tracing service into the inbox, as an export.

Reads through the vendor's own Python SDK (extras `offseason[langfuse]` / `offseason[langsmith]`,
credentials from the vendor's usual environment variables) the traces of a window (`--since
last-cycle` by default). Writes one new JSONL file into the inbox per pull
(`langfuse-<UTC time>.jsonl`), in the shape `stages/traces/sources/` reads, and remembers the
trace ids pulled (`.offseason/pull/<service>[-<project>].json`), so no trace is written twice.
Failures raise `PullError` (exit 2). With params.yaml's `pull:` every cycle pulls first. A service
that answers nothing for `runtime.pull.stall_seconds` (a request is never retried after that)
fails the pull; the traces fetched whole before are written and remembered all the same, and the
next pull goes on from there.

    offseason pull langfuse                          # new traces since the last cycle
    offseason pull langsmith --project support-bot --since 2026-03-01T00:00:00Z --limit 500

Details: docs/traces.md, "How a pull works (flows/intake/pull.py)".
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from flows.project.params import SERVICES, Pull
from flows.project.workspace import WorkspaceError, generations, git
from stages import config as cfg
from stages import erasure, io

OVERLAP = timedelta(minutes=15)  # Langfuse's v1 read endpoints may lag ingestion by ~10 minutes
# seconds a request may take where no setting says (`offseason erase --upstream`,
# flows/orchestration/upstream.py); a pull's is `runtime.pull.stall_seconds`
TIMEOUT = 30
PAGE = 100  # items a page: the v3 scores endpoint's maximum


class PullError(WorkspaceError):
    """A pull that cannot go on (SDK, credentials, the service): the message says what to do."""


@dataclass
class Pulled:
    """What a pull has fetched so far, trace by trace: kept when the service stops midway."""

    records: list[dict] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    cut: bool = False  # the limit cut the listing short: the window does not move

    def add(self, trace_id: str, records: list[dict]) -> None:
        """One trace fetched whole."""
        self.ids.append(trace_id)
        self.records.extend(records)


# --- the window ---------------------------------------------------------------------------------

def last_cycle_time(root: Path) -> datetime | None:
    """The commit time of the last cycle's tag (gen-N, N >= 1), or None before the first cycle."""
    cycles = [n for n in generations(root) if n >= 1]
    if not cycles:
        return None
    return datetime.fromisoformat(git(root, "log", "-1", "--format=%cI", f"gen-{cycles[-1]}"))


def parse_since(value: str) -> datetime:
    """An ISO time (a `Z` or offset; none means UTC); raises PullError naming the option."""
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise PullError(f"--since: {value!r} is neither 'last-cycle' nor an ISO time like "
                        f"2026-03-01T00:00:00Z") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def window_start(root: Path, since: str, state: dict) -> datetime | None:
    """Where this pull's window opens (None: everything), `OVERLAP` before the time asked."""
    if since != "last-cycle":
        start = parse_since(since)
    else:
        start = last_cycle_time(root)
        complete = state.get("complete_from")
        if start is not None and complete:
            start = min(start, datetime.fromisoformat(complete))
    return None if start is None else start - OVERLAP


# --- what was pulled ----------------------------------------------------------------------------

def state_path(root: Path, service: str, project: str) -> Path:
    """Where the ids pulled from a service (and project) are remembered."""
    name = f"{service}-{project}" if project else service
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return root / ".offseason" / "pull" / f"{safe}.json"


def read_state(path: Path) -> dict:
    """The remembered pulls ({} before the first); an unreadable file fails naming it."""
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except ValueError as err:
        raise PullError(f"{path}: not readable JSON ({err}); delete it to pull from scratch "
                        f"(ingest counts traces pulled again as duplicates)") from None
    return state if isinstance(state, dict) else {}


# --- writing ------------------------------------------------------------------------------------

def write_inbox(inbox: Path, service: str, records: list[dict], now: datetime) -> Path:
    """Records as one new JSONL inbox file, whole: a hidden temporary name (ingest skips it),
    fsynced, renamed, the folder fsynced. The name sorts by time and never repeats.
    """
    inbox.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%dT%H%M%S%fZ")
    path = inbox / f"{service}-{stamp}.jsonl"
    n = 1
    while path.exists():  # two pulls within a microsecond
        n += 1
        path = inbox / f"{service}-{stamp}-{n}.jsonl"
    io.write_lines_durably(path, (io.jsonl_line(record).encode() for record in records))
    return path


def _json(value: Any) -> Any:
    """A value as JSON gives it back: datetimes as ISO text, UUIDs as text."""
    return json.loads(json.dumps(value, default=str))


def _decoded(text: Any) -> Any:
    """The v2 observations endpoint returns input and output as JSON text: decoded when it is a
    JSON object, array or string; a plain prompt stays text.
    """
    if isinstance(text, str) and text[:1] in ("{", "[", '"'):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _need(names: list[str], extra: str) -> dict[str, str]:
    missing = [name for name in names if not os.environ.get(name)]
    if missing:
        raise PullError(f"{', '.join(missing)} not set: put the {extra} credentials in the "
                        f"environment (never in params.yaml)")
    return {name: os.environ[name] for name in names}


# --- Langfuse -----------------------------------------------------------------------------------

OBSERVATION_FIELDS = "core,basic,time,io,model,usage,trace_context"


def langfuse_api(timeout: float):
    """The Langfuse SDK's API client (requests unanswered for `timeout` seconds fail), its host,
    and the SDK's error type; PullError when the SDK or the keys are missing. Also erase's
    (`flows/orchestration/upstream.py`).
    """
    try:
        from langfuse._version import __version__
        from langfuse.api import LangfuseAPI
        from langfuse.api.core.api_error import ApiError
    except ImportError:
        raise PullError("the Langfuse SDK is not installed: pip install 'offseason[langfuse]'"
                        ) from None
    keys = _need(["LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"], "Langfuse")
    host = (os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST")
            or "https://cloud.langfuse.com")
    # the SDK's API client, as `Langfuse().api` builds it; `Langfuse()` itself also starts the
    # tracing machinery and is one shared instance per public key, whatever the host
    api = LangfuseAPI(base_url=host, username=keys["LANGFUSE_PUBLIC_KEY"],
                      password=keys["LANGFUSE_SECRET_KEY"], x_langfuse_sdk_name="python",
                      x_langfuse_sdk_version=__version__,
                      x_langfuse_public_key=keys["LANGFUSE_PUBLIC_KEY"], timeout=timeout)
    return api, host, ApiError


def langfuse_traces(since: datetime | None, limit: int, seen: set[str], project: str,
                    got: Pulled, stall: float) -> None:
    """New traces from Langfuse, into `got`; a request unanswered for `stall` seconds fails."""
    import httpx

    api, host, ApiError = langfuse_api(stall)
    try:  # (its client retries answers of 429 and 5xx, never a timeout)
        _langfuse_pull(api, since, limit, seen, got)
    except ApiError as err:
        if err.status_code in (401, 403):
            raise PullError(f"Langfuse at {host} refused the key (HTTP {err.status_code}): check "
                            f"LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY (a project's API "
                            f"keys)") from None
        raise PullError(f"Langfuse at {host} answered HTTP {err.status_code} ({err.body!r:.200}); "
                        f"try again later") from None
    except httpx.TimeoutException as err:
        raise PullError(f"Langfuse at {host} did not answer within runtime.pull.stall_seconds="
                        f"{stall:g} ({type(err).__name__}); is the service up, or wedged? (raise "
                        f"the setting for one that is slow, not stuck)") from None
    except httpx.HTTPError as err:
        raise PullError(f"Langfuse at {host} did not answer ({type(err).__name__}: {err}); is "
                        f"LANGFUSE_HOST right and the service up?") from None


def _pages(call, **query):
    """Every item of a cursor-paginated Langfuse list."""
    cursor = None
    while True:
        page = call(limit=PAGE, cursor=cursor, **query)
        yield from page.data
        cursor = page.meta.cursor
        if not cursor or not page.data:
            return


def _new_ids(trace_ids, seen, limit: int) -> tuple[list[str], bool]:
    """The trace ids not pulled before, in the service's order, at most `limit` (0: all), and
    whether the limit cut them short (then the window does not move: the next pull goes on).
    """
    ids: list[str] = []
    for trace_id in trace_ids:
        if not trace_id or trace_id in seen or trace_id in ids:
            continue
        if limit and len(ids) >= limit:
            return ids, True
        ids.append(trace_id)
    return ids, False


def _langfuse_pull(api, since, limit, seen, got: Pulled) -> None:
    ids, got.cut = _new_ids((root.trace_id for root in _pages(
        api.observations.get_many, is_root_observation=True, from_start_time=since,
        fields="core")), seen, limit)
    for trace_id in ids:
        observations = [_observation(o) for o in
                        _pages(api.observations.get_many, trace_id=trace_id,
                               fields=OBSERVATION_FIELDS)]
        scores = [_score(s) for s in _pages(api.scores.get_many, trace_id=trace_id,
                                            fields="details,subject")]
        got.add(trace_id, [_trace_record(trace_id, observations, scores), *observations,
                           *(s for s in scores if s["traceId"] == trace_id)])


def _observation(item) -> dict:
    record = json.loads(item.json())  # the API's own field names (camelCase), ISO times
    for key in ("input", "output"):
        if key in record:
            record[key] = _decoded(record[key])
    return record


def _score(item) -> dict:
    """A v3 score as the v1 `Score` object (`GET /api/public/scores`) reads."""
    score = json.loads(item.json())
    subject = score.pop("subject", None) or {}
    kind, value = subject.get("kind"), score.pop("value", None)
    score["traceId"] = subject.get("id") if kind == "trace" else subject.get("traceId")
    score["observationId"] = subject.get("id") if kind == "observation" else None
    if kind == "session":
        score["sessionId"] = subject.get("id")
    if score.get("dataType") == "NUMERIC":
        score["value"], score["stringValue"] = value, None
    elif score.get("dataType") == "BOOLEAN":
        score["value"], score["stringValue"] = float(bool(value)), str(bool(value))
    else:  # CATEGORICAL, TEXT, CORRECTION: a label
        score["value"], score["stringValue"] = None, value
    return score


def _trace_record(trace_id: str, observations: list[dict], scores: list[dict]) -> dict:
    """A `/api/public/traces` list item for the trace, from its observations."""
    ordered = sorted(observations, key=lambda o: str(o.get("startTime") or ""))
    ids = {o.get("id") for o in observations}
    root = next((o for o in ordered if o.get("parentObservationId") not in ids),
                ordered[0] if ordered else {})
    first = {key: next((o[key] for o in ordered if o.get(key)), None)
             for key in ("sessionId", "userId", "traceName", "tags", "environment")}
    return {"id": trace_id, "timestamp": root.get("startTime"),
            "name": first["traceName"] or root.get("name"), "sessionId": first["sessionId"],
            "userId": first["userId"], "tags": first["tags"] or [],
            "environment": first["environment"],
            "observations": [o.get("id") for o in observations],
            "scores": [s.get("id") for s in scores]}


# --- LangSmith ----------------------------------------------------------------------------------

def langsmith_traces(since: datetime | None, limit: int, seen: set[str], project: str,
                     got: Pulled, stall: float) -> None:
    """New traces from LangSmith, into `got`; a request unanswered for `stall` seconds fails."""
    try:
        import langsmith
        from langsmith import utils as ls_utils
        from urllib3.util.retry import Retry
    except ImportError:
        raise PullError("the LangSmith SDK is not installed: pip install "
                        "'offseason[langsmith]'") from None
    key = _need(["LANGSMITH_API_KEY"], "LangSmith")["LANGSMITH_API_KEY"]
    endpoint = os.environ.get("LANGSMITH_ENDPOINT") or "https://api.smith.langchain.com"
    project = project or os.environ.get("LANGSMITH_PROJECT") or "default"
    # the SDK's own retries (langsmith/client.py `_default_retry_config`), but none after a read
    # timeout: that request had no answer for the whole bound already
    retry = Retry(total=3, read=0, status_forcelist=[429, 500, 502, 503, 504, 408, 425],
                  backoff_factor=0.5, raise_on_redirect=False, raise_on_status=False,
                  respect_retry_after_header=True, allowed_methods=None)
    client = langsmith.Client(api_url=endpoint, api_key=key, timeout_ms=int(stall * 1000),
                              auto_batch_tracing=False, retry_config=retry)
    try:
        _langsmith_pull(client, project, since, limit, seen, got)
    except ls_utils.LangSmithAuthError:
        raise PullError(f"LangSmith at {endpoint} refused the key: check LANGSMITH_API_KEY "
                        f"(and, for a self-hosted one, LANGSMITH_ENDPOINT)") from None
    except ls_utils.LangSmithNotFoundError:
        raise PullError(f"LangSmith at {endpoint} has no project {project!r}: name yours with "
                        f"--project, pull.project or LANGSMITH_PROJECT") from None
    except ls_utils.LangSmithConnectionError as err:
        if "Read timed out" in str(err):
            raise PullError(f"LangSmith at {endpoint} did not answer within runtime.pull."
                            f"stall_seconds={stall:g} (read timed out); is the service up, or "
                            f"wedged? (raise the setting for one that is slow, not stuck)"
                            ) from None
        raise PullError(f"LangSmith at {endpoint} did not answer ({str(err)[:200]}); is "
                        f"LANGSMITH_ENDPOINT right and the service up?") from None
    except ls_utils.LangSmithError as err:
        raise PullError(f"LangSmith at {endpoint} failed the request ({str(err)[:200]}); try "
                        f"again later") from None


def _langsmith_pull(client, project, since, limit, seen, got: Pulled) -> None:
    project_id = client.read_project(project_name=project).id
    with warnings.catch_warnings():
        # list_runs (POST /runs/query) is deprecated in 0.15 for client.runs.query, which needs
        # a LangSmith backend >= 0.16 and returns another shape; it stays until 2027
        warnings.simplefilter("ignore", DeprecationWarning)
        ids, got.cut = _new_ids((str(run.trace_id or run.id) for run in client.list_runs(
            project_id=project_id, is_root=True, start_time=since,
            select=["id", "trace_id", "start_time", "name", "run_type"])), seen, limit)
        for trace_id in ids:
            runs = [_json(run.model_dump(exclude={"attachments"}))
                    for run in client.list_runs(project_id=project_id, trace_id=trace_id)]
            got.add(trace_id, sorted(runs, key=lambda r: str(r.get("dotted_order") or "")))


FETCH = {"langfuse": langfuse_traces, "langsmith": langsmith_traces}


# --- the command --------------------------------------------------------------------------------

def not_erased(root: Path, records: list[dict], ids: list[str]) -> tuple[list[dict], list[str]]:
    """The records and trace ids without the traces `offseason erase` tombstoned (by trace, or
    by a subject a trace record names: its user, its session).
    """
    tombstones = erasure.Tombstones(root)
    if not tombstones:
        return records, ids
    gone = {str(i) for i in ids if tombstones.trace_erased(str(i))}
    gone |= {str(r.get("id")) for r in records if "traceId" not in r and "trace_id" not in r
             and tombstones.erased(erasure.subjects(None, r))}

    def trace_of(record: dict) -> str:
        return str(record.get("traceId") or record.get("trace_id") or record.get("id"))

    return [r for r in records if trace_of(r) not in gone], [i for i in ids if str(i) not in gone]


def pull(root: Path, inbox: Path, service: str, since: str = "last-cycle", limit: int = 0,
         project: str = "", stall: float | None = None) -> dict:
    """Pull the new traces of `service` into `inbox`; returns what was done (`message` says it).
    `stall`: runtime.pull.stall_seconds (None: its default). A service that stops answering
    midway raises PullError once the traces fetched before are written and remembered.
    """
    if service not in FETCH:
        raise PullError(f"unknown service {service!r}; one of {', '.join(SERVICES)}")
    if service == "langsmith":
        project = project or os.environ.get("LANGSMITH_PROJECT") or "default"
    stall = Pull().stall_seconds if stall is None else stall
    path = state_path(root, service, project if service == "langsmith" else "")
    state = read_state(path)
    began = datetime.now(timezone.utc)
    start = window_start(root, since, state)
    pulled: dict[str, str] = dict(state.get("ids") or {})
    got = Pulled()
    try:
        FETCH[service](start, limit, set(pulled), project, got, stall)
    except PullError as err:
        if not got.ids:
            raise
        # the window does not move: what the service did not send yet is still to pull
        done = _save(root, inbox, service, project, path, state, pulled, got, began, start, limit,
                     stopped=True)
        raise PullError(f"{err}. Kept: {done['message'].removeprefix('pull: ')}; the next "
                        f"pull goes on from there") from None
    return _save(root, inbox, service, project, path, state, pulled, got, began, start, limit)


def _save(root: Path, inbox: Path, service: str, project: str, path: Path, state: dict,
          pulled: dict[str, str], got: Pulled, began: datetime, start: datetime | None,
          limit: int, stopped: bool = False) -> dict:
    """Write what a pull fetched (an inbox file) and remember it (the state); what was done.
    `stopped`: the service stopped answering midway (the window does not move, as for a limit).
    """
    records, ids = not_erased(root, got.records, got.ids)
    cut = got.cut
    written = write_inbox(inbox, service, records, began) if records else None
    for trace_id in ids:
        pulled[trace_id] = began.isoformat()
    # ids older than a week before the window stay out of the file: it does not grow forever
    keep = (start or began) - timedelta(days=7)
    pulled = {i: t for i, t in pulled.items() if datetime.fromisoformat(t) >= keep}
    complete_from = state.get("complete_from") if cut or stopped else began.isoformat()
    io.write_json(path, {"service": service, "project": project, "complete_from": complete_from,
                         "ids": pulled})
    window = f"since {start.isoformat()}" if start else "everything"
    where = f" project {project!r}" if service == "langsmith" else ""
    if written is None:
        message = f"pull: no new traces in {service}{where} ({window})"
    else:
        message = (f"pull: {len(ids)} new trace(s) from {service}{where} ({window}) -> "
                   f"{written.relative_to(root) if written.is_relative_to(root) else written}"
                   + (f"; --limit {limit} reached, the next pull takes the next ones"
                      if cut else ""))
    return {"service": service, "traces": len(ids), "records": len(records),
            "file": str(written) if written else None, "since": start.isoformat() if start else None,
            "limit_reached": cut, "message": message}


def before_cycle(root: Path, inbox: Path, params: Path) -> str | None:
    """The pull a cycle runs first when params.yaml has a `pull:` section naming a service;
    returns its message, or None when none is configured.
    """
    if "pull" not in cfg.read_params(params):
        return None
    config = cfg.load("pull", params, {"pull": Pull})
    if not config.service:
        return None
    return pull(root, inbox, config.service, "last-cycle", config.limit, config.project,
                config.stall_seconds)["message"]
