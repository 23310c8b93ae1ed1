"""`offseason pull`: the vendors' own SDKs, over real HTTP, against a scripted server on loopback
(tests/trace_services.py: the endpoints the SDKs call, in the shapes their generated types
declare, and where each shape comes from).
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from trace_services import (
    LAST_CYCLE,
    LF_NEW,
    LF_OLD,
    LS_NEW,
    LS_OLD,
    OLD,
    Service,
    iso,
    set_langfuse,
    set_langsmith,
)

from flows.intake import pull
from stages import config as cfg
from stages import ingest

REPO = Path(__file__).resolve().parents[3]


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
    from flows.project import params as settings

    params.write_text("pull: {service: datadog}\n")
    with pytest.raises(cfg.ParamsError, match="pull.service: 'datadog'.*langfuse, langsmith"):
        cfg.load("pull", params, settings.SECTIONS)
    params.write_text("pull: {servce: langfuse}\n")
    with pytest.raises(cfg.ParamsError, match="did you mean 'pull.service'"):
        cfg.load("pull", params, settings.SECTIONS)


# --- a service that wedges midway (issue 51.4) --------------------------------------------------

@pytest.mark.parametrize("vendor", ["langfuse", "langsmith"])
def test_a_service_that_wedges_midway_fails_within_the_bound_keeping_what_was_pulled(
        vendor, workspace, monkeypatch):
    """Four new traces; the service answers the listing and two traces' requests, then accepts
    and reads every request and never replies. The pull fails within `runtime.pull.stall_seconds`
    (LangSmith's SDK had retried a read timeout 3 times, 30 s each), naming the service and the
    setting; the two traces are written and remembered, and the next pull takes only the rest.
    """
    import trace_services
    from trace_services import NEW, langfuse_data, lf_trace, ls_trace

    extra = [f"{n}b0c8a52-4b7e-4c1d-9a3e-2b6d5f8e7a1{n}" for n in range(3)]
    for n, trace_id in enumerate(extra):  # three more new traces beside LF_NEW / LS_NEW
        if vendor == "langfuse":
            observations, scores = lf_trace(trace_id, NEW + timedelta(seconds=10 + n), f"C{n}",
                                            "Done.")
            trace_services.LF_OBS.extend(observations)
            trace_services.LF_SCORES.extend(scores)
        else:
            trace_services.LS_RUNS.extend(ls_trace(trace_id, NEW + timedelta(seconds=10 + n),
                                                   f"do thing {n}"))
    # the listing, then 2 requests a trace for Langfuse (observations, scores), 1 for LangSmith
    # after its project lookup
    answer = 1 + 2 * 2 if vendor == "langfuse" else 2 + 2
    freed, answered = threading.Event(), []

    class Wedging(Service):
        def handle_one_request(self):
            if len(answered) >= answer:  # read the request, never reply
                self.raw_requestline = self.rfile.readline(65537)
                freed.wait()
                self.close_connection = True
                return
            answered.append(1)
            super().handle_one_request()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Wedging)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    (set_langfuse if vendor == "langfuse" else set_langsmith)(monkeypatch, url)
    project = "support-bot" if vendor == "langsmith" else ""
    inbox = workspace / "data" / "inbox"
    try:
        started = time.monotonic()
        with pytest.raises(pull.PullError) as err:
            pull.pull(workspace, inbox, vendor, project=project, stall=1.0)
        took = time.monotonic() - started
    finally:
        freed.set()
        server.shutdown()
        server.server_close()
    message = str(err.value)
    name = {"langfuse": "Langfuse", "langsmith": "LangSmith"}[vendor]
    assert took < 30, took
    assert f"{name} at {url} did not answer within runtime.pull.stall_seconds=1" in message, message
    assert "Kept: 2 new trace(s)" in message and "the next pull goes on" in message, message
    [kept] = inbox.glob(f"{vendor}-*.jsonl")
    state = json.loads(pull.state_path(workspace, vendor, project).read_text())
    assert len(state["ids"]) == 2 and state["complete_from"] is None
    # the service back: only the two traces left, none written twice
    service = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    (set_langfuse if vendor == "langfuse" else set_langsmith)(
        monkeypatch, f"http://127.0.0.1:{service.server_address[1]}")
    try:
        rest = pull.pull(workspace, inbox, vendor, project=project)
    finally:
        service.shutdown()
        service.server_close()
        if vendor == "langfuse":
            langfuse_data(NEW)
        else:
            del trace_services.LS_RUNS[-12:]
    assert rest["traces"] == 2
    metrics, rows = ingest_inbox(workspace)
    assert len(rows) == 4 and metrics["duplicates"] == 0, metrics
