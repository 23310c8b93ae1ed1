"""The demo environment: integer arithmetic that an agent may answer with a calculator tool.

One episode, in the model's own text (each tag is a single token of the demo tokenizer):

    Q:47*38<calc>47*38</calc><result>1786</result>answer:1786<eos>

The agent writes `<calc>EXPR</calc>`; the environment evaluates EXPR and injects
`<result>VALUE</result>`; the agent then writes `answer:VALUE`. A tiny model cannot multiply
three-digit numbers in its head but can learn to copy into and out of the tool, so tool use visibly
pays off. A task's `answer` is the integer as text; verification is an exact integer match against
it. `score` adds `format` (every `<calc>` closed and answered, and a final integer answer) and
`tool_ok` (no calculator call came back `?`).

In production traces the same episode is OpenAI chat messages: the user's question, an assistant
message with a `calculator` tool call, the tool's reply, and the assistant's final answer.
`task_from_messages`, `messages_from_completion` and `completion_from_messages` translate between
the two.

The same module is an environment on the contract of a user's own (stages/envs/contract.py:
`TOOLS`, `call_tool`, `reward`, `gold`, `task_from_trace`), which is how the demo runs: params.yaml
lists it under `environments:` and the demo model, with its Hermes-shaped chat template
(stages/tinylm.py), plays it through the chat path. A task there is `{"task_id", "messages":
[{"role": "user", "content": "47*38"}], "answer": "1786"}`; one episode, as the template renders it:

    <|user|>47*38<|assistant|><tool_call>{"name": "calculator", "arguments": {"expression":
    "47*38"}}</tool_call><eos><tool_response>1786</tool_response><|assistant|>answer:1786<eos>

The held-out benchmark carries both shapes in each line (`id`/`question` and `task_id`/`messages`).

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
QUESTION, ANSWER = "Q:", "answer:"
TOOL_OPEN, TOOL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
TOOL_NAME = "calculator"
TAGS = [QUESTION, ANSWER, TOOL_OPEN, TOOL_CLOSE, RESULT_OPEN, RESULT_CLOSE]
CHARS = list("0123456789+-*?")
OPS = "+-*"
# The fixed parts of a calculator call in the Hermes JSON the chat template writes, one token each
# in the demo's chat tokenizer (stages/tinylm.py, `build_tokenizer(env, chat=True)`), and the
# answer's own prefix: its first token is then the choice between calling and answering, as in the
# tag protocol, which is what lets one cycle teach the model to call when it pays (DEMO-NOTES)
CHAT_TOKENS = ['{"name": "calculator", "arguments": {"expression": "', '"}}', ANSWER]
TOOL_SCHEMA = {
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
}

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


def task_kind(question: str) -> str:
    """The task's category, for the drift report: which operation it asks for."""
    return {"+": "sum", "-": "difference", "*": "product"}.get(
        next((c for c in question[1:] if c in OPS), ""), "other")


def gold_answer(question: str) -> int | None:
    """The right answer to a question, or None if it has none."""
    return evaluate(question)


def prompt(question: str) -> str:
    """The prompt the model completes for a question."""
    return f"{QUESTION}{question}"


def demonstration(question: str, use_tool: bool) -> str:
    """A correct completion, with or without the tool (for the warm start)."""
    answer = gold_answer(question)
    if use_tool:
        return f"{TOOL_OPEN}{question}{TOOL_CLOSE}{RESULT_OPEN}{answer}{RESULT_CLOSE}{ANSWER}{answer}"
    return f"{ANSWER}{answer}"


def on_tool_close(text: str) -> str:
    """What the environment injects after the agent closed a tool call in `text`."""
    expression = text.rsplit(TOOL_OPEN, 1)[-1].removesuffix(TOOL_CLOSE) if TOOL_OPEN in text else ""
    return f"{RESULT_OPEN}{tool_result(expression)}{RESULT_CLOSE}"


def final_answer(completion: str) -> str | None:
    """The text after the last `answer:` tag, or None if the agent never answered."""
    if ANSWER not in completion:
        return None
    return completion.rsplit(ANSWER, 1)[-1].strip()


def _gold(answer) -> int | None:
    text = str(answer).strip() if answer is not None else ""
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def verify(question: str, answer: str, completion: str) -> float | None:
    """1.0 if the final answer is exactly `answer`, 0.0 if wrong or missing, None if the task has
    no integer answer (cannot judge).
    """
    gold = _gold(answer)
    if gold is None:
        return None
    final = final_answer(completion)
    if final is None or not re.fullmatch(r"-?\d+", final):
        return 0.0
    return 1.0 if int(final) == gold else 0.0


_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE) + r"(?:"
                   + re.escape(RESULT_OPEN) + r"(.*?)" + re.escape(RESULT_CLOSE) + r")?", re.S)


def score(question: str, answer: str, completion: str) -> dict[str, float] | None:
    """The reward components: `correct` (== verify), `format` (every call closed and answered,
    then `answer:` and an integer) and `tool_ok` (no call came back `?`); None if unjudgeable.
    """
    correct = verify(question, answer, completion)
    if correct is None:
        return None
    calls = _CALL.findall(completion)
    rest = _CALL.sub("", completion)
    final = final_answer(rest)
    well_formed = (TOOL_OPEN not in rest and TOOL_CLOSE not in rest and RESULT_OPEN not in rest
                   and all(result != "" for _, result in calls)
                   and final is not None and re.fullmatch(r"-?\d+", final) is not None)
    tool_ok = all(evaluate(expr) is not None for expr, _ in calls)
    return {"correct": correct, "format": float(well_formed), "tool_ok": float(tool_ok)}


def gold_completion(question: str, answer: str) -> str:
    """A completion that must score full marks: the final answer, no tool."""
    return f"{ANSWER}{answer}"


def tool_calls(completion: str) -> list[str]:
    """The expressions of the tool calls in a completion, in order."""
    return re.findall(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), completion)


def messages_from_completion(user_text: str, completion: str, call_prefix: str) -> list[dict]:
    """An episode as OpenAI chat messages: user, assistant tool calls, tool replies, final answer."""
    messages = [{"role": "user", "content": user_text}]
    pattern = re.compile(
        re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE)
        + r"(?:" + re.escape(RESULT_OPEN) + r"(.*?)" + re.escape(RESULT_CLOSE) + r")?"
    )
    pos = 0
    for i, match in enumerate(pattern.finditer(completion)):
        call_id = f"{call_prefix}-{i}"
        messages.append({
            "role": "assistant",
            "content": completion[pos:match.start()] or None,
            "tool_calls": [{
                "id": call_id,
                "type": "function",
                "function": {"name": TOOL_NAME,
                             "arguments": json.dumps({"expression": match[1]})},
            }],
        })
        messages.append({"role": "tool", "tool_call_id": call_id, "content": match[2] or ""})
        pos = match.end()
    rest = completion[pos:]
    answer = final_answer(rest)
    messages.append({"role": "assistant", "content": answer if answer is not None else rest})
    return messages


def _arguments(call: dict) -> dict:
    arguments = (call.get("function") or {}).get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def completion_from_messages(messages: list[dict]) -> str | None:
    """The trace's answer in the model's text: the inverse of `messages_from_completion`.

    Everything after the first user message: each calculator call as `<calc>EXPR</calc>` followed by
    the tool's reply as `<result>VALUE</result>`, then `answer:N` from the final assistant message.
    None when the trace cannot be written in the model's alphabet (another user turn, another tool,
    a call without a reply, a final answer that is not an integer): such a trace gives no pair.
    """
    start = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if start is None:
        return None
    replies = {m.get("tool_call_id"): m.get("content") for m in messages[start + 1:]
               if m.get("role") == "tool"}
    text, final = "", None
    for message in messages[start + 1:]:
        role, content = message.get("role"), message.get("content")
        if role == "tool":
            continue
        if role != "assistant" or final is not None:
            return None  # a second user turn, or text after the final answer
        calls = message.get("tool_calls") or []
        if not calls:
            final = str(content or "").strip()
            continue
        text += content or ""
        for call in calls:
            expression = re.sub(r"\s+", "", str(_arguments(call).get("expression", "")))
            reply = replies.get(call.get("id"))
            if (call.get("function") or {}).get("name") != TOOL_NAME or reply is None:
                return None
            text += (f"{TOOL_OPEN}{expression}{TOOL_CLOSE}"
                     f"{RESULT_OPEN}{str(reply).strip()}{RESULT_CLOSE}")
    if final is None or not re.fullmatch(r"-?\d+", final):
        return None
    text += f"{ANSWER}{final}"
    plain = text
    for tag in TAGS:
        plain = plain.replace(tag, "")
    return text if all(c in CHARS for c in plain) else None


def task_from_messages(messages: list[dict], tools: list[dict] | None = None) -> dict | None:
    """The task behind a trace: the first user message's arithmetic question, or None.

    The answer is computed from the question (the calculator's own arithmetic), not taken from
    the trace, whose answer may be wrong; `tools` is not needed here.
    """
    for message in messages:
        if message.get("role") == "user":
            question = question_from_text(str(message.get("content") or ""))
            if question is None:
                return None
            return {"question": question, "answer": str(gold_answer(question))}
    return None


# The contract of an environment (stages/envs/contract.py): what the chat path runs, as it runs a
# user's own module. A task: {"task_id", "messages": [the user's question], "answer": "<int>"}.
TOOLS = [TOOL_SCHEMA]


def chat_task(question: str) -> dict:
    """The task of a question, as the chat path holds it (without its task_id)."""
    return {"messages": [{"role": "user", "content": question}],
            "answer": str(gold_answer(question))}


def call_tool(task: dict, name: str, arguments: dict) -> str:
    """The calculator: the value of `arguments["expression"]`, or `?` (in the demo model's
    alphabet, as the tag protocol answers) when it is not `a OP b`.
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
    """The chat task behind a trace (see `task_from_messages`): its question as the user turn."""
    task = task_from_messages(messages, tools)
    return None if task is None else chat_task(task["question"])


def write_benchmark(path: Path, size: int = 200, seed: int = 1234) -> None:
    """The held-out suite: uniform over operations and operand sizes, fixed by its seed."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < size:
        question = sample_question(rng)
        if question not in seen:
            seen.add(question)
            task_id = f"{NAME}-{len(rows):04d}"  # `id` for the tag path, `task_id` for chat
            rows.append({"id": task_id, "task_id": task_id, "question": question,
                         "answer": gold_answer(question),
                         "messages": chat_task(question)["messages"]})
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
