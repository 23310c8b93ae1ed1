"""Reward: the environment's verifier scores each rollout.

Reads `data/rollouts.parquet`; writes `data/rewards.parquet` (the rollouts with `correct`,
`reward`, `verifier` and `error` columns) and `metrics/reward.json`. A verifier returns 1.0, 0.0 or
None ("cannot judge": counted and left out of the reward); one that raises is an error, recorded
with its cause and never turned into a zero. Before scoring, the verifier must give the gold answer
full marks on every task, or that task is set aside and counted.

    python -m stages.reward data/rollouts.parquet data/rewards.parquet metrics/reward.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import io
from stages.environments import ENVIRONMENTS


class VerifierBroken(RuntimeError):
    """Every score failed: the verifier itself is broken, not the rollouts."""


def _gold_problem(env, question: str, answer: str) -> str | None:
    """None if the verifier gives the gold answer full marks, else why the task is set aside."""
    try:
        gold = env.verify(question, answer, env.demonstration(question, use_tool=False))
    except Exception as err:
        return f"verifier raised {type(err).__name__} on the gold answer: {err}"
    return None if gold == 1.0 else f"gold answer scores {gold}, not 1.0: task set aside"


def run(base: cfg.Base, config: cfg.Reward, rollouts: Path, rewards: Path) -> dict:
    """Score every rollout; returns the stage metrics."""
    env = ENVIRONMENTS[base.environment]
    table = pq.read_table(rollouts)
    rows = table.to_pylist()
    # Before scoring: the gold answer must score full marks, or the task is set aside.
    set_aside: dict[str, str | None] = {}
    for row in rows:
        if row["task_id"] not in set_aside:
            set_aside[row["task_id"]] = _gold_problem(env, row["question"], row["answer"])
    correct, reward, error, unjudged, errors = [], [], [], 0, 0
    for row in rows:
        problem = set_aside[row["task_id"]]
        score = None
        if problem is None:
            try:
                score = env.verify(row["question"], row["answer"], row["completion"])
            except Exception as err:  # the verifier broke: an error with its cause, never a zero
                problem = f"verifier raised {type(err).__name__}: {err}"
                errors += 1
        else:
            errors += problem.startswith("verifier raised")
        unjudged += problem is None and score is None
        correct.append(score)
        reward.append(None if score is None else config.correct_weight * score)
        error.append(problem)
    if rows and errors == len(rows):
        raise VerifierBroken(f"the {base.environment} verifier failed on every rollout, e.g. "
                             f"{error[0]}; fix the verifier before training on its scores")
    out = table.append_column("correct", pa.array(correct, pa.float64())) \
        .append_column("reward", pa.array(reward, pa.float64())) \
        .append_column("verifier", pa.array([f"{env.NAME}/exact-match@1"] * len(rows))) \
        .append_column("error", pa.array(error, pa.string()))
    io.write_parquet(rewards, out)
    judged = [c for c in correct if c is not None]
    tasks = {}
    for row, score in zip(rows, correct):
        tasks[row["task_id"]] = tasks.get(row["task_id"], False) or score == 1.0
    return {"episodes": len(rows), "judged": len(judged), "unjudgeable": unjudged,
            "errors": errors, "tasks_set_aside": sum(p is not None for p in set_aside.values()),
            "mean_reward": round(sum(judged) / len(judged), 4) if judged else 0.0,
            "correct_episodes": int(sum(judged)),
            "pass_at_k": round(sum(tasks.values()) / len(tasks), 4) if tasks else 0.0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("rollouts", "rewards", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    metrics = run(cfg.load("base", args.params), cfg.load("reward", args.params), args.rollouts,
                  args.rewards)
    io.write_json(args.metrics, metrics)
    print(f"reward: mean {metrics['mean_reward']} over {metrics['judged']} judged episodes, "
          f"pass@k {metrics['pass_at_k']}", file=sys.stderr)


if __name__ == "__main__":
    main()
