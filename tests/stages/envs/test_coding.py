"""The code environment on the contract: its reward on right, wrong, malformed and unjudgeable
answers, its `python` tool, and its task files (every reference solution passes, a stub fails)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stages.envs import coding, contract, sandbox
from stages.envs.errors import VerifierError

REPO = Path(__file__).resolve().parents[3]
SUITES = [REPO / "data/tasks/code.jsonl", REPO / "data/benchmarks/code.jsonl"]
TESTS = ("import unittest\nfrom solution import add\n\n"
         "class T(unittest.TestCase):\n    def test_add(self):\n"
         "        self.assertEqual(add(2, 3), 5)\n        self.assertEqual(add(-1, 1), 0)\n")
ANSWER = json.dumps({"tests": TESTS, "entry_point": "add",
                     "solution": "def add(a, b):\n    return a + b\n"})
TASK = {"task_id": "add", "answer": ANSWER,
        "messages": [{"role": "user", "content": "Write a function add(a, b) that returns a + b."}]}


def block(code: str) -> str:
    return f"```python\n{code}\n```"


def said(text: str, task: dict = TASK) -> list[dict]:
    return task["messages"] + [{"role": "assistant", "content": text}]


def test_right_answer_and_gold_score_full_marks():
    assert coding.reward(TASK, TASK["messages"] + coding.gold(TASK)) == 1.0
    # the last block is the answer: an earlier wrong draft does not count against it
    drafts = block("def add(a, b):\n    return 0") + " fixed:\n" + block("def add(a, b):\n    return b + a")
    assert coding.reward(TASK, said(drafts)) == 1.0


def test_wrong_answers_score_zero_with_the_reason(monkeypatch):
    # the loop below: seconds, not five
    monkeypatch.setattr(coding, "TEST_LIMITS", dataclasses.replace(coding.TEST_LIMITS, cpu_seconds=1,
                                                                   wall_seconds=4.0))
    wrong = coding.check(ANSWER, block("def add(a, b):\n    return a * b"))
    assert (wrong.correct, wrong.outcome) == (0.0, "failed")
    assert "test_add" in wrong.reason and "6 != 5" in wrong.reason
    loop = coding.check(ANSWER, block("def add(a, b):\n    while True:\n        pass"))
    assert (loop.correct, loop.outcome) == (0.0, "timeout")
    hog = coding.check(ANSWER, block("def add(a, b):\n    return len(bytearray(1 << 34))"))
    assert (hog.correct, hog.outcome) == (0.0, "memory")
    assert coding.reward(TASK, said(block("def add(a, b):\n    return a - b"))) == 0.0


def test_malformed_answers_score_zero():
    for text in ["def add(a, b):\n    return a + b",  # no fence
                 "```python\ndef add(a, b):\n    return a + b\n",  # never closed
                 ""]:
        verdict = coding.check(ANSWER, text)
        assert (verdict.correct, verdict.outcome) == (0.0, "no-code"), text
        assert coding.reward(TASK, said(text)) == 0.0
    syntax = coding.check(ANSWER, block("def add(a, b)\n    return a + b"))
    assert (syntax.correct, syntax.outcome) == (0.0, "failed") and "SyntaxError" in syntax.reason
    # the last message a tool's, not an answer: no code to judge
    called = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "python", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": block("def add(a, b):\n    return a + b")}]
    assert coding.reward(TASK, TASK["messages"] + called) == 0.0


def test_unjudgeable_tasks_give_none():
    right = block("def add(a, b):\n    return a + b")
    for answer in ["not json", json.dumps({"tests": ""}), json.dumps([1, 2]),
                   json.dumps({"entry_point": "add"})]:
        assert coding.reward({**TASK, "answer": answer}, said(right)) is None
    with pytest.raises(ValueError, match="no reference solution"):
        coding.gold({**TASK, "answer": json.dumps({"tests": TESTS})})


def test_a_broken_sandbox_raises_not_zero(monkeypatch):
    # bubblewrap probed first, with the real interpreter: its answer is cached for the process,
    # and a first probe under the patch below cached "bwrap does not work here" for every later
    # test of this worker (test_sandbox's bwrap cases then skipped)
    sandbox.bwrap_problem()
    monkeypatch.setattr(sandbox, "interpreter", lambda: "/nonexistent/bin/python3")
    with pytest.raises(VerifierError, match="not an executable file"):
        coding.reward(TASK, TASK["messages"] + coding.gold(TASK))


def test_the_python_tool_answers_with_output_and_errors():
    assert coding.call_tool(TASK, "python", {"code": "print(2 + 3)"}) == "5\n"
    failed = coding.call_tool(TASK, "python", {"code": "print(1)\n1/0"})
    assert failed.startswith("error: failed: ZeroDivisionError: division by zero\n")
    long = coding.call_tool(TASK, "python", {"code": "print('x' * 5000)"})
    assert len(long) == coding.TOOL_OUTPUT_CHARS + 3 and long.endswith("...")


@pytest.mark.parametrize("path", SUITES, ids=lambda p: p.parent.name)
def test_task_files_gold_passes_and_a_stub_fails(path):
    tasks = contract.load_tasks(path, "code")
    assert len(tasks) >= 10 and len({t["task_id"] for t in tasks}) == len(tasks)

    def verdicts(task):
        entry = coding.parse_answer(task["answer"])["entry_point"]
        stub = block(f"def {entry}(*args, **kwargs):\n    return None")
        return (coding.check(task["answer"], coding.gold(task)[-1]["content"]),
                coding.check(task["answer"], stub))

    with ThreadPoolExecutor(4) as pool:
        for task, (gold, stub) in zip(tasks, pool.map(verdicts, tasks)):
            assert gold.correct == 1.0, (task["task_id"], gold)
            assert stub.correct == 0.0, (task["task_id"], stub)


def test_code_loads_as_an_environment_on_the_contract():
    """The benchmark's tasks through the contract: each gold passes its tests in the sandbox, a
    wrong final answer scores 0, the python tool runs code.
    """
    env = contract.load("code", "stages.envs.coding")
    assert env.tool_names == ["python"] and env.version == "unittest-sandbox@1"
    tasks = contract.load_tasks(REPO / "data/benchmarks/code.jsonl", env)
    assert len(tasks) == 10
    for task in tasks:
        assert [m["role"] for m in task["messages"]] == ["user"]
        assert contract.check_gold(env, task) == {"reward": 1.0}
    task = tasks[0]
    wrong = "```python\ndef multiply(a, b):\n    return a + b\n```"
    assert contract.score(env, task, said(wrong, task)) == {"reward": 0.0}
    assert contract.score(env, task, said("multiply is a * b", task)) == {"reward": 0.0}
    assert contract.call(env, task, "python", {"code": "print(6 * 7)"}) == ("42\n", None)
    output, why = contract.call(env, task, "python", {"code": "1/0"})
    assert why is None and output.startswith("error: ") and "ZeroDivisionError" in output
