"""`offseason simulate` (stages/simulate.py): the demo's chat champion answering a day of requests
on the chat path, logged as OpenAI chat JSONL with its tool calls, the calculator's replies and
thumbs from whether its final answer is right.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages import config as cfg
from stages import simulate
from stages.envs import arith


def records(path: Path) -> list[dict]:
    """The lines of a traffic file that parse (not the one cut off mid-write)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_a_day_is_the_champions_own_conversations_with_the_calculator_run(simulated_once):
    root = simulated_once
    rows = records(root / "data/inbox/traffic-000.jsonl")
    requests = [r for r in rows if r["id"] != "tr-000-chat"]  # all but the small talk
    assert len(requests) == 48 + 1  # the day's requests and a duplicate
    benchmark = {arith.question_of(json.loads(line)["messages"])
                 for line in (root / "data/benchmarks/arith.jsonl").read_text().splitlines()}
    emails = 0
    for row in requests:
        messages = row["messages"]
        assert messages[0]["role"] == "user" and messages[1]["role"] == "assistant"
        question = arith.question_from_text(messages[0]["content"])
        emails += "jane.doe@example.com" in messages[0]["content"]
        assert question not in benchmark  # the held-out suite is never asked
        # what the model read: the expression, as the benchmark and the rollouts ask it
        assert messages[0]["content"].split(" (reply to")[0] == question
        calls = [c for m in messages for c in m.get("tool_calls") or []]
        assert len({c["id"] for c in calls}) == len(calls)  # unique in the trace, as an API's
        replies = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        for call in calls:  # each call answered by the calculator, as the rollout answers it
            reply = replies[call["id"]]
            if not reply.startswith("Error:"):
                expression = json.loads(call["function"]["arguments"])["expression"]
                assert reply == arith.tool_result(expression)
        if "feedback" in row:  # thumbs from whether the final answer is right
            task = {"answer": str(arith.gold_answer(question))}
            assert row["feedback"]["thumbs_up"] == (arith.reward(task, messages) == 1.0)
    assert emails == 1


def test_its_accuracy_is_the_share_of_right_answers_and_of_thumbs_up(simulated_once, tmp_path):
    root = simulated_once
    params = root / "params.yaml"
    out = simulate.run(cfg.load("base", params),
                       cfg.Simulate(traces_per_day=24, feedback_rate=1.0, junk=False),
                       root / "models/champion", tmp_path / "inbox", cfg.environments(params),
                       cfg.load("rollout", params), root)
    rows = records(Path(out["file"]))
    assert len(rows) == out["lines"] == 24
    assert out["champion_correct"] == sum(r["feedback"]["thumbs_up"] for r in rows) / 24


def test_environments_without_the_demos_module_have_no_traffic_to_simulate():
    assert simulate.demo_environment(
        {"maths": cfg.EnvironmentSpec(module="stages.envs.arith")}) == "maths"
    with pytest.raises(cfg.ParamsError, match="no entry has module stages.envs.arith"):
        simulate.demo_environment({"support": cfg.EnvironmentSpec(module="my_envs.support")})
