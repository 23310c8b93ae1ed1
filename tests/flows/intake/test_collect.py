"""`offseason collect` (flows/intake/collect.py) with real clients: the OpenTelemetry SDK's OTLP/HTTP
span and log exporters, the openai client instrumented by opentelemetry-instrumentation-openai-v2,
and OTLP JSON and gzip bodies posted with httpx, to the receiver running as the CLI on a free
loopback port; then the ingest stage reads what it wrote. Also a kill -9 mid-stream, the token,
load shedding, and the grouping and journal on their own.
"""

import contextlib
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from opentelemetry._logs import LogRecord
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import (
    InMemoryLogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flows.intake import collect
from stages import config as cfg
from stages import ingest

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def workspace(path: Path, **settings) -> Path:
    """A folder `offseason collect` runs in: dvc.yaml (where the inbox is) and params.yaml."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "dvc.yaml").write_text((REPO / "dvc.yaml").read_text())
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["runtime"]["collect"].update(settings)
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return path


class Receiver:
    """`python -m flows.cli collect` (this checkout's code) in `root`, on `port`."""

    def __init__(self, root: Path, port: int, env: dict | None = None):
        self.root, self.port = root, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "collect", "--port", str(port)], cwd=root,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.banner = self.proc.stdout.readline()
        assert "listening on" in self.banner, self.banner + self.proc.stdout.read()

    def stop(self, sig: int = signal.SIGTERM) -> str:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        rest = self.proc.communicate(timeout=30)[0]
        return rest


@pytest.fixture
def receiver(tmp_path):
    started = []

    def start(port: int | None = None, env: dict | None = None, **settings) -> Receiver:
        root = workspace(tmp_path / "project",
                         **{"idle_seconds": 3.0, "file_seconds": 0.0, **settings})
        started.append(Receiver(root, port or free_port(), env))
        return started[-1]

    yield start
    for one in started:
        one.stop()


def inbox_files(root: Path) -> list[Path]:
    inbox = root / "data" / "inbox"
    return sorted(p for p in inbox.iterdir() if not p.name.startswith(".")) if inbox.exists() \
        else []


def inbox_documents(root: Path) -> list[dict]:
    """Every OTLP JSON document in the inbox's files (a trace a line)."""
    return [json.loads(line) for path in inbox_files(root)
            for line in path.read_text().splitlines()]


def wait_for_traces(root: Path, n: int, timeout: float = 20) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        documents = inbox_documents(root)
        if len(documents) >= n:
            return documents
        time.sleep(0.1)
    raise AssertionError(f"{len(inbox_documents(root))} traces in the inbox, expected {n}")


def ingested(root: Path, tmp_path: Path) -> tuple[dict, list[dict]]:
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    metrics = ingest.run(cfg.Ingest(), root / "data" / "inbox", out / "traces",
                         out / "ingested.parquet", out / "quarantine.jsonl")
    rows = pq.read_table(out / "ingested.parquet").to_pylist()
    return metrics, sorted(rows, key=lambda r: r["user_text"])


# --- an agent instrumented with the OpenTelemetry SDK, GenAI semantic conventions ---------------

def text(role: str, content: str) -> dict:
    return {"role": role, "parts": [{"type": "text", "content": content}]}


def agent_turn(tracer, question: str, answer: str, with_tool: bool) -> None:
    """One agent invocation: a root `invoke_agent` span, one or two `chat` spans under it."""
    user = text("user", question)
    with tracer.start_as_current_span("invoke_agent calc") as root:
        root.set_attribute("gen_ai.operation.name", "invoke_agent")
        inputs, outputs = [user], [text("assistant", answer)]
        if with_tool:
            call = {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1",
                                                    "name": "calculator",
                                                    "arguments": {"expression": question}}]}
            with tracer.start_as_current_span("chat tiny") as span:
                span.set_attribute("gen_ai.operation.name", "chat")
                span.set_attribute("gen_ai.request.model", "tiny")
                span.set_attribute("gen_ai.input.messages", json.dumps([user]))
                span.set_attribute("gen_ai.output.messages", json.dumps([call]))
            result = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1",
                                                 "response": answer}]}
            inputs = [user, call, result]
        with tracer.start_as_current_span("chat tiny") as span:
            span.set_attribute("gen_ai.operation.name", "chat")
            span.set_attribute("gen_ai.request.model", "tiny")
            span.set_attribute("gen_ai.input.messages", json.dumps(inputs))
            span.set_attribute("gen_ai.output.messages", json.dumps(outputs))


QUESTIONS = [("What is 2+3?", "5", True), ("What is 7*6?", "42", False),
             ("What is 9-4?", "5", True)]


def test_sdk_export_over_protobuf_is_ingested_as_exactly_those_conversations(receiver, tmp_path):
    rx = receiver()
    provider = TracerProvider(resource=Resource.create({"service.name": "calc-agent"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=f"{rx.url}/v1/traces", timeout=10)))
    tracer = provider.get_tracer("test")
    for question, answer, tool in QUESTIONS:
        agent_turn(tracer, question, answer, tool)
    assert provider.force_flush(10_000)
    provider.shutdown()

    documents = wait_for_traces(rx.root, 3)
    assert all(f.name.startswith("otlp-") and f.suffix == ".jsonl" for f in inbox_files(rx.root))
    span = documents[0]["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and len(span["spanId"]) == 16  # hex, as OTLP JSON has it

    metrics, rows = ingested(rx.root, tmp_path)
    assert (metrics["accepted"], metrics["quarantined"]) == (3, 0)
    assert metrics["per_format"]["otel-genai"]["accepted"] == 3
    by_question = {r["user_text"]: json.loads(r["messages"]) for r in rows}
    assert by_question["What is 7*6?"] == [{"role": "user", "content": "What is 7*6?"},
                                           {"role": "assistant", "content": "42"}]
    with_tool = by_question["What is 2+3?"]
    assert [m["role"] for m in with_tool] == ["user", "assistant", "tool", "assistant"]
    assert with_tool[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert with_tool[-1]["content"] == "5"

    status = httpx.get(f"{rx.url}/status").json()
    assert (status["spans"], status["traces_written"], status["pending_spans"]) == (8, 3, 0)
    shown = subprocess.run([sys.executable, "-m", "flows.cli", "collect", "--status", "--port",
                            str(rx.port)], cwd=rx.root, env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "8 spans and 0 log records accepted" in shown.stdout and "3 traces written" in shown.stdout
    # the HTML report's line: the receiver at runtime.collect's address, or none there
    from flows.audit import report

    params = (rx.root / "params.yaml").read_text()
    (rx.root / "params.yaml").write_text(params.replace("port: 4318", f"port: {free_port()}"))
    quiet = report.collect_note(rx.root)  # no receiver is the common case: said, not an error
    assert "no `offseason collect` is running at http://127.0.0.1:" in quiet
    assert "Errno" not in quiet and "refused" not in quiet
    (rx.root / "params.yaml").write_text(params.replace("port: 4318", f"port: {rx.port}"))
    note = report.collect_note(rx.root)
    assert f"at http://127.0.0.1:{rx.port}: collect: 8 spans" in note and "3 traces written" in note


@contextlib.contextmanager
def scripted_openai_server():
    """tests/openai_agent.py's scripted OpenAI-compatible server on a free port: (port, script)."""
    port = free_port()
    script = Path(__file__).parents[2] / "openai_agent.py"
    server = subprocess.Popen([sys.executable, str(script), "server", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        yield port, script
    finally:
        server.terminate()
        server.wait()


def test_the_openai_client_instrumented_by_opentelemetry_exports_to_collect(receiver, tmp_path):
    """One agent instrumented by OpenTelemetry's GenAI instrumentation exporting protobuf, one by
    OpenInference's exporting JSON (OpenTelemetry's JSON exporter): the same conversation each.
    """
    pytest.importorskip("opentelemetry.instrumentation.openai_v2")  # the dev extra has them
    pytest.importorskip("openinference.instrumentation.openai")
    pytest.importorskip("opentelemetry.exporter.otlp.json.http")
    rx = receiver()
    with scripted_openai_server() as (port, script):
        subprocess.run([sys.executable, str(script), "agent", str(port), f"{rx.url}/v1/traces",
                        "What is 2+3?", "genai", "protobuf",
                        "What is 40+2?", "openinference", "json"], check=True, timeout=60)
    wait_for_traces(rx.root, 2)
    metrics, rows = ingested(rx.root, tmp_path)
    assert (metrics["accepted"], metrics["quarantined"]) == (2, 0)
    assert [r["format"] for r in rows] == ["otel-genai", "openinference"]
    first = json.loads(rows[0]["messages"])
    assert [m["role"] for m in first] == ["user", "assistant", "tool", "assistant"]
    assert first[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert json.loads(first[1]["tool_calls"][0]["function"]["arguments"]) == {"expression": "2+3"}
    assert (first[2]["content"], first[3]["content"]) == ("5", "2+3 is 5.")
    # the same turn, recorded by the other instrumentation: the same messages
    second = json.loads(rows[1]["messages"])
    assert second == json.loads(json.dumps(first).replace("2+3", "40+2").replace('"5"', '"42"')
                                .replace(" is 5.", " is 42."))
    assert rows[0]["model"] == rows[1]["model"] == "tiny"


def recorded_spans(n_traces: int, start: int = 0) -> list:
    """Finished SDK spans (ReadableSpan) of `n_traces` agent turns, captured in memory."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "calc-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in range(start, start + n_traces):
        agent_turn(tracer, f"What is {i}+1?", str(i + 1), i % 2 == 0)
    return list(memory.get_finished_spans())


def as_request(spans: list) -> ExportTraceServiceRequest:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans)


def otlp_json_body(spans: list) -> bytes:
    """The request as OTLP JSON: hex ids, as the spec (and the Collector's JSON exporter) has."""
    return json.dumps(collect.otlp_json(list(as_request(spans).resource_spans))).encode()


def test_json_and_gzip_bodies_are_accepted_and_ingested(receiver, tmp_path):
    rx = receiver(file_seconds=3.0)  # the three traces finish within it: gathered in one file
    first, second, third = (recorded_spans(1, start=i) for i in (10, 20, 30))
    answers = [
        httpx.post(f"{rx.url}/v1/traces", content=otlp_json_body(first),
                   headers={"Content-Type": "application/json"}),
        httpx.post(f"{rx.url}/v1/traces", content=gzip.compress(otlp_json_body(second)),
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}),
        httpx.post(f"{rx.url}/v1/traces",
                   content=gzip.compress(as_request(third).SerializeToString()),
                   headers={"Content-Type": "application/x-protobuf",
                            "Content-Encoding": "gzip"}),
    ]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].headers["content-type"] == "application/json"
    assert answers[0].json() == {}  # an ExportTraceServiceResponse without partial success
    assert answers[2].headers["content-type"] == "application/x-protobuf"
    ExportTraceServiceResponse().ParseFromString(answers[2].content)

    wait_for_traces(rx.root, 3)
    assert len(inbox_files(rx.root)) == 1
    metrics, rows = ingested(rx.root, tmp_path)
    assert metrics["accepted"] == 3
    assert [r["user_text"] for r in rows] == ["What is 10+1?", "What is 20+1?", "What is 30+1?"]
    assert {r["trace_id"] for r in rows} == {format(s.context.trace_id, "032x")
                                             for s in first + second + third}


def test_bodies_it_cannot_read_are_refused_by_name(receiver):
    rx = receiver(max_request_bytes=2000)
    post = lambda body, **headers: httpx.post(f"{rx.url}/v1/traces", content=body,  # noqa: E731
                                              headers=headers)
    bad = post(b"\xff\x00garbage", **{"Content-Type": "application/x-protobuf"})
    assert bad.status_code == 400 and "ExportTraceServiceRequest" in bad.json()["message"]
    assert post(b"{}", **{"Content-Type": "text/plain"}).status_code == 415
    assert post(b"{", **{"Content-Type": "application/json"}).status_code == 400
    big = post(b" " * 5000, **{"Content-Type": "application/json"})
    assert big.status_code == 413 and "max_request_bytes" in big.json()["message"]
    bomb = post(gzip.compress(b" " * 100_000), **{"Content-Type": "application/json",
                                                 "Content-Encoding": "gzip"})
    assert bomb.status_code == 413
    cut = post(gzip.compress(b'{"resourceSpans": []}')[:-10],
               **{"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert cut.status_code == 400 and "cut short" in cut.json()["message"]
    rejected = httpx.get(f"{rx.url}/status").json()["rejected"]
    assert rejected["bad_request"] == 3 and rejected["too_large"] == 2
    assert rejected["unsupported"] == 1


def test_kill_9_mid_stream_loses_no_acknowledged_span(receiver, tmp_path):
    port = free_port()
    rx = receiver(port=port)
    spans = recorded_spans(60)
    exporter = OTLPSpanExporter(endpoint=f"{rx.url}/v1/traces", timeout=2)
    acknowledged: list = []
    stop = threading.Event()

    def stream() -> None:
        for i in range(0, len(spans), 3):
            if stop.is_set():
                return
            batch = spans[i:i + 3]
            if exporter.export(batch) == SpanExportResult.SUCCESS:
                acknowledged.extend(batch)

    sender = threading.Thread(target=stream)
    sender.start()
    while len(acknowledged) < 30:
        time.sleep(0.005)
    rx.proc.send_signal(signal.SIGKILL)  # mid-stream: the sender is still sending
    rx.proc.wait()
    stop.set()
    sender.join()
    assert 30 <= len(acknowledged) < len(spans)

    again = receiver(port=port)
    recovered = int(again.banner.split(";")[-1].split()[0])
    assert recovered > 0  # held (acknowledged, not yet written) when killed: the journal had them
    # every span acknowledged and not yet written was recovered from the journal
    deadline = time.time() + 20
    wanted = {format(s.context.span_id, "016x") for s in acknowledged}
    while time.time() < deadline:
        found = {s["spanId"] for document in inbox_documents(again.root)
                 for resource in document["resourceSpans"] for scope in resource["scopeSpans"]
                 for s in scope["spans"]}
        if wanted <= found:
            break
        time.sleep(0.2)
    assert wanted <= found, f"{len(wanted - found)} acknowledged spans lost ({recovered} recovered)"
    metrics, rows = ingested(again.root, tmp_path)
    assert metrics["quarantined"] == 0
    done_traces = {format(s.context.trace_id, "032x") for s in acknowledged
                   if s.parent is None}
    assert done_traces <= {r["trace_id"] for r in rows}


def test_serve_collect_starts_a_receiver_beside_and_stops_it(tmp_path, monkeypatch, capsys):
    port = free_port()
    root = workspace(tmp_path / "project", port=port)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the child runs this checkout's code
    child = collect.beside(root)
    try:
        assert f"listening on http://127.0.0.1:{port}/v1/traces" in capsys.readouterr().out
        assert httpx.get(f"http://127.0.0.1:{port}/status").json()["spans"] == 0
    finally:
        collect.stop(child)
    assert child.returncode == 0  # stopped as by Ctrl-C, not killed


def test_sigterm_writes_the_finished_traces_before_it_ends(receiver):
    rx = receiver(file_seconds=600)  # would gather for ten minutes
    exporter = OTLPSpanExporter(endpoint=f"{rx.url}/v1/traces")
    assert exporter.export(recorded_spans(1)) == SpanExportResult.SUCCESS
    time.sleep(collect.ROOT_WAIT + 3 * collect.TICK)  # finished, not yet written
    assert inbox_documents(rx.root) == []
    rx.stop()
    assert rx.proc.returncode == 0
    assert len(inbox_documents(rx.root)) == 1


def test_stopped_at_once_it_writes_every_trace_whose_root_ended_and_says_what_it_keeps(receiver):
    """Stopped within ROOT_WAIT of a trace's last span, a receiver held that finished trace in
    its journal until its next start, silently; a cycle in between did not see it. Now it goes
    out on the way; an unfinished one (its root never came) stays, said on stderr and in
    held.json, which `offseason run` reports until collect starts again."""
    from flows.project.workspace import held_by_collect

    rx = receiver(file_seconds=600)
    spans = recorded_spans(2)
    rooted = spans[0].context.trace_id
    orphans = [s for s in spans if s.context.trace_id != rooted and s.parent is not None]
    exporter = OTLPSpanExporter(endpoint=f"{rx.url}/v1/traces")
    assert exporter.export([s for s in spans if s.context.trace_id == rooted] + orphans) \
        == SpanExportResult.SUCCESS
    said = rx.stop(signal.SIGINT)  # at once: no ROOT_WAIT, no file_seconds
    assert rx.proc.returncode == 0
    [written] = inbox_documents(rx.root)
    assert {s["traceId"] for r in written["resourceSpans"] for sc in r["scopeSpans"]
            for s in sc["spans"]} == {format(rooted, "032x")}
    assert "1 finished traces written on the way out; 1 unfinished traces " \
        f"({len(orphans)} spans) kept in" in said, said
    held = held_by_collect(rx.root)
    assert held and f"holds 1 unfinished traces ({len(orphans)} spans)" in held
    again = receiver(port=rx.port)  # the same workspace: it takes them over
    assert held_by_collect(again.root) is None


def test_a_second_receiver_on_the_same_workspace_is_refused(receiver):
    rx = receiver()
    second = subprocess.run([sys.executable, "-m", "flows.cli", "collect", "--port",
                             str(free_port())], cwd=rx.root, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert second.returncode == 2
    assert "another `offseason collect` uses this journal" in second.stderr
    assert httpx.get(f"{rx.url}/status").status_code == 200  # the first one goes on


def test_a_token_is_required_when_set(receiver):
    rx = receiver(env={"OFFSEASON_COLLECT_TOKEN": "s3cret"})
    body = as_request(recorded_spans(1)).SerializeToString()
    headers = {"Content-Type": "application/x-protobuf"}
    assert "bearer token" in rx.banner
    missing = httpx.post(f"{rx.url}/v1/traces", content=body, headers=headers)
    wrong = httpx.post(f"{rx.url}/v1/traces", content=body,
                       headers={**headers, "Authorization": "Bearer guess"})
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert missing.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{rx.url}/status").status_code == 401
    exporter = OTLPSpanExporter(endpoint=f"{rx.url}/v1/traces",
                                headers={"Authorization": "Bearer s3cret"})
    sent = recorded_spans(1)
    assert exporter.export(sent) == SpanExportResult.SUCCESS
    status = httpx.get(f"{rx.url}/status", headers={"Authorization": "Bearer s3cret"}).json()
    assert status["rejected"]["unauthorized"] == 3 and status["spans"] == len(sent)


def test_a_full_queue_gets_429_and_a_short_disk_503_with_retry_after(receiver, tmp_path):
    rx = receiver(max_pending_spans=4, idle_seconds=600)
    children = [s for s in recorded_spans(4, start=1) if s.parent is not None]  # no root: held
    post = lambda spans: httpx.post(  # noqa: E731
        f"{rx.url}/v1/traces", content=as_request(spans).SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"})
    assert post(children[:4]).status_code == 200
    full = post(children[4:])
    assert full.status_code == 429 and full.headers["retry-after"].isdigit()
    assert "max_pending_spans" in full.json()["message"]
    rx.stop()

    short = receiver(min_free_mb=1 << 40)  # more than any disk has
    refused = httpx.post(f"{short.url}/v1/traces",
                         content=as_request(children[:1]).SerializeToString(),
                         headers={"Content-Type": "application/x-protobuf"})
    assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
    assert "min_free_mb" in refused.json()["message"]
    status = httpx.get(f"{short.url}/status").json()
    assert status["spans"] == 0 and status["rejected"]["disk_full"] == 1


def test_traces_of_mixed_conventions_in_one_file_are_read_each_by_its_own(tmp_path):
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for i in (1, 2):
        agent_turn(tracer, f"What is {i}+{i}?", str(2 * i), False)
    with tracer.start_as_current_span("chat tiny") as span:  # content capture off: no messages
        span.set_attribute("gen_ai.operation.name", "chat")
    with tracer.start_as_current_span("ChatOpenAI") as span:  # another service: OpenInference
        for key, value in {"openinference.span.kind": "LLM", "llm.model_name": "tiny",
                           "llm.input_messages.0.message.role": "user",
                           "llm.input_messages.0.message.content": "What is 3+3?",
                           "llm.output_messages.0.message.role": "assistant",
                           "llm.output_messages.0.message.content": "6"}.items():
            span.set_attribute(key, value)
    by_trace: dict = {}
    for span in memory.get_finished_spans():
        by_trace.setdefault(span.context.trace_id.to_bytes(16, "big"), []).append(span)
    documents = [(t, collect.otlp_json(list(as_request(spans).resource_spans)))
                 for t, spans in by_trace.items()]
    inbox = tmp_path / "project" / "data" / "inbox"
    inbox.mkdir(parents=True)
    # one file, as collect writes it: GenAI and OpenInference traces and a refused one together
    collect.write_file(inbox, [document for _, document in documents], 0)
    metrics, rows = ingested(tmp_path / "project", tmp_path)
    assert (metrics["accepted"], metrics["quarantined"]) == (3, 1)
    assert [r["user_text"] for r in rows] == ["What is 1+1?", "What is 2+2?", "What is 3+3?"]
    assert metrics["per_format"]["openinference"]["accepted"] == 1
    [refused] = [json.loads(line) for line in
                 (tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()]
    assert "content capture" in refused["reason"]


# --- grouping and the journal, in process ---------------------------------------------------------

def test_traces_finish_on_their_root_or_when_idle_and_count_retries_once():
    spans = recorded_spans(2)
    with_root = [s for s in spans if format(s.context.trace_id, "032x")
                 == format(spans[0].context.trace_id, "032x")]
    other = [s for s in spans if s not in with_root and s.parent is not None]  # its root missing
    traces = collect.Traces(idle_seconds=10)
    counts = traces.add(as_request(with_root + other), now=100.0)
    assert counts == {"new": len(with_root) + len(other), "duplicate": 0, "invalid": 0, "late": 0}
    # an exporter's retry: counted once, and not news (the trace's clock does not restart)
    assert traces.add(as_request(with_root[:1]), now=100.5)["duplicate"] == 1
    assert traces.finished(now=100.0 + collect.ROOT_WAIT / 2) == []
    [(trace_id, trace)] = traces.finished(now=100.0 + collect.ROOT_WAIT)
    assert trace_id == with_root[0].context.trace_id.to_bytes(16, "big") and trace.root
    assert len(trace.span_ids) == len(with_root)
    traces.written(trace_id)
    # a child span after its trace was written: held again, as a trace of its own
    assert traces.add(as_request(with_root[:1]), now=101.0)["late"] == 1
    other_id = other[0].context.trace_id.to_bytes(16, "big")
    # idle_seconds after their last span, traces whose root never came are finished too
    assert [(t, tr.root) for t, tr in traces.finished(now=110.0)] == [(other_id, False)]
    assert [(t, tr.root) for t, tr in traces.finished(now=111.0)] == [(trace_id, False)]


def test_the_journal_replays_held_spans_and_forgets_written_ones(tmp_path):
    spans = recorded_spans(3)
    traces = collect.Traces(idle_seconds=10)
    journal = collect.Journal(tmp_path / "journal", traces)
    traces.add(as_request(spans), now=0.0)
    journal.append(collect.SPANS, as_request(spans).SerializeToString()).result()
    first = spans[0].context.trace_id.to_bytes(16, "big")
    [(trace_id, trace)] = [(t, tr) for t, tr in traces.finished(now=5.0) if t == first]
    journal.append(collect.WRITTEN, collect.written_record(trace_id, trace)).result()
    journal.close()
    with open(journal.segments()[-1], "ab") as handle:  # a record cut short by the kill
        handle.write(b"S\x00\x00\x10\x00")

    again = collect.Traces(idle_seconds=10)
    reopened = collect.Journal(tmp_path / "journal", again)
    held = {t for t in again.pending}
    assert first not in held and len(held) == 2
    assert reopened.recovered == len(spans) - len(trace.span_ids)
    assert len(reopened.segments()) == 1  # compacted into a fresh segment
    reopened.close()


def test_runtime_collect_is_checked(tmp_path):
    path = workspace(tmp_path, port=4318)
    assert cfg.collect(path / "params.yaml").port == 4318
    for bad, message in (({"port": 70000}, r"runtime.collect.port: must be between 0 and 65535, got "
                                          r"70000 \(OTLP/HTTP's standard port; 0: a free one\)"),
                         ({"idle_seconds": 0}, "runtime.collect.idle_seconds: must be > 0"),
                         ({"max_pending": 5}, "unknown key 'runtime.collect.max_pending'")):
        workspace(tmp_path, **bad)
        with pytest.raises(cfg.ParamsError, match=message):
            cfg.collect(path / "params.yaml")
        params = yaml.safe_load((path / "params.yaml").read_text())
        params["runtime"]["collect"].pop(next(iter(bad)))
        (path / "params.yaml").write_text(yaml.safe_dump(params))


def test_compacting_the_journal_while_receiving_keeps_every_held_span(tmp_path, monkeypatch):
    monkeypatch.setattr(collect, "SEGMENT_BYTES", 1)  # compact whenever the segment doubled,
    monkeypatch.setattr(collect.Journal, "_mostly_held", lambda self: False)  # held or not
    traces = collect.Traces(idle_seconds=10)
    journal = collect.Journal(tmp_path / "journal", traces)
    sent = 0
    for i in range(6):
        spans = recorded_spans(2, start=10 * i)
        request = as_request(spans)
        sent += traces.receive(request, request.SerializeToString())
        journal.append(collect.SPANS, request.SerializeToString()).result()
        if i % 2:
            traces.group(now=float(i))  # some grouped, some still queued when compacted
    assert sent == 6 * len(recorded_spans(2))
    journal.close()
    [segment] = journal.segments()
    assert int(segment.stem.split("-")[1]) > 2  # compacted while receiving, not only at start
    again = collect.Traces(idle_seconds=10)
    assert collect.Journal(tmp_path / "journal", again).recovered == sent


# --- log records: message content captured as GenAI events, exported to /v1/logs ---------------

def test_the_openai_client_s_message_events_come_to_v1_logs_and_are_ingested_with_their_spans(
        receiver, tmp_path):
    pytest.importorskip("opentelemetry.instrumentation.openai_v2")  # the dev extra has it
    rx = receiver()
    with scripted_openai_server() as (port, script):
        # an operation-details event a call (the earlier event-a-message conventions are no
        # longer emitted by this instrumentation: recorded_turn_with_events has them); log
        # records flushed after the spans, then before them
        for first, question in (("spans", "What is 2+3?"), ("logs", "What is 40+2?")):
            subprocess.run([sys.executable, str(script), "export", str(port), rx.url, "events",
                            first, question], check=True, timeout=60)
    documents = wait_for_traces(rx.root, 2)
    time.sleep(collect.ROOT_WAIT + 3 * collect.TICK)  # a log record written late would show
    assert len(inbox_documents(rx.root)) == 2
    for document in documents:  # each trace's spans and log records on one line
        assert document["resourceSpans"] and document["resourceLogs"]
        assert "gen_ai.input.messages" not in json.dumps(document["resourceSpans"])
    metrics, rows = ingested(rx.root, tmp_path)
    assert (metrics["accepted"], metrics["quarantined"]) == (2, 0)
    for row, answer in zip(rows, ("2+3 is 5.", "40+2 is 42.")):
        messages = json.loads(row["messages"])
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool",
                                                 "assistant"]
        assert messages[2]["tool_calls"][0]["function"]["name"] == "calculator"
        assert messages[-1]["content"] == answer
    status = httpx.get(f"{rx.url}/status").json()
    assert status["log_records"] > 0 and status["late_log_records"] == 0
    assert (status["pending_spans"], status["pending_log_records"]) == (0, 0)
    shown = subprocess.run([sys.executable, "-m", "flows.cli", "collect", "--status", "--port",
                            str(rx.port)], cwd=rx.root, env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True)
    assert f"{status['log_records']} log records accepted" in shown.stdout, shown.stderr


def recorded_turn_with_events(question: str, answer: str) -> tuple[list, list]:
    """Finished SDK spans and log records of one agent turn whose messages are GenAI events
    (`gen_ai.user.message`, `gen_ai.choice`) in log records, not span attributes; plus a log
    record outside any span (no trace id).
    """
    spans, logs = InMemorySpanExporter(), InMemoryLogRecordExporter()
    resource = Resource.create({"service.name": "calc-agent"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    logger_provider = LoggerProvider(resource=resource)
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
    logger = logger_provider.get_logger("test")
    logger.emit(LogRecord(body="agent starting"))  # a plain log line: no trace
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("invoke_agent calc") as root:
        root.set_attribute("gen_ai.operation.name", "invoke_agent")
        with tracer.start_as_current_span("chat tiny") as span:
            span.set_attribute("gen_ai.operation.name", "chat")  # content only in the events
            span.set_attribute("gen_ai.request.model", "tiny")
            logger.emit(LogRecord(event_name="gen_ai.user.message", body={"content": question}))
            logger.emit(LogRecord(event_name="gen_ai.choice", body={
                "index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": answer}}))
    return list(spans.get_finished_spans()), list(logs.get_finished_logs())


def test_log_records_join_their_trace_before_or_after_its_spans_and_others_are_counted():
    spans, logs = recorded_turn_with_events("What is 1+1?", "2")
    events = logs[1:]  # logs[0]: outside any span
    trace_id = spans[0].context.trace_id.to_bytes(16, "big")
    traces = collect.Traces(idle_seconds=10)
    counts = traces.add(encode_logs(logs), now=100.0)  # before the spans
    assert counts == {"new_logs": 2, "duplicate_logs": 0, "untraced_logs": 1, "late_logs": 0}
    assert traces.add(encode_logs(events[:1]), now=100.1)["duplicate_logs"] == 1  # a retry
    assert traces.finished(now=105.0) == []  # no root yet: log records alone wait idle_seconds
    traces.add(as_request(spans), now=105.0)
    [(taken, trace)] = traces.finished(now=105.0 + collect.ROOT_WAIT)
    assert taken == trace_id and trace.root and len(trace.log_keys) == 2
    document = collect.otlp_json(trace.resources, trace.logs)
    [record, _] = document["resourceLogs"][0]["scopeLogs"][0]["logRecords"]
    assert record["traceId"] == format(spans[0].context.trace_id, "032x")  # hex, as OTLP JSON
    traces.written(trace_id)
    assert traces.counts() == {"pending_traces": 0, "pending_spans": 0, "pending_log_records": 0}

    # spans first, a log record within ROOT_WAIT after them: written with them
    spans, logs = recorded_turn_with_events("What is 2+2?", "4")
    traces.add(as_request(spans), now=200.0)
    traces.add(encode_logs(logs[1:2]), now=200.0 + collect.ROOT_WAIT / 2)
    assert traces.finished(now=200.0 + collect.ROOT_WAIT) == []  # the wait counts from it
    [(_, trace)] = traces.finished(now=200.0 + 1.5 * collect.ROOT_WAIT)
    assert len(trace.log_keys) == 1
    traces.written(spans[0].context.trace_id.to_bytes(16, "big"))
    # after the trace was written: held again, written as a trace of its own
    assert traces.add(encode_logs(logs[2:]), now=210.0)["late_logs"] == 1


def test_acknowledged_log_records_survive_a_kill_9_and_join_their_spans(receiver, tmp_path):
    port = free_port()
    rx = receiver(port=port, idle_seconds=600)  # held until their spans come
    (spans, logs), (spans2, logs2) = (recorded_turn_with_events(f"What is {i}+{i}?", str(2 * i))
                                      for i in (1, 2))
    assert OTLPLogExporter(endpoint=f"{rx.url}/v1/logs").export(logs) == \
        LogRecordExportResult.SUCCESS
    body = json.dumps(collect.otlp_json([], list(encode_logs(logs2[1:]).resource_logs)))
    answer = httpx.post(f"{rx.url}/v1/logs", content=gzip.compress(body.encode()),
                        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert answer.status_code == 200 and answer.json() == {}  # an ExportLogsServiceResponse
    bad = httpx.post(f"{rx.url}/v1/logs", content=b"\xff\x00garbage",
                     headers={"Content-Type": "application/x-protobuf"})
    assert bad.status_code == 400 and "ExportLogsServiceRequest" in bad.json()["message"]
    status = httpx.get(f"{rx.url}/status").json()
    assert (status["log_records"], status["spans"]) == (5, 0)
    time.sleep(3 * collect.TICK)  # grouped by the writer
    status = httpx.get(f"{rx.url}/status").json()
    assert (status["untraced_log_records"], status["pending_log_records"]) == (1, 4)
    rx.proc.send_signal(signal.SIGKILL)
    rx.proc.wait()

    again = receiver(port=port, idle_seconds=600)
    assert "0 spans and 4 log records recovered" in again.banner
    assert httpx.get(f"{again.url}/status").json()["recovered_log_records"] == 4
    exporter = OTLPSpanExporter(endpoint=f"{again.url}/v1/traces")
    assert exporter.export(spans + spans2) == SpanExportResult.SUCCESS
    documents = wait_for_traces(again.root, 2)
    assert all(len(d["resourceLogs"][0]["scopeLogs"][0]["logRecords"]) == 2 for d in documents)
    metrics, rows = ingested(again.root, tmp_path)
    assert (metrics["accepted"], metrics["quarantined"]) == (2, 0)
    assert [json.loads(r["messages"]) for r in rows] == [
        [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}],
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]]


def test_the_journal_forgets_written_log_records(tmp_path):
    spans, logs = recorded_turn_with_events("What is 3+3?", "6")
    traces = collect.Traces(idle_seconds=10)
    journal = collect.Journal(tmp_path / "journal", traces)
    for kind, request in ((collect.LOGS, encode_logs(logs)), (collect.SPANS, as_request(spans))):
        traces.add(request, now=0.0)
        journal.append(kind, request.SerializeToString()).result()
    [(trace_id, trace)] = traces.finished(now=5.0)
    journal.close()
    journal = collect.Journal(tmp_path / "journal", collect.Traces(idle_seconds=10))
    assert journal.recovered_logs == 2  # acknowledged, not yet written: back
    journal.append(collect.WRITTEN, collect.written_record(trace_id, trace)).result()
    journal.close()
    reopened = collect.Journal(tmp_path / "journal", collect.Traces(idle_seconds=10))
    assert (reopened.recovered, reopened.recovered_logs) == (0, 0)
    reopened.close()


def test_the_journal_is_not_compacted_while_most_of_it_is_held(tmp_path, monkeypatch):
    monkeypatch.setattr(collect, "SEGMENT_BYTES", 1)
    traces = collect.Traces(idle_seconds=10)
    journal = collect.Journal(tmp_path / "journal", traces)
    for i in range(4):  # a burst: nothing written yet, a compaction would rewrite all of it
        request = as_request(recorded_spans(2, start=10 * i))
        traces.receive(request, request.SerializeToString())
        journal.append(collect.SPANS, request.SerializeToString()).result()
    assert [p.name for p in journal.segments()] == ["journal-00000001.log"]
    traces.group(now=0.0)
    for trace_id, trace in traces.finished(now=0.0, everything=True):  # written into the inbox
        journal.append(collect.WRITTEN, collect.written_record(trace_id, trace)).result()
        traces.written(trace_id)
    sent = 0
    for i in range(4):  # the segment grows on, now mostly spans no longer held
        request = as_request(recorded_spans(2, start=100 + 10 * i))
        sent += traces.receive(request, request.SerializeToString())
        journal.append(collect.SPANS, request.SerializeToString()).result()
    journal.close()
    [segment] = journal.segments()
    assert segment.name != "journal-00000001.log"  # compacted once most of it was written
    assert collect.Journal(tmp_path / "journal", collect.Traces(idle_seconds=10)).recovered == sent


def test_a_burst_is_written_in_files_of_at_most_file_traces(tmp_path, monkeypatch):
    monkeypatch.setattr(collect, "FILE_TRACES", 2)  # ingest reads an OTLP file whole
    monkeypatch.setattr(collect, "ROOT_WAIT", 0.0)
    collector = collect.Collector(cfg.Collect(file_seconds=0.0), tmp_path / "inbox",
                                  tmp_path / "spool")
    request = as_request(recorded_spans(5))
    collector.traces.receive(request, request.SerializeToString())
    collector.journal.append(collect.SPANS, request.SerializeToString()).result()
    collector.close()  # writes every finished trace
    files = sorted((tmp_path / "inbox").glob("otlp-*.jsonl"))
    assert [len(f.read_text().splitlines()) for f in files] == [2, 2, 1]
    assert collector.counters["traces_written"] == 5
    again = collect.Traces(idle_seconds=10)
    assert collect.Journal(tmp_path / "spool" / "journal", again).recovered == 0
