import random

from stages.envs import arith


def test_calculator_never_evals():
    assert arith.evaluate("12-30") == -18
    assert arith.evaluate("__import__('os')") is None
    assert arith.tool_result("1+") == "?"


def test_question_from_free_text():
    assert arith.question_from_text("What is 47 x 38? thanks") == "47*38"
    assert arith.question_from_text("compute 5-12") == "5-12"
    assert arith.question_from_text("hello there") is None


def test_mix_shifts_towards_products():
    assert arith.mix_for_day(0, 0.15)[2] < arith.mix_for_day(3, 0.15)[2]
    rng = random.Random(0)
    questions = [arith.sample_question(rng, arith.mix_for_day(6, 0.15)) for _ in range(500)]
    assert sum("*" in q for q in questions) > 250


def test_benchmark_is_fixed(tmp_path):
    arith.write_benchmark(tmp_path / "b.jsonl")
    committed = (arith.Path(__file__).parents[3] / "data/benchmarks/arith.jsonl").read_text()
    assert (tmp_path / "b.jsonl").read_text() == committed


def test_arith_loads_as_an_environment_on_the_contract():
    from stages.envs import contract

    env = contract.load("arith", "stages.envs.arith")
    assert env.tool_names == ["calculator"] and env.max_turns == arith.MAX_TURNS
    tasks = contract.load_tasks(arith.Path(__file__).parents[3] / "data/benchmarks/arith.jsonl", env)
    assert len(tasks) == 200
    for task in tasks:
        assert [m["role"] for m in task["messages"]] == ["user"]
        assert contract.check_gold(env, task) == {"reward": 1.0}


def test_reward_right_wrong_malformed_unfinished_unjudgeable():
    task = {"task_id": "t", **arith.chat_task("47*38")}
    user = task["messages"]
    assert arith.reward(task, user + [{"role": "assistant", "content": "answer:1786"}]) == 1.0
    assert arith.reward(task, user + [{"role": "assistant", "content": " 1786 "}]) == 1.0  # a trace's
    assert arith.reward(task, user + [{"role": "assistant", "content": "1787"}]) == 0.0
    assert arith.reward(task, user + [{"role": "assistant", "content": "about 1786"}]) == 0.0
    assert arith.reward(task, user + [{"role": "assistant", "content": "answer:17x6"}]) == 0.0
    # the last word is a tool call: it never answered
    assert arith.reward(task, user + arith.gold(task)[:1]) == 0.0
    assert arith.reward({"answer": "None", "messages": user}, user) is None  # cannot judge
    assert arith.reward({"answer": "", "messages": user}, user) is None


def test_calculator_tool_answers_as_the_demo_does():
    task = {"task_id": "t", **arith.chat_task("47*38")}
    assert arith.call_tool(task, "calculator", {"expression": "47*38"}) == "1786"
    assert arith.call_tool(task, "calculator", {"expression": "__import__('os')"}) == "?"


def test_task_from_trace_normalises_the_question():
    trace = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 47 x 38?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {
                 "name": "calculator", "arguments": {"expression": "47 * 38"}}}]},
             {"role": "tool", "tool_call_id": "a", "content": "1786"},
             {"role": "assistant", "content": "1787"}]  # the logged answer is wrong: not taken
    assert arith.task_from_trace(trace, arith.TOOLS) == {
        "messages": [{"role": "user", "content": "47*38"}], "answer": "1786"}
    assert arith.task_from_trace([{"role": "user", "content": "hello"}], None) is None
