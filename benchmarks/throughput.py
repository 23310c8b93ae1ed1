"""Throughput of the demo model on this machine: generation (episodes/s) and training (tokens/s).

    .venv/bin/python benchmarks/throughput.py            # prints a Markdown table for BENCHMARKS.md

Builds the demo's generation-0 architecture from params.yaml (`init:`), its chat tokenizer and
template, untrained weights: speed does not depend on what the weights say, only on shapes, batch
size and sequence lengths, which are pinned here (every episode runs to `max_new_tokens` or the
model's position limit). Generation is the chat path the rollout stage runs (`chat.rollout`).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages import config as cfg  # noqa: E402
from stages import tinylm  # noqa: E402
from stages.envs import arith, contract  # noqa: E402
from stages.generation import chat  # noqa: E402
from stages.training import warmstart  # noqa: E402


def main() -> None:
    """Time generation with the tiny model and print tokens per second."""
    tinylm.quiet()
    init = cfg.load("init", Path(__file__).resolve().parents[1] / "params.yaml")
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, init.n_layer, init.n_embd, init.n_head,
                               init.n_positions, seed=0)
    model.eval()
    rng = random.Random(0)
    env = contract.load("arith", "stages.envs.arith")
    template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
    tasks = [{"task_id": str(i), **arith.chat_task(arith.sample_question(rng))}
             for i in range(4096)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters\n")
    print("| what | batch | result |")
    print("|---|---|---|")
    for batch in (256, 1024, 4096):
        started, episodes = time.time(), []
        for start in range(0, len(tasks), batch):
            episodes += chat.rollout(model, tokenizer, env, tasks[start:start + batch],
                                     parser="hermes", temperature=1.0, max_new_tokens=48,
                                     max_turns=arith.MAX_TURNS, template=template,
                                     generator=torch.Generator().manual_seed(start))
        seconds = time.time() - started
        tokens = sum(len(e.token_ids) for e in episodes)
        print(f"| generation, 4096 episodes at temperature 1 | {batch} | "
              f"{len(episodes) / seconds:.0f} episodes/s, {tokens / seconds:.0f} tokens/s |")
    batches = warmstart.demonstrations(template, arith, rng, 0.4, init.batch_size)
    model.train()
    stats = warmstart.train(model, batches, steps=50, lr=init.lr, tokenizer=tokenizer, seed=0,
                      label="benchmark")
    print(f"| SFT, 50 steps on demonstrations | {init.batch_size} | "
          f"{stats['tokens_per_second']} tokens/s |")


if __name__ == "__main__":
    main()
