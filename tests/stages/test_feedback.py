"""Feedback as a reward: users' ratings ingested with traces become the `feedback` component of
the rollouts of those traces' tasks (stages/reward.py: `trace_feedback`, `with_feedback`, `mixed`).

Real inputs: an OpenAI chat log with thumbs and the Langfuse export fixture (a BOOLEAN and a
NUMERIC score) go through the ingest and validate stages with the replay environment; the reward
stage scores episodes of those traces' tasks.

    pytest -q tests/stages/test_feedback.py
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from stages import config as cfg
from stages import ingest, reward, rollout, validate

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parents[1] / "fixtures" / "traces"


def chat_trace(trace_id: str, question: str, answer: str, feedback: dict | None) -> dict:
    return {"id": trace_id, "messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": answer}],
            **({"feedback": feedback} if feedback is not None else {})}


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """Ingested and validated traces (with their feedback) routed to the replay environment."""
    inbox = tmp_path / "data" / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "chat.jsonl").write_text("".join(json.dumps(t) + "\n" for t in [
        chat_trace("up", "Where is order A1?", "It was delivered on Monday.", {"thumbs_up": True}),
        chat_trace("down", "Can I get a refund?", "No.", {"thumbs_up": False}),
        chat_trace("none", "Hello?", "Hello! How can I help?", None)]))
    shutil.copy(FIXTURES / "langfuse.json", inbox / "langfuse.json")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "base": {}, "reward": {},
        "environments": {"replay": {"module": "stages.envs.replay"}}}))
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    ingest.run(cfg.Ingest(), inbox, data / "traces", data / "ingested.parquet",
               data / "quarantine.jsonl")
    specs = cfg.environments(tmp_path / "params.yaml")
    validate.run(cfg.Base(), cfg.Validate(min_valid_fraction=0.0), data / "ingested.parquet",
                 data / "validated.parquet", data / "qv.jsonl", data / "profiles", data / "docs",
                 specs, REPO)
    return tmp_path


def episodes(root: Path, answers: dict[str, list[str]]) -> None:
    """data/rollouts.parquet: for each trace, episodes of its routed task ending on `answers`."""
    rows = []
    for row in pq.read_table(root / "data/validated.parquet").to_pylist():
        task = json.loads(row["question"])
        task.pop("environment")
        task["task_id"] = f"trace:{row['trace_id']}"
        for sample, answer in enumerate(answers.get(row["trace_id"], [])):
            added = [{"role": "assistant", "content": answer}]
            rows.append({"task_id": f"replay:trace:{row['trace_id']}", "environment": "replay",
                         "sample": sample, "task": json.dumps(task),
                         "messages": json.dumps(task["messages"] + added),
                         "completion": json.dumps(added), "token_ids": [1, 2],
                         "model_mask": [0, 1], "logprobs": [0.0, -0.5], "finish": "stop",
                         "tool_calls": 0, "tool_errors": 0, "error": None, "turns": [1]})
    pq.write_table(pa.Table.from_pylist(rows, schema=rollout.SCHEMA),
                   root / "data/rollouts.parquet")


def score(root: Path) -> tuple[dict, dict]:
    reward.main(["data/rollouts.parquet", "data/rewards.parquet", "metrics/reward.json",
                 "--validated", "data/validated.parquet"])
    table = pq.read_table(root / "data/rewards.parquet").to_pylist()
    return ({(r["task_id"].split(":")[-1], r["sample"]): r for r in table},
            json.loads((root / "metrics/reward.json").read_text()))


def test_a_rated_answer_gives_its_rating_as_the_feedback_component(project):
    langfuse = "c2a1e0d4-5b6f-4e3a-9d2c-7f8e1a0b3c4d"  # a BOOLEAN `user-feedback` score
    traces = {r["trace_id"]: r for r in pq.read_table(project / "data/validated.parquet",
                                                        columns=["trace_id", "feedback"]
                                                        ).to_pylist()}
    assert json.loads(traces[langfuse]["feedback"]) == {  # as ingest stored it
        "scores": {"helpfulness": 0.9, "user-feedback": True}}
    produced = json.loads(pq.read_table(project / "data/validated.parquet",
                                        filters=[("trace_id", "=", langfuse)]
                                        ).column("messages")[0].as_py())[-1]["content"]
    episodes(project, {"up": ["It was delivered   on monday.", "It is lost."],
                       "down": ["No.", "Yes, within 30 days."],
                       "none": ["Hello! How can I help?"], langfuse: [produced]})
    rows, metrics = score(project)
    # production's rated answer (whitespace and case aside): the user's rating, 1.0 or 0.0
    assert rows[("up", 0)]["score_feedback"] == 1.0
    assert rows[("down", 0)]["score_feedback"] == 0.0
    assert rows[(langfuse, 0)]["score_feedback"] is None  # no thumbs, and no score named
    # another answer than the one rated, or no rating at all: no component (absent, not 0)
    assert rows[("up", 1)]["score_feedback"] is None
    assert rows[("down", 1)]["score_feedback"] is None
    assert rows[("none", 0)]["score_feedback"] is None
    # reward.weights.feedback 0 (the default): recorded, not mixed in; correct is the verifier's
    assert rows[("down", 0)]["reward"] == 1.0 and rows[("down", 0)]["correct"] == 1.0
    assert metrics["feedback"] == {"rated_traces": 2, "episodes": 2, "other_answer": 2}
    assert metrics["components"]["feedback"] == 0.5

    # weighed in: the weighted mean over the components present, renormalised; and the
    # Langfuse score named as the rating of traces without thumbs
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["reward"]["weights"] = {"feedback": 3.0}
    params["reward"]["feedback_score"] = "user-feedback"
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    rows, metrics = score(project)
    assert rows[(langfuse, 0)]["score_feedback"] == 1.0
    assert metrics["feedback"] == {"rated_traces": 3, "episodes": 3, "other_answer": 2}
    assert rows[("down", 0)]["reward"] == pytest.approx((1.0 + 3.0 * 0.0) / 4)
    assert rows[("up", 0)]["reward"] == 1.0
    assert rows[("down", 1)]["reward"] == 0.0  # no feedback: the environment's own mean
    assert rows[("down", 0)]["correct"] == 1.0  # a rating is not a verifier


def test_a_named_score_rates_traces_without_thumbs():
    assert reward.rating({"thumbs_up": False, "scores": {"helpfulness": 0.9}}, "helpfulness") == 0
    assert reward.rating({"scores": {"helpfulness": 0.9}}, "helpfulness") == 0.9
    assert reward.rating({"scores": {"helpfulness": 0.9}}) is None  # not named: thumbs only
    assert reward.rating({"scores": {"stars": 4}}, "stars") is None  # outside [0, 1]
    assert reward.rating({"scores": {"ok": True}}, "ok") == 1.0
    assert reward.rating({}) is None


def test_feedback_is_a_component_reward_weights_may_name(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"reward": {"weights": {"feedback": 0.5},
                                               "feedback_score": "helpfulness"}}))
    config = cfg.load("reward", path)
    assert config.weights["feedback"] == 0.5 and config.feedback_score == "helpfulness"
    path.write_text(yaml.safe_dump({"reward": {"weights": {"feedbak": 0.5}}}))
    with pytest.raises(cfg.ParamsError, match=r"did you mean 'reward\.weights\.feedback'"):
        cfg.load("reward", path)


def test_a_module_failing_on_most_episodes_fails_the_stage(project, capsys):
    # the chat path: more than reward.max_error_fraction of the episodes erred
    (project / "flaky.py").write_text(
        "from stages.envs.replay import *  # noqa: F401,F403\n"
        "from stages.envs import replay\n"
        "def reward(task, messages, **kwargs):\n"
        "    if 'refund' not in str(task):\n"
        "        raise RuntimeError('judge answered: Sure! A solid 7/10')\n"
        "    return replay.reward(task, messages, **kwargs)\n")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["environments"] = {"replay": {"module": "flaky"}}
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    episodes(project, {"up": ["It is lost."], "down": ["No."], "none": ["Hi"]})
    with pytest.raises(SystemExit):
        score(project)
    assert re.search(r"2 of 3 episodes could not be scored \(67%.*Sure! A solid 7/10.*"
                     r"reward.max_error_fraction in params.yaml", capsys.readouterr().err)
