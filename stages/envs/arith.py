"""The demo environment: integer arithmetic that an agent may answer with a calculator tool.

An environment on the contract of a user's own (stages/envs/contract.py: `TOOLS`, `call_tool`,
`reward`, `gold`, `task_from_trace`): params.yaml lists it under `environments:` and the demo's
tiny chat model (stages/tinylm.py, its chat template of the Hermes shape) plays it through the chat
path. A task is `{"task_id", "messages": [{"role": "user", "content": "47*38"}], "answer": "1786"}`;
one episode, as the template renders it (each tag one token of the demo tokenizer):

    <|user|>47*38<|assistant|><tool_call>{"name": "calculator", "arguments": {"expression":
    "47*38"}}</tool_call><eos><tool_response>1786</tool_response><|assistant|>answer:1786<eos>

The calculator evaluates `a OP b` (`?` for anything else); the reward is an exact integer match of
the final answer against the task's. A tiny model cannot multiply three-digit numbers in its head
but can learn to copy into and out of the tool, so tool use visibly pays off. In production traces
the same episode is the user's question, an assistant message with a `calculator` tool call, the
tool's reply and the final answer: `task_from_trace` finds the question in the user's free text.

This module is pure Python (no torch), so ingestion and validation stay light.
    python -m stages.envs.arith --write-benchmark data/benchmarks/arith.jsonl   # the held-out suite
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

NAME = "arith"
VERSION = "exact-match@2"  # 2: the answer comes from the task, not recomputed from the question
MAX_TURNS = 4  # calculator calls per episode
ANSWER = "answer:"
TOOL_NAME = "calculator"
CHARS = list("0123456789+-*?")  # the demo tokenizer's alphabet
OPS = "+-*"
# The fixed parts of a calculator call in the Hermes JSON the chat template writes, one token each
# in the demo's chat tokenizer (stages/tinylm.py, `build_tokenizer`), and the answer's own prefix:
# its first token is then the choice between calling and answering, which is what lets one cycle
# teach the model to call when it pays (DEMO-NOTES)
CHAT_TOKENS = ['{"name": "calculator", "arguments": {"expression": "', '"}}', ANSWER]
TOOLS = [{
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate one integer expression a OP b with OP in + - *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}]

_EXPR = re.compile(r"(-?\d{1,6})\s*([+\-*x×])\s*(-?\d{1,6})")


def evaluate(expression: str) -> int | None:
    """The calculator: `a OP b` with integers; None for anything else (never eval())."""
    match = re.fullmatch(r"\s*(-?\d{1,6})\s*([+\-*])\s*(-?\d{1,6})\s*", expression)
    if not match:
        return None
    a, op, b = int(match[1]), match[2], int(match[3])
    return a + b if op == "+" else a - b if op == "-" else a * b


def tool_result(expression: str) -> str:
    """What the calculator tool answers for an expression (`?` if it cannot)."""
    value = evaluate(expression)
    return "?" if value is None else str(value)


def mix_for_day(day: int, shift: float) -> list[float]:
    """Weights of (+, -, *) on a given day: traffic drifts from sums towards products."""
    start, end = [0.5, 0.35, 0.15], [0.2, 0.2, 0.6]
    t = min(1.0, max(0.0, day * shift))
    return [s + (e - s) * t for s, e in zip(start, end)]


def sample_question(rng: random.Random, weights: list[float] | None = None) -> str:
    """A random question `a<op>b`, the operators drawn with `weights`."""
    op = rng.choices(OPS, weights=weights or [1, 1, 1])[0]
    a, b = (rng.randint(0, 10 ** rng.randint(1, 3) - 1) for _ in range(2))
    return f"{a}{op}{b}"


def question_from_text(text: str) -> str | None:
    """The expression a user asked about, from free text ('what is 47 * 38?'); None if there is none."""
    match = _EXPR.search(text or "")
    if not match:
        return None
    op = "*" if match[2] in "x×" else match[2]
    return f"{int(match[1])}{op}{int(match[3])}"


def gold_answer(question: str) -> int | None:
    """The right answer to a question, or None if it has none."""
    return evaluate(question)


def _gold(answer) -> int | None:
    text = str(answer).strip() if answer is not None else ""
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def question_of(messages: list[dict]) -> str | None:
    """The arithmetic question of a conversation's first user message; None when it asks none."""
    user = next((m for m in messages if m.get("role") == "user"), None)
    return None if user is None else question_from_text(str(user.get("content") or ""))


def chat_task(question: str) -> dict:
    """The task of a question, as the chat path holds it (without its task_id)."""
    return {"messages": [{"role": "user", "content": question}],
            "answer": str(gold_answer(question))}


def call_tool(task: dict, name: str, arguments: dict) -> str:
    """The calculator: the value of `arguments["expression"]`, or `?` (in the demo model's
    alphabet) when it is not `a OP b`.
    """
    return tool_result(str(arguments.get("expression", "")))


_FINAL = re.compile(r"(?:" + re.escape(ANSWER) + r")?\s*(-?\d+)")


def reward(task: dict, messages: list[dict]) -> float | None:
    """1.0 when the episode's last message is an assistant answer, without a tool call, that is
    exactly the task's integer answer (`answer:1786`, as the demo writes it, or `1786`, as a
    production trace does); 0.0 otherwise; None when the task has no integer answer.
    """
    gold_value = _gold(task.get("answer"))
    if gold_value is None:
        return None
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return 0.0
    final = _FINAL.fullmatch(str(last.get("content") or "").strip())
    return 1.0 if final and int(final[1]) == gold_value else 0.0


def chat_demonstration(question: str, use_tool: bool) -> list[dict]:
    """A correct answer as chat messages, with or without a calculator call."""
    value = gold_answer(question)
    if not use_tool:
        return [{"role": "assistant", "content": f"{ANSWER}{value}"}]
    call = {"id": "call_0", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": question})}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(value)},
            {"role": "assistant", "content": f"{ANSWER}{value}"}]


def gold(task: dict) -> list[dict]:
    """The calculator called on the question, then its value as the answer."""
    return chat_demonstration(str(task["messages"][-1]["content"]), use_tool=True)


def task_from_trace(messages: list[dict], tools: list[dict] | None = None) -> dict | None:
    """The task behind a trace: its question (`question_of`, from the user's free text) as the
    user turn, its answer computed (the calculator's own arithmetic, not the logged answer, which
    may be wrong); None when it asks none.
    """
    question = question_of(messages)
    return None if question is None else chat_task(question)


def write_benchmark(path: Path, size: int = 200, seed: int = 1234) -> None:
    """The held-out suite: uniform over operations and operand sizes, fixed by its seed."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < size:
        question = sample_question(rng)
        if question not in seen:
            seen.add(question)
            rows.append({"task_id": f"{NAME}-{len(rows):04d}", **chat_task(question)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    """Write the held-out benchmark (the command line)."""
    parser = argparse.ArgumentParser(description="The arithmetic demo environment.")
    parser.add_argument("--write-benchmark", type=Path, required=True,
                        help="write the 200-item held-out benchmark (seed 1234) to this JSONL file")
    args = parser.parse_args(argv)
    write_benchmark(args.write_benchmark)


if __name__ == "__main__":
    main()
