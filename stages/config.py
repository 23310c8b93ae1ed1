"""Typed, checked configuration: one frozen pydantic dataclass per `params.yaml` section.

Every stage reads exactly its own section (plus `base:`) through `load(section)`. Each setting is
declared once, below, with its type, bounds and a one-line description; pydantic checks them, and
`_explain` turns its complaint into a ParamsError naming the file, the key's full name, the value
it got and what to write instead. Checks across settings stay in each class's `__post_init__`.
The whole file is checked before a cycle starts (`flows/project/params.py` adds the flow's own
sections, `promotion:`, `deployments:` and `pull:`), so a typo fails in a second, not after an
hour of rollouts. The declarations are written out as docs/params.md (flows/project/params.py).

    offseason check             # check params.yaml and print it with every default filled in
    offseason check --explain   # every section and key: type, default, bounds, description
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import typing
from pathlib import Path
from typing import Annotated

import pydantic
import yaml
from pydantic import BeforeValidator, Field
from pydantic_core import ArgsKwargs

# the DVC stages of a cycle in the order they run (dvc.yaml; tests/test_layout.py checks it):
# the one place the cycle, the report, the ledger and the budget read it
CYCLE = ("ingest", "validate", "rollout", "reward", "train", "champion_scores", "gate")
FEEDBACK = "feedback"  # the reward component of users' ratings (stages/reward.py)


class ParamsError(ValueError):
    """A params.yaml problem; the message names the file, the key and the fix."""


def _fail(where: str, message: str) -> typing.NoReturn:
    raise ParamsError(f"{where}: {message}")


def _yaml_number(value):
    """PyYAML reads `1e-3` (no dot) as a string: a float setting takes it as the number (and an
    integer of hundreds of digits as inf, which is refused as not finite).
    """
    if isinstance(value, str | int) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
        except OverflowError:
            return math.inf
    return value


Float = Annotated[float, BeforeValidator(_yaml_number)]


def _mapping(cls: type):
    """A sub-section's type (train.sft): a mapping in params.yaml, checked by `cls` itself, so
    that its errors name its own keys.
    """
    return Annotated[cls, BeforeValidator(
        lambda value: cls(**{str(k): v for k, v in value.items()}) if isinstance(value, dict)
        else value)]


def section(name: str):
    """Declare `name`'s settings: a frozen pydantic dataclass that refuses unknown keys and wrong
    types (a bool is no number, 4.0 no whole number) and raises ParamsError, built in code
    (`Train(...)`, `dataclasses.replace`) as from params.yaml.
    """
    def declare(cls):
        cls = pydantic.dataclasses.dataclass(frozen=True, config=pydantic.ConfigDict(
            extra="forbid", strict=True, allow_inf_nan=False))(cls)
        cls.__init__ = lambda self, *args, **values: _validate(self, name, args, values)
        return cls
    return declare


@section("base")
class Base:
    """Settings every stage shares."""

    seed: int = Field(0, description="every source of randomness derives from it, so DVC's "
                                     "run-cache stays correct")
    registered_model: str = Field("offseason-agent", description="MLflow registered model name")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = all cores")
    model: str = Field("", description="a Hugging Face chat model (folder or hub id) as "
                                       "generation 0; \"\" = the demo's tiny model")


@section("init")
class Init:
    """Generation 0 for the demo: a tiny GPT-2 built from a config and a short supervised warm start."""

    n_layer: int = Field(4, gt=0, description="transformer blocks")
    n_embd: int = Field(128, gt=0, description="width; a multiple of n_head")
    n_head: int = Field(4, gt=0, description="attention heads")
    n_positions: int = Field(80, gt=0, description="longest sequence, in tokens")
    warmup_steps: int = Field(1000, gt=0, description="optimizer steps of the warm start")
    batch_size: int = Field(64, gt=0, description="sequences per optimizer step")
    lr: Float = Field(3e-3, gt=0, description="learning rate of the warm start")
    tool_fraction: Float = Field(0.2, ge=0, le=1, description="share of demonstrations that "
                                                             "use the calculator")

    def __post_init__(self):
        """Refuse a model shape that cannot be built."""
        if self.n_embd % self.n_head:
            raise ParamsError(
                f"init.n_embd ({self.n_embd}) must be divisible by init.n_head ({self.n_head})"
            )


@section("simulate")
class Simulate:
    """Synthetic production traffic: the champion answering a task mix that shifts day by day."""

    traces_per_day: int = Field(1024, gt=0, description="traces of one simulated day")
    shift_per_day: Float = Field(0.15, description="how far the task mix moves towards "
                                                   "multiplication each day")
    feedback_rate: Float = Field(0.5, ge=0, le=1, description="share of traces in which the user "
                                                              "left thumbs up/down")
    junk: bool = Field(True, description="add a malformed line, a duplicate and an e-mail "
                                         "address, as real logs have")


@section("ingest")
class Ingest:
    """Reading traces from the inbox."""

    scrub_secrets: bool = Field(True, description="provider keys (gitleaks' formats), JWTs, auth "
                                "headers, URL passwords, PEM keys, `password = ...`")
    scrub_emails: bool = Field(True, description="e-mail addresses")
    scrub_cards: bool = Field(True, description="payment card numbers that pass the Luhn check")
    scrub_ips: bool = Field(True, description="IP addresses")
    scrub_phones: bool = Field(True, description="phone numbers")
    max_messages: int = Field(64, gt=0, description="a trace with more messages is quarantined")
    max_line_bytes: int = Field(10_000_000, gt=0, description="a longer line is quarantined "
                                                              "unread (JSON documents: 10x)")


@section("validate")
class Validate:
    """Great Expectations checks on the ingested traces."""

    min_valid_fraction: Float = Field(0.9, ge=0, le=1, description="below this share of valid "
                                                                   "traces the stage fails")
    max_drift: Float = Field(1.0, ge=0, le=1, description="stop the cycle when the task mix moved "
                             "more than this from the previous cycle's (total variation "
                             "distance); 1.0 never stops")
    holdout_fraction: Float = Field(0.0, ge=0, le=0.5, description="this share of the valid "
                                    "traces that give a task is held out, never trained on, and "
                                    "kept in data/holdout/ to refresh the benchmarks (`offseason "
                                    "benchmark refresh`); 0 holds none out")


@section("rollout")
class Rollout:
    """The champion re-attempting the tasks of the validated traces."""

    backend: str = Field("transformers", description="transformers, or openai: OpenAI-compatible "
                                                     "servers (vLLM, SGLang, TGI)")
    samples_per_task: int = Field(4, gt=0, description="attempts at each task")
    temperature: Float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: Float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1.0 = off")
    top_k: int = Field(0, ge=0, description="top-k sampling; 0 = off")
    max_new_tokens: int = Field(48, gt=0, description="tokens generated per turn")
    max_turns: int = Field(0, ge=0, description="tool calls answered per episode; 0 = the "
                                                "environment's MAX_TURNS")
    batch_size: int = Field(1024, gt=0, description="sequences generated together; 1024 is "
                                                    "fastest on 2 CPU cores")
    max_tasks: int = Field(0, ge=0, description="0 = every task; otherwise N, shared among the "
                           "environments by weight (each one's traces' tasks first, then its "
                           "task file's)")
    urls: str = Field("", description="openai backend: servers already up (base URLs ending in "
                                      "/v1, separated by commas)")
    server_command: str = Field("", description="openai backend: or a command that starts one on "
                                "the champion ({model}, {port} filled in) for this stage only")
    server_timeout: Float = Field(600.0, gt=0, description="seconds to wait for the started "
                                                           "server's /health")
    model: str = Field("", description="the served model's name; \"\" = the first one GET "
                                       "/v1/models lists")
    concurrency: int = Field(64, gt=0, description="requests in flight, over all URLs")
    request_timeout: Float = Field(120.0, gt=0, description="seconds per request before it is "
                                                            "retried")
    stall_seconds: Float = Field(300.0, gt=0, description="openai backend: no answer from any "
                                 "server for this long (no request finished) fails the stage, "
                                 "naming the servers, instead of waiting out every request's "
                                 "timeout and retries")
    retries: int = Field(5, ge=0, description="per request, on timeouts, 429 and 5xx, with "
                                              "exponential backoff")
    api_key_env: str = Field("OPENAI_API_KEY", description="the environment variable holding the "
                                                           "API key, if any")
    api: str = Field("completions", description="the chat path's endpoint: completions (token ids "
                     "in and out; any vLLM) or chat (messages and tools= to /chat/completions, "
                     "tool_calls read back and checked against ours token for token; vLLM >= "
                     "0.10.2 with --tool-call-parser)")
    tool_parser: str = Field("auto", description="how the chat model writes tool calls: hermes, "
                             "llama3_json or mistral, as vLLM names them; auto = the one its chat "
                             "template implies")

    def __post_init__(self):
        """Refuse an unknown backend or endpoint and server settings that contradict each other
        (an unknown tool_parser: `check_tool_parser`, which the flow and the rollout stage call).
        """
        if self.backend not in ("transformers", "openai"):
            raise ParamsError(
                f"rollout.backend: {self.backend!r} is not a backend; use 'transformers' or "
                f"'openai'"
            )
        if self.api not in ("completions", "chat"):
            raise ParamsError(f"runtime.rollout.api: {self.api!r} is not an endpoint; use "
                              f"'completions' (token ids in and out) or 'chat' (messages and "
                              f"tools, /chat/completions)")
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


@section("reward")
class Reward:
    """Verification of each rollout."""

    weights: dict[str, float] = Field(default_factory=lambda: {FEEDBACK: 0.0}, description=(
        "an environment's own components each weigh 1 (its reward is their mean); `feedback` "
        "(the user's rating of production's answer) weighs this much against each of them; 0: "
        "recorded, not mixed in"))
    feedback_score: str = Field("", description="the name of a trace's `feedback.scores` entry "
                                "(a Langfuse / LangSmith / OTel score in [0, 1]) used as the "
                                "user's rating where the trace has no thumbs; \"\" = thumbs only")
    max_error_fraction: Float = Field(0.5, ge=0, le=1, description="more of a cycle's episodes "
                                      "than this failing to score (a judge answering garbage, a "
                                      "dead tool server, a reward that raises) fails the stage")
    workers: int = Field(0, ge=0, description="local processes the rewards and gold checks run "
                                              "in: 0 = one per core, 1 = the stage's own process")
    ray_address: str = Field("", description="\"\" = the local processes; \"auto\" or "
                                             "\"host:port\" = that Ray cluster")
    stall_seconds: Float = Field(300.0, gt=0, description="no reward or gold check finished "
                                 "anywhere (the local processes, the Ray cluster, the judged "
                                 "environments' threads) for this long: the stage fails, naming "
                                 "where it waited and what it finished")

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


RETIRED_COMPONENTS = ("correct", "format", "tool_ok")  # the tag protocol's reward.weights


@section("train.sft")
class SFT:
    """`train.sft`: rejection-sampling fine-tuning on the verified-correct rollouts."""

    epochs: Float = Field(8.0, gt=0, description="passes over this cycle's examples plus the "
                                                 "replayed ones")
    lr: Float = Field(1e-3, gt=0, description="learning rate")


@section("train.dpo")
class DPO:
    """`train.dpo`: preference pairs through TRL's DPOTrainer. Fewer epochs and a lower learning
    rate than SFT: at SFT's 8 epochs and 1e-3 it over-fits the demo's pairs and breaks the protocol
    (BENCHMARKS.md, "Switching only train.algorithm").
    """

    epochs: Float = Field(3.0, gt=0, description="passes over this cycle's pairs plus the "
                                                 "replayed ones")
    lr: Float = Field(2e-4, gt=0, description="learning rate")
    beta: Float = Field(0.5, gt=0, description="strength of the pull towards the reference (the "
                                               "champion)")


@section("train.grpo")
class GRPO:
    """`train.grpo`: group-relative advantages and a clipped ratio against the rollout policy.
    A lower learning rate than SFT: at 1e-3 the candidate broke the protocol and the gate's format
    guard rejected it (BENCHMARKS.md, "Switching only train.algorithm").
    """

    epochs: Float = Field(4.0, gt=0, description="passes over this cycle's groups plus the "
                                                 "replayed ones")
    lr: Float = Field(3e-4, gt=0, description="learning rate")
    clip: Float = Field(0.3, gt=0, description="the ratio against the rollout policy is clipped "
                                               "to 1 +- clip")
    kl_coef: Float = Field(0.0, ge=0, description="weight of the KL term to the champion; 0 = none")
    loss_type: str = Field("bnpo", description="how the per-token losses are averaged, as TRL's "
                           "GRPOTrainer names it: bnpo (over the batch's model tokens), grpo (per "
                           "episode, then over episodes), dapo (over the model tokens of the "
                           "global batch), dr_grpo (a fixed denominator: episodes x "
                           "max_completion_length)")
    clip_high: Float = Field(0.0, ge=0, description="the upper clip, 1 + clip_high (DAPO's "
                                                    "clip-higher); 0: = clip")
    scale_rewards: str = Field("group", description="the advantage's scale: group (reward std "
                               "within the task's samples), batch (over all the cycle's samples) "
                               "or none (Dr. GRPO: reward - group mean, unscaled)")
    max_completion_length: int = Field(256, gt=0, description="dr_grpo's fixed denominator, per "
                                                              "episode")
    steps: int = Field(1, ge=1, description="1: one off-policy step on the rollout stage's "
                       "episodes; more: on-policy steps, each playing tasks_per_step tasks "
                       "samples_per_task times with the current policy (the rollout stage's "
                       "loop, backend and environments), scoring them with the reward stage's "
                       "code and updating once")
    tasks_per_step: int = Field(32, gt=0, description="on-policy steps: tasks drawn per step "
                                                      "from the cycle's tasks and the replay's "
                                                      "(train.replay_fraction)")
    samples_per_task: int = Field(8, ge=2, description="on-policy steps: episodes per task (the "
                                                       "group its advantages are relative to)")
    max_staleness: int = Field(0, ge=0, le=1, description="on-policy steps: 0 = each step plays "
                               "with the weights it trains; 1 = the next step's episodes are "
                               "played while this step trains, with weights one step old "
                               "(generation and training overlap; importance_cap corrects)")
    importance_cap: Float = Field(3.0, ge=1, description="on-policy steps: the most a token's "
                                  "weight exp(training log-prob - the generating engine's) may "
                                  "be (TRL's truncated importance sampling, for vLLM's numerics)")
    kl_importance_weighted: bool = Field(False, description="the KL term weighted by the ratio to "
                                         "the rollout policy (TRL's use_bias_correction_kl): the "
                                         "k3 estimate is unbiased for samples of the current "
                                         "policy, the rollouts are the old one's")

    def __post_init__(self):
        """Refuse unknown variants."""
        for key, value, known in (("loss_type", self.loss_type, GRPO_LOSSES),
                                  ("scale_rewards", self.scale_rewards, ("group", "batch", "none"))):
            if value not in known:
                raise ParamsError(f"train.grpo.{key}: {value!r} is not one of "
                                  f"{', '.join(known)} (the names TRL's GRPOTrainer uses)")


GRPO_LOSSES = ("bnpo", "grpo", "dapo", "dr_grpo")


# The training algorithms by name, with their settings; each is the module
# stages/training/<name>.py (the train stage loads it by that name).
ALGORITHMS = {"sft": SFT, "dpo": DPO, "grpo": GRPO}


@section("train")
class Train:
    """Training the champion on its scored rollouts: SFT, DPO or GRPO (stages/train.py).

    What all algorithms share sits at the top; each algorithm's own settings (epochs, learning
    rate, ...) in its sub-section, `train.sft`, `train.dpo`, `train.grpo`, with defaults that learn
    on the demo, so switching `train.algorithm` alone is enough.
    """

    algorithm: str = Field("sft", description="sft, dpo or grpo")
    batch_size: int = Field(64, gt=0, description="examples per optimizer step")
    min_examples: int = Field(8, ge=0, description="fewer SFT examples / DPO pairs / GRPO groups: "
                                                   "the champion is kept")
    replay_fraction: Float = Field(1.0, ge=0, le=1, description="share of earlier cycles' "
                                   "examples (data/replay/) trained on again; on-policy GRPO "
                                   "(grpo.steps > 1): earlier cycles' tasks added to those the "
                                   "steps draw from, this share of the cycle's task count")
    lora_r: int = Field(0, ge=0, description="LoRA rank through PEFT, merged into the candidate; "
                                             "0 = full fine-tuning")
    deepspeed: int | str = Field(0, description="DeepSpeed: 0 = off, 1 / 2 / 3 = that ZeRO stage, "
                                                "or the path of a DeepSpeed JSON config")
    checkpoint_steps: int = Field(50, gt=0, description="optimizer steps between checkpoints (a "
                                                        "killed stage resumes)")
    sft: _mapping(SFT) = Field(default_factory=SFT, description="SFT's own settings")
    dpo: _mapping(DPO) = Field(default_factory=DPO, description="DPO's own settings")
    grpo: _mapping(GRPO) = Field(default_factory=GRPO, description="GRPO's own settings")

    def __post_init__(self):
        """Refuse an unknown algorithm and DeepSpeed setting."""
        if self.algorithm not in ALGORITHMS:
            raise ParamsError(f"train.algorithm: unknown algorithm {self.algorithm!r}; choose "
                              f"one of {', '.join(ALGORITHMS)}")
        if (isinstance(self.deepspeed, int) and self.deepspeed not in (0, 1, 2, 3)) or (
                isinstance(self.deepspeed, str) and not self.deepspeed.endswith(".json")):
            raise ParamsError(f"train.deepspeed: {self.deepspeed!r} is neither a ZeRO stage "
                              f"(0 = off, 1, 2, 3) nor the path of a DeepSpeed .json config")

    @property
    def method(self):
        """The chosen algorithm's own settings: `train.<algorithm>`."""
        return getattr(self, self.algorithm)


@section("gate")
class Gate:
    """Candidate against champion on the held-out benchmark suites, with paired statistics."""

    benchmark_size: int = Field(0, ge=0, description="0 = every item of each suite; otherwise "
                                                     "its first N")
    min_improvement: Float = Field(0.0, description="the primary suite's interval lower bound "
                                                    "must exceed this")
    alpha: Float = Field(0.05, gt=0, le=0.5, description="the one-sided error rate: the most often "
                         "the gate may promote a candidate no better than the champion, per "
                         "decision; it sets the primary's test and every guard's bound")
    bootstrap_samples: int = Field(2000, gt=0, description="resamples of the paired bootstrap")
    primary: str = Field("arith", description="the environment whose benchmark must improve; "
                         "every other one with a benchmark is a guard, with its own "
                         "environments.<name>.max_regression")
    forgetting_max_regression: Float = Field(0.1, ge=0, description="guard on the items earlier "
                                             "champions solved (data/forgetting.jsonl)")
    forgetting_min_items: int = Field(30, ge=0, description="the forgetting guard applies once "
                                                            "there are this many items")
    max_length_increase: Float = Field(3.0, ge=0, description="reward-hacking guard, per suite: "
                                       "mean generated tokens may grow by this fraction at most "
                                       "(a tool used legitimately makes answers 2-3x longer)")
    max_format_regression: Float = Field(0.1, ge=0, description="guard: share of completions "
                                                                "breaking the protocol")
    max_tool_error_regression: Float = Field(0.1, ge=0, description="guard: share of completions "
                                                                    "with a failed tool call")
    max_hack_increase: Float = Field(0.0, ge=0, description="guard: share of completions a "
                                                            "verifier noted hack_suspected")
    underpowered: str = Field("decide", description="a guard suite too small to detect its "
                              "max_regression at 80% power: decide (it still blocks or passes, "
                              "flagged) or skip (it does not)")
    sequential: str = Field("none", description="error control across cycles: none (alpha per "
                            "decision), or the expected share of false promotions among all "
                            "promotions kept below alpha over the years by addis (ADDIS: most "
                            "power, docs/cycle.md), saffron (SAFFRON) or lord (LORD++)")
    power: Float = Field(0.8, gt=0, lt=1, description="the design's target: the chance that the "
                         "whole decision (primary better and every guard within its margin) "
                         "promotes a candidate min_detectable better on the primary and unchanged "
                         "elsewhere; each test is sized for 1 - (1 - power) / (guards + 1)")
    min_detectable: Float = Field(0.075, gt=0, le=1, description="the primary's improvement the "
                                  "design sizes the suites for (pass@1 points / 100); it sets no "
                                  "rule, min_improvement does")
    discordance: Float = Field(0.15, gt=0, le=1, description="the design's assumption: the share "
                               "of items a candidate answers differently from the champion "
                               "(graded scores: their mean squared difference)")

    def __post_init__(self):
        """Refuse unknown rules for underpowered guards and for the sequence of decisions, and a
        design no candidate can meet.
        """
        if self.discordance < self.min_detectable:
            raise ParamsError(f"gate.discordance: {self.discordance} is below "
                              f"gate.min_detectable {self.min_detectable}: a candidate better by "
                              f"that much answers at least that share of the items differently; "
                              f"raise discordance or lower min_detectable")
        if self.sequential not in ("none", "lord", "saffron", "addis"):
            raise ParamsError(f"gate.sequential: {self.sequential!r}; use none (alpha per "
                              f"decision), or a bound over the sequence of cycles: addis, "
                              f"saffron or lord (docs/cycle.md, 'The error rate it promises')")
        if self.underpowered not in ("decide", "skip"):
            raise ParamsError(f"gate.underpowered: {self.underpowered!r}; use decide (an "
                              f"underpowered guard still decides, flagged) or skip (it does not)")


@section("judge")
class Judge:
    """`judge:`: the LLM judge an environment's reward may call (`stages/envs/judge.py`), for
    tasks without ground truth. What it computes: the model and the rubric (a changed one
    re-scores) and the per-stage budget; where it runs is `runtime.judge`.
    """

    model: str = Field("", description="the judge model's name on its server; \"\" = no judge "
                                       "configured")
    rubric: str = Field("", description="the grading instructions: the text itself, or a file "
                                        "path from the project")
    benchmark_model: str = Field("", description="held out for the benchmarks (champion_scores, "
                                 "gate), so a policy that games the training judge cannot promote "
                                 "on it alone; \"\" = the same as model")
    benchmark_rubric: str = Field("", description="likewise for the rubric; \"\" = the same as "
                                                  "rubric")
    max_calls: int = Field(2000, ge=0, description="judge requests per stage run (cache hits are "
                                                   "free); then the stage stops")
    max_cost: int = Field(2_000_000, ge=0, description="tokens (prompt + completion, as the "
                                                       "server reports) per stage run")
    url: str = Field("", description="the OpenAI-compatible server's base URL, e.g. "
                                     "http://127.0.0.1:8000/v1")
    server_command: str = Field("", description="or a command the stage starts on loopback "
                                "({port} and {model} filled in), waits healthy for, uses and "
                                "stops, e.g. `.venv-vllm/bin/vllm serve models/judge "
                                "--served-model-name {model} --port {port} --host 127.0.0.1`")
    server_timeout: Float = Field(600.0, gt=0, description="seconds the started server may take "
                                                           "to be healthy")
    api_key_env: str = Field("OPENAI_API_KEY", description="the environment variable holding "
                                                           "its key")
    request_timeout: Float = Field(60.0, gt=0, description="seconds per request before it is "
                                                           "retried")
    retries: int = Field(3, ge=0, description="per judgment, on timeouts, 429, 5xx and "
                                              "unparseable answers")
    concurrency: int = Field(8, ge=1, description="judgments in flight at once, always within "
                                                  "max_calls and max_cost")
    stall_seconds: Float = Field(300.0, gt=0, description="no answer from the judge's server for "
                                 "this long (across the judgments in flight): the stage fails, "
                                 "naming the server and what it judged (kept in its cache), "
                                 "instead of waiting request_timeout x retries for each")

    def __post_init__(self):
        """Refuse server settings that contradict each other."""
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


@section("environments.<name>")
class EnvironmentSpec:
    """One entry of `environments:`: a user's environment module and its task files
    (`stages/envs/contract.py` says what the module defines).
    """

    module: str = Field("", description="a dotted path from the project folder, or an entry "
                                        "point's name")
    tasks: str = Field("", description="JSON lines: task_id, messages, the fields its reward needs")
    benchmark: str = Field("", description="the held-out tasks the gate scores it on")
    weight: Float = Field(1.0, gt=0, description="share of rollouts / training examples")
    max_regression: Float = Field(0.05, ge=0, description="a guard environment fails when the "
                                  "lower bound of candidate - champion on its benchmark falls "
                                  "below minus this (gate.primary must improve instead)")
    mcp: dict[str, dict] = Field(default_factory=dict, description="MCP servers whose tools the "
                                 "environment offers, by what they are: {server: {allow, "
                                 "version}} ({}: all its tools; `version`: the serverInfo.version "
                                 "it must report); where each runs is runtime.mcp.servers."
                                 "<server> (stages/envs/mcp_tools.py)")
    network: bool = Field(False, description="whether its tools may reach the network: an MCP url "
                          "server is refused without it, and its stdio servers run in the "
                          "sandbox with no network unless it is true")


@section("runtime.collect")
class Collect:
    """`runtime.collect`: `offseason collect`, the OTLP/HTTP receiver that writes finished traces
    into the inbox (flows/intake/collect.py). No stage reads it and nothing in it changes what a cycle
    computes, so all of it lives in `runtime:`.
    """

    host: str = Field("127.0.0.1", description="traces hold PII: loopback unless a deployment "
                                               "says otherwise")
    port: int = Field(4318, ge=0, le=65535, description="OTLP/HTTP's standard port; 0: a free one")
    idle_seconds: Float = Field(30.0, gt=0, description="a trace whose root span never arrives is "
                                "written after this long without a new span")
    file_seconds: Float = Field(10.0, ge=0, description="finished traces are gathered this long "
                                "into one inbox file (fewer, larger files for ingest and DVC); 0 "
                                "writes them every fifth of a second")
    max_pending_spans: int = Field(200_000, gt=0, description="spans and log records held in the "
                                   "journal, not yet in the inbox, before new requests get 429")
    max_request_bytes: int = Field(16_000_000, gt=0, description="a request body over this "
                                                                 "(decompressed) gets 413")
    min_free_mb: int = Field(256, ge=0, description="free space the journal's and the inbox's "
                                                    "disks keep; below it requests get 503")
    token_env: str = Field("OFFSEASON_COLLECT_TOKEN", description="the environment variable "
                           "holding the bearer token clients must send; unset or empty: no token "
                           "asked (bind to loopback then)")

    def __post_init__(self):
        """Refuse an empty host."""
        if not self.host.strip():
            raise ParamsError("runtime.collect.host: empty; write 127.0.0.1 (this machine only) "
                              "or 0.0.0.0 (every interface: set a token, see token_env)")


@section("runtime.sandbox")
class Sandbox:
    """`runtime.sandbox`: how model-written code may run (stages/envs/sandbox.py). Where it may
    run, never what it computes: in `runtime:`.
    """

    allow_unisolated: bool = Field(False, description="where neither bubblewrap nor the unshare "
                                   "sandbox works, run the code with rlimits only (it sees the "
                                   "machine's files and processes) instead of refusing every "
                                   "stage that runs code; said in the log of every such stage")


@section("runtime.mcp")
class Mcp:
    """`runtime.mcp`: where the environments' MCP tool servers (stages/envs/mcp_tools.py) run and
    how long they may go silent. Where work runs, never what it computes: in `runtime:`; what a
    server is (its allowed tools, its version) stays in `environments.<name>.mcp.<server>`.
    """

    stall_seconds: Float = Field(300.0, gt=0, description="no answer from an MCP server for this "
                                 "long (across its calls in flight, and calls that timed out one "
                                 "by one): the stage fails, naming the server and the calls it "
                                 "answered, instead of every episode's call waiting its timeout")
    servers: dict[str, dict] = Field(default_factory=dict, description="where each server an "
                                     "environment names runs: {server: {command | url, timeout, "
                                     "memory_mb}}; command: a stdio server started in the project "
                                     "(in the sandbox's limits), url: a Streamable HTTP one "
                                     "already running, timeout: seconds per request (default 30), "
                                     "memory_mb: a stdio server's address space (default 2048)")

    def __post_init__(self):
        """Refuse a server without a command or url, or with a key it has not."""
        from stages.envs import mcp_tools

        try:
            mcp_tools.check_servers(self.servers)
        except ValueError as err:
            raise ParamsError(str(err)) from None


@section("runtime.fleet")
class Fleet:
    """`runtime.fleet`: the model servers that answer users, which a promoted generation (and a
    rollback) reaches through `stages/weights.py` (flows/orchestration/fleet.py). Where work runs,
    never what a cycle computes: in `runtime:`.
    """

    urls: str = Field("", description="the replicas' OpenAI-compatible base URLs, comma-separated "
                      "(e.g. http://10.0.0.5:8000/v1); \"\" = no fleet: promotion stops at the "
                      "MLflow alias")
    kind: str = Field("vllm", description="vllm or sglang")
    mode: str = Field("reload", description="reload: full weights from a folder the servers "
                      "read (.offseason/fleet/<generation>/ on a shared disk)")
    model: str = Field("", description="the model name agents call; \"\" = the first the "
                                       "server lists")
    token_env: str = Field("OFFSEASON_FLEET_TOKEN", description="the environment variable "
                           "holding the servers' admin token (sent as a bearer token); unset: "
                           "none")
    push_on_promote: bool = Field(True, description="a promotion (after its approval) and a "
                                  "rollback push to the fleet at once; false: `offseason fleet "
                                  "push` does")
    keep: int = Field(3, ge=2, description="generations kept on disk for the servers (the "
                                           "previous one always, for a rollback in seconds)")
    canary: int = Field(0, ge=0, description="replicas (the first ones of urls) that get a "
                        "promoted generation first; the rest follow once the production gate "
                        "passes on live traffic (`offseason fleet judge`, and the start of every "
                        "cycle), else the canary goes back; 0 = no canary: every replica at once")
    bake: int = Field(100, ge=1, description="live traces per arm (canary, stable), ingested and "
                      "attributed by the model name their responses carry, before the "
                      "production gate decides")

    def __post_init__(self):
        """Refuse a kind or mode no push is written for, URLs that are not http(s), and a
        canary that leaves no stable replica to compare it with.
        """
        if self.kind not in ("vllm", "sglang"):
            raise ParamsError(f"runtime.fleet.kind: {self.kind!r} is not vllm or sglang")
        if self.mode != "reload":
            raise ParamsError(f"runtime.fleet.mode: {self.mode!r}; the fleet takes full weights "
                              f"(reload): the train stage merges LoRA adapters into them")
        for url in self.url_list:
            if not url.startswith(("http://", "https://")):
                raise ParamsError(f"runtime.fleet.urls: {url!r} is not an http(s) URL; write "
                                  f"e.g. http://127.0.0.1:8000/v1")
        if self.canary and self.url_list and self.canary >= len(self.url_list):
            raise ParamsError(f"runtime.fleet.canary: {self.canary} of {len(self.url_list)} "
                              f"replicas leaves none serving the stable generation to compare "
                              f"the canary with; set it below {len(self.url_list)} (or 0: no "
                              f"canary)")

    @property
    def url_list(self) -> list[str]:
        """The replicas' URLs."""
        return [u.strip() for u in self.urls.split(",") if u.strip()]


def fleet(path: str | Path = "params.yaml") -> Fleet:
    """`runtime.fleet` of params.yaml, checked (defaults when absent)."""
    return _build(Fleet, "runtime.fleet", _runtime(read_params(path), "fleet", str(path)),
                  str(path))


def sandbox(path: str | Path = "params.yaml") -> Sandbox:
    """`runtime.sandbox` of params.yaml, checked (defaults when absent)."""
    return _build(Sandbox, "runtime.sandbox", _runtime(read_params(path), "sandbox", str(path)),
                  str(path))


def mcp(path: str | Path = "params.yaml") -> Mcp:
    """`runtime.mcp` of params.yaml, checked (defaults when absent)."""
    return _build(Mcp, "runtime.mcp", _runtime(read_params(path), "mcp", str(path)), str(path))


def collect(path: str | Path = "params.yaml") -> Collect:
    """`runtime.collect` of params.yaml, checked (defaults when absent)."""
    return _build(Collect, "runtime.collect", _runtime(read_params(path), "collect", str(path)),
                  str(path))


@section("runtime.mlflow")
class Mlflow:
    """`runtime.mlflow`: how long an MLflow tracking server (`MLFLOW_TRACKING_URI=http...`) may
    go silent mid-cycle (flows/project/workspace.py: `mlflow_requests`). Where work runs, never
    what it computes: in `runtime:`.
    """

    stall_seconds: Float = Field(300.0, ge=2, description="no answer from the MLflow server for "
                                 "this long (over MLflow's own tries, whose timeout, retries and "
                                 "backoff offseason fits inside it): the cycle fails, naming the "
                                 "server and the stages it finished")


@section("runtime.dvc")
class Dvc:
    """`runtime.dvc`: how long `dvc push`, `pull` and `fetch` (promotion, init, rollback, erase)
    may move no bytes before they are stopped (flows/project/stall.py). Where work runs, never
    what it computes: in `runtime:`.
    """

    stall_seconds: Float = Field(300.0, gt=0, description="the DVC command moved no bytes (to "
                                 "or from the network or the disk) for this long: it is stopped "
                                 "and fails, naming the remote; what it sent stays there")


def mlflow(path: str | Path = "params.yaml") -> Mlflow:
    """`runtime.mlflow` of params.yaml, checked (defaults when absent)."""
    return _build(Mlflow, "runtime.mlflow", _runtime(read_params(path), "mlflow", str(path)),
                  str(path))


def dvc(path: str | Path = "params.yaml") -> Dvc:
    """`runtime.dvc` of params.yaml, checked (defaults when absent)."""
    return _build(Dvc, "runtime.dvc", _runtime(read_params(path), "dvc", str(path)), str(path))


# sections a params.yaml may leave out (`pull:` is the flow's: flows/intake/pull.py); `environments:`
# may not, but `environments()` says so with what to write
OPTIONAL = {"environments", "runtime", "judge", "cost", "budget", "pull", "erase"}

# Settings that say where and how fast work runs, never what it computes. They live in params.yaml's
# `runtime:` section (runtime.rollout.urls, runtime.reward.workers, ...), which no DVC stage lists
# as a param: changing one reruns nothing and starts no cycle. `load` merges them into their
# stage's config, so the code reads config.urls as before, and the stages record what they used.
RUNTIME = {"rollout": ("urls", "server_command", "server_timeout", "concurrency",
                       "request_timeout", "stall_seconds", "retries", "api_key_env", "api"),
           "reward": ("workers", "ray_address", "stall_seconds"),
           "judge": ("url", "server_command", "server_timeout", "api_key_env", "request_timeout",
                     "retries", "concurrency", "stall_seconds"),
           # `offseason collect`'s own section: every key of it (no stage section to merge into)
           "collect": tuple(f.name for f in dataclasses.fields(Collect)),
           "sandbox": tuple(f.name for f in dataclasses.fields(Sandbox)),
           "mcp": tuple(f.name for f in dataclasses.fields(Mcp)),
           "fleet": tuple(f.name for f in dataclasses.fields(Fleet)),
           "mlflow": tuple(f.name for f in dataclasses.fields(Mlflow)),
           "dvc": tuple(f.name for f in dataclasses.fields(Dvc)),
           "pull": ("stall_seconds",)}  # `pull:`'s (flows/project/params.py)


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
            near = difflib.get_close_matches(str(key), RUNTIME[section], n=1)
            if near and not hint:
                hint = f" (did you mean 'runtime.{section}.{near[0]}'?)"
            _fail(where, f"unknown key 'runtime.{section}.{key}'{hint}; valid keys: "
                         f"{', '.join(RUNTIME[section])}")
    return values


def environments(path: str | Path = "params.yaml") -> dict[str, EnvironmentSpec]:
    """The `environments:` section, {name: EnvironmentSpec}, in params.yaml order; a missing or
    empty one is an error (every stage that plays, scores or trains needs one). Also applies
    `runtime.sandbox.allow_unisolated` to this process and those it starts, since every process
    that loads environments reads them here (stages/envs/sandbox.py: `allow_unisolated`). An
    environment's `mcp` comes back joined with where its servers run (runtime.mcp.servers,
    `mcp_tools.join`), as `load` merges runtime.<stage> into a stage's config: the stages read
    spec.mcp whole, and params.yaml keeps where apart from what.
    """
    from stages.envs import sandbox as code_sandbox

    code_sandbox.allow_unisolated(sandbox(path).allow_unisolated)
    tool_servers = mcp(path)  # checked even where no environment names its servers yet
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
        if spec.mcp:
            from stages.envs import mcp_tools

            mcp_tools.STALL_SECONDS[0] = tool_servers.stall_seconds  # this process's servers'
            try:
                servers = mcp_tools.join(name, spec.mcp, tool_servers.servers)
            except ValueError as err:
                _fail(str(path), str(err))
            spec = out[name] = dataclasses.replace(spec, mcp=servers)
            remote = [server for server, entry in servers.items() if entry["url"]]
            if remote and not spec.network:
                _fail(str(path), f"environments.{name}.mcp.{remote[0]}: url "
                                 f"{servers[remote[0]]['url']} reaches a server over the network "
                                 f"(runtime.mcp.servers.{remote[0]}.url), "
                                 f"which tools may not by default (a loopback url too: offseason "
                                 f"cannot see where that server reaches); add `network: true` to "
                                 f"environments.{name} in params.yaml to allow this environment's "
                                 f"tools the network, or run the server as a stdio command")
    return out


@section("cost")
class Cost:
    """`cost:`: prices, so the cost ledger (`metrics/cost.json`, flows/orchestration/cost.py) reads in dollars
    too, and `budget.max_usd` can be checked. Example rates; set your own. No stage lists it as
    a DVC param: a price changes what a cycle costs, not what it computes.
    """

    cpu_hour_usd: Float = Field(0.05, ge=0, description="one core for an hour (a cloud vCPU is "
                                                        "about $0.02 to $0.05)")
    gpu_hour_usd: Float = Field(2.50, ge=0, description="one GPU for an hour (an H100 rents for "
                                                        "about $2 to $4)")
    judge_usd_per_million_tokens: Float = Field(0.0, ge=0, description="the judge's price; 0: a "
                                                                       "local judge")
    gpu_hour_usd_by_name: dict[str, float] = Field(default_factory=dict, description=(
        "by device: a GPU whose NVML name (\"NVIDIA H100 80GB HBM3\") contains a key (any case) "
        "costs that per hour, e.g. {H100: 2.5, A10G: 1.0}"))
    judge_usd_per_million_tokens_by_model: dict[str, float] = Field(
        default_factory=dict, description="by judge model (judge.model, judge.benchmark_model), "
                                          "e.g. {gpt-4o-mini: 0.6}")
    rollout_usd_per_million_tokens: Float = Field(0.0, ge=0, description="rollouts from a server "
                                                  "that bills by the token (rollout.backend: "
                                                  "openai); 0 for one you run (priced by the hour)")

    def __post_init__(self):
        """Refuse negative prices by name."""
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


@section("budget")
class Budget:
    """`budget:`: what one cycle (and one calendar month of cycles) may spend; 0 = no limit.
    A cycle whose estimate exceeds it is refused before it starts (`offseason run`); the
    rollout, reward and train stages check what the cycle spent as they go and stop at the
    limit, keeping what they did. No stage lists it as a DVC param: raising a budget reruns
    nothing, so a stopped cycle resumes where it stopped (flows/orchestration/cost.py, stages/budget.py).
    """

    max_usd: Float = Field(0.0, ge=0, description="dollars per cycle, by the `cost:` prices; "
                                                  "0 = no limit")
    max_gpu_hours: Float = Field(0.0, ge=0, description="GPU hours per cycle (each GPU a stage "
                                                        "holds, for its wall time); 0 = no limit")
    max_judge_tokens: int = Field(0, ge=0, description="judge tokens per cycle, as the judge's "
                                                       "server reports them; 0 = no limit")
    monthly_usd: Float = Field(0.0, ge=0, description="dollars per calendar month (UTC), over the "
                                                      "committed cycles' ledgers; 0 = no limit")


ERASE_MODELS = ("keep", "flag", "rollback")  # what an erasure does to generations that learned


@section("erase")
class Erase:
    """`erase:`: deletion requests (`offseason erase`, flows/orchestration/erase.py). Ingest reads
    `subject_fields` (a DVC param of the ingest stage: what its erasure index holds); the rest is
    the command's alone and reruns nothing.
    """

    subject_fields: list[str] = Field(default_factory=list, description="record fields (dotted: "
                                      "metadata.customer_id) that name a person, indexed at "
                                      "ingest as salted hashes beside the user and session ids, "
                                      "so `offseason erase --field NAME=VALUE` finds them")
    models: str = Field("flag", description="generations that learned from erased traces: keep "
                        "(serve on; excluded from the next cycle), flag (also named in the "
                        "receipt, erasures.jsonl, `lineage --trace`, `offseason history` and "
                        "the report) or rollback (the champion goes back to the newest "
                        "generation that was a champion and never saw them)")
    deadline_days: int = Field(30, gt=0, description="days a request may stay open (GDPR: a "
                               "month); `offseason erase --status` counts against it")

    def __post_init__(self):
        """Refuse a models policy that is not one of the three."""
        if self.models not in ERASE_MODELS:
            raise ParamsError(f"erase.models: {self.models!r} is not a policy; one of "
                              f"{', '.join(ERASE_MODELS)}")
        for name in self.subject_fields:
            if not name.strip():
                raise ParamsError("erase.subject_fields: an empty field name; write a record "
                                  "key such as customer_id or metadata.customer_id")


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
    "erase": Erase,
}


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


# what a setting of each type looks like, for "expected ..." (by the type in pydantic's error;
# a mapping's example is its default)
EXAMPLES = {"int": "a whole number like 4", "float": "a number like 0.001",
            "bool": "true or false", "string": "a string"}
BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _validate(config, section: str, args: tuple, values: dict) -> None:
    """Fill `config`, a new instance of one `section(...)` class, from `values`, checked (what its
    `__init__` does, there with `section` its own name).
    """
    try:
        type(config).__pydantic_validator__.validate_python(ArgsKwargs(args, values),
                                                            self_instance=config)
    except pydantic.ValidationError as err:
        raise ParamsError(_explain(err, type(config), section)) from None


def _explain(err: pydantic.ValidationError, cls: type, section: str) -> str:
    """Pydantic's first complaint about `section` as ParamsError's message: the key's full name,
    the value it got and what to write instead (a `__post_init__` says so itself).
    """
    errors = err.errors()
    first, loc = errors[0], errors[0]["loc"]
    problem, value = first["type"], first["input"]
    if isinstance((first.get("ctx") or {}).get("error"), ParamsError):
        return str(first["ctx"]["error"])
    if problem == "unexpected_keyword_argument":
        return _unknown(cls, section, loc[0], value)
    if not loc or loc[0] not in cls.__pydantic_fields__:
        return f"{section}: {first['msg']}"
    field = cls.__pydantic_fields__[loc[0]]
    # a mapping's own entries (reward.weights.feedback) are named; a union's members are not
    key = _name(section, ".".join(map(str, loc[:2] if typing.get_origin(field.annotation) is dict
                                      else loc[:1])))
    if problem in BOUND_ERRORS:
        return (f"{key}: must be {bounds(field)}, got {value} "
                f"({field.description})")
    if problem == "finite_number":
        return f"{key}: expected a finite number like 0.001, got {value}"
    if problem == "dataclass_exact_type":  # a sub-section, e.g. train.dpo
        return f"section '{key}' must be a mapping of keys to values, got {_short(value)}"
    examples = dict(EXAMPLES)
    if problem == "dict_type":
        default = field.get_default(call_default_factory=True)
        examples["dict"] = (f"a mapping like {yaml.safe_dump(default, default_flow_style=True)}"
                            .strip() if default else "a mapping of keys to values")
    wanted = dict.fromkeys(examples.get(e["type"].split("_")[0], e["msg"]) for e in errors
                           if e["loc"][:1] == loc[:1])
    return f"{key}: expected {' or '.join(wanted)}, got {_short(value)} ({type(value).__name__})"


def _unknown(cls: type, section: str, key: str, value) -> str:
    """A key `section` has not: retired (what to write instead), or a typo (the nearest key)."""
    if (section, key) in RETIRED:
        return RETIRED[section, key](value)
    # where work runs is no key of the section itself (`load` refuses it there)
    shown = [f.name for f in dataclasses.fields(cls) if f.name not in RUNTIME.get(section, ())]
    near = difflib.get_close_matches(str(key), shown, n=1)
    hint = f" (did you mean '{section}.{near[0]}'?)" if near else ""
    elsewhere = (f"; where work runs goes under runtime.{section}: "
                 f"{', '.join(RUNTIME[section])}") if section in RUNTIME else ""
    return (f"unknown key '{section}.{key}'{hint}; valid keys in '{section}': "
            f"{', '.join(shown)}{elsewhere}")


def _name(section: str, key: str) -> str:
    """A key's full name, as written in params.yaml: runtime.rollout.urls, rollout.top_p."""
    runtime = key.split(".")[0] in RUNTIME.get(section, ())
    return f"runtime.{section}.{key}" if runtime else f"{section}.{key}"


def bounds(field) -> str:
    """A declared setting's bounds as its errors and docs/params.md say them: '> 0', 'between 0
    and 1', 'in (0, 0.5]'.
    """
    limits = {name: getattr(limit, name) for limit in field.metadata
              for name in ("gt", "ge", "lt", "le") if hasattr(limit, name)}
    low = ("[", limits["ge"]) if "ge" in limits else ("(", limits["gt"]) if "gt" in limits else None
    high = ("]", limits["le"]) if "le" in limits else (")", limits["lt"]) if "lt" in limits else None
    if low and high:
        if (low[0], high[0]) == ("[", "]"):
            return f"between {low[1]} and {high[1]}"
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]}"
    return ""


def _build(cls: type, section: str, raw, where: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        _fail(where, f"section '{section}' must be a mapping of keys to values, got {_short(raw)}")
    config = cls.__new__(cls)
    try:
        _validate(config, section, (), {str(key): value for key, value in raw.items()})
    except ParamsError as err:
        _fail(where, str(err))
    return config


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
