"""What a cycle cost: the ledger, `metrics/cost.json`, from the stages' own metrics.

Each stage writes `resources` into its metrics (`stages.io.write_metrics`: wall and CPU seconds of
its process and children, peak memory; measured, so they vary run to run); the rollout counts the
tokens it generated, the reward stage its judge's requests and tokens. The ledger sums the stages
that ran in this cycle (a stage DVC skipped, because its inputs had not changed, was paid for in
an earlier cycle and is listed as `reused`), and prices the units with params.yaml's `cost:`
(per CPU-hour, per GPU-hour, per million judge tokens; with a rate of 0 the units still show).
`offseason history` reads the committed ledgers: each generation's cost, and its gain over the
champion it was gated against per dollar (rejected cycles cost too).

Not yet: GPU busy time and utilisation (NVML), trained-token counts, estimates before a cycle and
budgets that stop one (the cost issue).
"""

from __future__ import annotations

from dataclasses import dataclass

from stages import config as cfg

STAGES = ["ingest", "validate", "rollout", "reward", "train", "champion_scores", "gate"]


@dataclass(frozen=True)
class Cost:
    """`cost:`: prices, so the ledger reads in dollars too. Example rates; set your own."""

    cpu_hour_usd: float = 0.05  # one core for an hour (a cloud vCPU is about $0.02 to $0.05)
    gpu_hour_usd: float = 2.50  # one GPU for an hour (an H100 rents for about $2 to $4)
    judge_usd_per_million_tokens: float = 0.0  # the judge's price; 0: a local judge

    def __post_init__(self):
        """Refuse negative prices."""
        for key in ("cpu_hour_usd", "gpu_hour_usd", "judge_usd_per_million_tokens"):
            if getattr(self, key) < 0:
                raise cfg.ParamsError(f"cost.{key}: must be >= 0, got {getattr(self, key)}")


def ledger(metrics: dict[str, dict], reran: dict[str, bool], prices: Cost,
           gpus: int = 0) -> dict:
    """The cycle's ledger from its stages' metrics: per stage and in total, units and dollars."""
    stages, total = {}, {"wall_seconds": 0.0, "cpu_seconds": 0.0, "generated_tokens": 0,
                         "judge_requests": 0, "judge_tokens": 0, "usd": 0.0}
    for name in STAGES:
        if name not in metrics:
            continue
        if not reran.get(name, False):
            stages[name] = {"reused": True}
            continue
        used = metrics[name].get("resources") or {}
        judges = metrics[name].get("judges") or []
        row = {"wall_seconds": used.get("wall_seconds", 0.0),
               "cpu_seconds": used.get("cpu_seconds", 0.0),
               "max_rss_mb": used.get("max_rss_mb"),
               "generated_tokens": int(metrics[name].get("generated_tokens") or 0)
               if name == "rollout" else 0,
               "judge_requests": sum(j.get("requests", 0) for j in judges),
               "judge_tokens": sum(j.get("tokens", 0) for j in judges)}
        row["usd"] = round(row["cpu_seconds"] / 3600 * prices.cpu_hour_usd
                           + gpus * row["wall_seconds"] / 3600 * prices.gpu_hour_usd
                           + row["judge_tokens"] / 1e6 * prices.judge_usd_per_million_tokens, 6)
        stages[name] = row
        for key in total:
            total[key] += row[key]
    total = {k: round(v, 6) if isinstance(v, float) else v for k, v in total.items()}
    return {"stages": stages, "total": total, "gpus": gpus,
            "prices": {"cpu_hour_usd": prices.cpu_hour_usd, "gpu_hour_usd": prices.gpu_hour_usd,
                       "judge_usd_per_million_tokens": prices.judge_usd_per_million_tokens},
            "measured": "wall and CPU seconds are measured and vary run to run; tokens and "
                        "requests are counted exactly"}


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
