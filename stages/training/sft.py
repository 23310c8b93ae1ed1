"""SFT: rejection-sampling fine-tuning on the verified-correct rollouts, on the transformers Trainer.

Helper of `stages/train.py` (`train.algorithm: sft`, settings in `train.sft`). The examples are
the rollouts' own token ids with the mask of the tokens the model chose (`model_mask`), so the loss
is on those tokens only: never on the prompt, never on a tool result the environment injected.
`stages/training/batches.py` collates them (`collate`, the warm start's collator too).
"""

from __future__ import annotations

import functools
from pathlib import Path

from transformers import Trainer

from stages.training import trainers
from stages.training.batches import collate

UNIT = "verified-correct rollouts"  # what one example is, for the stage's messages


def examples(rows: list[dict]) -> tuple[list[dict], dict]:
    """The verified-correct episodes, once per distinct completion of a task, in a fixed order."""
    unique = {}
    for row in rows:
        if row["correct"] == 1.0:
            unique.setdefault((row["task_id"], row["completion"]),
                              {k: row[k] for k in ("task_id", "completion", "token_ids",
                                                   "model_mask")})
    return [unique[key] for key in sorted(unique)], {}


class SFTTrainer(trainers.StepLog, Trainer):
    """The transformers Trainer, with per-step throughput; the model computes its own loss."""


def trainer(model, tokenizer, champion: Path, rows: list[dict], args_for, config):
    """The Trainer for `rows` (examples); `args_for(n)`: the TrainingArguments for n dataset rows;
    `config`: the `train.sft` section.
    """
    from datasets import Dataset

    data = Dataset.from_list([{"token_ids": e["token_ids"], "model_mask": e["model_mask"]}
                              for e in rows])
    return SFTTrainer(
        model=model, args=args_for(len(data)), train_dataset=data,
        data_collator=functools.partial(collate, pad=trainers.pad_id(tokenizer)))
