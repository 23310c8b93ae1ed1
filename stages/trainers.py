"""The trainers behind the train stage: SFT and GRPO on the transformers Trainer, DPO through TRL.

Helper of `stages/train.py` (no work at import time, nothing read or written here but the
checkpoints the Trainer saves). What they share:

- the data are pre-tokenized rollouts (`token_ids`, `model_mask`: 1 where the model chose the token),
  so the loss is only ever on the model's own tokens: never on the prompt, never on a tool result
  the environment injected;
- `TrainingArguments` built in one place (`arguments`): precision from the hardware (bf16 only on a
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
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments


def hardware() -> dict:
    """Where training runs and at what precision."""
    cuda = torch.cuda.is_available()
    bf16 = cuda and torch.cuda.is_bf16_supported()
    return {"device": "cuda" if cuda else "cpu", "bf16": bf16,
            "precision": "bf16" if bf16 else "fp32"}


def deepspeed_config(setting: int | str, bf16: bool) -> dict | None:
    """The DeepSpeed config for `train.deepspeed`: None (off), a ZeRO stage, or a JSON file.

    The optimizer stays the Trainer's torch AdamW (handed to DeepSpeed, hence
    `zero_allow_untested_optimizer`): the same update as without DeepSpeed, and no op to compile.
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


def arguments(output_dir: Path, *, steps: int, batch_size: int, lr: float, seed: int,
              checkpoint_steps: int, deepspeed: dict | None, cls=TrainingArguments, **extra):
    """TrainingArguments (or a TRL config class) with this project's settings."""
    hw = hardware()
    if deepspeed is not None:
        single_process_distributed(hw["device"])
    return cls(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
        # no warm-up under 20 steps: HF's warm-up gives step 0 a learning rate of 0
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=steps // 20,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        seed=seed, data_seed=seed, bf16=hw["bf16"], use_cpu=hw["device"] == "cpu",
        logging_steps=1, save_strategy="steps", save_steps=checkpoint_steps, save_total_limit=1,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, deepspeed=deepspeed,
        ddp_backend="gloo" if hw["device"] == "cpu" and deepspeed is not None else None,
        **extra,
    )


class StepLog:
    """Adds training tokens per second to each logged step (a mixin for any Trainer)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._tokens = getattr(self, "_tokens", 0) + sum(
            int(v.sum()) for k, v in inputs.items() if k.endswith("attention_mask"))
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs:
            now = time.perf_counter()
            since = getattr(self, "_since", None)
            if since is not None:
                logs["tokens_per_second"] = round(self._tokens / max(now - since, 1e-9), 1)
            self._since, self._tokens = now, 0
            logs.update(getattr(self, "_extra", {}))
        super().log(logs, start_time)


def collate_sft(bos: int, eos: int, pad: int):
    """Right-padded `<bos> ids <eos>`; labels -100 wherever the model did not choose the token."""
    def collate(rows: list[dict]) -> dict:
        width = max(len(r["token_ids"]) for r in rows) + 2
        inputs = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            seq = [bos, *row["token_ids"], eos]
            keep = [0, *row["model_mask"], 1]
            inputs[i, :len(seq)] = torch.tensor(seq)
            attention[i, :len(seq)] = 1
            labels[i, :len(seq)] = torch.tensor([t if k else -100 for t, k in zip(seq, keep)])
        return {"input_ids": inputs, "attention_mask": attention, "labels": labels}
    return collate


class SFTTrainer(StepLog, Trainer):
    """The transformers Trainer, with per-step throughput; the model computes its own loss."""


def collate_grpo(bos: int, pad: int):
    """`<bos> ids`, right-padded, with the per-token mask, rollout log-probs and advantage.

    Position t of `mask`, `old_logprobs` and `ref_logprobs` belongs to the token at t + 1 of the
    inputs (the one the logits at t predict). The end-of-sequence choice has no recorded log-prob,
    so it is not part of the GRPO loss.
    """
    def collate(rows: list[dict]) -> dict:
        width = max(len(r["token_ids"]) for r in rows) + 1
        n = len(rows)
        out = {"input_ids": torch.full((n, width), pad, dtype=torch.long),
               "attention_mask": torch.zeros((n, width), dtype=torch.long),
               "mask": torch.zeros((n, width - 1)), "old_logprobs": torch.zeros((n, width - 1)),
               "ref_logprobs": torch.zeros((n, width - 1)),
               "advantage": torch.tensor([r["advantage"] for r in rows], dtype=torch.float)}
        for i, row in enumerate(rows):
            length = len(row["token_ids"])
            out["input_ids"][i, :length + 1] = torch.tensor([bos, *row["token_ids"]])
            out["attention_mask"][i, :length + 1] = 1
            out["mask"][i, :length] = torch.tensor(row["model_mask"], dtype=torch.float)
            out["old_logprobs"][i, :length] = torch.tensor(row["logprobs"])
            if row.get("ref_logprobs") is not None:
                out["ref_logprobs"][i, :length] = torch.tensor(row["ref_logprobs"])
        return out
    return collate


def token_logprobs(model, input_ids, attention_mask) -> torch.Tensor:
    """Per position t: the log-probability of token t + 1 given the tokens up to t, in fp32."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(2, input_ids[:, 1:, None]).squeeze(2)


@torch.no_grad()
def reference_logprobs(model, rows: list[dict], bos: int, pad: int, batch_size: int) -> None:
    """Fill `ref_logprobs` (the champion's, per token) into each GRPO row, in place."""
    collate = collate_grpo(bos, pad)
    model.eval()
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = collate([{"token_ids": r["token_ids"], "model_mask": r["model_mask"],
                          "logprobs": [0.0] * len(r["token_ids"]), "advantage": 0.0}
                         for r in chunk])
        logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
        for i, row in enumerate(chunk):
            row["ref_logprobs"] = logp[i, :len(row["token_ids"])].tolist()


class GRPOTrainer(StepLog, Trainer):
    """Group-relative policy optimization on recorded rollouts: our loss on the Trainer.

    Per model-chosen token: -min(ratio * A, clip(ratio, 1 - clip, 1 + clip) * A) with ratio the
    policy's probability over the one recorded at rollout time and A the episode's group-relative
    advantage; plus `kl_coef` times the k3 estimate of KL(policy || champion). Averaged over the
    batch's model tokens.
    """

    def __init__(self, *args, clip: float, kl_coef: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.clip, self.kl_coef = clip, kl_coef
        self._extra = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logp = token_logprobs(model, inputs["input_ids"], inputs["attention_mask"])
        mask = inputs["mask"]
        ratio = torch.exp(logp - inputs["old_logprobs"])
        advantage = inputs["advantage"][:, None]
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        per_token = -torch.minimum(ratio * advantage, clipped * advantage)
        if self.kl_coef:
            delta = inputs["ref_logprobs"] - logp
            per_token = per_token + self.kl_coef * (torch.exp(delta) - delta - 1)
        tokens = mask.sum().clamp(min=1)
        loss = (per_token * mask).sum() / tokens
        with torch.no_grad():
            outside = ((ratio - 1).abs() > self.clip).float()
            self._extra = {"clip_fraction": round(float((outside * mask).sum() / tokens), 4)}
        return (loss, None) if return_outputs else loss


def total_steps(n: int, batch_size: int, epochs: float) -> int:
    return max(1, math.ceil(epochs * math.ceil(n / batch_size)))


class Progress(TrainerCallback):
    """About ten progress lines per training on stderr (the Trainer's own bar is off)."""

    def __init__(self, label: str):
        self.label = label

    def on_log(self, args, state, control, logs=None, **kwargs):
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
