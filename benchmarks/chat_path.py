"""The chat path against plain PyTorch on the same tiny chat model (BENCHMARKS.md, "The chat path").

1. Rollouts: multi-turn episodes of the support example (`stages.generation.chat.rollout`: chat
   template, hermes tool-call parser, `call_tool` answers injected as exact ids) against a plain
   batched single-turn `model.generate` on the same model and prompts; both at temperature 1,
   the same `max_new_tokens` per turn and batch. Tokens are the ones the model chose.
2. Training on conversations: the train stage's SFT (`stages/train.py`, the transformers
   Trainer, rows marked `chat`) against a plain PyTorch loop with the same ids, masks, batch size,
   optimizer and steps. Tokens are all tokens fed (padding excluded).

The model: `tests/chat_model.py`'s tiny Qwen2 (2 layers, hidden 64, a BPE tokenizer trained
here, Qwen2.5's template), first taught the support example's gold conversations for a few
seconds so that it calls the tool (a random model would end every episode in its first turn).

    .venv/bin/python benchmarks/chat_path.py [--episodes 256] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def teach(folder: Path, steps: int = 90):
    """The tiny Qwen2 after `steps` of SFT on the support example's gold conversations."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.envs import contract
    from stages.generation import chat

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    env = contract.load("support", "examples.support.support_env", REPO)
    tasks = contract.load_tasks(REPO / "examples/support/tasks.jsonl", env)
    template = chat.Template.of(tok, list(env.tools), chat.end_ids(model, tok))
    data = [chat.encode(template, t["messages"] + env.gold(t)) for t in tasks]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, labels, attention = batch(data, tok.pad_token_id)
    for _ in range(steps):
        model(input_ids=inputs, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tok, model.eval(), env, tasks, template, data


def batch(rows, pad):
    """Right-padded ids, labels (-100 off the mask) and attention of (ids, mask) rows."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    inputs = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        inputs[i, :len(ids)], attention[i, :len(ids)] = torch.tensor(ids), 1
        labels[i, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    return inputs, labels, attention


def timed(fn):
    """(fn(), wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def rollouts(tok, model, env, tasks, template, episodes: int, max_new_tokens: int):
    """Chat rollouts and plain `model.generate` on the same prompts: tokens, seconds, CPU."""
    import torch

    from stages.generation import chat

    jobs = [tasks[i % len(tasks)] for i in range(episodes)]

    def ours():
        gens = [torch.Generator().manual_seed(i) for i in range(len(jobs))]
        return chat.rollout(model, tok, env, jobs, parser="hermes", temperature=1.0,
                            max_new_tokens=max_new_tokens, max_turns=3, generator=gens,
                            template=template)

    def plain():
        torch.manual_seed(0)
        prompts = [template.prompt(t["messages"]) for t in jobs]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id)
        attention = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left-padded, as generate wants
            ids[i, width - len(p):], attention[i, width - len(p):] = torch.tensor(p), 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
        new = out[:, width:]
        ends = set(chat.end_ids(model, tok))
        count = 0
        for row in new.tolist():  # up to and including the first end token
            for token in row:
                count += 1
                if token in ends:
                    break
        return count

    episodes_out, wall, cpu = timed(ours)
    chosen = sum(sum(e.model_mask) for e in episodes_out)
    calls = sum(e.tool_calls for e in episodes_out)
    plain_tokens, pwall, pcpu = timed(plain)
    return {"chat": {"tokens": chosen, "seconds": wall, "cpu": cpu, "tool_calls": calls,
                     "multi_turn": sum(e.tool_calls > 0 for e in episodes_out)},
            "generate": {"tokens": plain_tokens, "seconds": pwall, "cpu": pcpu}}


def training(folder: Path, data, steps: int, batch_size: int, work: Path):
    """The train stage's SFT on chat rows against a plain loop: same rows, batches, AdamW."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages import config as cfg
    from stages import train

    rows = [{"task_id": f"t{i}", "completion": str(i), "correct": 1.0, "reward": 1.0,
             "token_ids": ids, "model_mask": mask, "logprobs": [0.0] * len(ids), "chat": True}
            for i, (ids, mask) in enumerate(data)]
    rewards = work / "rewards.parquet"
    pq.write_table(pa.Table.from_pylist(rows), rewards)
    epochs = max(1, round(steps * batch_size / len(rows)))
    tokens = sum(len(ids) for ids, _ in data) * epochs
    config = cfg.Train(min_examples=1, batch_size=batch_size, checkpoint_steps=10_000,
                       sft=cfg.SFT(epochs=epochs, lr=1e-3))
    base = cfg.Base(threads=torch.get_num_threads())
    _, wall, cpu = timed(lambda: train.run(base, config, rewards, folder, work / "candidate",
                                           work / "replay"))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plain():
        generator = torch.Generator().manual_seed(0)
        for _ in range(epochs):
            order = torch.randperm(len(data), generator=generator).tolist()
            for start in range(0, len(order), batch_size):
                inputs, labels, attention = batch([data[i] for i in order[start:start + batch_size]],
                                                  tok.pad_token_id)
                model(input_ids=inputs, attention_mask=attention, labels=labels).loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    _, pwall, pcpu = timed(plain)
    return {"stage": {"tokens": tokens, "seconds": wall, "cpu": cpu},
            "plain": {"tokens": tokens, "seconds": pwall, "cpu": pcpu}, "epochs": epochs}


def main() -> None:
    """Run both comparisons and print their tables (best of --repeats)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("DO_NOT_TRACK", "true")
    import torch
    from chat_model import build

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "model")
        tok, model, env, tasks, template, data = teach(folder)
        model.save_pretrained(folder)
        best = {}
        for repeat in range(args.repeats):
            result = rollouts(tok, model, env, tasks, template, args.episodes,
                              args.max_new_tokens)
            for side in ("chat", "generate"):
                rate = result[side]["tokens"] / result[side]["seconds"]
                if rate > best.get(side, ({}, 0))[1]:
                    best[side] = (result[side], rate)
        work = Path(tmp) / "train"
        trained = {}
        for repeat in range(args.repeats):
            (work / str(repeat)).mkdir(parents=True)
            result = training(folder, data * 8, args.train_steps, args.batch_size,
                              work / str(repeat))
            for side in ("stage", "plain"):
                rate = result[side]["tokens"] / result[side]["seconds"]
                if rate > trained.get(side, ({}, 0))[1]:
                    trained[side] = (result[side], rate)
    print(f"torch {torch.__version__}, {args.threads} threads, tiny Qwen2 (2 layers, hidden 64, "
          f"vocab {len(tok)}), best of {args.repeats}, load {os.getloadavg()[0]:.1f}\n")
    chat_row, chat_rate = best["chat"]
    gen_row, gen_rate = best["generate"]
    print("| what | seconds | CPU seconds | tokens chosen | tokens/s |\n|---|---|---|---|---|")
    print(f"| chat rollouts, multi-turn ({args.episodes} episodes, {chat_row['multi_turn']} with "
          f"tool calls, {chat_row['tool_calls']} calls answered) | {chat_row['seconds']:.2f} | "
          f"{chat_row['cpu']:.2f} | {chat_row['tokens']} | {chat_rate:.0f} |")
    print(f"| `model.generate`, single-turn, same prompts | {gen_row['seconds']:.2f} | "
          f"{gen_row['cpu']:.2f} | {gen_row['tokens']} | {gen_rate:.0f} |")
    print(f"\nratio chat / generate: **{chat_rate / gen_rate:.2f}** (target: at least 0.9)\n")
    stage_row, stage_rate = trained["stage"]
    plain_row, plain_rate = trained["plain"]
    print("| what | seconds | CPU seconds | tokens | tokens/s |\n|---|---|---|---|---|")
    print(f"| train stage, sft on chat rows (Trainer) | {stage_row['seconds']:.2f} | "
          f"{stage_row['cpu']:.2f} | {stage_row['tokens']} | {stage_rate:.0f} |")
    print(f"| plain PyTorch loop, same ids and masks | {plain_row['seconds']:.2f} | "
          f"{plain_row['cpu']:.2f} | {plain_row['tokens']} | {plain_rate:.0f} |")
    print(f"\nratio stage / plain: **{stage_rate / plain_rate:.2f}** (target: at least 0.85)")
    print(json.dumps({"chat": chat_rate, "generate": gen_rate, "stage": stage_rate,
                      "plain": plain_rate}))


if __name__ == "__main__":
    main()
