r"""Gate: the candidate against the champion on every benchmark suite, with paired statistics.

Reads `models/candidate`, the champion's per-item scores (`data/champion_scores.parquet`), the
items earlier champions solved (`data/forgetting.jsonl`) and the candidate's training data
(`data/rewards.parquet`, `data/replay/`). Scores the candidate greedily on every suite of the
`environments:` with a `benchmark`, then applies one-sided tests at `gate.alpha`: the primary
suite must improve; guards, forgetting, reward hacking and contamination must hold. Writes
per-item results to `data/gate.parquet`, the verdict to `metrics/gate.json`, and the held-out
judge's paid judgments to `--judgments`.

    python -m stages.gate models/candidate data/champion_scores.parquet data/forgetting.jsonl data/rewards.parquet \
        data/replay data/gate.parquet metrics/gate.json \
        --judgments data/gate_judgments --judged-before data/champion_judgments

Details: docs/cycle.md, "How the gate stage works (stages/gate.py)".
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import io
from stages.envs import contract

# tinylm and the generation loop (torch, transformers: seconds) are imported where a model is
# loaded: the statistics and `offseason benchmark refresh` (item_decisions, refreshed) need neither


def weights_hash(folder: Path) -> str:
    """The SHA-256 of a model folder's weights (sharded folders too: `tinylm.weights_digest`)."""
    from stages import tinylm

    return tinylm.weights_digest(folder)


def question_of(task: dict) -> str:
    """A chat task's question, for people reading the results: its first user message's text."""
    for message in task["messages"]:
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content or ""
    return ""


def score(model_dir: Path, suites: dict[str, tuple], rollout: cfg.Rollout, seed: int
          ) -> list[dict]:
    """Every benchmark task of the user's environments attempted greedily by one chat model
    (its template, `rollout.tool_parser`, `rollout.max_new_tokens` per turn) and scored by the
    environment's reward: correct (full marks), reward (mean of the components), format (the
    model ended its answer itself, not cut off), tool_ok (no tool call failed), tokens. A tool
    or a reward that breaks fails the gate naming the item: it cannot decide on a broken suite.
    """
    import json

    from stages import tinylm
    from stages.generation import chat

    model, tokenizer = tinylm.load(model_dir)
    model.eval()
    rows = []
    for name, (env, tasks) in suites.items():
        episodes = chat.greedy(model, tokenizer, env, tasks, rollout, seed)
        for task, episode in zip(tasks, episodes):
            where = f"{env.where}, benchmark task {task['task_id']!r}"
            if episode.error:
                raise RuntimeError(f"{where}: {episode.error}")
            try:
                parts = contract.score(env, task, episode.messages)
            except Exception as err:
                raise RuntimeError(f"{where}: reward() raised {type(err).__name__}: {err}"
                                   ) from err
            judged = parts is not None
            rows.append({
                "suite": name, "id": task["task_id"], "question": question_of(task),
                "correct": float(contract.full_marks(parts)) if judged else None,
                "reward": contract.mean(parts) if judged else None,
                "format": float(episode.finish == "eos") if judged else None,
                "tool_ok": float(episode.tool_errors == 0) if judged else None,
                "suspect": float(bool(contract.suspected(parts))) if judged else None,
                "tokens": int(sum(episode.model_mask)),
                "completion": json.dumps(episode.messages[len(task["messages"]):])})
    return rows


def score_all(model_dir: Path, config: cfg.Gate, seed: int, specs: dict, rollout: cfg.Rollout,
              root: Path | None = None) -> tuple[dict, list[dict], dict]:
    """(tasks by suite, one model's score rows, the suites: {name: (Environment, tasks)}): the
    environments' benchmarks (the first `gate.benchmark_size` of each when set), attempted and
    scored (`score`). What champion_scores and the gate both score, alike.
    """
    suites = contract.benchmark_suites(specs, root or Path.cwd(), config.benchmark_size)
    items = {name: tasks for name, (_, tasks) in suites.items()}
    return items, score(model_dir, suites, rollout, seed), suites


def paired_interval(a: np.ndarray, b: np.ndarray, samples: int, confidence: float, seed: int,
                    relative: bool = False) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(a) - mean(b), resampling items (pairs) together.

    With `relative`, of (mean(a) - mean(b)) / mean(b): the growth of a over b.
    """
    stats = bootstrap(a, b, samples, seed, relative)
    tail = (1 - confidence) / 2
    return float(np.quantile(stats, tail)), float(np.quantile(stats, 1 - tail))


def bootstrap(a: np.ndarray, b: np.ndarray, samples: int, seed: int, relative: bool = False
              ) -> np.ndarray:
    """The paired bootstrap's resampled statistics (see `paired_interval`)."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(a), size=(samples, len(a)))
    if relative:
        mean_a, mean_b = a[index].mean(axis=1), b[index].mean(axis=1)
        stats = (mean_a - mean_b) / np.maximum(mean_b, 1e-12)
    else:  # the mean of the paired differences: exact where the scores are (0.6 - 0.65 is not)
        stats = (a - b)[index].mean(axis=1)
    return stats


# LORD++ (Ramdas, Yang, Wainwright and Jordan 2017, after Javanmard and Montanari 2018): gamma_j,
# a non-increasing sequence summing to 1, spreads the error budget over an unending sequence
GAMMA_C = 0.07720838


def gamma(j: int) -> float:
    """The LORD++ weight of the j-th decision after a point (j >= 1)."""
    return GAMMA_C * math.log(max(j, 2)) / (j * math.exp(math.sqrt(math.log(j))))


def lord_level(alpha: float, passed: list[bool]) -> float:
    """LORD++'s level for the next decision, after the earlier ones (`passed`, in order): the
    initial wealth alpha / 2 spent by gamma, each promotion earning alpha back. Keeps the
    expected share of false promotions among promotions (FDR) at most alpha over any number of
    cycles; with no real improvement ever, the chance of any promotion at all stays below
    alpha / 2.
    """
    t = len(passed) + 1
    wealth = alpha / 2
    times = [i + 1 for i, p in enumerate(passed) if p]
    level = gamma(t) * wealth
    if times:
        level += (alpha - wealth) * gamma(t - times[0])
        level += alpha * sum(gamma(t - tau) for tau in times[1:])
    return level


# SAFFRON's and ADDIS's spending sequence: gamma_j proportional to j^-1.6, summing to 1 (the
# default of both papers); ZETA_1_6 is the sum of j^-1.6 over j >= 1
ZETA_1_6 = 2.2857583226


def gamma_adaptive(j: int) -> float:
    """The weight of the j-th step of SAFFRON's and ADDIS's spending (j >= 1)."""
    return j ** -1.6 / ZETA_1_6


def saffron_level(alpha: float, p_values: list[float], lam: float = 0.5) -> float:
    """SAFFRON's level for the next decision (Ramdas, Zrnic, Wainwright & Jordan 2018), from the
    earlier decisions' p-values in order. Adaptive: a decision whose p-value is at most `lam`
    (a "candidate", likely a real improvement) spends no wealth, so a run of clearly null
    decisions does not drive the level to nothing as LORD++'s does. FDR at most alpha.
    """
    w0 = (1 - lam) * alpha / 2
    t = len(p_values) + 1
    rejections: list[int] = []
    for i, p in enumerate(p_values, start=1):  # the levels earlier decisions were held to
        if p <= _saffron(alpha, lam, w0, i, p_values[:i - 1], rejections):
            rejections.append(i)
    return _saffron(alpha, lam, w0, t, p_values, rejections)


def _saffron(alpha, lam, w0, t, p_values, rejections) -> float:
    candidates = [1 if p <= lam else 0 for p in p_values]

    def after(time: int) -> int:  # candidates after decision `time`, before t
        return sum(candidates[time:t - 1])

    level = w0 * gamma_adaptive(t - after(0))
    for j, tau in enumerate(rejections):
        weight = ((1 - lam) * alpha - w0) if j == 0 else (1 - lam) * alpha
        level += weight * gamma_adaptive(t - tau - after(tau))
    return min(lam, level)


def addis_level(alpha: float, p_values: list[float], lam: float = 0.25, tau: float = 0.5
                ) -> float:
    """ADDIS's level for the next decision (Tian & Ramdas 2019): SAFFRON's adaptivity plus
    discarding, a decision whose p-value is above `tau` (a candidate clearly no better, which
    most are) spends nothing at all. FDR at most alpha, for conservative null p-values (a
    discrete exact test's are).
    """
    w0 = alpha / 2
    rejections: list[int] = []
    for i, p in enumerate(p_values, start=1):
        if p <= _addis(alpha, lam, tau, w0, i, p_values[:i - 1], rejections):
            rejections.append(i)
    return _addis(alpha, lam, tau, w0, len(p_values) + 1, p_values, rejections)


def _addis(alpha, lam, tau, w0, t, p_values, rejections) -> float:
    selected = [1 if p <= tau else 0 for p in p_values]
    candidates = [1 if p <= lam else 0 for p in p_values]
    s_t = 1 + sum(selected)

    def after(time: int) -> int:
        return sum(candidates[time:t - 1])

    level = w0 * gamma_adaptive(s_t - after(0))
    for j, kappa in enumerate(rejections):
        kappa_star = sum(selected[:kappa])
        weight = (alpha - w0) if j == 0 else alpha
        level += weight * gamma_adaptive(max(1, s_t - kappa_star - after(kappa)))
    return min(lam, (tau - lam) * level)


SEQUENTIAL = ("none", "lord", "saffron", "addis")
SEQUENTIAL_NAMES = {"lord": "LORD++", "saffron": "SAFFRON", "addis": "ADDIS"}


def sequential_level(config: cfg.Gate, history: list[dict]) -> float:
    """The primary's level for this decision under `gate.sequential`, from the earlier
    decisions (data/gate_history.jsonl lines: `passed`, `p_value`).
    """
    if config.sequential == "lord":
        return lord_level(config.alpha, [bool(h["passed"]) for h in history])
    p_values = [1.0 if h.get("p_value") is None else float(h["p_value"]) for h in history]
    if config.sequential == "saffron":
        return saffron_level(config.alpha, p_values)
    if config.sequential == "addis":
        return addis_level(config.alpha, p_values)
    return config.alpha


def mcnemar(a: np.ndarray, b: np.ndarray) -> dict:
    """McNemar's exact test on pass/fail pairs: the items only one of the two models solved.
    `p_value` is two-sided; `p_better` one-sided, that a (the candidate) is better.
    """
    from scipy.stats import binomtest

    only_a, only_b = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    n = only_a + only_b
    p = binomtest(only_a, n, 0.5).pvalue if n else 1.0
    better = binomtest(only_a, n, 0.5, alternative="greater").pvalue if n else 1.0
    return {"candidate_only": only_a, "champion_only": only_b, "p_value": round(float(p), 6),
            "p_better": round(float(better), 6)}


def compare(name: str, a: np.ndarray, b: np.ndarray, config: cfg.Gate, seed: int, *,
            threshold: float, primary: bool, relative: bool = False, lower_is_better=False,
            level: float | None = None, score_test: bool = True) -> dict:
    """One rule: the paired interval of candidate - champion against its threshold. `level`:
    the primary's one-sided test level (default `gate.alpha`; LORD's when sequential);
    `score_test`: a pass/fail guard with a margin is decided by Tango's test (False: by the
    bootstrap's bound, as the per-environment protocol guards are).
    """
    level = config.alpha if level is None else level
    if len(a) == 0:
        if primary:  # nothing to decide on is no evidence of improvement
            return {"passed": False, "skipped": False, "items": 0,
                    "reason": f"{name}: no judged items: the primary suite cannot show an "
                              f"improvement; check data/benchmarks/{name}.jsonl and its verifier"}
        return {"passed": True, "skipped": True, "items": 0,
                "reason": f"{name}: no items yet, skipped"}
    # two-sided 1 - 2 alpha: each bound is the one-sided bound at level 1 - alpha
    stats = bootstrap(a, b, config.bootstrap_samples, seed, relative)
    tail = level if primary else config.alpha
    low, high = float(np.quantile(stats, tail)), float(np.quantile(stats, 1 - tail))
    ma, mb = float(a.mean()), float(b.mean())
    difference = (ma - mb) / max(mb, 1e-12) if relative else float((a - b).mean())
    out = {"items": int(len(a)), "candidate": round(ma, 4), "champion": round(mb, 4),
           "difference": round(difference, 4), "interval": [round(low, 4), round(high, 4)],
           "threshold": threshold, "skipped": False}
    binary = set(np.unique(np.concatenate([a, b]))) <= {0.0, 1.0} and not relative
    if binary:
        out["mcnemar"] = mcnemar(a, b)
    if primary and binary and threshold == 0:
        test = out["mcnemar"]
        out["test"] = "exact McNemar, one-sided"
        out["p_value"] = test["p_better"]
        out["passed"] = test["p_better"] < level
        split = f"{test['candidate_only']}-{test['champion_only']}"
        out["reason"] = (f"{name}: {split} on the items only one model solved, p = "
                         f"{test['p_better']:.4f} < alpha {level:.4g}" if out["passed"] else
                         f"{name}: {split} on the items only one model solved, p = "
                         f"{test['p_better']:.4f} >= alpha {level:.4g}: not clearly better")
    elif primary:
        # a paired t-test, not the bootstrap: a bootstrap p-value cannot go below 1 / (B + 1),
        # so a level LORD++ set below it (8.9e-5 against B = 2,000) was never resolved and false
        # promotions ran at 1e-3 (issue 50); the t-test's p-value resolves any level, and its
        # error rate on bounded, skewed scores is checked by simulation (tests/stages/test_gate.py)
        p_value, low = paired_t(a, b, threshold, level)
        out["test"] = "paired t-test, one-sided"
        out["p_value"] = round(p_value, 8)
        out["interval"][0] = round(low, 4)
        out["passed"] = p_value < level
        out["reason"] = (f"{name}: {difference:+.3f}, p = {p_value:.4g} < alpha {level:.4g} "
                         f"(lower bound {low:+.3f} > {threshold})" if out["passed"] else
                         f"{name}: {difference:+.3f}, p = {p_value:.4g} >= alpha {level:.4g} "
                         f"(lower bound {low:+.3f}): not clearly better than {threshold}")
    elif binary and score_test and not lower_is_better and threshold > 0:
        # pass/fail pairs against a margin: Tango's score test for paired proportions (its
        # size held at 5.1 % where the percentile bootstrap's ran at 7.1 %, issue 50). A margin
        # of 0 keeps the bootstrap's "no regression seen": no test can show non-inferiority at a
        # margin of 0, so every cycle would be blocked
        from scipy.stats import norm

        low = tango_lower(a, b, tail)
        out["interval"][0] = round(low, 4)
        out["test"] = "Tango's paired score test, one-sided"
        out["passed"] = bool(tango_statistic(a, b, -threshold) > norm.ppf(1 - tail))
        out["reason"] = (f"{name}: lower bound {low:+.3f} >= -{threshold}" if out["passed"]
                         else f"{name}: lower bound {low:+.3f} < -{threshold}: may have "
                              f"regressed beyond the margin")
    elif lower_is_better:  # growth is bad: its upper bound must stay within the margin
        out["passed"] = high <= threshold
        out["reason"] = (f"{name}: upper bound {high:+.3f} <= {threshold}" if out["passed"] else
                         f"{name}: upper bound {high:+.3f} > {threshold}: may have grown beyond "
                         f"the margin")
    else:
        out["passed"] = low >= -threshold
        out["reason"] = (f"{name}: lower bound {low:+.3f} >= -{threshold}" if out["passed"] else
                         f"{name}: lower bound {low:+.3f} < -{threshold}: may have regressed "
                         f"beyond the margin")
    return out


def tango_statistic(a: np.ndarray, b: np.ndarray, delta: float) -> float:
    """Tango's score statistic (1998) for paired pass/fail items against the null hypothesis
    mean(a) - mean(b) = `delta`: the discordant counts' difference over its standard error at
    the constrained maximum-likelihood estimate of the discordant probability.
    """
    n = len(a)
    only_a = float(((a == 1) & (b == 0)).sum())
    only_b = float(((a == 0) & (b == 1)).sum())
    variance = n * tango_variance(only_a / n, only_b / n, delta)
    surplus = only_a - only_b - n * delta
    if variance <= 0:
        return math.inf if surplus > 0 else -math.inf if surplus < 0 else 0.0
    return surplus / math.sqrt(variance)


def tango_variance(only_a: float, only_b: float, delta: float) -> float:
    """The variance of one item's paired difference under Tango's null hypothesis mean(a) -
    mean(b) = `delta`, given the shares of items only a and only b solved: 2q + delta(1 -
    delta), q the constrained maximum-likelihood estimate of the share only b solved.
    """
    big_b = -only_a - only_b + (2.0 - only_a + only_b) * delta
    big_c = -only_b * delta * (1 - delta)
    q = (math.sqrt(max(big_b * big_b - 8 * big_c, 0.0)) - big_b) / 4
    return 2 * q + delta * (1 - delta)


def tango_lower(a: np.ndarray, b: np.ndarray, tail: float) -> float:
    """The one-sided lower confidence bound (level 1 - `tail`) of mean(a) - mean(b) from
    Tango's score test: the least difference the test does not reject (by bisection).
    """
    from scipy.stats import norm

    z = float(norm.ppf(1 - tail))
    low, high = -1.0, float((a - b).mean())
    if tango_statistic(a, b, low + 1e-9) <= z:
        return -1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if tango_statistic(a, b, middle) > z else (low, middle)
    return high


def paired_t(a: np.ndarray, b: np.ndarray, threshold: float, level: float
             ) -> tuple[float, float]:
    """One-sided paired t-test that mean(a - b) > `threshold`: (its p-value, the one-sided lower
    confidence bound at `level`). Differences all alike (no spread): p is 0 above the threshold,
    1 otherwise.
    """
    from scipy.stats import t as student

    diff = a - b
    n, mean = len(diff), float(diff.mean())
    spread = float(diff.std(ddof=1)) if n > 1 else 0.0
    if spread == 0.0:
        return (0.0 if mean > threshold else 1.0), mean
    se = spread / math.sqrt(n)
    p_value = float(student.sf((mean - threshold) / se, n - 1))
    return p_value, mean - float(student.ppf(1 - level, n - 1)) * se


def detectable(a: np.ndarray, b: np.ndarray, alpha: float, power: float = 0.8) -> float:
    """The smallest true difference a paired comparison of these items detects with `power`
    at one-sided `alpha`: (z_(1-alpha) + z_power) * sd(a - b) / sqrt(n). On pass/fail items the
    variance of a difference is about the share of items the models disagree on, so this is the
    sqrt(6.2 x disagreement / n) of the usual McNemar sizing at alpha 0.05; and never below
    what the exact test can show at all: k items one model solves and the other not, all one
    way, give p = 0.5^k, so a change under k/n items with 0.5^k < alpha (5 at 0.05) is never
    significant. Two models that agree on every item (sd 0) said 0 before: a 4-item suite
    "detected a change of 0.000"; it now says 1.25, more than any change there can be.
    """
    from scipy.stats import norm

    if len(a) < 2:
        return float("inf")
    spread = float(np.std(a - b, ddof=1))
    change = (norm.ppf(1 - alpha) + norm.ppf(power)) * spread / math.sqrt(len(a))
    if np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
        change = max(change, (math.floor(math.log2(1 / alpha)) + 1) / len(a))
    return change


@functools.lru_cache(maxsize=4096)  # the design of every decision asks again (simulations)
def mcnemar_power(n: int, discordance: float, change: float, level: float) -> float:
    """The chance that McNemar's exact one-sided test at `level` finds a candidate better on `n`
    pass/fail items, when each item is discordant with probability `discordance` and a
    discordant one goes the candidate's way with probability 1/2 + change / (2 discordance):
    a true difference of `change`. Exact: the sum over the number of discordant items.
    """
    from scipy import special

    if n < 1:
        return 0.0
    # the numbers of discordant items with any weight (within 10 standard deviations)
    spread = 10 * math.sqrt(n * discordance * (1 - discordance)) + 10
    k = np.arange(max(0, math.floor(n * discordance - spread)),
                  min(n, math.ceil(n * discordance + spread)) + 1)
    # the least number of wins among k that the test calls significant (p < level): from the
    # normal approximation, moved until P(W >= wins - 1) >= level > P(W >= wins)
    wins = np.ceil(k / 2 + special.ndtri(1 - level) * np.sqrt(k) / 2).astype(int)
    for _ in range(n + 2):
        up = special.bdtrc(wins - 1, k, 0.5) >= level  # not yet significant: one more
        down = (wins > 0) & (special.bdtrc(wins - 2, k, 0.5) < level)  # one fewer suffices
        if not (up.any() or down.any()):
            break
        wins += up.astype(int) - down.astype(int)
    share = min(0.5 + change / (2 * discordance), 1.0)
    counts = np.exp(special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)
                    + special.xlogy(k, discordance) + special.xlog1py(n - k, -discordance))
    # P(W >= wins) for W ~ Binomial(k, share); no k can reach wins > k
    reach = np.where(wins <= k, special.bdtrc(wins - 1, k, share), 0.0)
    return float((counts * reach).sum())


def design(config: cfg.Gate, suites: dict[str, dict], forgetting: int = 0,
           level: float | None = None) -> dict:
    """The gate stated as one decision (Schultzberg, Ankargren and Frånberg 2024, "Risk-aware
    product decisions in A/B tests with multiple metrics"): promote when the primary is
    significantly better and every guard significantly within its margin. Alpha is not adjusted
    for the guards (the rule is an intersection-union test: a candidate no better than the
    champion is promoted at most alpha of the time however many guards there are), but beta is:
    with k guards each test is sized for power 1 - (1 - gate.power) / (k + 1), so that the whole
    decision has at least gate.power (Bonferroni on the misses).

    `suites`: {name: {"items": n, "margin": its max_regression (the primary's is unused),
    "graded": scores other than pass/fail}}; `forgetting`: the items earlier champions solved
    (a guard from gate.forgetting_min_items on); `level`: the primary's level (default
    gate.alpha; LORD's when sequential). The scenario: the candidate is gate.min_detectable
    better on the primary and unchanged on every guard, and answers gate.discordance of each
    suite's items differently from the champion (graded: that mean squared difference), so the
    variance of an item's paired difference is discordance - change^2. A pass/fail primary's
    power is McNemar's exact test's (`mcnemar_power`; the normal approximation of Connor 1987
    overstates it by 5 to 7 points at 200 items); the rest are normal approximations: the paired
    t-test for a graded primary or one above a min_improvement, Tango's score test for a
    pass/fail guard at its margin (the null variance at its constrained estimate), a normal
    bound for the rest. The protocol guards
    (format, tool calls, length, hacks) are assumed to hold. The decision's power is the product
    of the tests' (the suites' items are apart; the forgetting items overlap them), never below
    the Bonferroni bound also returned. Per suite: items it has, items it needs for its test's
    target (None: no number suffices, as for a margin of 0), its test's power.
    """
    from scipy.stats import norm

    level = config.alpha if level is None else level
    change, psi = config.min_detectable, config.discordance
    # name: (role, items, effect, sd under the null, sd at the scenario, level, McNemar's)
    tests = {}
    for name, suite in sorted(suites.items(), key=lambda item: item[0] != config.primary):
        graded = suite.get("graded", False)
        if name == config.primary:
            spread = math.sqrt(max(psi - change * change, 1e-12))
            exact = not graded and config.min_improvement == 0  # compare's McNemar branch
            tests[name] = ("primary", suite["items"], change - config.min_improvement, spread,
                           spread, level, exact)
        else:
            margin = suite["margin"]
            null = (tango_variance(psi / 2, psi / 2, -margin) if not graded and margin > 0
                    else psi)
            tests[name] = ("guard", suite["items"], margin, math.sqrt(null), math.sqrt(psi),
                           config.alpha, False)
    if forgetting >= config.forgetting_min_items:
        margin = config.forgetting_max_regression
        tests["forgetting"] = ("forgetting", forgetting, margin, math.sqrt(
            tango_variance(psi / 2, psi / 2, -margin) if margin > 0 else psi), math.sqrt(psi),
            config.alpha, False)
    z_power = norm.ppf(0.8)  # `detectable`'s 80%: what decide flags underpowered by
    blocking = [name for name, (role, n, effect, *_) in tests.items() if role != "primary" and n
                and not (config.underpowered == "skip"
                         and (norm.ppf(1 - config.alpha) + z_power) * math.sqrt(psi)
                         > effect * math.sqrt(n))]
    target = 1 - (1 - config.power) / (len(blocking) + 1)
    out, whole, misses = {}, 1.0, 0.0
    for name, (role, n, effect, null, spread, lvl, exact) in tests.items():
        z = norm.ppf(1 - lvl)
        if exact:  # McNemar's exact test, given the discordant items
            power = mcnemar_power(n, psi, effect, lvl)
        elif role == "primary" or name in blocking:
            power = float(norm.cdf((effect * math.sqrt(n) - z * null) / spread)) if n else 0.0
        else:  # no items yet, or underpowered under gate.underpowered: skip: it cannot block
            power = 1.0
        needs = (math.ceil(((z * null + norm.ppf(target) * spread) / effect) ** 2)
                 if effect > 0 else None)
        if exact and needs is not None:  # from there, the least n the exact test reaches it at
            low, high = 1, needs
            while mcnemar_power(high, psi, effect, lvl) < target:
                low, high = high, 2 * high
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (low, middle) if mcnemar_power(middle, psi, effect, lvl) >= target \
                    else (middle, high)
            needs = high
        out[name] = {"role": role, "items": n, "needs": needs, "test_power": round(power, 4),
                     "blocks": role == "primary" or name in blocking}
        whole, misses = whole * power, misses + 1 - power
    primary = tests.get(config.primary)
    lacking = [f"{'the forgetting guard' if name == 'forgetting' else f'suite {name!r}'}"
               + ("" if s["blocks"] else " does not block (underpowered, gate.underpowered: "
                                         "skip); it")
               + " needs " + (f"{s['needs']} items, has {s['items']}" if s["needs"] is not None
                              else f"a margin above 0 (no number of items shows "
                                   f"non-inferiority at 0), has {s['items']} items")
               for name, s in out.items() if s["blocks"] or s["items"]]
    guards = (f", {len(blocking)} guard{'' if len(blocking) == 1 else 's'} unchanged"
              if blocking else "")
    summary = (f"whole decision power {whole:.0%} (target {config.power:.0%}) at {change:+g} on "
               f"{config.primary!r}{guards}, {psi:.0%} of items answered differently (assumed); "
               + "; ".join(lacking)) if primary else (
        f"no decision: the primary {config.primary!r} has no benchmark suite")
    return {"decision_power": round(whole if primary else 0.0, 4), "target": config.power,
            "bound": round(max(1 - misses, 0.0) if primary else 0.0, 4),
            "per_test_target": round(target, 4), "min_detectable": change, "discordance": psi,
            "level": round(level, 6), "suites": out, "summary": summary}


def normalized_hash(text: str) -> str:
    """The hash two spellings of one question share: case and whitespace do not count."""
    return hashlib.sha256(re.sub(r"\s+", "", text).casefold().encode()).hexdigest()[:16]


def training_prompts(rewards: Path, replay: Path, tokenizer) -> set[str]:
    """Normalized hashes of every prompt in the candidate's training data: the decoded ids of
    each episode (this cycle's rewards, the replayed parts) before the model's first own token.
    """
    parts = sorted(replay.glob("part-*.parquet")) if replay.exists() else []
    seen = set()
    for part in [rewards, *parts] if rewards.exists() else parts:
        table = pq.read_table(part, columns=["token_ids", "model_mask"]).to_pylist()
        # the prompt is what precedes the model's first own token
        prompts = [row["token_ids"][:row["model_mask"].index(1) if 1 in row["model_mask"]
                                    else len(row["model_mask"])] for row in table]
        seen |= {normalized_hash(text) for text in
                 tokenizer.batch_decode(prompts, skip_special_tokens=True)}
    return seen


def run(base: cfg.Base, config: cfg.Gate, candidate: Path, champion_scores: Path,
        forgetting: Path, rewards: Path, replay: Path, items_out: Path, specs: dict,
        rollout: cfg.Rollout, root: Path | None = None, history: Path | None = None) -> dict:
    """Score the candidate on the benchmarks of the `environments:` (`specs`, attempted as the
    `rollout` settings say), compare with the champion's scores and decide; returns the verdict.
    """
    from stages import tinylm
    from stages.generation import chat

    tinylm.set_threads(base.threads)
    items, cand, suites = score_all(candidate, config, base.seed, specs, rollout, root)
    margins = {name: (f"{name} ({env.module})", specs[name].max_regression)
               for name, (env, _) in suites.items()}
    champ_rows = pq.read_table(champion_scores).to_pylist()
    champ = {(r["suite"], r["id"]): r for r in champ_rows}
    missing = [(r["suite"], r["id"]) for r in cand if (r["suite"], r["id"]) not in champ]
    if missing:
        raise ValueError(f"{champion_scores}: no champion scores for {len(missing)} items (e.g. "
                         f"{missing[0]}); rerun `dvc repro champion_scores`")
    pairs = [(c, champ[(c["suite"], c["id"])]) for c in cand]
    current = champ_rows[0]["champion_weights"][:16]
    solved = {(r["suite"], r["id"]) for r in (io.read_jsonl(forgetting) if forgetting.exists()
                                              else []) if set(r["solved_by"]) - {current}}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(candidate)
    seen = training_prompts(rewards, replay, tokenizer)
    contaminated = []  # a task's prompt as the model saw it: its template's rendering, decoded
    for name, suite in items.items():
        template = chat.Template.of(tokenizer, list(suites[name][0].tools))
        contaminated += [f"{name}/{task['task_id']}" for task in suite if normalized_hash(
            tokenizer.decode(template.for_task(task).prompt(task["messages"]),
                             skip_special_tokens=True)) in seen]
    contaminated.sort()
    candidate_weights = weights_hash(candidate)
    unchanged = candidate_weights == champ_rows[0]["champion_weights"]
    io.write_parquet(items_out, pa.Table.from_pylist([
        {"suite": c["suite"], "id": c["id"], "question": c["question"],
         "candidate": c["correct"], "champion": h["correct"], "candidate_format": c["format"],
         "candidate_tool_ok": c["tool_ok"], "candidate_suspect": c.get("suspect"),
         "candidate_tokens": c["tokens"],
         "champion_tokens": h["tokens"], "candidate_completion": c["completion"],
         "champion_completion": h["completion"]} for c, h in pairs]))
    # the sequence of decisions across cycles, one line each, keyed by the two models' weights
    # so that a rerun of this cycle's gate replaces its own line
    key = f"{candidate_weights[:16]}/{champ_rows[0]['champion_weights'][:16]}"
    earlier = [h for h in (io.read_jsonl(history) if history and history.exists() else [])
               if h["key"] != key]
    verdict = decide(config, base.seed, pairs, solved, contaminated, unchanged, margins,
                     [h for h in earlier if not h.get("unchanged")])
    used = {name: sorted({str(task["task_id"]) for task in suite})
            for name, suite in items.items()}
    verdict["item_usage"] = item_usage(earlier, used, unchanged)
    if history is not None:
        io.write_jsonl(history, earlier + [{
            "key": key, "primary": config.primary, "method": config.sequential,
            "level": verdict["sequence"]["level"], "p_value": verdict["sequence"]["p_value"],
            "passed": verdict["passed"], "unchanged": unchanged, "items": used}])
    return verdict


def item_usage(earlier: list[dict], used: dict[str, list[str]], unchanged: bool) -> dict:
    """How many decisions each suite's items have informed, this one included (unless the
    candidate is the champion unchanged: nothing was decided), from the earlier lines of
    data/gate_history.jsonl: per suite its items and the fewest, mean and most decisions per
    item. Held-out items that decided many cycles wear out (a team picks candidates by them);
    refresh a suite whose items have informed many decisions.
    """
    out = {}
    for name, ids in used.items():
        counts = dict.fromkeys(ids, 0 if unchanged else 1)
        for line in earlier:
            if line.get("unchanged"):
                continue
            for item in set((line.get("items") or {}).get(name, ())):
                if item in counts:
                    counts[item] += 1
        values = list(counts.values()) or [0]
        out[name] = {"items": len(ids), "decisions_min": min(values),
                     "decisions_mean": round(sum(values) / len(values), 2),
                     "decisions_max": max(values)}
    return out


def item_decisions(history: list[dict], suite: str) -> dict[str, int]:
    """How many decisions each item of `suite` has informed, from data/gate_history.jsonl's
    lines (a candidate that was the champion unchanged decided nothing).
    """
    counts: dict[str, int] = {}
    for line in history:
        if line.get("unchanged"):
            continue
        for item in set((line.get("items") or {}).get(suite, ())):
            counts[item] = counts.get(item, 0) + 1
    return counts


def refreshed(items: list[dict], pool: list[dict], decided: dict[str, int], limit: int = 0,
              min_decisions: int = 1) -> tuple[list[dict], list[dict], list[dict]]:
    """A benchmark with its most-used items replaced by held-out production tasks.

    `items`: the benchmark's tasks; `pool`: held-out tasks, oldest first (`data/holdout/`);
    `decided`: decisions per item id (`item_decisions`). The items that informed the most
    decisions (at least `min_decisions`; ties: the earlier in the file) give way, each to the
    oldest pool task that is not in the benchmark and never decided anything, at most `limit`
    (0: as many as the pool allows). The suite keeps its size and order. Returns (the new items,
    the retired ones, the ones added).
    """
    ids = {str(i["task_id"]) for i in items}
    fresh = [t for t in pool if str(t["task_id"]) not in ids and str(t["task_id"]) not in decided]
    worn = sorted((i for i, item in enumerate(items)
                   if decided.get(str(item["task_id"]), 0) >= min_decisions),
                  key=lambda i: (-decided.get(str(items[i]["task_id"]), 0), i))
    n = min(len(fresh), len(worn), limit or len(worn))
    out = list(items)
    for position, task in zip(sorted(worn[:n]), fresh[:n]):
        out[position] = task
    return out, [items[i] for i in sorted(worn[:n])], fresh[:n]


def grown(items: list[dict], pool: list[dict], decided: dict[str, int], size: int
          ) -> tuple[list[dict], list[dict]]:
    """A benchmark grown towards `size` items (what the gate's design says it needs, `design`)
    by the oldest held-out tasks that are not in it and never decided anything, as `refreshed`
    takes them, appended. Returns (the new items, the ones added).
    """
    ids = {str(i["task_id"]) for i in items}
    fresh = [t for t in pool if str(t["task_id"]) not in ids and str(t["task_id"]) not in decided]
    added = fresh[:max(size - len(items), 0)]
    return items + added, added


# the reward-hacking guards, each held in every suite apart: (what it measures, the row key,
# whether growth is the bad direction); their margins are gate.max_length_increase etc.
GUARDS = {
    "length": ("generated tokens", "tokens", True),
    "format": ("protocol followed", "format", False),
    "tool_ok": ("tool calls without error", "tool_ok", False),
    # a verifier's hack_suspected note (code that patched the test framework, replaced
    # builtins, walked the harness): any rise over the champion's share fails by default
    "hacking": ("completions a verifier suspected of a reward hack", "suspect", True),
}


def decide(config: cfg.Gate, seed: int, pairs: list[tuple[dict, dict]], solved: set,
           contaminated: list[str], unchanged: bool,
           margins: dict[str, tuple[str, float]] | None = None,
           history: list[dict] | None = None) -> dict:
    """The verdict from per-item (candidate, champion) rows: every rule with its numbers.

    A row has suite, id, correct (None: unjudged), format, tool_ok and tokens; `solved` holds the
    (suite, id) of the forgetting set; `contaminated` the items found in the training data.
    `margins`: {suite: (its environment in words, its max_regression)}; default: each suite its
    own environment, with an environment's default max_regression.
    """
    margins = margins or {c["suite"]: (c["suite"], cfg.EnvironmentSpec().max_regression)
                          for c, _ in pairs}
    history = history or []  # the earlier cycles' decisions (data/gate_history.jsonl)
    earlier = [bool(h["passed"]) for h in history]
    level = sequential_level(config, history)
    judged = [(c, h) for c, h in pairs if c["correct"] is not None and h["correct"] is not None]

    def arrays(rows, key):
        if key == "suspect":  # champion scores written before the hacking guard have none
            return (np.array([c.get(key) or 0.0 for c, _ in rows], dtype=float),
                    np.array([h.get(key) or 0.0 for _, h in rows], dtype=float))
        return (np.array([c[key] for c, _ in rows], dtype=float),
                np.array([h[key] for _, h in rows], dtype=float))

    suites_out, shapes, observed = {}, {}, {}
    for name in dict.fromkeys(c["suite"] for c, _ in pairs):
        rows = [(c, h) for c, h in judged if c["suite"] == name]
        primary = name == config.primary
        threshold = config.min_improvement if primary else margins[name][1]
        scores = arrays(rows, "correct")
        shapes[name] = {"items": len(rows), "margin": margins[name][1],
                        "graded": not np.isin(np.concatenate(scores), (0.0, 1.0)).all()}
        if rows:  # this decision's discordance, beside the design's assumption
            observed[name] = float(((scores[0] - scores[1]) ** 2).mean())
        out = suites_out[name] = {
            "role": "primary" if primary else "guard", "environment": margins[name][0],
            "unjudged": sum(c["suite"] == name for c, _ in pairs) - len(rows),
            **compare(name, *scores, config, seed, threshold=threshold, primary=primary,
                      level=level if primary else None)}
        if rows:  # the smallest change this suite detects at 80% power, this cycle
            out["detectable_change"] = round(detectable(*scores, config.alpha), 4)
        if not primary and rows and out["detectable_change"] > threshold:
            out["underpowered"] = True
            note = (f"underpowered: with {len(rows)} items it detects a change of "
                    f"{out['detectable_change']:.3f} at 80% power, more than its max_regression "
                    f"{threshold}")
            if config.underpowered == "skip" and not out["passed"]:
                out.update(passed=True, skipped=True,
                           reason=f"{out['reason']}; {note}: skipped (gate.underpowered: skip)")
            else:
                out["reason"] = f"{out['reason']} ({note})"
    kept = [(c, h) for c, h in judged if (c["suite"], c["id"]) in solved]
    if len(kept) < config.forgetting_min_items:  # a handful of items makes a meaningless interval
        forgotten = {"passed": True, "skipped": True, "items": len(kept),
                     "reason": f"forgetting: {len(kept)} items earlier champions solved, fewer "
                               f"than gate.forgetting_min_items={config.forgetting_min_items}: "
                               f"skipped"}
    else:
        forgotten = compare("forgetting", *arrays(kept, "correct"), config, seed,
                            threshold=config.forgetting_max_regression, primary=False)
    # the decision's design: its power for gate.min_detectable, the items each suite needs
    plan = design(config, shapes, len(kept), level)
    if kept:
        a, b = arrays(kept, "correct")
        observed["forgetting"] = float(((a - b) ** 2).mean())
    for name, value in observed.items():
        if name in plan["suites"]:
            plan["suites"][name]["observed_discordance"] = round(value, 4)
    forgotten["lost"] = sorted(f"{c['suite']}/{c['id']}" for c, h in kept
                               if h["correct"] == 1 and c["correct"] == 0)[:20]
    # each guard in each suite (environment) apart, with the same margin: pooled, one
    # environment's regression hid behind another's gain (issue 46)
    limits = {"length": config.max_length_increase, "format": config.max_format_regression,
              "tool_ok": config.max_tool_error_regression, "hacking": config.max_hack_increase}
    guards: dict[str, dict[str, dict]] = {guard: {} for guard in GUARDS}
    for name in suites_out:
        everything = [(c, h) for c, h in pairs if c["suite"] == name]
        rows = [(c, h) for c, h in judged if c["suite"] == name]
        where = f"environment {margins[name][0]}"
        for guard, (words, key, growth) in GUARDS.items():
            guards[guard][name] = {
                "environment": margins[name][0],
                **compare(f"{guard} ({words}) in {where}",
                          *arrays(everything if key == "tokens" else rows, key), config, seed,
                          threshold=limits[guard], primary=False,
                          relative=key == "tokens", lower_is_better=growth,
                          # the protocol guards watch for a break, not a suite's score: on a
                          # 10-item suite no test could show a format unchanged within 0.1
                          score_test=False)}
    contamination = {"passed": not contaminated, "items": contaminated,
                     "reason": (f"contamination: {len(contaminated)} benchmark items appear in "
                                f"the candidate's training data: {', '.join(contaminated[:10])}"
                                f"{' ...' if len(contaminated) > 10 else ''} (an item trained on no "
                                f"longer measures anything, and the replay buffer keeps it: replace "
                                f"those items in the benchmark files, by hand or with `offseason "
                                f"benchmark refresh` once validate.holdout_fraction holds tasks "
                                f"out; a benchmark file that is also a task file fails every cycle)")
                     if contaminated
                     else "contamination: no benchmark item in the training data"}
    checks = {**{f"suite {n}": s for n, s in suites_out.items()}, "forgetting": forgotten,
              **{f"guard {g} {n}": r for g, per in guards.items() for n, r in per.items()},
              "contamination": contamination}
    failures = [c["reason"] for c in checks.values() if not c["passed"]]
    passed = not unchanged and not failures
    main = suites_out[config.primary]
    if unchanged:
        reason = "the candidate is the champion unchanged (nothing was trained)"
    elif passed:
        reason = main["reason"].split(": ", 1)[1] + "; every guard held"
    else:
        reason = "; ".join(failures)
    primary_test = main.get("test", "paired t-test, one-sided")
    rule = (f"pass when suite '{config.primary}' shows the candidate better than the champion "
            f"({primary_test}"
            f"{'' if primary_test.startswith('exact') else f', above {config.min_improvement}'}"
            f"), no guard suite's one-sided lower bound is below minus its max_regression, the "
            f"forgetting guard holds, the reward-hacking guards hold in every environment apart "
            f"and no benchmark item is in the training data; each test is one-sided at alpha "
            f"{config.alpha}: a candidate no better than the champion is promoted at most "
            f"{config.alpha:.0%} of the time per decision"
            + (f"; across cycles {SEQUENTIAL_NAMES.get(config.sequential)} sets the primary's "
               f"level ({level:.4g} at decision {len(history) + 1}), so that false promotions "
               f"stay at most {config.alpha:.0%} of all promotions over the years"
               if config.sequential != "none" else ""))
    return {"passed": bool(passed), "candidate_score": main.get("candidate", 0.0),
            "champion_score": main.get("champion", 0.0),
            "difference": main.get("difference", 0.0), "interval": main.get("interval"),
            "alpha": config.alpha, "test": main.get("test"), "items": main["items"],
            "sequence": {"method": config.sequential, "decision": len(history) + 1,
                         "level": round(level, 6), "p_value": main.get("p_value"),
                         "earlier_passes": sum(earlier),
                         # each decision at no real improvement promotes with at most its level
                         "expected_false_passes_at_most": round(
                             sum(h["level"] for h in history) + level, 4)},
            "benchmark": f"{config.primary}.jsonl", "primary": config.primary,
            "rule": rule, "reason": reason, "failures": failures, "unchanged": unchanged,
            "suites": suites_out, "forgetting": forgotten, "guards": guards,
            "contamination": contamination, "design": plan,
            "first_cycle_rule": "generation 0 is scored like any champion: no pass by default; "
                                "the forgetting guard is skipped until earlier champions solved "
                                "gate.forgetting_min_items items"}


def main(argv: list[str] | None = None) -> None:
    """Gate the candidate against the champion (the DVC stage's command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("candidate", "champion_scores", "forgetting", "rewards", "replay", "items",
                 "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--history", type=Path, help="data/gate_history.jsonl: every cycle's "
                        "decision, for error control across cycles (gate.sequential)")
    parser.add_argument("--params", default="params.yaml")
    from stages.envs import judge

    # an answer given as the champion gave it is not judged again
    judge.cache_arguments(parser, "data/gate_judgments", "data/champion_judgments")
    args = parser.parse_args(argv)
    io.watch_gpus()  # per GPU busy seconds, peak memory (the cost ledger); none: nothing

    # an environment's reward calls the held-out judge here
    judge.for_benchmarks(args.judgments, tuple(args.judged_before))
    verdict = run(cfg.load("base", args.params), cfg.load("gate", args.params), args.candidate,
                  args.champion_scores, args.forgetting, args.rewards, args.replay, args.items,
                  cfg.environments(args.params), cfg.load("rollout", args.params),
                  Path(args.params).resolve().parent, args.history)
    io.write_metrics(args.metrics, {**verdict, **judge.spent()})
    print(f"gate: candidate {verdict['candidate_score']:.3f} vs champion "
          f"{verdict['champion_score']:.3f} -> {'PASS' if verdict['passed'] else 'FAIL'} "
          f"({verdict['reason']})", file=sys.stderr)


if __name__ == "__main__":
    with io.explained("gate"):
        main()
    io.exit_soon()
