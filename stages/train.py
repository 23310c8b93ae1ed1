"""Train: supervised fine-tuning of the champion on its own verified-correct rollouts.

Reads `data/rewards.parquet` and `models/champion`; writes `models/candidate` (a Hugging Face
model folder) and `metrics/train.json`. This is rejection-sampling fine-tuning: keep the episodes
the verifier marked correct (once per distinct completion of a task), train for `train.epochs`
passes with the loss on the model's own tokens only (not the prompt, not the tool's replies).
With fewer than `train.min_examples` examples there is nothing sound to learn from: the champion is
written unchanged as the candidate, the metrics say so, and the gate has nothing to promote.

    python -m stages.train data/rewards.parquet models/champion models/candidate metrics/train.json
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq

from stages import config as cfg
from stages import io, sft, tinylm


def examples_from(rewards: Path) -> list[tuple[list[int], list[int]]]:
    rows = pq.read_table(rewards, columns=["task_id", "completion", "correct", "token_ids",
                                           "model_mask"]).to_pylist()
    unique = {}
    for row in rows:
        if row["correct"] == 1.0:
            unique.setdefault((row["task_id"], row["completion"]),
                              (row["token_ids"], row["model_mask"]))
    return [unique[key] for key in sorted(unique)]


def run(base: cfg.Base, config: cfg.Train, rewards: Path, champion: Path, candidate: Path) -> dict:
    """Fine-tune and write the candidate; returns the stage metrics."""
    tinylm.set_threads(base.threads)
    examples = examples_from(rewards)
    tmp = candidate.with_name(candidate.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if len(examples) < config.min_examples:
        shutil.copytree(champion, tmp)
        io.replace_dir(tmp, candidate)
        print(f"train: only {len(examples)} verified-correct examples (train.min_examples="
              f"{config.min_examples}); the candidate is the champion unchanged", file=sys.stderr)
        return {"trained": False, "examples": len(examples),
                "reason": f"fewer than train.min_examples={config.min_examples} verified-correct "
                          f"rollouts"}
    model, tokenizer = tinylm.load(champion)
    steps = math.ceil(config.epochs * len(examples) / config.batch_size)
    metrics = sft.train(model, sft.epoch_batches(examples, config.batch_size, base.seed),
                        steps=steps, lr=config.lr, tokenizer=tokenizer, seed=base.seed)
    tinylm.save(model, tokenizer, tmp)
    io.replace_dir(tmp, candidate)
    return {"trained": True, "examples": len(examples), **metrics}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("rewards", "champion", "candidate", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("base", args.params), cfg.load("train", args.params), args.rewards,
                  args.champion, args.candidate)
    io.write_json(args.metrics, metrics)


if __name__ == "__main__":
    main()
