"""The production gate: a canary generation against the stable one, on live traffic.

After a promotion with `runtime.fleet.canary`, some replicas serve the new generation (the
canary) and the rest the one before (stable). Every trace ingested since is attributed to the
arm that answered it by the model name its responses carry (the trace's `model`: OpenAI logs'
`model`, OTel's `gen_ai.response.model`): vLLM answers with the first name it serves, so each
replica started with a name of its own first (`--served-model-name policy-a policy`) is told
apart while agents keep calling `policy` (`weights.response_name`). A trace counts only when
its `created_at` falls after the canary was verified (before, a canary replica still served the
stable generation); one with no time, or a name of no replica, is counted and left out.

Once `runtime.fleet.bake` traces are in on each arm, each trace is measured:
- `reward`: the environments' own verdict on the live conversation: the first environment
  whose `task_from_trace` claims it (params.yaml order), its `reward(task, messages)` on the
  messages as logged (None: cannot judge, left out; environments that call the LLM judge are
  left to the cycle's reward stage);
- `thumbs`: the user's rating, where there is one;
- `errors`: whether the run recorded an error (`feedback.error`: a failed tool or agent step);
- `length`: the characters of the assistant's turns (reported, not decided on: shorter is not
  better or worse by itself).
Live traffic gives no pairs (each request was answered by one arm only), so where the
benchmark gate pairs items, this gate compares two independent samples: Welch's t-test,
one-sided, per measure, at `gate.alpha` split over the measures compared (Bonferroni). The
canary fails when any measure shows it worse (a lower reward or thumbs rate, a higher error
rate); it passes otherwise: it already passed the benchmark gate, and this one is there to
catch what the benchmark missed. A measure with fewer than 2 values on an arm is skipped.

Reads the ingested traces (`data/traces/part-*.parquet`), writes nothing. The fleet
(flows/orchestration/fleet.py) acts on the verdict: `offseason fleet judge`.
"""

from __future__ import annotations

import json
import math
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from stages import config as cfg

ARMS = ("canary", "stable")
COLUMNS = ["trace_id", "model", "created_at", "messages", "tools", "feedback", "thumbs_up"]
# measure: whether higher is better (decided), or None (reported only)
MEASURES = {"reward": True, "thumbs": True, "errors": False, "length": None}


def read_traces(traces: Path, models: list[str] | None = None) -> list[dict]:
    """The ingested traces (every `part-*.parquet` of `data/traces/`), the columns this gate
    reads, as dicts; with `models`, only the traces answered under those names.
    """
    rows = []
    where = [("model", "in", models)] if models else None
    for part in sorted(Path(traces).glob("part-*.parquet")):
        rows.extend(pq.read_table(part, columns=COLUMNS, filters=where).to_pylist())
    return rows


def _time(value) -> datetime | None:
    try:
        stamp = datetime.fromisoformat(str(value))
    except (TypeError, ValueError):
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)


def attribute(rows: list[dict], names: dict[str, list[str]], since: str) -> tuple[dict, dict]:
    """The traces of each arm: {arm: [rows]}, and the counts of those left out
    ({"before": created before `since`, "untimed": no created_at, "unknown": a model name of
    no arm}). `names`: {arm: the model names its replicas answer with}.
    """
    start = _time(since)
    arm_of = {name: arm for arm in ARMS for name in names[arm]}
    arms, left = {arm: [] for arm in ARMS}, {"before": 0, "untimed": 0, "unknown": 0}
    for row in rows:
        arm = arm_of.get(row.get("model"))
        if arm is None:
            left["unknown"] += 1
            continue
        created = _time(row.get("created_at"))
        if created is None:
            left["untimed"] += 1
        elif created < start:
            left["before"] += 1
        else:
            arms[arm].append(row)
    return arms, left


def _assistant_text(messages: list[dict]) -> str:
    from stages.envs.contract import text_of

    return "".join(text_of(m.get("content")) for m in messages if m.get("role") == "assistant")


def measure(rows: list[dict], envs: dict) -> dict[str, list[float]]:
    """Each measure's values over `rows` (see the module's docstring); `envs`: the loaded
    environments, {name: Environment}, in params.yaml order. Returns {measure: [values]},
    `unjudged`: the number of traces no environment could score, and `verifier_errors`: those
    whose reward raised (the verifier broke: left out and counted, never a score of zero).
    """
    from stages.envs import contract

    out = {name: [] for name in MEASURES}
    unjudged = broke = 0
    router = contract.Router({n: e for n, e in envs.items() if not e.judged})
    for row in rows:
        messages = json.loads(row["messages"]) if row.get("messages") else []
        tools = json.loads(row["tools"]) if row.get("tools") else None
        feedback = json.loads(row["feedback"]) if row.get("feedback") else {}
        task = router.task_of(messages, tools)
        scores, broken = None, False
        if task is not None:
            task = json.loads(task)
            try:
                scores = contract.score(envs[task["environment"]], task, messages)
            except Exception:  # noqa: BLE001 - a verifier that broke is no verdict on the arm
                broken = True
        if scores is not None:
            out["reward"].append(contract.mean(scores))
        elif broken:
            broke += 1
        else:
            unjudged += 1
        if row.get("thumbs_up") is not None:
            out["thumbs"].append(float(row["thumbs_up"]))
        out["errors"].append(float(bool((feedback or {}).get("error"))))
        out["length"].append(float(len(_assistant_text(messages))))
    return {**out, "unjudged": unjudged, "verifier_errors": broke}


def worse(canary: np.ndarray, stable: np.ndarray, higher_is_better: bool) -> float:
    """The one-sided p-value of Welch's t-test that the canary is worse than the stable arm
    (a lower mean where higher is better, a higher one otherwise). Two constant arms: 0 when
    the canary's value is the worse one, else 1.
    """
    from scipy.stats import ttest_ind

    if canary.var() == 0 and stable.var() == 0:
        gap = canary.mean() - stable.mean()
        return 0.0 if (gap < 0 if higher_is_better else gap > 0) else 1.0
    alternative = "less" if higher_is_better else "greater"
    with warnings.catch_warnings():  # one constant arm (all thumbs up): scipy's precision note
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(ttest_ind(canary, stable, equal_var=False, alternative=alternative).pvalue)
    return 1.0 if math.isnan(p) else p


def compare(values: dict[str, dict], alpha: float) -> dict:
    """The verdict from each arm's measures ({arm: measure's output}): per measure the means,
    counts, difference (canary - stable) and, where decided, Welch's p-value against the
    level; `passed` unless a decided measure shows the canary worse.
    """
    decided = [name for name, better in MEASURES.items() if better is not None
               and min(len(values[arm][name]) for arm in ARMS) >= 2]
    level = alpha / max(len(decided), 1)
    out, reasons = {}, []
    for name, better in MEASURES.items():
        canary, stable = (np.asarray(values[arm][name], dtype=float) for arm in ARMS)
        row = {"n": [int(len(canary)), int(len(stable))],
               "canary": round(float(canary.mean()), 4) if len(canary) else None,
               "stable": round(float(stable.mean()), 4) if len(stable) else None}
        if len(canary) and len(stable):
            row["difference"] = round(row["canary"] - row["stable"], 4)
        if name in decided:
            p = worse(canary, stable, better)
            row.update(p_value=round(p, 6), level=round(level, 6), worse=p < level,
                       test="Welch's t-test, one-sided")
            if row["worse"]:
                reasons.append(f"{name}: canary {row['canary']:.3f} vs stable "
                               f"{row['stable']:.3f} (n = {row['n'][0]}, {row['n'][1]}), "
                               f"p = {p:.4g} < {level:.4g}: worse on live traffic")
        elif better is not None:
            row["skipped"] = "fewer than 2 values on an arm"
        out[name] = row
    passed = not reasons
    reason = "; ".join(reasons) if reasons else (
        "no measure shows the canary worse (" + ", ".join(
            f"{n} {out[n]['canary']:.3f} vs {out[n]['stable']:.3f}" for n in decided) + ")"
        if decided else "nothing measured on both arms: no evidence against the canary")
    return {"passed": passed, "reason": reason, "alpha": alpha, "measures": out,
            "unjudged": {arm: values[arm]["unjudged"] for arm in ARMS},
            "verifier_errors": {arm: values[arm]["verifier_errors"] for arm in ARMS}}


def judge(root: Path, canary: dict, bake: int) -> dict:
    """The production gate's verdict on the canary record `canary` (flows/orchestration/
    fleet.py: `names`, `since`): `status` "baking" (fewer than `bake` traces on an arm, with
    the counts) or "passed" / "failed" with `compare`'s verdict.
    """
    rows = read_traces(root / "data" / "traces",
                       [name for arm in ARMS for name in canary["names"][arm]])
    arms, left = attribute(rows, canary["names"], canary["since"])
    counts = {arm: len(arms[arm]) for arm in ARMS}
    out = {"traces": counts, "left_out": left, "bake": bake}
    if min(counts.values()) < bake:
        return {**out, "status": "baking"}
    from stages.envs import contract

    specs = cfg.environments(root / "params.yaml")
    envs = {name: contract.load_spec(name, spec, root) for name, spec in specs.items()}
    values = {arm: measure(arms[arm], envs) for arm in ARMS}
    verdict = compare(values, cfg.load("gate", root / "params.yaml").alpha)
    return {**out, **verdict, "status": "passed" if verdict["passed"] else "failed"}
