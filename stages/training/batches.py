"""Training examples as token ids: a written completion encoded as a rollout's ids and mask, and
the one collator of such rows into a batch.

Helpers of `stages/training/sft.py` (its Trainer's collator), `dpo.py` and the warm start
(`warmstart.py`), which builds generation 0 without the transformers Trainer: this module
imports torch alone, so the warm start does not load the Trainer's libraries (3 s and 240 MB on
their own; `offseason init` is 1 s faster, saving the model loads some of them anyway).
"""

from __future__ import annotations

import torch


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
