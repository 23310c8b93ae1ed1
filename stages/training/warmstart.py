"""The warm start of generation 0: a plain PyTorch loop over the environment's demonstrations.

Used by `offseason init` (`stages/init.py`) for the demo's tiny model, and by the tests and
benchmarks as the baseline the train stage's Trainer is measured against. The examples are the
same rows the train stage uses (`token_ids`, `model_mask`: chat conversations encoded by the model's
chat template), collated by `stages.training.batches`, so the loss is on the model's own tokens
only: prompts and tool results are context, not targets (teaching the model to predict a
calculator's output would teach it to guess instead of calling the tool).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Iterator

import torch

from stages.training.batches import collate


def demonstrations(template, env, rng: random.Random, tool_fraction: float, batch_size: int):
    """Endless batches of a built-in environment's demonstrations as chat conversations, encoded
    by the model's chat template as a rollout is (`stages.generation.chat.encode`).
    """
    from stages.generation import chat

    while True:
        batch = []
        for _ in range(batch_size):
            question = env.sample_question(rng)
            task = env.chat_task(question)
            answer = env.chat_demonstration(question, use_tool=rng.random() < tool_fraction)
            ids, mask = chat.encode(template.for_task(task), task["messages"] + answer)
            batch.append({"token_ids": ids, "model_mask": mask})
        yield batch


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine decay to zero."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(model, batches: Iterator[list[dict]], *, steps: int, lr: float,
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
        batch = collate(examples, tokenizer.pad_token_id)
        inputs, attention, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
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
