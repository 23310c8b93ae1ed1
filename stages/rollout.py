"""Rollout: the champion re-attempts the tasks of the validated traces, several samples each.

Reads `data/validated.parquet` (one task per trace: `question`, `answer`) and `models/champion`.
Each task is attempted `rollout.samples_per_task` times at `rollout.temperature`, multi-turn: the
environment answers each tool call and the model goes on. Writes `data/rollouts.parquet` (one row
per episode: task, completion, token ids, which tokens the model chose, their log-probabilities) and
`metrics/rollout.json`. Seeded by `base.seed`, so a rerun gives the same episodes.

    python -m stages.rollout data/validated.parquet models/champion data/rollouts.parquet metrics/rollout.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import generate, io, tinylm
from stages.environments import ENVIRONMENTS

SCHEMA = pa.schema([
    ("task_id", pa.string()), ("trace_id", pa.string()), ("sample", pa.int64()),
    ("question", pa.string()), ("answer", pa.string()), ("prompt", pa.string()),
    ("completion", pa.string()), ("token_ids", pa.list_(pa.int32())),
    ("model_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float32())),
    ("finish", pa.string()), ("tool_calls", pa.int64()),
])


def run(base: cfg.Base, config: cfg.Rollout, validated: Path, champion: Path,
        rollouts: Path) -> dict:
    """Generate the episodes; returns the stage metrics."""
    tinylm.set_threads(base.threads)
    env = ENVIRONMENTS[base.environment]
    tasks = pq.read_table(validated, columns=["trace_id", "question", "answer"]).to_pylist()
    tasks.sort(key=lambda t: t["trace_id"])
    if config.max_tasks:
        tasks = tasks[:config.max_tasks]
    model, tokenizer = tinylm.load(champion)
    jobs = [(task, sample) for task in tasks for sample in range(config.samples_per_task)]
    started = time.time()
    episodes = generate.generate(
        model, tokenizer, env, [env.prompt(task["question"]) for task, _ in jobs],
        temperature=config.temperature, max_new_tokens=config.max_new_tokens, seed=base.seed,
        batch_size=config.batch_size,
    )
    seconds = time.time() - started
    rows = [{
        "task_id": f"{task['trace_id']}", "trace_id": task["trace_id"], "sample": sample,
        "question": task["question"], "answer": task["answer"], "prompt": episode.prompt,
        "completion": episode.completion, "token_ids": episode.token_ids,
        "model_mask": episode.model_mask, "logprobs": episode.logprobs,
        "finish": episode.finish, "tool_calls": episode.tool_calls,
    } for (task, sample), episode in zip(jobs, episodes)]
    io.write_parquet(rollouts, pa.Table.from_pylist(rows, schema=SCHEMA))
    generated = sum(sum(e.model_mask) for e in episodes)
    return {"tasks": len(tasks), "episodes": len(episodes), "generated_tokens": generated,
            "seconds": round(seconds, 2), "tokens_per_second": round(generated / max(seconds, 1e-9)),
            "tool_use_rate": round(sum(e.tool_calls > 0 for e in episodes) / max(1, len(episodes)), 4),
            "truncated": sum(e.finish == "length" for e in episodes)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("validated", "champion", "rollouts", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("base", args.params), cfg.load("rollout", args.params), args.validated,
                  args.champion, args.rollouts)
    io.write_json(args.metrics, metrics)
    print(f"rollout: {metrics['episodes']} episodes for {metrics['tasks']} tasks in "
          f"{metrics['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
