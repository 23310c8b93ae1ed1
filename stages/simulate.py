"""Production-like traffic for the demo: the champion answering a day of user requests.

Writes `data/inbox/traffic-NNN.jsonl` (day NNN = the number of traffic files already there) as
OpenAI chat JSONL: the user's request, the assistant's `calculator` tool calls and the tool's
replies, the final answer, and a user feedback field (thumbs up when the final answer is right,
on `simulate.feedback_rate` of the traces). The task mix shifts each day (`simulate.shift_per_day`,
from sums towards products). Like real logs it carries junk: a malformed line, an exact duplicate,
an e-mail address in a user message and a request with no task in it. Benchmark questions are
never asked, so the held-out suite stays held out.

The champion answers as the demo's cycles run it. With params.yaml listing the demo's environment
under `environments:` (the default), it is a chat model and each request is an episode of the chat
path (`stages.generation.chat.rollout`, as the rollout stage and the gate run it): its chat
template, its tool calls read by `rollout.tool_parser`, the calculator (`call_tool`) run on each,
greedy, `rollout.max_new_tokens` a turn; the trace is that conversation (the model's own text,
`answer:1786` included; its tool calls numbered `call-<day>-<trace>-<n>`). The request is the
expression (`47*38`), as the benchmark and the cycles' rollouts ask it: the demo's character model
reads no other symbols, and a log holds what the model was asked (the request with the e-mail
address too: the model reads its letters as unknown tokens). With `environments: {}` the champion
speaks the environment's tag protocol (`Q:47*38<calc>...`) and the trace is its episode written as
chat messages after the request in free text, which only the log holds.

    offseason simulate            # or: python -m stages.simulate models/champion data/inbox
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
from pathlib import Path

from stages import config as cfg
from stages import io, tinylm
from stages.envs.registry import ENVIRONMENTS
from stages.generation import transformers_backend

TEMPLATES = ["What is {q}?", "{q} = ?", "compute {q}", "Q: {q}", "how much is {q}",
             "Please work out {q} for me.", "{q}"]
EPOCH = dt.datetime(2026, 1, 1, 9, 0, tzinfo=dt.timezone.utc)


def next_day(inbox: Path) -> int:
    """The day number of the next traffic file in the inbox."""
    return len(list(inbox.glob("traffic-*.jsonl")))


def demo_environment(base: cfg.Base, specs: dict) -> str | None:
    """The name under `environments:` of the demo's environment (`base.environment`'s module):
    the chat path's traffic. None with `environments: {}` (the tag protocol's). Raises ParamsError
    when `environments:` lists only other modules: the demo's traffic is its arithmetic.
    """
    if not specs:
        return None
    module = ENVIRONMENTS[base.environment].__name__
    for name, spec in specs.items():
        if spec.module == module:
            return name
    raise cfg.ParamsError(f"environments: no entry has module {module} (base.environment), so "
                          f"there is no demo environment to simulate traffic for; offseason "
                          f"simulate writes the demo's arithmetic requests only (your own "
                          f"agent's traces come from `offseason collect` or `offseason pull`)")


def held_out(benchmark: Path, env) -> set[str]:
    """The questions of the benchmark file (its `question`, or its messages' question: a
    refreshed benchmark holds chat tasks only).
    """
    if not benchmark.exists():
        return set()
    out = set()
    for row in io.read_jsonl(benchmark):
        task = ({"question": row["question"]} if row.get("question")
                else env.task_from_messages(row.get("messages") or []))
        if task is not None:
            out.add(task["question"])
    return out


def tag_answers(champion: Path, env, questions: list[str], texts: list[str], seed: int,
                day: int) -> list[tuple[list[dict], bool]]:
    """(messages, right) per request: the champion on the tag protocol, its episode written as
    chat messages after the user's free text.
    """
    model, tokenizer = tinylm.load(champion)
    episodes = transformers_backend.generate(model, tokenizer, env,
                                             [env.prompt(q) for q in questions],
                                             temperature=0.0, max_new_tokens=48, seed=seed,
                                             batch_size=1024)
    return [(env.messages_from_completion(text, episode.completion, f"call-{day}-{i}"),
             env.verify(question, str(env.gold_answer(question)), episode.completion) == 1.0)
            for i, (question, text, episode) in enumerate(zip(questions, texts, episodes))]


def chat_answers(champion: Path, env, rollout: cfg.Rollout, tasks: list[dict], seed: int,
                 day: int) -> list[tuple[list[dict], bool]]:
    """(messages, right) per task: the champion's greedy episode on the chat path, right when the
    environment's reward gives it full marks.
    """
    from stages.envs import contract
    from stages.generation import chat

    model, tokenizer = tinylm.load(champion)
    model.eval()
    episodes = chat.greedy(model, tokenizer, env, tasks, rollout, seed)
    out = []
    for i, (task, episode) in enumerate(zip(tasks, episodes)):
        if episode.error:  # a broken tool: said, never logged as the agent's wrong answer
            raise RuntimeError(f"{env.where}, request {task['task_id']}: {episode.error}")
        out.append((numbered(episode.messages, f"call-{day}-{i}"),
                    contract.full_marks(contract.score(env, task, episode.messages))))
    return out


def numbered(messages: list[dict], prefix: str) -> list[dict]:
    """The conversation with its tool calls' ids unique in the log (`<prefix>-<n>`), as an API
    assigns them: the parser numbers each turn's calls from call_0.
    """
    ids, out, calls = {}, [], 0
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [dict(call) for call in message["tool_calls"]]
            for call in message["tool_calls"]:
                ids[call["id"]] = f"{prefix}-{calls}"
                call["id"] = ids[call["id"]]
                calls += 1
        elif message.get("role") == "tool" and message.get("tool_call_id") in ids:
            message["tool_call_id"] = ids[message["tool_call_id"]]
        out.append(message)
    return out


def run(base: cfg.Base, config: cfg.Simulate, champion: Path, inbox: Path, benchmark: Path,
        specs: dict | None = None, rollout: cfg.Rollout | None = None, root: Path | None = None
        ) -> dict:
    """Write one day of traffic to the inbox; returns what was written. `specs` (params.yaml's
    `environments:`), `rollout` and `root` (the project folder) put the champion on the chat path
    (`demo_environment`). `benchmark`: the held-out file whose questions are never asked (on the
    chat path the environment's own `benchmark`, which the gate scores).
    """
    tinylm.set_threads(base.threads)
    env = ENVIRONMENTS[base.environment]
    name = demo_environment(base, specs or {})
    inbox.mkdir(parents=True, exist_ok=True)
    day = next_day(inbox)
    rng = random.Random(base.seed * 100_003 + day)
    if name is not None and specs[name].benchmark:  # the gate's suite on the chat path
        benchmark = Path(root or Path.cwd()) / specs[name].benchmark
    asked = held_out(benchmark, env)
    weights = env.mix_for_day(day, config.shift_per_day)
    questions = []
    while len(questions) < config.traces_per_day:
        question = env.sample_question(rng, weights)
        if question not in asked:
            questions.append(question)
    if name is None:  # free text, which only the log holds: the model reads `Q:<question>`
        texts = [rng.choice(TEMPLATES).format(q=q.replace("*", rng.choice(["*", " * ", " x "])))
                 for q in questions]
    else:  # what the model reads, as the benchmark and the cycles' rollouts ask it
        texts = list(questions)
    if config.junk and texts:
        texts[1 % len(texts)] += " (reply to jane.doe@example.com)"  # PII for ingest to scrub
    if name is None:
        answers = tag_answers(champion, env, questions, texts, rng.randrange(2**31), day)
    else:
        from stages.envs import contract

        tasks = [{"task_id": f"tr-{day:03d}-{i:05d}",
                  "messages": [{"role": "user", "content": text}],
                  "answer": str(env.gold_answer(question))}
                 for i, (question, text) in enumerate(zip(questions, texts))]
        answers = chat_answers(champion, contract.load_spec(name, specs[name], root),
                               rollout or cfg.Rollout(), tasks, rng.randrange(2**31), day)
    lines = []
    for i, (messages, right) in enumerate(answers):
        record = {
            "id": f"tr-{day:03d}-{i:05d}",
            "created_at": (EPOCH + dt.timedelta(days=day, seconds=20 * i)).isoformat(),
            "model": "offseason-agent@champion",
            "messages": messages,
            "tools": [env.TOOL_SCHEMA],
        }
        if rng.random() < config.feedback_rate:
            record["feedback"] = {"thumbs_up": right}
        lines.append(json.dumps(record))
    if config.junk and lines:
        lines.append(lines[0])  # an exact duplicate, as retried log shippers produce
        lines.append(lines[-1][: len(lines[-1]) // 2])  # a line cut off mid-write
        lines.append(json.dumps({
            "id": f"tr-{day:03d}-chat", "created_at": EPOCH.isoformat(), "model": "x",
            "messages": [{"role": "user", "content": "hello! are you there?"},
                         {"role": "assistant", "content": "answer:?"}],
        }))  # small talk: no task an environment can verify
    path = inbox / f"traffic-{day:03d}.jsonl"
    io.write_text(path, "\n".join(lines) + "\n")
    return {"file": str(path), "day": day, "lines": len(lines), "traces": len(questions),
            "path": "tag" if name is None else "chat",
            "champion_correct": sum(right for _, right in answers) / max(1, len(questions)),
            "mix": weights}


def main(argv: list[str] | None = None) -> None:
    """Write a day of simulated traffic to the inbox (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("champion", type=Path, nargs="?", default=Path("models/champion"))
    parser.add_argument("inbox", type=Path, nargs="?", default=Path("data/inbox"))
    parser.add_argument("--benchmark", type=Path, default=Path("data/benchmarks/arith.jsonl"))
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    out = run(cfg.load("base", args.params), cfg.load("simulate", args.params), args.champion,
              args.inbox, args.benchmark, cfg.environments(args.params),
              cfg.load("rollout", args.params), Path(args.params).resolve().parent)
    print(json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    with io.explained("simulate"):
        main()
    io.exit_soon()
