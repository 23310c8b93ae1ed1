"""The OpenAI Responses reader, on sample exports written to the Responses API reference."""

import json
from pathlib import Path

import pytest

from stages.traces.schema import BadRecord
from stages.traces.sources import openai_responses as responses

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"


def records() -> list[dict]:
    lines = (FIXTURES / "openai_responses.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def otel_document() -> dict:
    return json.loads((FIXTURES / "otel_genai.json").read_text())


def test_response_object_with_parallel_tool_calls_and_reasoning():
    trace = responses.parse(records()[0])
    assert trace["trace_id"] == "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b"
    assert trace["model"] == "o4-mini-2025-04-16"
    assert trace["created_at"] == "2025-03-08T23:29:02Z"
    assert trace["messages"] == [
        {"role": "system",
         "content": "You are a travel assistant. Use tools for anything that changes over time."},
        {"role": "user", "content": "What's the weather in Paris and Berlin right now?"},
        {"role": "assistant", "content": None,
         "reasoning_content": "**Checking two cities**\n\nThe user wants current conditions for "
                              "both cities, so I'll call get_weather for each.",
         "tool_calls": [
             {"id": "call_paris_01", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}},
             {"id": "call_berlin_02", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city":"Berlin","unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "call_paris_01",
         "content": '{"temp_c": 14, "conditions": "light rain"}'},
        {"role": "tool", "tool_call_id": "call_berlin_02",
         "content": '{"temp_c": 9, "conditions": "overcast"}'},
        {"role": "assistant", "content": "Paris: 14 °C with light rain. Berlin: 9 °C and overcast.",
         "reasoning_content": "Both lookups returned; summarize them side by side."},
    ]
    # the hosted web_search_preview tool has no chat schema and is left out
    assert trace["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.", "strict": True,
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"city": {"type": "string",
                                               "description": "City name, e.g. Paris"},
                                      "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city", "unit"]}}}]
    assert trace["usage"] == {"input_tokens": 328, "output_tokens": 96, "total_tokens": 424,
                              "cached_input_tokens": 192, "reasoning_tokens": 64}
    assert trace["feedback"] == {}
    assert trace["conversation_id"] == "conv_68ccd2b9a4e88190a0f2e1c7d3b5a6f40bb6a6b452d3795b"


def test_bare_input_output_record_joins_text_and_call_into_one_turn():
    trace = responses.parse(records()[1])
    assert trace["trace_id"] == "conv-2f9c1e7a:turn-3"
    assert trace["model"] == "gpt-4.1-mini-2025-04-14"
    assert trace["created_at"] is None
    assert trace["messages"] == [
        {"role": "user", "content": "Cancel my 3pm meeting with Dana."},
        {"role": "assistant", "content": "Sure, cancelling it now.", "tool_calls": [
            {"id": "call_cal_7", "type": "function", "function": {
                "name": "cancel_event",
                "arguments": '{"title":"Meeting with Dana","start":"15:00"}'}}]},
    ]
    assert trace["feedback"] == {"thumbs_up": False}
    assert trace["tools"] == [] and trace["usage"] == {}
    assert trace["conversation_id"] is None  # the record names no conversation


def test_incomplete_response_keeps_raw_reasoning_and_reports_the_error():
    trace = responses.parse(records()[2])
    assert trace["trace_id"] == "resp_0d3b7c1e9a2f48c6b5e4a7d9c8f1e2a3"
    assert trace["messages"] == [
        {"role": "developer", "content": "Answer in one short paragraph."},
        {"role": "user", "content": "Explain how DNS resolution works."},
        {"role": "assistant",
         "content": "When you type a name, your resolver first checks its cache; on a miss it "
                    "asks a root server",
         "reasoning_content": "Walk through stub resolver, recursive resolver, root, TLD, "
                              "authoritative."},
    ]
    assert trace["feedback"] == {"error": "incomplete: max_output_tokens"}
    assert trace["usage"]["output_tokens"] == 256 and trace["usage"]["reasoning_tokens"] == 38


@pytest.mark.parametrize(("extra", "expected"), [
    ({"conversation": "conv_abc"}, "conv_abc"),  # the request's form: a bare id
    ({"conversation": {"id": "conv_abc"}}, "conv_abc"),  # the Response object's form
    ({"conversation": None}, None),
    # a chain of responses is not a Conversation object: no conversation id
    ({"previous_response_id": "resp_prev"}, None),
])
def test_conversation_id_comes_from_the_conversation_field_only(extra, expected):
    record = {"id": "r1", "input": "hi", "output": [
        {"type": "message", "role": "assistant", "content": "hello"}], **extra}
    assert responses.parse(record)["conversation_id"] == expected


def test_every_tool_reply_follows_its_call_and_arguments_are_json_strings():
    checked_calls = checked_replies = 0
    for record in records():
        calls: set[str] = set()
        for message in responses.parse(record)["messages"]:
            for call in message.get("tool_calls", []):
                assert isinstance(call["function"]["arguments"], str)
                json.loads(call["function"]["arguments"])
                calls.add(call["id"])
                checked_calls += 1
            if message["role"] == "tool":
                assert message["tool_call_id"] in calls
                checked_replies += 1
    # the fixtures hold tool calls and their replies: the loops above checked something
    assert checked_calls > 0 and checked_replies > 0


def test_reasoning_between_calls_starts_a_new_assistant_turn():
    trace = responses.parse({"id": "r1", "input": "hi", "output": [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "first"}]},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "second"}]},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": ""},
    ]})
    assert [(m.get("reasoning_content"), [c["id"] for c in m["tool_calls"]])
            for m in trace["messages"][1:]] == [("first", ["a"]), ("second", ["b"])]
    assert trace["messages"][2]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_detect():
    assert all(responses.detect(record) for record in records())
    assert not responses.detect(otel_document())
    assert not responses.detect({"id": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert not responses.detect({"id": "x"})
    assert not responses.detect([])


def call(call_id: str = "c1", arguments: str = "{}") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": arguments}


@pytest.mark.parametrize("record, reason", [
    ({"id": "r", "input": [call()], "output": [
        {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "function_call_output call_id 'c9' has no matching function_call (output[0])"),
    ({"id": "r", "output": [{"type": "function_call_output", "call_id": "c1", "output": "x"},
                            call()]},
     "function_call_output call_id 'c1' has no matching function_call"),
    ({"id": "r", "output": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]},
     "output[0]: item type 'web_search_call' has no chat completions equivalent"),
    ({"id": "r", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}], "output": []},
     "input[0].content[1]: content part type 'input_image' is not text"),
    ({"id": "r", "output": [call(arguments='{"q": ')]},
     "output[0]: function_call 'c1' arguments are not valid JSON"),
    ({"id": "r", "output": [call(), call()]},
     "output[1]: function_call call_id 'c1' appears twice"),
    ({"id": "r", "output": [{"type": "message", "role": "critic", "content": "x"}]},
     "output[0]: message role 'critic' is not user, system, developer or assistant"),
    ({"output": []}, "no 'id'"),
    ({"id": "r", "object": "response", "output": None}, "'output' is missing or not a list"),
    ({"id": "r", "output": []}, "no messages"),
])
def test_bad_records_say_what_is_wrong(record, reason):
    with pytest.raises(BadRecord) as err:
        responses.parse(record)
    assert reason in str(err.value)


def test_a_response_logged_without_its_input_is_quarantined_saying_what_to_log(tmp_path):
    """The SDK's Response object does not echo the request's input: a system prompt and an
    answer are no task. Ingest quarantines it with the reason and what to change.
    """
    from stages import config as cfg
    from stages import ingest

    bare = {k: v for k, v in records()[0].items() if k != "input"}
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "responses.jsonl").write_text(
        json.dumps(bare) + "\n" + json.dumps(records()[0]) + "\n")
    m = ingest.run(cfg.Ingest(), tmp_path / "inbox", tmp_path / "traces",
                   tmp_path / "ingested.parquet", tmp_path / "q.jsonl")
    assert m["accepted"] == 1 and m["quarantined"] == 1
    bad = json.loads((tmp_path / "q.jsonl").read_text().splitlines()[0])
    assert bad["source_file"] == "responses.jsonl" and bad["source_line"] == 1
    assert "no user turn in the trace" in bad["reason"]
    assert "log the request's `input` beside it" in bad["reason"], bad["reason"]
