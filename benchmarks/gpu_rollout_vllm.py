"""GPU check: the rollout stage through vLLM on the demo's tiny model, against the transformers backend.

    make setup vllm-env                                   # .venv (offseason) and .venv-vllm (vLLM)
    .venv/bin/python benchmarks/gpu_rollout_vllm.py       # prints both throughputs (Markdown)
    .venv/bin/python benchmarks/gpu_rollout_vllm.py --tasks 512 --samples 8 --keep /tmp/gpu-check

Generation 0 is the demo's chat model, the tasks are arith's chat tasks, and `stages.rollout.run`
runs them through vLLM (each turn sent as token ids rendered by the chat template here, the
model's ids back with `return_tokens_as_token_ids`, the end ids as `stop_token_ids`) and through
the transformers backend; it fails unless vLLM gave token ids, tool calls, and prompts that begin
every stored conversation as rendered here. `--api chat` sends the turns to vLLM's
/chat/completions instead (messages and `tools=`, vLLM started with `--enable-auto-tool-choice
--tool-call-parser hermes`, `return_token_ids`), which offseason checks token for token against
its own rendering and parsing (`runtime.rollout.api: chat`).

What it does, in a temporary folder: builds generation 0 with `stages.init` (the demo's params.yaml
`init:` section; `--warmup-steps` shortens the warm start), writes a task file of `--tasks`
arithmetic questions, then runs the rollout stage twice on the same tasks and seed:
1. `rollout.backend: openai` with `rollout.server_command` = `.venv-vllm/bin/vllm serve {model}
   --port {port} ...`: the stage starts vLLM on the champion folder in its own process group, waits
   for /health, runs the multi-turn episodes (tool results between turns) and stops it;
2. `rollout.backend: transformers`, the stage as it is (it loads the model where
   `stages.tinylm.load` puts it).
It prints episodes, generated tokens and tokens/s of both (the server's start-up is not counted)
and the share of conversations with identical ids (greedy runs with `--temperature 0` should agree
on most; float32 vs vLLM's kernels may flip near-ties).

What was checked and what was not (written without a GPU; vLLM could not be installed or run):
- checked on CPU: the same rollout stage through `rollout.server_command` starting
  `stages.generation.serve_tiny` (an OpenAI-compatible server with vLLM's extensions) in
  tests/stages/generation/test_backends.py, episodes identical to the transformers backend, server stopped after;
- NOT checked: that vLLM 0.33 loads the demo folder. It is a standard GPT-2 (`config.json`,
  `model.safetensors`) with a character-level `PreTrainedTokenizerFast` (`tokenizer.json`): vLLM
  supports GPT-2 and loads tokenizers with AutoTokenizer, but the tiny vocabulary (~30 tokens), the
  80-position context and the head size 32 are untested with its kernels. If the tokenizer is the
  problem, try `--tokenizer-mode slow`; if the kernels are, `--enforce-eager` is already set and
  `--dtype float32` keeps the comparison fair.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import config as cfg  # noqa: E402
from stages import init, rollout  # noqa: E402
from stages.envs import arith  # noqa: E402

VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
COMMAND = (f"{VLLM} serve {{model}} --port {{port}} --host 127.0.0.1 --dtype float32 "
           "--enforce-eager --gpu-memory-utilization 0.3 --max-logprobs 1 "
           "--return-tokens-as-token-ids")


def main(argv: list[str] | None = None) -> int:
    """Time the rollout on vLLM and print the numbers; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4, help="rollout.samples_per_task")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--server-command", default=COMMAND,
                        help="rollout.server_command ({model} and {port} are filled in)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    parser.add_argument("--api", choices=("completions", "chat"), default="completions",
                        help="the chat path's endpoint (runtime.rollout.api)")
    args = parser.parse_args(argv)
    if args.api == "chat" and args.server_command == COMMAND:
        args.server_command += " --enable-auto-tool-choice --tool-call-parser hermes"
    if not VLLM.exists() and args.server_command == COMMAND:
        print(f"error: {VLLM} not found; run `make vllm-env` first (needs a GPU machine with PyPI)",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("warning: torch sees no CUDA GPU; vLLM will most likely refuse to start",
              file=sys.stderr)
    work = args.keep or Path(tempfile.mkdtemp(prefix="offseason-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return chat_check(args, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def both_backends(args, work: Path, run_stage) -> dict:
    """{name: (metrics, rows)} of `run_stage(config, out)` through vLLM, then in-process."""
    common = {"samples_per_task": args.samples, "temperature": args.temperature}
    results = {}
    for name, config in (
        ("vllm (openai backend)", cfg.Rollout(backend="openai", concurrency=args.concurrency,
                                              server_command=args.server_command,
                                              api=getattr(args, "api", "completions"), **common)),
        ("transformers", cfg.Rollout(**common)),
    ):
        out = work / f"rollouts-{config.backend}.parquet"
        results[name] = (run_stage(config, out), pq.read_table(out).to_pylist())
    return results


def chat_check(args, work: Path) -> int:
    """The rollout stage through the server and in-process on arith's chat tasks."""
    import json

    base = cfg.Base(seed=0)
    params = cfg.load("init", ROOT / "params.yaml")
    champion = work / "champion"
    init.run(base, cfg.Init(**{**params.__dict__, "warmup_steps": args.warmup_steps}), champion)
    rng = random.Random(7)
    tasks = work / "arith.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"t{i:05d}", **arith.chat_task(
        arith.sample_question(rng))}) + "\n" for i in range(args.tasks)))
    specs = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith", tasks=str(tasks))}
    results = both_backends(args, work, lambda config, out: rollout.run(
        base, config, specs, champion, out, ROOT))
    print(f"\ntorch {torch.__version__}, GPU: "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}\n")
    print("| backend | episodes | generated tokens | seconds | tokens/s | tool use |")
    print("|---|---|---|---|---|---|")
    for name, (metrics, rows) in results.items():
        used = sum(r["tool_calls"] > 0 for r in rows) / max(1, len(rows))
        print(f"| {name} | {metrics['episodes']} | {metrics['generated_tokens']} | "
              f"{metrics['seconds']} | {metrics['tokens_per_second']} | {used:.3f} |")
    (served, served_rows), (_, local_rows) = list(results.values())
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(served_rows, local_rows))
    print(f"\nconversations with identical ids in both: {same}/{len(local_rows)}; requests: "
          f"{served['requests']}, retries: {served['retries']}")
    prompts_agree = all(a["token_ids"][:a["model_mask"].index(1)]
                        == b["token_ids"][:b["model_mask"].index(1)]
                        for a, b in zip(served_rows, local_rows) if 1 in a["model_mask"])
    if not all(any(r["model_mask"]) for r in served_rows):
        print("error: vLLM returned no token ids for some episodes", file=sys.stderr)
        return 1
    if not any(r["tool_calls"] for r in served_rows):
        print("error: no episode through vLLM called the tool", file=sys.stderr)
        return 1
    if not prompts_agree:
        print("error: a stored conversation does not begin with its rendered prompt",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
