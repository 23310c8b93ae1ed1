"""Budgets that hold: what a cycle has spent so far, checked by the rollout, reward and train
stages as they go against params.yaml's `budget:` (per cycle: `max_usd`, `max_gpu_hours`,
`max_judge_tokens`; 0 = no limit), priced by `cost:`.

Helper of `stages/rollout.py`, `stages/reward.py` and `stages/train.py`; reads params.yaml, the
metrics of the cycle's earlier stages and, through git, whether those are this cycle's; writes
nothing. The cycle's spend so far is the earlier stages' (their `metrics/<stage>.json`, counted
when it differs from the last committed cycle's: a stage DVC skipped was paid for before) plus
this stage's own (its process's CPU seconds and its children's, the GPUs it watches for its wall
time, its judge's tokens). Over a limit, the stage raises `BudgetSpent` naming the key, what was
spent and what was left to do, after keeping what it did (the rollout's finished episodes and
the reward's finished scores beside their outputs, `<output>.partial`; the train stage's
checkpoint or on-policy state; the judge's paid judgments in its cache). Neither section is a
DVC param of any stage: raising a budget reruns nothing, so `offseason run` again resumes where
the stage stopped. The calendar month's budget (`budget.monthly_usd`) counts the committed
cycles of the month by their ledgers (`month_spent`, read through git) plus this cycle's spend
so far, before a cycle starts (flows/orchestration/cost.py) and in the stages alike.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from stages import config as cfg
from stages import io

ORDER = cfg.CYCLE


class BudgetSpent(RuntimeError):
    """A `budget:` limit is reached: the stage stops, keeping what it did."""


def price(units: dict, prices: cfg.Cost, places: int | None = 6) -> float:
    """Dollars of `units` at `prices`: cpu_seconds; gpu_seconds (split evenly over
    `gpu_names`, each GPU at its own rate, where they are known); judge_tokens (by model where
    `judge_tokens_by_model` says); `served_tokens` (a billing rollout server's). Rounded to
    `places` for ledgers; None: not rounded (a budget compares what was spent, however little).
    """
    names = units.get("gpu_names") or []
    gpu_seconds = units.get("gpu_seconds", 0.0)
    gpu = (sum(gpu_seconds / len(names) / 3600 * prices.gpu_rate(n) for n in names) if names
           else gpu_seconds / 3600 * prices.gpu_hour_usd)
    by_model = units.get("judge_tokens_by_model") or {}
    judge = (sum(tokens / 1e6 * prices.judge_rate(model) for model, tokens in by_model.items())
             if by_model else
             units.get("judge_tokens", 0) / 1e6 * prices.judge_usd_per_million_tokens)
    usd = (units.get("cpu_seconds", 0.0) / 3600 * prices.cpu_hour_usd + gpu + judge
           + units.get("served_tokens", 0) / 1e6 * prices.rollout_usd_per_million_tokens)
    return usd if places is None else round(usd, places)


def judge_model(judge: dict) -> str:
    """The model of a judge as a stage's metrics name it (`<model>/rubric-<hash>`)."""
    return str(judge.get("judge", "")).rsplit("/rubric-", 1)[0]


def units_of(metrics: dict) -> dict:
    """The priced units of a stage's metrics: CPU seconds, GPU seconds held (and the GPUs'
    names), judge tokens (by model), and the tokens of a rollout from a server (`served_tokens`:
    prompt and generated, when `backend` is openai).
    """
    used = metrics.get("resources") or {}
    judges = metrics.get("judges") or []
    by_model: dict[str, int] = {}
    for judge in judges:
        by_model[judge_model(judge)] = by_model.get(judge_model(judge), 0) + judge.get("tokens", 0)
    return {"cpu_seconds": used.get("cpu_seconds", 0.0),
            "gpu_seconds": len(used.get("gpus") or []) * used.get("wall_seconds", 0.0),
            "gpu_names": [g.get("name", "") for g in used.get("gpus") or []],
            "judge_tokens": sum(j.get("tokens", 0) for j in judges),
            "judge_tokens_by_model": by_model,
            "served_tokens": served_tokens(metrics)}


def served_tokens(metrics: dict) -> int:
    """The prompt and generated tokens of a rollout an OpenAI-compatible server generated."""
    if metrics.get("backend") != "openai":
        return 0
    usage = metrics.get("served_usage")  # the servers' own count, every turn's prompt included
    if usage:
        return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    return int(metrics.get("prompt_tokens") or 0) + int(metrics.get("generated_tokens") or 0)


def ran_this_cycle(root: Path, stage: str) -> bool:
    """Whether `stage` ran in this cycle, in this attempt or an earlier one (failed, or suspended
    for approval and resumed): its metrics file differs from the one committed at HEAD (or none
    is committed). A stage DVC skipped since the last cycle keeps that cycle's, unchanged.
    """
    path = root / "metrics" / f"{stage}.json"
    if not path.exists():
        return False
    committed = subprocess.run(["git", "show", f"HEAD:metrics/{stage}.json"], cwd=root,
                               capture_output=True, text=True)
    return committed.returncode != 0 or committed.stdout != path.read_text()


def earlier_spend(root: Path, stage: str) -> dict:
    """{stage: units} of the cycle's stages before `stage` that ran in this cycle
    (`ran_this_cycle`).
    """
    return {name: units_of(json.loads((root / "metrics" / f"{name}.json").read_text()))
            for name in ORDER[:ORDER.index(stage)] if ran_this_cycle(root, name)}


def month_spent(root: Path, now: datetime | None = None) -> tuple[float, list[str]]:
    """Dollars the committed cycles (tags gen-N, N >= 1) of this calendar month (UTC) cost, by
    their ledgers (metrics/cost.json at each tag), and their tags.
    """
    now = now or datetime.now(UTC)
    listed = subprocess.run(["git", "for-each-ref", "--format=%(refname:short) %(creatordate:iso-strict)",
                             "refs/tags/gen-*"], cwd=root, capture_output=True, text=True).stdout
    usd, tags = 0.0, []
    for line in listed.splitlines():
        tag, _, when = line.partition(" ")
        number = tag.removeprefix("gen-")
        if not number.isdigit() or int(number) < 1:
            continue
        stamp = datetime.fromisoformat(when).astimezone(UTC)
        if (stamp.year, stamp.month) != (now.year, now.month):
            continue
        shown = subprocess.run(["git", "show", f"{tag}:metrics/cost.json"], cwd=root,
                               capture_output=True, text=True)
        try:
            spent = (json.loads(shown.stdout).get("total") or {}).get("usd") \
                if shown.returncode == 0 else None
        except ValueError:
            spent = None
        if spent:
            usd += spent
            tags.append(tag)
    order = sorted(tags, key=lambda t: int(t.removeprefix("gen-")))
    return round(usd, 6), order


@dataclass
class Meter:
    """One stage's view of the cycle's budget: `check()` raises `BudgetSpent` once a limit is
    reached. `since_cpu`: the CPU seconds already used by this process before the stage began
    (0 for a stage's own process; a test calling `run()` passes what it used so far).
    """

    stage: str
    budget: cfg.Budget
    prices: cfg.Cost
    before: dict = field(default_factory=dict)  # {stage: units}, earlier in this cycle
    since_cpu: float = 0.0
    judge: str = ""  # the judge model this stage's judge tokens are priced as (judge.model)
    month: float = 0.0  # dollars the committed cycles of this calendar month cost (monthly_usd)
    since_wall: float = field(default_factory=lambda: io.STARTED)
    # CPU and wall seconds of this stage's earlier attempts (a training resumed after a stop)
    carried: dict = field(default_factory=dict)

    @classmethod
    def of(cls, stage: str, params: str | Path) -> Meter:
        """The meter of `stage` from params.yaml's `budget:` and `cost:` and the cycle so far."""
        budget = cfg.load("budget", params)
        limited = any((budget.max_usd, budget.max_gpu_hours, budget.max_judge_tokens,
                       budget.monthly_usd))
        root = Path(params).resolve().parent
        return cls(stage, budget, cfg.load("cost", params),
                   earlier_spend(root, stage) if limited else {},
                   judge=cfg.load("judge", params).model,
                   month=month_spent(root)[0] if budget.monthly_usd else 0.0)

    @property
    def limited(self) -> bool:
        """Whether any per-cycle limit is set."""
        return bool(self.budget.max_usd or self.budget.max_gpu_hours
                    or self.budget.max_judge_tokens or self.budget.monthly_usd)

    def own(self, judge_tokens: int = 0, served_tokens: int = 0) -> dict:
        """This stage's units so far (`served_tokens`: a rollout server's, as it billed them)."""
        mine, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
            resource.RUSAGE_CHILDREN)
        cpu = mine.ru_utime + mine.ru_stime + kids.ru_utime + kids.ru_stime - self.since_cpu
        names = [g["name"] for g in io._WATCH[0].summary()] if io._WATCH else []
        wall = time.monotonic() - self.since_wall + self.carried.get("wall_seconds", 0.0)
        return {"cpu_seconds": cpu + self.carried.get("cpu_seconds", 0.0),
                "gpu_seconds": len(names) * wall,
                "gpu_names": names, "judge_tokens": judge_tokens,
                "judge_tokens_by_model": {self.judge: judge_tokens} if judge_tokens else {},
                "served_tokens": served_tokens}

    def check(self, done: str, left: str, judge_tokens: int = 0, served_tokens: int = 0) -> None:
        """Raise `BudgetSpent` if the cycle is over a limit; `done` and `left` say, in words,
        what this stage did and what it leaves undone; `judge_tokens` and `served_tokens`: what
        this stage's judge and rollout servers processed so far.
        """
        if not self.limited:
            return
        stages = {**self.before, self.stage: self.own(judge_tokens, served_tokens)}
        total = {key: sum(u[key] for u in stages.values())
                 for key in ("cpu_seconds", "gpu_seconds", "judge_tokens")}
        # unrounded: a step's cent-fractions add up, and under $5e-7 rounded to nothing (a
        # 1e-9 budget then let a fast step or two through, as the tests' budget saw now and then)
        usd = sum(price(u, self.prices, None) for u in stages.values())
        over = None
        if self.budget.max_usd and usd >= self.budget.max_usd:
            over = (f"budget.max_usd={self.budget.max_usd:g}", f"${usd:.4f}",
                    f"${max(0.0, self.budget.max_usd - usd):.4f}")
        elif self.budget.max_gpu_hours and total["gpu_seconds"] / 3600 >= self.budget.max_gpu_hours:
            over = (f"budget.max_gpu_hours={self.budget.max_gpu_hours:g}",
                    f"{total['gpu_seconds'] / 3600:.4f} GPU hours", "none")
        elif self.budget.max_judge_tokens and total["judge_tokens"] >= self.budget.max_judge_tokens:
            over = (f"budget.max_judge_tokens={self.budget.max_judge_tokens}",
                    f"{total['judge_tokens']} judge tokens", "none")
        elif self.budget.monthly_usd and self.month + usd >= self.budget.monthly_usd:
            over = (f"budget.monthly_usd={self.budget.monthly_usd:g}",
                    f"${usd:.4f}, ${self.month + usd:.4f} this month with the committed cycles",
                    "none")
        if over is None:
            return
        by_stage = ", ".join(f"{name} ${price(u, self.prices):.4f}" for name, u in stages.items())
        raise BudgetSpent(
            f"{self.stage}: {over[0]} reached: this cycle spent {over[1]} ({by_stage}); "
            f"done: {done}; left to do: {left}. Nothing done is lost: raise {over[0].split('=')[0]} "
            f"in params.yaml (no stage reruns for it) and run the cycle again; it resumes here")


@contextmanager
def stops_cleanly(stage: str):
    """A stage's command line: a spent budget ends it with its message and exit status 3, not a
    traceback (its kept work stays where the message says).
    """
    try:
        yield
    except BudgetSpent as err:
        print(f"{stage}: error: {err}", file=sys.stderr)
        sys.exit(3)
