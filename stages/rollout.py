"""Rollout: the champion, a chat model, plays the tasks of its environments, several samples each.

Reads the `environments:` modules of params.yaml, their tasks (from `data/validated.parquet`, then
their `tasks` files) and `models/champion`. Each task is attempted `rollout.samples_per_task`
times, multi-turn through the chat template, the tool parser and the environment's `call_tool`,
the exact token ids kept; `rollout.backend` is `transformers` or `openai`. Writes
`data/rollouts.parquet` (one row per episode) and `metrics/rollout.json` (`episodes_ended` counts
how each ended). Seeded, so a rerun gives the same episodes; one bad episode never stops it.

    python -m stages.rollout data/validated.parquet models/champion data/rollouts.parquet metrics/rollout.json

Details: docs/training.md, "How the rollout stage works (stages/rollout.py)".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import budget as budgets
from stages import config as cfg
from stages import io, remote, tinylm
from stages.generation import openai_backend
from stages.servers import ServerError

# what stops a rollout between episodes, its finished episodes kept (`err.rows`): a spent budget,
# a remote down or stalled (an MCP tool server, the judge), a rollout server that failed or stalled
STOPS = (budgets.BudgetSpent, remote.RemoteDown, ServerError)

SCHEMA = pa.schema([
    ("task_id", pa.string()), ("environment", pa.string()), ("sample", pa.int64()),
    ("task", pa.string()), ("messages", pa.string()), ("completion", pa.string()),
    ("token_ids", pa.list_(pa.int32())), ("model_mask", pa.list_(pa.int8())),
    ("logprobs", pa.list_(pa.float32())), ("finish", pa.string()), ("tool_calls", pa.int64()),
    ("tool_errors", pa.int64()), ("error", pa.string()), ("turns", pa.list_(pa.int16())),
])


def shares(total: int, weights: dict[str, float], available: dict[str, int]) -> dict[str, int]:
    """Tasks per environment: all of them when `total` is 0; otherwise `total` split by weight
    (largest remainders; at least one each), never more than an environment has.
    """
    if not total:
        return dict(available)
    scale = total / sum(weights.values())
    exact = {name: weights[name] * scale for name in weights}
    counts = {name: max(1, int(value)) for name, value in exact.items()}
    for name in sorted(exact, key=lambda n: int(exact[n]) - exact[n])[:max(0, total - sum(
            counts.values()))]:
        counts[name] += 1
    return {name: min(count, available[name]) for name, count in counts.items()}


def chat_jobs(specs: dict, config: cfg.Rollout, root: Path, validated: Path | None = None
              ) -> tuple[dict, list[tuple]]:
    """({name: Environment}, [(name, task, sample)]): each environment's tasks, by its share:
    the validated traces' tasks (`task_from_trace`, routed by the validate stage; task id
    `trace:<trace id>`), then its `tasks` file's.
    """
    from stages.envs import contract

    envs = {name: contract.load_spec(name, spec, root) for name, spec in specs.items()}
    tasks = {name: [] for name in specs}
    if validated is not None and validated.exists():
        for row in pq.read_table(validated, columns=["trace_id", "question"]).to_pylist():
            task = json.loads(row["question"]) if row["question"] else None
            if not isinstance(task, dict) or task.get("environment") not in tasks:
                continue  # routed by an earlier params.yaml, or not by the environments path
            name = task.pop("environment")
            tasks[name].append({**task, "task_id": f"trace:{row['trace_id']}"})
    for name, spec in specs.items():
        if not spec.tasks and not tasks[name]:
            raise cfg.ParamsError(f"environments.{name}.tasks: no task file to roll out, and no "
                                  f"trace its task_from_trace claimed; write one (JSON lines: "
                                  f"task_id, messages, the fields its reward needs) and name it")
        tasks[name].sort(key=lambda t: t["task_id"])
        if spec.tasks:
            tasks[name] += sorted(contract.load_tasks(root / spec.tasks, envs[name]),
                                  key=lambda t: t["task_id"])
    counts = shares(config.max_tasks, {n: s.weight for n, s in specs.items()},
                    {n: len(t) for n, t in tasks.items()})
    jobs = [(name, task, sample) for name in specs for task in tasks[name][:counts[name]]
            for sample in range(config.samples_per_task)]
    return envs, jobs


def run(base: cfg.Base, config: cfg.Rollout, specs: dict, champion: Path, rollouts: Path,
        root: Path | None = None, validated: Path | None = None,
        meter: budgets.Meter | None = None) -> dict:
    """The episodes of the chat model in the `environments:` (`specs`, the modules imported from
    `root`); returns the stage metrics. `meter`: the cycle's budget, checked first and between
    batches (`stages/budget.py`).
    """
    tinylm.set_threads(base.threads)
    root = root or Path.cwd()
    envs, jobs = chat_jobs(specs, config, root, validated)
    if meter is not None:
        meter.check("no episode yet", f"{len(jobs)} episodes")
    # episodes a stop kept (a budget, a remote: `STOPS`; beside the output, which DVC deletes
    # before a run): a rerun plays only the rest, and each episode is the same as in an
    # uninterrupted run (seeded by its identity), so the table is too
    partial = rollouts.with_name(rollouts.name + ".partial")
    # hashed only where a stop left episodes or leaves them: the weights may be gigabytes
    key = lambda: _resume_key(base, config, specs, champion)  # noqa: E731
    kept = _kept(partial, key)
    left = [job for job in jobs if (f"{job[0]}:{job[1]['task_id']}", job[2]) not in kept]
    if kept:
        print(f"rollout: {len(jobs) - len(left)} episodes kept from a run that stopped; "
              f"{len(left)} to play", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        served = config.backend == "openai"
        policy = Policy.served(champion, openai_backend.servers(config, champion, stack)) \
            if served else Policy.local(champion)
        try:
            played = play(base, config, envs, left, policy, meter=meter)
        except STOPS as err:
            done = list(kept.values()) + getattr(err, "rows", [])
            io.write_parquet(partial, pa.Table.from_pylist(done, schema=SCHEMA)
                             .replace_schema_metadata({"offseason.resume": key()}))
            raise type(err)(f"{err} ({len(done)} finished episodes are kept in "
                            f"{partial.name}; the rerun plays only the rest)") from err
    fresh = {(r["task_id"], r["sample"]): r for r in played.rows}
    rows = [kept.get(k) or fresh[k] for k in ((f"{n}:{t['task_id']}", s) for n, t, s in jobs)]
    stats, parser, seconds = played.stats, played.parser, played.seconds
    templates, refused, ended = played.templates, played.refused, played.ended
    bad_arguments = played.bad_arguments
    io.write_parquet(rollouts, pa.Table.from_pylist(rows, schema=SCHEMA))
    partial.unlink(missing_ok=True)
    generated = sum(sum(r["model_mask"]) for r in rows)
    per_env = {}
    for name in envs:
        mine = [r for r in rows if r["environment"] == name]
        per_env[name] = {
            "episodes": len(mine), "tasks": len({r["task_id"] for r in mine}),
            "trace_tasks": len({r["task_id"] for r in mine
                                if r["task_id"].startswith(f"{name}:trace:")}),
            "tool_use_rate": round(sum(r["tool_calls"] > 0 for r in mine) / max(1, len(mine)), 4),
            "tool_error_rate": round(sum(r["tool_errors"] for r in mine)
                                     / max(1, sum(r["tool_calls"] for r in mine)), 4),
            "errors": sum(r["error"] is not None for r in mine),
            **token_counts(mine), "module": envs[name].module, "version": envs[name].version,
            # the module's own file as this stage ran it (data/environments.json, a dep of
            # the stage, hashes its folder)
            "source_sha256": hashlib.sha256(Path(envs[name].source).read_bytes()).hexdigest()
            if envs[name].source else None}
    requests = {}
    if served:
        by_url: dict[str, int] = {}
        for stat in stats:
            for url, count in stat.by_url.items():
                by_url[url] = by_url.get(url, 0) + count
        requests = {"requests": sum(s.requests for s in stats),
                    "retries": sum(s.retries for s in stats), "requests_by_url": by_url,
                    # servers left out mid-stage (died, or stalled while others answered), and why
                    "urls_lost": {url: why for s in stats for url, why in s.lost.items()},
                    # what the servers processed (and bill): budget.served_tokens prices it
                    "served_usage": {"prompt_tokens": sum(s.prompt_tokens for s in stats),
                                     "completion_tokens": sum(s.completion_tokens
                                                              for s in stats)}}
    return {"backend": config.backend, "tool_parser": parser, **requests,
            "resumed_episodes": len(kept),
            "prompt_tokens": sum(e["prompt_tokens"] for e in per_env.values()),
            "tool_calls": sum(e["tool_calls"] for e in per_env.values()),
            "template": "prefix-preserving" if all(t.prefix_preserving for t in templates.values())
            else "incremental", "tasks": sum(e["tasks"] for e in per_env.values()),
            "episodes": len(rows), "generated_tokens": generated, "seconds": round(seconds, 2),
            "tokens_per_second": round(generated / max(seconds, 1e-9)),
            "truncated": sum(r["finish"] == "length" for r in rows),
            "turn_limited": sum(r["finish"] == "turns" for r in rows),
            # turns the model's own chat template refused (ended there, scored as they stand)
            "template_refused": sum(r["finish"] == "template" for r in rows),
            "template_refused_first": refused[0] if refused else None,
            "episodes_ended": ended, "bad_arguments": bad_arguments,
            "errors": sum(r["error"] is not None for r in rows), "environments": per_env}


def _resume_key(base: cfg.Base, config: cfg.Rollout, specs: dict, champion: Path) -> str:
    """What kept episodes must have been played with: the champion's weights, the rollout's
    settings, the seed and the environments (a change of any: nothing kept is reused).
    """
    from dataclasses import asdict

    digest = hashlib.sha256(tinylm.weights_digest(champion).encode())
    digest.update(repr((sorted(asdict(config).items()), base.seed,
                        sorted((n, repr(s)) for n, s in specs.items()))).encode())
    return digest.hexdigest()[:24]


def _kept(partial: Path, key) -> dict:
    """{(task_id, sample): row} of the episodes a stop (`STOPS`) kept under `key()`; none when the
    file is missing or was written for other weights or settings (then it is removed).
    """
    if not partial.exists():
        return {}
    table = pq.read_table(partial)
    if (table.schema.metadata or {}).get(b"offseason.resume", b"").decode() != key():
        partial.unlink()
        return {}
    return {(r["task_id"], r["sample"]): r for r in table.to_pylist()}


@dataclass
class Policy:
    """The model that plays: its folder's tokenizer and end tokens, and either the model in this
    process (`model`) or the servers that hold its weights (`urls`, the chat template and the
    tool parser still run here; `context`: the model's positions).
    """

    tokenizer: object
    ends: tuple
    model: object = None
    urls: list | None = None
    context: int | None = None

    @classmethod
    def local(cls, folder: Path, model=None, tokenizer=None) -> Policy:
        """The model of `folder` (or `model`, already loaded: a policy being trained) here."""
        from stages.generation import chat

        if model is None:
            model, tokenizer = tinylm.load(folder)
        model.eval()
        return cls(tokenizer=tokenizer, ends=chat.end_ids(model, tokenizer), model=model)

    @classmethod
    def served(cls, folder: Path, urls: list[str]) -> Policy:
        """The model of `folder` behind the servers at `urls`."""
        from types import SimpleNamespace

        from transformers import AutoConfig, GenerationConfig

        from stages.generation import chat

        tokenizer = tinylm.load_tokenizer(folder)
        try:
            generation = GenerationConfig.from_pretrained(folder)
        except OSError:  # no generation_config.json: the tokenizer's eos ends a turn
            generation = None
        return cls(tokenizer=tokenizer,
                   ends=chat.end_ids(SimpleNamespace(generation_config=generation), tokenizer),
                   urls=urls, context=AutoConfig.from_pretrained(folder).max_position_embeddings)


@dataclass
class Played:
    """What `play` returns: the episodes' rows (`SCHEMA`) and how they went."""

    rows: list
    stats: list
    parser: str | None
    seconds: float
    templates: dict
    refused: list
    ended: dict
    bad_arguments: int


def play(base: cfg.Base, config: cfg.Rollout, envs: dict, jobs: list[tuple], policy: Policy, *,
         meter: budgets.Meter | None = None, salt: str = "", progress: bool = True) -> Played:
    """Play `jobs` ((environment, task, sample), from `chat_jobs`) with `policy`: the one episode
    loop of the rollout stage and of on-policy training (`train.grpo.steps`). Each episode's
    randomness comes from the seed, `salt` and the episode's own identity, so an episode is the
    same whatever else is in its batch. `meter`: checked between batches.
    """
    import zlib

    import torch

    from stages.generation import chat
    from stages.generation.episode import Progress

    tokenizer, ends, served = policy.tokenizer, policy.ends, policy.urls is not None
    templates = {name: chat.Template.of(tokenizer, list(env.tools), ends)
                 for name, env in envs.items()}
    rows, stats = [], []
    refused: list[str] = []  # the chat template's words on the first turn it refused
    ended = dict.fromkeys(chat.ENDINGS, 0)  # episodes by how they ended
    bad_arguments = 0

    def add(name: str, task: dict, sample: int, episode) -> None:
        nonlocal bad_arguments
        if episode.template_error and not refused:
            refused.append(f"{name}:{task['task_id']}: {episode.template_error}")
        ended[episode.ended] += 1
        bad_arguments += episode.bad_arguments
        added = episode.messages[len(task["messages"]):]
        rows.append({  # ids of different environments' tasks may coincide
            "task_id": f"{name}:{task['task_id']}", "environment": name, "sample": sample,
            "task": json.dumps(task), "messages": json.dumps(episode.messages),
            "completion": json.dumps(added), "token_ids": episode.token_ids,
            "model_mask": episode.model_mask, "logprobs": episode.logprobs,
            "finish": episode.finish, "tool_calls": episode.tool_calls,
            "tool_errors": episode.tool_errors, "error": episode.error,
            "turns": episode.turns})

    started, parser = time.time(), None
    bar = None if served or not progress else Progress(len(jobs), "rollout", True)
    try:
        for name, env in envs.items():
            mine = [(task, sample) for n, task, sample in jobs if n == name]
            if not mine:
                continue
            parser, max_turns = chat.resolve(config, tokenizer, env)
            seeds = [zlib.crc32(f"{base.seed}{salt}/{name}/{task['task_id']}/{sample}".encode())
                     for task, sample in mine]
            if served:  # in batches, the budget checked between them on the servers' usage
                for start in range(0, len(mine), config.batch_size):
                    if meter is not None and rows:
                        meter.check(f"{len(rows)} of {len(jobs)} episodes",
                                    f"{len(jobs) - len(rows)} episodes",
                                    served_tokens=sum(s.prompt_tokens + s.completion_tokens
                                                      for s in stats))
                    chunk = mine[start:start + config.batch_size]
                    episodes, stat = openai_backend.chat_rollout(
                        tokenizer, env, [task for task, _ in chunk],
                        seeds[start:start + config.batch_size], urls=policy.urls, parser=parser,
                        max_turns=max_turns, context=policy.context, ends=ends,
                        template=templates[name], model=config.model,
                        temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                        max_new_tokens=config.max_new_tokens, concurrency=config.concurrency,
                        timeout=config.request_timeout, retries=config.retries, api=config.api,
                        api_key=openai_backend.api_key_from(config.api_key_env),
                        stall=config.stall_seconds)
                    stats.append(stat)
                    for (task, sample), episode in zip(chunk, episodes):
                        add(name, task, sample, episode)
                continue
            for start in range(0, len(mine), config.batch_size):
                if meter is not None and rows:
                    meter.check(f"{len(rows)} of {len(jobs)} episodes",
                                f"{len(jobs) - len(rows)} episodes")
                chunk = mine[start:start + config.batch_size]
                generators = [torch.Generator().manual_seed(seed)
                              for seed in seeds[start:start + config.batch_size]]
                done = len(rows)
                episodes = chat.rollout(
                    policy.model, tokenizer, env, [task for task, _ in chunk], parser=parser,
                    temperature=config.temperature, max_new_tokens=config.max_new_tokens,
                    max_turns=max_turns, generator=generators, top_p=config.top_p,
                    top_k=config.top_k, template=templates[name],
                    on_step=None if bar is None else lambda n, base=done: bar.update(base + n))
                for (task, sample), episode in zip(chunk, episodes):
                    add(name, task, sample, episode)
    except STOPS as err:
        err.rows = rows  # the finished episodes: the caller keeps them
        raise
    finally:
        if bar is not None:
            bar.close()
    return Played(rows, stats, parser, time.time() - started, templates, refused, ended,
                  bad_arguments)


def token_counts(rows: list[dict]) -> dict:
    """Exact counts of episodes' own token ids (the cost ledger's, flows/orchestration/cost.py):
    `generated_tokens` the model chose (`model_mask` 1), `prompt_tokens` it read without choosing
    them (the prompt, the chat template's tokens, tool results), and the tool calls answered.
    """
    generated = sum(sum(r["model_mask"]) for r in rows)
    return {"prompt_tokens": sum(len(r["token_ids"]) for r in rows) - generated,
            "generated_tokens": generated, "tool_calls": sum(r["tool_calls"] for r in rows)}


def main(argv: list[str] | None = None) -> None:
    """Roll out the champion on the tasks (the DVC stage's command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("validated", "champion", "rollouts", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    io.watch_gpus()  # per GPU busy seconds, peak memory (the cost ledger); none: nothing
    base, config = cfg.load("base", args.params), cfg.load("rollout", args.params)
    metrics = run(base, config, cfg.environments(args.params), args.champion, args.rollouts,
                  Path(args.params).resolve().parent, args.validated,
                  budgets.Meter.of("rollout", args.params))
    metrics["runtime"] = cfg.runtime_of(config)  # what ran where (runtime.rollout)
    io.write_metrics(args.metrics, metrics)
    print(f"rollout: {metrics['episodes']} episodes for {metrics['tasks']} tasks in "
          f"{metrics['seconds']} s", file=sys.stderr)
    if metrics.get("template_refused"):
        print(f"rollout: {metrics['template_refused']} episode(s) ended on a turn the model's own "
              f"chat template refuses (first: {metrics['template_refused_first']}); they score as "
              f"they stand, and training on them teaches the format the template takes",
              file=sys.stderr)
    failed = {k: n for k, n in (metrics.get("episodes_ended") or {}).items()
              if n and k in ("tool_failed", "tool_schema", "task_messages", "prompt_too_long",
                             "template_unusable")}
    if failed:
        causes = ", ".join(f"{cause} {n}" for cause, n in failed.items())
        print(f"rollout: episodes ended by a failure that is not the model's, by cause: {causes} "
              f"(each row's `error` says why; the reward stage sets them aside, never a zero)",
              file=sys.stderr)


if __name__ == "__main__":
    with budgets.stops_cleanly("rollout"), io.explained("rollout"):
        main()
    io.exit_soon()
