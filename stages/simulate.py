"""Production-like traffic for the demo: the champion answering a day of user requests.

Writes `data/inbox/traffic-NNN.jsonl` (day NNN = the number of traffic files already there) as
OpenAI chat JSONL: the user's request in free text, the assistant's `calculator` tool calls and the
tool's replies, the final answer, and a user feedback field. The task mix shifts each day
(`simulate.shift_per_day`, from sums towards products). Like real logs it carries junk: a malformed
line, an exact duplicate, an e-mail address in a user message and a request with no task in it.
Benchmark questions are never asked, so the held-out suite stays held out.

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


def run(base: cfg.Base, config: cfg.Simulate, champion: Path, inbox: Path, benchmark: Path
        ) -> dict:
    """Write one day of traffic to the inbox; returns what was written."""
    tinylm.set_threads(base.threads)
    env = ENVIRONMENTS[base.environment]
    inbox.mkdir(parents=True, exist_ok=True)
    day = next_day(inbox)
    rng = random.Random(base.seed * 100_003 + day)
    held_out = {row["question"] for row in io.read_jsonl(benchmark)} if benchmark.exists() else set()
    weights = env.mix_for_day(day, config.shift_per_day)
    questions = []
    while len(questions) < config.traces_per_day:
        question = env.sample_question(rng, weights)
        if question not in held_out:
            questions.append(question)
    texts = [rng.choice(TEMPLATES).format(q=q.replace("*", rng.choice(["*", " * ", " x "])))
             for q in questions]
    model, tokenizer = tinylm.load(champion)
    episodes = transformers_backend.generate(model, tokenizer, env, [env.prompt(q) for q in questions],
                                 temperature=0.0, max_new_tokens=48, seed=rng.randrange(2**31),
                                 batch_size=1024)
    lines, correct = [], 0
    for i, (question, text, episode) in enumerate(zip(questions, texts, episodes)):
        score = env.verify(question, str(env.gold_answer(question)), episode.completion)
        correct += score == 1.0
        record = {
            "id": f"tr-{day:03d}-{i:05d}",
            "created_at": (EPOCH + dt.timedelta(days=day, seconds=20 * i)).isoformat(),
            "model": "offseason-agent@champion",
            "messages": env.messages_from_completion(text, episode.completion, f"call-{day}-{i}"),
            "tools": [env.TOOL_SCHEMA],
        }
        if rng.random() < config.feedback_rate:
            record["feedback"] = {"thumbs_up": score == 1.0}
        lines.append(json.dumps(record))
    if config.junk and lines:
        with_email = json.loads(lines[1 % len(lines)])
        with_email["messages"][0]["content"] += " (reply to jane.doe@example.com)"
        lines[1 % len(lines)] = json.dumps(with_email)
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
            "champion_correct": correct / max(1, len(questions)), "mix": weights}


def main(argv: list[str] | None = None) -> None:
    """Write a day of simulated traffic to the inbox (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("champion", type=Path, nargs="?", default=Path("models/champion"))
    parser.add_argument("inbox", type=Path, nargs="?", default=Path("data/inbox"))
    parser.add_argument("--benchmark", type=Path, default=Path("data/benchmarks/arith.jsonl"))
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    out = run(cfg.load("base", args.params), cfg.load("simulate", args.params), args.champion,
              args.inbox, args.benchmark)
    print(json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    main()
