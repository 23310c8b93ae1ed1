"""On-policy GRPO: offseason's loop against TRL's GRPOTrainer, same model, tasks, reward and budget.

    .venv/bin/python benchmarks/online_grpo_vs_trl.py                  # all three sides, 8 steps
    .venv/bin/python benchmarks/online_grpo_vs_trl.py --steps 4 --sides offseason,trl --out DIR

Issue 49. Every side starts from the same generation-0 chat model (the demo's tiny GPT-2, read
from `OUT/champion`: copy it there first) and trains on the same arithmetic tasks
(`stages.envs.arith`, 2000 questions drawn with `arith.sample_question`, none of them a benchmark
question) with the same reward (`arith.reward`: 1.0 for the right final `answer:N`), multi-turn,
with the `calculator` tool:

- offseason: `stages.train.run` with `train.grpo.steps` > 1, i.e. `train.online`: per step
  `stages.rollout.play` (the chat path and its tool parser), `stages.reward.score`,
  `stages.training.grpo.update`;
- trl: `trl.GRPOTrainer(tools=[calculator])`, transformers generation on the CPU. The demo's chat
  template is none that TRL knows (`add_response_schema` raises "Unrecognized chat template"), so
  the tokenizer is given a `response_template` for the demo's format (assistant turns after
  `<|assistant|>`, tool calls as `<tool_call>JSON</tool_call>`, the turn ending at `<eos>`), the
  documented way; with it TRL parses, runs and answers the calls;
- trl-positions: the same, with one fix to the model: a forward without `position_ids` takes them
  from the attention mask. TRL's training forward passes none, so GPT-2 (learned absolute
  positions) scores a left-padded prompt at other positions than `generate` sampled it at (on
  this model a 2-token pad moves an episode's log-prob from -38.8 to -59.6); a RoPE model would
  not care. This side shows how much of the gap that mismatch is.

Matched: tasks per step x samples per task (32 x 8 = 256 episodes a step), the number of steps,
the learning rate (1e-3, constant, AdamW, no weight decay), 64 episodes per optimizer step (4 per
step: TRL's steps_per_generation=4, the old log-probs taken before the first), clip 0.3, loss
bnpo, group-scaled advantages, no KL, temperature 1.0, grad-norm clip 1.0, one torch thread per
process, rewards scored in the training process (offseason's reward.workers=1). Not matched, by
design: offseason drops the groups whose rewards are all equal, TRL keeps them at advantage 0 (in
bnpo's token count). Tokens: offseason writes up to `--max-new-tokens` (48) per turn, never past the
model's 80 positions; TRL's `max_completion_length` is the whole completion's budget (tool
answers included) and its transformers path generates that many again after a tool answer
without regard to the model's positions (a turn that does not stop would index past GPT-2's 80
position embeddings; not seen in a 3-step run at 48), so it is capped at (80 - 1 - longest
prompt) / 2 = 35 (`--trl-max-completion-length` to change); an episode with a tool call takes
about 30 tokens, so the cap cuts none that could be right.

Measured per side, each in its own process, one after the other: pass@1 on the 200 held-out items
of data/benchmarks/arith.jsonl, greedy, scored with the gate's own code (`stages.gate.score`,
`chat.greedy`, 48 new tokens a turn) before and after training, and the share of those answers
that called the tool; episodes generated; the wall and CPU seconds (user + system, the process
and its children) of the training call, from loading the model to the saved candidate; samples
per wall second and per CPU second (on a shared machine the CPU figure is the steadier one).
Writes `results.json` and `results.md` into `--out`. CPU only; about 20 CPU seconds a side
for 8 steps plus the evaluations, 2-4 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK = ROOT / "data" / "benchmarks" / "arith.jsonl"
SIDES = ("offseason", "trl", "trl-positions")
POSITIONS_SAFETY = 1  # TRL refuses a tool turn at len >= max positions; keep one spare


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def threads(n: int = 1) -> None:
    """One torch thread (and quiet libraries)."""
    sys.path.insert(0, str(ROOT))
    from stages import tinylm

    tinylm.set_threads(n)


def write_tasks(path: Path, count: int, seed: int) -> None:
    """Training tasks: `arith.sample_question` questions, none of them a benchmark item's."""
    from stages.envs import arith

    held_out = {json.loads(line)["messages"][0]["content"] for line in BENCHMARK.open()}
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < count:
        question = arith.sample_question(rng)
        if question in held_out or question in seen:
            continue
        seen.add(question)
        rows.append({"task_id": f"train-{len(rows):05d}", **arith.chat_task(question)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def specs(tasks: Path):
    """The `environments:` section: arith with the training tasks and the benchmark."""
    from stages import config as cfg

    return {"arith": cfg.EnvironmentSpec(module="stages.envs.arith", tasks=str(tasks),
                                         benchmark=str(BENCHMARK))}


def evaluate(model_dir: Path, tasks: Path, max_new_tokens: int, seed: int) -> dict:
    """Greedy pass@1 on the benchmark, as the gate scores a candidate."""
    from stages import config as cfg
    from stages import gate
    from stages.envs import contract

    suites = contract.benchmark_suites(specs(tasks), ROOT, 0)
    rows = gate.score(model_dir, suites, cfg.Rollout(max_new_tokens=max_new_tokens), seed)
    correct = [r["correct"] for r in rows if r["correct"] is not None]
    used_tool = sum('"tool_calls"' in r["completion"] for r in rows)
    return {"items": len(rows), "pass_at_1": round(sum(correct) / len(correct), 4),
            "tool_call_rate": round(used_tool / len(rows), 4)}


def longest_prompt(tasks: Path, tokenizer) -> int:
    """The longest chat prompt, in tokens, of the training tasks and the benchmark."""
    longest = 0
    for path in (tasks, BENCHMARK):
        for line in path.open():
            messages = json.loads(line)["messages"]
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
            longest = max(longest, len(ids))
    return longest


def run_offseason(args, work: Path) -> dict:
    """The on-policy GRPO of offseason (`train.run` -> `train.online`), timed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import train_config

    from stages import config as cfg
    from stages import train

    config = train_config(algorithm="grpo", steps=args.steps, tasks_per_step=args.tasks_per_step,
                          samples_per_task=args.samples, batch_size=args.batch_size,
                          min_examples=1, lr=args.lr)
    candidate = work / "candidate"
    wall, cpu = time.perf_counter(), cpu_seconds()
    metrics = train.run(cfg.Base(seed=args.seed, threads=1), config, None, args.champion,
                        candidate, work / "replay", work / "ckpt", work / "steps.csv", None,
                        specs(args.tasks), ROOT, 1.0, None,
                        cfg.Rollout(max_new_tokens=args.max_new_tokens, temperature=1.0),
                        cfg.Reward(workers=args.reward_workers), work / "episodes")
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    return {"episodes": metrics["episodes"], "wall_seconds": wall, "cpu_seconds": cpu,
            "optimizer_steps": metrics["optimizer_steps"],
            "reward_first_step": metrics["reward_first_step"],
            "reward_last_step": metrics["reward_last_step"],
            "generate_seconds": metrics["generate_seconds"],
            "train_seconds": metrics["train_seconds"], "candidate": str(candidate)}


RESPONSE_TEMPLATE = {  # the demo's chat template, as transformers' response parser reads it
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


def calculator(expression: str) -> str:
    """Evaluate one integer expression a OP b with OP in + - *.

    Args:
        expression: the expression, e.g. 47*38
    """
    from stages.envs import arith

    return arith.call_tool({}, arith.TOOL_NAME, {"expression": expression})


def positions_from_mask(model) -> None:
    """Make a forward without `position_ids` take them from the attention mask, as `generate`
    does: TRL's training forward passes none, so GPT-2 (learned absolute positions) sees a
    left-padded prompt at other positions than it sampled it at (`--sides trl-positions`).
    """
    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if kwargs.get("position_ids") is None and mask is not None and not args \
                and kwargs.get("past_key_values") is None:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def run_trl(args, work: Path, fix_positions: bool = False) -> dict:
    """TRL's GRPOTrainer with the calculator tool, timed."""
    import datasets
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from stages import tinylm
    from stages.envs import arith

    datasets.disable_progress_bars()
    rows = [json.loads(line) for line in args.tasks.open()]
    data = datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]}
                                       for r in rows])
    counted = {"episodes": 0, "reward_sum": 0.0, "per_step": []}

    def arith_reward(prompts, completions, answer, **_):
        """`arith.reward` of each episode: the prompt's messages, then TRL's completion turns."""
        out = [arith.reward({"answer": a}, list(p) + list(c))
               for p, c, a in zip(prompts, completions, answer)]
        counted["episodes"] += len(out)
        counted["per_step"].append(round(sum(out) / max(1, len(out)), 4))
        return out

    episodes_per_step = args.tasks_per_step * args.samples
    wall, cpu = time.perf_counter(), cpu_seconds()
    model, tokenizer = tinylm.load(args.champion)
    tokenizer.response_template = RESPONSE_TEMPLATE
    if fix_positions:
        positions_from_mask(model)
    positions = model.config.n_positions
    budget = args.trl_max_completion_length or min(
        args.max_new_tokens, (positions - POSITIONS_SAFETY - longest_prompt(args.tasks, tokenizer)) // 2)
    config = GRPOConfig(
        output_dir=str(work / "run"), use_cpu=True, bf16=False, fp16=False, report_to=[],
        seed=args.seed, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, num_generations=args.samples,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        steps_per_generation=episodes_per_step // args.batch_size, num_iterations=1,
        max_steps=args.steps * (episodes_per_step // args.batch_size),
        max_completion_length=budget, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        epsilon=0.3, loss_type="bnpo", scale_rewards="group", use_vllm=False,
        max_tool_calling_iterations=arith.MAX_TURNS, save_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
        log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=config,
                          train_dataset=data, processing_class=tokenizer, tools=[calculator])
    began = time.perf_counter()
    trainer.train()
    train_call = time.perf_counter() - began
    candidate = work / "candidate"
    _, plain = tinylm.load(args.champion)  # the tokenizer without the parser TRL was given
    tinylm.save(trainer.model.to("cpu").float(), plain, candidate)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tool_calls = [h.get("tools/call_frequency") for h in logs if "tools/call_frequency" in h]
    return {"episodes": counted["episodes"], "wall_seconds": wall, "cpu_seconds": cpu,
            "optimizer_steps": trainer.state.global_step,
            "reward_first_step": counted["per_step"][0] if counted["per_step"] else None,
            "reward_last_step": counted["per_step"][-1] if counted["per_step"] else None,
            "max_completion_length": budget, "tool_call_frequency_last": tool_calls[-1]
            if tool_calls else None, "candidate": str(candidate), "train_call_seconds": train_call,
            "torch": torch.__version__}


def worker(args) -> None:
    """One side (or the baseline evaluation) in this process; its result as JSON to --result."""
    threads(1)
    if args.worker == "baseline":
        result = {"before": evaluate(args.champion, args.tasks, args.max_new_tokens, args.seed)}
    else:
        work = args.out / args.worker
        work.mkdir(parents=True, exist_ok=True)
        result = run_offseason(args, work) if args.worker == "offseason" else \
            run_trl(args, work, fix_positions=args.worker == "trl-positions")
        result["after"] = evaluate(Path(result["candidate"]), args.tasks, args.max_new_tokens,
                                   args.seed)
    args.result.write_text(json.dumps(result, indent=1))


def table(results: dict, args) -> str:
    """Every side's figures (Markdown), then offseason against each TRL side."""
    before = results["baseline"]["before"]
    lines = [f"{args.steps} on-policy steps x {args.tasks_per_step} tasks x {args.samples} "
             f"samples, lr {args.lr}, {args.batch_size} episodes per optimizer step, 1 torch "
             f"thread; pass@1 greedy on {before['items']} held-out items",
             "",
             "| side | pass@1 before | pass@1 after | tool calls after | episodes | wall s | "
             "CPU s | samples/s | samples/CPU s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for side in SIDES:
        r = results.get(side)
        if r is None:
            continue
        lines.append(
            f"| {side} | {before['pass_at_1']:.1%} | {r['after']['pass_at_1']:.1%} | "
            f"{r['after']['tool_call_rate']:.0%} | {r['episodes']} | {r['wall_seconds']:.1f} | "
            f"{r['cpu_seconds']:.1f} | {r['episodes'] / r['wall_seconds']:.1f} | "
            f"{r['episodes'] / r['cpu_seconds']:.1f} |")
    o = results.get("offseason")
    for side in SIDES[1:]:
        t = results.get(side)
        if o is None or t is None:
            continue
        speed = (o["episodes"] / o["wall_seconds"]) / (t["episodes"] / t["wall_seconds"])
        per_cpu = (o["episodes"] / o["cpu_seconds"]) / (t["episodes"] / t["cpu_seconds"])
        gain = o["after"]["pass_at_1"] - t["after"]["pass_at_1"]
        lines += ["", f"offseason vs {side}: samples/s {speed:.2f}x (goal >= 1.2x: "
                      f"{'met' if speed >= 1.2 else 'not met'}), per CPU second {per_cpu:.2f}x; "
                      f"pass@1 after {gain * 100:+.1f} points (goal >= 0: "
                      f"{'met' if gain >= 0 else 'not met'})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prepare the tasks, run the baseline and each side in its own process, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out", type=Path, default=Path("/tmp/trlbench"),
                        help="work folder: tasks, candidates, results.json, results.md")
    parser.add_argument("--champion", type=Path, default=None,
                        help="generation-0 model folder (default: OUT/champion)")
    parser.add_argument("--steps", type=int, default=8, help="on-policy steps per side")
    parser.add_argument("--tasks-per-step", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="episodes per task (group size)")
    parser.add_argument("--batch-size", type=int, default=64, help="episodes per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--trl-max-completion-length", type=int, default=0,
                        help="TRL's whole-completion token budget; 0: the largest that stays "
                             "inside the model's positions, at most --max-new-tokens")
    parser.add_argument("--train-tasks", type=int, default=2000, help="training task pool size")
    parser.add_argument("--reward-workers", type=int, default=1,
                        help="offseason's reward.workers (1: in its own process, as TRL scores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--worker", choices=["baseline", *SIDES], help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.champion = (args.champion or args.out / "champion").resolve()
    if args.worker:
        worker(args)
        return 0
    unknown = [side for side in args.sides.split(",") if side and side not in SIDES]
    if unknown:
        parser.error(f"--sides: unknown {unknown}; of {list(SIDES)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (offseason's on-policy loop is train.grpo.steps > 1)")
    if (args.tasks_per_step * args.samples) % args.batch_size:
        parser.error("--tasks-per-step x --samples must be a multiple of --batch-size")
    if not (args.champion / "config.json").exists():
        parser.error(f"{args.champion}: no model folder; copy the generation-0 champion there")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    tasks = args.out / "tasks.jsonl"
    write_tasks(tasks, args.train_tasks, args.seed + 49)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1"}
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k not in ("sides", "worker", "tasks", "result", "out", "champion")]
    results = {}
    for side in ["baseline"] + [s for s in args.sides.split(",") if s]:
        out = args.out / f"{side}.json"
        out.unlink(missing_ok=True)
        began = time.perf_counter()
        print(f"== {side}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, *passed, "--out", str(args.out),
                               "--champion", str(args.champion), "--worker", side,
                               "--tasks", str(tasks), "--result", str(out)], cwd=ROOT, env=env)
        if done.returncode or not out.exists():
            print(f"{side}: failed (exit {done.returncode})", file=sys.stderr)
            continue
        results[side] = json.loads(out.read_text())
        print(f"== {side}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    if "baseline" not in results:
        return 1
    text = table(results, args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    return 0 if all(s in results for s in args.sides.split(",") if s) else 1


if __name__ == "__main__":
    sys.exit(main())
