import json
import random

from stages.envs import arith


def test_verify_right_wrong_malformed_unjudgeable():
    assert arith.verify("47*38", "1786",
                        "<calc>47*38</calc><result>1786</result>answer:1786") == 1.0
    assert arith.verify("47*38", "1786", "answer:1787") == 0.0
    assert arith.verify("47*38", "1786", "answer:17x6") == 0.0  # malformed answer
    assert arith.verify("47*38", "1786", "<calc>47*38</calc>") == 0.0  # never answered
    assert arith.verify("hello", "None", "answer:1") is None  # no gold answer: cannot judge
    assert arith.verify("47*38", "", "answer:1786") is None


def test_score_components():
    full = {"correct": 1.0, "format": 1.0, "tool_ok": 1.0}
    assert arith.score("47*38", "1786", "<calc>47*38</calc><result>1786</result>answer:1786") == full
    assert arith.score("47*38", "1786", "answer:1786") == full  # no tool call: tool_ok holds
    assert arith.score("47*38", "1786", "answer:1787") == {**full, "correct": 0.0}
    # a call the calculator could not evaluate is a tool error, even if the answer is right
    assert arith.score("47*38", "1786", "<calc>47 x 38</calc><result>?</result>answer:1786") == \
        {**full, "tool_ok": 0.0}
    # a call that was never answered, and no final answer: not the protocol
    assert arith.score("47*38", "1786", "<calc>47*38</calc>") == \
        {"correct": 0.0, "format": 0.0, "tool_ok": 1.0}
    assert arith.score("47*38", "1786", "<calc>47*38answer:1786") == {**full, "format": 0.0}
    assert arith.score("hello", "None", "answer:1") is None


def test_gold_scores_full_marks():
    assert arith.gold_completion("47*38", "1786") == "answer:1786"
    assert set(arith.score("47*38", "1786", arith.gold_completion("47*38", "1786")).values()) == {1.0}


def test_calculator_never_evals():
    assert arith.evaluate("12-30") == -18
    assert arith.evaluate("__import__('os')") is None
    assert arith.tool_result("1+") == "?"


def test_question_from_free_text():
    assert arith.question_from_text("What is 47 x 38? thanks") == "47*38"
    assert arith.question_from_text("compute 5-12") == "5-12"
    assert arith.question_from_text("hello there") is None


def test_on_tool_close_uses_last_call():
    assert arith.on_tool_close("<calc>1+1</calc><result>2</result><calc>3*4</calc>") == \
        "<result>12</result>"


def test_messages_round_trip():
    completion = "<calc>47*38</calc><result>1786</result>answer:1786"
    messages = arith.messages_from_completion("what is 47*38?", completion, "c")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    call = messages[1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"expression": "47*38"}
    assert messages[2]["tool_call_id"] == call["id"] and messages[2]["content"] == "1786"
    assert messages[3]["content"] == "1786"
    assert arith.task_from_messages(messages) == {"question": "47*38", "answer": "1786"}


def test_completion_from_messages_inverts_messages_from_completion():
    for completion in ["<calc>47*38</calc><result>1786</result>answer:1786", "answer:-3",
                       "<calc>1+1</calc><result>2</result><calc>2*9</calc><result>18</result>"
                       "answer:18"]:
        messages = arith.messages_from_completion("what is it?", completion, "c")
        assert arith.completion_from_messages(messages) == completion
    # a production trace: spaces in the tool's arguments, a system prompt first
    trace = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "47 x 38?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {
                 "name": "calculator", "arguments": {"expression": "47 * 38"}}}]},
             {"role": "tool", "tool_call_id": "a", "content": "1786"},
             {"role": "assistant", "content": " 1786 "}]
    assert arith.completion_from_messages(trace) == \
        "<calc>47*38</calc><result>1786</result>answer:1786"
    # not writable in the model's text: prose, another tool, a call never answered, a second turn
    user = {"role": "user", "content": "2+2?"}
    other = [{"id": "b", "function": {"name": "search", "arguments": "{}"}}]
    for messages in ([user, {"role": "assistant", "content": "four"}],
                     [user, {"role": "assistant", "tool_calls": other},
                      {"role": "tool", "tool_call_id": "b", "content": "4"},
                      {"role": "assistant", "content": "4"}],
                     trace[:3] + [trace[4]],
                     [user, {"role": "assistant", "content": "4"}, user],
                     [{"role": "assistant", "content": "4"}]):
        assert arith.completion_from_messages(messages) is None


def test_mix_shifts_towards_products():
    assert arith.mix_for_day(0, 0.15)[2] < arith.mix_for_day(3, 0.15)[2]
    rng = random.Random(0)
    questions = [arith.sample_question(rng, arith.mix_for_day(6, 0.15)) for _ in range(500)]
    assert sum("*" in q for q in questions) > 250


def test_benchmark_is_fixed(tmp_path):
    arith.write_benchmark(tmp_path / "b.jsonl")
    committed = (arith.Path(__file__).parents[1] / "data/benchmarks/arith.jsonl").read_text()
    assert (tmp_path / "b.jsonl").read_text() == committed


# --- the demo on the contract: the same module, loaded as a user's environment is ----------


def test_arith_loads_as_an_environment_on_the_contract():
    from stages.envs import contract

    env = contract.load("arith", "stages.envs.arith")
    assert env.tool_names == ["calculator"] and env.max_turns == arith.MAX_TURNS
    tasks = contract.load_tasks(arith.Path(__file__).parents[1] / "data/benchmarks/arith.jsonl", env)
    assert len(tasks) == 200
    for task in tasks:  # the tag path's fields and the chat path's agree, item by item
        assert task["messages"] == [{"role": "user", "content": task["question"]}]
        assert contract.check_gold(env, task) == {"reward": 1.0}


def test_chat_reward_right_wrong_and_unfinished():
    task = {"task_id": "t", **arith.chat_task("47*38")}
    user = task["messages"]
    assert arith.reward(task, user + [{"role": "assistant", "content": "answer:1786"}]) == 1.0
    assert arith.reward(task, user + [{"role": "assistant", "content": " 1786 "}]) == 1.0  # a trace's
    assert arith.reward(task, user + [{"role": "assistant", "content": "1787"}]) == 0.0
    assert arith.reward(task, user + [{"role": "assistant", "content": "about 1786"}]) == 0.0
    # the last word is a tool call: it never answered
    assert arith.reward(task, user + arith.gold(task)[:1]) == 0.0
    assert arith.reward({"answer": "None", "messages": user}, user) is None


def test_calculator_tool_answers_as_the_demo_does():
    task = {"task_id": "t", **arith.chat_task("47*38")}
    assert arith.call_tool(task, "calculator", {"expression": "47*38"}) == "1786"
    assert arith.call_tool(task, "calculator", {"expression": "__import__('os')"}) == "?"


def test_task_from_trace_normalises_the_question():
    trace = arith.messages_from_completion("What is 47 x 38?", "answer:1786", "c")
    assert arith.task_from_trace(trace, [arith.TOOL_SCHEMA]) == {
        "messages": [{"role": "user", "content": "47*38"}], "answer": "1786"}
    assert arith.task_from_trace([{"role": "user", "content": "hello"}], None) is None
