"""Traces recorded with content capture off, hidden or masked hold the instrumentation's
placeholder where each message was (`<elided>`, `__REDACTED__`, a text part with no content):
they are quarantined, the reason naming the setting that records the content; real text that
only mentions a placeholder is accepted. The exports are the tools' own: Google ADK and
Pydantic AI recorded by `fixtures/traces/capture_off/record.py` (see the README there), the
OpenInference OpenAI instrumentation live against the scripted server of `openai_agent.py`.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_ingest_conventions import otlp_line

from stages import config as cfg
from stages import ingest

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
CAPTURE_OFF = FIXTURES / "capture_off"


def run(tmp_path, files: dict[str, str]):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for name, text in files.items():
        (inbox / name).write_text(text)
    m = ingest.run(cfg.Ingest(), inbox, tmp_path / "traces", tmp_path / "ingested.parquet",
                   tmp_path / "q.jsonl")
    assert m["rows_read"] == m["accepted"] + m["quarantined"] + m["duplicates"]
    rows = pq.read_table(tmp_path / "ingested.parquet").to_pylist()
    bad = {json.loads(line)["source_file"]: json.loads(line)["reason"]
           for line in (tmp_path / "q.jsonl").read_text().splitlines()}
    assert len(bad) == m["quarantined"]  # one refusal a file in these tests
    return m, rows, bad


def trace_ids(document: dict) -> set[str]:
    return {span["traceId"] for resource in document["resourceSpans"]
            for scope in resource["scopeSpans"] for span in scope["spans"]}


def test_an_adk_export_with_content_capture_off_is_quarantined_naming_adk_s_setting(tmp_path):
    text = (CAPTURE_OFF / "adk_elided.json").read_text()
    [trace_id] = trace_ids(json.loads(text))
    m, rows, bad = run(tmp_path, {"adk.json": text})
    assert (m["rows_read"], m["accepted"], m["quarantined"]) == (1, 0, 1), rows
    # every message ADK logged (system, user, the model's call, the tool's reply, the answer)
    what, _, fix = bad["adk.json"].partition("; to fix: ")
    assert what == (f"adk.json, trace {trace_id}: 5 of 5 messages hold only '<elided>', what "
                    "an instrumentation writes in place of content it did not record"), what
    # the scope (gcp.vertex.agent) says it was ADK: its setting, and the one that puts the
    # messages where offseason reads them (checked by hand against ADK 2.13: see the README)
    assert fix.startswith("Google ADK ") and "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=" \
        "SPAN_ONLY" in fix and "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental" in fix


def test_pydantic_ai_with_include_content_off_is_quarantined_naming_its_setting(tmp_path):
    text = (CAPTURE_OFF / "pydantic_ai_no_content.json").read_text()
    [trace_id] = trace_ids(json.loads(text))
    m, rows, bad = run(tmp_path, {"pai.json": text})
    assert (m["accepted"], m["quarantined"]) == (0, 1), rows
    what, _, fix = bad["pai.json"].partition("; to fix: ")
    assert what.startswith(f"pai.json, trace {trace_id}: span ") and what.endswith(
        "gen_ai.input.messages[0].parts[0] is a text part with no content: the instrumentation "
        "did not record it"), what
    assert fix.startswith("Pydantic AI ") and "include_content=True" in fix


TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def openinference_turns(port: int, configs: dict[str, dict]) -> dict[str, str]:
    """An OTLP line a turn of the calculator agent on the real openai client, instrumented by
    openinference-instrumentation-openai with each TraceConfig; by the turn's name.
    """
    import openai
    from openai_agent import calculator_turn
    from openinference.instrumentation import TraceConfig
    from openinference.instrumentation.openai import OpenAIInstrumentor

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    lines = {}
    for name, config in configs.items():
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "calc-agent"}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        OpenAIInstrumentor().instrument(tracer_provider=provider, config=TraceConfig(**config))
        try:
            with provider.get_tracer("calc-agent").start_as_current_span("agent") as root:
                root.set_attribute("openinference.span.kind", "AGENT")  # one trace a turn
                calculator_turn(client, [{"role": "system", "content": "Use the calculator."},
                                         {"role": "user", "content": "What is 2+3?"}])
        finally:
            OpenAIInstrumentor().uninstrument()
        lines[name] = otlp_line(encode_spans(memory.get_finished_spans())) + "\n"
    return lines


def test_openinference_hidden_text_is_quarantined_naming_the_hide_setting(tmp_path):
    pytest.importorskip("openinference.instrumentation.openai")
    script = Path(__file__).parents[2] / "openai_agent.py"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(script), "server", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        lines = openinference_turns(port, {"inputs.jsonl": {"hide_input_text": True},
                                           "outputs.jsonl": {"hide_output_text": True},
                                           "shown.jsonl": {}})
    finally:
        server.terminate()
        server.wait()
    assert '"__REDACTED__"' in lines["inputs.jsonl"] and '"__REDACTED__"' in lines["outputs.jsonl"]
    m, rows, bad = run(tmp_path, lines)
    assert (m["accepted"], m["quarantined"]) == (1, 2), bad
    assert rows[0]["source_file"] == "shown.jsonl"  # the same turn, its text recorded
    assert json.loads(rows[0]["messages"])[-1]["content"] == "2+3 is 5."
    # the system prompt, the question and the tool's result were hidden; then only the answer
    assert " 3 of 5 messages hold only '__REDACTED__'" in bad["inputs.jsonl"]
    assert " 1 of 5 messages hold only '__REDACTED__'" in bad["outputs.jsonl"]
    inputs, outputs = (bad[name].partition("; to fix: ")[2] for name in ("inputs.jsonl",
                                                                          "outputs.jsonl"))
    assert "OPENINFERENCE_HIDE_INPUT_TEXT" in inputs and "HIDE_OUTPUT_TEXT" not in inputs
    assert "OPENINFERENCE_HIDE_OUTPUT_TEXT" in outputs and "HIDE_INPUT_TEXT" not in outputs


def genai_span_document(messages: list[dict]) -> str:
    """One GenAI chat span (current conventions) whose input is `messages` (role, text), with an
    answer: an OTLP JSON document.
    """
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bot"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("bot").start_as_current_span("chat tiny") as span:
        span.set_attribute("gen_ai.operation.name", "chat")
        span.set_attribute("gen_ai.input.messages", json.dumps(
            [{"role": role, "parts": [{"type": "text", "content": text}]}
             for role, text in messages]))
        span.set_attribute("gen_ai.output.messages", json.dumps(
            [{"role": "assistant", "parts": [{"type": "text", "content": "Use the reset link."}],
              "finish_reason": "stop"}]))
    return otlp_line(encode_spans(memory.get_finished_spans())) + "\n"


def test_a_masked_or_scrubbed_message_is_quarantined_naming_who_wrote_it(tmp_path):
    from langfuse._client.constants import MASK_FALLBACK_VALUE

    # the Langfuse SDK writes MASK_FALLBACK_VALUE for the whole input and output when the
    # client's `mask` function raises (langfuse/_client/span.py, `_mask_attribute`)
    download = json.loads((FIXTURES / "langfuse_export_genai.json").read_text())
    for record in [download["trace"], *download["observations"]]:
        record["input"] = record["output"] = MASK_FALLBACK_VALUE
    elided = {"id": "c1", "messages": [{"role": "user", "content": "<elided>"},
                                       {"role": "assistant", "content": " <elided>\n"}]}
    m, rows, bad = run(tmp_path, {
        "langfuse.json": json.dumps(download),
        # Logfire's scrubbing: a value that mentions a sensitive word is replaced whole
        # (pydantic/logfire logfire/_internal/scrubbing.py, BaseScrubber._redact)
        "logfire.jsonl": genai_span_document([("user", "[Scrubbed due to 'password']")]),
        "chat.jsonl": json.dumps(elided) + "\n"})
    assert (m["accepted"], m["quarantined"]) == (0, 3), rows
    assert "hold only '<fully masked due to failed mask function>'" in bad["langfuse.json"]
    assert "Langfuse client's `mask` function" in bad["langfuse.json"]
    assert "hold only \"[Scrubbed due to 'password']\"" in bad["logfire.jsonl"]
    assert "logfire.configure(scrubbing=" in bad["logfire.jsonl"]
    # a format that does not say who wrote it: each tool that writes it, with its setting
    assert bad["chat.jsonl"].startswith("chat.jsonl line 1, trace c1: 2 of 2 messages hold only "
                                        "'<elided>'")
    assert "Google ADK" in bad["chat.jsonl"] and "google-genai" in bad["chat.jsonl"]


def test_text_that_only_mentions_a_placeholder_is_accepted(tmp_path):
    lines = [{"id": "ok1", "messages": [
        {"role": "user", "content": "My trace shows <elided> where the prompt was. Why?"},
        {"role": "assistant", "content": "<elided> is what ADK writes while content capture "
                                         "is off."}]},
             {"id": "ok2", "messages": [
                 {"role": "user", "content": [{"type": "text", "text": "__REDACTED__"},
                                              {"type": "text", "text": "What does that mean?"}]},
                 {"role": "assistant", "content": "OpenInference hid the text."}]}]
    m, rows, bad = run(tmp_path, {
        "chat.jsonl": "".join(json.dumps(line) + "\n" for line in lines),
        "otel.jsonl": genai_span_document([("user", "Logfire wrote [Scrubbed due to 'password'] "
                                                    "in my span. How do I reset my password?")])})
    assert (m["accepted"], m["quarantined"]) == (3, 0), bad
    texts = {row["user_text"] for row in rows}
    assert "My trace shows <elided> where the prompt was. Why?" in texts
    assert "__REDACTED__\nWhat does that mean?" in texts
