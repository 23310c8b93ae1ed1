"""`offseason pull`: the vendors' own SDKs, over real HTTP, against a scripted server on loopback.

The server answers the endpoints the SDKs call, in the shapes their generated types declare (the
SDK parses each response into those types, so a wrong shape fails here). Where each shape comes
from (the installed wheels of the pinned versions, constraints.txt):
- Langfuse, langfuse==5.2.0 (github.com/langfuse/langfuse-python, Fern-generated from Langfuse's
  OpenAPI spec): `GET /api/public/v2/observations` (query `isRootObservation`, `fromStartTime`,
  `traceId`, `fields`, `limit`, `cursor`; langfuse/api/observations/raw_client.py) answers
  `ObservationsV2Response` `{data: [ObservationV2], meta: {cursor}}`
  (langfuse/api/observations/types/observations_v2response.py, commons/types/observation_v2.py:
  `input`/`output` as JSON text, per the endpoint's docstring); `GET /api/public/v3/scores`
  (`traceId`, `fields`; scores/raw_client.py) answers `GetScoresV3Response` `{data: [ScoreV3],
  meta: {limit, cursor}}` (scores/types/score_v3.py: polymorphic `value`, `subject` discriminated
  by `kind`). Basic auth with public:secret key; 401 otherwise.
- LangSmith, langsmith==0.15.1 (github.com/langchain-ai/langsmith-sdk, python/langsmith):
  `GET /sessions?name=` answers a list of `TracerSessionResult` (client.py `read_project`,
  schemas.py), `POST /runs/query` answers `{runs: [Run], cursors: {next}}` (client.py
  `list_runs`, `_get_cursor_paginated_list`; schemas.py `RunBase`/`Run`). Key in `x-api-key`.
"""

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pyarrow.parquet as pq
import pytest

from flows import pull
from stages import config as cfg
from stages import ingest

REPO = Path(__file__).resolve().parent.parent
NOW = datetime.now(timezone.utc)
OLD = NOW - timedelta(days=30)  # before the last cycle
NEW = NOW - timedelta(minutes=2)  # after it
LAST_CYCLE = (NOW - timedelta(hours=1)).replace(microsecond=0)  # git keeps whole seconds
PROJECT = "7a1c3e5f-0b2d-4f6a-8c9e-1d3f5b7a9c0e"
SYSTEM = "You are the ShopCo support assistant. Look orders up before answering."


def iso(when: datetime, plus: float = 0.0) -> str:
    return (when + timedelta(seconds=plus)).isoformat().replace("+00:00", "Z")


# --- Langfuse: a trace with a tool call, scores from a user; another from a month ago ---------

def lf_trace(trace_id: str, start: datetime, order: str, answer: str) -> tuple[list, list]:
    call = {"id": f"call_{trace_id[:4]}", "type": "function",
            "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order})}}
    tools = [{"type": "function", "function": {
        "name": "lookup_order", "description": "Look an order up.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}]
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Where is my order #{order}?"}]
    second = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"],
                       "content": '{"status": "shipped", "carrier": "UPS"}'}]

    def obs(id_, type_, name, plus, parent=None, **more):
        return {"id": id_, "traceId": trace_id, "startTime": iso(start, plus),
                "endTime": iso(start, plus + 1), "projectId": PROJECT,
                "parentObservationId": parent, "type": type_, "name": name, "level": "DEFAULT",
                "sessionId": f"chat-{order}", "userId": "u-17", "traceName": "support-agent",
                "isRootObservation": parent is None, **more}

    root = f"{trace_id[:8]}-root"
    observations = [
        obs(root, "AGENT", "support-agent", 0),
        obs(f"{trace_id[:8]}-g1", "GENERATION", "OpenAI-generation", 0.1, root,
            model="gpt-4o-mini-2024-07-18",
            input=json.dumps({"messages": first, "tools": tools}),
            output=json.dumps({"role": "assistant", "content": None, "tool_calls": [call]}),
            usageDetails={"input": 96, "output": 19, "total": 115}),
        obs(f"{trace_id[:8]}-t1", "TOOL", "lookup_order", 1.2, root,
            input=json.dumps({"order_id": order}), output='{"status": "shipped"}'),
        obs(f"{trace_id[:8]}-g2", "GENERATION", "OpenAI-generation", 1.5, root,
            model="gpt-4o-mini-2024-07-18", input=json.dumps({"messages": second, "tools": tools}),
            output=json.dumps({"role": "assistant", "content": answer}),
            usageDetails={"input": 151, "output": 21, "total": 172}),
    ]

    def score(id_, name, data_type, value, subject):
        return {"id": id_, "projectId": PROJECT, "name": name, "source": "API",
                "timestamp": iso(start, 60), "environment": "default",
                "createdAt": iso(start, 60), "updatedAt": iso(start, 60), "dataType": data_type,
                "value": value, "comment": None, "subject": subject}

    scores = [score(f"s1-{trace_id[:8]}", "user-feedback", "BOOLEAN", True,
                    {"kind": "trace", "id": trace_id}),
              score(f"s2-{trace_id[:8]}", "helpfulness", "NUMERIC", 0.9,
                    {"kind": "observation", "id": f"{trace_id[:8]}-g2", "traceId": trace_id})]
    return observations, scores


LF_NEW, LF_OLD = "c2a1e0d4-5b6f-4e3a-9d2c-7f8e1a0b3c4d", "7d9e3b1f-2a4c-4f6e-8b0d-1c3e5a7f9b2d"
LF_OBS, LF_SCORES = [], []
for _id, _start, _order, _answer in ((LF_NEW, NEW, "A1043", "It shipped with UPS."),
                                     (LF_OLD, OLD, "B2200", "It is on its way.")):
    _o, _s = lf_trace(_id, _start, _order, _answer)
    LF_OBS += _o
    LF_SCORES += _s

# --- LangSmith: a root chain run, two llm runs (the OpenAI wrapper's shape), a tool run --------

LS_NEW, LS_OLD = "1f0c8a52-4b7e-4c1d-9a3e-2b6d5f8e7a10", "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
LS_SESSION = "0d8e7f6a-5b4c-4d3e-9f2a-1b0c9d8e7f6a"
TENANT = "e1f2a3b4-c5d6-4e7f-8a9b-0c1d2e3f4a5b"


def ls_trace(trace_id: str, start: datetime, query: str) -> list[dict]:
    call = {"id": f"call_{trace_id[:4]}", "type": "function",
            "function": {"name": "search_docs", "arguments": json.dumps({"query": query})}}
    first = [{"role": "system", "content": "You are the Acme docs assistant."},
             {"role": "user", "content": f"How do I {query}?"}]
    second = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "content": "Settings > Keys."}]
    tools = [{"type": "function", "function": {"name": "search_docs", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}}]
    stamp = start.strftime("%Y%m%dT%H%M%S%fZ")

    def run(id_, run_type, name, plus, parent, inputs, outputs, **more):
        order = f"{stamp}{trace_id}" + ("" if parent is None else f".{stamp}{id_}")
        return {"id": id_, "trace_id": trace_id, "parent_run_id": parent, "run_type": run_type,
                "name": name, "start_time": iso(start, plus), "end_time": iso(start, plus + 1),
                "dotted_order": order, "status": "success", "error": None, "inputs": inputs,
                "outputs": outputs, "extra": {"metadata": {"thread_id": "th-55"}}, "tags": [],
                "session_id": LS_SESSION, "events": [], **more}

    def response(message, prompt, completion):
        return {"id": "chatcmpl-1", "model": "gpt-4o-mini-2024-07-18", "choices": [
            {"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}

    base = trace_id[:-4]
    return [
        run(trace_id, "chain", "agent", 0, None, {"question": f"How do I {query}?"},
            {"answer": "Use Settings > Keys."},
            feedback_stats={"user_score": {"n": 1, "avg": 1.0, "values": {}},
                            "correctness": {"n": 1, "avg": 0.8, "values": {}}}),
        run(base + "0001", "llm", "ChatOpenAI", 0.1, trace_id, {"messages": first, "tools": tools},
            response({"role": "assistant", "content": None, "tool_calls": [call]}, 142, 17)),
        run(base + "0002", "tool", "search_docs", 1.0, trace_id, {"query": query},
            {"output": "Settings > Keys."}),
        run(base + "0003", "llm", "ChatOpenAI", 1.5, trace_id, {"messages": second, "tools": tools},
            response({"role": "assistant", "content": "Use Settings > Keys."}, 201, 31)),
    ]


LS_RUNS = ls_trace(LS_NEW, NEW, "rotate an API key") + ls_trace(LS_OLD, OLD, "delete a project")


# --- the scripted server ------------------------------------------------------------------------

def after(start: str, since: str | None) -> bool:
    """A start time at or after the filter's (none: everything)."""
    def parse(text):
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        return when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    return since is None or parse(start) >= parse(since)


class Service(BaseHTTPRequestHandler):
    """Langfuse's and LangSmith's public API, as far as the SDKs call it."""

    calls: list = []  # (method, path) of every request, for the tests to read

    def log_message(self, *args):
        pass

    def answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        Service.calls.append(("GET", url.path, query))
        if url.path.startswith("/api/public/"):
            expected = "Basic " + base64.b64encode(b"pk-lf-test:sk-lf-test").decode()
            if self.headers.get("Authorization") != expected:
                return self.answer(401, {"message": "Invalid credentials. Confirm that you've "
                                         "configured the correct host."})
            if url.path == "/api/public/v2/observations":
                found = [o for o in LF_OBS
                         if query.get("traceId") in (None, o["traceId"])
                         and (query.get("isRootObservation") != "true" or o["isRootObservation"])
                         and after(o["startTime"], query.get("fromStartTime"))]
                found.sort(key=lambda o: o["startTime"], reverse=True)  # newest first
                return self.page(found, query, {})
            if url.path == "/api/public/v3/scores":
                found = [s for s in LF_SCORES if query.get("traceId") in (
                    s["subject"]["id"], s["subject"].get("traceId"))]
                return self.page(found, query, {"limit": int(query.get("limit", 50))})
        if url.path == "/sessions":
            if self.headers.get("x-api-key") != "lsv2_pt_test":
                return self.answer(401, {"detail": "Invalid token"})
            if query.get("name") != "support-bot":
                return self.answer(200, [])
            return self.answer(200, [{"id": LS_SESSION, "name": "support-bot",
                                      "tenant_id": TENANT, "start_time": iso(OLD, -86400),
                                      "reference_dataset_id": None}])
        return self.answer(404, {"detail": "Not Found"})

    def page(self, items: list, query: dict, meta: dict) -> None:
        """One page of a cursor-paginated list: the cursor is the next item's index."""
        start, size = int(query.get("cursor") or 0), int(query.get("limit", 50))
        rest = start + size < len(items)
        self.answer(200, {"data": items[start:start + size],
                          "meta": {**meta, "cursor": str(start + size) if rest else None}})

    def do_POST(self):
        url = urlparse(self.path)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        Service.calls.append(("POST", url.path, body))
        if url.path == "/runs/query":
            if self.headers.get("x-api-key") != "lsv2_pt_test":
                return self.answer(401, {"detail": "Invalid token"})
            runs = [r for r in LS_RUNS if body.get("session") == [LS_SESSION]
                    and body.get("trace") in (None, r["trace_id"])
                    and (not body.get("is_root") or r["parent_run_id"] is None)
                    and after(r["start_time"], body.get("start_time"))]
            runs.sort(key=lambda r: r["start_time"], reverse=True)
            if body.get("select"):
                runs = [{k: r[k] for k in body["select"] if k in r} for r in runs]
            return self.answer(200, {"runs": runs, "cursors": {"next": None}})
        return self.answer(404, {"detail": "Not Found"})


@pytest.fixture
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Service.calls = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A project folder whose last cycle (tag gen-1) was committed an hour ago."""
    for name in ("LANGFUSE_BASE_URL", "LANGFUSE_HOST", "LANGSMITH_PROJECT", "LANGCHAIN_ENDPOINT",
                 "LANGSMITH_ENDPOINT", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    hour_ago = iso(LAST_CYCLE)
    env = {**os.environ, "GIT_COMMITTER_DATE": hour_ago, "GIT_AUTHOR_DATE": hour_ago}
    for args in (["init", "-q"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                                  "--allow-empty", "-m", "gen-1"], ["tag", "gen-1"]):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, env=env)
    return tmp_path


def set_langfuse(monkeypatch, url, secret="sk-lf-test"):
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", secret)
    monkeypatch.setenv("LANGFUSE_HOST", url)


def set_langsmith(monkeypatch, url, key="lsv2_pt_test"):
    monkeypatch.setenv("LANGSMITH_API_KEY", key)
    monkeypatch.setenv("LANGSMITH_ENDPOINT", url)


def ingest_inbox(root: Path) -> tuple[dict, list[dict]]:
    metrics = ingest.run(cfg.Ingest(), root / "data" / "inbox", root / "data" / "traces",
                         root / "data" / "ingested.parquet",
                         root / "data" / "quarantine" / "ingest.jsonl")
    return metrics, pq.read_table(root / "data" / "ingested.parquet").to_pylist()


# --- Langfuse -----------------------------------------------------------------------------------

def test_langfuse_pull_since_last_cycle_then_ingest_and_pull_again(service, workspace,
                                                                   monkeypatch):
    set_langfuse(monkeypatch, service)
    inbox = workspace / "data" / "inbox"
    first = pull.pull(workspace, inbox, "langfuse")
    # the last cycle (gen-1) was an hour ago: only the new trace, not last month's
    assert first["traces"] == 1 and first["file"].startswith(str(inbox / "langfuse-"))
    assert datetime.fromisoformat(first["since"]) == LAST_CYCLE - pull.OVERLAP
    assert ("GET", "/api/public/v3/scores") in [c[:2] for c in Service.calls]
    metrics, rows = ingest_inbox(workspace)
    assert metrics["per_format"]["langfuse"]["accepted"] == 1 and metrics["quarantined"] == 0
    [row] = rows
    assert row["trace_id"] == LF_NEW and row["format"] == "langfuse"
    messages = json.loads(row["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {
        "name": "lookup_order", "arguments": '{"order_id": "A1043"}'}
    assert messages[-1]["content"] == "It shipped with UPS."
    assert json.loads(row["feedback"])["scores"] == {"user-feedback": True, "helpfulness": 0.9}
    assert row["conversation_id"] == "chat-A1043"  # the trace record's sessionId
    assert row["n_tool_calls"] == 1 and row["model"] == "gpt-4o-mini-2024-07-18"

    # the same window again: nothing new is written, the inbox holds one file
    again = pull.pull(workspace, inbox, "langfuse")
    assert again["traces"] == 0 and again["file"] is None
    assert "no new traces" in again["message"]
    # everything since last month: the old trace only, the new one is not written twice
    wider = pull.pull(workspace, inbox, "langfuse", since=iso(OLD - timedelta(days=1)))
    assert wider["traces"] == 1
    assert LF_NEW not in Path(wider["file"]).read_text()
    metrics, rows = ingest_inbox(workspace)
    assert [r["trace_id"] for r in rows] == [LF_OLD]
    assert metrics["accepted"] == 1 and metrics["duplicates"] == 0
    assert len(list(inbox.glob("*.jsonl"))) == 2
    assert not list(inbox.glob(".*"))  # no temporary file left behind


def test_a_file_pulled_twice_is_counted_as_duplicates_by_ingest(service, workspace, monkeypatch):
    # the process died after writing the inbox file, before it remembered the ids
    set_langfuse(monkeypatch, service)
    inbox = workspace / "data" / "inbox"
    pull.pull(workspace, inbox, "langfuse", since="2000-01-01T00:00:00Z")
    pull.state_path(workspace, "langfuse", "").unlink()
    second = pull.pull(workspace, inbox, "langfuse", since="2000-01-01T00:00:00Z")
    assert second["traces"] == 2
    metrics, _ = ingest_inbox(workspace)
    assert (metrics["rows_read"], metrics["accepted"], metrics["duplicates"]) == (4, 2, 2)


def test_limit_takes_the_newest_and_the_next_pull_the_rest(service, workspace, monkeypatch):
    set_langfuse(monkeypatch, service)
    inbox = workspace / "data" / "inbox"
    first = pull.pull(workspace, inbox, "langfuse", since="2000-01-01T00:00:00Z", limit=1)
    assert (first["traces"], first["limit_reached"]) == (1, True)
    assert LF_NEW in Path(first["file"]).read_text()
    second = pull.pull(workspace, inbox, "langfuse", since="2000-01-01T00:00:00Z", limit=1)
    assert LF_OLD in Path(second["file"]).read_text()
    assert second["limit_reached"] is False


def test_langfuse_refused_key_and_down_server_exit_2(service, workspace, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.chdir(workspace)
    for name in ("params.yaml", "dvc.yaml"):  # the CLI checks params.yaml before pulling
        shutil.copy(REPO / name, workspace / name)
    set_langfuse(monkeypatch, service, secret="sk-lf-wrong")
    assert pull_cli(main, "langfuse") == 2
    err = capsys.readouterr().err
    assert "refused the key (HTTP 401)" in err and "LANGFUSE_SECRET_KEY" in err
    assert "Traceback" not in err
    # nothing listens on this port: the service is down
    set_langfuse(monkeypatch, "http://127.0.0.1:9")
    assert pull_cli(main, "langfuse") == 2
    err = capsys.readouterr().err
    assert "did not answer" in err and "LANGFUSE_HOST" in err
    monkeypatch.delenv("LANGFUSE_SECRET_KEY")
    assert pull_cli(main, "langfuse") == 2
    assert "LANGFUSE_SECRET_KEY not set" in capsys.readouterr().err
    assert not list((workspace / "data" / "inbox").glob("*")) if (
        workspace / "data" / "inbox").exists() else True


def pull_cli(main, *args) -> int:
    try:
        return main(["pull", *args])
    except SystemExit as exc:  # argparse
        return int(exc.code)


# --- LangSmith ----------------------------------------------------------------------------------

def test_langsmith_pull_then_ingest(service, workspace, monkeypatch):
    set_langsmith(monkeypatch, service)
    inbox = workspace / "data" / "inbox"
    first = pull.pull(workspace, inbox, "langsmith", project="support-bot")
    assert first["traces"] == 1 and Path(first["file"]).name.startswith("langsmith-")
    queries = [c[2] for c in Service.calls if c[1] == "/runs/query"]
    assert queries[0]["is_root"] is True and "start_time" in queries[0]
    metrics, rows = ingest_inbox(workspace)
    assert metrics["per_format"]["langsmith"]["accepted"] == 1 and metrics["quarantined"] == 0
    [row] = rows
    assert row["trace_id"] == LS_NEW
    messages = json.loads(row["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "search_docs"
    assert json.loads(row["feedback"])["scores"] == {"user_score": 1.0, "correctness": 0.8}
    assert json.loads(row["usage"]) == {"input_tokens": 142 + 201, "output_tokens": 17 + 31}
    assert row["conversation_id"] == "th-55"
    again = pull.pull(workspace, inbox, "langsmith", project="support-bot",
                      since="2000-01-01T00:00:00Z")
    assert again["traces"] == 1 and LS_NEW not in Path(again["file"]).read_text()
    metrics, rows = ingest_inbox(workspace)
    assert [r["trace_id"] for r in rows] == [LS_OLD] and metrics["duplicates"] == 0


def test_langsmith_refused_key_unknown_project_and_down_server(service, workspace, monkeypatch):
    inbox = workspace / "data" / "inbox"
    set_langsmith(monkeypatch, service, key="lsv2_pt_wrong")
    with pytest.raises(pull.PullError, match="refused the key: check LANGSMITH_API_KEY"):
        pull.pull(workspace, inbox, "langsmith", project="support-bot")
    set_langsmith(monkeypatch, service)
    with pytest.raises(pull.PullError, match="no project 'elsewhere'"):
        pull.pull(workspace, inbox, "langsmith", project="elsewhere")
    set_langsmith(monkeypatch, "http://127.0.0.1:9")
    with pytest.raises(pull.PullError, match="did not answer.*LANGSMITH_ENDPOINT"):
        pull.pull(workspace, inbox, "langsmith", project="support-bot")
    monkeypatch.delenv("LANGSMITH_API_KEY")
    with pytest.raises(pull.PullError, match="LANGSMITH_API_KEY not set"):
        pull.pull(workspace, inbox, "langsmith", project="support-bot")
    assert not inbox.exists() or not list(inbox.iterdir())


# --- the rest -----------------------------------------------------------------------------------

def test_a_missing_sdk_names_the_extra(workspace, monkeypatch):
    # a fresh interpreter in which the SDKs cannot be imported, as without the extras: a None in
    # sys.modules makes `import langfuse` raise ImportError
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, workspace / name)
    set_langfuse(monkeypatch, "http://127.0.0.1:9")
    set_langsmith(monkeypatch, "http://127.0.0.1:9")
    for service in ("langfuse", "langsmith"):
        code = ("import sys; sys.modules['langfuse'] = sys.modules['langsmith'] = None; "
                f"from flows.cli import main; sys.exit(main(['pull', '{service}']))")
        done = subprocess.run([sys.executable, "-c", code], cwd=workspace, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 2, done.stderr
        assert f"pip install 'offseason[{service}]'" in done.stderr
        assert "Traceback" not in done.stderr


def test_pull_section_is_optional_and_checked(workspace, service, monkeypatch):
    params = workspace / "params.yaml"
    params.write_text("base: {}\n")
    assert pull.before_cycle(workspace, workspace / "data" / "inbox", params) is None
    params.write_text("pull: {service: langfuse}\n")
    set_langfuse(monkeypatch, service)
    message = pull.before_cycle(workspace, workspace / "data" / "inbox", params)
    assert message.startswith("pull: 1 new trace(s) from langfuse")
    from flows import params as settings

    params.write_text("pull: {service: datadog}\n")
    with pytest.raises(cfg.ParamsError, match="pull.service: 'datadog'.*langfuse, langsmith"):
        cfg.load("pull", params, settings.SECTIONS)
    params.write_text("pull: {servce: langfuse}\n")
    with pytest.raises(cfg.ParamsError, match="did you mean 'pull.service'"):
        cfg.load("pull", params, settings.SECTIONS)
