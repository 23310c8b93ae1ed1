"""Train: a better candidate from the champion's scored rollouts, by SFT, DPO or GRPO.

Reads `data/rewards.parquet`, `models/champion` and (with `--validated`) `data/validated.parquet`;
writes `models/candidate`, this cycle's scored rollouts into `data/replay/` (a persistent output),
`metrics/train.json` and `metrics/train_steps.csv`. `train.algorithm` is `sft`, `dpo` or `grpo`,
every loss on the model's own tokens only; earlier cycles' examples are mixed in
(`train.replay_fraction`; on-policy GRPO plays earlier cycles' tasks again). Below
`train.min_examples` the champion is written unchanged.
Checkpoints go to `models/candidate.ckpt` (not a DVC output; resumed only by the same run).

    python -m stages.train data/rewards.parquet models/champion models/candidate data/replay \
        models/candidate.ckpt metrics/train.json metrics/train_steps.csv \
        --validated data/validated.parquet

Details: docs/training.md, "How the train stage works (stages/train.py)".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import hashlib
import importlib
import io as textio
import json
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import TrainerCallback

from stages import budget as budgets
from stages import config as cfg
from stages import erasure, io, tinylm
from stages.training import trainers

# `task`: the task played, as the rollout row keeps it (JSON; null for a trace conversation), so
# that on-policy GRPO can play an earlier cycle's task again (`replay_tasks`); parts written
# before it was kept have no such column
REPLAY = pa.schema([("task_id", pa.string()), ("completion", pa.string()),
                    ("token_ids", pa.list_(pa.int32())), ("model_mask", pa.list_(pa.int8())),
                    ("logprobs", pa.list_(pa.float32())), ("correct", pa.float64()),
                    ("reward", pa.float64()), ("environment", pa.string()),
                    ("task", pa.string())])
STEP_COLUMNS = ["step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "epoch"]


def algorithm(name: str):
    """The module of `train.algorithm` (stages/training/<name>.py): `UNIT`, `examples(rows)` and
    `trainer(...)`. The algorithm's name is its module's name: one spelling, no table to keep.
    """
    with io.heavy_imports():  # transformers' Trainer and datasets, when not loaded yet
        return importlib.import_module(f"stages.training.{name}")


def encoded_traces(validated: Path, specs: dict, root: Path, tokenizer,
                   end_ids: tuple[int, ...] = (), thumbs: tuple[bool, ...] = (True,),
                   context: int | None = None) -> list[dict]:
    """The production traces of the `environments:` whose feedback is in `thumbs`, each scored by
    its environment's reward and encoded turn by turn with the champion's chat template and the
    environment's tools (`chat.encode`: mask 1 on the assistant's tokens). Each item: `trace_id`,
    `task_id` (`<environment>:trace:<id>`, as its rollouts have), `environment`, `thumbs_up`,
    `scores` (None: the reward cannot judge), `token_ids`, `model_mask`, `completion`; or `error`
    (why it cannot be used: also a conversation longer than the model's `context` positions,
    which no position embedding can take).
    """
    import json

    from stages.envs import contract
    from stages.generation import chat

    if not validated.exists():
        return []
    table = pq.read_table(validated, columns=["trace_id", "messages", "thumbs_up", "question"],
                          filters=[("thumbs_up", "in", list(thumbs))]).to_pylist()
    envs, templates, items = {}, {}, []
    for trace in sorted(table, key=lambda t: t["trace_id"]):
        task = json.loads(trace["question"]) if trace["question"] else None
        name = task.get("environment") if isinstance(task, dict) else None
        if name not in specs:
            continue
        if name not in envs:
            envs[name] = contract.load(name, specs[name].module, root)
            templates[name] = chat.Template.of(tokenizer, list(envs[name].tools), end_ids)
        messages = json.loads(trace["messages"])
        task = {k: v for k, v in task.items() if k != "environment"}
        start = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                     len(messages))
        item = {"trace_id": trace["trace_id"], "task_id": f"{name}:trace:{trace['trace_id']}",
                "environment": name, "thumbs_up": trace["thumbs_up"],
                "completion": json.dumps(messages[start:]), "error": None}
        try:
            item["scores"] = contract.score(envs[name], task, task["messages"] + messages[start:])
            item["token_ids"], item["model_mask"] = chat.encode(templates[name].for_task(task),
                                                                 messages)
            if context is not None and len(item["token_ids"]) > context:
                raise ValueError(f"{len(item['token_ids'])} tokens, more than the model's "
                                 f"{context} positions")
        except Exception as err:  # one odd trace: counted and said; the others still train
            item["error"] = f"{type(err).__name__}: {err}"
            print(f"train: trace {trace['trace_id']} not used: {item['error']}", file=sys.stderr)
        items.append(item)
    return items


def trace_conversations(validated: Path, specs: dict, root: Path, tokenizer,
                        end_ids: tuple[int, ...] = (), context: int | None = None
                        ) -> tuple[list, dict]:
    """SFT rows from the production traces with a thumbs up (`specs`: the `environments:`): each
    trace's own conversation, its tool calls and tool results included (`encoded_traces`: the
    loss on the assistant's tokens only). A trace is kept when its environment's reward gives its
    turns full marks or cannot judge them (None); one the reward scores lower is counted, not used.
    """
    from stages.envs import contract

    counts = {"trace_examples": 0, "traces_thumbs_up": 0, "traces_reward_disagrees": 0,
              "traces_unusable": 0}
    rows = []
    for item in encoded_traces(validated, specs, root, tokenizer, end_ids, context=context):
        counts["traces_thumbs_up"] += 1
        if item["error"] is not None:
            counts["traces_unusable"] += 1
            continue
        if item["scores"] is not None and not contract.full_marks(item["scores"]):
            counts["traces_reward_disagrees"] += 1
            continue
        rows.append({"task_id": item["task_id"], "environment": item["environment"],
                     "completion": item["completion"], "correct": 1.0, "reward": 1.0,
                     "token_ids": item["token_ids"], "model_mask": item["model_mask"],
                     "logprobs": None})
    counts["trace_examples"] = len(rows)
    return rows, counts


def model_context(champion: Path) -> int | None:
    """How many positions the champion takes (its config's `max_position_embeddings`)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(champion), "max_position_embeddings", None)


def chat_tokenizer(champion: Path):
    """The champion's tokenizer and the ids that end its turns, as the rollout takes them
    (the generation config's eos ids: Llama 3 has three).
    """
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(champion)
    try:
        ends = GenerationConfig.from_pretrained(champion).eos_token_id
    except OSError:
        ends = None
    return tokenizer, tuple([ends] if isinstance(ends, int) else list(ends or []))


def by_weight(examples: list[dict], environment_of: dict[str, str], specs: dict, seed: int
              ) -> tuple[list[dict], dict]:
    """Several environments: their examples in the shares their `weight`s ask for, the total
    kept. An environment short of its share has its examples repeated (in turn), one over it
    loses a seeded sample; each keeps at least one. Returns the examples and the count of each.
    """
    groups = {name: [] for name in specs}
    for example in examples:
        groups.setdefault(environment_of.get(example["task_id"], ""), []).append(example)
    groups = {name: group for name, group in groups.items() if group}
    if len(groups) < 2:
        return examples, {name: len(group) for name, group in groups.items()}
    total = sum(len(group) for group in groups.values())
    weights = {name: specs[name].weight if name in specs else 0.0 for name in groups}
    out, counts = [], {}
    rng = random.Random(seed)
    for name, group in groups.items():
        share = max(1, round(total * weights[name] / sum(weights.values())))
        chosen = [group[i % len(group)] for i in range(share)] if share >= len(group) \
            else rng.sample(group, share)
        out += chosen
        counts[name] = len(chosen)
    return out, counts


def examples_from(rewards: Path) -> list[dict]:
    """The SFT examples of a rewards file."""
    return algorithm("sft").examples(_read(rewards))[0]


def _read(rewards: Path) -> list[dict]:
    names = pq.read_schema(rewards).names
    columns = [c for c in ("task_id", "completion", "correct", "reward", "token_ids",
                           "model_mask", "logprobs", "environment", "task") if c in names]
    return pq.read_table(rewards, columns=columns).to_pylist()


def store_and_replay(rows: list[dict], replay: Path, name: str, fraction: float, seed: int,
                     current: list[dict], traced: list[dict] | None = None) -> tuple[list[dict], int]:
    """Save this cycle's scored rollouts (`rows`) and the trace examples it trained on (`traced`)
    as a replay part; returns a sample of the examples that the earlier parts give for the
    algorithm `name` (those not among this cycle's `current` examples).

    The part is named by its content, so a stage killed after writing it and run again neither
    duplicates it nor replays it as if it were earlier data; a part that begins with this cycle's
    very rollouts (stored by a run with `train.algorithm` switched since) is this cycle's too: not
    stored again, not replayed.
    """
    replay.mkdir(parents=True, exist_ok=True)
    stored = [{"task_id": r["task_id"], "completion": r["completion"], "token_ids": r["token_ids"],
               "model_mask": r["model_mask"], "logprobs": r.get("logprobs"),
               "correct": r["correct"], "reward": r["reward"],
               "environment": r.get("environment"), "task": r.get("task")}
              for r in rows + (traced or [])]
    part = replay / f"part-{_rows_digest(stored)[:16]}.parquet"
    mine = _rows_digest(stored[:len(rows)]) if rows else None
    earlier = []
    erased = erasure.Tombstones()  # the project's (the stage runs in its root): never replayed
    for path in sorted(replay.glob("part-*.parquet")):
        if path != part:
            old = erased.keep_rows(pq.read_table(path).to_pylist())
            if mine is not None and len(old) >= len(rows) and _rows_digest(old[:len(rows)]) == mine:
                # this cycle's rollouts, stored by a run with another algorithm: what this run
                # adds is its trace examples, if that run had none
                stored = stored[len(rows):] if len(old) == len(rows) else []
                continue
            earlier.extend(algorithm(name).examples(old)[0])
    if stored and not (part := replay / f"part-{_rows_digest(stored)[:16]}.parquet").exists():
        io.write_parquet(part, pa.Table.from_pylist(stored, schema=REPLAY))
    seen = {(e["task_id"], e["completion"]) for e in current}
    earlier = [e for e in earlier if (e["task_id"], e["completion"]) not in seen]
    chosen = random.Random(seed).sample(earlier, round(fraction * len(earlier)))
    return chosen, len(earlier)


def replay_tasks(replay: Path, specs: dict, cycle: list[tuple[str, dict]], fraction: float,
                 seed: int, erased: erasure.Tombstones) -> tuple[list[tuple[str, dict]], int]:
    """On-policy GRPO's tasks from earlier cycles, [(environment, task)]: a seeded sample of
    round(`fraction` x the number of this cycle's tasks, `cycle`) of the replay's distinct tasks
    of the environments `specs` still lists, not among this cycle's and not made from an erased
    trace; and how many there were to sample from. A part written before the replay kept tasks
    gives none.
    """
    mine = {f"{name}:{task['task_id']}" for name, task in cycle}
    found: dict[str, tuple[str, str]] = {}  # task id -> (environment, task JSON)
    for path in sorted(replay.glob("part-*.parquet")) if replay.exists() else []:
        if "task" not in pq.read_schema(path).names:
            continue
        rows = pq.read_table(path, columns=["task_id", "environment", "task"]).to_pylist()
        for row in erased.keep_rows(rows):  # the task id names the trace a task was made of
            if row["task"] is None or row["environment"] not in specs or row["task_id"] in mine:
                continue
            # a task stored with different contents by different cycles (its file edited):
            # the same one whichever parts there are, this cycle's own (stored at the end, by a
            # run killed before it cleaned up) included
            kept = found.get(row["task_id"])
            if kept is None or row["task"] < kept[1]:
                found[row["task_id"]] = (row["environment"], row["task"])
    chosen = random.Random(f"{seed}/replay").sample(
        sorted(found), min(len(found), round(fraction * len(cycle))))
    return [(found[key][0], json.loads(found[key][1])) for key in sorted(chosen)], len(found)


def _rows_digest(rows: list[dict]) -> str:
    return hashlib.sha256(repr([(r["task_id"], r["completion"], r.get("reward"))
                                for r in rows]).encode()).hexdigest()


def _fingerprint(examples: list[dict], champion: Path, config: cfg.Train, seed: int) -> str:
    digest = hashlib.sha256()
    digest.update(tinylm.weights_digest(champion).encode())
    digest.update(repr((sorted(asdict(config).items()), seed)).encode())
    for example in examples:
        digest.update(repr(sorted(example.items())).encode())
    return digest.hexdigest()[:16]


def last_checkpoint(work: Path) -> str | None:
    """The newest complete checkpoint in `work` (the Trainer writes trainer_state.json last, so a
    folder without it, or with only part of it, is one the run was killed while saving: deleted).
    """
    if not work.exists():
        return None
    found = {}
    for folder in work.glob("checkpoint-*"):
        if _whole_json(folder / "trainer_state.json"):
            found[int(folder.name.rsplit("-", 1)[-1])] = folder
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return str(found[max(found)]) if found else None


def _whole_json(path: Path) -> bool:
    """Whether `path` holds a whole JSON document: a kill while the Trainer wrote it leaves the
    file empty or cut short, and resuming from it failed with a JSONDecodeError.
    """
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _steps_csv(history: list[dict]) -> str:
    rows = [h for h in history if "loss" in h]
    extra = sorted({k for h in rows for k in h} - set(STEP_COLUMNS))
    out = textio.StringIO()
    writer = csv.DictWriter(out, fieldnames=STEP_COLUMNS + extra, extrasaction="ignore")
    writer.writeheader()
    for h in rows:
        writer.writerow(h)
    return out.getvalue()


class BudgetCheck(TrainerCallback):
    """After every optimizer step, the cycle's budget (`stages/budget.py`): at the limit, a
    checkpoint of this step is saved and training stops; `stopped` holds the error to raise.
    """

    def __init__(self, meter: budgets.Meter | None):
        """Check `meter` (None: never stop)."""
        self.meter, self.stopped = meter, None

    def on_step_end(self, args, state, control, **kwargs):
        """Stop, saving this step, once the budget is spent."""
        try:
            self.meter.check(f"{state.global_step} of {state.max_steps} optimizer steps (the "
                             f"checkpoint of step {state.global_step} is saved)",
                             f"{state.max_steps - state.global_step} steps")
        except budgets.BudgetSpent as err:
            self.stopped = err
            control.should_save = True
            control.should_training_stop = True
        return control


SPENT = "spent.json"  # beside a training's checkpoints: what it used up to the last one


class Spent(TrainerCallback):
    """At each checkpoint, what this training has used up to it, its earlier attempts' included,
    written beside the checkpoints (`SPENT`): a run resumed there (after a budget stop, a kill)
    adds it to its own, in the budget's meter and in its metrics' `resources` (the cost ledger),
    where the seconds before the stop were lost.
    """

    def __init__(self, work: Path, carried: dict, meter: budgets.Meter | None):
        """Write to `work`, adding `carried`; the process's use since `meter` began (or since
        it started).
        """
        self.work, self.carried = work, carried
        self.since_cpu = meter.since_cpu if meter is not None else 0.0
        self.since_wall = meter.since_wall if meter is not None else io.STARTED

    def on_save(self, args, state, control, **kwargs):
        """Note the use so far beside the checkpoint just saved."""
        if int(os.environ.get("RANK", "0")) != 0:
            return
        cpu = io.resources()["cpu_seconds"] - self.since_cpu
        wall = time.monotonic() - self.since_wall
        io.write_json(self.work / SPENT, {
            "step": state.global_step,
            "cpu_seconds": round(self.carried.get("cpu_seconds", 0.0) + cpu, 3),
            "wall_seconds": round(self.carried.get("wall_seconds", 0.0) + wall, 3)})


def run(base: cfg.Base, config: cfg.Train, rewards: Path, champion: Path, candidate: Path,
        replay: Path, checkpoints: Path | None = None, steps_csv: Path | None = None,
        validated: Path | None = None, specs: dict | None = None, root: Path | None = None,
        temperature: float = 1.0, meter: budgets.Meter | None = None,
        rollout: cfg.Rollout | None = None, reward: cfg.Reward | None = None,
        episodes: Path | None = None) -> dict:
    """Train and write the candidate; returns the stage metrics. `validated`, with `specs` (the
    `environments:` section): the traces whose thumbs add DPO pairs (`dpo.feedback_pairs`)
    or, for SFT, whose thumbs-up conversations are trained on (`trace_conversations`).
    `meter`: the cycle's budget, checked after every optimizer step; at the limit the stage saves
    a checkpoint and raises `BudgetSpent` (a rerun resumes there). With `train.grpo.steps` > 1,
    on-policy GRPO (`online`) with the `rollout` and `reward` sections, its episodes per step
    into `episodes`.
    """
    tinylm.set_threads(base.threads)
    checkpoints = checkpoints or candidate.with_name(candidate.name + ".ckpt")
    if config.algorithm == "grpo" and config.grpo.steps > 1:
        return online(base, config, specs or {}, root or Path.cwd(), rewards, champion,
                      candidate, replay,
                      checkpoints, steps_csv, validated, rollout or cfg.Rollout(),
                      reward or cfg.Reward(), episodes, meter)
    method, settings = algorithm(config.algorithm), config.method
    rows = _read(rewards)
    # GRPO's advantages are scaled as train.grpo.scale_rewards says
    examples, counts = method.examples(rows, **(
        {"scale": settings.scale_rewards} if config.algorithm == "grpo" else {}))
    traced = []
    if specs and config.algorithm == "sft" and validated is not None:
        tokenizer, ends = chat_tokenizer(champion)
        traced, found = trace_conversations(validated, specs, root or Path.cwd(), tokenizer, ends,
                                            context=model_context(champion))
        examples = examples + method.examples(traced)[0]
        counts.update(found)
    if len(specs or {}) > 1:  # the environments' shares of the examples, by weight
        environment_of = {r["task_id"]: r.get("environment") for r in rows + traced}
        examples, counts["examples_by_environment"] = by_weight(examples, environment_of, specs,
                                                                base.seed)
    if config.algorithm == "dpo":
        counts["pairs_from_rollouts"] = len(examples)
        if validated is not None and specs:
            tokenizer, ends = chat_tokenizer(champion)
            more, feedback = method.feedback_pairs(
                rows, encoded_traces(validated, specs, root or Path.cwd(), tokenizer, ends,
                                     thumbs=(True, False), context=model_context(champion)),
                {(e["task_id"], e["completion"]) for e in examples})
            examples = examples + more
            counts.update(feedback)
        counts["pairs_from_feedback"] = len(examples) - counts["pairs_from_rollouts"]
    tmp = candidate.with_name(candidate.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # the thumbs-up traces trained on are stored too: replayed later, and seen by the gate's
    # contamination check
    replayed, available = store_and_replay(rows, replay, config.algorithm,
                                           config.replay_fraction, base.seed, examples, traced)
    hw = trainers.hardware()
    metrics = {"algorithm": config.algorithm, "examples": len(examples), "replayed": len(replayed),
               "replay_available": available, **counts, "device": hw["device"],
               "precision": hw["precision"]}
    if len(examples) < config.min_examples:
        shutil.copytree(champion, tmp)
        io.replace_dir(tmp, candidate)
        reason = (f"{len(examples)} {method.UNIT}, fewer than "
                  f"train.min_examples={config.min_examples}")
        print(f"train: {reason}; the candidate is the champion unchanged", file=sys.stderr)
        if steps_csv is not None:
            io.write_text(steps_csv, _steps_csv([]))
        return {**metrics, "trained": False, "reason": reason}
    data = examples + [{**e, "replayed": True} for e in replayed]
    work = checkpoints / _fingerprint(data, champion, config, base.seed)
    if checkpoints.exists():  # an earlier training's checkpoints can never be resumed
        for stale in checkpoints.iterdir():
            if stale != work:
                shutil.rmtree(stale, ignore_errors=True)
    model, tokenizer = tinylm.load(champion)
    if config.lora_r:
        model = trainers.lora(model, config.lora_r)
    args_for = trainers.ArgumentsFor(
        work, batch_size=config.batch_size, epochs=settings.epochs, lr=settings.lr, seed=base.seed,
        checkpoint_steps=config.checkpoint_steps,
        deepspeed=trainers.deepspeed_config(config.deepspeed, hw["bf16"]))
    # GRPO's ratio is against log-probs recorded at the rollout's temperature (rollout.temperature)
    trainer = method.trainer(model, tokenizer, champion, data, args_for, settings,
                             **({"temperature": temperature} if config.algorithm == "grpo" else {}))
    from transformers import PrinterCallback

    resume = last_checkpoint(work)
    carried = {}
    if resume:
        print(f"train: resuming from {resume}", file=sys.stderr, flush=True)
        if (work / SPENT).is_file():  # the attempts before: counted, not lost
            spent = json.loads((work / SPENT).read_text())
            carried = {key: spent[key] for key in ("cpu_seconds", "wall_seconds")}
            if meter is not None:
                meter.carried = carried
    started = time.time()
    trainer.remove_callback(PrinterCallback)  # prints every step's dict; Progress is enough
    trainer.add_callback(trainers.Progress(config.algorithm))
    trainer.add_callback(Spent(work, carried, meter))
    check = BudgetCheck(meter)
    if meter is not None and meter.limited:
        trainer.add_callback(check)
    result = trainer.train(resume_from_checkpoint=resume)
    if check.stopped is not None:  # the checkpoint of the last step is saved: a rerun resumes
        raise check.stopped
    seconds = time.time() - started
    model = trainer.model
    if config.lora_r:
        model = model.merge_and_unload()
    if int(os.environ.get("RANK", "0")) == 0:
        model = model.to("cpu").float()
        tinylm.save(model, tokenizer, tmp)
        io.replace_dir(tmp, candidate)
        if steps_csv is not None:
            io.write_text(steps_csv, _steps_csv(trainer.state.log_history))
        shutil.rmtree(work, ignore_errors=True)
    history = [h for h in trainer.state.log_history if "loss" in h]
    tail = history[-max(1, len(history) // 10):]
    speeds = [h["tokens_per_second"] for h in history if "tokens_per_second" in h]
    return {**metrics, "trained": True, "steps": trainer.state.global_step,
            # exact, over every step (a resumed run's earlier steps from its checkpoint)
            "trained_tokens": sum(h.get("tokens", 0) for h in history),
            "loss_tokens": sum(h.get("loss_tokens", 0) for h in history),
            "resumed_from_step": int(resume.rsplit("-", 1)[-1]) if resume else 0,
            "final_loss": round(sum(h["loss"] for h in tail) / len(tail), 4),
            "train_seconds": round(seconds, 2), "train_loss": round(result.training_loss, 4),
            "tokens_per_second": round(sorted(speeds)[len(speeds) // 2]) if speeds else None,
            "lora_r": config.lora_r, "deepspeed": config.deepspeed,
            # the earlier attempts' seconds, added to `resources` (io.write_metrics)
            "before_resume": carried}


def online(base: cfg.Base, config: cfg.Train, specs: dict, root: Path, rewards: Path | None,
           champion: Path, candidate: Path, replay: Path, checkpoints: Path,
           steps_csv: Path | None,
           validated: Path | None, rollout: cfg.Rollout, reward: cfg.Reward,
           episodes: Path | None, meter: budgets.Meter | None = None) -> dict:
    """On-policy GRPO (`train.grpo.steps` > 1). Step 1 learns from `rewards`, the rollout
    stage's scored episodes (the champion's own); each later step draws `tasks_per_step` of the
    cycle's tasks and the replay's (`replay_tasks`: earlier cycles', `train.replay_fraction` of
    as many), plays each `samples_per_task` times with the current policy through the rollout
    stage's own loop (`stages.rollout.play`: its backend, chat templates, tool parsers, sandbox,
    judge and MCP tools), scores them with the reward stage's own code (`stages.reward.score`),
    and updates once (`grpo.update`); then the new weights reach the generation servers
    (`stages.weights`: in this process nothing moves; served, a verified push). Each step's
    scored episodes are a Parquet part in `episodes` (an output); the state after each step is
    saved in `checkpoints`, so a kill or a budget stop at step k and a rerun resume at k with
    the same result. With `train.grpo.max_staleness: 1` the next step's episodes are played (on a
    copy of the weights, or on the servers before the push) while a step trains, so generation
    and training overlap; those episodes are one update old, which the truncated importance
    weights correct, and each step's log says its staleness. Returns the stage metrics.
    """
    import torch

    from stages import reward as scoring_code
    from stages import rollout as rollouts
    from stages.training import grpo

    settings = config.grpo
    model, tokenizer = tinylm.load(champion)
    envs, jobs = rollouts.chat_jobs(specs, rollout, root, validated)
    cycle = [(name, task) for name, task, sample in jobs if sample == 0]
    # the steps draw from the cycle's tasks and earlier cycles' (train.replay_fraction of as many)
    replayed, available = replay_tasks(replay, specs, cycle, config.replay_fraction, base.seed,
                                       erasure.Tombstones(root))
    tasks, from_replay = cycle + replayed, {f"{n}:{t['task_id']}" for n, t in replayed}
    # the pool in the work folder's name: a rerun resumes only a run that drew from the same
    work = checkpoints / ("online-" + _fingerprint(
        [{"task": f"{n}:{t['task_id']}", "replayed": f"{n}:{t['task_id']}" in from_replay}
         for n, t in tasks], champion, config, base.seed))
    episodes = episodes or work / "episodes"
    if checkpoints.exists():  # an earlier training's state can never be resumed
        for stale in checkpoints.iterdir():
            if stale != work:
                shutil.rmtree(stale, ignore_errors=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    state, history, start = work / "state.pt", [], 0
    # what served generation processed (and bills) and the seconds used, earlier attempts' too
    usage, carried = {"prompt_tokens": 0, "completion_tokens": 0}, {}
    if state.is_file():
        saved = torch.load(state, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start, history = saved["step"], saved["history"]
        # the attempts before (a budget stop, a kill): counted, not lost, as for `Spent`
        usage, carried = saved.get("usage", usage), saved.get("spent", {})
        if meter is not None:
            meter.carried = carried
        print(f"train: resuming on-policy GRPO at step {start + 1}", file=sys.stderr, flush=True)
    since_cpu = meter.since_cpu if meter is not None else 0.0
    since_wall = meter.since_wall if meter is not None else io.STARTED
    episodes.mkdir(parents=True, exist_ok=True)
    # max_staleness 1: the state after step k was saved once step k+1's episodes were played
    # (with the weights before step k's update) and stored: that part is the next step's
    overlap = settings.max_staleness > 0
    for part in episodes.glob("step-*.parquet"):  # a part no saved state accounts for
        if int(part.stem.split("-")[1]) > start + (1 if overlap and start else 0):
            part.unlink()
    # step 1: the rollout stage's scored episodes (the champion's: on-policy for it), where
    # there are any; the later steps play their own
    first = [r for r in _read(rewards) if r["reward"] is not None] \
        if rewards is not None and rewards.exists() else None
    served = rollout.backend == "openai"
    with contextlib.ExitStack() as stack:
        sync = _Sync(stack, rollout, champion, work, model, tokenizer) if served else None
        from stages.envs import contract

        # one pool of reward workers for every step (spawning one per step costs seconds)
        scoring = stack.enter_context(scoring_code.scorer(
            {name: contract.load(name, spec.module, root) for name, spec in specs.items()},
            {name: spec.module for name, spec in specs.items()}, root, reward.workers,
            reward.ray_address, reward.stall_seconds))
        pad = trainers.pad_id(tokenizer)
        # max_staleness 1: the next step's episodes are played on this thread while one trains
        ahead_pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="ahead"))

        def policy_now():
            """The policy as its weights are now: the servers', or a copy of the model here
            (a copy: with max_staleness 1 the model is trained while the copy plays).
            """
            if served:
                return sync.policy()
            here = copy.deepcopy(model) if overlap else model
            return rollouts.Policy.local(champion, model=here, tokenizer=tokenizer)

        def produce(step: int, policy, version: int) -> dict:
            """Play, score and store `step`'s episodes with `policy` (the weights after
            `version` updates); what the step's log needs of them.
            """
            began = time.monotonic()
            chosen = random.Random(f"{base.seed}/{step}").sample(
                tasks, min(settings.tasks_per_step, len(tasks)))
            step_jobs = [(name, task, sample) for name, task in chosen
                         for sample in range(settings.samples_per_task)]
            again = sum(f"{name}:{task['task_id']}" in from_replay for name, task in chosen)
            played = rollouts.play(base, rollout, envs, step_jobs, policy,
                                   salt=f"/step{step}", progress=False)
            generated = time.monotonic() - began
            table = pa.Table.from_pylist(played.rows, schema=rollouts.SCHEMA)
            scored, _ = scoring_code.score(specs, table, root, reward, scoring=scoring)
            scored = scored.append_column("step", pa.array([step + 1] * len(scored), pa.int32()))
            log = {"generate_seconds": round(generated, 2), "episodes": len(played.rows),
                   "generated_tokens": rollouts.token_counts(played.rows)["generated_tokens"],
                   "policy_version": version, "replay_tasks": again,
                   "prompt_tokens": sum(stat.prompt_tokens for stat in played.stats),
                   "completion_tokens": sum(stat.completion_tokens for stat in played.stats)}
            io.write_parquet(episodes / f"step-{step + 1:05d}.parquet", scored.replace_schema_metadata(
                {**(scored.schema.metadata or {}), b"offseason.played": json.dumps(log)}))
            return log

        def stored(step: int) -> dict | None:
            """A step's episodes as `produce` stored them (played ahead before a kill)."""
            part = episodes / f"step-{step + 1:05d}.parquet"
            meta = pq.read_schema(part).metadata or {} if part.exists() else {}
            return json.loads(meta[b"offseason.played"]) if b"offseason.played" in meta else None

        def rows_of(step: int) -> list[dict]:
            return [r for r in pq.read_table(episodes / f"step-{step + 1:05d}.parquet")
                    .to_pylist() if r["reward"] is not None]

        ahead = None  # max_staleness 1: (step, the future of its episodes, played meanwhile)
        for step in range(start, settings.steps):
            if step == 0 and first is not None:
                # the rollout stage's episodes are the champion's own: step 1 learns from them
                rows, log = first, {"generate_seconds": 0.0, "episodes": len(first),
                                    "generated_tokens": 0, "policy_version": 0,
                                    "replay_tasks": 0}
            else:
                if ahead is not None and ahead[0] == step:
                    log = ahead[1].result()  # played while the step before trained
                elif overlap and step == start and (kept := stored(step)) is not None:
                    log = kept  # played ahead before a kill; its usage is counted
                else:
                    log = produce(step, policy_now(), step)
                    usage["prompt_tokens"] += log["prompt_tokens"]
                    usage["completion_tokens"] += log["completion_tokens"]
                rows = rows_of(step)
            ahead = None
            if overlap and step + 1 < settings.steps:
                # the next step's episodes, played with these weights while this step trains
                ahead = (step + 1, ahead_pool.submit(produce, step + 1, policy_now(), step))
            generated = log["generate_seconds"]
            groups, flat = grpo.examples(rows, settings.scale_rewards)
            trained = time.monotonic()
            torch.manual_seed(base.seed * 100_003 + step)  # the same update on a resumed run
            stats = grpo.update(model, groups, optimizer, settings, pad=pad,
                                batch_size=config.batch_size, temperature=rollout.temperature,
                                is_cap=settings.importance_cap) if groups else \
                {"loss": 0.0, "optimizer_steps": 0}
            if ahead is not None:  # the next step's episodes done before the weights move
                played_ahead = ahead[1].result()
                usage["prompt_tokens"] += played_ahead["prompt_tokens"]
                usage["completion_tokens"] += played_ahead["completion_tokens"]
            sync_seconds = sync.push(step + 1) if served else 0.0
            # step 1's episodes are the rollout stage's: generated there, counted there
            made = log["generated_tokens"]
            rewards_now = [r["reward"] for r in rows]
            mean = sum(rewards_now) / max(1, len(rewards_now))
            history.append({
                "step": step + 1, **stats, "learning_rate": settings.lr,
                "episodes": log["episodes"], "replay_tasks": log["replay_tasks"],
                "reward_mean": round(mean, 4),
                "reward_std": round((sum((r - mean) ** 2 for r in rewards_now)
                                     / max(1, len(rewards_now))) ** 0.5, 4),
                "correct_rate": round(sum(r["correct"] or 0 for r in rows) / max(1, len(rows)), 4),
                "groups": len(groups), **flat, "generate_seconds": round(generated, 2),
                "train_seconds": round(time.monotonic() - trained - sync_seconds, 2),
                "weight_sync_seconds": round(sync_seconds, 3),
                # updates between the weights that played the episodes and those they train
                "staleness": step - log["policy_version"],
                "generated_tokens": made,
                "tokens_per_second": round(made / generated) if generated else None})
            print(f"train: step {step + 1}/{settings.steps}: reward {mean:.3f}, "
                  f"{len(groups)} groups with spread ({log['replay_tasks']} tasks from the "
                  f"replay), loss {stats['loss']:.4f}", file=sys.stderr, flush=True)
            tmp = state.with_suffix(".tmp")
            work.mkdir(parents=True, exist_ok=True)
            spent = {"cpu_seconds": round(carried.get("cpu_seconds", 0.0)
                                          + io.resources()["cpu_seconds"] - since_cpu, 3),
                     "wall_seconds": round(carried.get("wall_seconds", 0.0)
                                           + time.monotonic() - since_wall, 3)}
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1, "history": history, "usage": usage, "spent": spent},
                       tmp)
            os.replace(tmp, state)
            if meter is not None:
                meter.check(f"{step + 1} of {settings.steps} on-policy steps (saved: a rerun "
                            f"resumes at step {step + 2})", f"{settings.steps - step - 1} steps",
                            served_tokens=usage["prompt_tokens"] + usage["completion_tokens"])
    tmp = candidate.with_name(candidate.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tinylm.save(model.to("cpu").float(), tokenizer, tmp)
    io.replace_dir(tmp, candidate)
    if steps_csv is not None:
        io.write_text(steps_csv, _steps_csv(history))
    # the episodes trained on are stored for replay and the gate's contamination check
    every = (first or []) + [r for part in sorted(episodes.glob("step-*.parquet"))
                             for r in pq.read_table(part).to_pylist() if r["reward"] is not None]
    store_and_replay(every, replay, "grpo", 0.0, base.seed, [])
    shutil.rmtree(work, ignore_errors=True)
    hw = trainers.hardware()
    updated = sum(h.get("optimizer_steps", 0) for h in history)
    if not updated:
        print("train: no on-policy step had a group with a reward spread; the candidate is the "
              "champion unchanged", file=sys.stderr)
    return {"algorithm": "grpo", "online": True, "trained": bool(updated), "steps": len(history),
            "optimizer_steps": sum(h.get("optimizer_steps", 0) for h in history),
            "examples": sum(h["groups"] for h in history),
            "episodes": sum(h["episodes"] for h in history),
            # the tasks the steps drew from: the cycle's and the replay's (of those available)
            "cycle_tasks": len(cycle), "replay_tasks_in_pool": len(replayed),
            "replay_tasks_available": available,
            "replay_tasks_drawn": sum(h["replay_tasks"] for h in history),
            "groups_without_spread": sum(h.get("groups_without_spread", 0) for h in history),
            "reward_first_step": history[0]["reward_mean"] if history else None,
            "reward_last_step": history[-1]["reward_mean"] if history else None,
            "weight_sync_seconds": round(sum(h["weight_sync_seconds"] for h in history), 3),
            "generate_seconds": round(sum(h["generate_seconds"] for h in history), 2),
            "train_seconds": round(sum(h["train_seconds"] for h in history), 2),
            "generated_tokens": sum(h["generated_tokens"] for h in history),
            "loss_tokens": sum(h.get("loss_tokens", 0) for h in history),
            "resumed_from_step": start, "device": hw["device"], "precision": hw["precision"],
            # the earlier attempts' seconds, added to `resources` (io.write_metrics)
            "before_resume": carried,
            # served generation is priced like the rollout stage's (budget.served_tokens)
            "backend": rollout.backend, **({"served_usage": usage} if served else {}),
            "lora_r": config.lora_r, "deepspeed": config.deepspeed}


class _Sync:
    """The generation servers of on-policy steps (`rollout.backend: openai`): one started with
    `runtime.rollout.server_command` on a copy of the champion, or `runtime.rollout.urls`; after
    each step the policy's weights are written to a folder the servers read and pushed to every
    one, verified (`stages.weights`), before the next step plays.
    """

    def __init__(self, stack: contextlib.ExitStack, rollout: cfg.Rollout, champion: Path,
                 work: Path, model, tokenizer):
        """Start or reach the servers; the first push follows the first step."""
        from stages import weights
        from stages.generation import openai_backend

        self.model, self.tokenizer, self.work = model, tokenizer, work
        self.folder = work / "serving"
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.copytree(champion, self.folder)
        self.urls = openai_backend.servers(rollout, self.folder, stack)
        self.replicas = [weights.Replica(url=url, model=rollout.model) for url in self.urls]
        self.champion = champion
        # probes: the start of the tokenizer's own vocabulary, a few fixed short prompts
        self.probes = [[i % len(tokenizer) for i in range(k, k + 4)] for k in (1, 11, 21)]

    def policy(self):
        """The served policy, as the rollout stage's loop takes it."""
        from stages import rollout as rollouts

        return rollouts.Policy.served(self.champion, self.urls)

    def push(self, version: int) -> float:
        """Write the weights, push them to every server as `version`, verified; the seconds."""
        from stages import weights

        started = time.monotonic()
        out = self.work / f"push-{version}"
        tinylm.save(self.model, self.tokenizer, out)
        weights.push_verified(self.replicas, out, str(version), self.model, self.probes)
        for old in self.work.glob("push-*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
        return time.monotonic() - started


def main(argv: list[str] | None = None) -> None:
    """Train the candidate (the DVC stage's command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("rewards", "champion", "candidate", "replay", "checkpoints", "metrics",
                 "steps"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--validated", type=Path,
                        help="data/validated.parquet: DPO also learns from the traces' thumbs")
    parser.add_argument("--episodes", type=Path,
                        help="data/train_episodes: on-policy GRPO's scored episodes, a part per "
                             "step (train.grpo.steps > 1)")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    io.watch_gpus()  # per GPU busy seconds, peak memory (the cost ledger); none: nothing
    base, config = cfg.load("base", args.params), cfg.load("train", args.params)
    rollout = cfg.load("rollout", args.params)
    if args.episodes is not None:  # a DVC out: present (empty) when training is not on-policy
        args.episodes.mkdir(parents=True, exist_ok=True)
    trainers.relaunch_on_gpus(config.deepspeed, "stages.train", sys.argv[1:])
    metrics = run(base, config, args.rewards, args.champion, args.candidate, args.replay,
                  args.checkpoints, args.steps, args.validated, cfg.environments(args.params),
                  Path(args.params).resolve().parent,
                  rollout.temperature, budgets.Meter.of("train", args.params), rollout,
                  cfg.load("reward", args.params), args.episodes)
    if int(os.environ.get("RANK", "0")) == 0:
        io.write_metrics(args.metrics, metrics, carried=metrics.get("before_resume"))


if __name__ == "__main__":
    with budgets.stops_cleanly("train"), io.explained("train"):
        main()
    io.exit_soon()
