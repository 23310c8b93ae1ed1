"""Train: supervised fine-tuning of the champion on its own verified-correct rollouts.

Reads `data/rewards.parquet` and `models/champion`; writes `models/candidate` (a Hugging Face
model folder), this cycle's examples into `data/replay/` (a persistent DVC output: one Parquet part
per cycle) and `metrics/train.json`. This is rejection-sampling fine-tuning: keep the episodes the
verifier marked correct (once per distinct completion of a task), add `train.replay_fraction` of
the earlier cycles' examples (so the model keeps what it learned, and copying keeps improving), and
train for `train.epochs` passes with the loss on the model's own tokens only (not the prompt, not
the tool's replies). With fewer than `train.min_examples` new examples there is nothing sound to
learn from: the champion is written unchanged as the candidate, the metrics say so, and the gate
has nothing to promote.

    python -m stages.train data/rewards.parquet models/champion models/candidate data/replay metrics/train.json
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import io, sft, tinylm

REPLAY = pa.schema([("task_id", pa.string()), ("completion", pa.string()),
                    ("token_ids", pa.list_(pa.int32())), ("model_mask", pa.list_(pa.int8()))])


def examples_from(rewards: Path) -> list[dict]:
    """The verified-correct episodes, once per distinct completion of a task, in a fixed order."""
    rows = pq.read_table(rewards, columns=["task_id", "completion", "correct", "token_ids",
                                           "model_mask"]).to_pylist()
    unique = {}
    for row in rows:
        if row["correct"] == 1.0:
            unique.setdefault((row["task_id"], row["completion"]),
                              {k: row[k] for k in REPLAY.names})
    return [unique[key] for key in sorted(unique)]


def store_and_replay(examples: list[dict], replay: Path, fraction: float, seed: int
                     ) -> tuple[list[dict], int]:
    """Save this cycle's examples as a replay part; returns a sample of the earlier parts' ones.

    The part is named by its content, so a stage killed after writing it and run again neither
    duplicates it nor replays it as if it were earlier data.
    """
    replay.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(repr([(e["task_id"], e["completion"]) for e in examples]).encode())
    part = replay / f"part-{digest.hexdigest()[:16]}.parquet"
    earlier = []
    for path in sorted(replay.glob("part-*.parquet")):
        if path != part:
            earlier.extend(pq.read_table(path).to_pylist())
    if examples:
        io.write_parquet(part, pa.Table.from_pylist(examples, schema=REPLAY))
    seen = {(e["task_id"], e["completion"]) for e in examples}
    earlier = [e for e in earlier if (e["task_id"], e["completion"]) not in seen]
    chosen = random.Random(seed).sample(earlier, round(fraction * len(earlier)))
    return chosen, len(earlier)


def run(base: cfg.Base, config: cfg.Train, rewards: Path, champion: Path, candidate: Path,
        replay: Path) -> dict:
    """Fine-tune and write the candidate; returns the stage metrics."""
    tinylm.set_threads(base.threads)
    examples = examples_from(rewards)
    tmp = candidate.with_name(candidate.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    replayed, available = store_and_replay(examples, replay, config.replay_fraction, base.seed)
    if len(examples) < config.min_examples:
        shutil.copytree(champion, tmp)
        io.replace_dir(tmp, candidate)
        print(f"train: only {len(examples)} verified-correct examples (train.min_examples="
              f"{config.min_examples}); the candidate is the champion unchanged", file=sys.stderr)
        return {"trained": False, "examples": len(examples),
                "reason": f"fewer than train.min_examples={config.min_examples} verified-correct "
                          f"rollouts"}
    model, tokenizer = tinylm.load(champion)
    data = [(e["token_ids"], e["model_mask"]) for e in examples + replayed]
    steps = math.ceil(config.epochs * len(data) / config.batch_size)
    metrics = sft.train(model, sft.epoch_batches(data, config.batch_size, base.seed),
                        steps=steps, lr=config.lr, tokenizer=tokenizer, seed=base.seed)
    tinylm.save(model, tokenizer, tmp)
    io.replace_dir(tmp, candidate)
    return {"trained": True, "examples": len(examples), "replayed": len(replayed),
            "replay_available": available, **metrics}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("rewards", "champion", "candidate", "replay", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("base", args.params), cfg.load("train", args.params), args.rewards,
                  args.champion, args.candidate, args.replay)
    io.write_json(args.metrics, metrics)


if __name__ == "__main__":
    main()
