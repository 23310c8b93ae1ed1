"""Real exports through the ingest stage, trace by trace: Langfuse single-trace downloads and API
pages, an OTLP file whose services follow different conventions, GenAI messages in log events.
"""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stages import config as cfg
from stages import ingest

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"


def run(tmp_path):
    m = ingest.run(cfg.Ingest(), tmp_path / "inbox", tmp_path / "traces",
                   tmp_path / "ingested.parquet", tmp_path / "q.jsonl")
    assert m["rows_read"] == m["accepted"] + m["quarantined"] + m["duplicates"]
    rows = pq.read_table(tmp_path / "ingested.parquet").to_pylist()
    bad = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    return m, rows, bad


def hex_ids(value):
    """Protobuf's JSON mapping writes ids in base64; OTLP JSON (the Collector's files) in hex."""
    import base64

    if isinstance(value, dict):
        return {k: base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") and v
                else hex_ids(v) for k, v in value.items()}
    return [hex_ids(v) for v in value] if isinstance(value, list) else value


def otlp_line(message) -> str:
    from google.protobuf import json_format

    return json.dumps(hex_ids(json_format.MessageToDict(message, use_integers_for_enums=True)))


def test_langfuse_downloads_and_api_pages_are_read(tmp_path):
    (tmp_path / "inbox").mkdir()
    for name in ("langfuse_export_genai.json", "langfuse_export_openinference.json"):
        shutil.copy(FIXTURES / name, tmp_path / "inbox" / name)
    m, rows, bad = run(tmp_path)
    assert (m["accepted"], m["quarantined"]) == (2, 0), bad
    genai, oi = sorted(rows, key=lambda r: r["source_file"])
    messages = json.loads(genai["messages"])
    # the system prompt from gen_ai.system_instructions; the follow-up call (its input only the
    # tool result, sent on top of the previous response) continues the conversation
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                        "arguments": '{"city":"Oslo"}'}
    assert messages[3] == {"role": "tool", "content": "-3 C and snowing", "tool_call_id": "call_W1"}
    assert json.loads(genai["tools"])[0]["function"]["name"] == "get_weather"
    assert json.loads(genai["usage"]) == {"input_tokens": 77 + 216, "output_tokens": 86 + 20}
    assert (genai["conversation_id"], genai["model"]) == ("sess-oslo-1", "gpt-5-mini-2025-08-07")
    assert json.loads(genai["feedback"]) == {"scores": {"helpful": True}}
    # OpenInference attributes in metadata are read, not the SDK-shaped input.value
    oi_messages = json.loads(oi["messages"])
    assert [m["role"] for m in oi_messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert oi_messages[-1]["content"] == "Visit the Sagrada Familia."
    assert json.loads(oi["usage"]) == {"input_tokens": 280, "output_tokens": 27}

    # the API's list page of the same observations: the same conversation, new cycle = duplicate
    shutil.copy(FIXTURES / "langfuse_api_observations_page.json", tmp_path / "inbox" / "page.json")
    m, _, _ = run(tmp_path)
    assert (m["rows_read"], m["duplicates"]) == (1, 1)


def test_langfuse_downloads_of_twenty_agent_frameworks(tmp_path):
    # Langfuse's published downloads (fixtures/traces/langfuse_frameworks, one trace a file;
    # what each reads as: tests/stages/traces/test_sources_langfuse.py)
    (tmp_path / "inbox").mkdir()
    for path in (FIXTURES / "langfuse_frameworks").glob("*.trace.json"):
        shutil.copy(path, tmp_path / "inbox" / path.name)
    m, rows, bad = run(tmp_path)
    # pydantic-ai-tools-2025-06-06 is pydantic-ai-2025-06-06's trace, observations reordered
    assert (m["rows_read"], m["accepted"], m["duplicates"]) == (20, 18, 1), bad
    assert [b["source_file"] for b in bad] == ["beeai-2025-08-01.trace.json"]
    assert "the first 233 output message(s) (stream chunks) are missing" in bad[0]["reason"]
    assert all(json.loads(r["messages"])[-1]["role"] == "assistant" for r in rows)


def test_a_bad_langfuse_trace_is_quarantined_alone_with_file_trace_and_fix(tmp_path):
    (tmp_path / "inbox").mkdir()
    good = json.loads((FIXTURES / "langfuse_export_genai.json").read_text())
    lonely = {"trace": {"id": "t-no-gen", "timestamp": "2025-01-01T00:00:00Z", "name": "x",
                        "input": "hi"}, "observations": []}
    (tmp_path / "inbox" / "two.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(lonely)
                                                  + "\n")
    m, rows, bad = run(tmp_path)
    assert (m["accepted"], m["quarantined"]) == (1, 1)
    assert bad[0]["source_line"] == 2
    assert bad[0]["reason"].startswith("two.jsonl, trace t-no-gen: no GENERATION observation")


def span(tracer, name, attributes):
    with tracer.start_as_current_span(name) as current:
        for key, value in attributes.items():
            current.set_attribute(key, value)


def test_one_collector_file_three_conventions_each_trace_read_by_its_own(tmp_path):
    memory = InMemorySpanExporter()
    lines = []
    services = {
        "planner": {"openinference.span.kind": "LLM", "llm.model_name": "tiny",
                    "llm.input_messages.0.message.role": "user",
                    "llm.input_messages.0.message.content": "Plan a trip to Rome.",
                    "llm.output_messages.0.message.role": "assistant",
                    "llm.output_messages.0.message.content": "Day 1: the Colosseum."},
        "support": {"gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny",
                    "gen_ai.input.messages": json.dumps(
                        [{"role": "user", "parts": [{"type": "text", "content": "Reset my PIN"}]}]),
                    "gen_ai.output.messages": json.dumps(
                        [{"role": "assistant", "parts": [{"type": "text", "content": "Done."}],
                          "finish_reason": "stop"}])},
        "legacy": {"gen_ai.system": "openai", "gen_ai.request.model": "tiny",
                   "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "What is 2+2?",
                   "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "4"},
        "muted": {"gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny"},  # capture off
    }
    for service, attributes in services.items():
        memory.clear()
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        span(provider.get_tracer(service), f"chat {service}", attributes)
        lines.append(otlp_line(encode_spans(memory.get_finished_spans())))  # a line a batch
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "collector.jsonl").write_text("\n".join(lines) + "\n")
    m, rows, bad = run(tmp_path)
    assert (m["accepted"], m["quarantined"]) == (3, 1), bad
    assert {r["user_text"]: r["format"] for r in rows} == {
        "Plan a trip to Rome.": "openinference", "Reset my PIN": "otel-genai",
        "What is 2+2?": "otel-genai"}
    muted_id = json.loads(lines[3])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]
    [refused] = bad
    assert refused["source_line"] == 4
    assert refused["reason"].startswith(f"collector.jsonl, trace {muted_id}: ")
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT" in refused["reason"]


def test_messages_in_legacy_log_events_are_joined_to_their_span(tmp_path):
    pytest.importorskip("opentelemetry.instrumentation.openai_v2")
    from openai.types.chat.chat_completion import Choice
    from opentelemetry.instrumentation.openai_v2.utils import choice_to_event, message_to_event

    spans, logs = InMemorySpanExporter(), InMemoryLogRecordExporter()
    tracer_provider = TracerProvider(resource=Resource.create({"service.name": "bot"}))
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    logger_provider = LoggerProvider(resource=Resource.create({"service.name": "bot"}))
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
    logger = logger_provider.get_logger("opentelemetry.instrumentation.openai_v2")
    with tracer_provider.get_tracer("bot").start_as_current_span("chat tiny") as current:
        current.set_attribute("gen_ai.operation.name", "chat")  # no content on the span
        for message in ({"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Capital of Peru?"}):
            logger.emit(message_to_event(message, True))
        choice = Choice.model_validate({"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "Lima."}})
        logger.emit(choice_to_event(choice, True))
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "otel.jsonl").write_text(
        otlp_line(encode_spans(spans.get_finished_spans())) + "\n"
        + otlp_line(encode_logs(logs.get_finished_logs())) + "\n")
    m, rows, bad = run(tmp_path)
    assert (m["accepted"], m["quarantined"]) == (1, 0), bad
    assert json.loads(rows[0]["messages"]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"},
        {"role": "assistant", "content": "Lima."}]


def test_the_instrumented_openai_client_s_operation_details_events_are_read(tmp_path):
    pytest.importorskip("opentelemetry.instrumentation.openai_v2")
    script = Path(__file__).parents[2] / "openai_agent.py"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(script), "server", str(port)],
                              stdout=subprocess.PIPE, text=True)
    (tmp_path / "inbox").mkdir()
    try:
        assert server.stdout.readline().strip() == "listening"
        subprocess.run([sys.executable, str(script), "events", str(port),
                        str(tmp_path / "inbox" / "otel.jsonl"), "events", "What is 2+3?"],
                       check=True, timeout=120)
    finally:
        server.terminate()
        server.wait()
    spans = (tmp_path / "inbox" / "otel.jsonl").read_text().splitlines()[0]
    assert "gen_ai.input.messages" not in spans  # the messages are only in the log events
    m, rows, bad = run(tmp_path)
    assert (m["accepted"], m["quarantined"]) == (1, 0), bad
    messages = json.loads(rows[0]["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert messages[-1]["content"] == "2+3 is 5."
