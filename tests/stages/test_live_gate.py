"""stages/live_gate.py: the production gate's decision on real ingested traces (openai-chat
logs through the ingest stage into `data/traces/`), attributed to canary and stable by the
model name the answers carry; the demo's arithmetic environment scores the live answers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import yaml

from stages import config as cfg
from stages import ingest, live_gate

REPO = Path(__file__).resolve().parents[2]
SINCE = "2026-12-01T12:00:00+00:00"
NAMES = {"canary": ["policy-a"], "stable": ["policy-b"]}


def trace(n: int, model: str, right: bool, *, at: str = "2026-12-01T13:00:00Z",
          thumbs: bool | None = None, error: bool = False) -> dict:
    """One live conversation as an OpenAI log line: a sum asked, answered right or wrong."""
    # ingest drops a conversation it has seen (by content): each arm's questions its own
    a, b = 10 + n + (500 if model.endswith("a") else 0), 3 + n % 7
    feedback = {}
    if thumbs is not None:
        feedback["thumbs_up"] = thumbs
    if error:
        feedback["error"] = "calculator: timed out"
    return {"id": f"t{model}-{n}", "model": model, "created_at": at, "feedback": feedback,
            "messages": [{"role": "user", "content": f"what is {a}+{b}?"},
                         {"role": "assistant", "content": str(a + b + (0 if right else 1))}]}


def project(root: Path, lines: list[dict]) -> Path:
    """A project with the demo's params and environment, the lines ingested into data/traces."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    (root / "data" / "inbox").mkdir(parents=True)
    (root / "data" / "inbox" / "live.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines))
    params = yaml.safe_load((root / "params.yaml").read_text())
    metrics = ingest.run(cfg.Ingest(**params.get("ingest", {})), root / "data" / "inbox",
                         root / "data" / "traces", root / "data" / "ingested.parquet",
                         root / "q.jsonl")
    assert metrics["accepted"] == len(lines), metrics
    return root


def test_traces_are_attributed_by_the_name_their_answers_carry_and_their_time(tmp_path):
    lines = ([trace(i, "policy-a", True) for i in range(3)]
             + [trace(i, "policy-b", True) for i in range(4)]
             + [trace(9, "policy-a", True, at="2026-12-01T11:59:59Z")]  # before the canary
             + [trace(10, "someone-else", True)]
             + [{**trace(11, "policy-b", True), "created_at": None}])
    root = project(tmp_path / "p", lines)
    arms, left = live_gate.attribute(live_gate.read_traces(root / "data" / "traces"), NAMES,
                                     SINCE)
    assert {arm: len(rows) for arm, rows in arms.items()} == {"canary": 3, "stable": 4}
    assert left == {"before": 1, "untimed": 1, "unknown": 1}
    verdict = live_gate.judge(root, {"names": NAMES, "since": SINCE}, bake=4)
    assert verdict["status"] == "baking" and verdict["traces"] == {"canary": 3, "stable": 4}


def test_a_canary_that_answers_worse_on_live_traffic_fails_and_names_the_measure(tmp_path):
    lines = ([trace(i, "policy-a", right=i % 4 == 0) for i in range(24)]
             + [trace(i, "policy-b", right=i % 8 != 0) for i in range(24)])
    root = project(tmp_path / "p", lines)
    verdict = live_gate.judge(root, {"names": NAMES, "since": SINCE}, bake=20)
    assert verdict["status"] == "failed"
    reward = verdict["measures"]["reward"]
    assert reward["n"] == [24, 24] and reward["canary"] == 0.25 and reward["stable"] == 0.875
    assert reward["worse"] and reward["test"] == "Welch's t-test, one-sided"
    assert verdict["reason"].startswith("reward: canary 0.250 vs stable 0.875")
    # no thumbs on these traces: not decided, and the level is alpha over the measures decided
    assert "skipped" in verdict["measures"]["thumbs"]
    assert reward["level"] == round(cfg.load("gate", root / "params.yaml").alpha / 2, 6)


def test_a_canary_as_good_as_stable_passes(tmp_path):
    lines = ([trace(i, "policy-a", right=i % 5 != 0, thumbs=i % 3 != 0) for i in range(30)]
             + [trace(i, "policy-b", right=i % 5 != 1, thumbs=i % 3 != 1) for i in range(30)])
    root = project(tmp_path / "p", lines)
    verdict = live_gate.judge(root, {"names": NAMES, "since": SINCE}, bake=30)
    assert verdict["status"] == "passed", verdict["reason"]
    assert verdict["measures"]["reward"]["canary"] == verdict["measures"]["reward"]["stable"]
    assert verdict["measures"]["thumbs"]["n"] == [30, 30]
    assert not verdict["measures"]["thumbs"]["worse"]


def test_more_user_errors_or_fewer_thumbs_up_fail_a_canary_whose_rewards_are_equal(tmp_path):
    errors = ([trace(i, "policy-a", True, error=i % 2 == 0) for i in range(30)]
              + [trace(i, "policy-b", True, error=i == 0) for i in range(30)])
    verdict = live_gate.judge(project(tmp_path / "e", errors), {"names": NAMES, "since": SINCE},
                              bake=30)
    assert verdict["status"] == "failed" and verdict["reason"].startswith("errors:")
    assert not verdict["measures"]["reward"]["worse"]
    thumbs = ([trace(i, "policy-a", True, thumbs=i % 4 == 0) for i in range(30)]
              + [trace(i, "policy-b", True, thumbs=i % 4 != 0) for i in range(30)])
    verdict = live_gate.judge(project(tmp_path / "t", thumbs), {"names": NAMES, "since": SINCE},
                              bake=30)
    assert verdict["status"] == "failed" and verdict["reason"].startswith("thumbs:")


def test_welch_one_sided_direction_and_constant_arms():
    ones, zeros = np.ones(10), np.zeros(10)
    assert live_gate.worse(zeros, ones, higher_is_better=True) == 0.0
    assert live_gate.worse(ones, zeros, higher_is_better=True) == 1.0
    assert live_gate.worse(ones, zeros, higher_is_better=False) == 0.0
    assert live_gate.worse(ones, ones, higher_is_better=True) == 1.0
    mixed = np.array([1.0, 0.0] * 10)
    assert live_gate.worse(mixed, ones, True) < 0.01 < live_gate.worse(ones, mixed, True)


def test_fleet_canary_settings_are_checked(tmp_path):
    import pytest

    assert cfg.Fleet().canary == 0  # off by default: every replica at once, as before
    cfg.Fleet(urls="http://a:1/v1,http://b:1/v1", canary=1)
    with pytest.raises(cfg.ParamsError, match="leaves none serving the stable generation"):
        cfg.Fleet(urls="http://a:1/v1,http://b:1/v1", canary=2)


def test_a_verifier_that_breaks_on_a_live_trace_is_counted_not_scored_zero(tmp_path):
    lines = ([trace(i, "policy-a", True) for i in range(6)]
             + [trace(i, "policy-b", True) for i in range(6)]
             + [{**trace(50, "policy-b", True), "messages": [
                 {"role": "user", "content": "hello there"},
                 {"role": "assistant", "content": "hi"}]}])  # no question: no task
    root = project(tmp_path / "p", lines)
    (root / "breaks_env.py").write_text(
        "from stages.envs import arith\n"
        "TOOLS, call_tool, gold, task_from_trace = (arith.TOOLS, arith.call_tool, arith.gold,\n"
        "                                           arith.task_from_trace)\n"
        "def reward(task, messages):\n"
        "    if task['messages'][0]['content'].startswith('510'):\n"
        "        raise RuntimeError('the sandbox is gone')\n"
        "    return arith.reward(task, messages)\n")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["environments"] = {"breaks": {"module": "breaks_env",
                                         "benchmark": "data/benchmarks/arith.jsonl"}}
    params["gate"]["primary"] = "breaks"
    (root / "data" / "benchmarks").mkdir()
    shutil.copy(REPO / "data" / "benchmarks" / "arith.jsonl", root / "data" / "benchmarks")
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    verdict = live_gate.judge(root, {"names": NAMES, "since": SINCE}, bake=6)
    # the canary's first question (510+3) broke its verifier: left out of the rewards, counted
    assert verdict["verifier_errors"] == {"canary": 1, "stable": 0}
    assert verdict["unjudged"] == {"canary": 0, "stable": 1}
    assert verdict["measures"]["reward"]["n"] == [5, 6]
    assert verdict["status"] == "passed"
