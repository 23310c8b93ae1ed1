"""The examples/judged environment loads, its tasks check, and the judge scores it by its rubric
(a scripted OpenAI-compatible judge on loopback); the README's mixed entry is valid params.

    pytest -q tests/stages/envs/test_examples.py
"""

from __future__ import annotations

from pathlib import Path

import yaml
from judge_server import Scripted

from stages import config as cfg
from stages.envs import contract, judge

REPO = Path(__file__).resolve().parents[3]


def test_the_judged_example_is_scored_by_its_rubric(tmp_path, monkeypatch):
    server = Scripted([{"reasoning": "42, plainly", "score": 1.0}])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "judge": {"model": "judge-7b", "rubric": str(REPO / "examples/judged/rubric.md")},
        "runtime": {"judge": {"url": server.url}},
        "environments": {
            "arith": {"module": "stages.envs.arith", "benchmark": "data/benchmarks/arith.jsonl"},
            "judged": {"module": "examples.judged.judged_env",
                       "tasks": "examples/judged/tasks.jsonl", "weight": 0.5},
            "replay": {"module": "stages.envs.replay", "weight": 0.5}}}))
    try:
        judge.use_cache(None)
        specs = cfg.environments(tmp_path / "params.yaml")
        assert list(specs) == ["arith", "judged", "replay"]
        env = contract.load_spec("judged", specs["judged"], REPO)
        tasks = contract.load_tasks(REPO / specs["judged"].tasks, env)
        assert len(tasks) == 6 and env.reward_group is not None
        scores = contract.score(env, tasks[0], tasks[0]["messages"] + [
            {"role": "assistant", "content": "42"}])
        assert scores == {"judge": 1.0} and scores.judgment["reasoning"] == "42, plainly"
        sent = server.requests[0]["body"]["messages"][0]["content"]
        assert "Grade the assistant's final answer" in sent  # the rubric file's text
    finally:
        server.close()
        judge.use_cache(None)
