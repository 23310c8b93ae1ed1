"""Supervised fine-tuning on token sequences, with the loss on the model's own tokens only.

Used by `offseason init` (the warm start on demonstrations) and the train stage (rejection-sampling
fine-tuning on verified-correct rollouts). Prompts and injected tool results are context, not
targets: teaching the model to predict a calculator's output would teach it to guess instead of
calling the tool.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator

import torch


def collate(examples: list[tuple[list[int], list[int]]], bos: int, eos: int, pad: int):
    """Right-padded inputs and labels: <bos> ids <eos>, label -100 wherever the mask is 0."""
    width = max(len(ids) for ids, _ in examples) + 2
    inputs = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        seq = [bos] + list(ids) + [eos]
        inputs[row, :len(seq)] = torch.tensor(seq)
        attention[row, :len(seq)] = 1
        # labels[t] is the token at t; the model shifts them itself
        keep = [0] + list(mask) + [1]
        labels[row, :len(seq)] = torch.tensor([t if k else -100 for t, k in zip(seq, keep)])
    return inputs, attention, labels


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(model, batches: Iterator[list[tuple[list[int], list[int]]]], *, steps: int, lr: float,
          tokenizer, seed: int, log: Callable[[dict], None] | None = None, label: str = "train",
          ) -> dict:
    """Run `steps` optimizer steps over `batches`; returns loss and throughput figures."""
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    started, tokens, losses = time.time(), 0, []
    report_every = max(1, steps // 10)
    for step in range(steps):
        examples = next(batches)
        inputs, attention, labels = collate(examples, tokenizer.bos_token_id,
                                            tokenizer.eos_token_id, tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(input_ids=inputs, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        tokens += int(attention.sum())
        losses.append(loss.item())
        if log is not None:
            log({"step": step, "loss": losses[-1], "lr": optimizer.param_groups[0]["lr"],
                 "grad_norm": grad_norm})
        if (step + 1) % report_every == 0 or step + 1 == steps:
            elapsed = time.time() - started
            print(f"{label}: step {step + 1}/{steps} loss {losses[-1]:.4f} "
                  f"({tokens / max(elapsed, 1e-9):.0f} tokens/s)", file=sys.stderr, flush=True)
    model.eval()
    elapsed = time.time() - started
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": steps, "final_loss": sum(tail) / len(tail), "train_tokens": tokens,
            "train_seconds": round(elapsed, 2), "tokens_per_second": round(tokens / max(elapsed, 1e-9))}


def epoch_batches(examples: list, batch_size: int, seed: int) -> Iterator[list]:
    """Endless shuffled passes over a fixed set of examples, `batch_size` at a time."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            yield [examples[i] for i in order[start:start + batch_size]]
