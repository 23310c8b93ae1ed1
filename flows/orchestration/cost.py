"""What a cycle cost: the ledger, `metrics/cost.json`, from the stages' own metrics; what the
next one will cost (`offseason estimate`), and whether a budget allows it.

Reads the `resources` and counted units (tokens, episodes, judge requests) each stage writes into
its metrics, params.yaml's `cost:` rates and the committed ledgers; writes `metrics/cost.json`
(stages DVC skipped listed as `reused`). `offseason history` reads the committed ledgers;
`estimate` fits each stage's cost to the work that drives it; `budget_refusal` says why a cycle
may not start.

Details: docs/costs.md, "How the ledger and the estimate are computed (flows/orchestration/cost.py)".
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path

from stages import budget as budgets
from stages.budget import price
from stages.config import CYCLE, Budget, Cost

STAGES = CYCLE  # in the order they run
EXACT = ["prompt_tokens", "generated_tokens", "served_tokens", "tool_calls", "trained_tokens",
         "loss_tokens", "judge_requests", "judge_tokens", "judge_prompt_tokens", "judge_completion_tokens"]
MEASURED = ["wall_seconds", "cpu_seconds", "gpu_busy_seconds"]
SUMMED = ["wall_seconds", "cpu_seconds", "gpu_seconds", "gpu_busy_seconds", *EXACT, "usd"]


def stage_row(metrics: dict, gpus: int, prices: Cost) -> dict:
    """One stage's units and dollars from its metrics. Its GPUs are those NVML saw it hold
    (`resources.gpus`), else `gpus`; each is paid for the stage's wall time (`gpu_seconds`),
    busy or not; `gpu_busy_seconds` is how much of it a kernel ran (sampled).
    """
    used = metrics.get("resources") or {}
    judges = metrics.get("judges") or []
    seen = used.get("gpus")
    count = len(seen) if seen is not None else gpus
    wall = used.get("wall_seconds", 0.0)
    row = {"wall_seconds": wall, "cpu_seconds": used.get("cpu_seconds", 0.0),
           "max_rss_mb": used.get("max_rss_mb"), "gpu_count": count,
           "gpu_seconds": round(count * wall, 3),
           # None where the GPUs were counted but not sampled (no NVML: stages/io.py HeldGpus)
           "gpu_busy_seconds": round(sum(g["busy_seconds"] or 0.0 for g in seen or []), 3),
           "prompt_tokens": int(metrics.get("prompt_tokens") or 0),
           "generated_tokens": int(metrics.get("generated_tokens") or 0),
           "tool_calls": int(metrics.get("tool_calls") or 0),
           "trained_tokens": int(metrics.get("trained_tokens") or 0),
           "loss_tokens": int(metrics.get("loss_tokens") or 0),
           "judge_requests": sum(j.get("requests", 0) for j in judges),
           "judge_tokens": sum(j.get("tokens", 0) for j in judges),
           "judge_prompt_tokens": sum(j.get("prompt_tokens", 0) for j in judges),
           "judge_completion_tokens": sum(j.get("completion_tokens", 0) for j in judges)}
    if seen:
        row["gpus"] = seen
    if isinstance(metrics.get("environments"), dict):  # the rollout's, per environment
        row["environments"] = {
            name: {k: env[k] for k in ("episodes", "prompt_tokens", "generated_tokens",
                                       "tool_calls") if k in env}
            for name, env in metrics["environments"].items()}
    units = budgets.units_of(metrics)
    row["served_tokens"] = units["served_tokens"]
    if units["judge_tokens_by_model"]:
        row["judge_tokens_by_model"] = units["judge_tokens_by_model"]
    # each GPU at its own rate (cost.gpu_hour_usd_by_name), each judge model at its own
    row["usd"] = price({**row, "gpu_names": units["gpu_names"] if seen else [],
                        "judge_tokens_by_model": units["judge_tokens_by_model"]}, prices)
    return row


def ledger(metrics: dict[str, dict], reran: dict[str, bool], prices: Cost,
           gpus: int = 0) -> dict:
    """The cycle's ledger from its stages' metrics: per stage and in total, units and dollars."""
    stages, total = {}, dict.fromkeys(SUMMED, 0)
    for name in STAGES:
        if name not in metrics:
            continue
        if not reran.get(name, False):
            stages[name] = {"reused": True}
            continue
        row = stages[name] = stage_row(metrics[name], gpus, prices)
        for key in total:
            total[key] += row[key]
    total = {k: round(v, 6) if isinstance(v, float) else v for k, v in total.items()}
    return {"stages": stages, "total": total, "gpus": gpus,
            "prices": dataclasses.asdict(prices),
            "exact": EXACT, "measured": MEASURED + ["max_rss_mb", "gpus"],
            "how": "tokens, tool calls and judge requests are counted exactly from the rollouts' "
                   "token ids, the training batches and the judge's usage; seconds, memory and "
                   "GPU utilisation are measured (GPU: NVML sampled every 0.5 s) and vary run "
                   "to run; gpu_seconds are the GPUs held for the stage's wall time; sandbox "
                   "time is not counted apart: its processes are the reward stage's children, "
                   "inside its cpu_seconds"}


def gain_per_dollar(root: Path, spent: dict, verdict: dict) -> dict:
    """This cycle's gain per dollar, for its ledger and its MLflow run: the primary suite's gain
    over the champion it was gated against (`points`, pass@1 points), per dollar the cycle cost
    (`points_per_usd`; None when it cost nothing at these prices), and the spend of every
    committed cycle with a ledger plus this one (`cumulative_usd`: rejected cycles cost too).
    Not in gate.json: the gate stage writes that (a DVC output) before the cycle is priced.
    """
    from flows.project.workspace import generations, read_at

    usd = spent["total"]["usd"]
    candidate, champion = verdict.get("candidate_score"), verdict.get("champion_score")
    points = None if candidate is None or champion is None else round(100 * (candidate - champion), 3)
    before = sum(((read_at(root, f"gen-{g}", "metrics/cost.json") or {}).get("total") or {})
                 .get("usd") or 0.0 for g in generations(root) if g >= 1)
    return {"points": points,
            "points_per_usd": round(points / usd, 2) if points is not None and usd > 0 else None,
            "cumulative_usd": round(before + usd, 6)}


def per_dollar(rows: list[dict]) -> None:
    """Add `cost_usd` (the cycle's), `cumulative_usd` and `points_per_usd` (the primary suite's
    gain over the champion it faced, in points, per dollar of its cycle) to history rows.
    """
    spent = 0.0
    for row in rows:
        usd = row.get("cost_usd")
        if usd is None:
            row["cumulative_usd"], row["points_per_usd"] = (round(spent, 6) if spent else None,
                                                           None)
            continue
        spent += usd
        row["cumulative_usd"] = round(spent, 6)
        gain = None if row.get("score") is None or row.get("champion_score") is None else \
            100 * (row["score"] - row["champion_score"])
        row["points_per_usd"] = round(gain / usd, 2) if gain is not None and usd > 0 else None


ESTIMATES: dict[str, dict] = {}  # repo root -> the estimate `offseason run` made before its cycle

# What drives each stage's work, known before the cycle runs: its cost is fixed + rate x driver
DRIVERS = {"ingest": "inbox_lines", "validate": "inbox_lines", "rollout": "episodes",
           "reward": "episodes", "train": "example_epochs", "champion_scores": "runs",
           "gate": "runs"}
ESTIMATED = ["cpu_seconds", "gpu_seconds", "judge_tokens"]


def _yaml_at(root: Path, ref: str, path: str) -> dict:
    import yaml

    from flows.project.workspace import run

    out = run(["git", "show", f"{ref}:{path}"], root, check=False)
    return (yaml.safe_load(out.stdout) or {}) if out.returncode == 0 else {}


def _epochs(params: dict) -> float:
    train = params.get("train") or {}
    algorithm = train.get("algorithm", "sft")
    default = {"sft": 8, "dpo": 3, "grpo": 4}.get(algorithm, 1)
    return float((train.get(algorithm) or {}).get("epochs", default))


def committed_cycles(root: Path, last: int = 3) -> list[dict]:
    """The last `last` committed cycles with a ledger (tags gen-N, N >= 1): per cycle its tag,
    date, ledger, the drivers of its stages' work, and the ratios the estimate carries over.
    """
    from flows.project.workspace import generations, git, read_at

    found = []
    for generation in reversed(generations(root)):
        if generation == 0 or len(found) == last:
            continue
        tag = f"gen-{generation}"
        spent = read_at(root, tag, "metrics/cost.json")
        if not spent or "stages" not in spent:
            continue
        ingest = read_at(root, tag, "metrics/ingest.json") or {}
        roll = read_at(root, tag, "metrics/rollout.json") or {}
        train = read_at(root, tag, "metrics/train.json") or {}
        examples = (train.get("examples") or 0) + (train.get("replayed") or 0)
        found.append({
            "tag": tag, "date": git(root, "log", "-1", "--format=%cI", tag), "ledger": spent,
            "drivers": {"inbox_lines": ingest.get("rows_read") or 0,
                        "episodes": roll.get("episodes") or 0,
                        "example_epochs": examples * _epochs(_yaml_at(root, tag, "params.yaml"))
                        if train.get("trained") else 0, "runs": 1},
            "tasks_per_line": (roll.get("tasks") or 0) / ingest["rows_read"]
            if ingest.get("rows_read") else None,
            "examples_per_episode": (train.get("examples") or 0) / roll["episodes"]
            if roll.get("episodes") else None,
            "replay_next": (train.get("replay_available") or 0) + (train.get("examples") or 0),
            "trained": bool(train.get("trained"))})
    return list(reversed(found))


def waiting_lines(root: Path) -> int:
    """Non-empty lines of the inbox files not yet ingested (not in data/traces/manifest.json):
    the traces (or, for span formats, records) the next cycle reads.
    """
    manifest = root / "data" / "traces" / "manifest.json"
    done = set(json.loads(manifest.read_text())) if manifest.exists() else set()
    lines = 0
    for path in sorted((root / "data" / "inbox").glob("*")):
        if path.is_file() and path.name not in done and not path.name.startswith("."):
            if path.suffix == ".gz":
                import gzip

                with gzip.open(path, "rt", errors="replace") as handle:
                    lines += sum(1 for line in handle if line.strip())
            else:
                with path.open("rb") as handle:
                    lines += sum(1 for line in handle if line.strip())
    return lines


def _champion_changed(root: Path) -> bool:
    """Whether models/champion differs from what champion_scores last scored (dvc.lock), so
    that stage reruns next cycle.
    """
    import yaml

    pointer, lock = root / "models" / "champion.dvc", root / "dvc.lock"
    if not pointer.exists() or not lock.exists():
        return True
    current = (yaml.safe_load(pointer.read_text()).get("outs") or [{}])[0].get("md5")
    deps = ((yaml.safe_load(lock.read_text()) or {}).get("stages", {})
            .get("champion_scores", {}).get("deps", []))
    return next((d.get("md5") for d in deps if d.get("path") == "models/champion"), None) \
        != current


def rerun_stages(root: Path) -> tuple[set[str], list[str]]:
    """The stages the next cycle reruns when no traces are waiting, and why: what differs from
    the last committed cycle's inputs (`inputs_fingerprint`, the environments' note made afresh:
    a module edited since is seen before the cycle notes it). A changed environment module or
    stage code reruns every stage after ingest; changed params those whose dvc.yaml params
    differ, and every stage after them (champion_scores only for its own, or a new champion).
    """
    import yaml

    from flows.orchestration.pipeline import CHANGES, changed_inputs
    from flows.project.workspace import note_environments

    note_environments(root)  # as the cycle does first: the same note, written when it changed
    keys = [key for key in changed_inputs(root) if key != "inbox"]
    changed = set()
    if "environments" in keys or "code" in keys:
        changed = set(STAGES) - {"ingest"}
    elif keys:  # params.yaml: the stages whose own params differ, then what follows them
        now = yaml.safe_load((root / "params.yaml").read_text()) or {}
        before = _yaml_at(root, "HEAD", "params.yaml")
        stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}

        def value(params: dict, key: str):
            for part in key.split("."):
                params = params.get(part) if isinstance(params, dict) else None
            return params

        def differs(name: str) -> bool:  # one of the stage's dvc.yaml params has another value
            keys = [k for entry in (stages.get(name) or {}).get("params") or []
                    for k in (entry if isinstance(entry, dict) else [entry])]
            return any(value(now, key) != value(before, key) for key in keys)

        first = next((i for i, name in enumerate(STAGES) if differs(name)), None)
        if first is not None:
            changed = {n for n in STAGES[first:] if n != "champion_scores"}
            changed |= {"champion_scores"} if differs("champion_scores") else set()
    if changed and "champion_scores" not in changed and _champion_changed(root):
        changed.add("champion_scores")
    return changed, [CHANGES[key] for key in keys]


def predict(points: list[tuple[float, float]], units: float) -> list[float]:
    """[low, estimate, high] of a cost at `units` from earlier (units, cost) points: a fixed
    part (a stage's process start-up: imports, model loading) plus a rate per unit, the line
    through the points by least squares (a slope below 0: a fixed cost alone; a fixed part below
    0, or units too alike to tell the parts apart: a rate alone). The range: the points' own
    spread around that line.
    """
    if not points:
        return [0.0, 0.0, 0.0]
    us, cs = [u for u, _ in points], [c for _, c in points]
    mean_u, mean_c = sum(us) / len(us), sum(cs) / len(cs)
    fixed, rate = 0.0, sum(cs) / sum(us)
    if len(points) > 1 and max(us) - min(us) >= 0.1 * max(us):
        slope = sum((u - mean_u) * (c - mean_c) for u, c in points) / sum(
            (u - mean_u) ** 2 for u in us)
        if slope <= 0:  # no growth with the units beyond the noise: a fixed cost
            fixed, rate = mean_c, 0.0
        elif mean_c - slope * mean_u >= 0:
            fixed, rate = mean_c - slope * mean_u, slope
    middle = fixed + rate * units
    residuals = [c - (fixed + rate * u) for u, c in points]
    return [round(max(0.0, middle + min(residuals)), 3), round(middle, 3),
            round(max(0.0, middle + max(residuals)), 3)]


def estimate(root: Path, configs: dict, last: int = 3) -> dict:
    """The next cycle's units and dollars (see the module docstring), or, without a committed
    cycle to learn rates from, `status: no-history` and what it needs.
    """
    cycles = committed_cycles(root, last)
    lines = waiting_lines(root)
    if not cycles:
        return {"status": "no-history", "inbox_lines": lines,
                "made_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "message": "no committed cycle with a ledger yet (metrics/cost.json at a gen-N "
                           "tag), so no per-unit costs to go by; run one cycle (`offseason run`): "
                           "from then on the estimate uses the last cycles' rates "
                           f"({lines} inbox lines are waiting)"}
    rollout, train = configs["rollout"], configs["train"]
    if not lines:  # no traces waiting: a cycle for a changed module, stage code or params
        rerun, reasons = rerun_stages(root)
        # the stages rerun on what the last cycle read, so at its units
        drivers = dict(cycles[-1]["drivers"]) if rerun else \
            {"inbox_lines": 0, "episodes": 0, "example_epochs": 0, "runs": 0}
        return _priced(cycles, drivers, {name: name in rerun for name in STAGES},
                       configs, trains=cycles[-1]["trained"], reasons=reasons)
    mean = lambda values: sum(values) / len(values) if values else 0.0  # noqa: E731
    tasks = lines * mean([c["tasks_per_line"] for c in cycles if c["tasks_per_line"] is not None])
    if rollout.max_tasks:
        tasks = min(tasks, rollout.max_tasks)
    episodes = round(tasks) * rollout.samples_per_task
    examples = episodes * mean([c["examples_per_episode"] for c in cycles
                                if c["examples_per_episode"] is not None])
    replayed = train.replay_fraction * cycles[-1]["replay_next"]
    trains = examples + replayed >= train.min_examples
    drivers = {"inbox_lines": lines, "episodes": episodes,
               "example_epochs": round((examples + replayed) * train.method.epochs, 1)
               if trains else 0, "runs": 1}
    reruns = {name: True for name in STAGES} | {"champion_scores": _champion_changed(root)}
    return _priced(cycles, drivers, reruns, configs, trains)


def _priced(cycles: list[dict], drivers: dict, reruns: dict[str, bool], configs: dict,
            trains: bool, reasons: list[str] | None = None) -> dict:
    """The estimate of the stages in `reruns` at `drivers`' units, fitted to `cycles`."""
    stages, total = {}, {key: [0.0, 0.0, 0.0] for key in ESTIMATED}
    for name in STAGES:
        driver = DRIVERS[name]
        if not reruns.get(name, True):
            stages[name] = {"reused": True}
            continue
        points = [(cycle["drivers"][driver], cycle["ledger"]["stages"][name])
                  for cycle in cycles
                  if not (cycle["ledger"]["stages"].get(name) or {"reused": True}).get("reused")
                  and cycle["drivers"][driver]]
        # a train stage that wrote the champion unchanged (too few examples) costs its fixed part
        units = drivers[driver] if name != "train" or trains else 0
        row = {"driver": driver, "units": units, "cycles": len(points)}
        for key in ESTIMATED:
            row[key] = predict([(u, r.get(key, 0) or 0) for u, r in points], units)
            for i in range(3):
                total[key][i] += row[key][i]
        stages[name] = row
    prices = configs["cost"]
    total = {key: [round(v, 3) for v in values] for key, values in total.items()}
    total["usd"] = [price({key: total[key][i] for key in ESTIMATED}, prices) for i in range(3)]
    return {"status": "ok", "made_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "from": [c["tag"] for c in cycles], "drivers": drivers, "stages": stages,
            **({"reasons": reasons} if reasons is not None else {}),
            "total": total, "gpu_hours": [round(v / 3600, 4) for v in total["gpu_seconds"]],
            "range": "low, estimate, high: per stage a fixed part plus a rate per unit, fitted "
                     "to the cycles in `from`, at this cycle's units; low and high: those "
                     "cycles' own spread around the fit"}


def budget_refusal(root: Path, guess: dict, budget: Budget) -> str | None:
    """Why a cycle of this estimate may not start under `budget`, or None."""
    if guess.get("status") != "ok":
        return None
    total = guess["total"]
    over = []
    if budget.max_usd and total["usd"][1] > budget.max_usd:
        over.append(f"budget.max_usd={budget.max_usd:g}: estimated ${total['usd'][1]:.4f}")
    if budget.max_gpu_hours and guess["gpu_hours"][1] > budget.max_gpu_hours:
        over.append(f"budget.max_gpu_hours={budget.max_gpu_hours:g}: estimated "
                    f"{guess['gpu_hours'][1]:.3f} GPU hours")
    if budget.max_judge_tokens and total["judge_tokens"][1] > budget.max_judge_tokens:
        over.append(f"budget.max_judge_tokens={budget.max_judge_tokens}: estimated "
                    f"{total['judge_tokens'][1]:.0f} judge tokens")
    if budget.monthly_usd:
        spent, tags = budgets.month_spent(root)
        if spent + total["usd"][1] > budget.monthly_usd:
            over.append(f"budget.monthly_usd={budget.monthly_usd:g}: ${spent:.4f} spent this "
                        f"month ({', '.join(tags) or 'no cycle'}) + estimated "
                        f"${total['usd'][1]:.4f}")
    if not over:
        return None
    return (f"this cycle's estimate is over budget ({'; '.join(over)}); nothing was started. "
            f"Raise the budget in params.yaml, or make the cycle smaller "
            f"(rollout.samples_per_task, train epochs, fewer traces in data/inbox). "
            f"The estimate:\n{format_estimate(guess)}")


def format_estimate(guess: dict) -> str:
    """The estimate as a table for people."""
    if guess.get("status") != "ok":
        return guess["message"]
    drivers = guess["drivers"]
    lines = [f"estimate of the next cycle from {', '.join(guess['from'])} "
             f"(low / estimate / high)",
             f"  {drivers['inbox_lines']} inbox lines waiting -> about {drivers['episodes']} "
             f"episodes, {drivers['example_epochs']:g} trained example-epochs"
             if not guess.get("reasons") else
             f"  no inbox lines waiting, but {'; '.join(guess['reasons'])}: the stages rerun on "
             f"the last cycle's traces, about {drivers['episodes']} episodes, "
             f"{drivers['example_epochs']:g} trained example-epochs",
             f"  {'stage':<16}{'units':>10} {'of':<15}{'CPU s':>22}{'GPU s':>26}"]
    for name, row in guess["stages"].items():
        if row.get("reused"):
            lines.append(f"  {name:<16}{'reused (unchanged inputs)':>40}")
            continue
        fmt = lambda v: f"{v[0]:.1f} / {v[1]:.1f} / {v[2]:.1f}"  # noqa: E731
        lines.append(f"  {name:<16}{row['units']:>10g} {row['driver']:<15}"
                     f"{fmt(row['cpu_seconds']):>22}{fmt(row['gpu_seconds']):>26}")
    total = guess["total"]
    lines.append(f"  total CPU seconds {total['cpu_seconds'][0]:.1f} / "
                 f"{total['cpu_seconds'][1]:.1f} / {total['cpu_seconds'][2]:.1f}; GPU hours "
                 f"{guess['gpu_hours'][0]:.3f} / {guess['gpu_hours'][1]:.3f} / "
                 f"{guess['gpu_hours'][2]:.3f}; judge tokens {total['judge_tokens'][1]:.0f}")
    lines.append(f"  dollars ${total['usd'][0]:.4f} / ${total['usd'][1]:.4f} / "
                 f"${total['usd'][2]:.4f} (params.yaml cost:)")
    return "\n".join(lines)
