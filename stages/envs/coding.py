r"""The "code" environment: write a Python function; verified by running unit tests in a sandbox.

An environment on the contract (stages/envs/contract.py): `environments: {code: {module:
stages.envs.coding, tasks: data/tasks/code.jsonl, benchmark: data/benchmarks/code.jsonl}}`.
Reads tasks whose `answer` holds `tests`, `entry_point` and a reference `solution`; writes nothing.
The final code is the last fenced python block of the last assistant message; before it the
`python` tool runs code in the same sandbox. reward: 1.0 when every test passes in the sandbox
(`stages.envs.sandbox`), else 0.0; a broken sandbox raises `SandboxError`, never a zero.

    python -m stages.envs.coding --check data/tasks/code.jsonl data/benchmarks/code.jsonl
        # runs every task's reference solution against its tests: each must pass

Details: docs/environments.md, "How the code environment works (stages/envs/coding.py)".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from stages.envs import contract, sandbox

VERSION = "unittest-sandbox@1"
FENCE_OPEN, FENCE_CLOSE = "```python", "```"
TOOL_NAME = "python"
MAX_TURNS = 3
TOOL_OUTPUT_CHARS = 400  # what a run answers, at most: the context of a small model is short
# the tests of one task and a run are small programs: keep a stuck one from holding a core long
TEST_LIMITS = sandbox.Limits(wall_seconds=10.0, cpu_seconds=5, memory_mb=512)
RUN_LIMITS = sandbox.Limits(wall_seconds=5.0, cpu_seconds=3, memory_mb=256)

_BLOCK = re.compile(re.escape(FENCE_OPEN) + r"[ \t]*\n?(.*?)" + re.escape(FENCE_CLOSE), re.DOTALL)
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME,
    "description": "Run Python code in a sandbox; returns what it printed (stdout, then stderr).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]


@dataclass(frozen=True)
class Verdict:
    """A verification with its reason: correct is 1.0, 0.0 or None (cannot judge)."""

    correct: float | None
    outcome: str  # a sandbox outcome, or "no-code" / "no-tests"
    reason: str
    suspect: str = ""  # the sandbox's note of a likely reward hack (sandbox.Result.suspect)


def code_block(text: str) -> str | None:
    """The code of the last closed ```python block, or None when there is none."""
    blocks = _BLOCK.findall(text or "")
    return blocks[-1] if blocks else None


def parse_answer(answer) -> dict:
    """A task's answer (its JSON text, or the object) as a dict ({} when it is not one)."""
    try:
        data = json.loads(answer) if isinstance(answer, str) else answer
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def check(answer, text: str) -> Verdict:
    """The verdict on the code of `text` against the task's tests (its `answer`) and why;
    raises SandboxError when the sandbox itself broke.
    """
    tests = parse_answer(answer).get("tests")
    if not isinstance(tests, str) or not tests.strip():
        return Verdict(None, "no-tests", "the task has no unit tests")
    code = code_block(text)
    if code is None:
        return Verdict(0.0, "no-code", f"no closed {FENCE_OPEN} ... {FENCE_CLOSE} block")
    result = sandbox.run_tests(code, tests, limits=TEST_LIMITS)
    return Verdict(1.0 if result.passed else 0.0, result.outcome, result.reason, result.suspect)


def run_output(code: str) -> str:
    """What running `code` in the sandbox printed (stdout, then stderr), at most TOOL_OUTPUT_CHARS;
    a run that failed starts with `error: <outcome>: <reason>`. A broken sandbox raises.
    """
    result = sandbox.run_code(code, limits=RUN_LIMITS)
    output = result.stdout + result.stderr
    if not result.passed:
        output = f"error: {result.outcome}: {result.reason}\n" + output
    return output if len(output) <= TOOL_OUTPUT_CHARS else output[:TOOL_OUTPUT_CHARS] + "..."


def call_tool(task: dict, name: str, arguments: dict) -> str:
    """`run_output` of the call's code. A broken sandbox raises SandboxError: an infrastructure
    failure, never an answer the agent sees.
    """
    return run_output(str(arguments.get("code", "")))


def reward(task: dict, messages: list[dict]) -> float | dict | None:
    """1.0 when every unit test passes on the last assistant message's last ```python block,
    0.0 when one fails or there is no block, None when the task has no tests; with the sandbox's
    `hack_suspected` reason beside it when the code touched the test framework.
    """
    last = messages[-1] if messages else {}
    final = str(last.get("content") or "") if last.get("role") == "assistant" else ""
    verdict = check(task.get("answer"), final)
    if verdict.suspect and verdict.correct is not None:
        return {"reward": verdict.correct, contract.HACK_SUSPECTED: verdict.suspect}
    return verdict.correct


def gold(task: dict) -> list[dict]:
    """The reference solution as the final answer."""
    solution = parse_answer(task.get("answer")).get("solution")
    if not isinstance(solution, str):
        raise ValueError(f"task {task.get('task_id')!r} has no reference solution in its answer")
    return [{"role": "assistant", "content": f"{FENCE_OPEN}\n{solution.rstrip()}\n{FENCE_CLOSE}"}]


def main(argv: list[str] | None = None) -> None:
    """Check task files' reference solutions in the sandbox (the command line)."""
    parser = argparse.ArgumentParser(description="The Python coding environment: check task files.")
    parser.add_argument("--check", type=Path, nargs="+", required=True, metavar="JSONL",
                        help="run each task's reference solution against its tests in the sandbox")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.check:
        tasks = contract.load_tasks(path, "code")
        for task in tasks:
            verdict = check(task["answer"], gold(task)[-1]["content"])
            if verdict.correct != 1.0:
                bad += 1
                print(f"{path}: {task['task_id']}: reference solution {verdict.outcome}: "
                      f"{verdict.reason}")
        print(f"{path}: {len(tasks)} tasks checked")
    if bad:
        sys.exit(f"{bad} reference solutions do not pass their tests: fix those tasks")


if __name__ == "__main__":
    main()
