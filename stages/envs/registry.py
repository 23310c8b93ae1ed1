"""The environments tasks run in, by the name `base.environment` gives in params.yaml.

A task is two strings: `question` (what the user asked; what `prompt()` turns into the model's
prompt) and `answer` (what the verifier needs: for arith the integer as text; for other
environments a JSON string, e.g. unit tests or a tool's schema and the expected call).

An environment is one module that defines:
- `NAME`, `VERSION` (the verifier's version, recorded with every score, e.g. "exact-match@2"),
  `TAGS`, `CHARS` (alphabet of the demo tokenizer; each tag is one token), `TOOL_CLOSE` (text after
  which the environment answers a tool call), `MAX_TURNS` (default turn limit: tool calls per
  episode).
- `prompt(question) -> str`; `on_tool_close(text) -> str` (text = the completion so far, ending
  with TOOL_CLOSE; returns the text to inject, e.g. `<result>1786</result>`).
- `verify(question, answer, completion) -> float | None`: correctness in [0, 1]; None = cannot
  judge (counted, dropped); raises `VerifierError` (or any exception) when the verifier or its
  infrastructure (sandbox, server) broke: that is an error with its cause, never a zero.
- `score(question, answer, completion) -> dict[str, float] | None`: all reward components; always
  has "correct" (== verify), "format" (1.0 if the completion follows the protocol: well-formed tool
  calls and a final answer) and "tool_ok" (1.0 if every tool call in it ran without a tool error;
  1.0 when there were none); more components may follow (kept as `score_<name>` columns). The
  reward is `sum(reward.weights[name] * component)` over `COMPONENTS`.
- `gold_completion(question, answer) -> str`: a completion that must score full marks (checked before
  scoring; a task whose gold does not is set aside and counted).
- `task_from_messages(messages, tools=None) -> {"question", "answer"} | None`: the task behind an
  OpenAI chat trace (`tools`: the trace's tool schemas, chat `tools` shape, which validate passes
  from the trace row), `messages_from_completion(user_text, completion, call_prefix)` and its
  inverse `completion_from_messages(messages) -> str | None` (the trace's answer in the model's
  text, None when it cannot be written so; the train stage's feedback pairs use it), `task_kind(question)`
  (for drift reports), and for the demo's simulated traffic and warm start
  `sample_question(rng, weights)`, `mix_for_day(day, shift)`, `demonstration(question, use_tool)`
  (an environment without a demo may raise NotImplementedError there).

That is the tag protocol, run when params.yaml's `environments:` is empty. `arith` and `code` also
define the contract of a user's own environment (`stages/envs/contract.py`), and the demo runs
arith that way, through the chat path; `toolcall` does not (its tools differ from task to task).

Add an environment by writing that module and naming it in ENVIRONMENTS below; then set
`base.environment: <name>` in params.yaml and put its task suite in `data/tasks/<name>.jsonl`
(see `load_tasks`).
"""

from __future__ import annotations

import json
from pathlib import Path

from stages.envs import arith, coding, toolcall
from stages.envs.errors import TaskFileError

ENVIRONMENTS = {"arith": arith, "code": coding, "toolcall": toolcall}

# The reward components every environment's score() returns; `reward.weights` may weight these.
COMPONENTS = ("correct", "format", "tool_ok")


def score_job(env_name: str, question: str, answer: str, completion: str | None
              ) -> tuple[dict | None, str | None]:
    """One verification (of the task's gold completion when `completion` is None):
    (components or None, None), or (None, the cause) when the verifier raised. Here, not in
    stages/reward.py, so that the reward stage's worker processes import only the environments.
    """
    env = ENVIRONMENTS[env_name]
    try:
        if completion is None:
            completion = env.gold_completion(question, answer)
        components = env.score(question, answer, completion)
    except Exception as err:  # the verifier broke: an error with its cause, never a zero
        return None, f"{type(err).__name__}: {err}"
    missing = [c for c in COMPONENTS if components is not None and c not in components]
    if missing:
        return None, f"VerifierError: {env.NAME}.score() returned no {', '.join(missing)}"
    return components, None


def score_chunk(env_name: str, jobs: list[tuple]) -> list[tuple[dict | None, str | None]]:
    """Score a chunk of jobs in one worker (see `score_job`)."""
    return [score_job(env_name, *job) for job in jobs]


def load_tasks(path: str | Path) -> list[dict]:
    """The tasks of a suite file, `data/tasks/<env>.jsonl`: one JSON object a line with `task_id`
    (or `id`), `question` (a string) and `answer` (a string; a number or a JSON object/list is
    turned into its JSON text, so suites can write the verifier's data unquoted). Blank lines are
    skipped. Raises TaskFileError naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        raise TaskFileError(f"{path}: task suite not found")
    tasks, seen = [], {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise TaskFileError(f"{where}: not valid JSON ({err.msg} at column {err.colno})"
                                    ) from None
            if not isinstance(row, dict):
                raise TaskFileError(f"{where}: expected a JSON object with task_id, question and "
                                    f"answer, got {type(row).__name__}")
            task_id = row.get("task_id", row.get("id"))
            if not isinstance(task_id, str) or not task_id:
                raise TaskFileError(f"{where}: missing 'task_id' (a non-empty string)")
            if task_id in seen:
                raise TaskFileError(f"{where}: task_id {task_id!r} repeats line {seen[task_id]}")
            seen[task_id] = number
            question, answer = row.get("question"), row.get("answer")
            if not isinstance(question, str) or not question:
                raise TaskFileError(f"{where}: 'question' must be a non-empty string")
            if answer is None or isinstance(answer, bool):
                raise TaskFileError(f"{where}: missing 'answer' (what the verifier needs)")
            if not isinstance(answer, str):
                answer = json.dumps(answer)
            tasks.append({"task_id": task_id, "question": question, "answer": answer})
    return tasks
