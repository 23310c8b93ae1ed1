import json
from pathlib import Path

import pytest

from stages.traces.schema import BadRecord
from stages.traces.sources import langfuse, langsmith, openinference

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
T1 = "6a1f0c9b2e3d4f5a8b7c6d5e4f3a2b1c"
T2 = "0af7651916cd43dd8448eb211c80319c"
SYS = "You are WeatherBot. Use the tools to answer; reply in one sentence."
Q = "What's the weather in Paris right now, in celsius?"


def records():
    text = (FIXTURES / "openinference.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def by_id(traces):
    return {t["trace_id"]: t for t in traces}


def span(trace_id, span_id, attributes, start, parent=None, **more):
    return {"name": "span", "context": {"trace_id": trace_id, "span_id": span_id},
            "parent_id": parent, "start_time": start, "status_code": "OK",
            "attributes": attributes, **more}


def llm(trace_id, span_id, start, inputs, outputs, **attributes):
    flat = {"openinference.span.kind": "LLM", **attributes}
    for prefix, messages in (("llm.input_messages", inputs), ("llm.output_messages", outputs)):
        for i, message in enumerate(messages):
            for key, value in message.items():
                flat[f"{prefix}.{i}.message.{key}"] = value
    return span(trace_id, span_id, flat, start)


def test_the_tool_calling_trace_maps_to_exact_chat_messages():
    traces = openinference.parse(records())
    assert [t["trace_id"] for t in traces] == [T1, T2]
    trace = traces[0]
    assert trace["messages"] == [
        {"role": "system", "content": SYS},
        {"role": "user", "content": Q},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_Qx7mB2", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "content": '{"temp_c": 18, "conditions": "light rain"}',
         "tool_call_id": "call_Qx7mB2"},
        {"role": "assistant",
         "content": "It's 18 °C with light rain in Paris right now, so bring an umbrella."},
    ]
    call = trace["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert trace["model"] == "gpt-4o-2024-08-06"
    assert trace["created_at"] == "2025-03-04T10:15:00.000000+00:00"
    assert trace["feedback"] == {"scores": {"user_feedback": 1}}
    assert [t["function"]["name"] for t in trace["tools"]] == ["get_weather"]
    assert trace["tools"][0]["type"] == "function"
    assert trace["tools"][0]["function"]["parameters"]["required"] == ["city"]
    assert trace["conversation_id"] == "sess-7f3e"  # session.id


def test_nested_client_span_repeating_the_call_is_not_duplicated_nor_double_counted():
    # Spans 4 and 5 of the fixture are one call recorded by two instrumentors (LangChain and
    # the OpenAI client); the second has compact arguments JSON and flat attribute keys.
    trace = by_id(openinference.parse(records()))[T1]
    assert sum(m["role"] == "assistant" for m in trace["messages"]) == 2
    assert trace["usage"] == {"input_tokens": 112 + 160, "output_tokens": 18 + 17}


def test_otlp_json_with_reasoning_and_a_failed_root_span():
    trace = by_id(openinference.parse(records()))[T2]
    assert trace["messages"] == [
        {"role": "system", "content": "You are a patient math tutor."},
        {"role": "user", "content": "Is 1001 a prime number?"},
        {"role": "assistant", "content": "No. 1001 = 7 × 11 × 13, so it is not prime.",
         "reasoning_content": "Try small primes: 1001 / 7 = 143 and 143 = 11 × 13."},
    ]
    assert trace["model"] == "claude-3-7-sonnet-20250219"
    assert trace["usage"] == {"input_tokens": 58, "output_tokens": 96}  # OTLP intValue strings
    assert trace["created_at"] == "2025-03-04T11:00:00+00:00"  # from startTimeUnixNano
    assert trace["feedback"] == {
        "error": "tutor.answer: OutputParserException: final answer is missing the worked steps"}
    assert trace["tools"] == []
    assert trace["conversation_id"] == "sess-91ac"  # session.id of an OTLP span


def test_detect_only_its_own_format():
    assert all(openinference.detect(r) for r in records())
    others = [json.loads(line) for line in
              (FIXTURES / "langsmith.jsonl").read_text().splitlines()]
    others += json.loads((FIXTURES / "langfuse.json").read_text())
    assert not any(openinference.detect(r) for r in others)
    assert not openinference.detect({"messages": [{"role": "user", "content": "hi"}]})
    assert not openinference.detect([1, 2])
    # Plain OTel spans without OpenInference attributes belong to another reader.
    plain = {"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": T2, "spanId": "01", "attributes": [
            {"key": "http.route", "value": {"stringValue": "/"}}]}]}]}]}
    assert not openinference.detect(plain)
    assert not langfuse.detect(records()[0]) and not langsmith.detect(records()[0])


def test_annotation_records_and_dataframe_rows():
    # Phoenix's annotations API shape, and a pandas-style row (attributes.<name> columns).
    row = {"context.trace_id": "t9", "context.span_id": "s1", "parent_id": None,
           "span_kind": "LLM", "start_time": "2025-01-01T00:00:00Z", "status_code": "OK",
           "attributes.llm.input_messages": [{"message.role": "user", "message.content": "2+2?"}],
           "attributes.llm.output_messages": [{"message.role": "assistant",
                                               "message.content": "4"}],
           "attributes.llm.model_name": "gpt-4o-mini"}
    note = {"span_id": "s1", "name": "correctness", "annotator_kind": "HUMAN",
            "result": {"label": "correct", "score": None, "explanation": "right"}}
    assert openinference.detect(row) and openinference.detect(note)
    [trace] = openinference.parse([row, note])
    assert trace["messages"] == [{"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "content": "4"}]
    assert trace["feedback"] == {"scores": {"correctness": "correct"}}
    assert trace["usage"] == {} and trace["model"] == "gpt-4o-mini"


def test_a_side_call_does_not_break_the_conversation():
    user = {"role": "user", "content": "Book a table for two."}
    spans = [
        llm("t", "a", "2025-01-01T00:00:00Z",
            [{"role": "system", "content": "Agent."}, user],
            [{"role": "assistant", "content": "Which evening?"}]),
        llm("t", "b", "2025-01-01T00:00:01Z",  # a title-generation call
            [{"role": "system", "content": "Write a title."}, user],
            [{"role": "assistant", "content": "Table booking"}]),
        llm("t", "c", "2025-01-01T00:00:02Z",
            [{"role": "system", "content": "Agent."}, user,
             {"role": "assistant", "content": "Which evening?"},
             {"role": "user", "content": "Friday."}],
            [{"role": "assistant", "content": "Booked for Friday."}]),
    ]
    [trace] = openinference.parse(spans)
    assert [m["content"] for m in trace["messages"]] == [
        "Agent.", "Book a table for two.", "Which evening?", "Friday.", "Booked for Friday."]


def test_tool_result_without_id_answers_the_pending_call():
    call = {"tool_calls.0.tool_call.function.name": "now",
            "tool_calls.0.tool_call.function.arguments": ""}
    spans = [llm("t", "a", "2025-01-01T00:00:00Z",
                 [{"role": "user", "content": "time?"}, {"role": "assistant", **call},
                  {"role": "tool", "content": "12:00"}],
                 [{"role": "assistant", "content": "Noon."}])]
    [trace] = openinference.parse(spans)
    assistant, tool = trace["messages"][1], trace["messages"][2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == "{}"
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"] != ""


@pytest.mark.parametrize("change, reason", [
    (lambda r: [r[2]], f"trace {T1}: no LLM span"),
    (lambda r: [{"name": "x", "attributes": {}}], "no context.trace_id"),
    (lambda r: r[:5] + [{"span_id": "ffff", "name": "q", "result": {"score": 1}}],
     "annotation 'q' is for 'ffff', which is not a span or trace in this file"),
    (lambda r: ["oops"], "record 1 is a JSON str, not an object"),
])
def test_broken_files_say_what_is_wrong(change, reason):
    with pytest.raises(BadRecord, match=reason):
        openinference.parse(change(records()))


def test_broken_messages_say_which_span_and_attribute():
    image = llm("t", "s1", "2025-01-01T00:00:00Z", [{"role": "user"}], [])
    image["attributes"]["llm.input_messages.0.message.contents.0.message_content.type"] = "image"
    with pytest.raises(BadRecord, match=r"trace t: span s1 llm.input_messages.0 "
                                        r"message.contents.0 is a 'image' part"):
        openinference.parse([image])
    no_role = llm("t", "s1", "2025-01-01T00:00:00Z", [{"content": "hi"}], [])
    with pytest.raises(BadRecord, match="llm.input_messages.0 has no message.role"):
        openinference.parse([no_role])
    stray = llm("t", "s1", "2025-01-01T00:00:00Z",
                [{"role": "user", "content": "hi"},
                 {"role": "tool", "content": "42", "tool_call_id": "call_9"}], [])
    with pytest.raises(BadRecord, match="answers tool call 'call_9', which no earlier"):
        openinference.parse([stray])
    bad_time = llm("t", "s1", "yesterday", [{"role": "user", "content": "hi"}], [])
    with pytest.raises(BadRecord, match="start time 'yesterday' is not an ISO 8601 time"):
        openinference.parse([bad_time])
