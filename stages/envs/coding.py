r"""The "code" environment: write a Python function; verified by running unit tests in a sandbox.

A task is two strings. `question` is the statement ("Write a function add(a, b) that returns
a + b."); `answer` is JSON: {"tests": "<unittest source>", "entry_point": "add",
"solution": "<reference solution>"}. The tests import the candidate from the module `solution`
(`from solution import add`) and are plain `unittest.TestCase`s.

The protocol, in the model's text: the final code is the LAST fenced block opened with
```` ```python ```` and closed with ```` ``` ````. Before it the model may try code with the `<run>`
tool: `<run>print(add(2, 3))</run>` is answered with `<output>5\n</output>` (stdout, then stderr,
of the code run in the same sandbox, bounded; a run that failed starts with `error: <outcome>`).

    # Task: Write a function add(a, b) that returns a + b.
    <run>print(1 + 2)</run><output>3\n</output>```python
    def add(a, b):
        return a + b
    ```

verify: 1.0 when every test passes in the sandbox (`stages.envs.sandbox`), 0.0 when a test fails, the
code times out, hits a limit or crashes, or there is no code block; None when the task has no tests.
A broken sandbox raises `stages.envs.sandbox.SandboxError` (a `VerifierError`): never a zero.
`check()` gives the same verdict with the sandbox's reason, for the record.

    python -m stages.envs.coding --check data/tasks/code.jsonl data/benchmarks/code.jsonl
        # runs every task's reference solution against its tests: each must pass
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from stages.envs import contract, sandbox

NAME = "code"
VERSION = "unittest-sandbox@1"
FENCE_OPEN, FENCE_CLOSE = "```python", "```"
TOOL_OPEN, TOOL_CLOSE = "<run>", "</run>"
RESULT_OPEN, RESULT_CLOSE = "<output>", "</output>"
TOOL_NAME = "python"
TAGS = [FENCE_OPEN, FENCE_CLOSE, TOOL_OPEN, TOOL_CLOSE, RESULT_OPEN, RESULT_CLOSE]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII: the demo tokenizer's alphabet
_ALPHABET = frozenset(CHARS)
MAX_TURNS = 3
TOOL_OUTPUT_CHARS = 400  # what a `<run>` injects back, at most: the context of a small model is short
# the tests of one task and a `<run>` are small programs: keep a stuck one from holding a core long
TEST_LIMITS = sandbox.Limits(wall_seconds=10.0, cpu_seconds=5, memory_mb=512)
RUN_LIMITS = sandbox.Limits(wall_seconds=5.0, cpu_seconds=3, memory_mb=256)

_BLOCK = re.compile(re.escape(FENCE_OPEN) + r"[ \t]*\n?(.*?)" + re.escape(FENCE_CLOSE), re.DOTALL)
_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE)
                   + r"(?:" + re.escape(RESULT_OPEN) + r"(.*?)" + re.escape(RESULT_CLOSE) + r")?",
                   re.DOTALL)


@dataclass(frozen=True)
class Verdict:
    """A verification with its reason: correct is 1.0, 0.0 or None (cannot judge)."""

    correct: float | None
    outcome: str  # a sandbox outcome, or "no-code" / "no-tests"
    reason: str
    suspect: str = ""  # the sandbox's note of a likely reward hack (sandbox.Result.suspect)


def prompt(question: str) -> str:
    """The prompt the model completes for a task."""
    return f"# Task: {question}\n"


def code_block(completion: str) -> str | None:
    """The code of the last closed ```python block, or None when there is none."""
    blocks = _BLOCK.findall(_CALL.sub("", completion or ""))
    return blocks[-1] if blocks else None


def parse_answer(answer: str) -> dict:
    """The task's answer JSON as a dict ({} when it is not a JSON object)."""
    try:
        data = json.loads(answer) if isinstance(answer, str) else answer
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def check(question: str, answer: str, completion: str) -> Verdict:
    """The verdict and why; raises SandboxError when the sandbox itself broke."""
    tests = parse_answer(answer).get("tests")
    if not isinstance(tests, str) or not tests.strip():
        return Verdict(None, "no-tests", "the task has no unit tests")
    code = code_block(completion)
    if code is None:
        return Verdict(0.0, "no-code", f"no closed {FENCE_OPEN} ... {FENCE_CLOSE} block")
    result = sandbox.run_tests(code, tests, limits=TEST_LIMITS)
    return Verdict(1.0 if result.passed else 0.0, result.outcome, result.reason, result.suspect)


def verify(question: str, answer: str, completion: str) -> float | None:
    """1.0 if all the task's tests pass on the completion's code; 0.0 if not; None: no tests."""
    return check(question, answer, completion).correct


def tool_calls(completion: str) -> list[str]:
    """The code of the `<run>` tool calls in a completion, in order."""
    return [m[0] for m in _CALL.findall(completion)]


def score(question: str, answer: str, completion: str) -> contract.Scores | None:
    """correct; format (a final code block, every `<run>` answered); tool_ok (no run errored);
    the sandbox's `hack_suspected` note (`contract.Scores`).
    """
    verdict = check(question, answer, completion)
    if verdict.correct is None:
        return None
    outputs = [m[2] for m in _CALL.finditer(completion)]  # None: a call with no output after it
    answered = all(output is not None for output in outputs)
    return contract.Scores.of({
        "correct": verdict.correct,
        "format": 1.0 if code_block(completion) is not None and answered else 0.0,
        "tool_ok": 0.0 if any((o or "").startswith("error:") for o in outputs) else 1.0,
    }, verdict.suspect)


def gold_completion(question: str, answer: str) -> str:
    """The reference solution as a completion: scores 1.0 when the task is sound."""
    solution = parse_answer(answer).get("solution")
    if not isinstance(solution, str):
        raise ValueError(f"task {question[:60]!r} has no reference solution in its answer")
    return f"{FENCE_OPEN}\n{solution.rstrip()}\n{FENCE_CLOSE}"


def run_output(code: str) -> str:
    """What running `code` in the sandbox printed (stdout, then stderr), at most TOOL_OUTPUT_CHARS;
    a run that failed starts with `error: <outcome>: <reason>`. A broken sandbox raises.
    """
    result = sandbox.run_code(code, limits=RUN_LIMITS)
    output = result.stdout + result.stderr
    if not result.passed:
        output = f"error: {result.outcome}: {result.reason}\n" + output
    return output if len(output) <= TOOL_OUTPUT_CHARS else output[:TOOL_OUTPUT_CHARS] + "..."


def on_tool_close(text: str) -> str:
    """Run the code of the last `<run>` call in the sandbox; inject what it printed."""
    code = text.rsplit(TOOL_OPEN, 1)[-1].removesuffix(TOOL_CLOSE) if TOOL_OPEN in text else ""
    output = run_output(code)
    # the injected text must encode with the environment's alphabet; and must not close early
    output = "".join(c if c in _ALPHABET else "?" for c in output)
    return f"{RESULT_OPEN}{output.replace(RESULT_CLOSE, '')}{RESULT_CLOSE}"



def task_kind(question: str) -> str:
    """The task kind for drift profiles: always `code`."""
    return "code"


def task_from_messages(messages: list[dict], tools: list | None = None) -> dict | None:
    """None: a chat trace carries the request but not the unit tests a code task needs."""
    return None


def messages_from_completion(user_text: str, completion: str, call_prefix: str) -> list[dict]:
    """An episode as OpenAI chat messages: user, `python` tool calls and replies, the final code."""
    messages = [{"role": "user", "content": user_text}]
    pos = 0
    for i, match in enumerate(_CALL.finditer(completion)):
        call_id = f"{call_prefix}-{i}"
        messages.append({
            "role": "assistant",
            "content": completion[pos:match.start()] or None,
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": TOOL_NAME,
                                         "arguments": json.dumps({"code": match[1]})}}],
        })
        messages.append({"role": "tool", "tool_call_id": call_id, "content": match[2] or ""})
        pos = match.end()
    messages.append({"role": "assistant", "content": completion[pos:]})
    return messages


def completion_from_messages(messages: list[dict]) -> str | None:
    """None: chat traces give no code tasks (see `task_from_messages`), so no trace answer pairs."""
    return None


def _demo_only(*args, **kwargs):
    raise NotImplementedError("the code environment has no simulated traffic or warm start: its "
                              "tasks come from data/tasks/code.jsonl")


sample_question = mix_for_day = demonstration = _demo_only


# The contract of an environment (stages/envs/contract.py), so a chat model can be trained on code
# tasks through the chat path: `environments: {code: {module: stages.envs.coding, tasks:
# data/tasks/code.jsonl, benchmark: data/benchmarks/code.jsonl}}`. A task line carries both shapes:
# `id`/`question`/`answer` (the tag protocol) and `task_id`/`messages` (the chat path; the reward
# reads the tests from `answer`). The final code is the last ```python block of the last assistant
# message; the `python` tool runs code in the same sandbox as `<run>` does.
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME,
    "description": "Run Python code in a sandbox; returns what it printed (stdout, then stderr).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]


def call_tool(task: dict, name: str, arguments: dict) -> str:
    """`run_output` of the call's code. A broken sandbox raises SandboxError: an infrastructure
    failure, never an answer the agent sees.
    """
    return run_output(str(arguments.get("code", "")))


def _task_text(task: dict) -> tuple[str, str]:
    """A chat task's (question, answer JSON text), as the tag protocol's functions take them."""
    answer = task.get("answer")
    return str(task.get("question", "")), answer if isinstance(answer, str) else json.dumps(answer)


def reward(task: dict, messages: list[dict]) -> float | dict | None:
    """1.0 when every unit test passes on the last assistant message's last ```python block,
    0.0 when one fails or there is no block, None when the task has no tests; with the sandbox's
    `hack_suspected` reason beside it when the code touched the test framework.
    """
    last = messages[-1] if messages else {}
    final = str(last.get("content") or "") if last.get("role") == "assistant" else ""
    verdict = check(*_task_text(task), final)
    if verdict.suspect and verdict.correct is not None:
        return {"reward": verdict.correct, contract.HACK_SUSPECTED: verdict.suspect}
    return verdict.correct


def gold(task: dict) -> list[dict]:
    """The reference solution as the final answer."""
    return [{"role": "assistant", "content": gold_completion(*_task_text(task))}]


def load_tasks(path: Path) -> list[dict]:
    """Tasks from a JSONL suite; names the file and line of a malformed one."""
    tasks = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e})") from e
        missing = [k for k in ("id", "question", "answer") if not isinstance(row.get(k), str)]
        answer = parse_answer(row.get("answer", ""))
        missing += [f"answer.{k}" for k in ("tests", "entry_point", "solution")
                    if not isinstance(answer.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{number}: missing or not a string: {', '.join(missing)}")
        tasks.append(row)
    return tasks


def main(argv: list[str] | None = None) -> None:
    """Check task suites' reference solutions in the sandbox (the command line)."""
    parser = argparse.ArgumentParser(description="The Python coding environment: check task suites.")
    parser.add_argument("--check", type=Path, nargs="+", required=True, metavar="JSONL",
                        help="run each task's reference solution against its tests in the sandbox")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.check:
        tasks = load_tasks(path)
        for task in tasks:
            verdict = check(task["question"], task["answer"],
                           gold_completion(task["question"], task["answer"]))
            if verdict.correct != 1.0:
                bad += 1
                print(f"{path}: {task['id']}: reference solution {verdict.outcome}: {verdict.reason}")
        print(f"{path}: {len(tasks)} tasks checked")
    if bad:
        sys.exit(f"{bad} reference solutions do not pass their tests: fix those tasks")


if __name__ == "__main__":
    main()
