import json

import pytest

from stages.envs import toolcall
from stages.envs.errors import VerifierError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"], "additionalProperties": False}}}
TIMER = {"type": "function", "function": {"name": "set_timer", "parameters": {
    "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1}},
    "required": ["minutes"]}}}
Q = "What's the weather in Paris?"


FULL = {"correct": 1.0, "format": 1.0, "tool_ok": 1.0, "right_tool": 1.0, "arguments_valid": 1.0}


def turn(name, arguments, call_id="call_0", reply='{"ok": true}'):
    """A call (its arguments as JSON text, as a chat model's tool call carries them) and the
    tool's reply."""
    return [{"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                     else json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": reply}]


def chat_task(arguments=None, name="get_weather", tools=(WEATHER, TIMER)):
    return {"task_id": "t", "messages": [{"role": "user", "content": Q}], "tools": list(tools),
            "expected": {"name": name, "arguments": arguments}}


def score(added, task=None):
    task = task or chat_task({"city": "Paris"})
    return toolcall.reward(task, task["messages"] + added)


def test_right_call():
    assert score(turn("get_weather", {"city": "Paris"})) == FULL
    # no expected arguments: any the schema accepts are right
    assert score(turn("get_weather", {"city": "Lyon"}), chat_task(None)) == FULL


def test_wrong_calls():
    # the wrong tool: well-formed, schema-valid, but not what was asked
    assert score(turn("set_timer", {"minutes": 3})) == \
        {**FULL, "correct": 0.0, "right_tool": 0.0, "arguments_valid": 0.0}
    # the right tool, valid but different arguments
    assert score(turn("get_weather", {"city": "Rome"})) == {**FULL, "correct": 0.0}
    # arguments the schema rejects: a tool error too
    bad = {**FULL, "correct": 0.0, "tool_ok": 0.0, "arguments_valid": 0.0}
    assert score(turn("get_weather", {"city": ""}), chat_task(None)) == bad
    assert score(turn("get_weather", {"town": "Paris"}), chat_task(None)) == bad
    # a tool that was not offered
    assert score(turn("delete_files", {"path": "/"}))["tool_ok"] == 0.0
    # no call at all
    assert score([{"role": "assistant", "content": "It is sunny in Paris."}]) == \
        {"correct": 0.0, "format": 0.0, "tool_ok": 1.0, "right_tool": 0.0, "arguments_valid": 0.0}


@pytest.mark.parametrize("added", [
    turn("get_weather", '{"city": "Paris"'),  # arguments a brace short
    turn("get_weather", '["Paris"]'),  # not an object
    # what the chat path records when its parser could not read the call: the model's text, and
    # a tool error answering no call it made
    [{"role": "assistant", "content": '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'},
     {"role": "tool", "tool_call_id": "call_malformed_0", "content": "Error: no name"}],
])
def test_malformed_calls(added):
    components = score(added)
    assert components["format"] == 0.0 and components["correct"] == 0.0
    assert components["tool_ok"] == 0.0


@pytest.mark.parametrize("bad_task", [
    {**chat_task(), "tools": None},  # no tools
    chat_task({"city": "Paris"}, name="get_time"),  # expected tool not offered
    {**chat_task(), "expected": None},
    chat_task(tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "no-such-type"}}}]),  # not a JSON schema
])
def test_unjudgeable_tasks(bad_task):
    assert score(turn("get_weather", {"city": "Paris"}), bad_task) is None


def test_an_unresolvable_schema_ref_is_a_verifier_error_not_a_zero():
    remote = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "$ref": "https://schemas.example.com/weather.json"}}}
    with pytest.raises(VerifierError, match="get_weather.*cannot be resolved"):
        score(turn("get_weather", {"city": "Paris"}), chat_task(None, tools=[remote]))


def test_gold_makes_up_arguments_from_the_schema_when_none_are_expected():
    call = toolcall.gold(chat_task(None))[0]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "x"})
    assert score(toolcall.gold(chat_task(None)), chat_task(None)) == FULL


def trace(tools):
    return [{"role": "user", "content": "weather in Oslo please"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
            {"role": "assistant", "content": "It is -3 C in Oslo."}]


def test_validate_derives_tool_call_tasks_from_trace_rows():
    import pandas as pd

    from stages import validate
    from stages.envs import contract

    traces = pd.DataFrame([
        {"trace_id": "a", "n_messages": 4, "user_text": "weather in Oslo please",
         "messages": json.dumps(trace([WEATHER])), "tools": json.dumps([WEATHER, TIMER])},
        {"trace_id": "b", "n_messages": 4, "user_text": "weather in Oslo please",
         "messages": json.dumps(trace([])), "tools": "[]"}])
    router = contract.Router({"toolcall": contract_env()})
    per_trace, _, calls = validate.flatten(traces, router)
    assert json.loads(per_trace.question[0]) == {
        "messages": trace([])[:1], "tools": [WEATHER, TIMER],
        "expected": {"name": "get_weather", "arguments": None}, "environment": "toolcall"}
    assert pd.isna(per_trace.question[1])  # no schema in the trace: quarantined by validate
    assert list(calls.name) == ["get_weather", "get_weather"]


# --- through the contract: a chat model's native tool calls, each task its own tools ------------

def contract_env():
    from stages.envs import contract

    return contract.load("toolcall", "stages.envs.toolcall")


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


def test_a_trace_that_called_an_offered_tool_is_a_task():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q},
                *turn("get_weather", {"city": "Paris"}),
                {"role": "assistant", "content": "Sunny."}]
    task = toolcall.task_from_trace(messages, [WEATHER, TIMER])
    assert task == {"messages": messages[:2], "tools": [WEATHER, TIMER],
                    "expected": {"name": "get_weather", "arguments": None}}
    assert toolcall.task_from_trace(messages, [TIMER]) is None  # the called tool not offered
    assert toolcall.task_from_trace(messages[:2], [WEATHER]) is None  # no call
    assert toolcall.task_from_trace(messages, []) is None  # no schema: nothing to judge


def test_a_task_line_with_bad_tools_is_refused_naming_its_line(tmp_path):
    from stages.envs import contract

    path = tmp_path / "tasks.jsonl"
    bad = {**chat_task(), "task_id": "u",
           "tools": [{"type": "function", "function": {"name": "x"}}]}
    path.write_text(json.dumps(chat_task()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(contract.TaskFileError, match=rf"{path}:2: task 'u': tools\[0\] \(x\) has no function.parameters"):
        contract.load_tasks(path, contract_env())
