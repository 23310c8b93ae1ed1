"""The OpenTelemetry GenAI reader, on OTLP JSON samples written to the GenAI conventions."""

import copy
import json
from pathlib import Path

import pytest

from stages.traces.schema import BadRecord
from stages.traces.sources import otel_genai as otel

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
WEATHER_CALL = "call_VSPygqKTWdrhaFErNvMV18Yl"


def document(name: str = "otel_genai.json") -> dict:
    return json.loads((FIXTURES / name).read_text())


def spans(doc: dict) -> dict[str, dict]:
    return {s["spanId"]: s for r in doc["resourceSpans"] for sc in r["scopeSpans"]
            for s in sc["spans"]}


def set_attribute(span: dict, key: str, value: dict | None) -> None:
    span["attributes"] = [a for a in span["attributes"] if a["key"] != key]
    if value is not None:
        span["attributes"].append({"key": key, "value": value})


def otlp(*raw_spans: dict) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": []},
                               "scopeSpans": [{"scope": {"name": "t"}, "spans": list(raw_spans)}]}]}


def chat_span(span_id: str, start: int, inputs: list, outputs: list, trace: str = "ab" * 16,
              system: str | None = None) -> dict:
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
             "gen_ai.input.messages": json.dumps(inputs),
             "gen_ai.output.messages": json.dumps(outputs)}
    if system:
        attrs["gen_ai.system_instructions"] = json.dumps([{"type": "text", "content": system}])
    return {"traceId": trace, "spanId": span_id, "name": "chat m", "kind": 3,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 1),
            "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attrs.items()]}


def text(role: str, content: str) -> dict:
    return {"role": role, "parts": [{"type": "text", "content": content}]}


def test_agent_trace_with_a_tool_call_becomes_one_conversation():
    traces = otel.parse(document())
    # the health-check trace of the edge proxy has no GenAI span and is skipped
    assert [t["trace_id"] for t in traces] == ["4bf92f3577b34da6a3ce929d0e0e4736",
                                               "0af7651916cd43dd8448eb211c80319c"]
    trace = traces[0]
    assert trace["messages"] == [
        {"role": "system",
         "content": "You are TripPlanner. Use tools for live data and answer briefly."},
        {"role": "user", "content": "What's the weather in Paris tomorrow? Celsius please."},
        # the reasoning came with the first call's output; the second call's input drops it
        {"role": "assistant", "content": None,
         "reasoning_content": "The user wants tomorrow's forecast for Paris in Celsius; "
                              "call get_weather.",
         "tool_calls": [{"id": WEATHER_CALL, "type": "function", "function": {
             "name": "get_weather",
             "arguments": '{"location": "Paris", "date": "tomorrow", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": WEATHER_CALL,
         "content": '{"temperature_c": 14, "conditions": "light rain"}'},
        {"role": "assistant",
         "content": "Tomorrow in Paris expect light rain and about 14 °C, so pack an umbrella."},
    ]
    assert trace["model"] == "o4-mini-2025-04-16"
    assert trace["created_at"] == "2025-05-15T12:00:00Z"
    # summed over both model calls; the invoke_agent span's numbers are not added again
    assert trace["usage"] == {"input_tokens": 273, "output_tokens": 62,
                              "cached_input_tokens": 112, "reasoning_tokens": 18}
    assert trace["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a location.",
        "parameters": {"type": "object",
                       "properties": {"location": {"type": "string"}, "date": {"type": "string"},
                                      "unit": {"type": "string",
                                               "enum": ["celsius", "fahrenheit"]}},
                       "required": ["location", "unit"]}}}]
    assert trace["feedback"] == {"scores": {"relevance": 0.92}}


def test_structured_attributes_reasoning_and_a_failed_root_span():
    trace = otel.parse(document())[1]
    assert trace["messages"] == [
        {"role": "system", "content": "Summarize documents faithfully in two sentences."},
        {"role": "user", "content": "Summarize this incident report:\nIncident 4471: the primary "
                                    "Postgres node ran out of disk at 02:13 UTC; failover to the "
                                    "replica completed at 03:00 UTC. Root cause: WAL archiving "
                                    "stalled after a credentials rotation."},
        # the redacted_thinking part is a provider-specific generic part and carries no text
        {"role": "assistant",
         "content": "The primary Postgres node ran out of disk, forcing a 47-minute failover. "
                    "WAL archiving had stalled after a credentials rotation.",
         "reasoning_content": "Key facts: disk exhaustion, 47-minute failover, WAL archiving "
                              "root cause."},
    ]
    assert trace["model"] == "claude-sonnet-4-5-20250929"
    assert trace["usage"] == {"input_tokens": 820, "output_tokens": 143}
    assert trace["tools"] == []
    assert trace["feedback"] == {
        "error": "OutputGuardrailTripwireTriggered: summary cites no sources"}
    assert trace["created_at"] == "2025-05-15T12:01:00Z"
    assert trace["conversation_id"] is None  # no span names a conversation


def test_conversation_id_is_the_first_one_in_start_order_of_any_span():
    assert otel.parse(document())[0]["conversation_id"] == "conv_5j66UpCpwteGg4YSxUnt7lPY"
    user = text("user", "hi")
    later = chat_span("02", 200, [user], [text("assistant", "hello")])
    first = chat_span("01", 100, [user], [text("assistant", "hey")])
    set_attribute(later, "gen_ai.conversation.id", {"stringValue": "conv_b"})
    tool = {"traceId": "ab" * 16, "spanId": "03", "name": "execute_tool",
            "startTimeUnixNano": "50", "attributes": []}
    set_attribute(tool, "gen_ai.conversation.id", {"stringValue": "conv_a"})
    # file order is not start order; a non-model span's id counts too
    assert otel.parse(otlp(later, first, tool))[0]["conversation_id"] == "conv_a"
    assert otel.parse(otlp(later, first))[0]["conversation_id"] == "conv_b"
    assert otel.parse(otlp(first))[0]["conversation_id"] is None


def test_legacy_flattened_openllmetry_attributes():
    traces = otel.parse(document("otel_genai_legacy.json"))
    assert [t["conversation_id"] for t in traces] == [None, None]
    assert [t["trace_id"] for t in traces] == ["8a3c60f7d188f8fa79d48a391a778fa6",
                                               "d4cda95b652f4a1592b449d5929fda1b"]
    trace = traces[0]
    assert trace["messages"] == [
        {"role": "system", "content": "You are Acme's support agent. Look orders up before "
                                      "answering."},
        {"role": "user", "content": "Where is order 8812?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_Q7x1mN2pL4", "type": "function",
             "function": {"name": "lookup_order", "arguments": '{"order_id":"8812"}'}}]},
        {"role": "tool", "tool_call_id": "call_Q7x1mN2pL4",
         "content": '{"status": "shipped", "eta": "2024-11-12"}'},
        {"role": "assistant",
         "content": "Order 8812 has shipped and should arrive on November 12."},
    ]
    assert trace["model"] == "gpt-4o-mini-2024-07-18"
    assert trace["usage"] == {"input_tokens": 236, "output_tokens": 34}
    assert trace["tools"] == [{"type": "function", "function": {
        "name": "lookup_order", "description": "Fetch an order's shipping status by id.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                       "required": ["order_id"]}}}]
    assert trace["created_at"] == "2024-11-08T12:00:00Z"
    assert trace["feedback"] == {}


def test_legacy_json_prompt_and_completion_on_span_events():
    trace = otel.parse(document("otel_genai_legacy.json"))[1]
    assert trace["messages"] == [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Translate 'good morning' to French."},
        {"role": "assistant", "content": "Bonjour."},
    ]
    assert trace["model"] == "gpt-4o"
    assert trace["usage"] == {"input_tokens": 25, "output_tokens": 9}


def test_side_calls_and_retries_do_not_duplicate_or_replace_the_main_conversation():
    user = text("user", "plan a trip")
    first = {"role": "assistant", "parts": [{"type": "tool_call", "name": "search",
                                             "arguments": {"q": "flights"}}]}
    reply = {"role": "tool", "parts": [{"type": "tool_call_response", "response": "3 flights"}]}
    doc = otlp(
        chat_span("01", 100, [user], [first], system="planner"),
        chat_span("02", 200, [user, first, reply], [text("assistant", "Book the 9am one.")],
                  system="planner"),
        # a retry of the first step, and a title generator with its own history, come last
        chat_span("03", 300, [user], [text("assistant", "retry answer")], system="planner"),
        chat_span("04", 400, [text("user", "title for: plan a trip")],
                  [text("assistant", "Trip plan")]),
    )
    (trace,) = otel.parse(doc)
    # ids left out by the instrumentation are numbered by position, the same in every span
    assert trace["messages"] == [
        {"role": "system", "content": "planner"},
        {"role": "user", "content": "plan a trip"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "search", "arguments": '{"q": "flights"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3 flights"},
        {"role": "assistant", "content": "Book the 9am one."},
    ]


def test_tool_replies_in_a_user_message_become_tool_messages_first():
    call = {"type": "tool_call", "id": "toolu_01", "name": "get_time", "arguments": {}}
    doc = otlp(chat_span("01", 1, [
        text("user", "time?"), {"role": "assistant", "parts": [call]},
        {"role": "user", "parts": [
            {"type": "tool_call_response", "id": "toolu_01", "response": {"time": "09:00"}},
            {"type": "text", "content": "and be brief"}]}],
        [text("assistant", "09:00")]))
    assert otel.parse(doc)[0]["messages"][2:] == [
        {"role": "tool", "tool_call_id": "toolu_01", "content": '{"time": "09:00"}'},
        {"role": "user", "content": "and be brief"},
        {"role": "assistant", "content": "09:00"},
    ]


def test_detect():
    assert otel.detect(document())
    assert otel.detect(document("otel_genai_legacy.json"))
    line = (FIXTURES / "openai_responses.jsonl").read_text().splitlines()[0]
    assert not otel.detect(json.loads(line))
    assert not otel.detect({"id": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert not otel.detect([])


def test_unparseable_input_messages_names_the_span():
    doc = document()
    set_attribute(spans(doc)["00f067aa0ba902b7"], "gen_ai.input.messages",
                  {"stringValue": '[{"role": "user", "parts": ['})
    with pytest.raises(BadRecord) as err:
        otel.parse(doc)
    assert str(err.value).startswith(
        "trace 4bf92f3577b34da6a3ce929d0e0e4736 span 00f067aa0ba902b7: gen_ai.input.messages is "
        "not valid JSON (")


def test_reply_to_an_unknown_call_names_the_span():
    doc = document()
    messages = [text("user", "hi"), {"role": "tool", "parts": [
        {"type": "tool_call_response", "id": "call_nope", "response": "x"}]}]
    set_attribute(spans(doc)["5fb397be34d26b51"], "gen_ai.input.messages",
                  {"stringValue": json.dumps(messages)})
    with pytest.raises(BadRecord, match=r"span 5fb397be34d26b51: gen_ai\.input\.messages\[1\]"
                                        r"\.parts\[0\]: tool_call_response id 'call_nope' has no "
                                        r"matching tool_call"):
        otel.parse(doc)


@pytest.mark.parametrize("inputs, reason", [
    ([{"role": "user", "parts": [{"type": "blob", "modality": "image", "content": "aGk="}]}],
     "gen_ai.input.messages[0].parts[0]: part type 'blob' cannot be mapped"),
    ([{"role": "user", "content": "chat-style"}], "gen_ai.input.messages[0] has no 'parts' list"),
    ([{"role": "narrator", "parts": []}], "gen_ai.input.messages[0] has role 'narrator'"),
    ({"role": "user", "parts": []}, "gen_ai.input.messages must be a list of messages, got dict"),
    ([{"role": "assistant", "parts": [{"type": "tool_call", "id": "c", "name": "f",
                                       "arguments": "not json"}]}],
     "tool call 'c' arguments are not valid JSON"),
    ([{"role": "tool", "parts": [{"type": "text", "content": "orphan"}]}],
     "tool_call_response has no id and no tool call is waiting for one"),
])
def test_unmappable_messages(inputs, reason):
    doc = otlp(chat_span("0a0b", 1, [], [text("assistant", "ok")]))
    set_attribute(doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0], "gen_ai.input.messages",
                  {"stringValue": json.dumps(inputs)})
    with pytest.raises(BadRecord) as err:
        otel.parse(doc)
    assert f"trace {'ab' * 16} span 0a0b: " in str(err.value)
    assert reason in str(err.value)


def test_content_capture_off_is_refused_not_skipped():
    doc = document()
    for span in spans(doc).values():
        for key in ("gen_ai.input.messages", "gen_ai.output.messages"):
            set_attribute(span, key, None)
    with pytest.raises(BadRecord, match="trace 4bf92f3577b34da6a3ce929d0e0e4736: its GenAI "
                                        "spans record no messages"):
        otel.parse(doc)


def test_malformed_documents():
    with pytest.raises(BadRecord, match="no 'resourceSpans' or 'resourceLogs' list"):
        otel.parse({"resourceMetrics": []})
    assert otel.parse({"resourceLogs": []}) == []  # log records alone are read too
    doc = copy.deepcopy(otlp(chat_span("01", 1, [], [])))
    del doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]
    with pytest.raises(BadRecord, match=r"resourceSpans\[0\]\.scopeSpans\[0\]\.spans\[0\] has "
                                        "no 'traceId'"):
        otel.parse(doc)
    assert otel.parse({"resourceSpans": []}) == []
