"""`offseason erase --upstream`: a person's traces pulled from Langfuse and LangSmith (the vendors'
own SDKs, over real HTTP, against the scripted server of tests/trace_services.py, which deletes
asynchronously: a trace asked to be deleted is answered by one more read, then gone), erased
from a small project of no cycle (a git repository, pull, ingest), and deleted upstream.
"""

import json
import shutil
import subprocess
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from trace_services import LF_NEW, LF_OLD, LS_NEW, LS_SESSION, Service, set_langfuse, set_langsmith

from flows.intake import pull
from flows.orchestration import erase
from stages import config as cfg
from stages import erasure, ingest

EVERYTHING = "2000-01-01T00:00:00Z"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Service.calls, Service.deleting, Service.gone = [], set(), set()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    Service.deleting, Service.gone = set(), set()  # the traces back for the next test


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def project(tmp_path, monkeypatch, service):
    """A git repository whose inbox holds both services' traces as `offseason pull` wrote them,
    ingested (the erasure index), no cycle run."""
    for name in ("LANGFUSE_BASE_URL", "LANGFUSE_HOST", "LANGSMITH_PROJECT", "LANGCHAIN_ENDPOINT",
                 "LANGSMITH_ENDPOINT", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY",
                 "MLFLOW_TRACKING_URI", "OFFSEASON_FAIL_AT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("OFFSEASON_ERASURE_SALT", "test-salt")
    root = tmp_path
    git(root, "init", "-q")
    git(root, "config", "user.name", "t")
    git(root, "config", "user.email", "t@t")
    git(root, "commit", "-q", "--allow-empty", "-m", "start")
    set_langfuse(monkeypatch, service)
    set_langsmith(monkeypatch, service)
    inbox = root / "data" / "inbox"
    assert pull.pull(root, inbox, "langfuse", since=EVERYTHING)["traces"] == 2
    assert pull.pull(root, inbox, "langsmith", since=EVERYTHING,
                     project="support-bot")["traces"] == 2
    metrics = ingest.run(cfg.Ingest(), inbox, root / "data" / "traces",
                         root / "data" / "ingested.parquet",
                         root / "data" / "quarantine" / "ingest.jsonl", erasure.salt(root))
    assert metrics["accepted"] == 4
    Service.calls = []
    return root


def erase_it(root: Path, kind: str, value: str, upstream: bool = True) -> dict:
    return erase.erase(root, kind, value, "DSR-17", cfg.Erase(), "offseason-agent",
                       upstream=upstream)


def log(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "erasures.jsonl").read_text().splitlines()]


def deletes(path: str) -> list:
    return [c[2] for c in Service.calls if c[:2] in (("DELETE", path), ("POST", path))]


def test_langfuse_delete_is_asked_recorded_then_confirmed_by_status(project):
    receipt = erase_it(project, "user", "u-17")
    # one request through the SDK, both of the person's traces (Langfuse's keys name the project)
    assert [sorted(b["traceIds"]) for b in deletes("/api/public/traces")] == \
        [sorted([LF_NEW, LF_OLD])]
    assert receipt["status"] == "done" and receipt["done"]
    [group] = receipt["upstream"]
    assert (group["service"], group["traces"], group["answer"]) == ("langfuse", 2,
                                                                    "Traces deleted")
    assert group["asked"] and group["confirmed"] is None and "asynchronously" in \
        group["asynchronous"]
    assert group["request"] == "DELETE /api/public/traces {traceIds}"
    [left] = [i for i in receipt["left"] if i.get("service")]
    assert left["what"].startswith("Langfuse (2 trace(s)") and "asynchronously" in left["why"]
    assert "--status" in left["todo"] and not left.get("open")
    page = (project / ".offseason" / "erasures" / f"{receipt['id']}.txt").read_text()
    assert "upstream       Langfuse: 2 trace(s) asked" in page and "pending" in page
    [row] = log(project)
    assert row["upstream"][0]["asked"] == group["asked"] and not row["upstream"][0]["confirmed"]
    assert erase.awaiting_upstream(project)
    # no trace id in the committed log
    assert LF_NEW not in (project / "erasures.jsonl").read_text()

    # the first look finds them still there (the service deletes asynchronously) ...
    text, open_count = erase.status(project, 30, recheck=True)
    assert open_count == 0
    assert "Langfuse: 2 of 2 trace(s) still there, deletion pending" in text
    assert "deletion PENDING" in text and "1 upstream deletion(s) pending" in text
    # ... the next finds none: recorded in erasures.jsonl (committed) and the receipt
    text, _ = erase.status(project, 30, recheck=True)
    assert "Langfuse: confirmed gone (2 trace(s))" in text
    [row] = log(project)
    assert row["upstream"][0]["confirmed"] and row["status"] == "done"
    assert not erase.awaiting_upstream(project)
    assert git(project, "status", "--porcelain", "--untracked-files=no") == ""
    assert "confirmed gone" in erase.status(project, 30)[0]
    receipt = json.loads((project / ".offseason" / "erasures" / f"{receipt['id']}.json")
                         .read_text())
    assert receipt["upstream"][0]["confirmed"] and not [i for i in receipt["left"]
                                                        if i.get("service")]
    # the ids, kept to ask again, are forgotten once confirmed
    assert not (project / ".offseason" / "erasures" / f"{receipt['id']}.upstream.json").exists()
    assert not holding(project, [LF_NEW, LF_OLD])


def test_langsmith_delete_names_the_project_then_status_confirms(project):
    receipt = erase_it(project, "trace", LS_NEW)
    # the documented body, with the project's id as the runs pulled named it, the SDK's key
    assert deletes("/runs/delete") == [{"trace_ids": [LS_NEW], "session_id": LS_SESSION}]
    [group] = receipt["upstream"]
    assert (group["service"], group["project"], group["project_id"]) == (
        "langsmith", "support-bot", LS_SESSION)
    assert group["answer"] == "HTTP 202" and receipt["status"] == "done"
    assert "LangSmith project support-bot: 1 of 1 trace(s) still there" in \
        erase.status(project, 30, recheck=True)[0]
    assert "LangSmith project support-bot: confirmed gone" in \
        erase.status(project, 30, recheck=True)[0]
    queries = [c[2] for c in Service.calls if c[1] == "/runs/query"]
    assert queries and all(q["trace"] == LS_NEW and q["session"] == [LS_SESSION]
                           for q in queries)


def test_a_refusing_or_unreachable_service_leaves_the_request_open(project, service,
                                                                   monkeypatch):
    set_langfuse(monkeypatch, service, secret="sk-lf-wrong")
    receipt = erase_it(project, "user", "u-17")
    assert receipt["status"] == "open: Langfuse (2 trace(s) offseason pulled from there) " \
        "not deleted" and receipt["done"] is None
    [left] = [i for i in receipt["left"] if i.get("open")]
    assert "refused (HTTP 401" in left["why"] and "LANGFUSE_SECRET_KEY" in left["why"]
    assert "--upstream" in left["todo"]
    assert receipt["upstream"][0]["asked"] is None
    [row] = log(project)
    assert row["done"] is None
    text, open_count = erase.status(project, 30)
    assert open_count == 1 and f"{receipt['id']}: OPEN" in text and "NOT deleted" in text

    # the same command again, the service down, then no credentials: still open, each named
    set_langfuse(monkeypatch, "http://127.0.0.1:9")
    again = erase_it(project, "user", "u-17")
    assert again["id"] == receipt["id"] and again["status"].startswith("open")
    assert "did not answer" in [i for i in again["left"] if i.get("open")][0]["why"]
    monkeypatch.delenv("LANGFUSE_SECRET_KEY")
    again = erase_it(project, "user", "u-17")
    assert "LANGFUSE_SECRET_KEY not set" in [i for i in again["left"] if i.get("open")][0]["why"]
    # the one request that reached the service was the refused one
    assert log(project)[0]["done"] is None and len(deletes("/api/public/traces")) == 1

    # back: the same erasure finishes, its deletion asked
    set_langfuse(monkeypatch, service)
    done = erase_it(project, "user", "u-17")
    assert done["id"] == receipt["id"] and done["status"] == "done"
    assert done["upstream"][0]["asked"] and len(deletes("/api/public/traces")) == 2
    assert not list((project / ".offseason" / "erasures").glob("*.pending.json"))

    # LangSmith refusing: the key wrong
    set_langsmith(monkeypatch, service, key="lsv2_pt_wrong")
    refused = erase_it(project, "trace", LS_NEW)
    assert refused["status"].startswith("open: LangSmith project support-bot")
    assert "refused the key (HTTP 401)" in [i for i in refused["left"] if i.get("open")][0]["why"]


def holding(root: Path, ids: list[str]) -> list[str]:
    """The files offseason keeps (its folder, erasures.jsonl) that hold any of the ids."""
    files = [*(root / ".offseason").rglob("*"), root / "erasures.jsonl"]
    return [str(p) for p in files if p.is_file() and any(i.encode() in p.read_bytes()
                                                         for i in ids)]


def test_without_upstream_the_receipt_says_how_and_keeps_no_id(project):
    dry = erase.erase(project, "user", "u-17", "", cfg.Erase(), "m", dry_run=True)
    assert [(g["service"], g["traces"]) for g in dry["upstream"]] == [("langfuse", 2)]
    receipt = erase_it(project, "user", "u-17", upstream=False)
    assert receipt["status"] == "done" and not Service.calls
    [left] = [i for i in receipt["left"] if i.get("service")]
    assert "still there" in left["why"] and "--upstream" in left["todo"]
    assert "delete them in Langfuse" in left["todo"]
    assert receipt["upstream"][0]["asked"] is None
    assert "still there (erased without --upstream): delete them in Langfuse" in \
        erase.status(project, 30)[0]

    # offseason keeps no id of them: nothing left to ask about, nothing asked
    assert not holding(project, [LF_NEW, LF_OLD])
    later = erase_it(project, "user", "u-17")
    assert later["status"] == "already erased" and not Service.calls


def test_the_command_line(project, monkeypatch, capsys):
    from flows.cli import main

    for name in ("params.yaml", "dvc.yaml"):  # the CLI checks params.yaml first
        shutil.copy(REPO / name, project / name)
    monkeypatch.chdir(project)
    assert main(["erase", "--user", "u-17", "--upstream", "--json"]) == 0
    receipt = json.loads(capsys.readouterr().out)
    assert receipt["status"] == "done" and receipt["upstream"][0]["asked"]
    assert main(["erase", "--status"]) == 0
    assert "deletion pending" in capsys.readouterr().out
    assert main(["erase", "--status"]) == 0
    out = capsys.readouterr().out
    assert "Langfuse: confirmed gone (2 trace(s))" in out and "0 open, 1 done" in out
