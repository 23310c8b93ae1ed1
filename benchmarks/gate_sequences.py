"""Error control across a year of cycles: gate.sequential's procedures compared on realistic sequences.

    .venv/bin/python benchmarks/gate_sequences.py                   # 2,000 years of exact p-values
    .venv/bin/python benchmarks/gate_sequences.py --decide 100      # and 100 years through gate.decide

A year is 52 weekly decisions on a 200-item pass/fail primary whose candidates answer 15 % of the
items differently from the champion. Most candidates are no better (`--null`, default 70 %); the
others improve pass@1 by 3 to 10 points, drawn uniformly. Each decision's p-value is the primary's
exact one-sided McNemar test (what `gate.decide` computes for a pass/fail primary); each procedure
(stages/gate.py `sequential_level`) sets the level from the earlier decisions. Printed per
procedure: the share of promotions that were false (FDR, the procedures' promise: at most alpha),
the share of all-null years with any false promotion, and the power (real improvements promoted),
at the first and last quarter of the year too: LORD++'s level falls as decisions pass.

With `--decide N`, N years also go through `gate.decide` itself (item rows generated, the verdict's
own p-value and level), to check that the stage's decisions are the ones simulated.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages import config as cfg  # noqa: E402
from stages import gate  # noqa: E402

ITEMS, DISAGREE, WEEKS = 200, 0.15, 52
METHODS = ("none", "lord", "saffron", "addis", "alpha-investing")  # the last: compared only


class AlphaInvesting:
    """Foster and Stine's alpha-investing (2008), compared here and not a gate.sequential choice:
    wealth alpha / 2 at the start; each decision bets `wealth / (1 + decisions since the last
    promotion)`, pays `level / (1 - level)` when it promotes nothing and earns alpha / 2 back on a
    promotion (mFDR at most alpha: wealth and payout within alpha times eta = 1/2).
    """

    def __init__(self, alpha: float):
        """A year's start: no decision yet."""
        self.alpha, self.wealth, self.since = alpha, alpha / 2, 0

    def level(self) -> float:
        """The next decision's level."""
        return self.wealth / (2 + self.since)

    def after(self, level: float, promoted: bool) -> None:
        """Pay for a decision made at `level`, or earn on a promotion."""
        if promoted:
            self.wealth, self.since = self.wealth + self.alpha / 2, 0
        else:
            self.wealth, self.since = self.wealth - level / (1 - level), self.since + 1


def truths(rng, null: float) -> list[float]:
    """A year's candidates' true improvements: 0 with probability `null`, else 3-10 points."""
    return [0.0 if rng.random() < null else float(rng.uniform(0.03, 0.10)) for _ in range(WEEKS)]


def p_value(rng, d: float) -> float:
    """The exact McNemar p-value of one decision whose candidate is truly better by `d`."""
    k = rng.binomial(ITEMS, DISAGREE)
    wins = rng.binomial(k, 0.5 + d / (2 * DISAGREE))
    return stats.binomtest(wins, k, 0.5, alternative="greater").pvalue if k else 1.0


def year(rng, method: str, truth: list[float], alpha: float = 0.05) -> list[tuple[float, bool]]:
    """A year of decisions under `method`: (true improvement, promoted) per week."""
    investing = AlphaInvesting(alpha) if method == "alpha-investing" else None
    config = cfg.Gate(sequential="none" if investing else method, alpha=alpha)
    history: list[dict] = []
    for d in truth:
        level = investing.level() if investing else gate.sequential_level(config, history)
        p = p_value(rng, d)
        history.append({"p_value": p, "passed": p < level})
        if investing:
            investing.after(level, p < level)
    return [(d, h["passed"]) for d, h in zip(truth, history)]


def summary(years: list[list[tuple[float, bool]]]) -> dict:
    """FDR (mean share of promotions that were false), power overall and by quarter."""
    fdp = [sum(p and d == 0 for d, p in y) / max(1, sum(p for _, p in y)) for y in years]
    real = [(i, p) for y in years for i, (d, p) in enumerate(y) if d > 0]
    early = [p for i, p in real if i < WEEKS // 4]
    late = [p for i, p in real if i >= WEEKS - WEEKS // 4]
    return {"fdr": float(np.mean(fdp)),
            "power": float(np.mean([p for _, p in real])) if real else 0.0,
            "power_first_quarter": float(np.mean(early)) if early else 0.0,
            "power_last_quarter": float(np.mean(late)) if late else 0.0,
            "promotions": float(np.mean([sum(p for _, p in y) for y in years]))}


def through_decide(rng, method: str, years: int, null: float) -> dict:
    """Years of decisions through gate.decide on generated pass/fail rows."""
    config = cfg.Gate(sequential=method, bootstrap_samples=100)
    out = []
    for _ in range(years):
        history: list[dict] = []
        truth = truths(rng, null)
        for d in truth:
            champion = (rng.random(ITEMS) < 0.55).astype(float)
            candidate = champion.copy()
            split = rng.random(ITEMS) < DISAGREE
            wins = rng.random(ITEMS) < 0.5 + d / (2 * DISAGREE)
            candidate[split], champion[split] = wins[split], 1 - wins[split]
            pairs = [({"suite": "arith", "id": f"t{i}", "correct": float(c), "tokens": 5,
                       "format": 1.0, "tool_ok": 1.0},
                      {"suite": "arith", "id": f"t{i}", "correct": float(h), "tokens": 5,
                       "format": 1.0, "tool_ok": 1.0})
                     for i, (c, h) in enumerate(zip(candidate, champion))]
            verdict = gate.decide(config, int(rng.integers(1 << 30)), pairs, set(), [], False,
                                  history=history)
            history.append({"p_value": verdict["sequence"]["p_value"],
                            "passed": verdict["passed"], "level": verdict["sequence"]["level"]})
        out.append([(d, h["passed"]) for d, h in zip(truth, history)])
    return summary(out)


def main() -> None:
    """Print the comparison table (and, with --decide, the same through gate.decide)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--years", type=int, default=2000, help="simulated years per procedure")
    parser.add_argument("--null", type=float, default=0.7, help="share of candidates no better")
    parser.add_argument("--decide", type=int, default=0,
                        help="also this many years through gate.decide per procedure")
    args = parser.parse_args()
    print(f"{args.years} years of {WEEKS} decisions, {ITEMS}-item pass/fail primary, "
          f"{DISAGREE:.0%} discordant, {args.null:.0%} of candidates no better, the rest +3 to "
          f"+10 points; alpha 0.05")
    print("| procedure | FDR | null years with a false promotion | power | first quarter | "
          "last quarter | promotions a year |")
    print("|---|---|---|---|---|---|---|")
    for method in METHODS:
        started = time.monotonic()
        rng = np.random.default_rng(1)
        mixed = summary([year(rng, method, truths(rng, args.null)) for _ in range(args.years)])
        nulls = [year(rng, method, [0.0] * WEEKS) for _ in range(args.years)]
        any_false = float(np.mean([any(p for _, p in y) for y in nulls]))
        print(f"| {method} | {mixed['fdr']:.3f} | {any_false:.3f} | {mixed['power']:.3f} | "
              f"{mixed['power_first_quarter']:.3f} | {mixed['power_last_quarter']:.3f} | "
              f"{mixed['promotions']:.1f} |  ({time.monotonic() - started:.0f} s)")
    if args.decide:
        print(f"\nthrough gate.decide, {args.decide} years each:")
        for method in METHODS[:-1]:  # gate.sequential's own
            got = through_decide(np.random.default_rng(2), method, args.decide, args.null)
            print(f"| {method} | FDR {got['fdr']:.3f} | power {got['power']:.3f} | first quarter "
                  f"{got['power_first_quarter']:.3f} | last quarter "
                  f"{got['power_last_quarter']:.3f} |")


if __name__ == "__main__":
    main()
