
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import train_config
from tiny_arith import BAD, GOOD, SPECS, build_champion, episodes, said, scored

from stages import champion_scores, gate, reward, rollout, train
from stages import config as cfg
from stages.envs import arith

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("reward_train_gate")


@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    return build_champion(tmp_path_factory.mktemp("models") / "champion")


def rollouts_file(tmp_path, champion, groups):
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pa.Table.from_pylist(episodes(champion, groups), schema=rollout.SCHEMA), path)
    return path


CALLED_ONLY = arith.chat_demonstration("4+4", use_tool=True)[:2]  # a call, never an answer


def test_reward_scores_each_rollout(tmp_path, champion):
    path = rollouts_file(tmp_path, champion, [("2*3", [said("answer:6"), said("answer:7")]),
                                              ("4+4", [arith.chat_demonstration("4+4", True),
                                                       CALLED_ONLY])])
    m = reward.run(cfg.Reward(workers=1), path, tmp_path / "rewards.parquet", SPECS)
    scored_rows = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert [r["correct"] for r in scored_rows] == [1.0, 0.0, 1.0, 0.0]
    assert [r["score_reward"] for r in scored_rows] == [1.0, 0.0, 1.0, 0.0]
    assert m["mean_reward"] == 0.5 and m["pass_at_k"] == 1.0 and m["errors"] == 0
    assert all(r["verifier"] == "arith/exact-match@2" for r in scored_rows)


def test_broken_verifier_is_an_error_not_a_zero(tmp_path, monkeypatch, champion):
    path = rollouts_file(tmp_path, champion, [("2*3", [said("answer:6"), said("answer:7")])])
    score = arith.reward

    def flaky(task, messages):
        if messages[-1]["content"] == "answer:7":
            raise TimeoutError("sandbox timed out")
        return score(task, messages)

    monkeypatch.setattr(arith, "reward", flaky)  # in this process: workers=1
    m = reward.run(cfg.Reward(workers=1), path, tmp_path / "rewards.parquet", SPECS)
    scored_rows = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert scored_rows[1]["reward"] is None
    assert "reward() raised TimeoutError: sandbox timed out" in scored_rows[1]["error"]
    assert scored_rows[1]["correct"] is None and scored_rows[1]["score_reward"] is None
    assert m["errors"] == 1 and m["mean_reward"] == 1.0 and m["judged"] == 1

    monkeypatch.setattr(arith, "reward", lambda task, messages: 1 / 0)
    with pytest.raises(reward.VerifierBroken, match="no rollout could be scored.*ZeroDivision"):
        reward.run(cfg.Reward(workers=1), path, tmp_path / "rewards2.parquet", SPECS)


def test_too_little_data_keeps_the_champion(tmp_path, champion):
    scored(tmp_path, champion, [("2*3", [said("answer:7"), said("answer:8")])])
    m = train.run(cfg.Base(), train_config(min_examples=1), tmp_path / "rewards.parquet", champion,
                  tmp_path / "candidate", tmp_path / "replay")
    assert m["trained"] is False and "train.min_examples" in m["reason"]
    assert gate.weights_hash(tmp_path / "candidate") == gate.weights_hash(champion)


def test_train_learns_from_verified_rollouts_only(tmp_path, champion):
    scored(tmp_path, champion, [("2*3", [GOOD, BAD])] * 4)
    assert len(train.examples_from(tmp_path / "rewards.parquet")) == 4  # 4 tasks, 1 correct each
    m = train.run(cfg.Base(), train_config(min_examples=2, epochs=8, batch_size=4),
                  tmp_path / "rewards.parquet", champion, tmp_path / "candidate",
                  tmp_path / "replay")
    assert m["trained"] is True and m["examples"] == 4 and m["steps"] == 8
    assert m["replayed"] == 0
    assert gate.weights_hash(tmp_path / "candidate") != gate.weights_hash(champion)


def test_later_cycles_replay_earlier_examples_once(tmp_path, champion):
    first = tmp_path / "one"
    first.mkdir()
    scored(first, champion, [("2*3", [GOOD, GOOD])] * 2)
    config = train_config(min_examples=1, epochs=1, batch_size=4)
    train.run(cfg.Base(), config, first / "rewards.parquet", champion, tmp_path / "cand",
              tmp_path / "replay")
    second = tmp_path / "two"
    second.mkdir()
    scored(second, champion, [("7+1", [said("answer:8"), said("answer:9")])] * 3)
    m = train.run(cfg.Base(), config, second / "rewards.parquet", champion, tmp_path / "cand",
                  tmp_path / "replay")
    assert (m["examples"], m["replayed"], m["replay_available"]) == (3, 2, 2)
    # run again (a killed stage): the same part, nothing counted twice
    again = train.run(cfg.Base(), config, second / "rewards.parquet", champion, tmp_path / "cand",
                      tmp_path / "replay")
    assert (again["examples"], again["replayed"]) == (3, 2)
    assert len(list((tmp_path / "replay").glob("part-*.parquet"))) == 2
    half = train_config(min_examples=1, epochs=1, batch_size=4, replay_fraction=0.5)
    m = train.run(cfg.Base(), half, second / "rewards.parquet", champion, tmp_path / "cand",
                  tmp_path / "replay")
    assert m["replayed"] == 1


def test_paired_interval_contains_the_difference():
    rng = np.random.default_rng(0)
    a = (rng.random(400) < 0.6).astype(float)
    b = (rng.random(400) < 0.3).astype(float)
    low, high = gate.paired_interval(a, b, 1000, 0.9, 0)
    assert low < (a - b).mean() < high and low > 0
    low, high = gate.paired_interval(a, a, 1000, 0.9, 0)
    assert low == high == 0


def test_gate_never_passes_an_unchanged_candidate(tmp_path, champion):
    arith.write_benchmark(tmp_path / "arith.jsonl", size=20)
    config = cfg.Gate(min_improvement=-1.0, bootstrap_samples=100)
    specs = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith", benchmark="arith.jsonl")}
    champion_scores.run(cfg.Base(), config, champion, tmp_path / "scores.parquet",
                        tmp_path / "forgetting.jsonl", specs, cfg.Rollout(), tmp_path)
    verdict = gate.run(cfg.Base(), config, champion, tmp_path / "scores.parquet",
                       tmp_path / "forgetting.jsonl", tmp_path / "rewards.parquet",
                       tmp_path / "replay", tmp_path / "items.parquet", specs, cfg.Rollout(),
                       tmp_path)
    assert verdict["passed"] is False and "unchanged" in verdict["reason"]
    assert verdict["candidate_score"] == verdict["champion_score"]
    assert pq.read_table(tmp_path / "items.parquet").num_rows == 20


def test_gate_names_an_empty_benchmark(tmp_path, champion):
    (tmp_path / "arith.jsonl").write_text("")
    specs = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith", benchmark="arith.jsonl")}
    with pytest.raises(ValueError, match="arith.jsonl: the benchmark of environment 'arith' is "
                                         "empty"):
        champion_scores.run(cfg.Base(), cfg.Gate(), champion, tmp_path / "scores.parquet",
                            tmp_path / "forgetting.jsonl", specs, cfg.Rollout(), tmp_path)
