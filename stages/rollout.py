"""Rollout: the champion re-attempts the tasks of the validated traces, several samples each.

Reads `data/validated.parquet` (one task per trace: `question`, `answer`) and `models/champion`.
Each task is attempted `rollout.samples_per_task` times at `rollout.temperature`, multi-turn: the
environment answers each tool call and the model goes on, up to `rollout.max_turns` calls. Writes
`data/rollouts.parquet` (one row per episode: task, completion, token ids, which tokens the model
chose, their log-probabilities, the turn of each token) and `metrics/rollout.json`. Seeded by
`base.seed`, so a rerun gives the same episodes.

`rollout.backend` picks who generates: `transformers` (in this process, `stages.generation.transformers_backend`) or
`openai` (OpenAI-compatible servers, `stages.generation.openai_backend`: the ones at `rollout.urls`, or one
the stage starts with `rollout.server_command` on models/champion and stops afterwards).

    python -m stages.rollout data/validated.parquet models/champion data/rollouts.parquet metrics/rollout.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer

from stages import config as cfg
from stages import io, tinylm
from stages.envs.registry import ENVIRONMENTS, load_tasks
from stages.generation import openai_backend, transformers_backend

SCHEMA = pa.schema([
    ("task_id", pa.string()), ("trace_id", pa.string()), ("sample", pa.int64()),
    ("question", pa.string()), ("answer", pa.string()), ("prompt", pa.string()),
    ("completion", pa.string()), ("token_ids", pa.list_(pa.int32())),
    ("model_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float32())),
    ("finish", pa.string()), ("tool_calls", pa.int64()), ("turns", pa.list_(pa.int16())),
])


def suite(config: cfg.Rollout, env, suites: Path | None) -> list[dict]:
    """The first `rollout.suite_tasks` tasks of the environment's suite, as trace-like rows."""
    if not config.suite_tasks:
        return []
    path = (suites or Path("data/tasks")) / f"{env.NAME}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: rollout.suite_tasks={config.suite_tasks} asks for tasks "
                                f"of the {env.NAME} suite, but there is none; write it (one JSON "
                                f"object a line: task_id, question, answer) or set "
                                f"rollout.suite_tasks: 0")
    tasks = sorted(load_tasks(path), key=lambda t: t["task_id"])[:config.suite_tasks]
    return [{"trace_id": f"suite:{t['task_id']}", "question": t["question"],
             "answer": t["answer"]} for t in tasks]


def run(base: cfg.Base, config: cfg.Rollout, validated: Path, champion: Path,
        rollouts: Path, suites: Path | None = None) -> dict:
    """Generate the episodes; returns the stage metrics."""
    tinylm.set_threads(base.threads)
    env = ENVIRONMENTS[base.environment]
    tasks = pq.read_table(validated, columns=["trace_id", "question", "answer"]).to_pylist()
    tasks.sort(key=lambda t: t["trace_id"])
    if config.max_tasks:
        tasks = tasks[:config.max_tasks]
    from_traces = len(tasks)
    tasks += suite(config, env, suites)
    jobs = [(task, sample) for task in tasks for sample in range(config.samples_per_task)]
    prompts = [env.prompt(task["question"]) for task, _ in jobs]
    max_turns = config.max_turns or env.MAX_TURNS
    stop = (config.stop,) if config.stop else ()
    served = {}
    if config.backend == "transformers":
        model, tokenizer = tinylm.load(champion)
        started = time.time()
        episodes = transformers_backend.generate(
            model, tokenizer, env, prompts, temperature=config.temperature,
            max_new_tokens=config.max_new_tokens, seed=base.seed, batch_size=config.batch_size,
            top_p=config.top_p, top_k=config.top_k, max_turns=max_turns, stop=stop,
        )
        seconds = time.time() - started
    else:  # the served model is the champion: its tokenizer encodes prompts and tool results
        tokenizer = AutoTokenizer.from_pretrained(champion)
        with contextlib.ExitStack() as stack:
            urls = config.url_list or [stack.enter_context(openai_backend.serve(
                config.server_command, champion, timeout=config.server_timeout))]
            started = time.time()
            episodes, stats = openai_backend.generate(
                prompts, env, urls=urls, tokenizer=tokenizer, model=config.model,
                temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                max_new_tokens=config.max_new_tokens, max_turns=max_turns, stop=stop,
                seed=base.seed, concurrency=config.concurrency, timeout=config.request_timeout,
                retries=config.retries, api_key=openai_backend.api_key_from(config.api_key_env),
            )
            seconds = time.time() - started
        served = {"requests": stats.requests, "retries": stats.retries,
                  "requests_by_url": stats.by_url}
    rows = [{
        "task_id": f"{task['trace_id']}", "trace_id": task["trace_id"], "sample": sample,
        "question": task["question"], "answer": task["answer"], "prompt": episode.prompt,
        "completion": episode.completion, "token_ids": episode.token_ids,
        "model_mask": episode.model_mask, "logprobs": episode.logprobs,
        "finish": episode.finish, "tool_calls": episode.tool_calls, "turns": episode.turns,
    } for (task, sample), episode in zip(jobs, episodes)]
    io.write_parquet(rollouts, pa.Table.from_pylist(rows, schema=SCHEMA))
    # the model's own tokens (a server that gives no token ids: its log-probs count them)
    generated = sum(sum(e.model_mask) if e.token_ids else len(e.logprobs) for e in episodes)
    return {"backend": config.backend, "tasks": len(tasks), "suite_tasks": len(tasks) - from_traces, "episodes": len(episodes),
            "generated_tokens": generated,
            "seconds": round(seconds, 2), "tokens_per_second": round(generated / max(seconds, 1e-9)),
            "tool_use_rate": round(sum(e.tool_calls > 0 for e in episodes) / max(1, len(episodes)), 4),
            "truncated": sum(e.finish == "length" for e in episodes),
            "turn_limited": sum(e.finish == "turns" for e in episodes), **served}


def main(argv: list[str] | None = None) -> None:
    """Roll out the champion on the tasks (the DVC stage's command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("validated", "champion", "rollouts", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--tasks", type=Path, default=Path("data/tasks"),
                        help="the folder of task suites, <environment>.jsonl (rollout.suite_tasks)")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("base", args.params), cfg.load("rollout", args.params), args.validated,
                  args.champion, args.rollouts, args.tasks)
    io.write_json(args.metrics, metrics)
    print(f"rollout: {metrics['episodes']} episodes for {metrics['tasks']} tasks in "
          f"{metrics['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
