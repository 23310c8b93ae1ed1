"""A scripted OpenAI-compatible server and an agent on the real `openai` client, instrumented by
`opentelemetry-instrumentation-openai-v2` (GenAI conventions) or by OpenInference's
`openinference-instrumentation-openai`, exporting over OTLP/HTTP as protobuf
(`opentelemetry-exporter-otlp-proto-http`) or JSON (`opentelemetry-exporter-otlp-json-http`):
tests/flows/intake/test_collect.py runs each as a process of its own; `traffic` runs the agent with each
instrumentation and each encoding against `offseason collect` in a project, for
tests/cycle/test_security.py's cycle.

    python tests/openai_agent.py server PORT
    python tests/openai_agent.py agent SERVER_PORT OTLP_TRACES_URL "What is 2+3?" genai|openinference protobuf|json [...]
    python tests/openai_agent.py events SERVER_PORT OUT.jsonl events|legacy "What is 2+3?"
    python tests/openai_agent.py export SERVER_PORT OTLP_ENDPOINT events|legacy spans|logs "What is 2+3?"
    python tests/openai_agent.py traffic PROJECT COLLECT_PORT
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def server(port: int) -> None:
    """/v1/chat/completions: a calculator call for a user's "What is A+B?", then the answer."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def completion(message: dict, finish: str) -> dict:
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
                "model": "tiny", "choices": [{"index": 0, "message": message,
                                              "finish_reason": finish}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}}

    async def chat(request) -> JSONResponse:
        messages = (await request.json())["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        a, b = map(int, re.findall(r"\d+", question)[:2])
        if messages[-1]["role"] == "user":
            call = {"id": "call_1", "type": "function", "function": {
                "name": "calculator", "arguments": json.dumps({"expression": f"{a}+{b}"})}}
            return JSONResponse(completion({"role": "assistant", "content": None,
                                            "tool_calls": [call]}, "tool_calls"))
        return JSONResponse(completion({"role": "assistant", "content": f"{a}+{b} is {a + b}."},
                                       "stop"))

    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    print("listening", flush=True)
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def calculator_turn(client, messages: list[dict]) -> None:
    """The agent's turn through `client`: the model calls the calculator, gets its result and
    answers (two chat completions, each recorded by the instrumentation).
    """
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    a, b = map(int, json.loads(call.function.arguments)["expression"].split("+"))
    messages = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": str(a + b)}]
    client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)


def agent(port: int, otlp_url: str, turns: list[tuple[str, str, str]]) -> None:
    """For each (question, instrumentation, encoding) of `turns`, one agent turn (a tool call, its
    result, the answer) under an agent root span, recorded by `instrumentation` ("genai":
    OpenTelemetry's, "openinference": OpenInference's) and exported to `otlp_url` as `encoding`
    ("protobuf" or "json"); between turns the instrumentation is taken off `openai` again.
    """
    # the GenAI conventions' current shape: messages as span attributes, content captured
    # (OpenInference captures content unless told not to)
    os.environ["OTEL_SEMCONV_STABILITY_OPT_IN"] = "gen_ai_latest_experimental"
    os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "SPAN_ONLY"
    import openai
    from openinference.instrumentation.openai import OpenAIInstrumentor as OpenInference
    from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter as Json
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Protobuf
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor as GenAI
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    instrumentors = {"genai": (GenAI, ("gen_ai.operation.name", "invoke_agent")),
                     "openinference": (OpenInference, ("openinference.span.kind", "AGENT"))}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    for question, instrumentation, encoding in turns:
        instrumentor, root_kind = instrumentors[instrumentation]
        exporter = {"protobuf": Protobuf, "json": Json}[encoding](endpoint=otlp_url)
        provider = TracerProvider(resource=Resource.create({"service.name": "calc-agent"}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        instrumentor().instrument(tracer_provider=provider)
        with provider.get_tracer("calc-agent").start_as_current_span("invoke_agent calc") as root:
            root.set_attribute(*root_kind)
            calculator_turn(client, [{"role": "user", "content": question}])
        provider.shutdown()  # exports what is left
        instrumentor().uninstrument()


# what `traffic` asks, and how: each instrumentation with each encoding
TRAFFIC = [("What is 2+3?", "genai", "protobuf"), ("What is 11+4?", "genai", "json"),
           ("What is 6+7?", "openinference", "protobuf"),
           ("What is 20+22?", "openinference", "json")]


def traffic(project: Path, collect_port: int, timeout: float = 60) -> None:
    """`offseason collect` in `project` on `collect_port`, the scripted server, and the agent's
    TRAFFIC turns against them; returns once collect wrote their traces into the project's
    inbox (runtime.collect.file_seconds 0 there: at once), after stopping it.
    """
    here = Path(__file__)
    with socket.socket() as sock:  # a free port for the scripted server
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    offseason = Path(sys.executable).parent / "offseason"
    receiver = subprocess.Popen([str(offseason), "collect", "--port", str(collect_port)],
                                cwd=project, stdout=subprocess.PIPE, text=True)
    server = subprocess.Popen([sys.executable, str(here), "server", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on" in receiver.stdout.readline()
        assert server.stdout.readline().strip() == "listening"
        # one process: an instrumentation patches `openai` only until it is taken off again
        turns = subprocess.run([sys.executable, str(here), "agent", str(port),
                                f"http://127.0.0.1:{collect_port}/v1/traces",
                                *[word for turn in TRAFFIC for word in turn]], timeout=timeout)
        assert turns.returncode == 0
        deadline = time.monotonic() + timeout
        while sum(len(path.read_text().splitlines()) for path in (project / "data" / "inbox")
                  .glob("otlp-*.jsonl")) < len(TRAFFIC):
            assert time.monotonic() < deadline, "collect did not write the agents' traces"
            time.sleep(0.1)
    finally:
        server.terminate()
        receiver.send_signal(signal.SIGTERM)
        server.wait(timeout)
        receiver.wait(timeout)
    assert receiver.returncode == 0


def capture_as_events(capture: str) -> None:
    """Set the instrumentation to record messages as log events: "events" (one
    `gen_ai.client.inference.operation.details` a call) or "legacy" (an event a message); before
    it is imported. The opentelemetry-instrumentation-openai-v2 installed now (2.4b0) follows the
    current conventions whatever is asked: "legacy" gets it to capture nothing (it warns that
    "true" is no valid mode), so tests build the older events in process instead.
    """
    if capture == "events":
        os.environ["OTEL_SEMCONV_STABILITY_OPT_IN"] = "gen_ai_latest_experimental"
        os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "EVENT_ONLY"
    else:
        os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "true"


def instrumented_turn(port: int, question: str, tracer_provider, logger_provider) -> None:
    """One agent turn on the openai client, instrumented by opentelemetry-instrumentation-openai-v2
    into these providers (its content capture set before, `capture_as_events`).
    """
    import openai
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider,
                                    logger_provider=logger_provider)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    messages = [{"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": question}]
    with tracer_provider.get_tracer("calc-agent").start_as_current_span("invoke_agent calc"):
        calculator_turn(client, messages)


def export(port: int, endpoint: str, capture: str, first: str, question: str) -> None:
    """One agent turn, messages captured as log events (`capture` as in `events`), exported live
    the way a deployed agent does: spans by the OTLP/HTTP span exporter to `endpoint`/v1/traces,
    log records by the OTLP/HTTP log exporter to `endpoint`/v1/logs, each in batches. `first`
    ("spans" or "logs") is the signal flushed first: the receiver must take log records that come
    before their spans and those that come after.
    """
    capture_as_events(capture)
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": f"calc-agent-{capture}"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
        endpoint=f"{endpoint}/v1/traces")))
    logger_provider = LoggerProvider(resource=resource)
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(
        endpoint=f"{endpoint}/v1/logs")))
    instrumented_turn(port, question, tracer_provider, logger_provider)
    order = [tracer_provider, logger_provider]
    for provider in order if first == "spans" else order[::-1]:
        provider.shutdown()  # exports what is left


def events(port: int, out: str, capture: str, question: str) -> None:
    """One agent turn with the messages captured as GenAI events in log records, not on the
    spans: `capture` "events" (the current conventions: one
    `gen_ai.client.inference.operation.details` event a call) or "legacy" (the earlier ones:
    `gen_ai.user.message`, `gen_ai.choice`, ... an event a message). Spans and log records go to
    `out` as OTLP JSON, a document a line, as a Collector's file exporter writes them.
    """
    capture_as_events(capture)
    import base64

    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    resource = Resource.create({"service.name": f"calc-agent-{capture}"})
    spans, logs = InMemorySpanExporter(), InMemoryLogRecordExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    logger_provider = LoggerProvider(resource=resource)
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
    instrumented_turn(port, question, tracer_provider, logger_provider)

    def hex_ids(value):  # OTLP JSON writes ids as hex, protobuf's JSON mapping as base64
        if isinstance(value, dict):
            return {k: base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId")
                    and v else hex_ids(v) for k, v in value.items()}
        return [hex_ids(v) for v in value] if isinstance(value, list) else value

    with open(out, "w") as handle:
        for message in (encode_spans(spans.get_finished_spans()),
                        encode_logs(logs.get_finished_logs())):
            document = json_format.MessageToDict(message, use_integers_for_enums=True)
            handle.write(json.dumps(hex_ids(document)) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    elif sys.argv[1] == "events":
        events(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    elif sys.argv[1] == "export":
        export(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
    elif sys.argv[1] == "traffic":
        traffic(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        rest = sys.argv[4:]
        agent(int(sys.argv[2]), sys.argv[3], [tuple(rest[i:i + 3]) for i in range(0, len(rest), 3)])
