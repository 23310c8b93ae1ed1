import copy
import json
import re
from pathlib import Path

import pytest

from stages.traces.schema import BadRecord
from stages.traces.sources import langfuse, langsmith, openinference

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
LF1 = "c2a1e0d4-5b6f-4e3a-9d2c-7f8e1a0b3c4d"
LF2 = "7d9e3b1f-2a4c-4f6e-8b0d-1c3e5a7f9b2d"


def records():
    return json.loads((FIXTURES / "langfuse.json").read_text())


def by_id(traces):
    return {t["trace_id"]: t for t in traces}


def generation(trace_id, id_, start, input_, output, **more):
    return {"id": id_, "traceId": trace_id, "type": "GENERATION", "name": "llm",
            "startTime": start, "input": input_, "output": output, "level": "DEFAULT", **more}


def test_trace_with_nested_observations_and_scores():
    traces = langfuse.parse(records())
    assert [t["trace_id"] for t in traces] == [LF1, LF2]
    trace = traces[0]
    assert trace["messages"] == [
        {"role": "system",
         "content": "You are the ShopCo support assistant. Look orders up before answering."},
        {"role": "user", "content": "Where is my order #A1043?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_8sJd0", "type": "function",
                         "function": {"name": "lookup_order",
                                      "arguments": '{"order_id": "A1043"}'}}]},
        {"role": "tool", "content": '{"status": "shipped", "carrier": "UPS", "eta": "2025-03-07"}',
         "tool_call_id": "call_8sJd0"},
        {"role": "assistant",
         "content": "Your order #A1043 has shipped with UPS and should arrive on March 7."},
    ]
    assert trace["model"] == "gpt-4o-mini-2024-07-18"
    assert trace["created_at"] == "2025-03-05T09:00:00.000Z"
    assert trace["usage"] == {"input_tokens": 96 + 151, "output_tokens": 19 + 21}
    assert trace["feedback"] == {"scores": {"user-feedback": True, "helpfulness": 0.9}}
    assert [t["function"]["name"] for t in trace["tools"]] == ["lookup_order"]
    assert trace["conversation_id"] == "chat-4411"  # the trace's sessionId
    assert traces[1]["conversation_id"] is None  # "sessionId": null


def test_observations_without_their_trace_record_have_no_conversation_id():
    recs = [r for r in records() if r.get("id") != LF1 or "traceId" in r]
    nested = next(r for r in records() if r.get("id") == LF1)
    recs += [{"traceId": LF1, **o} for o in nested["observations"]]
    trace = by_id(langfuse.parse(recs))[LF1]
    assert trace["conversation_id"] is None
    assert len(trace["messages"]) == 5


def test_separate_records_from_the_langchain_handler():
    # Trace list item (observation and score ids only), observations and a score as records;
    # LangChain-style tool calls ({"name", "args", "id"}) and the handler's tool-schema
    # pseudo-messages ({"role": "tool", "content": <schema>}) at the end of each input.
    trace = by_id(langfuse.parse(records()))[LF2]
    assert trace["messages"] == [
        {"role": "system",
         "content": "You are a finance helper. Use convert_currency for any conversion."},
        {"role": "user", "content": "Convert 250 USD to EUR."},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_Zp41", "type": "function",
                         "function": {"name": "convert_currency", "arguments":
                                      '{"amount": 250, "from": "USD", "to": "EUR"}'}}]},
        {"role": "tool", "content": "230.15 EUR", "tool_call_id": "call_Zp41"},
        {"role": "assistant", "content": "250 USD is about 230.15 EUR at today's rate."},
    ]
    assert [t["function"]["name"] for t in trace["tools"]] == ["convert_currency"]
    assert trace["feedback"] == {"scores": {"resolution": "resolved"}}
    assert trace["usage"] == {"input_tokens": 88 + 131, "output_tokens": 24 + 15}


def test_jsonl_order_and_duplicates_do_not_matter():
    # The same observations nested in the trace and again as records, in reverse order.
    recs = records()
    shuffled = list(reversed(recs)) + [copy.deepcopy(o) for o in recs[0]["observations"]]
    assert by_id(langfuse.parse(shuffled)) == by_id(langfuse.parse(recs))


def test_detect_only_its_own_format():
    assert all(langfuse.detect(r) for r in records())
    others = [json.loads(line) for name in ("langsmith.jsonl", "openinference.jsonl")
              for line in (FIXTURES / name).read_text().splitlines()]
    assert not any(langfuse.detect(r) for r in others)
    assert not langfuse.detect({"messages": [{"role": "user", "content": "hi"}]})
    assert not any(openinference.detect(r) or langsmith.detect(r) for r in records())


def test_anthropic_blocks_streamed_output_and_errors():
    # Anthropic-style content blocks in the input; the OpenAI integration's streamed output
    # (no role, tool call without id: the next input's copy of the message supplies it, and the
    # thinking the input echoes); a root generation at level ERROR.
    first = generation("t1", "g1", "2025-01-01T00:00:00Z",
                       [{"role": "user",
                         "content": [{"type": "text", "text": "Weather in Oslo?"}]}],
                       {"tool_calls": [{"function": {"name": "weather",
                                                     "arguments": '{"city": "Oslo"}'}}]},
                       usage={"promptTokens": 10, "completionTokens": 5})
    second = generation("t1", "g2", "2025-01-01T00:00:02Z", [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "-3 C, snow"}]}]},
    ], None, level="ERROR", statusMessage="overloaded_error: Overloaded", model="claude-x")
    [trace] = langfuse.parse([first, second])
    assert trace["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}],
         "reasoning_content": "Need the tool."},
        {"role": "tool", "content": "-3 C, snow", "tool_call_id": "toolu_1"},
    ]
    assert trace["feedback"] == {"error": "llm: overloaded_error: Overloaded"}
    assert trace["usage"] == {"input_tokens": 10, "output_tokens": 5}
    assert trace["created_at"] == "2025-01-01T00:00:00Z"  # no trace record: first observation


def test_usage_details_parts_add_up_and_tool_output_objects_become_json():
    # The LangChain handler moves cached and reasoning tokens out of input/output into keys
    # of their own; a Vercel AI SDK tool result carries {"type": "json", "value": ...}.
    gen = generation("t", "g", "2025-01-01T00:00:00Z", [
        {"role": "user", "content": "Stock of SKU 7?"},
        {"role": "assistant", "content": [
            {"type": "tool-call", "toolCallId": "c7", "toolName": "stock", "input": {"sku": 7}}]},
        {"role": "tool", "content": [{"type": "tool-result", "toolCallId": "c7",
                                      "toolName": "stock",
                                      "output": {"type": "json", "value": {"left": 3}}}]},
    ], "3 left.", usageDetails={"input": 46, "input_cache_read": 50, "output": 10,
                                "output_reasoning": 5, "total": 111})
    [trace] = langfuse.parse([gen])
    assert trace["usage"] == {"input_tokens": 96, "output_tokens": 15}
    assert trace["messages"][1:] == [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c7", "type": "function",
                         "function": {"name": "stock", "arguments": '{"sku": 7}'}}]},
        {"role": "tool", "content": '{"left": 3}', "tool_call_id": "c7"},
        {"role": "assistant", "content": "3 left."},
    ]


@pytest.mark.parametrize("recs, reason", [
    ([{"id": "t", "timestamp": "2025-01-01T00:00:00Z", "name": "x", "input": "hi",
       "observations": []}], "trace t: no GENERATION observation among its 0 observation"),
    ([{"traceId": "t", "name": "thumbs", "value": 1, "dataType": "BOOLEAN"}],
     "trace t: the file has scores for it but not the trace or its observations"),
    ([{"id": "o", "type": "GENERATION", "startTime": "2025-01-01T00:00:00Z"}],
     "record 1: observation 'o' has no traceId"),
    ([{"messages": [{"role": "user", "content": "hi"}]}],
     r"record 1 is not a Langfuse trace, observation or score \(keys: messages\)"),
    # ({"prompt": ...} is the Vercel AI SDK's generateText input, read as a user message)
    ([generation("t", "g", "2025-01-01T00:00:00Z", {"question": "hi"}, "yo")],
     r"trace t: generation g: input is an object without 'messages' \(keys: question\)"),
    ([generation("t", "g", "2025-01-01T00:00:00Z",
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "ok")],
     r"trace t: generation g input\[0\] content\[0\] is a 'image_url' part"),
    ([generation("t", "g", "2025-01-01T00:00:00Z", [{"role": "critic", "content": "x"}], "y")],
     r"input\[0\] has role 'critic'; expected one of"),
    ([generation("t", "g", "2025-01-01T00:00:00Z", [{"role": "user", "content": "x"}],
                 {"usage": {"input": 3}})],
     r"output is an object with no message in it \(keys: usage\)"),
])
def test_broken_records_say_what_is_wrong(recs, reason):
    with pytest.raises(BadRecord, match=reason):
        langfuse.parse(recs)


# Langfuse's own "Download JSON" of traces from 20 agent frameworks, with Langfuse's expected
# ChatML reading of each observation (`<name>.chatml.json`, the oracle), from langfuse/langfuse
# (see fixtures/traces/SOURCES.md).
FRAMEWORKS = FIXTURES / "langfuse_frameworks"
SFO = "What's the weather in San Francisco?"
# name -> (roles, the first user message's start, tool calls (name, arguments) in order, tool
# results' starts in order), or the quarantine reason of a trace with no trainable conversation.
FRAMEWORK_CONVERSATIONS = {
    "agno-2025-06-11": (  # the assistant's call put back from the first call (Agno leaves it out)
        ["system", "user", "assistant", "tool", "assistant"],
        "What is currently trending on Twitter?",
        [("duckduckgo_search", {"query": "currently trending on Twitter"})],
        ['[\n  {\n    "title": "Twitter. It\'s what\'s happening']),
    "autogen-2025-06-06": (  # the app's own text prompt ("role: text" lines), kept as written
        ["user", "assistant"], "system: You are a helpful AI assistant.", [], []),
    "beeai-2025-08-01": r"generation f50f7bbf13112df9: its llm.output_messages start at index "
                        r"233: the first 233 output message\(s\) \(stream chunks\) are missing",
    "claude-agent-2025-12-22": (  # one turn per generation; results from the TOOL observations
        ["system", "user", "assistant", "tool", "tool", "assistant"],
        "What's the weather like in Berlin and New York?",
        [("mcp__weather__get_weather", {"city": "Berlin"}),
         ("mcp__weather__get_weather", {"city": "New York"})],
        ["Weather in Berlin: Cloudy, 59°F", "Weather in New York: Sunny, 75°F"]),
    "crewai-2025-07-11": (["system", "user", "assistant"], "\nCurrent Task: Define the HTML", [],
                          []),
    "csharp-agent-with-gemini-2026-03-09": (  # encrypted-only reasoning parts left out
        ["system", "user", "assistant", "tool", "assistant", "assistant"],
        "What are my month over month performance insights the past quarter",
        [("get_custom_report", {"dimensions": ["Campaign"], "filters": {"dateRange": {
            "from_date": "2025-10-01", "to_date": "2025-12-31"}}, "timeDimension": "Month",
            "metrics": ["Cost", "Displays", "Clicks", "Ctr", "Sales", "Cvr"]}),
         ("final_result", None)],
        ['{"response_status": "Error"']),
    "google-adk-2025-08-28": (["system", "user", "assistant", "tool", "assistant"], "hi",
                              [("say_hello", {})], ['{"greeting": "Hello Langfuse']),
    "google-gemini-2025-08-01": (["user", "assistant"], "What is Langfuse?", [], []),
    "koog-2025-08-26": (  # calls written as JSON text, role "tool" in the next input
        ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"],
        "Greet and say goodbye to the user in the same message.",
        [("HelloTool", {"name": "Bob"}), ("ByeTool", {"name": "Bob"})],
        ["Hello my darling Bob!", "Bye my dear Bob!"]),
    "langgraph-js-2025-10-30": (  # the tool result's role is the tool's name
        ["user", "assistant", "tool", "assistant"], SFO,
        [("get_weather", {"city": "San Francisco"})], ["It's always sunny in San Francisco!"]),
    "langgraph-python-2025-08-22": (
        ["user", "user", "assistant", "tool", "assistant"], "Be helpful!",
        [("Web-Search", {"query": "example"})], ['[{"url": "https://example.com"']),
    "llamaindex-2025-06-05": (["user", "assistant"], "What is Langfuse?", [], []),
    "microsoft-agent-2025-12-17": (
        ["user", "assistant", "tool", "assistant"], "What's the weather in Tokyo?",
        [("get_weather", {"location": "Tokyo, Japan"})], ['{"type": "function_result"']),
    "openai-agents-2025-09-30": (
        ["system", "user", "assistant", "tool", "assistant"], "What's the weather in Tokyo?",
        [("get_weather", {"city": "Tokyo"})], ["The weather in Tokyo is sunny."]),
    "pydantic-ai-2025-06-06": (["system", "user", "assistant"], "What is Langfuse?", [], []),
    "pydantic-ai-tools-2025-06-06": (["system", "user", "assistant"], "What is Langfuse?", [], []),
    "pydantic-ai-tools-2025-12-04": (
        ["system", "user", "assistant", "tool", "tool", "tool", "assistant", "user", "assistant"],
        "Select and call THREE of the available tools",
        [("get_pun_suggestion", {"topic": "programming"}),
         ("get_dad_joke_suggestion", {"topic": "programming"}),
         ("get_one_liner_suggestion", {"topic": "programming"})],
        ["Pun idea:", "Dad joke idea:", "One-liner idea:"]),
    "pydantic-ai-with-gemini-2025-12-24": (["user", "assistant"], "what is 1+1?", [], []),
    "vercel-aisdk-2025-11-17": (  # generateText stopped at the tool call: no result sent back
        ["user", "assistant"], "What is the weather like today in San Francisco?",
        [("getWeather", {"location": "San Francisco"})], []),
    "vertex-ai-2025-08-01": (["user", "assistant"], "What is Langfuse?", [], []),
}


def test_every_framework_download_has_an_expectation():
    assert {p.name.removesuffix(".trace.json") for p in FRAMEWORKS.glob("*.trace.json")} == set(
        FRAMEWORK_CONVERSATIONS)


def chatml_oracle(name, download):
    """What Langfuse's adapters read from the generations.

    User texts in start order, tool calls by id (name, arguments), tool results by call id.
    """
    users, calls, results = [], {}, {}
    path = FRAMEWORKS / f"{name}.chatml.json"
    chatml = json.loads(path.read_text()) if path.exists() else {}
    generations = [o for o in download["observations"] if o["type"] == "GENERATION"]
    for observation in sorted(generations, key=lambda o: o["startTime"]):
        for side in ("input", "output"):
            found = chatml.get(observation["id"], {}).get(side) or {}
            for message in found.get("data") or [] if found.get("success") else []:
                content = message.get("content")
                if message.get("role") == "user" and isinstance(content, str):
                    users.append(content)
                blocks = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"
                          ] if isinstance(content, list) else []
                for call in (message.get("tool_calls") or []) + blocks:
                    calls[call["id"]] = (call["name"], call.get("arguments", call.get("input")))
                if message.get("role") == "tool" and message.get("tool_call_id"):
                    results[message["tool_call_id"]] = content
    return users, calls, results


def as_json(value):
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


@pytest.mark.parametrize("name", sorted(FRAMEWORK_CONVERSATIONS))
def test_langfuse_download_of_each_agent_framework(name):
    download = json.loads((FRAMEWORKS / f"{name}.trace.json").read_text())
    [(trace_id, trace)] = langfuse.parse_each([download])
    assert trace_id == download["trace"]["id"]
    expected = FRAMEWORK_CONVERSATIONS[name]
    if isinstance(expected, str):
        assert isinstance(trace, BadRecord)
        assert re.search(expected, str(trace)), str(trace)
        return
    assert isinstance(trace, dict), str(trace)
    roles, user, calls, results = expected
    messages = trace["messages"]
    assert [m["role"] for m in messages] == roles
    first_user = next(m["content"] for m in messages if m["role"] == "user")
    assert first_user.startswith(user)
    made = [c for m in messages for c in m.get("tool_calls") or []]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]) if arguments is not None else None)
            for c, (_, arguments) in zip(made, calls)] == calls
    assert len(made) == len(calls)
    # each tool result answers a call made before it, and no call twice
    seen, answered = set(), []
    for message in messages:
        seen |= {c["id"] for c in message.get("tool_calls") or []}
        if message["role"] == "tool":
            assert message["tool_call_id"] in seen and message["tool_call_id"] not in answered
            answered.append(message["tool_call_id"])
    tool_texts = [m["content"] for m in messages if m["role"] == "tool"]
    assert len(tool_texts) == len(results)
    assert all(text.startswith(start) for text, start in zip(tool_texts, results))

    # Langfuse's own reading, where its adapters read the observation
    users, oracle_calls, oracle_results = chatml_oracle(name, download)
    if users:
        assert first_user == users[0]
    for call in made:
        if call["id"] in oracle_calls:
            oracle_name, oracle_arguments = oracle_calls[call["id"]]
            assert call["function"]["name"] == oracle_name
            assert json.loads(call["function"]["arguments"]) == as_json(oracle_arguments)
    for message in messages:
        if message["role"] == "tool" and message["tool_call_id"] in oracle_results:
            assert as_json(message["content"]) == as_json(oracle_results[message["tool_call_id"]])


def test_framework_traces_missing_what_the_reader_puts_back_say_so():
    agno = json.loads((FRAMEWORKS / "agno-2025-06-11.trace.json").read_text())
    # without the first call, nothing supplies the assistant message Agno left out
    agno["observations"] = [o for o in agno["observations"] if o["id"] != "ca136de468e156c9"]
    [(_, error)] = langfuse.parse_each([agno])
    assert re.search(r"generation b38a82eaa62b551e: llm.input_messages.2 is missing \(the "
                     r"instrumentation left it out\) and no earlier call", str(error))

    claude = json.loads((FRAMEWORKS / "claude-agent-2025-12-22.trace.json").read_text())
    claude["observations"] = [o for o in claude["observations"] if o["id"] != "edbd987c5f361fdf"]
    [(_, error)] = langfuse.parse_each([claude])
    assert re.search(r"generation 371496f71d82baed: the tool call\(s\) mcp__weather__get_weather "
                     r"before this turn have no TOOL observation", str(error))
