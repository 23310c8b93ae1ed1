import json

import pytest

from stages.envs import toolcall
from stages.envs.errors import VerifierError
from stages.envs.registry import load_tasks

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"], "additionalProperties": False}}}
TIMER = {"type": "function", "function": {"name": "set_timer", "parameters": {
    "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1}},
    "required": ["minutes"]}}}
Q = "What's the weather in Paris?"


def answer(arguments=None, name="get_weather", tools=(WEATHER, TIMER)):
    return json.dumps({"tools": list(tools), "expected": {"name": name, "arguments": arguments}})


def call(name, arguments) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{body}</tool_call>" + toolcall.on_tool_close(f"<tool_call>{body}</tool_call>")


FULL = {"correct": 1.0, "format": 1.0, "tool_ok": 1.0, "right_tool": 1.0, "arguments_valid": 1.0}


def test_right_call():
    a = answer({"city": "Paris"})
    assert toolcall.score(Q, a, call("get_weather", {"city": "Paris"})) == FULL
    assert toolcall.verify(Q, a, call("get_weather", {"city": "Paris"})) == 1.0
    # arguments as a JSON string, as OpenAI's API sends them
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    assert toolcall.verify(Q, a, text) == 1.0
    # no expected arguments: any the schema accepts are right
    assert toolcall.score(Q, answer(None), call("get_weather", {"city": "Lyon"})) == FULL


def test_wrong_calls():
    a = answer({"city": "Paris"})
    # the wrong tool: well-formed, schema-valid, but not what was asked
    assert toolcall.score(Q, a, call("set_timer", {"minutes": 3})) == \
        {**FULL, "correct": 0.0, "right_tool": 0.0, "arguments_valid": 0.0}
    # the right tool, valid but different arguments
    assert toolcall.score(Q, a, call("get_weather", {"city": "Rome"})) == {**FULL, "correct": 0.0}
    # arguments the schema rejects: a tool error too
    bad = {**FULL, "correct": 0.0, "tool_ok": 0.0, "arguments_valid": 0.0}
    assert toolcall.score(Q, answer(None), call("get_weather", {"city": ""})) == bad
    assert toolcall.score(Q, answer(None), call("get_weather", {"town": "Paris"})) == bad
    # a tool that was not offered
    assert toolcall.score(Q, a, call("delete_files", {"path": "/"}))["tool_ok"] == 0.0
    # no call at all
    assert toolcall.score(Q, a, "It is sunny in Paris.") == \
        {"correct": 0.0, "format": 0.0, "tool_ok": 1.0, "right_tool": 0.0, "arguments_valid": 0.0}


def test_a_retry_after_a_bad_call_is_judged_on_the_last_call():
    a = answer({"city": "Paris"})
    first = call("get_weather", {"city": ""})
    components = toolcall.score(Q, a, first + call("get_weather", {"city": "Paris"}))
    assert components == {**FULL, "tool_ok": 0.0}  # right in the end; the first call failed


@pytest.mark.parametrize("completion", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',  # a brace short
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
    '<tool_call>{"name": "get_weather", "arguments": ["Paris"]}</tool_call>',  # not an object
    '<tool_call>["get_weather", {"city": "Paris"}]</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
])
def test_malformed_calls(completion):
    components = toolcall.score(Q, answer({"city": "Paris"}), completion)
    assert components["format"] == 0.0 and components["correct"] == 0.0
    assert components["tool_ok"] == 0.0


def test_the_environment_answers_a_malformed_call_with_an_error():
    assert toolcall.on_tool_close('<tool_call>{"name": "x"</tool_call>') == \
        '<tool_response>{"error": "not a JSON object with name and arguments"}</tool_response>'
    assert toolcall.on_tool_close('x<tool_call>{"name": "x", "arguments": {}}</tool_call>') == \
        '<tool_response>{"ok": true}</tool_response>'


@pytest.mark.parametrize("bad_answer", [
    "not json",
    json.dumps({"expected": {"name": "get_weather", "arguments": None}}),  # no tools
    answer({"city": "Paris"}, name="get_time"),  # expected tool not offered
    json.dumps({"tools": [WEATHER], "expected": None}),
    json.dumps({"tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "no-such-type"}}}],
        "expected": {"name": "get_weather", "arguments": None}}),  # not a JSON schema
])
def test_unjudgeable_tasks(bad_answer):
    assert toolcall.score(Q, bad_answer, call("get_weather", {"city": "Paris"})) is None
    assert toolcall.verify(Q, bad_answer, call("get_weather", {"city": "Paris"})) is None


def test_an_unresolvable_schema_ref_is_a_verifier_error_not_a_zero():
    remote = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "$ref": "https://schemas.example.com/weather.json"}}}
    with pytest.raises(VerifierError, match="get_weather.*cannot be resolved"):
        toolcall.score(Q, answer(None, tools=[remote]), call("get_weather", {"city": "Paris"}))


def test_gold_scores_full_marks_on_every_suite_task():
    tasks = load_tasks("data/tasks/toolcall.jsonl") + load_tasks("data/benchmarks/toolcall.jsonl")
    assert len(tasks) == 30
    for task in tasks:
        gold = toolcall.gold_completion(task["question"], task["answer"])
        assert toolcall.score(task["question"], task["answer"], gold) == FULL, task["task_id"]
    # made up from the schema when no arguments are expected
    assert json.loads(toolcall.gold_completion(Q, answer(None)).split("<tool_call>")[1].split("</")[0]) == \
        {"name": "get_weather", "arguments": {"city": "x"}}


def trace(tools):
    return [{"role": "user", "content": "weather in Oslo please"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
            {"role": "assistant", "content": "It is -3 C in Oslo."}]


def test_task_from_a_trace_uses_its_tool_schema():
    task = toolcall.task_from_messages(trace([WEATHER, TIMER]), tools=[WEATHER, TIMER])
    assert task["question"] == "weather in Oslo please"
    data = json.loads(task["answer"])
    assert data == {"tools": [WEATHER], "expected": {"name": "get_weather", "arguments": None}}
    assert toolcall.verify(task["question"], task["answer"], call("get_weather", {"city": "Oslo"})) \
        == 1.0
    assert toolcall.task_from_messages(trace([]), tools=[]) is None  # no schema: nothing to judge
    assert toolcall.task_from_messages(trace([TIMER]), tools=[TIMER]) is None  # tool not offered
    assert toolcall.task_from_messages(trace([WEATHER])[:1], tools=[WEATHER]) is None  # no call


def test_messages_from_completion():
    completion = call("get_weather", {"city": "Oslo"}) + "Done."
    messages = toolcall.messages_from_completion("weather in Oslo", completion, "c")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "tool_call_id": "c-0", "content": '{"ok": true}'}
    assert messages[3]["content"] == "Done."


def test_validate_derives_tool_call_tasks_from_trace_rows():
    import pandas as pd

    from stages import validate

    traces = pd.DataFrame([
        {"trace_id": "a", "n_messages": 4, "user_text": "weather in Oslo please",
         "messages": json.dumps(trace([WEATHER])), "tools": json.dumps([WEATHER, TIMER])},
        {"trace_id": "b", "n_messages": 4, "user_text": "weather in Oslo please",
         "messages": json.dumps(trace([])), "tools": "[]"}])
    per_trace, _, calls = validate.flatten(traces, toolcall)
    assert json.loads(per_trace.answer[0])["tools"] == [WEATHER]
    assert pd.isna(per_trace.question[1])  # no schema in the trace: quarantined by validate
    assert list(calls.name) == ["get_weather", "get_weather"]


# --- on the environment contract: a chat model's native tool calls, each task its own tools ----

def contract_env():
    from stages.envs import contract

    return contract.load("toolcall", "stages.envs.toolcall")


def turn(name, arguments, call_id="call_0", reply='{"ok": true}'):
    return [{"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": reply}]


def chat_task(arguments=None, name="get_weather", tools=(WEATHER, TIMER)):
    return {"task_id": "t", "messages": [{"role": "user", "content": Q}], "tools": list(tools),
            "expected": {"name": name, "arguments": arguments}}


def test_on_the_contract_every_suite_task_has_its_own_tools_and_a_full_marks_gold():
    from stages.envs import contract

    env = contract_env()
    assert env.tools == () and env.version == toolcall.VERSION  # the tools come with each task
    offered = set()
    for path in ("data/tasks/toolcall.jsonl", "data/benchmarks/toolcall.jsonl"):
        for task in contract.load_tasks(path, env):
            assert contract.full_marks(contract.check_gold(env, task)), task["task_id"]
            offered.add(tuple(sorted(t["function"]["name"] for t in task["tools"])))
    assert len(offered) > 3  # the offered tools differ from task to task


def test_on_the_contract_calls_are_checked_against_the_tasks_own_schemas():
    from stages.envs import contract

    env, task = contract_env(), chat_task({"city": "Paris"}, tools=(WEATHER,))
    assert contract.call(env, task, "get_weather", '{"city": "Paris"}') == ('{"ok": true}', None)
    # set_timer exists in other tasks, not in this one
    content, why = contract.call(env, task, "set_timer", '{"minutes": 5}')
    assert why == "unknown tool 'set_timer'; the tools are: get_weather"
    content, why = contract.call(env, task, "get_weather", '{"town": "Paris"}')
    assert content.startswith("Error: invalid arguments for get_weather")


def test_on_the_contract_the_reward_judges_the_last_call_of_the_conversation():
    from stages.envs import contract

    env, task = contract_env(), chat_task({"city": "Paris"})
    score = lambda added: contract.score(env, task, task["messages"] + added)  # noqa: E731
    assert score(turn("get_weather", {"city": "Paris"})) == FULL
    assert score(turn("get_weather", {"city": "Rome"}))["correct"] == 0.0
    wrong = score(turn("set_timer", {"minutes": 5}))
    assert (wrong["right_tool"], wrong["tool_ok"], wrong["format"]) == (0.0, 1.0, 1.0)
    # a refused call, then the right one: the last call is judged, the refused one costs tool_ok
    retried = score(turn("get_weather", {"town": "Paris"}, "a", "Error: invalid")
                    + turn("get_weather", {"city": "Paris"}, "b"))
    assert (retried["correct"], retried["tool_ok"]) == (1.0, 0.0)
    # a malformed call: the parser's error answers no call the assistant made
    malformed = score([{"role": "assistant", "content": "<tool_call>{oops</tool_call>"},
                       {"role": "tool", "tool_call_id": "call_malformed_0", "content": "Error"}])
    assert (malformed["format"], malformed["correct"]) == (0.0, 0.0)
    assert score([{"role": "assistant", "content": "It is sunny."}])["format"] == 0.0
    # no expected arguments: any the schema accepts are right
    assert contract.score(env, chat_task(None), chat_task(None)["messages"]
                          + turn("get_weather", {"city": "Oslo"}))["correct"] == 1.0
    assert contract.score(env, {**task, "expected": {"name": "nope"}}, task["messages"]) is None


def test_on_the_contract_a_trace_that_called_an_offered_tool_is_a_task():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q},
                *turn("get_weather", {"city": "Paris"}),
                {"role": "assistant", "content": "Sunny."}]
    task = toolcall.task_from_trace(messages, [WEATHER, TIMER])
    assert task == {"messages": messages[:2], "tools": [WEATHER, TIMER],
                    "expected": {"name": "get_weather", "arguments": None}}
    assert toolcall.task_from_trace(messages, [TIMER]) is None  # the called tool not offered
    assert toolcall.task_from_trace(messages[:2], [WEATHER]) is None  # no call


def test_a_task_line_with_bad_tools_is_refused_naming_its_line(tmp_path):
    from stages.envs import contract

    path = tmp_path / "tasks.jsonl"
    bad = {**chat_task(), "task_id": "u",
           "tools": [{"type": "function", "function": {"name": "x"}}]}
    path.write_text(json.dumps(chat_task()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(contract.TaskFileError, match=rf"{path}:2: task 'u': tools\[0\] \(x\) has no function.parameters"):
        contract.load_tasks(path, contract_env())
