"""Typed, checked configuration: one frozen dataclass per `params.yaml` section.

Every stage reads exactly its own section (plus `base:`) through `load(section)`. The whole file
is checked by `load_all()` before a cycle starts, so a typo fails in a second, not after an hour of
rollouts. Every error names the file, the key's full name and what to write instead.

    python -m stages.config params.yaml     # check a params file and print it with defaults filled in
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml


class ParamsError(ValueError):
    """A params.yaml problem; the message names the file, the key and the fix."""


def _fail(where: str, message: str) -> typing.NoReturn:
    raise ParamsError(f"{where}: {message}")


@dataclass(frozen=True)
class Base:
    """Settings every stage shares."""

    seed: int = 0  # every source of randomness derives from it, so DVC's run-cache stays correct
    environment: str = "arith"  # the environment tasks, rollouts and benchmarks run in
    registered_model: str = "offseason-agent"  # MLflow registered model name
    threads: int = 0  # torch CPU threads; 0 = all cores

    def __post_init__(self):
        from stages.environments import ENVIRONMENTS

        if self.environment not in ENVIRONMENTS:
            raise ParamsError(
                f"base.environment: unknown environment {self.environment!r}; "
                f"choose one of {sorted(ENVIRONMENTS)}"
            )
        if self.threads < 0:
            raise ParamsError("base.threads: must be >= 0 (0 uses every core)")


@dataclass(frozen=True)
class Init:
    """Generation 0 for the demo: a tiny GPT-2 built from a config and a short supervised warm start."""

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 80
    warmup_steps: int = 500  # optimizer steps of the warm start
    batch_size: int = 64
    lr: float = 3e-3
    tool_fraction: float = 0.2  # share of demonstrations that use the calculator

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ParamsError(
                f"init.n_embd ({self.n_embd}) must be divisible by init.n_head ({self.n_head})"
            )
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ParamsError("init.tool_fraction: must be between 0 and 1")
        _positive("init", warmup_steps=self.warmup_steps, batch_size=self.batch_size, lr=self.lr)


@dataclass(frozen=True)
class Simulate:
    """Synthetic production traffic: the champion answering a task mix that shifts day by day."""

    traces_per_day: int = 1024
    shift_per_day: float = 0.15  # how far the task mix moves towards multiplication each day
    feedback_rate: float = 0.5  # share of traces in which the user left thumbs up/down
    junk: bool = True  # add a malformed line, a duplicate and an e-mail address, as real logs have

    def __post_init__(self):
        _positive("simulate", traces_per_day=self.traces_per_day)
        if not 0.0 <= self.feedback_rate <= 1.0:
            raise ParamsError("simulate.feedback_rate: must be between 0 and 1")


@dataclass(frozen=True)
class Ingest:
    """Reading traces from the inbox."""

    scrub_secrets: bool = True  # API keys and tokens of the common providers, JWTs, Bearer tokens
    scrub_emails: bool = True
    scrub_cards: bool = True  # payment card numbers that pass the Luhn check
    scrub_ips: bool = True
    scrub_phones: bool = True
    max_messages: int = 64  # a trace with more messages is quarantined
    max_line_bytes: int = 10_000_000  # a longer line is quarantined unread (JSON documents: 10x)

    def __post_init__(self):
        _positive("ingest", max_messages=self.max_messages, max_line_bytes=self.max_line_bytes)


@dataclass(frozen=True)
class Validate:
    """Great Expectations checks on the ingested traces."""

    min_valid_fraction: float = 0.9  # below this share of valid traces the stage fails
    # stop the cycle when the task mix moved more than this from the previous cycle's (total
    # variation distance, 0 to 1); 1.0 never stops
    max_drift: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.min_valid_fraction <= 1.0:
            raise ParamsError("validate.min_valid_fraction: must be between 0 and 1")
        if not 0.0 <= self.max_drift <= 1.0:
            raise ParamsError("validate.max_drift: must be between 0 and 1 (1 never stops)")


@dataclass(frozen=True)
class Rollout:
    """The champion re-attempting the tasks of the validated traces."""

    backend: str = "transformers"
    samples_per_task: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 48
    batch_size: int = 1024  # sequences generated together; 1024 is fastest on 2 CPU cores
    max_tasks: int = 0  # 0 = every task; otherwise the first N (sorted by trace id)

    def __post_init__(self):
        if self.backend != "transformers":
            raise ParamsError(
                f"rollout.backend: {self.backend!r} is not available yet; use 'transformers'"
            )
        _positive(
            "rollout",
            samples_per_task=self.samples_per_task,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
        )
        if self.temperature < 0:
            raise ParamsError("rollout.temperature: must be >= 0 (0 is greedy)")
        if self.max_tasks < 0:
            raise ParamsError("rollout.max_tasks: must be >= 0 (0 means every task)")


@dataclass(frozen=True)
class Reward:
    """Verification of each rollout."""

    correct_weight: float = 1.0  # weight of the verified-correct component in the reward


@dataclass(frozen=True)
class Train:
    """Training the champion on its scored rollouts: SFT, DPO or GRPO (stages/train.py)."""

    algorithm: str = "sft"  # sft | dpo | grpo
    epochs: float = 8.0  # passes over this cycle's examples plus the replayed ones
    lr: float = 1e-3
    batch_size: int = 64
    min_examples: int = 8  # fewer SFT examples / DPO pairs / GRPO groups: the champion is kept
    replay_fraction: float = 1.0  # share of earlier cycles' examples trained on again
    beta: float = 0.1  # dpo: strength of the pull towards the reference (the champion)
    clip: float = 0.2  # grpo: the ratio against the rollout policy is clipped to 1 +- clip
    kl_coef: float = 0.0  # grpo: weight of the KL term to the champion; 0 = none
    lora_r: int = 0  # LoRA rank through PEFT, merged into the candidate; 0 = full fine-tuning
    # DeepSpeed: 0 = off, 1 / 2 / 3 = that ZeRO stage, or the path of a DeepSpeed JSON config
    deepspeed: int | str = 0
    checkpoint_steps: int = 50  # optimizer steps between checkpoints (a killed stage resumes)

    def __post_init__(self):
        if self.algorithm not in ("sft", "dpo", "grpo"):
            raise ParamsError(f"train.algorithm: unknown algorithm {self.algorithm!r}; choose "
                              f"one of sft, dpo, grpo")
        _positive("train", epochs=self.epochs, lr=self.lr, batch_size=self.batch_size,
                  beta=self.beta, clip=self.clip, checkpoint_steps=self.checkpoint_steps)
        if not 0.0 <= self.replay_fraction <= 1.0:
            raise ParamsError("train.replay_fraction: must be between 0 and 1")
        if self.kl_coef < 0 or self.lora_r < 0:
            raise ParamsError("train.kl_coef and train.lora_r: must be >= 0 (0 turns them off)")
        if isinstance(self.deepspeed, bool) or (
                isinstance(self.deepspeed, int) and self.deepspeed not in (0, 1, 2, 3)) or (
                isinstance(self.deepspeed, str) and not self.deepspeed.endswith(".json")):
            raise ParamsError(f"train.deepspeed: {self.deepspeed!r} is neither a ZeRO stage "
                              f"(0 = off, 1, 2, 3) nor the path of a DeepSpeed .json config")


@dataclass(frozen=True)
class Gate:
    """Candidate against champion on the held-out benchmark."""

    benchmark_size: int = 0  # 0 = every item of the benchmark file
    min_improvement: float = 0.0  # the paired interval's lower bound must exceed this
    confidence: float = 0.9
    bootstrap_samples: int = 2000

    def __post_init__(self):
        if not 0.5 <= self.confidence < 1.0:
            raise ParamsError("gate.confidence: must be in [0.5, 1), e.g. 0.9")
        _positive("gate", bootstrap_samples=self.bootstrap_samples)
        if self.benchmark_size < 0:
            raise ParamsError("gate.benchmark_size: must be >= 0 (0 means every item)")


SECTIONS: dict[str, type] = {
    "base": Base,
    "init": Init,
    "simulate": Simulate,
    "ingest": Ingest,
    "validate": Validate,
    "rollout": Rollout,
    "reward": Reward,
    "train": Train,
    "gate": Gate,
}


def _positive(section: str, **values):
    for key, value in values.items():
        if value <= 0:
            raise ParamsError(f"{section}.{key}: must be > 0, got {value}")


def _check_type(where: str, key: str, value, expected: type):
    if expected is float and isinstance(value, str):
        try:  # PyYAML reads `1e-3` (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    ok = (
        isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is not float
        else isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if not ok:
        example = {int: "a whole number like 4", float: "a number like 0.001", bool: "true or false",
                   str: "a string"}.get(expected, f"one of {expected}")
        _fail(where, f"{key}: expected {example}, got {value!r} ({type(value).__name__})")
    return float(value) if expected is float else value


def _build(cls: type, section: str, raw, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        _fail(where, f"section '{section}' must be a mapping of keys to values, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{section}.{near[0]}'?)" if near else ""
            _fail(where, f"unknown key '{section}.{key}'{hint}; valid keys in '{section}': "
                         f"{', '.join(names)}")
        values[key] = _check_type(where, f"{section}.{key}", value, hints[key])
    try:
        return cls(**values)
    except ParamsError as err:
        _fail(where, str(err))


def read_params(path: str | Path = "params.yaml") -> dict:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: not found; run from the project root (where dvc.yaml is)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections, got {type(raw).__name__}")
    return raw


def load(section: str, path: str | Path = "params.yaml"):
    """The typed config of one section, checked. Missing sections are errors, missing keys defaults."""
    raw = read_params(path)
    if section not in raw:
        _fail(str(path), f"missing section '{section}:'; add it (an empty '{section}: {{}}' takes "
                         f"the defaults)")
    return _build(SECTIONS[section], section, raw[section], str(path))


def load_all(path: str | Path = "params.yaml") -> dict:
    """Every section, checked; unknown and missing sections are errors."""
    raw = read_params(path)
    for name in raw:
        if name not in SECTIONS:
            near = difflib.get_close_matches(str(name), list(SECTIONS), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            _fail(str(path), f"unknown section '{name}'{hint}; valid sections: "
                             f"{', '.join(SECTIONS)}")
    return {name: load(name, path) for name in SECTIONS}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else "params.yaml"
    try:
        configs = load_all(path)
    except ParamsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(yaml.safe_dump({k: dataclasses.asdict(v) for k, v in configs.items()}, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
