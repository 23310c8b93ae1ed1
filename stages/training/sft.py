"""SFT: rejection-sampling fine-tuning on the verified-correct rollouts, on the transformers Trainer.

Helper of `stages/train.py` (`train.algorithm: sft`, settings in `train.sft`). The examples are
the rollouts' own token ids with the mask of the tokens the model chose (`model_mask`), so the loss
is on those tokens only: never on the prompt, never on a tool result the environment injected.
`encode_completion` turns a written completion (a demonstration, a trace's answer) into the same
ids and mask, and `collate` is the one SFT collator, used by the warm start
(`stages/training/warmstart.py`) too.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import Trainer

from stages.training import trainers

UNIT = "verified-correct rollouts"  # what one example is, for the stage's messages


def encode_completion(tokenizer, env, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + completion and the mask of the tokens the model would have chosen.

    Tokens the environment injects after each closed tool call are masked out, exactly as the
    generation backend masks them in a rollout.
    """
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    mask = [0] * len(ids)
    body = tokenizer.encode(completion, add_special_tokens=False)
    tool_close = tokenizer.convert_tokens_to_ids(env.TOOL_CLOSE)
    skip, start = 0, len(ids)
    for token in body:
        ids.append(token)
        mask.append(0 if skip else 1)
        skip = max(0, skip - 1)
        if token == tool_close and not mask[-1] == 0:
            text = tokenizer.decode(ids[start:], skip_special_tokens=True)
            skip = len(tokenizer.encode(env.on_tool_close(text), add_special_tokens=False))
    return ids, mask


def frame(row: dict, bos: int | None, eos: int | None) -> tuple[list[int], list[int]]:
    """The ids a row is trained on and their mask: a chat episode's (`chat`: the whole
    conversation as the model saw it, its template's special tokens and its own end tokens
    included) as they are; the demo's as `<bos> ids <eos>`, the <eos> its choice.
    """
    if row.get("chat"):
        return list(row["token_ids"]), list(row["model_mask"])
    head = [] if bos is None else [bos]
    return head + [*row["token_ids"], eos], [0] * len(head) + [*row["model_mask"], 1]


def collate(rows: list[dict], bos: int, eos: int, pad: int) -> dict:
    """Right-padded rows (`frame`); labels -100 wherever the model did not choose the token (the
    model shifts the labels itself).
    """
    framed = [frame(row, bos, eos) for row in rows]
    # exactly the longest row: a padding column past the model's positions would index past them
    width = max(len(seq) for seq, _ in framed)
    inputs = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (seq, keep) in enumerate(framed):
        inputs[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        labels[i, :len(seq)] = torch.tensor([t if k else -100 for t, k in zip(seq, keep)])
    return {"input_ids": inputs, "attention_mask": attention, "labels": labels}


def examples(rows: list[dict]) -> tuple[list[dict], dict]:
    """The verified-correct episodes, once per distinct completion of a task, in a fixed order."""
    unique = {}
    for row in rows:
        if row["correct"] == 1.0:
            unique.setdefault((row["task_id"], row["completion"]),
                              {k: row.get(k) for k in ("task_id", "completion", "token_ids",
                                                       "model_mask", "chat")})
    return [unique[key] for key in sorted(unique)], {}


class SFTTrainer(trainers.StepLog, Trainer):
    """The transformers Trainer, with per-step throughput; the model computes its own loss."""


def trainer(model, tokenizer, champion: Path, rows: list[dict], args_for, config):
    """The Trainer for `rows` (examples); `args_for(n)`: the TrainingArguments for n dataset rows;
    `config`: the `train.sft` section.
    """
    from datasets import Dataset

    data = Dataset.from_list([{"token_ids": e["token_ids"], "model_mask": e["model_mask"],
                               "chat": bool(e.get("chat"))} for e in rows])
    return SFTTrainer(
        model=model, args=args_for(len(data)), train_dataset=data,
        data_collator=functools.partial(collate, bos=tokenizer.bos_token_id,
                                        eos=tokenizer.eos_token_id, pad=trainers.pad_id(tokenizer)))
