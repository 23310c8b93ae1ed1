"""Training throughput: the train stage's trainers against a plain PyTorch loop, same model and data.

    .venv/bin/python benchmarks/train.py                 # prints a Markdown table for BENCHMARKS.md
    .venv/bin/python benchmarks/train.py --steps 50 --threads 1   # shorter, one thread

The model is the demo's generation-0 architecture (params.yaml `init:`, 0.8M parameters), the data
`steps x batch` warm-start demonstrations as chat conversations (question, tool call, the tool's
result, answer, rendered by the demo's chat template; loss on the model's own tokens only), the
settings the stage's: AdamW (betas 0.9/0.95, no weight decay), gradient clipping at 1, warm-up
then cosine, fp32 on CPU, one optimizer step per batch. Tokens/s counts the non-padding tokens of
every sequence trained on, over the wall time of the whole training call (optimizer set-up, data
loading, logging and the stage's checkpoints included). The plain loop and our stage run twice,
interleaved, and the best of each is reported, so a burst of load from other processes on a
shared machine does not decide the ratio.

Rows: the plain loop (`stages/training/warmstart.py`, which `offseason init` uses); the stage's SFT (the
transformers Trainer, `stages/training/trainers.py`); TRL's SFTTrainer used directly on the same
pre-tokenized data; and, for the record, the stage's DPO (TRL's DPOTrainer, chosen and rejected
per pair, plus the reference model's forward) and GRPO (our loss on the Trainer) on pairs/groups
built from the same demonstrations. DPO and GRPO do different work per token, so only the SFT rows
measure the overhead of a trainer.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import config as cfg  # noqa: E402
from stages import tinylm, train  # noqa: E402
from stages.envs import arith  # noqa: E402
from stages.generation import chat  # noqa: E402
from stages.training import trainers, warmstart  # noqa: E402


def demonstrations(tokenizer, n: int, seed: int) -> list[dict]:
    """`n` SFT rows of arithmetic demonstrations, encoded by the chat template, for timing
    training; each with a wrong answer beside it (`bad_ids`).
    """
    template = chat.Template.of(tokenizer, list(arith.TOOLS), (tokenizer.eos_token_id,))
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question = arith.sample_question(rng)
        task = arith.chat_task(question)
        good = arith.chat_demonstration(question, use_tool=True)
        bad = [{"role": "assistant", "content": f"{arith.ANSWER}{rng.randint(0, 999)}"}]
        ids, mask = chat.encode(template.for_task(task), task["messages"] + good)
        bad_ids, bad_mask = chat.encode(template.for_task(task), task["messages"] + bad)
        rows.append({"task_id": question, "completion": str(good), "token_ids": ids,
                     "model_mask": mask, "bad_ids": bad_ids, "bad_mask": bad_mask})
    return rows


def fresh(init: cfg.Init, tokenizer):
    """A freshly initialized tiny model of the `init` shape (seed 0)."""
    return tinylm.build_model(tokenizer, init.n_layer, init.n_embd, init.n_head, init.n_positions,
                              seed=0)


def tokens_of(rows: list[dict]) -> int:
    """The tokens the rows train on: whole conversations, as they are."""
    return sum(len(r["token_ids"]) for r in rows)


def plain_loop(init, tokenizer, rows, batch, lr, tokens=None):
    """Train a fresh model with the plain warm-start loop; returns tokens per second (`tokens`:
    how many the rows count for, default `tokens_of(rows)`).
    """
    model = fresh(init, tokenizer)
    data = [{"token_ids": r["token_ids"], "model_mask": r["model_mask"]} for r in rows]
    started = time.perf_counter()
    warmstart.train(model, iter([data[i:i + batch] for i in range(0, len(data), batch)]),
              steps=len(data) // batch, lr=lr, tokenizer=tokenizer, seed=0, label="plain loop")
    return (tokens or tokens_of(rows)) / (time.perf_counter() - started)


def grpo_episodes(rows):
    """GRPO's data from the demonstrations: two episodes a group, the good one ahead."""
    return [[{"token_ids": r["token_ids"], "model_mask": r["model_mask"],
              "logprobs": [0.0] * len(r["token_ids"]), "advantage": 1.0},
             {"token_ids": r["bad_ids"], "model_mask": r["bad_mask"],
              "logprobs": [0.0] * len(r["bad_ids"]), "advantage": -1.0}]
            for r in rows[:len(rows) // 2]]


def args_for(work: Path, batch: int, lr: float):
    """The TrainingArguments factory for one timed run in `work`."""
    return trainers.ArgumentsFor(work, batch_size=batch, epochs=1, lr=lr, seed=0,
                                 checkpoint_steps=cfg.Train().checkpoint_steps, deepspeed=None)


def stage(algorithm, init, tokenizer, rows, batch, lr, work):
    """Train a fresh model with the train stage's `algorithm`; returns tokens per second."""
    config = cfg.ALGORITHMS[algorithm](epochs=1, lr=lr)  # train.<algorithm>
    if algorithm == "sft":
        examples, tokens = rows, tokens_of(rows)
    elif algorithm == "dpo":
        cut = [next(i for i, m in enumerate(r["model_mask"]) if m) for r in rows]
        examples = [{"prompt_ids": r["token_ids"][:c], "chosen_ids": r["token_ids"][c:],
                     "chosen_mask": r["model_mask"][c:], "rejected_ids": r["bad_ids"][c:],
                     "rejected_mask": r["bad_mask"][c:]} for r, c in zip(rows, cut)]
        tokens = tokens_of(rows) + sum(len(r["bad_ids"]) for r in rows)
    else:
        examples = [{"episodes": group} for group in grpo_episodes(rows)]
        tokens = sum(len(e["token_ids"]) for g in examples for e in g["episodes"])
    champion = work / "champion"
    if not champion.exists():
        tinylm.save(fresh(init, tokenizer), tokenizer, champion)
    model = fresh(init, tokenizer)
    trainer = train.algorithm(algorithm).trainer(model, tokenizer, champion, examples,
                                                 args_for(work / algorithm, batch, lr), config)
    started = time.perf_counter()
    trainer.train()
    return tokens / (time.perf_counter() - started)


def trl_sft(init, tokenizer, rows, batch, lr, work):
    """Train a fresh model with TRL's SFTTrainer, the baseline; returns tokens per second."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = []
    for r in rows:
        seq, keep = r["token_ids"], r["model_mask"]
        data.append({"input_ids": seq, "labels": [t if k else -100 for t, k in zip(seq, keep)]})
    args = args_for(work / "trl-sft", batch, lr)(len(rows) // batch, cls=SFTConfig,
                                                 gradient_checkpointing=False, max_length=None,
                                                 dataset_text_field=None)
    trainer = SFTTrainer(model=fresh(init, tokenizer), args=args,
                         train_dataset=Dataset.from_list(data), processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    return tokens_of(rows) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    """Compare the training loops' throughput and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = all cores")
    args = parser.parse_args(argv)
    tinylm.set_threads(args.threads)
    init = cfg.load("init", ROOT / "params.yaml")
    batch, lr = init.batch_size, 1e-3
    tokenizer = tinylm.build_tokenizer(arith)
    rows = demonstrations(tokenizer, args.steps * batch, seed=0)
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for _ in range(2):
            results.setdefault("plain", []).append(plain_loop(init, tokenizer, rows, batch, lr))
            results.setdefault("sft", []).append(
                stage("sft", init, tokenizer, rows, batch, lr, work))
        results["trl-sft"] = [trl_sft(init, tokenizer, rows, batch, lr, work)]
        results["dpo"] = [stage("dpo", init, tokenizer, rows, batch, lr, work)]
        # GRPO's episodes are a different set (a short wrong answer beside each good one: more
        # padding per batch), so its baseline is the plain loop on those same episodes
        episodes = [e for group in grpo_episodes(rows) for e in group]
        counted = sum(len(e["token_ids"]) for e in episodes)
        for _ in range(2):
            results.setdefault("plain-grpo", []).append(
                plain_loop(init, tokenizer, episodes, batch, lr, counted))
            results.setdefault("grpo", []).append(
                stage("grpo", init, tokenizer, rows, batch, lr, work))
    best = {k: max(v) for k, v in results.items()}
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{sum(p.numel() for p in fresh(init, tokenizer).parameters()) / 1e6:.2f}M parameters, "
          f"{args.steps} steps of {batch} sequences, fp32\n")
    print("| what | tokens/s | vs plain loop |")
    print("|---|---|---|")
    names = {"plain": "plain PyTorch loop (`stages/training/warmstart.py`)",
             "sft": "train stage, sft (transformers Trainer)",
             "trl-sft": "TRL SFTTrainer used directly",
             "dpo": "train stage, dpo (TRL DPOTrainer; chosen + rejected + reference)",
             "plain-grpo": "plain PyTorch loop on GRPO's episodes (its baseline)",
             "grpo": "train stage, grpo (our loss on the Trainer)"}
    for key, name in names.items():
        runs = ", ".join(f"{v:.0f}" for v in results[key])
        baseline = "plain-grpo" if key == "grpo" else "plain"
        print(f"| {name} | {best[key]:.0f} (runs: {runs}) | {best[key] / best[baseline]:.2f}"
              f"{' vs its baseline' if key == 'grpo' else ''} |")


if __name__ == "__main__":
    main()
