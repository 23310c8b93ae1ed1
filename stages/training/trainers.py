"""What the train stage's algorithms share (`stages/training/sft.py`, `dpo.py`, `grpo.py`).

Helper of `stages/train.py` (no work at import time, nothing read or written here but the
checkpoints the Trainer saves). What the algorithms share:

- the data are pre-tokenized rollouts (`token_ids`, `model_mask`: 1 where the model chose the token),
  so the loss is only ever on the model's own tokens: never on the prompt, never on a tool result
  the environment injected;
- `TrainingArguments` built in one place (`ArgumentsFor`): precision from the hardware (bf16 only on a
  GPU that supports it, fp32 on CPU, never TRL's default bf16 on a CPU), checkpoints every
  `train.checkpoint_steps`, DeepSpeed ZeRO when `train.deepspeed` asks for it;
- one row per optimizer step in `trainer.state.log_history` (loss, learning rate, gradient norm,
  tokens per second), which survives a resume from a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments


def hardware() -> dict:
    """Where training runs and at what precision."""
    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()
    return {"device": "cuda" if cuda else "cpu", "bf16": bf16,
            "precision": "bf16" if bf16 else "fp32"}


def deepspeed_config(setting: int | str, bf16: bool) -> dict | None:
    """The DeepSpeed config for `train.deepspeed`: None (off), a ZeRO stage, or a JSON file.

    The optimizer stays the Trainer's torch AdamW (handed to DeepSpeed, hence
    `zero_allow_untested_optimizer`): the same update as without DeepSpeed, and no optimizer op to
    compile (nor, on a CPU, the comm op: `no_shm_comm_op`).
    "auto" values are filled in by transformers from the TrainingArguments.
    """
    if setting in (0, "0"):
        return None
    if isinstance(setting, str):
        path = Path(setting)
        if not path.exists():
            raise FileNotFoundError(f"train.deepspeed: {path} not found; give a ZeRO stage (1, 2, "
                                    f"3) or the path of a DeepSpeed JSON config")
        return json.loads(path.read_text())
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": int(setting)},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,  # our own per-step log is enough
        "wall_clock_breakdown": False,
    }


def single_process_distributed(device: str) -> None:
    """What DeepSpeed needs to start in one process: a rendezvous address and this process's rank.

    Set only where a launcher (the `deepspeed` command, torchrun) has not set them already.
    """
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as sock:  # a free port for the one-member process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def no_shm_comm_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op when it starts on a CPU.

    DeepSpeed's comm backend builds that op (g++, about 45 s on 2 cores, again for every new
    venv) whenever it starts on a CPU, yet only its inference all_reduce (tensor-parallel
    inference) calls it; ZeRO training reduces through torch.distributed (gloo here). Marked as
    DeepSpeed marks an op that cannot build on this machine, so the backend starts without it.
    """
    from stages import io

    with io.heavy_imports():  # DeepSpeed: a second of imports
        import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@dataclass(frozen=True)
class ArgumentsFor:
    """The TrainingArguments of one training, by the number of rows it trains on: the steps are
    `epochs` passes over them in batches of `batch_size`. Called by each algorithm's `trainer`.
    """

    work: Path  # checkpoints
    batch_size: int
    epochs: float
    lr: float
    seed: int
    checkpoint_steps: int
    deepspeed: dict | None

    def __call__(self, rows: int, cls=TrainingArguments, **extra):
        """The TrainingArguments (or a TRL config class `cls`) for training on `rows` rows, with
        this project's settings.
        """
        steps = max(1, math.ceil(self.epochs * math.ceil(rows / self.batch_size)))
        hw = hardware()
        if self.deepspeed is not None:
            single_process_distributed(hw["device"])
            if hw["device"] == "cpu":
                no_shm_comm_op()
        return cls(
            output_dir=str(self.work), max_steps=steps, per_device_train_batch_size=self.batch_size,
            # no warm-up under 20 steps: HF's warm-up gives step 0 a learning rate of 0
            learning_rate=self.lr, lr_scheduler_type="cosine", warmup_steps=steps // 20,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
            seed=self.seed, data_seed=self.seed, bf16=hw["bf16"], use_cpu=hw["device"] == "cpu",
            logging_steps=1, save_strategy="steps", save_steps=self.checkpoint_steps,
            save_total_limit=1, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            remove_unused_columns=False, deepspeed=self.deepspeed,
            ddp_backend="gloo" if hw["device"] == "cpu" and self.deepspeed is not None else None,
            **extra,
        )


def loss_tokens(inputs: dict) -> int:
    """The tokens of a batch that the loss sees: SFT's labels that are not -100, DPO's
    `completion_mask`, GRPO's `mask` (the model's own tokens; never the prompt, padding or a
    tool result).
    """
    if "labels" in inputs:
        return int((inputs["labels"] != -100).sum())
    if "completion_mask" in inputs:
        return int(inputs["completion_mask"].sum())
    return int(inputs["mask"].sum())


class StepLog:
    """Adds to each logged step its tokens per second and its exact token counts: `tokens` (not
    padding) and `loss_tokens` (what the loss saw). They live in `trainer.state.log_history`,
    which a resumed run restores from its checkpoint, so their sum is the training's, across a
    kill (a mixin for any Trainer).
    """

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One training step, counting its tokens."""
        tokens = sum(int(v.sum()) for k, v in inputs.items() if k.endswith("attention_mask"))
        self._tokens = getattr(self, "_tokens", 0) + tokens
        self._loss_tokens = getattr(self, "_loss_tokens", 0) + loss_tokens(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """Log a step, with the tokens per second since the last logged loss."""
        if "loss" in logs:
            now = time.perf_counter()
            since = getattr(self, "_since", None)
            if since is not None:
                logs["tokens_per_second"] = round(self._tokens / max(now - since, 1e-9), 1)
            logs["tokens"] = getattr(self, "_tokens", 0)
            logs["loss_tokens"] = getattr(self, "_loss_tokens", 0)
            self._since, self._tokens, self._loss_tokens = now, 0, 0
            logs.update(getattr(self, "_extra", {}))
        super().log(logs, start_time)


def pad_id(tokenizer) -> int:
    """The padding id: the tokenizer's pad token, else its eos (Llama 3 and Mistral Instruct
    tokenizers have no pad token; padded positions are masked out anyway).
    """
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id


def by_task(rows: list[dict]) -> dict[str, list[dict]]:
    """The scored rollouts (reward not None) grouped by task, tasks in a fixed order."""
    tasks: dict[str, list[dict]] = {}
    for row in rows:
        if row["reward"] is not None:
            tasks.setdefault(row["task_id"], []).append(row)
    return {task: tasks[task] for task in sorted(tasks)}


def lora(model, r: int):
    """`model` with LoRA adapters of rank `r` on every linear layer (PEFT); merged after training."""
    from peft import LoraConfig, get_peft_model

    # GPT-2's projections are Conv1D layers (weights stored transposed): fan_in_fan_out
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                            target_modules="all-linear", fan_in_fan_out=True))


class Progress(TrainerCallback):
    """About ten progress lines per training on stderr (the Trainer's own bar is off)."""

    def __init__(self, label: str):
        """Progress of the training `label` names."""
        self.label = label

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Print the loss about every tenth of the steps."""
        every = max(1, state.max_steps // 10)
        if logs and "loss" in logs and (state.global_step % every == 0
                                        or state.global_step == state.max_steps):
            speed = logs.get("tokens_per_second")
            print(f"train ({self.label}): step {state.global_step}/{state.max_steps} loss "
                  f"{logs['loss']:.4f}" + (f" ({speed:.0f} tokens/s)" if speed else ""),
                  file=sys.stderr, flush=True)


def relaunch_on_gpus(setting: int | str, module: str, argv: list[str]) -> None:
    """With DeepSpeed on and several GPUs, run `module` again under the `deepspeed` launcher, one
    process per GPU (which sets RANK, LOCAL_RANK and WORLD_SIZE itself). Returns otherwise.
    """
    gpus = torch.cuda.device_count()
    if setting in (0, "0") or gpus < 2 or "LOCAL_RANK" in os.environ:
        return
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    print(f"train: {gpus} GPUs, relaunching through {launcher}", file=sys.stderr, flush=True)
    os.execv(launcher, [launcher, f"--num_gpus={gpus}", "--module", module, *argv])
