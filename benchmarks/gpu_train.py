"""GPU check: the demo model trained by the train stage's SFT under DeepSpeed ZeRO-2 in bf16.

    .venv/bin/python benchmarks/gpu_train.py              # needs one CUDA GPU (see docs/gpus.md, "GPUs")
    .venv/bin/python benchmarks/gpu_train.py --steps 200 --batch 256

Builds the demo's generation-0 architecture (params.yaml `init:`), trains it on warm-start
demonstrations through `stages.train.train_sft` with `train.deepspeed: 2` (one process: the stage
sets MASTER_ADDR, RANK, WORLD_SIZE and LOCAL_RANK itself, NCCL on a GPU), checks that the Trainer
really ran under DeepSpeed in bf16, and prints training tokens/s and peak GPU memory. It has NOT
been run on the project's machines, which have no GPU: it exits with a message there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from stages import config as cfg  # noqa: E402
from stages import tinylm  # noqa: E402
from stages.envs import arith  # noqa: E402
from stages.training import sft, trainers  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Time training steps on the GPU and print the numbers; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_train: no CUDA GPU visible to torch; run this on a machine with one "
              "(docs/gpus.md, 'GPUs')", file=sys.stderr)
        return 2
    from train import demonstrations, fresh, tokens_of  # benchmarks/train.py

    tinylm.quiet()
    init = cfg.load("init", ROOT / "params.yaml")
    tokenizer = tinylm.build_tokenizer(arith)
    rows = demonstrations(tokenizer, args.steps * args.batch, seed=0)
    hw = trainers.hardware()
    config = cfg.SFT(epochs=1, lr=1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tinylm.save(fresh(init, tokenizer), tokenizer, work / "champion")
        ds = trainers.deepspeed_config(2, hw["bf16"])

        args_for = trainers.ArgumentsFor(work / "run", batch_size=args.batch, epochs=1, lr=1e-3,
                                         seed=0, checkpoint_steps=10 ** 9, deepspeed=ds)
        trainer = sft.trainer(fresh(init, tokenizer), tokenizer, work / "champion", rows,
                              args_for, config)
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        trainer.train()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    assert trainer.is_deepspeed_enabled, "the Trainer did not run under DeepSpeed"
    print(f"{torch.cuda.get_device_name()}: ZeRO-2, {hw['precision']}, {args.steps} steps of "
          f"{args.batch} sequences")
    print(f"training: {tokens_of(rows) / seconds:.0f} tokens/s ({seconds:.1f} s)")
    print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2 ** 20:.0f} MiB allocated, "
          f"{torch.cuda.max_memory_reserved() / 2 ** 20:.0f} MiB reserved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
