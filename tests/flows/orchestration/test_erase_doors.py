"""Issue 52's whole test: a synthetic person's traces come in through every door offseason has
(an inbox file, `offseason collect` over OTLP/HTTP, `offseason pull` from a scripted Langfuse),
a cycle promotes a model trained on them and another follows, then `offseason erase --user`;
afterwards no byte offseason owns holds their ids or words, the next cycle runs green, DVC is
clean, and lineage marks the erased trace and the generations it fed."""

import json
import os
import signal
import socket
import subprocess
import threading
from datetime import datetime, timedelta, timezone
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import trace_services
import yaml
from conftest import BIN, cli_env, copy_project, offseason, write_params
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_erase import SESSION, USER, WORD, dvc_status, git_dirty, scan

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("erase-doors")]

# the warm start's gate, every rule relaxed: a trained candidate is promoted (what is tested is
# the erasure of what it learned from, not the verdict)
PROMOTES = {"gate": {"min_improvement": -1.0, "max_length_increase": 100.0,
                     "max_format_regression": 1.0, "max_tool_error_regression": 1.0,
                     "forgetting_max_regression": 1.0, "max_hack_increase": 1.0}}
LF_TRACE = "5e0f7a2b-qv00-4c1d-8e9f-0a1b2c3d4e5f"  # the person's trace in Langfuse
SUMS = [(1, 1), (2, 3), (4, 4), (3, 5), (6, 2), (1, 7), (5, 4), (2, 2), (3, 3), (8, 1)]


def inbox_file() -> str:
    """The person's conversations as a client writes them: small sums the warm start gets
    right often enough to learn from, and one record ingest quarantines."""
    rows = [{"id": f"qv-trace-{i}", "user": USER, "session_id": SESSION,
             "created_at": "2026-01-01T10:00:00+00:00",
             "messages": [{"role": "user", "content": f"{a}+{b} ({WORD} asks)"},
                          {"role": "assistant", "content": f"answer:{a + b}"}]}
            for i, (a, b) in enumerate(SUMS)]
    rows.append({"id": "qv-trace-broken", "user": USER,
                 "messages": [{"content": f"{WORD} without a role"}]})
    return "".join(json.dumps(r) + "\n" for r in rows)


def otlp_request(n: int) -> tuple[bytes, list[str]]:
    """`n` agent turns of the person, as an OpenTelemetry SDK exports them (protobuf), with
    their user and session on the root span; and the trace ids (hex)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "calc-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for a, b in SUMS[:n]:
        with tracer.start_as_current_span("invoke_agent calc") as root:
            root.set_attributes({"gen_ai.operation.name": "invoke_agent", "user.id": USER,
                                 "gen_ai.conversation.id": SESSION})
            with tracer.start_as_current_span("chat tiny") as span:
                span.set_attributes({
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny",
                    "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
                        {"type": "text", "content": f"{a}+{b} ({WORD} collected)"}]}]),
                    "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                        {"type": "text", "content": f"answer:{a + b}"}]}])})
    spans = memory.get_finished_spans()
    ids = sorted({format(s.context.trace_id, "032x") for s in spans})
    return encode_spans(spans).SerializeToString(), ids


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def collect_door(root: Path) -> list[str]:
    """`offseason collect` in the project, the person's spans posted to it, stopped once their
    traces are in the inbox; the trace ids."""
    port = free_port()
    proc = subprocess.Popen([str(BIN / "offseason"), "collect", "--port", str(port)], cwd=root,
                            env=cli_env(root), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        banner = proc.stdout.readline()
        assert "listening on" in banner, banner
        body, ids = otlp_request(3)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/traces", content=body,
                            headers={"Content-Type": "application/x-protobuf"}, timeout=30)
        assert answer.status_code == 200, answer.text
        inbox = root / "data" / "inbox"
        for _ in range(600):  # written once each root span ended and file_seconds passed
            written = "".join(p.read_text() for p in inbox.iterdir()
                              if not p.name.startswith(".") and p.name != "person.jsonl"
                              and not p.name.startswith("traffic-"))
            if all(i in written for i in ids):
                break
            threading.Event().wait(0.1)
        else:
            raise AssertionError("collect never wrote the person's traces")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    return ids


def pull_door(root: Path) -> None:
    """A scripted Langfuse holding one trace of the person's, pulled with `offseason pull`."""
    start = datetime.now(timezone.utc) - timedelta(minutes=1)
    observations, scores = trace_services.lf_trace(LF_TRACE, start, f"{WORD}-77",
                                                   "It shipped with UPS.")
    for item in observations:
        item.update(userId=USER, sessionId=SESSION)
    server = ThreadingHTTPServer(("127.0.0.1", 0), trace_services.Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    trace_services.LF_OBS[:], trace_services.LF_SCORES[:] = observations, scores
    try:
        env = {**cli_env(root), "LANGFUSE_PUBLIC_KEY": "pk-lf-test",
               "LANGFUSE_SECRET_KEY": "sk-lf-test",
               "LANGFUSE_HOST": f"http://127.0.0.1:{server.server_address[1]}"}
        pulled = subprocess.run([str(BIN / "offseason"), "pull", "langfuse", "--since",
                                 trace_services.iso(start - timedelta(hours=1))], cwd=root,
                                env=env, capture_output=True, text=True)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    finally:
        server.shutdown()
        server.server_close()
        trace_services.langfuse_data(trace_services.NEW)
    assert LF_TRACE in "".join(p.read_text() for p in (root / "data/inbox").glob("langfuse-*"))


def promoted(root: Path) -> bool:
    return json.loads((root / "metrics" / "promotion.json").read_text())["promoted"]


def markers_of(root: Path) -> list:
    """The person's ids and words, the collected trace ids as text and as the journal's bytes."""
    collected = json.loads((root / "collected.json").read_text())
    return [USER, SESSION, WORD, "qv-trace-", LF_TRACE, *collected,
            *(bytes.fromhex(i) for i in collected)]


@pytest.fixture(scope="module")
def fed(learned_once, tmp_path_factory):
    """The person through the three doors, a cycle that promotes gen-1 trained on them, a day
    later another cycle. Tests take copies of it, never it."""
    root = copy_project(learned_once, tmp_path_factory.mktemp("doors") / "project")
    write_params(root, PROMOTES)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["runtime"]["collect"].update(idle_seconds=3.0, file_seconds=0.0)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "data" / "inbox" / "person.jsonl").write_text(inbox_file())
    collected = collect_door(root)
    pull_door(root)
    offseason(root, "run")
    assert promoted(root), "gen-1 was not promoted"
    offseason(root, "simulate")
    offseason(root, "run")
    (root.parent / "collected.json").write_text(json.dumps(collected))
    return root


def changed_stages(root: Path) -> dict:
    return json.loads(subprocess.run([str(BIN / "dvc"), "status", "--json"], cwd=root,
                                     capture_output=True, text=True, check=True).stdout)


def test_a_person_through_every_door_is_erased_from_every_byte(fed, tmp_path):
    root = copy_project(fed, tmp_path / "project")
    markers = markers_of(fed.parent)
    before = scan(root, markers)
    assert ".offseason/pull/langfuse.json" in before and \
        any(k.startswith("data/replay") for k in before)
    assert any(k.startswith(".offseason/collect/journal/") for k in before)
    assert any(k.startswith(".dvc/cache/") for k in before)

    dry = json.loads(offseason(root, "erase", "--user", USER, "--dry-run", "--json").stdout)
    # every door's traces found by the one user id: 10 + the quarantined one, 3, 1
    assert dry["found"]["traces"] == len(SUMS) + 1 + 3 + 1
    assert "person.jsonl" in dry["found"]["inbox_files"] and \
        any(f.startswith("langfuse-") for f in dry["found"]["inbox_files"])
    # the promoted gen-1 learned from them (its SFT examples are their verified rollouts)
    assert "gen-1" in dry["models"]["direct"], dry["models"]

    receipt = json.loads(offseason(root, "erase", "--user", USER, "--json").stdout)
    assert receipt["status"] == "done" and receipt["models"]["policy"] == "flag"
    assert scan(root, markers) == {}
    assert "up to date" in dvc_status(root) and git_dirty(root) == ""
    # erase.models: flag, in the history and the report: a marker per generation that learned
    history = offseason(root, "history").stdout
    for generation in receipt["models"]["generations"]:
        assert f"{generation} learned from traces erased by {receipt['id']}" in history
    rows = json.loads(offseason(root, "history", "--json").stdout)
    assert {r["tag"] for r in rows if r["flagged"]} == set(receipt["models"]["generations"])
    offseason(root, "report", "--out", str(tmp_path / "report.html"))
    page = (tmp_path / "report.html").read_text()
    assert page.count('<tr class="flagged">') == len(receipt["models"]["generations"])

    # the next cycle runs green on what is left, and brings none of it back
    offseason(root, "simulate")
    offseason(root, "run")
    assert scan(root, markers) == {}
    # nothing changed but the champion a promotion leaves for the next cycle to start from
    assert {dep for stage in changed_stages(root).values() for change in stage
            for dep in change.get("changed deps", {})} <= {"models/champion"}
    for generation in ("gen-1", "gen-2"):
        verified = offseason(root, "lineage", "--verify", generation, check=False)
        assert verified.returncode == 0 and "MISSING" not in verified.stdout, verified.stdout
    assert "ERASED" in offseason(root, "lineage", "--verify", "gen-1", check=False).stdout
    traced = offseason(root, "lineage", "--trace", "qv-trace-1").stdout
    assert f"ERASED by {receipt['id']}" in traced
    fed_generations = traced.split("generations that learned from it: ")[1]
    assert "gen-1" in fed_generations, traced


def test_the_rollback_policy_brings_back_a_champion_that_never_saw_them(fed, tmp_path):
    root = copy_project(fed, tmp_path / "project")
    write_params(root, {"erase": {"models": "rollback"}})
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam",
                    "erase.models: rollback"], cwd=root, check=True)
    receipt = json.loads(offseason(root, "erase", "--user", USER, "--json").stdout)
    models = receipt["models"]
    assert receipt["status"] == "done" and models["policy"] == "rollback"
    assert models["champion_affected"], models
    # the newest generation that was a champion and never saw them
    log = [json.loads(line) for line in (root / "promotions.jsonl").read_text().splitlines()]
    champions = sorted({e["champion_generation"] for e in log[:-1]
                        if e["action"] in ("init", "promote", "rollback")})
    clean = [f"gen-{g}" for g in champions if f"gen-{g}" not in models["generations"]]
    assert models["action"] == f"rolled back to {clean[-1]}"
    # promotion.rollback's record: the champion it named, with the erasure as the reason
    assert log[-1]["action"] == "rollback" and f"gen-{log[-1]['generation']}" == clean[-1]
    assert "erasure" in log[-1]["reason"]
    rows = json.loads(offseason(root, "history", "--json").stdout)
    assert next(r["tag"] for r in rows if r["champion"]) == clean[-1]
    assert scan(root, markers_of(fed.parent)) == {}
