"""Typed, checked configuration: one frozen dataclass per `params.yaml` section.

Every stage reads exactly its own section (plus `base:`) through `load(section)`. The whole file
is checked before a cycle starts (`flows/project/params.py` adds the flow's own sections, `promotion:` and
`deployments:`), so a typo fails in a second, not after an hour of rollouts. Every error names the
file, the key's full name, the value it got and what to write instead.

    offseason check         # check params.yaml and print it with every default filled in
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

# the DVC stages of a cycle in the order they run (dvc.yaml; tests/test_layout.py checks it):
# the one place the cycle, the report, the ledger and the budget read it
CYCLE = ("ingest", "validate", "rollout", "reward", "train", "champion_scores", "gate")
FEEDBACK = "feedback"  # the reward component of users' ratings (stages/reward.py)


class ParamsError(ValueError):
    """A params.yaml problem; the message names the file, the key and the fix."""


def _fail(where: str, message: str) -> typing.NoReturn:
    raise ParamsError(f"{where}: {message}")


@dataclass(frozen=True)
class Base:
    """Settings every stage shares."""

    seed: int = 0  # every source of randomness derives from it, so DVC's run-cache stays correct
    registered_model: str = "offseason-agent"  # MLflow registered model name
    threads: int = 0  # torch CPU threads; 0 = all cores
    # a Hugging Face chat model (folder or hub id) as generation 0; "" = the demo's tiny model
    model: str = ""

    def __post_init__(self):
        """Refuse a negative thread count."""
        if self.threads < 0:
            raise ParamsError(f"base.threads: must be >= 0 (0 uses every core), got {self.threads}")


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
        """Refuse a model shape or tool fraction that cannot be built."""
        if self.n_embd % self.n_head:
            raise ParamsError(
                f"init.n_embd ({self.n_embd}) must be divisible by init.n_head ({self.n_head})"
            )
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ParamsError(f"init.tool_fraction: must be between 0 and 1, got {self.tool_fraction}")
        _positive("init", warmup_steps=self.warmup_steps, batch_size=self.batch_size, lr=self.lr)


@dataclass(frozen=True)
class Simulate:
    """Synthetic production traffic: the champion answering a task mix that shifts day by day."""

    traces_per_day: int = 1024
    shift_per_day: float = 0.15  # how far the task mix moves towards multiplication each day
    feedback_rate: float = 0.5  # share of traces in which the user left thumbs up/down
    junk: bool = True  # add a malformed line, a duplicate and an e-mail address, as real logs have

    def __post_init__(self):
        """Refuse a non-positive traffic size or a feedback rate outside [0, 1]."""
        _positive("simulate", traces_per_day=self.traces_per_day)
        if not 0.0 <= self.feedback_rate <= 1.0:
            raise ParamsError(f"simulate.feedback_rate: must be between 0 and 1, got {self.feedback_rate}")


@dataclass(frozen=True)
class Ingest:
    """Reading traces from the inbox."""

    # provider keys (gitleaks' formats), JWTs, auth headers, URL passwords, PEM keys, `password = ...`
    scrub_secrets: bool = True
    scrub_emails: bool = True
    scrub_cards: bool = True  # payment card numbers that pass the Luhn check
    scrub_ips: bool = True
    scrub_phones: bool = True
    max_messages: int = 64  # a trace with more messages is quarantined
    max_line_bytes: int = 10_000_000  # a longer line is quarantined unread (JSON documents: 10x)

    def __post_init__(self):
        """Refuse limits that are not positive."""
        _positive("ingest", max_messages=self.max_messages, max_line_bytes=self.max_line_bytes)


@dataclass(frozen=True)
class Validate:
    """Great Expectations checks on the ingested traces."""

    min_valid_fraction: float = 0.9  # below this share of valid traces the stage fails
    # stop the cycle when the task mix moved more than this from the previous cycle's (total
    # variation distance, 0 to 1); 1.0 never stops
    max_drift: float = 1.0
    # the environments: path: this share of the valid traces that give a task is held out, never
    # trained on, and kept in data/holdout/ to refresh the benchmarks (`offseason benchmark
    # refresh`); 0 holds none out
    holdout_fraction: float = 0.0

    def __post_init__(self):
        """Refuse fractions outside [0, 1] (a held-out share above one half)."""
        if not 0.0 <= self.holdout_fraction <= 0.5:
            raise ParamsError(f"validate.holdout_fraction: must be between 0 and 0.5 (a share "
                              f"of the traces kept from training), got {self.holdout_fraction}")
        if not 0.0 <= self.min_valid_fraction <= 1.0:
            raise ParamsError(f"validate.min_valid_fraction: must be between 0 and 1, got "
                              f"{self.min_valid_fraction}")
        if not 0.0 <= self.max_drift <= 1.0:
            raise ParamsError(f"validate.max_drift: must be between 0 and 1 (1 never stops), got "
                              f"{self.max_drift}")


@dataclass(frozen=True)
class Rollout:
    """The champion re-attempting the tasks of the validated traces."""

    backend: str = "transformers"  # or "openai": OpenAI-compatible servers (vLLM, SGLang, TGI)
    samples_per_task: int = 4
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 48
    max_turns: int = 0  # tool calls answered per episode; 0 = the environment's MAX_TURNS
    batch_size: int = 1024  # sequences generated together; 1024 is fastest on 2 CPU cores
    # 0 = every task; otherwise N, shared among the environments by weight (each one's traces'
    # tasks first, then its task file's)
    max_tasks: int = 0
    # openai backend: servers already up (base URLs ending in /v1, separated by commas), or a
    # command that starts one on the champion ({model}, {port} filled in) for this stage only
    urls: str = ""
    server_command: str = ""
    server_timeout: float = 600.0  # seconds to wait for the started server's /health
    model: str = ""  # the served model's name; "" = the first one GET /v1/models lists
    concurrency: int = 64  # requests in flight, over all URLs
    request_timeout: float = 120.0  # seconds per request before it is retried
    retries: int = 5  # per request, on timeouts, 429 and 5xx, with exponential backoff
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the API key, if any
    # the chat path's endpoint: "completions" (token ids in and out; any vLLM) or "chat" (messages
    # and tools= to /chat/completions, tool_calls read back; the server's rendering and parsing
    # checked against ours, token for token; vLLM >= 0.10.2 with --tool-call-parser)
    api: str = "completions"
    # how the chat model writes tool calls (`environments:`): hermes, llama3_json or mistral, as
    # vLLM names them; auto = the one its chat template implies
    tool_parser: str = "auto"

    def __post_init__(self):
        """Refuse an unknown backend and out-of-range sampling and server settings (an unknown
        tool_parser: `check_tool_parser`, which the flow and the rollout stage call).
        """
        if self.backend not in ("transformers", "openai"):
            raise ParamsError(
                f"rollout.backend: {self.backend!r} is not a backend; use 'transformers' or "
                f"'openai'"
            )
        _positive(
            "rollout",
            samples_per_task=self.samples_per_task,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
        )
        _positive("runtime.rollout", concurrency=self.concurrency,
                  server_timeout=self.server_timeout, request_timeout=self.request_timeout)
        if self.api not in ("completions", "chat"):
            raise ParamsError(f"runtime.rollout.api: {self.api!r} is not an endpoint; use "
                              f"'completions' (token ids in and out) or 'chat' (messages and "
                              f"tools, /chat/completions)")
        if self.temperature < 0:
            raise ParamsError(f"rollout.temperature: must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamsError(f"rollout.top_p: must be in (0, 1] (1 turns it off), got {self.top_p}")
        for key, value in {"top_k": self.top_k, "max_turns": self.max_turns,
                           "max_tasks": self.max_tasks,
                           "runtime.rollout.retries": self.retries}.items():
            if value < 0:
                where = key if key.startswith("runtime.") else f"rollout.{key}"
                raise ParamsError(f"{where}: must be >= 0, got {value}")
        for url in self.url_list:
            if not url.startswith(("http://", "https://")):
                raise ParamsError(f"runtime.rollout.urls: {url!r} is not an http(s) URL; write e.g. "
                                  f"http://127.0.0.1:8000/v1")
        if self.server_command and self.urls:
            raise ParamsError("runtime.rollout.server_command and runtime.rollout.urls are both set; set "
                              "server_command to have the stage start a server, or urls to use "
                              "servers already running")
        if self.server_command and "{port}" not in self.server_command:
            raise ParamsError("runtime.rollout.server_command: must contain {port} (the stage picks a "
                              "free port), e.g. '.venv-vllm/bin/vllm serve {model} --port {port} "
                              "--host 127.0.0.1'")
        if self.backend == "openai" and not (self.urls or self.server_command):
            raise ParamsError("rollout.backend 'openai' needs runtime.rollout.urls (servers "
                              "already up) or runtime.rollout.server_command (a server the stage "
                              "starts)")
        if not self.api_key_env.replace("_", "a").isalnum():
            raise ParamsError(f"runtime.rollout.api_key_env: {self.api_key_env!r} is not an environment "
                              f"variable name (the key itself never goes in params.yaml)")

    def check_tool_parser(self, parsers) -> None:
        """Refuse a tool_parser that is not `auto` or one of `parsers` (the names of
        `stages.generation.tool_parsers.PARSERS`, passed in so that this module, which every
        stage imports, does not import the generation package).
        """
        if self.tool_parser != "auto" and self.tool_parser not in parsers:
            raise ParamsError(f"rollout.tool_parser: unknown parser {self.tool_parser!r}; use "
                              f"auto (from the chat template) or one of {', '.join(parsers)}")

    @property
    def url_list(self) -> list[str]:
        """The server URLs, split on commas and whitespace."""
        return [u for u in self.urls.replace(",", " ").split() if u]


@dataclass(frozen=True)
class Reward:
    """Verification of each rollout."""

    # an environment's own components each weigh 1 (its reward is their mean); `feedback` (the
    # user's rating of production's answer, stages/reward.py `trace_feedback`) weighs this much
    # against each of them. 0: recorded, not mixed in
    weights: dict[str, float] = dataclasses.field(default_factory=lambda: {FEEDBACK: 0.0})
    # the name of a trace's `feedback.scores` entry (a Langfuse / LangSmith / OTel evaluation score,
    # a number in [0, 1]) used as the user's rating where the trace has no thumbs; "" = thumbs only
    feedback_score: str = ""
    # more of a cycle's episodes than this failing to score (a judge answering garbage, a tool
    # server that died, a reward that raises) fails the stage: a broken scorer, not a few bad rows
    max_error_fraction: float = 0.5
    # where the rewards and gold checks run (stages/reward.py, "Fan-out"): local processes
    # (0 = one per core, 1 = in the stage's own process), or the Ray cluster at ray_address
    workers: int = 0
    ray_address: str = ""  # "" = the local processes; "auto" or "host:port" = that Ray cluster

    def __post_init__(self):
        """Refuse unknown reward components and bad weights."""
        for name, weight in self.weights.items():
            if name in RETIRED_COMPONENTS:
                raise ParamsError(f"reward.weights.{name}: the tag protocol's components are "
                                  f"retired; an environment's own components each weigh 1 (its "
                                  f"reward is their mean) and only `feedback` has a weight: "
                                  f"write `weights: {{feedback: 0.0}}`")
            if name != FEEDBACK:
                near = difflib.get_close_matches(str(name), (FEEDBACK,), n=1)
                hint = f" (did you mean 'reward.weights.{near[0]}'?)" if near else ""
                raise ParamsError(f"reward.weights.{name}: unknown reward component{hint}; the "
                                  f"one weighted component is {FEEDBACK}")
            if weight < 0:
                raise ParamsError(f"reward.weights.{name}: must be >= 0, got {weight}")
        object.__setattr__(self, "weights", {FEEDBACK: self.weights.get(FEEDBACK, 0.0)})
        if self.workers < 0:
            raise ParamsError(f"runtime.reward.workers: must be >= 0 (0 uses every core), got {self.workers}")
        if not 0.0 <= self.max_error_fraction <= 1.0:
            raise ParamsError(f"reward.max_error_fraction: must be in [0, 1], got "
                              f"{self.max_error_fraction}")


RETIRED_COMPONENTS = ("correct", "format", "tool_ok")  # the tag protocol's reward.weights


@dataclass(frozen=True)
class SFT:
    """`train.sft`: rejection-sampling fine-tuning on the verified-correct rollouts."""

    epochs: float = 8.0  # passes over this cycle's examples plus the replayed ones
    lr: float = 1e-3

    def __post_init__(self):
        """Refuse epochs and a learning rate that are not positive."""
        _positive("train.sft", epochs=self.epochs, lr=self.lr)


@dataclass(frozen=True)
class DPO:
    """`train.dpo`: preference pairs through TRL's DPOTrainer. Fewer epochs and a lower learning
    rate than SFT: at SFT's 8 epochs and 1e-3 it over-fits the demo's pairs and breaks the protocol
    (BENCHMARKS.md, "Switching only train.algorithm").
    """

    epochs: float = 3.0
    lr: float = 2e-4
    beta: float = 0.5  # strength of the pull towards the reference (the champion)

    def __post_init__(self):
        """Refuse epochs, learning rate and beta that are not positive."""
        _positive("train.dpo", epochs=self.epochs, lr=self.lr, beta=self.beta)


@dataclass(frozen=True)
class GRPO:
    """`train.grpo`: group-relative advantages and a clipped ratio against the rollout policy.
    A lower learning rate than SFT: at 1e-3 the candidate broke the protocol and the gate's format
    guard rejected it (BENCHMARKS.md, "Switching only train.algorithm").
    """

    epochs: float = 4.0
    lr: float = 3e-4
    clip: float = 0.3  # the ratio against the rollout policy is clipped to 1 +- clip
    kl_coef: float = 0.0  # weight of the KL term to the champion; 0 = none
    # how the per-token losses are averaged, as TRL's GRPOTrainer names it: bnpo (over the
    # batch's model tokens), grpo (per episode, then over episodes), dapo (over the model tokens
    # of the global batch: every process), dr_grpo (a fixed denominator: episodes x
    # max_completion_length)
    loss_type: str = "bnpo"
    clip_high: float = 0.0  # the upper clip, 1 + clip_high (DAPO's clip-higher); 0: = clip
    # the advantage's scale: group (reward std within the task's samples), batch (over all the
    # cycle's samples) or none (Dr. GRPO: reward - group mean, unscaled)
    scale_rewards: str = "group"
    max_completion_length: int = 256  # dr_grpo's fixed denominator, per episode
    # the KL term weighted by the ratio to the rollout policy (TRL's use_bias_correction_kl): the
    # k3 estimate is unbiased for samples of the current policy, the rollouts are the old one's
    kl_importance_weighted: bool = False

    def __post_init__(self):
        """Refuse non-positive settings, a negative KL coefficient and unknown variants."""
        _positive("train.grpo", epochs=self.epochs, lr=self.lr, clip=self.clip,
                  max_completion_length=self.max_completion_length)
        if self.kl_coef < 0:
            raise ParamsError(f"train.grpo.kl_coef: must be >= 0 (0 turns it off), got "
                              f"{self.kl_coef}")
        if self.clip_high < 0:
            raise ParamsError(f"train.grpo.clip_high: must be >= 0 (0: the same as clip), got "
                              f"{self.clip_high}")
        for key, value, known in (("loss_type", self.loss_type, GRPO_LOSSES),
                                  ("scale_rewards", self.scale_rewards, ("group", "batch", "none"))):
            if value not in known:
                raise ParamsError(f"train.grpo.{key}: {value!r} is not one of "
                                  f"{', '.join(known)} (the names TRL's GRPOTrainer uses)")


GRPO_LOSSES = ("bnpo", "grpo", "dapo", "dr_grpo")


# The training algorithms by name, with their settings; each is the module
# stages/training/<name>.py (the train stage loads it by that name).
ALGORITHMS = {"sft": SFT, "dpo": DPO, "grpo": GRPO}


@dataclass(frozen=True)
class Train:
    """Training the champion on its scored rollouts: SFT, DPO or GRPO (stages/train.py).

    What all algorithms share sits at the top; each algorithm's own settings (epochs, learning
    rate, ...) in its sub-section, `train.sft`, `train.dpo`, `train.grpo`, with defaults that learn
    on the demo, so switching `train.algorithm` alone is enough.
    """

    algorithm: str = "sft"  # sft | dpo | grpo
    batch_size: int = 64
    min_examples: int = 8  # fewer SFT examples / DPO pairs / GRPO groups: the champion is kept
    replay_fraction: float = 1.0  # share of earlier cycles' examples trained on again
    lora_r: int = 0  # LoRA rank through PEFT, merged into the candidate; 0 = full fine-tuning
    # DeepSpeed: 0 = off, 1 / 2 / 3 = that ZeRO stage, or the path of a DeepSpeed JSON config
    deepspeed: int | str = 0
    checkpoint_steps: int = 50  # optimizer steps between checkpoints (a killed stage resumes)
    sft: SFT = dataclasses.field(default_factory=SFT)
    dpo: DPO = dataclasses.field(default_factory=DPO)
    grpo: GRPO = dataclasses.field(default_factory=GRPO)

    def __post_init__(self):
        """Refuse an unknown algorithm and out-of-range training settings."""
        if self.algorithm not in ALGORITHMS:
            raise ParamsError(f"train.algorithm: unknown algorithm {self.algorithm!r}; choose "
                              f"one of {', '.join(ALGORITHMS)}")
        _positive("train", batch_size=self.batch_size, checkpoint_steps=self.checkpoint_steps)
        if not 0.0 <= self.replay_fraction <= 1.0:
            raise ParamsError(f"train.replay_fraction: must be between 0 and 1, got "
                              f"{self.replay_fraction}")
        if self.lora_r < 0:
            raise ParamsError(f"train.lora_r: must be >= 0 (0 turns LoRA off), got {self.lora_r}")
        if isinstance(self.deepspeed, bool) or (
                isinstance(self.deepspeed, int) and self.deepspeed not in (0, 1, 2, 3)) or (
                isinstance(self.deepspeed, str) and not self.deepspeed.endswith(".json")):
            raise ParamsError(f"train.deepspeed: {self.deepspeed!r} is neither a ZeRO stage "
                              f"(0 = off, 1, 2, 3) nor the path of a DeepSpeed .json config")

    @property
    def method(self):
        """The chosen algorithm's own settings: `train.<algorithm>`."""
        return getattr(self, self.algorithm)


@dataclass(frozen=True)
class Gate:
    """Candidate against champion on the held-out benchmark suites, with paired statistics."""

    benchmark_size: int = 0  # 0 = every item of each suite; otherwise its first N
    min_improvement: float = 0.0  # the primary suite's interval lower bound must exceed this
    # the most often the gate may promote a candidate that is no better than the champion, per
    # decision (one-sided): the primary's test and every guard's bound are set by it
    alpha: float = 0.05
    bootstrap_samples: int = 2000
    # the environment whose benchmark must improve; every other one with a benchmark is a guard,
    # with its own environments.<name>.max_regression
    primary: str = "arith"
    # guard on the items earlier champions solved (data/forgetting.jsonl), once there are enough
    forgetting_max_regression: float = 0.1
    forgetting_min_items: int = 30
    # reward-hacking guards, candidate against champion in each suite (environment) apart:
    # mean generated tokens may grow by this fraction at most; generous, since learning to call a
    # tool legitimately makes answers two to three times longer
    max_length_increase: float = 3.0
    max_format_regression: float = 0.1  # share of completions breaking the protocol
    max_tool_error_regression: float = 0.1  # share of completions with a failed tool call
    max_hack_increase: float = 0.0  # share of completions a verifier noted hack_suspected
    # a guard suite too small for its margin (the smallest regression it detects at 80% power,
    # given its size and this cycle's disagreement, is above max_regression) is reported
    # "underpowered" and then: decide (it still blocks or passes, flagged) or skip (it does not)
    underpowered: str = "decide"
    # error control across the sequence of cycles: none (alpha per decision) or lord (LORD++: the
    # primary's level shrinks with each decision and is earned back by promotions, so that the
    # expected share of false promotions among all promotions stays below alpha over the years)
    sequential: str = "none"

    def __post_init__(self):
        """Refuse an alpha outside (0, 0.5] and out-of-range margins."""
        if not 0.0 < self.alpha <= 0.5:
            raise ParamsError(f"gate.alpha: must be in (0, 0.5] (the one-sided error rate, e.g. "
                              f"0.05), got {self.alpha}")
        _positive("gate", bootstrap_samples=self.bootstrap_samples)
        if self.benchmark_size < 0:
            raise ParamsError(f"gate.benchmark_size: must be >= 0 (0 means every item), got "
                              f"{self.benchmark_size}")
        if self.sequential not in ("none", "lord"):
            raise ParamsError(f"gate.sequential: {self.sequential!r}; use none (alpha per "
                              f"decision) or lord (a bound over the sequence of cycles)")
        if self.underpowered not in ("decide", "skip"):
            raise ParamsError(f"gate.underpowered: {self.underpowered!r}; use decide (an "
                              f"underpowered guard still decides, flagged) or skip (it does not)")
        margins = {"forgetting_max_regression": self.forgetting_max_regression,
                   "max_length_increase": self.max_length_increase,
                   "max_format_regression": self.max_format_regression,
                   "max_tool_error_regression": self.max_tool_error_regression,
                   "max_hack_increase": self.max_hack_increase,
                   "forgetting_min_items": self.forgetting_min_items}
        for key, value in margins.items():
            if value < 0:
                raise ParamsError(f"gate.{key}: must be >= 0, got {value}")


@dataclass(frozen=True)
class Judge:
    """`judge:`: the LLM judge an environment's reward may call (`stages/envs/judge.py`), for
    tasks without ground truth. What it computes: the model and the rubric (a changed one
    re-scores) and the per-stage budget; where it runs is `runtime.judge`.
    """

    model: str = ""  # the judge model's name on its server; "" = no judge configured
    rubric: str = ""  # the grading instructions: the text itself, or a file path from the project
    # held out for the benchmarks (champion_scores, gate): a model and/or rubric the training
    # reward never saw, so a policy that games the training judge cannot promote on it alone;
    # "" = the same as model / rubric
    benchmark_model: str = ""
    benchmark_rubric: str = ""
    max_calls: int = 2000  # judge requests per stage run (cache hits are free); then the stage stops
    max_cost: int = 2_000_000  # tokens (prompt + completion, as the server reports) per stage run
    url: str = ""  # runtime: the OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1
    # runtime: or a command the stage starts (on loopback; {port} and {model} filled in), waits
    # healthy for (GET /health), uses and stops, e.g. a local judge folder under vLLM:
    # .venv-vllm/bin/vllm serve models/judge --served-model-name {model} --port {port} --host 127.0.0.1
    server_command: str = ""
    server_timeout: float = 600.0  # runtime: seconds the started server may take to be healthy
    api_key_env: str = "OPENAI_API_KEY"  # runtime: the environment variable holding its key
    request_timeout: float = 60.0  # runtime: seconds per request before it is retried
    retries: int = 3  # runtime: per judgment, on timeouts, 429, 5xx and unparseable answers
    # runtime: judgments in flight at once (the reward stage's judged environments), always
    # within max_calls and max_cost
    concurrency: int = 8

    def __post_init__(self):
        """Refuse budgets and timeouts that cannot work."""
        for key in ("max_calls", "max_cost", "retries"):
            if getattr(self, key) < 0:
                raise ParamsError(f"judge.{key}: must be >= 0, got {getattr(self, key)}")
        if self.concurrency < 1:
            raise ParamsError(f"runtime.judge.concurrency: must be >= 1, got {self.concurrency}")
        if not self.request_timeout > 0:
            raise ParamsError(f"runtime.judge.request_timeout: must be > 0, got "
                              f"{self.request_timeout}")
        if not self.api_key_env.replace("_", "a").isalnum():
            raise ParamsError(f"runtime.judge.api_key_env: {self.api_key_env!r} is not an "
                              f"environment variable's name")
        if self.server_command and self.url:
            raise ParamsError("runtime.judge.server_command and runtime.judge.url are both set; "
                              "set server_command to have the stage start the judge's server, "
                              "or url to use one already up")
        if self.server_command and "{port}" not in self.server_command:
            raise ParamsError("runtime.judge.server_command: must contain {port} (the stage picks "
                              "a free port on 127.0.0.1), e.g. '... --port {port}'")
        if not self.server_timeout > 0:
            raise ParamsError(f"runtime.judge.server_timeout: must be > 0, got "
                              f"{self.server_timeout}")


@dataclass(frozen=True)
class EnvironmentSpec:
    """One entry of `environments:`: a user's environment module and its task files
    (`stages/envs/contract.py` says what the module defines).
    """

    module: str = ""  # a dotted path from the project folder, or an entry point's name
    tasks: str = ""  # JSON lines: task_id, messages, the fields its reward needs
    benchmark: str = ""  # the held-out tasks the gate scores it on
    weight: float = 1.0  # share of rollouts / training examples
    # the gate: a guard environment fails when the lower bound of candidate - champion on its
    # benchmark falls below minus this (the primary one, gate.primary, must improve instead)
    max_regression: float = 0.05
    # MCP servers whose tools the environment offers: {server: {command | url, allow, timeout}}
    # (stages/envs/mcp_tools.py)
    mcp: dict[str, dict] = dataclasses.field(default_factory=dict)
    # whether its tools may reach the network: an MCP `url` server (loopback included: offseason
    # cannot see where that server reaches) is refused without it, and its stdio servers run in
    # the sandbox with no network unless it is true. Off by default
    network: bool = False


@dataclass(frozen=True)
class Collect:
    """`runtime.collect`: `offseason collect`, the OTLP/HTTP receiver that writes finished traces
    into the inbox (flows/intake/collect.py). No stage reads it and nothing in it changes what a cycle
    computes, so all of it lives in `runtime:`.
    """

    host: str = "127.0.0.1"  # traces hold PII: loopback unless a deployment says otherwise
    port: int = 4318  # OTLP/HTTP's standard port
    # a trace whose root span never arrives is written after this long without a new span
    idle_seconds: float = 30.0
    # finished traces are gathered this long into one inbox file: fewer, larger files for ingest
    # (and DVC) against a later arrival; 0 writes them every fifth of a second
    file_seconds: float = 10.0
    # spans and log records held (on disk in the journal, not yet in the inbox) before new
    # requests get 429
    max_pending_spans: int = 200_000
    max_request_bytes: int = 16_000_000  # a request body over this (decompressed) gets 413
    # free space the journal's and the inbox's disks keep; below it requests get 503
    min_free_mb: int = 256
    # the environment variable holding the bearer token clients must send; unset or empty there:
    # no token asked (bind to loopback then)
    token_env: str = "OFFSEASON_COLLECT_TOKEN"

    def __post_init__(self):
        """Refuse a port outside 0..65535 and limits that are not positive."""
        if not 0 <= self.port <= 65535:
            raise ParamsError(f"runtime.collect.port: must be 0..65535 (0: a free one), got "
                              f"{self.port}")
        _positive("runtime.collect", idle_seconds=self.idle_seconds,
                  max_pending_spans=self.max_pending_spans,
                  max_request_bytes=self.max_request_bytes)
        if self.min_free_mb < 0:
            raise ParamsError(f"runtime.collect.min_free_mb: must be >= 0, got {self.min_free_mb}")
        if self.file_seconds < 0:
            raise ParamsError(f"runtime.collect.file_seconds: must be >= 0, got "
                              f"{self.file_seconds}")
        if not self.host.strip():
            raise ParamsError("runtime.collect.host: empty; write 127.0.0.1 (this machine only) "
                              "or 0.0.0.0 (every interface: set a token, see token_env)")


@dataclass(frozen=True)
class Sandbox:
    """`runtime.sandbox`: how model-written code may run (stages/envs/sandbox.py). Where it may
    run, never what it computes: in `runtime:`.
    """

    # where neither bubblewrap nor the unshare sandbox works on this machine, run the code with
    # rlimits only (it sees the machine's files and processes, and as root may act as root)
    # instead of refusing every stage that runs code; said in the log of every such stage
    allow_unisolated: bool = False


def sandbox(path: str | Path = "params.yaml") -> Sandbox:
    """`runtime.sandbox` of params.yaml, checked (defaults when absent)."""
    return _build(Sandbox, "runtime.sandbox", _runtime(read_params(path), "sandbox", str(path)),
                  str(path))


def collect(path: str | Path = "params.yaml") -> Collect:
    """`runtime.collect` of params.yaml, checked (defaults when absent)."""
    return _build(Collect, "runtime.collect", _runtime(read_params(path), "collect", str(path)),
                  str(path))


# sections a params.yaml may leave out (`pull:` is the flow's: flows/intake/pull.py); `environments:`
# may not, but `environments()` says so with what to write
OPTIONAL = {"environments", "runtime", "judge", "cost", "budget", "pull"}

# Settings that say where and how fast work runs, never what it computes. They live in params.yaml's
# `runtime:` section (runtime.rollout.urls, runtime.reward.workers, ...), which no DVC stage lists
# as a param: changing one reruns nothing and starts no cycle. `load` merges them into their
# stage's config, so the code reads config.urls as before, and the stages record what they used.
RUNTIME = {"rollout": ("urls", "server_command", "server_timeout", "concurrency",
                       "request_timeout", "retries", "api_key_env", "api"),
           "reward": ("workers", "ray_address"),
           "judge": ("url", "server_command", "server_timeout", "api_key_env", "request_timeout",
                     "retries", "concurrency"),
           # `offseason collect`'s own section: every key of it (no stage section to merge into)
           "collect": tuple(f.name for f in dataclasses.fields(Collect)),
           "sandbox": tuple(f.name for f in dataclasses.fields(Sandbox))}


def runtime_of(config) -> dict:
    """The runtime settings a stage's config holds (see RUNTIME), for its metrics."""
    section = {Rollout: "rollout", Reward: "reward", Judge: "judge"}[type(config)]
    return {key: getattr(config, key) for key in RUNTIME[section]}


def _runtime(raw: dict, section: str, where: str) -> dict:
    """`runtime.<section>` of params.yaml, checked: only the RUNTIME keys of that section."""
    runtime = raw.get("runtime") or {}
    if not isinstance(runtime, dict):
        _fail(where, f"runtime: expected a mapping of stages to settings, e.g. 'runtime: "
                     f"{{reward: {{workers: 2}}}}', got {_short(runtime)}")
    for name in runtime:
        if name not in RUNTIME:
            _fail(where, f"unknown section 'runtime.{name}'; runtime settings exist for "
                         f"{', '.join(RUNTIME)}")
    values = runtime.get(section) or {}
    if not isinstance(values, dict):
        _fail(where, f"runtime.{section}: expected a mapping of keys to values")
    for key in values:
        if key not in RUNTIME[section]:
            hint = (f" ('{section}.{key}' says what is computed: it stays in the '{section}:' "
                    f"section)" if section in SECTIONS and
                    key in {f.name for f in dataclasses.fields(SECTIONS[section])} else "")
            _fail(where, f"unknown key 'runtime.{section}.{key}'{hint}; valid keys: "
                         f"{', '.join(RUNTIME[section])}")
    return values


def environments(path: str | Path = "params.yaml") -> dict[str, EnvironmentSpec]:
    """The `environments:` section, {name: EnvironmentSpec}, in params.yaml order; a missing or
    empty one is an error (every stage that plays, scores or trains needs one). Also applies
    `runtime.sandbox.allow_unisolated` to this process and those it starts, since every process
    that loads environments reads them here (stages/envs/sandbox.py: `allow_unisolated`).
    """
    from stages.envs import sandbox as code_sandbox

    code_sandbox.allow_unisolated(sandbox(path).allow_unisolated)
    raw = read_params(path).get("environments")
    if raw is None or raw == {}:
        _fail(str(path), f"environments: {'empty' if raw == {} else 'missing'}; name the "
                         f"environments your agent works in (`environments: {{}}`, the built-in "
                         f"one of base.environment on the tag protocol, is retired): for the "
                         f"demo's arithmetic write {_entries({'arith': {}})}; for your own "
                         f"module `environments: {{support: {{module: my_envs.support, tasks: "
                         f"data/tasks/support.jsonl, benchmark: data/benchmarks/support.jsonl}}}}`")
    if not isinstance(raw, dict):
        _fail(str(path), "environments: expected a mapping of your names for your environments "
                         "to {module, tasks, benchmark, weight}, e.g. 'environments: {support: "
                         "{module: my_envs.support, tasks: data/tasks/support.jsonl}}'")
    out = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not name.replace("_", "a").replace("-", "a").isalnum():
            _fail(str(path), f"environments: {name!r} is not a name (letters, digits, _ and -)")
        spec = out[name] = _build(EnvironmentSpec, f"environments.{name}", value, str(path))
        if not spec.module.strip():
            _fail(str(path), f"environments.{name}.module: name the environment's module (a "
                             f"dotted path from the project folder, e.g. my_envs.support) or an "
                             f"entry point")
        if spec.max_regression < 0:
            _fail(str(path), f"environments.{name}.max_regression: must be >= 0, got "
                             f"{spec.max_regression}")
        if not spec.weight > 0:
            _fail(str(path), f"environments.{name}.weight: must be > 0 (a share of rollouts), "
                             f"got {spec.weight}")
        if spec.mcp:
            from stages.envs import mcp_tools

            try:
                servers = mcp_tools.check(f"environments.{name}.mcp", spec.mcp)
            except ValueError as err:
                _fail(str(path), str(err))
            remote = [server for server, entry in servers.items() if entry["url"]]
            if remote and not spec.network:
                _fail(str(path), f"environments.{name}.mcp.{remote[0]}: url "
                                 f"{servers[remote[0]]['url']} reaches a server over the network, "
                                 f"which tools may not by default (a loopback url too: offseason "
                                 f"cannot see where that server reaches); add `network: true` to "
                                 f"environments.{name} in params.yaml to allow this environment's "
                                 f"tools the network, or run the server as a stdio command")
    return out


@dataclass(frozen=True)
class Cost:
    """`cost:`: prices, so the cost ledger (`metrics/cost.json`, flows/orchestration/cost.py) reads in dollars
    too, and `budget.max_usd` can be checked. Example rates; set your own. No stage lists it as
    a DVC param: a price changes what a cycle costs, not what it computes.
    """

    cpu_hour_usd: float = 0.05  # one core for an hour (a cloud vCPU is about $0.02 to $0.05)
    gpu_hour_usd: float = 2.50  # one GPU for an hour (an H100 rents for about $2 to $4)
    judge_usd_per_million_tokens: float = 0.0  # the judge's price; 0: a local judge
    # by device: a GPU whose name as NVML reports it ("NVIDIA H100 80GB HBM3") contains a key
    # (any case) costs that per hour, e.g. {H100: 2.5, A10G: 1.0}; any other, gpu_hour_usd
    gpu_hour_usd_by_name: dict[str, float] = dataclasses.field(default_factory=dict)
    # by judge model (judge.model, judge.benchmark_model), e.g. {gpt-4o-mini: 0.6}; any other,
    # judge_usd_per_million_tokens
    judge_usd_per_million_tokens_by_model: dict[str, float] = dataclasses.field(
        default_factory=dict)
    # the prompt and generated tokens of rollouts from an OpenAI-compatible server that bills by
    # the token (rollout.backend: openai); 0 for a server you run (its GPUs are priced by the hour)
    rollout_usd_per_million_tokens: float = 0.0

    def __post_init__(self):
        """Refuse negative prices."""
        for key in ("cpu_hour_usd", "gpu_hour_usd", "judge_usd_per_million_tokens",
                    "rollout_usd_per_million_tokens"):
            if getattr(self, key) < 0:
                raise ParamsError(f"cost.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("gpu_hour_usd_by_name", "judge_usd_per_million_tokens_by_model"):
            for name, rate in getattr(self, key).items():
                if rate < 0:
                    raise ParamsError(f"cost.{key}.{name}: must be >= 0, got {rate}")

    def gpu_rate(self, name: str) -> float:
        """Dollars per hour of the GPU called `name` (NVML's name)."""
        found = [rate for key, rate in self.gpu_hour_usd_by_name.items()
                 if key.lower() in str(name).lower()]
        return found[0] if found else self.gpu_hour_usd

    def judge_rate(self, model: str) -> float:
        """Dollars per million tokens of the judge model `model`."""
        return self.judge_usd_per_million_tokens_by_model.get(
            model, self.judge_usd_per_million_tokens)


@dataclass(frozen=True)
class Budget:
    """`budget:`: what one cycle (and one calendar month of cycles) may spend; 0 = no limit.
    A cycle whose estimate exceeds it is refused before it starts (`offseason run`); the
    rollout, reward and train stages check what the cycle spent as they go and stop at the
    limit, keeping what they did. No stage lists it as a DVC param: raising a budget reruns
    nothing, so a stopped cycle resumes where it stopped (flows/orchestration/cost.py, stages/budget.py).
    """

    max_usd: float = 0.0  # dollars per cycle, by the `cost:` prices
    max_gpu_hours: float = 0.0  # GPU hours per cycle (each GPU a stage holds, for its wall time)
    max_judge_tokens: int = 0  # judge tokens per cycle, as the judge's server reports them
    monthly_usd: float = 0.0  # dollars per calendar month (UTC), over the committed cycles' ledgers

    def __post_init__(self):
        """Refuse negative budgets."""
        for key in ("max_usd", "max_gpu_hours", "max_judge_tokens", "monthly_usd"):
            if getattr(self, key) < 0:
                raise ParamsError(f"budget.{key}: must be >= 0 (0 = no limit), got "
                                  f"{getattr(self, key)}")


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
    "judge": Judge,
    "cost": Cost,
    "budget": Budget,
}


def _positive(section: str, **values):
    for key, value in values.items():
        if value <= 0:
            raise ParamsError(f"{section}.{key}: must be > 0, got {value}")


def _check_type(where: str, key: str, value, expected: type):
    if typing.get_origin(expected) is dict:  # a mapping section field, e.g. reward.weights
        if not isinstance(value, dict):
            _fail(where, f"{key}: expected a mapping like {{correct: 1.0}}, got {value!r}")
        inner = typing.get_args(expected)[1]
        return {str(k): _check_type(where, f"{key}.{k}", v, inner) for k, v in value.items()}
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
                   str: "a string", dict: "a mapping like {cron: '0 2 * * *'}"}.get(expected, f"one of {expected}")
        _fail(where, f"{key}: expected {example}, got {_short(value)} ({type(value).__name__})")
    if expected is float:
        try:
            value = float(value)
        except OverflowError:  # an integer of hundreds of digits
            value = math.inf
        if not math.isfinite(value):
            _fail(where, f"{key}: expected a finite number like 0.001, got {value}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# The tag protocol's built-in environments, as `environments:` entries (the retired keys' fix)
BUILT_IN = {"arith": {"module": "stages.envs.arith", "benchmark": "data/benchmarks/arith.jsonl"},
            "code": {"module": "stages.envs.coding", "tasks": "data/tasks/code.jsonl",
                     "benchmark": "data/benchmarks/code.jsonl"},
            "toolcall": {"module": "stages.envs.toolcall", "tasks": "data/tasks/toolcall.jsonl",
                         "benchmark": "data/benchmarks/toolcall.jsonl"}}


def _entries(names: dict) -> str:
    """`environments: {...}` for the built-in environments `names` maps to extra keys."""
    written = {name: {**BUILT_IN.get(name, {"module": "my_envs." + name}), **extra}
               for name, extra in names.items()}
    return "`environments: " + yaml.safe_dump(written, default_flow_style=True,
                                               sort_keys=False, width=1000).strip() + "`"


def _suites(value) -> dict:
    """gate.suites as `environments:` entries: each suite's environment, with its margin."""
    out = {}
    for name, suite in (value if isinstance(value, dict) else {"arith": {}}).items():
        suite = suite if isinstance(suite, dict) else {}
        out[str(suite.get("environment", name))] = (
            {"max_regression": suite["max_regression"]} if "max_regression" in suite else {})
    return out


# Keys that are gone, by (section, key): the message, from the value written, saying what to write
RETIRED = {
    ("gate", "confidence"): lambda value: (
        "gate.confidence is replaced by gate.alpha, the one-sided error rate: the old confidence "
        "0.9 (a two-sided 90% interval) is alpha 0.05; write `alpha: 0.05` instead"),
    ("base", "environment"): lambda value: (
        f"base.environment is retired with the tag protocol: each environment is an entry of "
        f"`environments:`, played by a chat model; write "
        f"{_entries({str(value): {}})} and delete base.environment"),
    ("gate", "suites"): lambda value: (
        f"gate.suites is retired with the tag protocol: each environment's benchmark is a gate "
        f"suite, with its own max_regression; write {_entries(_suites(value))} and delete "
        f"gate.suites"),
    ("rollout", "suite_tasks"): lambda value: (
        "rollout.suite_tasks is retired with the tag protocol: an environment's task file is "
        "attempted every cycle beside its traces' tasks; name it as environments.<name>.tasks "
        "(e.g. `tasks: data/tasks/code.jsonl`), share rollout.max_tasks among environments by "
        "their weight, and delete rollout.suite_tasks"),
    ("rollout", "stop"): lambda value: (
        "rollout.stop is retired with the tag protocol: a chat model's turn ends at its own end "
        "tokens (the eos ids of its generation config); delete rollout.stop"),
}


def _build(cls: type, section: str, raw, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        _fail(where, f"section '{section}' must be a mapping of keys to values, got {_short(raw)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if (section, key) in RETIRED:
            _fail(where, RETIRED[section, key](value))
        if key not in names:
            # where work runs is no key of the section itself (`load` refuses it there)
            shown = [n for n in names if n not in RUNTIME.get(section, ())]
            near = difflib.get_close_matches(str(key), shown, n=1)
            hint = f" (did you mean '{section}.{near[0]}'?)" if near else ""
            elsewhere = (f"; where work runs goes under runtime.{section}: "
                         f"{', '.join(RUNTIME[section])}") if section in RUNTIME else ""
            _fail(where, f"unknown key '{section}.{key}'{hint}; valid keys in '{section}': "
                         f"{', '.join(shown)}{elsewhere}")
        if dataclasses.is_dataclass(hints[key]):  # a sub-section, e.g. train.dpo
            values[key] = _build(hints[key], f"{section}.{key}", value, where)
            continue
        values[key] = _check_type(where, f"{section}.{key}", value, hints[key])
    try:
        return cls(**values)
    except ParamsError as err:
        _fail(where, str(err))


@functools.lru_cache(maxsize=32)
def _parsed(text: str):
    return yaml.safe_load(text)


def parse_yaml(text: str):
    """`yaml.safe_load(text)`, parsed once per process for each distinct text (a cycle's process
    reads params.yaml and dvc.lock again and again, and pure-Python YAML takes 20 ms a parse): a
    copy of its own for the caller to change. Errors are raised each time, as safe_load raises.
    """
    return copy.deepcopy(_parsed(text))


def read_params(path: str | Path = "params.yaml") -> dict:
    """params.yaml as a dict; raises ParamsError when missing or not YAML."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: not found; run from the project root (where dvc.yaml is)")
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ParamsError(f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                          f"offset {err.start})") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    except RecursionError:
        raise ParamsError(f"{path}: not valid YAML: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections, got {type(raw).__name__}")
    return raw


def load(section: str, path: str | Path = "params.yaml", sections: dict | None = None):
    """The typed config of one section, checked. Missing sections are errors, missing keys defaults.
    `sections`: the classes by section name (the stages' SECTIONS unless the flow adds its own).
    """
    if section == "environments":
        return environments(path)
    raw = read_params(path)
    if section not in raw and section not in OPTIONAL:
        _fail(str(path), f"missing section '{section}:'; add it (an empty '{section}: {{}}' takes "
                         f"the defaults)")
    values = raw.get(section) or {}
    if not isinstance(values, dict):
        _fail(str(path), f"{section}: expected a mapping of keys to values, got {_short(values)}")
    if section in RUNTIME:
        values = dict(values or {})
        moved = [key for key in values if key in RUNTIME[section]]
        if moved:
            _fail(str(path), f"{section}.{moved[0]} says where or how fast work runs, not what it "
                             f"computes: it lives in runtime.{section}.{moved[0]}, which no stage "
                             f"lists as a DVC param (changing it reruns nothing); move it there")
        values.update(_runtime(raw, section, str(path)))
    config = _build((sections or SECTIONS)[section], section, values, str(path))
    if section == "gate":  # its primary names a suite or, with environments:, an environment
        specs = environments(path)  # its errors name the file already
        try:
            check_primary(config, specs)
        except ParamsError as err:
            _fail(str(path), str(err))
    return config


def load_all(path: str | Path = "params.yaml", sections: dict | None = None) -> dict:
    """Every section of `sections` (default: the stages' SECTIONS), checked; unknown and missing
    sections are errors. `flows/project/params.py` calls it with the flow's sections added.
    """
    sections = sections or SECTIONS
    raw = read_params(path)
    for name in raw:
        if name not in sections and name not in OPTIONAL:
            near = difflib.get_close_matches(str(name), list(sections), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            _fail(str(path), f"unknown section '{name}'{hint}; valid sections: "
                             f"{', '.join(sections)}")
    collect(path)  # runtime.collect: no stage reads it, but a typo fails here as well
    return {**{name: load(name, path, sections) for name in sections},
            "environments": environments(path)}


def check_primary(gate: Gate, specs: dict[str, EnvironmentSpec]) -> None:
    """Refuse a gate.primary that names none of the environments with a benchmark."""
    scored = [name for name, spec in specs.items() if spec.benchmark]
    if not scored:
        raise ParamsError("environments: none has a benchmark, so the gate has nothing to "
                          "compare candidate and champion on; give the one that must improve "
                          "a benchmark (environments.<name>.benchmark: held-out tasks)")
    if gate.primary not in scored:
        raise ParamsError(f"gate.primary: {gate.primary!r} is not one of your environments "
                          f"with a benchmark ({', '.join(scored)}); name the one that must "
                          f"improve")
