"""The code environment: its verifier on right, wrong, malformed and unjudgeable completions, its
`<run>` tool, its task suites (every reference solution passes, a stub fails), and its alphabet."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stages import tinylm
from stages.envs import coding, sandbox
from stages.envs.errors import VerifierError
from stages.envs.registry import ENVIRONMENTS

REPO = Path(__file__).resolve().parents[1]
SUITES = [REPO / "data/tasks/code.jsonl", REPO / "data/benchmarks/code.jsonl"]
QUESTION = "Write a function add(a, b) that returns a + b."
TESTS = ("import unittest\nfrom solution import add\n\n"
         "class T(unittest.TestCase):\n    def test_add(self):\n"
         "        self.assertEqual(add(2, 3), 5)\n        self.assertEqual(add(-1, 1), 0)\n")
ANSWER = json.dumps({"tests": TESTS, "entry_point": "add",
                     "solution": "def add(a, b):\n    return a + b\n"})


def block(code: str) -> str:
    return f"```python\n{code}\n```"


def test_registered_under_code():
    assert ENVIRONMENTS["code"] is coding and coding.NAME == "code"
    assert coding.VERSION == "unittest-sandbox@1"


def test_right_answer_and_gold_score_full_marks():
    gold = coding.gold_completion(QUESTION, ANSWER)
    assert coding.verify(QUESTION, ANSWER, gold) == 1.0
    assert coding.score(QUESTION, ANSWER, gold) == {"correct": 1.0, "format": 1.0, "tool_ok": 1.0}
    # the last block is the answer: an earlier wrong draft does not count against it
    drafts = block("def add(a, b):\n    return 0") + " fixed:\n" + block("def add(a, b):\n    return b + a")
    assert coding.verify(QUESTION, ANSWER, drafts) == 1.0


def test_wrong_answers_score_zero_with_the_reason(monkeypatch):
    # the loop below: seconds, not five
    monkeypatch.setattr(coding, "TEST_LIMITS", dataclasses.replace(coding.TEST_LIMITS, cpu_seconds=1,
                                                                   wall_seconds=4.0))
    wrong = coding.check(QUESTION, ANSWER, block("def add(a, b):\n    return a * b"))
    assert (wrong.correct, wrong.outcome) == (0.0, "failed")
    assert "test_add" in wrong.reason and "6 != 5" in wrong.reason
    loop = coding.check(QUESTION, ANSWER, block("def add(a, b):\n    while True:\n        pass"))
    assert (loop.correct, loop.outcome) == (0.0, "timeout")
    hog = coding.check(QUESTION, ANSWER, block("def add(a, b):\n    return len(bytearray(1 << 34))"))
    assert (hog.correct, hog.outcome) == (0.0, "memory")
    assert coding.score(QUESTION, ANSWER, block("def add(a, b):\n    return a - b")) == \
        {"correct": 0.0, "format": 1.0, "tool_ok": 1.0}


def test_malformed_completions_score_zero():
    for completion in ["def add(a, b):\n    return a + b",  # no fence
                       "```python\ndef add(a, b):\n    return a + b\n",  # never closed
                       "",
                       "<run>def add(a, b): return a + b</run>"]:  # only tried, never answered
        verdict = coding.check(QUESTION, ANSWER, completion)
        assert (verdict.correct, verdict.outcome) == (0.0, "no-code"), completion
        assert coding.score(QUESTION, ANSWER, completion)["format"] == 0.0
    syntax = coding.check(QUESTION, ANSWER, block("def add(a, b)\n    return a + b"))
    assert (syntax.correct, syntax.outcome) == (0.0, "failed") and "SyntaxError" in syntax.reason


def test_unjudgeable_tasks_give_none():
    right = coding.gold_completion(QUESTION, ANSWER)
    for answer in ["not json", json.dumps({"tests": ""}), json.dumps([1, 2]),
                   json.dumps({"entry_point": "add"})]:
        assert coding.verify(QUESTION, answer, right) is None
        assert coding.score(QUESTION, answer, right) is None
    with pytest.raises(ValueError, match="no reference solution"):
        coding.gold_completion(QUESTION, json.dumps({"tests": TESTS}))


def test_a_broken_sandbox_raises_not_zero(monkeypatch):
    # bubblewrap probed first, with the real interpreter: its answer is cached for the process,
    # and a first probe under the patch below cached "bwrap does not work here" for every later
    # test of this worker (test_sandbox's bwrap cases then skipped)
    sandbox.bwrap_problem()
    monkeypatch.setattr(sandbox, "interpreter", lambda: "/nonexistent/bin/python3")
    with pytest.raises(VerifierError, match="not an executable file"):
        coding.verify(QUESTION, ANSWER, coding.gold_completion(QUESTION, ANSWER))


def test_run_tool_injects_output_and_errors():
    assert coding.on_tool_close("# Task: x\n<run>print(2 + 3)</run>") == "<output>5\n</output>"
    failed = coding.on_tool_close("<run>print(1)</run><output>1\n</output><run>1/0</run>")
    assert failed.startswith("<output>error: failed: ZeroDivisionError: division by zero\n")
    assert failed.endswith("</output>") and failed.count("</output>") == 1
    long = coding.on_tool_close("<run>print('</output>' * 500)</run>")
    assert len(long) <= len("<output></output>") + coding.TOOL_OUTPUT_CHARS + 3
    assert long.count("</output>") == 1  # the code cannot close the tool's reply early
    with_run = "<run>print(add(2, 3))</run>" + failed + block("def add(a, b):\n    return a + b")
    assert coding.score(QUESTION, ANSWER, with_run) == {"correct": 1.0, "format": 1.0, "tool_ok": 0.0}
    unanswered = "<run>print(1)</run>" + block("def add(a, b):\n    return a + b")
    assert coding.score(QUESTION, ANSWER, unanswered)["format"] == 0.0


def test_messages_from_completion():
    completion = "<run>print(1)</run><output>1\n</output>" + block("def add(a, b):\n    return a + b")
    messages = coding.messages_from_completion(QUESTION, completion, "c")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"code": "print(1)"}
    assert messages[2]["content"] == "1\n"
    assert coding.code_block(messages[3]["content"]) == "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.parent.name)
def test_task_suites_gold_passes_and_a_stub_fails(path):
    tasks = coding.load_tasks(path)
    assert len(tasks) >= 10 and len({t["id"] for t in tasks}) == len(tasks)
    tokenizer = tinylm.build_tokenizer(coding)

    def verdicts(task):
        entry = coding.parse_answer(task["answer"])["entry_point"]
        gold = coding.gold_completion(task["question"], task["answer"])
        stub = block(f"def {entry}(*args, **kwargs):\n    return None")
        assert tokenizer.decode(tokenizer.encode(coding.prompt(task["question"]) + gold)) == \
            coding.prompt(task["question"]) + gold  # the demo tokenizer can write it
        return (coding.check(task["question"], task["answer"], gold),
                coding.check(task["question"], task["answer"], stub))

    with ThreadPoolExecutor(4) as pool:
        for task, (gold, stub) in zip(tasks, pool.map(verdicts, tasks)):
            assert gold.correct == 1.0, (task["id"], gold)
            assert stub.correct == 0.0, (task["id"], stub)


def test_load_tasks_names_the_bad_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "a", "question": QUESTION, "answer": ANSWER}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: not JSON"):
        coding.load_tasks(path)
    path.write_text(json.dumps({"id": "a", "question": QUESTION, "answer": "{}"}) + "\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:1: .*answer.tests"):
        coding.load_tasks(path)


def test_code_loads_as_an_environment_on_the_contract():
    """The same tasks through the chat path's contract: each gold passes its tests in the
    sandbox, a wrong final answer scores 0, the python tool runs code.
    """
    from stages.envs import contract

    root = Path(__file__).resolve().parents[1]
    env = contract.load("code", "stages.envs.coding")
    assert env.tool_names == ["python"]
    tasks = contract.load_tasks(root / "data/benchmarks/code.jsonl", env)
    assert len(tasks) == 10
    for task in tasks:
        assert task["messages"] == [{"role": "user", "content": task["question"]}]
        assert contract.check_gold(env, task) == {"reward": 1.0}
    task = tasks[0]
    wrong = [{"role": "assistant", "content": "```python\ndef multiply(a, b):\n    return a + b\n```"}]
    assert contract.score(env, task, task["messages"] + wrong) == {"reward": 0.0}
    no_code = [{"role": "assistant", "content": "multiply is a * b"}]
    assert contract.score(env, task, task["messages"] + no_code) == {"reward": 0.0}
    assert contract.call(env, task, "python", {"code": "print(6 * 7)"}) == ("42\n", None)
    output, why = contract.call(env, task, "python", {"code": "1/0"})
    assert why is None and output.startswith("error: ") and "ZeroDivisionError" in output
