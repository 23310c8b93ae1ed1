"""Training examples as token ids: the one collator of such rows into a batch.

Helper of `stages/training/sft.py` (its Trainer's collator) and the warm start (`warmstart.py`),
which builds generation 0 without the transformers Trainer: this module imports torch alone, so
the warm start does not load the Trainer's libraries (3 s and 240 MB on their own; `offseason
init` is 1 s faster, saving the model loads some of them anyway). A row is a whole conversation
as the model saw it (`token_ids`: its chat template's special tokens and its own end tokens
included) and the mask of the tokens the model chose (`model_mask`).
"""

from __future__ import annotations

import torch


def collate(rows: list[dict], pad: int) -> dict:
    """Right-padded rows; labels -100 wherever the model did not choose the token (the model
    shifts the labels itself).
    """
    # exactly the longest row: a padding column past the model's positions would index past them
    width = max(len(row["token_ids"]) for row in rows)
    inputs = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        seq = row["token_ids"]
        inputs[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        labels[i, :len(seq)] = torch.tensor([t if k else -100
                                             for t, k in zip(seq, row["model_mask"])])
    return {"input_ids": inputs, "attention_mask": attention, "labels": labels}
