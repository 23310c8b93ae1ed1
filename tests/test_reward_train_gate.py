
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import train_config
from tiny_arith import build_champion

from stages import champion_scores, gate, reward, rollout, tinylm, train
from stages import config as cfg
from stages.envs import arith
from stages.training.batches import encode_completion

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("reward_train_gate")


def rollouts_file(tmp_path, rows):
    tokenizer = tinylm.build_tokenizer(arith)
    full = []
    for i, (question, completion) in enumerate(rows):
        ids, mask = encode_completion(tokenizer, arith, arith.prompt(question), completion)
        full.append({"task_id": f"t{i // 2}", "trace_id": f"t{i // 2}", "sample": i % 2,
                     "question": question, "answer": str(arith.gold_answer(question)),
                     "prompt": arith.prompt(question), "completion": completion,
                     "token_ids": ids, "model_mask": mask, "logprobs": [0.0] * len(ids),
                     "finish": "eos", "tool_calls": completion.count("<calc>")})
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pa.Table.from_pylist(full, schema=rollout.SCHEMA), path)
    return path


def test_reward_scores_each_rollout(tmp_path):
    path = rollouts_file(tmp_path, [("2*3", "answer:6"), ("2*3", "answer:7"),
                                    ("4+4", "<calc>4+4</calc><result>8</result>answer:8"),
                                    ("4+4", "<calc>4+4</calc>")])
    m = reward.run(cfg.Base(), cfg.Reward(), path, tmp_path / "rewards.parquet")
    scored = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert [r["correct"] for r in scored] == [1.0, 0.0, 1.0, 0.0]
    assert [r["score_format"] for r in scored] == [1.0, 1.0, 1.0, 0.0]
    assert m["mean_reward"] == 0.5 and m["pass_at_k"] == 1.0 and m["errors"] == 0
    assert all(r["verifier"] == "arith/exact-match@2" for r in scored)


def test_broken_verifier_is_an_error_not_a_zero(tmp_path, monkeypatch):
    path = rollouts_file(tmp_path, [("2*3", "answer:6"), ("2*3", "answer:7")])
    score = arith.score

    def flaky(question, answer, completion):
        if completion == "answer:7":
            raise TimeoutError("sandbox timed out")
        return score(question, answer, completion)

    monkeypatch.setattr(arith, "score", flaky)  # in this process: workers=1
    m = reward.run(cfg.Base(), cfg.Reward(workers=1), path, tmp_path / "rewards.parquet")
    scored = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert scored[1]["reward"] is None and "TimeoutError: sandbox timed out" in scored[1]["error"]
    assert scored[1]["correct"] is None and scored[1]["score_correct"] is None
    assert m["errors"] == 1 and m["mean_reward"] == 1.0 and m["judged"] == 1

    monkeypatch.setattr(arith, "score", lambda q, a, c: 1 / 0)
    with pytest.raises(reward.VerifierBroken, match="scored none of 2 rollouts.*ZeroDivisionError"):
        reward.run(cfg.Base(), cfg.Reward(workers=1), path, tmp_path / "rewards2.parquet")


@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    return build_champion(tmp_path_factory.mktemp("models") / "champion")


def test_too_little_data_keeps_the_champion(tmp_path, champion):
    path = rollouts_file(tmp_path, [("2*3", "answer:7"), ("2*3", "answer:8")])
    reward.run(cfg.Base(), cfg.Reward(), path, tmp_path / "rewards.parquet")
    m = train.run(cfg.Base(), train_config(min_examples=1), tmp_path / "rewards.parquet", champion,
                  tmp_path / "candidate", tmp_path / "replay")
    assert m["trained"] is False and "train.min_examples" in m["reason"]
    assert gate.weights_hash(tmp_path / "candidate") == gate.weights_hash(champion)


def test_train_learns_from_verified_rollouts_only(tmp_path, champion):
    rows = [("2*3", "<calc>2*3</calc><result>6</result>answer:6"), ("2*3", "answer:5")] * 4
    path = rollouts_file(tmp_path, rows)
    reward.run(cfg.Base(), cfg.Reward(), path, tmp_path / "rewards.parquet")
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
    rollouts_file(first, [("2*3", "<calc>2*3</calc><result>6</result>answer:6")] * 4)
    reward.run(cfg.Base(), cfg.Reward(), first / "rollouts.parquet", first / "rewards.parquet")
    config = train_config(min_examples=1, epochs=1, batch_size=4)
    train.run(cfg.Base(), config, first / "rewards.parquet", champion, tmp_path / "cand",
              tmp_path / "replay")
    second = tmp_path / "two"
    second.mkdir()
    rollouts_file(second, [("7+1", "answer:8"), ("7+1", "answer:9")] * 3)
    reward.run(cfg.Base(), cfg.Reward(), second / "rollouts.parquet", second / "rewards.parquet")
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
    champion_scores.run(cfg.Base(), config, champion, [tmp_path / "arith.jsonl"],
                        tmp_path / "scores.parquet", tmp_path / "forgetting.jsonl")
    verdict = gate.run(cfg.Base(), config, champion, tmp_path / "scores.parquet",
                       tmp_path / "forgetting.jsonl", tmp_path / "rewards.parquet",
                       tmp_path / "replay", [tmp_path / "arith.jsonl"], tmp_path / "items.parquet")
    assert verdict["passed"] is False and "unchanged" in verdict["reason"]
    assert verdict["candidate_score"] == verdict["champion_score"]
    assert pq.read_table(tmp_path / "items.parquet").num_rows == 20


def test_gate_names_an_empty_benchmark(tmp_path, champion):
    (tmp_path / "arith.jsonl").write_text("")
    with pytest.raises(ValueError, match="arith.jsonl: the benchmark is empty"):
        champion_scores.run(cfg.Base(), cfg.Gate(), champion, [tmp_path / "arith.jsonl"],
                            tmp_path / "scores.parquet", tmp_path / "forgetting.jsonl")
