"""Train: a better candidate from the champion's scored rollouts, by SFT, DPO or GRPO.

Reads `data/rewards.parquet`, `models/champion` and (for DPO's feedback pairs, with
`--validated`) `data/validated.parquet`; writes `models/candidate` (a Hugging Face model
folder), this cycle's scored rollouts into `data/replay/` (a persistent DVC output: one Parquet
part per cycle), `metrics/train.json` and `metrics/train_steps.csv` (loss, learning rate, gradient
norm and tokens/s per optimizer step: a DVC plot, and the flow logs it to the stage's MLflow run).
`train.algorithm` picks how the rollouts are used (every loss is on the model's own tokens only,
never on the prompt or on a tool result the environment injected):

- `sft`: rejection-sampling fine-tuning on the verified-correct episodes (once per distinct
  completion of a task), through the transformers Trainer;
- `dpo`: preference pairs from the same task's higher- and lower-reward episodes, and from the
  traces' thumbs (the trace's own answer against a rollout of its task, only where the verifier
  agrees with the thumbs: `feedback_pairs`), through TRL's DPOTrainer with the champion as the
  explicit reference model;
- `grpo`: group-relative advantages over each task's samples and a clipped ratio against the
  log-probabilities recorded at rollout time, optionally a KL term to the champion: our loss on
  the transformers Trainer (TRL's GRPO generates online, which would fold rollout and reward into
  training).

`train.replay_fraction` of the earlier cycles' examples (SFT examples, DPO pairs or GRPO groups,
rebuilt from the stored rollouts) is mixed in. `train.lora_r` > 0 trains LoRA adapters (PEFT) and
merges them into full weights. `train.deepspeed` runs the Trainer under DeepSpeed ZeRO. With fewer
than `train.min_examples` examples there is nothing sound to learn from: the champion is written
unchanged as the candidate, the metrics say why, and the gate has nothing to promote.

Checkpoints go to the folder given as `checkpoints` (`models/candidate.ckpt` in dvc.yaml). It is
deliberately not a DVC output: DVC deletes a stage's outputs before it runs the stage again, which
would throw away exactly what a killed run left to resume from, and a persistent output would be
cached and pushed every cycle for nothing. It is git-ignored, keyed by a hash of everything the run
depends on (data, champion, params), so only a rerun of the same training resumes from it, and it
is deleted once the candidate is written.

    python -m stages.train data/rewards.parquet models/champion models/candidate data/replay \
        models/candidate.ckpt metrics/train.json metrics/train_steps.csv \
        --validated data/validated.parquet
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io as textio
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import io, tinylm, trainers
from stages.environments import ENVIRONMENTS

REPLAY = pa.schema([("task_id", pa.string()), ("completion", pa.string()),
                    ("token_ids", pa.list_(pa.int32())), ("model_mask", pa.list_(pa.int8())),
                    ("logprobs", pa.list_(pa.float32())), ("correct", pa.float64()),
                    ("reward", pa.float64())])
STEP_COLUMNS = ["step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "epoch"]


# --- examples: what each algorithm learns from, built from scored rollouts -----------------------

def _by_task(rows: list[dict]) -> dict[str, list[dict]]:
    tasks: dict[str, list[dict]] = {}
    for row in rows:
        if row["reward"] is not None:
            tasks.setdefault(row["task_id"], []).append(row)
    return {task: tasks[task] for task in sorted(tasks)}


def sft_examples(rows: list[dict]) -> tuple[list[dict], dict]:
    """The verified-correct episodes, once per distinct completion of a task, in a fixed order."""
    unique = {}
    for row in rows:
        if row["correct"] == 1.0:
            unique.setdefault((row["task_id"], row["completion"]),
                              {k: row[k] for k in ("task_id", "completion", "token_ids",
                                                   "model_mask")})
    return [unique[key] for key in sorted(unique)], {}


def _prompt_length(mask: list[int]) -> int:
    return next((i for i, m in enumerate(mask) if m), len(mask))


def dpo_pairs(rows: list[dict]) -> tuple[list[dict], dict]:
    """Per task: each distinct best-reward completion against a distinct lower-reward one.

    The prompt is the leading run of tokens the model did not choose; chosen and rejected are the
    rest, with their masks (tool results inside them are not the model's).
    """
    pairs, no_pair = [], 0
    for task, group in _by_task(rows).items():
        best = max(r["reward"] for r in group)
        distinct = {}
        for row in group:
            distinct.setdefault(row["completion"], row)
        hi = [r for c, r in sorted(distinct.items()) if r["reward"] == best]
        lo = [r for c, r in sorted(distinct.items()) if r["reward"] < best]
        if not lo:
            no_pair += 1
            continue
        for i in range(max(len(hi), len(lo))):
            chosen, rejected = hi[i % len(hi)], lo[i % len(lo)]
            cut = _prompt_length(chosen["model_mask"])
            rcut = _prompt_length(rejected["model_mask"])
            pairs.append({
                "task_id": task, "completion": f"{chosen['completion']}\x00{rejected['completion']}",
                "prompt_ids": chosen["token_ids"][:cut],
                "chosen_ids": chosen["token_ids"][cut:], "chosen_mask": chosen["model_mask"][cut:],
                "rejected_ids": rejected["token_ids"][rcut:],
                "rejected_mask": rejected["model_mask"][rcut:]})
    return pairs, {"tasks_without_pair": no_pair}


def _injected_as_env(env, completion: str) -> bool:
    """Whether every tool result in `completion` is what the environment itself would inject
    (`encode_completion` masks exactly that many tokens after each call, as a rollout does).
    """
    pos = 0
    while (close := completion.find(env.TOOL_CLOSE, pos)) >= 0:
        end = close + len(env.TOOL_CLOSE)
        injected = env.on_tool_close(completion[:end])
        if not completion.startswith(injected, end):
            return False
        pos = end + len(injected)
    return True


def feedback_pairs(rows: list[dict], traces: list[dict], env, tokenizer,
                   taken: set | None = None) -> tuple[list[dict], dict]:
    """Pairs from the traces' thumbs: the trace's own answer against one of its task's rollouts.

    A thumbs-down answer the verifier scores wrong is `rejected` against the task's best verified-
    correct rollout; a thumbs-up answer the verifier scores correct is `chosen` against its worst
    failing rollout. Feedback never overrules the verifier: a thumbs-up answer it scores wrong (or a
    thumbs-down one it scores correct) is not used, only counted. The trace's answer is written in
    the model's text by `env.completion_from_messages` and tokenized with the champion's tokenizer,
    mask 1 on its own tokens and 0 on the tool results, like a rollout. `taken`: the (task_id,
    completion) keys of the rollout pairs, so the same pair is not added twice.
    """
    from stages.init import encode_completion

    tasks = _by_task(rows)
    counts = dict.fromkeys(("feedback_traces", "thumbs_up_verifier_wrong",
                            "thumbs_down_verifier_correct", "feedback_unusable",
                            "feedback_without_partner"), 0)
    pairs = []
    for trace in sorted(traces, key=lambda t: t["trace_id"]):
        group = tasks.get(trace["trace_id"])
        if trace["thumbs_up"] is None or not group:
            continue
        counts["feedback_traces"] += 1
        completion = env.completion_from_messages(json.loads(trace["messages"]))
        verdict = None if completion is None else \
            env.verify(trace["question"], trace["answer"], completion)
        if verdict is None or not _injected_as_env(env, completion):
            counts["feedback_unusable"] += 1
            continue
        ids, mask = encode_completion(tokenizer, env, env.prompt(trace["question"]), completion)
        if tokenizer.unk_token_id in ids:
            counts["feedback_unusable"] += 1
            continue
        if trace["thumbs_up"] and verdict < 1.0:
            counts["thumbs_up_verifier_wrong"] += 1
            continue
        if not trace["thumbs_up"] and verdict == 1.0:
            counts["thumbs_down_verifier_correct"] += 1
            continue
        ranked = sorted((r for r in group if r["correct"] is not None),
                        key=lambda r: (-r["reward"], r["completion"]))
        if trace["thumbs_up"]:
            partner = next((r for r in reversed(ranked) if r["correct"] < 1.0), None)
        else:
            partner = next((r for r in ranked if r["correct"] == 1.0), None)
        if partner is None:
            counts["feedback_without_partner"] += 1
            continue
        own = {"token_ids": ids, "model_mask": mask, "completion": completion}
        chosen, rejected = (own, partner) if trace["thumbs_up"] else (partner, own)
        key = (trace["trace_id"], f"{chosen['completion']}\x00{rejected['completion']}")
        if key in (taken or set()):
            continue
        cut, rcut = _prompt_length(chosen["model_mask"]), _prompt_length(rejected["model_mask"])
        pairs.append({
            "task_id": key[0], "completion": key[1], "prompt_ids": chosen["token_ids"][:cut],
            "chosen_ids": chosen["token_ids"][cut:], "chosen_mask": chosen["model_mask"][cut:],
            "rejected_ids": rejected["token_ids"][rcut:],
            "rejected_mask": rejected["model_mask"][rcut:]})
    return pairs, counts


def read_traces(validated: Path) -> list[dict]:
    """The validated traces that carry a thumbs signal, with their task."""
    table = pq.read_table(validated, columns=["trace_id", "messages", "thumbs_up", "question",
                                              "answer"], filters=[("thumbs_up", "in", [True, False])])
    return table.to_pylist()


def grpo_groups(rows: list[dict]) -> tuple[list[dict], dict]:
    """One group per task with its episodes' advantages: (reward - mean) / std within the group.

    A group whose samples all got the same reward has no advantage to learn from: counted, dropped.
    """
    groups, flat = [], 0
    for task, group in _by_task(rows).items():
        rewards = [r["reward"] for r in group]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        if std == 0 or any(r.get("logprobs") is None for r in group):
            flat += 1
            continue
        groups.append({"task_id": task, "completion": "\x00".join(r["completion"] for r in group),
                       "episodes": [{"token_ids": r["token_ids"], "model_mask": r["model_mask"],
                                     "logprobs": r["logprobs"],
                                     "advantage": (r["reward"] - mean) / std} for r in group]})
    return groups, {"groups_without_spread": flat}


EXAMPLES = {"sft": sft_examples, "dpo": dpo_pairs, "grpo": grpo_groups}


def examples_from(rewards: Path) -> list[dict]:
    """The SFT examples of a rewards file (kept for callers of the SFT-only stage)."""
    return sft_examples(_read(rewards))[0]


def _read(rewards: Path) -> list[dict]:
    names = pq.read_schema(rewards).names
    columns = [c for c in ("task_id", "completion", "correct", "reward", "token_ids",
                           "model_mask", "logprobs") if c in names]
    return pq.read_table(rewards, columns=columns).to_pylist()


def store_and_replay(rows: list[dict], replay: Path, algorithm: str, fraction: float, seed: int,
                     current: list[dict]) -> tuple[list[dict], int]:
    """Save this cycle's scored rollouts as a replay part; returns a sample of the examples that
    the earlier parts give for `algorithm` (those not among this cycle's `current` examples).

    The part is named by its content, so a stage killed after writing it and run again neither
    duplicates it nor replays it as if it were earlier data. Parts written before the stage stored
    every rollout hold only verified-correct examples: they read as reward 1 (for GRPO, a group
    without spread).
    """
    replay.mkdir(parents=True, exist_ok=True)
    stored = [{"task_id": r["task_id"], "completion": r["completion"], "token_ids": r["token_ids"],
               "model_mask": r["model_mask"], "logprobs": r.get("logprobs"),
               "correct": r["correct"], "reward": r["reward"]} for r in rows]
    digest = hashlib.sha256(repr([(r["task_id"], r["completion"], r["reward"])
                                  for r in stored]).encode())
    part = replay / f"part-{digest.hexdigest()[:16]}.parquet"
    earlier = []
    for path in sorted(replay.glob("part-*.parquet")):
        if path != part:
            old = pq.read_table(path).to_pylist()
            for row in old:
                row.setdefault("correct", 1.0)
                row.setdefault("reward", 1.0)
            earlier.extend(EXAMPLES[algorithm](old)[0])
    if stored:
        io.write_parquet(part, pa.Table.from_pylist(stored, schema=REPLAY))
    seen = {(e["task_id"], e["completion"]) for e in current}
    earlier = [e for e in earlier if (e["task_id"], e["completion"]) not in seen]
    chosen = random.Random(seed).sample(earlier, round(fraction * len(earlier)))
    return chosen, len(earlier)


# --- training, one function per algorithm --------------------------------------------------------

def _lora(model, r: int):
    from peft import LoraConfig, get_peft_model

    # GPT-2's projections are Conv1D layers (weights stored transposed): fan_in_fan_out
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                            target_modules="all-linear", fan_in_fan_out=True))


def train_sft(model, tokenizer, champion: Path, examples: list[dict], args_for, config: cfg.Train):
    from datasets import Dataset

    data = Dataset.from_list([{"token_ids": e["token_ids"], "model_mask": e["model_mask"]}
                              for e in examples])
    steps = trainers.total_steps(len(data), config.batch_size, config.epochs)
    return trainers.SFTTrainer(
        model=model, args=args_for(steps), train_dataset=data,
        data_collator=trainers.collate_sft(tokenizer.bos_token_id, tokenizer.eos_token_id,
                                           tokenizer.pad_token_id))


def train_grpo(model, tokenizer, champion: Path, groups: list[dict], args_for, config: cfg.Train):
    from datasets import Dataset

    rows = [dict(e) for g in groups for e in g["episodes"]]
    if config.kl_coef or any(g.get("replayed") for g in groups):
        reference, _ = tinylm.load(champion)
        trainers.reference_logprobs(reference, rows, tokenizer.bos_token_id,
                                    tokenizer.pad_token_id, config.batch_size)
        for row, replayed in zip(rows, [g.get("replayed", False) for g in groups
                                        for _ in g["episodes"]]):
            if replayed:  # recorded by an older policy: the ratio is taken against the champion
                row["logprobs"] = row["ref_logprobs"]
    for row in rows:
        row.setdefault("ref_logprobs", None)
    data = Dataset.from_list(rows)
    steps = trainers.total_steps(len(data), config.batch_size, config.epochs)
    return trainers.GRPOTrainer(
        model=model, args=args_for(steps), train_dataset=data,
        data_collator=trainers.collate_grpo(tokenizer.bos_token_id, tokenizer.pad_token_id),
        clip=config.clip, kl_coef=config.kl_coef)


def train_dpo(model, tokenizer, champion: Path, pairs: list[dict], args_for, config: cfg.Train):
    from stages import dpo

    return dpo.trainer(model, tokenizer, champion, pairs, args_for, config)


TRAIN = {"sft": train_sft, "dpo": train_dpo, "grpo": train_grpo}


def _fingerprint(examples: list[dict], champion: Path, config: cfg.Train, seed: int) -> str:
    digest = hashlib.sha256()
    digest.update((champion / "model.safetensors").read_bytes())
    digest.update(repr((sorted(asdict(config).items()), seed)).encode())
    for example in examples:
        digest.update(repr(sorted(example.items())).encode())
    return digest.hexdigest()[:16]


def last_checkpoint(work: Path) -> str | None:
    """The newest complete checkpoint in `work` (the Trainer writes trainer_state.json last, so a
    folder without it is one the run was killed while saving: deleted).
    """
    if not work.exists():
        return None
    found = {}
    for folder in work.glob("checkpoint-*"):
        if (folder / "trainer_state.json").exists():
            found[int(folder.name.rsplit("-", 1)[-1])] = folder
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return str(found[max(found)]) if found else None


def _steps_csv(history: list[dict]) -> str:
    rows = [h for h in history if "loss" in h]
    extra = sorted({k for h in rows for k in h} - set(STEP_COLUMNS))
    out = textio.StringIO()
    writer = csv.DictWriter(out, fieldnames=STEP_COLUMNS + extra, extrasaction="ignore")
    writer.writeheader()
    for h in rows:
        writer.writerow(h)
    return out.getvalue()


def run(base: cfg.Base, config: cfg.Train, rewards: Path, champion: Path, candidate: Path,
        replay: Path, checkpoints: Path | None = None, steps_csv: Path | None = None,
        validated: Path | None = None) -> dict:
    """Train and write the candidate; returns the stage metrics. `validated`: the traces whose
    feedback adds DPO pairs (see `feedback_pairs`).
    """
    tinylm.set_threads(base.threads)
    checkpoints = checkpoints or candidate.with_name(candidate.name + ".ckpt")
    rows = _read(rewards)
    examples, counts = EXAMPLES[config.algorithm](rows)
    if config.algorithm == "dpo":
        counts["pairs_from_rollouts"] = len(examples)
        if validated is not None:
            from transformers import AutoTokenizer

            more, feedback = feedback_pairs(
                rows, read_traces(validated), ENVIRONMENTS[base.environment],
                AutoTokenizer.from_pretrained(champion),
                {(e["task_id"], e["completion"]) for e in examples})
            examples = examples + more
            counts.update(feedback)
        counts["pairs_from_feedback"] = len(examples) - counts["pairs_from_rollouts"]
    tmp = candidate.with_name(candidate.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    replayed, available = store_and_replay(rows, replay, config.algorithm, config.replay_fraction,
                                           base.seed, examples)
    hw = trainers.hardware()
    metrics = {"algorithm": config.algorithm, "examples": len(examples), "replayed": len(replayed),
               "replay_available": available, **counts, "device": hw["device"],
               "precision": hw["precision"]}
    if len(examples) < config.min_examples:
        shutil.copytree(champion, tmp)
        io.replace_dir(tmp, candidate)
        unit = {"sft": "verified-correct rollouts", "dpo": "preference pairs",
                "grpo": "task groups with a reward spread"}[config.algorithm]
        reason = f"{len(examples)} {unit}, fewer than train.min_examples={config.min_examples}"
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
        model = _lora(model, config.lora_r)
    ds = trainers.deepspeed_config(config.deepspeed, hw["bf16"])

    def args_for(steps: int, cls=None, **extra):
        return trainers.arguments(work, steps=steps, batch_size=config.batch_size, lr=config.lr,
                                  seed=base.seed, checkpoint_steps=config.checkpoint_steps,
                                  deepspeed=ds, **({"cls": cls} if cls else {}), **extra)

    trainer = TRAIN[config.algorithm](model, tokenizer, champion, data, args_for, config)
    from transformers import PrinterCallback

    resume = last_checkpoint(work)
    if resume:
        print(f"train: resuming from {resume}", file=sys.stderr, flush=True)
    started = time.time()
    trainer.remove_callback(PrinterCallback)  # prints every step's dict; Progress is enough
    trainer.add_callback(trainers.Progress(config.algorithm))
    result = trainer.train(resume_from_checkpoint=resume)
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
            "resumed_from_step": int(resume.rsplit("-", 1)[-1]) if resume else 0,
            "final_loss": round(sum(h["loss"] for h in tail) / len(tail), 4),
            "train_seconds": round(seconds, 2), "train_loss": round(result.training_loss, 4),
            "tokens_per_second": round(sorted(speeds)[len(speeds) // 2]) if speeds else None,
            "lora_r": config.lora_r, "deepspeed": config.deepspeed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("rewards", "champion", "candidate", "replay", "checkpoints", "metrics",
                 "steps"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--validated", type=Path,
                        help="data/validated.parquet: DPO also learns from the traces' thumbs")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    base, config = cfg.load("base", args.params), cfg.load("train", args.params)
    trainers.relaunch_on_gpus(config.deepspeed, "stages.train", sys.argv[1:])
    metrics = run(base, config, args.rewards, args.champion, args.candidate, args.replay,
                  args.checkpoints, args.steps, args.validated)
    if int(os.environ.get("RANK", "0")) == 0:
        io.write_json(args.metrics, metrics)


if __name__ == "__main__":
    main()
