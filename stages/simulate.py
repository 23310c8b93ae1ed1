"""Production-like traffic for the demo: the champion answering a day of user requests.

Reads `models/champion` and params.yaml (the demo's environment, `stages.envs.arith`, and
`simulate.*`); writes `data/inbox/traffic-NNN.jsonl` as OpenAI chat JSONL: the champion answers
each request through the chat path (greedy, its calculator tool calls run), with user feedback
on `simulate.feedback_rate` of the traces, a task mix that shifts each day and some junk, as real
logs carry. Benchmark questions are never asked.

    offseason simulate            # or: python -m stages.simulate models/champion data/inbox

Details: docs/demo.md, "How the demo's traffic is made (stages/simulate.py)".
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
from stages.envs import arith, contract

EPOCH = dt.datetime(2026, 1, 1, 9, 0, tzinfo=dt.timezone.utc)


def next_day(inbox: Path) -> int:
    """The day number of the next traffic file in the inbox."""
    return len(list(inbox.glob("traffic-*.jsonl")))


def demo_environment(specs: dict) -> str:
    """The name under `environments:` of the demo's environment (module `stages.envs.arith`).
    Raises ParamsError when `environments:` lists only other modules: the demo's traffic is its
    arithmetic.
    """
    for name, spec in specs.items():
        if spec.module == arith.__name__:
            return name
    raise cfg.ParamsError(f"environments: no entry has module {arith.__name__}, so there is no "
                          f"demo environment to simulate traffic for; offseason simulate writes "
                          f"the demo's arithmetic requests only (your own agent's traces come "
                          f"from `offseason collect` or `offseason pull`)")


def held_out(benchmark: Path, name: str) -> set[str]:
    """The questions of the benchmark file of the demo's environment `name`."""
    if not benchmark.exists():
        return set()
    return {arith.question_of(task["messages"]) for task in contract.load_tasks(benchmark, name)}


def chat_answers(champion: Path, env, rollout: cfg.Rollout, tasks: list[dict], seed: int,
                 day: int) -> list[tuple[list[dict], bool]]:
    """(messages, right) per task: the champion's greedy episode on the chat path, right when the
    environment's reward gives it full marks.
    """
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


def run(base: cfg.Base, config: cfg.Simulate, champion: Path, inbox: Path, specs: dict,
        rollout: cfg.Rollout, root: Path | None = None) -> dict:
    """Write one day of traffic to the inbox; returns what was written. `specs` (params.yaml's
    `environments:`, its modules under `root`) name the demo's environment (`demo_environment`),
    whose `benchmark` questions are never asked; `rollout` says how the champion plays.
    """
    tinylm.set_threads(base.threads)
    root = Path(root or Path.cwd())
    name = demo_environment(specs)
    inbox.mkdir(parents=True, exist_ok=True)
    day = next_day(inbox)
    rng = random.Random(base.seed * 100_003 + day)
    asked = held_out(root / specs[name].benchmark, name) if specs[name].benchmark else set()
    weights = arith.mix_for_day(day, config.shift_per_day)
    questions = []
    while len(questions) < config.traces_per_day:
        question = arith.sample_question(rng, weights)
        if question not in asked:
            questions.append(question)
    texts = list(questions)  # what the model reads, as the benchmark and the rollouts ask it
    if config.junk and texts:
        texts[1 % len(texts)] += " (reply to jane.doe@example.com)"  # PII for ingest to scrub
    tasks = [{"task_id": f"tr-{day:03d}-{i:05d}", "messages": [{"role": "user", "content": text}],
              "answer": str(arith.gold_answer(question))}
             for i, (question, text) in enumerate(zip(questions, texts))]
    answers = chat_answers(champion, contract.load_spec(name, specs[name], root), rollout, tasks,
                           rng.randrange(2**31), day)
    lines = []
    for i, (messages, right) in enumerate(answers):
        record = {
            "id": f"tr-{day:03d}-{i:05d}",
            "created_at": (EPOCH + dt.timedelta(days=day, seconds=20 * i)).isoformat(),
            "model": "offseason-agent@champion",
            "messages": messages,
            "tools": arith.TOOLS,
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
            "champion_correct": sum(right for _, right in answers) / max(1, len(questions)),
            "mix": weights}


def main(argv: list[str] | None = None) -> None:
    """Write a day of simulated traffic to the inbox (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("champion", type=Path, nargs="?", default=Path("models/champion"))
    parser.add_argument("inbox", type=Path, nargs="?", default=Path("data/inbox"))
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    out = run(cfg.load("base", args.params), cfg.load("simulate", args.params), args.champion,
              args.inbox, cfg.environments(args.params), cfg.load("rollout", args.params),
              Path(args.params).resolve().parent)
    print(json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    with io.explained("simulate"):
        main()
    io.exit_soon()
