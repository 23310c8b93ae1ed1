"""Rollout throughput: the transformers backend on the chat path (multi-turn, tool results fed
between turns) against a plain batched `model.generate` (single-turn) on the same model and prompts.

    .venv/bin/python benchmarks/rollout.py                 # prints a Markdown table for BENCHMARKS.md
    .venv/bin/python benchmarks/rollout.py --episodes 4096 --batch 1024 --repeats 3
    .venv/bin/python benchmarks/rollout.py --model /tmp/warm   # warm-start once, reuse after

The model is the demo's generation-0 architecture and chat template (params.yaml `init:`),
warm-started for `--warmup-steps` on demonstrations that use the calculator (so episodes really
call the tool and get its results between turns; weights only change which tokens are sampled, not the cost of a
step). Both sample at temperature 1 with `max_new_tokens` 48 and stop a row at <eos>; tokens/s
counts completion tokens (what each row appended after its prompt before <eos>: the model's own
and, for the backend, the injected tool results, each of which costs a forward step like any
other), over the wall time of the whole call and over the process's CPU time (user + system, all
threads: on a shared machine the wall time also counts the other processes' turns).
`model.generate` gets the prompts left-padded with an attention mask and prefills them in one
pass; the backend feeds the shortest prompt's length in one pass and the rest of each prompt one
token per step (its lockstep design), which it pays for inside the same measure. Best of
`--repeats` runs, alternating, since the machine is shared.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import config as cfg  # noqa: E402
from stages import tinylm  # noqa: E402
from stages.envs import arith, contract  # noqa: E402
from stages.generation import chat  # noqa: E402
from stages.training import warmstart  # noqa: E402


def cpu_seconds() -> float:
    """CPU seconds this process has used so far, user and system, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all of this process's threads
    return usage.ru_utime + usage.ru_stime


def backend(model, tokenizer, tasks, batch):
    """Time the rollout stage's chat loop on the tasks; returns its numbers."""
    env = contract.load("arith", "stages.envs.arith")
    template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
    started, cpu, episodes = time.time(), cpu_seconds(), []
    for start in range(0, len(tasks), batch):
        episodes += chat.rollout(model, tokenizer, env, tasks[start:start + batch],
                                 parser="hermes", temperature=1.0, max_new_tokens=48,
                                 max_turns=4, template=template,
                                 generator=torch.Generator().manual_seed(start))
    seconds, cpu = time.time() - started, cpu_seconds() - cpu
    prompt_lens = [len(template.prompt(task["messages"])) for task in tasks]
    tokens = sum(len(e.token_ids) - n for e, n in zip(episodes, prompt_lens))
    chosen = sum(sum(e.model_mask) for e in episodes)
    calls = sum(e.tool_calls for e in episodes)
    return seconds, cpu, tokens, chosen, calls


@torch.inference_mode()
def plain_generate(model, tokenizer, tasks, batch):
    """Time plain `model.generate` on the tasks' prompts, the baseline; returns its numbers."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
    torch.manual_seed(0)
    started, cpu, tokens = time.time(), cpu_seconds(), 0
    for start in range(0, len(tasks), batch):
        ids = [template.prompt(task["messages"]) for task in tasks[start:start + batch]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=48,
                             eos_token_id=eos, pad_token_id=pad)
        new = out[:, width:]
        # tokens before each row's first <eos> (generate pads the rows that finished)
        done = (new == eos).cumsum(dim=1) > 0
        tokens += int((~done).sum())
    return time.time() - started, cpu_seconds() - cpu, tokens


def main(argv: list[str] | None = None) -> None:
    """Compare the rollout backend with plain generation and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", type=Path,
                        help="a model folder to use (models/champion); missing: the warm-started "
                             "model is saved there for the next run")
    args = parser.parse_args(argv)
    tinylm.quiet()
    if args.model and (args.model / "config.json").exists():
        model, tokenizer = tinylm.load(args.model)
    else:
        init = cfg.load("init", ROOT / "params.yaml")
        tokenizer = tinylm.build_tokenizer(arith)
        model = tinylm.build_model(tokenizer, init.n_layer, init.n_embd, init.n_head,
                                   init.n_positions, seed=0)
        template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
        warmstart.train(model, warmstart.demonstrations(template, arith, random.Random(0),
                                                        init.tool_fraction, init.batch_size),
                        steps=args.warmup_steps, lr=init.lr, tokenizer=tokenizer, seed=0,
                        label="warm start")
        if args.model:
            tinylm.save(model, tokenizer, args.model)
    model.eval()
    rng = random.Random(1)
    tasks = [{"task_id": str(i), **arith.chat_task(arith.sample_question(rng))}
             for i in range(args.episodes)]
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(backend(model, tokenizer, tasks, args.batch))
        theirs.append(plain_generate(model, tokenizer, tasks, args.batch))
    seconds, _, tokens, chosen, calls = min(ours)
    g_seconds, _, g_tokens = min(theirs)
    cpu, g_cpu = min(r[1] for r in ours), min(r[1] for r in theirs)
    rate, g_rate = tokens / seconds, g_tokens / g_seconds
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{args.episodes} episodes, batch {args.batch}, best of {args.repeats}\n")
    print("| what | seconds | CPU seconds | completion tokens | tokens/s | tokens per CPU second |")
    print("|---|---|---|---|---|---|")
    print(f"| transformers backend, multi-turn ({calls} tool calls answered; {chosen} tokens chosen "
          f"by the model) | {seconds:.2f} | {cpu:.2f} | {tokens} | {rate:.0f} | "
          f"{tokens / cpu:.0f} |")
    print(f"| `model.generate`, single-turn, same prompts | {g_seconds:.2f} | {g_cpu:.2f} | "
          f"{g_tokens} | {g_rate:.0f} | {g_tokens / g_cpu:.0f} |")
    print(f"\nratio backend / generate: {rate / g_rate:.2f} in wall time, "
          f"{(tokens / cpu) / (g_tokens / g_cpu):.2f} in CPU time (target >= 0.9)")


if __name__ == "__main__":
    main()
