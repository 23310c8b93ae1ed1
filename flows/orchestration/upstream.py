"""`offseason erase --upstream`: the erased traces that `offseason pull` brought in, deleted in the
tracing service they came from (Langfuse, LangSmith) through the vendor's own SDK.

Reads, before erase rewrites anything, where each erased trace came from (`origins`): the inbox
files pull wrote (`langfuse-<UTC time>.jsonl`, `langsmith-<UTC time>.jsonl`, as `write_inbox`
names them; a LangSmith run's `session_id` is its project's id) and pull's state
(`.offseason/pull/<service>[-<project>].json`: the ids it pulled, with the project's name). One
group per service and project. Writes nothing itself: erase keeps the groups, trace ids and all,
in `.offseason/erasures/<id>.upstream.json` (local, never committed), and the receipt and
`erasures.jsonl` record per group what was asked, when, the answer and the confirmation, by
count (no ids).

The delete, with the credentials pull uses (its `_need` variables, never params.yaml):
- Langfuse: `api.trace.delete_multiple(trace_ids=...)` (`DELETE /api/public/traces`, body
  `{traceIds}`; the keys name the project).
- LangSmith: its SDK has no delete of runs; the documented `POST /api/v1/runs/delete` with
  `{trace_ids, session_id: <project id>}` (at most 1000 ids a request) goes through
  `Client.request_with_retries` (the SDK's auth, base URL and retries), as `/runs/delete` under
  the client's `api_url`, the way the SDK calls its own `/runs/query`.

Both vendors delete asynchronously (LangSmith: "not instant ... no confirmation of deletion: query
the data again to verify"), so an accepted request is recorded as asked, not as gone:
`offseason erase --status` asks again (`confirm`): Langfuse's `GET /api/public/v2/observations
?traceId=` answering none (or 404), LangSmith's `list_runs(project_id, trace_id)` none, is gone.
A vendor that cannot be reached or refuses (no SDK, no credentials, HTTP 4xx/5xx) raises
`Refused`: erase names it in the receipt's `left` and keeps the request open.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

from flows.intake.pull import TIMEOUT, PullError, _need, langfuse_api

SERVICES = ("langfuse", "langsmith")
# the names `write_inbox` gives pull's files: <service>-<%Y%m%dT%H%M%S%f>Z[-n].jsonl
PULLED = re.compile(r"(langfuse|langsmith)-\d{8}T\d{12}Z(-\d+)?\.jsonl")
SELECT = ["id", "trace_id", "start_time", "name", "run_type"]  # as pull lists roots
BATCH = 1000  # ids a request: LangSmith's documented maximum (Langfuse documents none)
NAMES = {"langfuse": "Langfuse", "langsmith": "LangSmith"}
ASYNC = {"langfuse": "Langfuse deletes asynchronously: the trace may be readable for a while "
                     "after the request is accepted",
         "langsmith": "LangSmith deletes asynchronously (during off-peak hours, at worst at the "
                      "weekend) and sends no confirmation"}


class Refused(Exception):
    """A vendor that cannot be reached or refuses a request: why, and what to do."""

    def __init__(self, why: str, todo: str):
        """`why` names the service and what it answered; `todo` what to do next."""
        super().__init__(why)
        self.why, self.todo = why, todo


def label(group: dict) -> str:
    """A group as the receipt names it: 'Langfuse at HOST', 'LangSmith project NAME'."""
    if group["service"] == "langfuse":
        return "Langfuse"
    return f"LangSmith project {group.get('project') or group.get('project_id')}"


# --- where the traces came from ---------------------------------------------------------------

def _trace_of(record: dict) -> str | None:
    """The trace a pulled record belongs to: a Langfuse observation's or score's `traceId`, a
    LangSmith run's `trace_id`, a Langfuse trace record's own `id`.
    """
    trace = record.get("traceId") or record.get("trace_id") or record.get("id")
    return None if trace is None else str(trace)


def origins(root: Path, traces: set[str], files: set[str]) -> list[dict]:
    """The groups (service, project) of the traces that `offseason pull` brought in, from the
    inbox files it wrote (among `files`) and its state; each `{service, project, project_id,
    traces}`. Read before erase rewrites either.
    """
    service_of: dict[str, str] = {}
    project_id: dict[str, str] = {}  # LangSmith: the project's id, as its runs name it
    project_name: dict[str, str] = {}  # LangSmith: the project's name, as pull's state has it
    inbox = root / "data" / "inbox"
    for name in sorted(files):
        match = PULLED.fullmatch(name)
        if not match or not (inbox / name).is_file():
            continue
        for line in (inbox / name).read_bytes().split(b"\n"):
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            trace = _trace_of(record) if isinstance(record, dict) else None
            if trace in traces:
                service_of[trace] = match.group(1)
                if match.group(1) == "langsmith" and record.get("session_id"):
                    project_id[trace] = str(record["session_id"])
    for path in sorted((root / ".offseason" / "pull").glob("*.json")):
        try:
            state = json.loads(path.read_text())
        except ValueError:  # pull itself refuses the file and says how to fix it
            continue
        if not isinstance(state, dict) or state.get("service") not in SERVICES:
            continue
        for trace in set(state.get("ids") or {}) & traces:
            service_of.setdefault(trace, state["service"])
            if state["service"] == "langsmith" and service_of[trace] == "langsmith":
                project_name[trace] = state.get("project") or ""
    groups: dict[tuple, dict] = {}
    for trace, service in sorted(service_of.items()):
        key = (service, project_name.get(trace, ""), project_id.get(trace))
        group = groups.setdefault(key, {"service": service, "project": key[1],
                                        "project_id": key[2], "traces": [], "count": 0})
        group["traces"].append(trace)
        group["count"] += 1
    return list(groups.values())


# --- the vendors --------------------------------------------------------------------------------

def _langfuse():
    """The Langfuse SDK's API client as pull builds it (`pull.langfuse_api`), its host, and the
    SDK's error types; Refused, saying what to do, when the SDK or the keys are missing.
    """
    import httpx

    try:
        api, host, ApiError = langfuse_api(TIMEOUT)
    except PullError as err:
        todo = ("pip install 'offseason[langfuse]'" if "not installed" in str(err) else
                "put the Langfuse project's keys in the environment")
        raise Refused(str(err).split(":")[0], f"{todo}, then run the same erase with "
                                               f"--upstream again") from None
    return api, host, ApiError, httpx.HTTPError


def _langfuse_call(call, group: dict):
    """`call(api)` against Langfuse; its failures as `Refused`. Returns (answer, host)."""
    api, host, api_error, http_error = _langfuse()
    try:
        return call(api), host
    except api_error as err:
        keys = " (check LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY: the keys of the project " \
               "the traces were pulled from)" if err.status_code in (401, 403) else ""
        raise Refused(f"Langfuse at {host} refused (HTTP {err.status_code}: "
                      f"{str(err.body)[:200]}){keys}", "fix that, then run the same erase with "
                      "--upstream again") from None
    except http_error as err:
        raise Refused(f"Langfuse at {host} did not answer ({type(err).__name__}: {err})",
                      "check LANGFUSE_HOST and that the service is up, then run the same "
                      "erase with --upstream again") from None


def _langsmith():
    """The LangSmith SDK's client as pull builds it, its endpoint, and the SDK's utils."""
    try:
        import langsmith
        from langsmith import utils as ls_utils
    except ImportError:
        raise Refused("the LangSmith SDK is not installed", "pip install "
                      "'offseason[langsmith]', then run the same erase with --upstream "
                      "again") from None
    try:
        key = _need(["LANGSMITH_API_KEY"], "LangSmith")["LANGSMITH_API_KEY"]
    except PullError as err:
        raise Refused(str(err).split(":")[0], "put the LangSmith API key in the environment, "
                      "then run the same erase with --upstream again") from None
    endpoint = os.environ.get("LANGSMITH_ENDPOINT") or "https://api.smith.langchain.com"
    client = langsmith.Client(api_url=endpoint, api_key=key, timeout_ms=TIMEOUT * 1000,
                              auto_batch_tracing=False)
    return client, endpoint, ls_utils


def _langsmith_call(call, group: dict):
    """`call(client, project_id)` against LangSmith; failures as `Refused`. (answer, endpoint)"""
    client, endpoint, ls_utils = _langsmith()
    try:
        project_id = group.get("project_id") or str(
            client.read_project(project_name=group["project"]).id)
        return call(client, project_id), endpoint
    except ls_utils.LangSmithAuthError:
        raise Refused(f"LangSmith at {endpoint} refused the key (HTTP 401)", "check "
                      "LANGSMITH_API_KEY (a key of the workspace the traces were pulled from), "
                      "then run the same erase with --upstream again") from None
    except ls_utils.LangSmithNotFoundError:
        raise Refused(f"LangSmith at {endpoint} has no {label(group)} (HTTP 404)", "check "
                      "LANGSMITH_ENDPOINT and the key's workspace, then run the same erase "
                      "with --upstream again") from None
    except ls_utils.LangSmithConnectionError as err:
        raise Refused(f"LangSmith at {endpoint} did not answer ({str(err)[:200]})", "check "
                      "LANGSMITH_ENDPOINT and that the service is up, then run the same erase "
                      "with --upstream again") from None
    except ls_utils.LangSmithError as err:
        raise Refused(f"LangSmith at {endpoint} refused the request ({str(err)[:300]})",
                      "run the same erase with --upstream again later") from None


def delete(group: dict) -> dict:
    """Ask the group's service to delete its traces; what was asked and the answer. Raises
    `Refused` when it cannot be reached or refuses.
    """
    ids = group["traces"]
    chunks = [ids[i:i + BATCH] for i in range(0, len(ids), BATCH)]
    if group["service"] == "langfuse":
        def call(api):
            from langfuse.api.core.api_error import ApiError

            answers = []
            for chunk in chunks:
                try:
                    answers.append(api.trace.delete_multiple(trace_ids=chunk).message)
                except ApiError as err:
                    if err.status_code != 404:
                        raise
                    answers.append("HTTP 404: none of them there")  # gone already
            return answers
        answers, host = _langfuse_call(call, group)
        return {"host": host, "request": "DELETE /api/public/traces {traceIds}",
                "answer": "; ".join(sorted(set(answers)))}

    def ask(client, project_id):
        answers = []
        for chunk in chunks:
            response = client.request_with_retries(
                "POST", "/runs/delete", request_kwargs={
                    "data": json.dumps({"trace_ids": chunk, "session_id": project_id})},
                # idempotent: once more after a server error or a dropped connection
                stop_after_attempt=2)
            answers.append(f"HTTP {response.status_code}")
        return project_id, answers
    (project_id, answers), endpoint = _langsmith_call(ask, group)
    group["project_id"] = project_id
    return {"host": endpoint, "request": "POST /runs/delete {trace_ids, session_id}",
            "answer": "; ".join(sorted(set(answers)))}


def confirm(group: dict) -> list[str]:
    """The group's traces the service still holds (asked again, one trace at a time); raises
    `Refused` when it cannot be reached or refuses.
    """
    if group["service"] == "langfuse":
        def still(api):
            from langfuse.api.core.api_error import ApiError

            left = []
            for trace in group["traces"]:
                try:
                    page = api.observations.get_many(trace_id=trace, fields="core", limit=1)
                except ApiError as err:
                    if err.status_code == 404:  # gone
                        continue
                    raise
                if page.data:
                    left.append(trace)
            return left
        return _langfuse_call(still, group)[0]

    def held(client, project_id):
        with warnings.catch_warnings():  # list_runs: as pull.py's _langsmith_pull says
            warnings.simplefilter("ignore", DeprecationWarning)
            return [trace for trace in group["traces"] if any(
                True for _ in client.list_runs(project_id=project_id, trace_id=trace, limit=1,
                                               select=SELECT))]
    return _langsmith_call(held, group)[0]
