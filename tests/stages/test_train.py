"""The train stage's algorithms (SFT, DPO, GRPO), LoRA, DeepSpeed ZeRO-2 on CPU, and resuming."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import REPO, train_config
from tiny_arith import BAD, GOOD, SPECS, build_champion, encoded, said, scored

from stages import config as cfg
from stages import erasure, gate, io, tinylm, train
from stages.envs import arith, contract
from stages.training import dpo, grpo

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("train")

@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    return build_champion(tmp_path_factory.mktemp("models") / "champion")


def sequence_logprob(folder, completion, question="2*3"):
    """Summed log-probability of the model's own tokens of `completion`."""
    model, tokenizer = tinylm.load(folder)
    ids, mask = encoded(folder, question, completion)
    batch = grpo.collate(tokenizer.pad_token_id)(
        [{"token_ids": ids, "model_mask": mask, "logprobs": [0.0] * len(ids), "advantage": 0.0}])
    with torch.no_grad():
        logp = grpo.token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    return float((logp * batch["mask"]).sum())


def run_train(tmp_path, champion, rewards, validated=None, **params):
    config = train_config(**{"min_examples": 1, "batch_size": 4, **params})
    return train.run(cfg.Base(), config, rewards, champion, tmp_path / "candidate",
                     tmp_path / "replay", tmp_path / "candidate.ckpt", tmp_path / "steps.csv",
                     validated, SPECS, REPO)


def steps(tmp_path):
    return list(csv.DictReader((tmp_path / "steps.csv").open()))


def test_dpo_pairs_keep_the_model_tokens_only(tmp_path, champion):
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD, BAD, GOOD]), ("4+4", [BAD] * 2)])
    pairs, counts = dpo.examples(pq.read_table(rewards).to_pylist())
    assert len(pairs) == 1 and counts == {"tasks_without_pair": 1}  # distinct completions only
    _, tokenizer = tinylm.load(champion)
    pair = pairs[0]
    assert tokenizer.decode(pair["prompt_ids"]) == "<|user|>2*3<|assistant|>"
    assert tokenizer.decode(pair["chosen_ids"]) == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call><eos>'
        '<tool_response>6</tool_response><|assistant|>answer:6<eos>')
    # the calculator's answer (and the template's turn) is context, not a target
    masked = [t for t, m in zip(pair["chosen_ids"], pair["chosen_mask"]) if not m]
    assert tokenizer.decode(masked) == "<tool_response>6</tool_response><|assistant|>"
    assert tokenizer.decode(pair["rejected_ids"]) == "answer:5<eos>"
    assert all(pair["rejected_mask"])


def test_dpo_ranks_a_completion_sampled_twice_by_its_mean_reward():
    # a judge comparing a group's samples (reward_group) scored the same text 1.0 and 0.0: the
    # first sample of it alone left no completion at the best reward (ZeroDivisionError before)
    def row(completion, reward):
        return {"task_id": "t", "completion": completion, "reward": reward,
                "token_ids": [1, 2, 3], "model_mask": [0, 1, 1]}
    pairs, counts = dpo.examples([row("a", 0.25), row("a", 1.0), row("b", 0.5), row("c", 0.0)])
    assert [p["completion"] for p in pairs] == ["a\x00b", "a\x00c"]  # a's mean 0.625 is best
    assert counts == {"tasks_without_pair": 0}
    pairs, _ = dpo.examples([row("a", 0.0), row("a", 1.0), row("b", 0.5)])  # a tie: no pair
    assert pairs == []


def validated_traces(tmp_path, traces):
    """A validated.parquet of (trace_id, question, the trace's answer as messages, thumbs), each
    routed to the arith environment as the validate stage routes it.
    """
    router = contract.Router({"arith": contract.load("arith", "stages.envs.arith")})
    rows = []
    for trace_id, question, answer, thumbs in traces:
        messages = [{"role": "user", "content": question}] + answer
        rows.append({"trace_id": trace_id, "question": router.task_of(messages),
                     "thumbs_up": thumbs, "messages": json.dumps(messages)})
    path = tmp_path / "validated.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([
        ("trace_id", pa.string()), ("question", pa.string()), ("thumbs_up", pa.bool_()),
        ("messages", pa.string())])), path)
    return path


def test_dpo_counts_rollout_and_feedback_pairs_apart(tmp_path, champion):
    feedback = [("t0", "2*3", said("answer:7"), False),  # wrong, thumbs down: rejected vs GOOD
                ("t1", "4+4", said("answer:9"), True),  # thumbs up, but the reward says wrong
                ("t2", "5+1", arith.chat_demonstration("5+1", True), True),  # chosen
                ("t3", "2+2", said("answer:4"), False),  # thumbs down, but the reward says right
                ("t5", "1+1", said("answer:2"), None)]  # no feedback
    rollouts = [("2*3", [GOOD, GOOD]), ("4+4", [said("answer:8"), said("answer:5")]),
                ("5+1", [said("answer:5")] * 2), ("2+2", [said("answer:4"), said("answer:3")]),
                ("1+1", [said("answer:2"), said("answer:3")])]
    # the rollouts of the traces' tasks, named as the rollout stage names them
    rewards = scored(tmp_path, champion, rollouts, [f"trace:{t[0]}" for t in feedback])
    validated = validated_traces(tmp_path, feedback)
    m = run_train(tmp_path, champion, rewards, validated, algorithm="dpo", epochs=1)
    # rollout pairs: 4+4, 2+2 and 1+1 have a better and a worse completion; feedback pairs:
    # the thumbs down of 2*3 and the thumbs up of 5+1, where the reward agrees
    assert (m["pairs_from_rollouts"], m["pairs_from_feedback"], m["examples"]) == (3, 2, 5)
    assert (m["thumbs_up_verifier_wrong"], m["thumbs_down_verifier_correct"]) == (1, 1)
    assert m["trained"] is True
    without = run_train(tmp_path / "no", champion, rewards, algorithm="dpo", epochs=1)
    assert (without["pairs_from_rollouts"], without["pairs_from_feedback"]) == (3, 0)


def test_grpo_groups_and_flat_groups_counted(tmp_path, champion):
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD, BAD, BAD]), ("4+4", [BAD] * 4),
                                          ("5+1", [said("answer:6")] * 4)])
    groups, counts = grpo.examples(pq.read_table(rewards).to_pylist())
    assert counts == {"groups_without_spread": 2} and len(groups) == 1
    advantages = [e["advantage"] for e in groups[0]["episodes"]]
    # TRL's: (1 - 0.25) over the Bessel std 0.5 plus 1e-4
    assert advantages[0] == pytest.approx(0.75 / (0.5 + 1e-4)) and sum(advantages) == pytest.approx(0)


@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_preference_algorithms_move_towards_the_better_answer(tmp_path, champion, algorithm):
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD, BAD, BAD])] * 4)
    before = sequence_logprob(champion, GOOD) - sequence_logprob(champion, BAD)
    m = run_train(tmp_path, champion, rewards, algorithm=algorithm, epochs=10, lr=3e-3)
    assert m["trained"] is True and m["algorithm"] == algorithm and m["examples"] == 4
    after = sequence_logprob(tmp_path / "candidate", GOOD) - \
        sequence_logprob(tmp_path / "candidate", BAD)
    assert after > before + 1.0
    rows = steps(tmp_path)
    assert len(rows) == m["steps"] == (10 if algorithm == "dpo" else 40) and {"loss", "learning_rate", "grad_norm",
                                              "tokens_per_second"} <= set(rows[0])
    if algorithm == "dpo":  # TRL's own metrics come along: the reward margin grew
        assert float(rows[-1]["rewards/margins"]) > float(rows[0]["rewards/margins"])
    else:
        assert "clip_fraction" in rows[0]


@pytest.mark.parametrize("algorithm,reason", [
    ("sft", "0 verified-correct rollouts"), ("dpo", "0 preference pairs"),
    ("grpo", "0 task groups with a reward spread")])
def test_too_little_data_emits_the_champion(tmp_path, champion, algorithm, reason):
    rewards = scored(tmp_path, champion, [("2*3", [BAD, BAD])])
    m = run_train(tmp_path, champion, rewards, algorithm=algorithm)
    assert m["trained"] is False and reason in m["reason"] and "train.min_examples" in m["reason"]
    assert gate.weights_hash(tmp_path / "candidate") == gate.weights_hash(champion)


def test_grpo_kl_and_replay_of_earlier_groups(tmp_path, champion):
    first = tmp_path / "one"
    first.mkdir()
    rewards = scored(first, champion, [("2*3", [GOOD, BAD])])
    run_train(tmp_path, champion, rewards, algorithm="grpo", epochs=1)
    second = tmp_path / "two"
    second.mkdir()
    rewards = scored(second, champion, [("4+4", [said("answer:8"), said("answer:9")])])
    m = run_train(tmp_path, champion, rewards, algorithm="grpo", epochs=1, kl_coef=0.1)
    assert (m["examples"], m["replayed"], m["replay_available"]) == (1, 1, 1)
    assert m["trained"] is True


def test_lora_is_merged_into_full_weights(tmp_path, champion):
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD])] * 2)
    m = run_train(tmp_path, champion, rewards, algorithm="sft", lora_r=4, epochs=4, lr=1e-2)
    assert m["trained"] is True and m["lora_r"] == 4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "candidate/model.safetensors"), "pt") as f:
        names = list(f.keys())
    with safe_open(str(champion / "model.safetensors"), "pt") as f:
        assert sorted(names) == sorted(f.keys())  # no adapter left: loads anywhere
    tinylm.load(tmp_path / "candidate")
    assert gate.weights_hash(tmp_path / "candidate") != gate.weights_hash(champion)


DISTRIBUTED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR")


@pytest.fixture
def one_process_group(monkeypatch):
    """The stage sets these for its own (one) process; they must not leak into later tests."""
    for key in DISTRIBUTED:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    before = set(os.environ)
    yield
    for key in DISTRIBUTED:
        os.environ.pop(key, None)
    for key in set(os.environ) - before:  # transformers sets ACCELERATE_USE_DEEPSPEED & co.
        if key.startswith("ACCELERATE_"):
            os.environ.pop(key)


def test_deepspeed_zero2_trains_on_cpu(tmp_path, champion, one_process_group):
    """DeepSpeed for real: ZeRO stage 2, one CPU process (gloo), fp32, a few optimizer steps."""
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD])] * 4)
    m = run_train(tmp_path, champion, rewards, algorithm="sft", deepspeed=2, epochs=2)
    assert m["trained"] is True and m["deepspeed"] == 2 and m["precision"] == "fp32"
    assert m["steps"] == 2 and len(steps(tmp_path)) == 2
    assert gate.weights_hash(tmp_path / "candidate") != gate.weights_hash(champion)
    import deepspeed.comm.comm
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().device_name() == "cpu"
    # its comm backend started without compiling the shared-memory op (`no_shm_comm_op`)
    assert deepspeed.comm.comm.cdb is not None and deepspeed.comm.comm.cdb.shm_comm_op is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deepspeed_zero2_bf16_on_gpu(tmp_path, champion, one_process_group):
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD])] * 4)
    m = run_train(tmp_path, champion, rewards, algorithm="sft", deepspeed=2, epochs=2)
    assert m["device"] == "cuda" and m["trained"] is True
    assert m["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


def clean_env():
    return {k: v for k, v in os.environ.items()
            if k not in DISTRIBUTED and not k.startswith("ACCELERATE_")}


def run_stage(command):
    env = clean_env()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def stage_command(folder, champion, rewards, params):
    return [sys.executable, "-m", "stages.train", str(rewards), str(champion),
            str(folder / "candidate"), str(folder / "replay"), str(folder / "candidate.ckpt"),
            str(folder / "train.json"), str(folder / "steps.csv"), "--params", str(params)]


def test_killed_stage_resumes_to_the_same_weights(tmp_path, champion):
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD, BAD, BAD])] * 8)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["base"]["threads"] = 1
    params["train"].update(algorithm="grpo", batch_size=4, min_examples=1, checkpoint_steps=4)
    params["train"]["grpo"].update(epochs=4.5, kl_coef=0.05)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_stage(stage_command(whole, champion, rewards, tmp_path / "params.yaml"))
    proc = subprocess.Popen(stage_command(killed, champion, rewards, tmp_path / "params.yaml"),
                            cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    # killed once a checkpoint is whole (its trainer_state.json, written last, parses): a kill
    # inside that write leaves a checkpoint the rerun rightly discards, and starts from step 0
    while not any(train._whole_json(state) for state in
                  (killed / "candidate.ckpt").glob("*/checkpoint-*/trainer_state.json")):
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "candidate").exists()
    run_stage(stage_command(killed, champion, rewards, tmp_path / "params.yaml"))
    metrics = yaml.safe_load((killed / "train.json").read_text())
    assert metrics["resumed_from_step"] >= 4 and metrics["steps"] == 36
    assert gate.weights_hash(killed / "candidate") == gate.weights_hash(whole / "candidate")
    assert not list((killed / "candidate.ckpt").iterdir())  # cleaned once the candidate is out
    # the per-step log covers every step, across the kill
    assert [int(r["step"]) for r in steps_file(killed)] == list(range(1, 37))


def test_a_checkpoint_cut_short_while_saving_is_not_resumed_from(tmp_path):
    """A kill while the Trainer wrote trainer_state.json (its last file) left it empty or half
    written: resuming from it failed with a JSONDecodeError, so the stage could not be rerun."""
    for step, state in [(4, '{"global_step": 4}'), (8, ""), (12, '{"global_step": 1'), (16, None)]:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if state is not None:
            (folder / "trainer_state.json").write_text(state)
    assert train.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def steps_file(folder):
    return list(csv.DictReader((folder / "steps.csv").open()))


def test_train_params_are_checked(tmp_path):
    for bad, key in [({"algorithm": "ppo"}, "train.algorithm"),
                     ({"deepspeed": 4}, "train.deepspeed"), ({"deepspeed": "zero.yaml"},
                                                             "train.deepspeed"),
                     ({"deepspeed": 1.5}, "train.deepspeed")]:
        params = yaml.safe_load((REPO / "params.yaml").read_text())
        params["train"].update(bad)
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
        with pytest.raises(cfg.ParamsError, match=key):
            cfg.load("train", tmp_path / "p.yaml")


# On-policy GRPO (train.grpo.steps > 1). The arithmetic environment with a reward that gives
# partial credit (distinct characters of the answer, under 1; a right answer 1.0): a group of
# samples has a spread from the first step, whatever the tiny champion says.
SPREAD_ENV = '''
from stages.envs import arith

TOOLS, call_tool, gold, MAX_TURNS = arith.TOOLS, arith.call_tool, arith.gold, 2


def reward(task, messages):
    right = arith.reward(task, messages)
    text = "".join(m.get("content") or "" for m in messages if m["role"] == "assistant")
    return 1.0 if right == 1.0 else min(0.99, len(set(text)) / 40)
'''


def on_policy_project(folder):
    """A params.yaml with the spread environment and 40 tasks in `folder`; returns its path."""
    import random as random_

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spread_env.py").write_text(SPREAD_ENV)
    rng = random_.Random(0)
    with (folder / "tasks.jsonl").open("w") as out:
        for i in range(40):
            question = f"{rng.randint(1, 9)}+{rng.randint(1, 9)}"
            out.write(json.dumps({"task_id": f"t{i}", **arith.chat_task(question)}) + "\n")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["base"]["threads"] = 1
    params["environments"] = {"spread": {"module": "spread_env", "tasks": "tasks.jsonl"}}
    params["rollout"]["max_new_tokens"] = 24
    params.setdefault("runtime", {}).setdefault("reward", {})["workers"] = 1
    params["train"].update(algorithm="grpo", batch_size=16, min_examples=1)
    params["train"]["grpo"].update(steps=3, tasks_per_step=6, samples_per_task=4, lr=0.001)
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return folder / "params.yaml"


def on_policy_command(folder, champion, params, rewards="none.parquet"):
    return stage_command(folder, champion, folder / rewards, params) + [
        "--episodes", str(folder / "episodes")]


def test_on_policy_grpo_plays_scores_and_updates_every_step(tmp_path, champion):
    params = on_policy_project(tmp_path)
    run_stage(on_policy_command(tmp_path, champion, params))
    metrics = json.loads((tmp_path / "train.json").read_text())
    assert metrics["online"] is True and metrics["steps"] == 3 and metrics["trained"] is True
    # each step played its own 6 tasks x 4 samples, scored by the environment's reward
    parts = sorted((tmp_path / "episodes").glob("step-*.parquet"))
    assert [p.name for p in parts] == [f"step-0000{i}.parquet" for i in (1, 2, 3)]
    for step, part in enumerate(parts, 1):
        table = pq.read_table(part).to_pylist()
        assert len(table) == 24 and {r["step"] for r in table} == {step}
        assert len({r["task_id"] for r in table}) == 6
        assert all(r["reward"] is not None and r["logprobs"] for r in table)
    log = steps_file(tmp_path)
    assert [int(r["step"]) for r in log] == [1, 2, 3]
    assert all(int(r["groups"]) > 0 and int(r["optimizer_steps"]) > 0 for r in log)
    # generated here, with the weights being trained: the importance weight is 1
    assert all(abs(float(r["is_ratio_mean"]) - 1.0) < 1e-3 for r in log)
    assert gate.weights_hash(tmp_path / "candidate") != gate.weights_hash(champion)
    # the episodes trained on are stored for replay (and the gate's contamination check)
    assert sum(len(pq.read_table(p)) for p in (tmp_path / "replay").glob("*.parquet")) == 72


def test_on_policy_grpo_learns_first_from_the_rollout_stage(tmp_path, champion):
    params = on_policy_project(tmp_path)
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD, BAD, BAD])] * 3)
    run_stage(on_policy_command(tmp_path, champion, params, rewards.name))
    log = steps_file(tmp_path)
    assert int(log[0]["episodes"]) == 12 and float(log[0]["generate_seconds"]) == 0.0
    assert [p.name for p in sorted((tmp_path / "episodes").glob("*.parquet"))] == [
        "step-00002.parquet", "step-00003.parquet"]


def test_on_policy_grpo_killed_resumes_to_the_same_weights(tmp_path, champion):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for folder in (whole, killed):
        params = on_policy_project(folder)
        settings = yaml.safe_load(params.read_text())
        settings["train"]["grpo"]["steps"] = 4
        params.write_text(yaml.safe_dump(settings))
    run_stage(on_policy_command(whole, champion, whole / "params.yaml"))
    proc = subprocess.Popen(on_policy_command(killed, champion, killed / "params.yaml"), cwd=REPO,
                            env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list((killed / "candidate.ckpt").glob("online-*/state.pt")) or \
            not (killed / "episodes" / "step-00002.parquet").exists():
        assert proc.poll() is None and time.time() < deadline, "no step was saved"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "candidate").exists()
    run_stage(on_policy_command(killed, champion, killed / "params.yaml"))
    metrics = json.loads((killed / "train.json").read_text())
    assert metrics["resumed_from_step"] >= 1 and metrics["steps"] == 4
    assert gate.weights_hash(killed / "candidate") == gate.weights_hash(whole / "candidate")
    assert [int(r["step"]) for r in steps_file(killed)] == [1, 2, 3, 4]
    for part in sorted((whole / "episodes").glob("*.parquet")):
        assert pq.read_table(killed / "episodes" / part.name).equals(pq.read_table(part))



def test_on_policy_grpo_stopped_by_a_budget_resumes_to_the_unlimited_weights(tmp_path, champion):
    import resource

    from stages import budget as budgets

    def cpu_now():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
            resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def run(folder, meter):
        params = on_policy_project(folder)
        return train.run(cfg.load("base", params), cfg.load("train", params),
                         folder / "none.parquet", champion, folder / "candidate",
                         folder / "replay", folder / "candidate.ckpt", folder / "steps.csv",
                         specs=cfg.environments(params), root=folder, meter=meter,
                         rollout=cfg.load("rollout", params), reward=cfg.load("reward", params),
                         episodes=folder / "episodes")

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert run(whole, None)["steps"] == 3
    # checked after each step, once its state is saved: the first check stops it
    meter = budgets.Meter("train", cfg.Budget(max_usd=1e-9), cfg.Cost(cpu_hour_usd=0.05),
                          since_cpu=cpu_now())
    with pytest.raises(budgets.BudgetSpent, match=r"done: 1 of 3 on-policy steps \(saved: a "
                                                  r"rerun resumes at step 2\); left to do: 2"):
        run(stopped, meter)
    assert not (stopped / "candidate").exists()  # nothing half-done is left as an output
    assert [p.name for p in (stopped / "episodes").glob("*.parquet")] == ["step-00001.parquet"]
    raised = budgets.Meter("train", cfg.Budget(max_usd=1000.0), cfg.Cost(), since_cpu=cpu_now())
    again = run(stopped, raised)
    assert again["resumed_from_step"] == 1 and again["steps"] == 3
    assert gate.weights_hash(stopped / "candidate") == gate.weights_hash(whole / "candidate")
    for part in sorted((whole / "episodes").glob("*.parquet")):
        assert pq.read_table(stopped / "episodes" / part.name).equals(pq.read_table(part))
    assert [r["step"] for r in steps_file(stopped)] == [r["step"] for r in steps_file(whole)]
    # the stopped attempt's seconds join the resumed run's, in its meter and its metrics
    before = again["before_resume"]
    assert before["cpu_seconds"] > 0 and before["wall_seconds"] > 0
    assert raised.own()["cpu_seconds"] >= before["cpu_seconds"]


def test_on_policy_settings_are_checked(tmp_path):
    with pytest.raises(cfg.ParamsError, match="samples_per_task"):
        train_config(algorithm="grpo", steps=3, samples_per_task=1)


def test_on_policy_grpo_overlapped_plays_one_step_ahead_and_resumes_to_the_same_weights(
        tmp_path, champion):
    """train.grpo.max_staleness: 1: each step's episodes are played while the step before
    trains, with the weights before its update: the log says staleness 1 (the first step's,
    played first, 0), the importance weights are no longer all 1, and a kill after a step and a
    rerun give the uninterrupted run's weights and episodes (the part played ahead is kept)."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for folder in (whole, killed):
        params = on_policy_project(folder)
        settings = yaml.safe_load(params.read_text())
        settings["train"]["grpo"].update(steps=4, max_staleness=1)
        params.write_text(yaml.safe_dump(settings))
    run_stage(on_policy_command(whole, champion, whole / "params.yaml"))
    log = steps_file(whole)
    assert [int(r["step"]) for r in log] == [1, 2, 3, 4]
    assert [int(r["staleness"]) for r in log] == [0, 1, 1, 1]
    assert any(abs(float(r["is_ratio_mean"]) - 1.0) > 1e-4 for r in log[1:]), log
    played = [json.loads(pq.read_schema(part).metadata[b"offseason.played"])["policy_version"]
              for part in sorted((whole / "episodes").glob("step-*.parquet"))]
    assert played == [0, 0, 1, 2]  # each step's episodes by the weights one update before
    proc = subprocess.Popen(on_policy_command(killed, champion, killed / "params.yaml"), cwd=REPO,
                            env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list((killed / "candidate.ckpt").glob("online-*/state.pt")):
        assert proc.poll() is None and time.time() < deadline, "no step was saved"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_stage(on_policy_command(killed, champion, killed / "params.yaml"))
    metrics = json.loads((killed / "train.json").read_text())
    assert metrics["resumed_from_step"] >= 1 and metrics["steps"] == 4
    assert gate.weights_hash(killed / "candidate") == gate.weights_hash(whole / "candidate")
    for part in sorted((whole / "episodes").glob("*.parquet")):
        assert pq.read_table(killed / "episodes" / part.name).equals(pq.read_table(part))


# On-policy GRPO's tasks from the replay (train.replay_fraction): the replay keeps each episode's
# task, so an earlier cycle's task is played again by the steps.
def replay_row(task_id, environment, task):
    """A scored episode as the replay keeps it (`task`: the task played, or None)."""
    return {"task_id": task_id, "completion": "[]", "token_ids": [1, 2, 3],
            "model_mask": [0, 1, 1], "logprobs": [0.0, -1.0, -1.0], "correct": 0.0,
            "reward": 0.5, "environment": environment,
            "task": None if task is None else json.dumps(task)}


OLD_REPLAY = pa.schema([f for f in train.REPLAY if f.name != "task"])  # before it kept tasks


def earlier_replay(folder, monkeypatch):
    """An earlier cycle's replay part holding a task this cycle lacks (`spread:old1`), one of an
    erased trace, one of an environment params.yaml no longer lists and another version of one
    of this cycle's own tasks; and a part in the old schema (no task column).
    """
    monkeypatch.setenv(erasure.SALT_ENV, "test-salt")
    io.write_jsonl(folder / erasure.TOMBSTONES, [
        {"hash": erasure.digest(b"test-salt", "trace", "gone1"), "kind": "trace"}])
    replay = folder / "replay"
    replay.mkdir(parents=True)
    rows = [replay_row("spread:old1", "spread", {"task_id": "old1", **arith.chat_task("7+7")}),
            replay_row("spread:trace:gone1", "spread",
                       {"task_id": "trace:gone1", **arith.chat_task("8+8")}),
            replay_row("dropped:x", "dropped", {"task_id": "x", **arith.chat_task("1+1")}),
            replay_row("spread:t0", "spread", {"task_id": "t0", **arith.chat_task("9+9")})]
    pq.write_table(pa.Table.from_pylist(rows, schema=train.REPLAY), replay / "part-a.parquet")
    old = [{k: v for k, v in replay_row("spread:old2", "spread", None).items() if k != "task"}]
    pq.write_table(pa.Table.from_pylist(old, schema=OLD_REPLAY), replay / "part-b.parquet")


def replay_project(folder):
    """The on-policy project, small: 3 tasks a cycle, 4 drawn a step, 2 samples, 2 steps."""
    params = on_policy_project(folder)
    settings = yaml.safe_load(params.read_text())
    settings["rollout"]["max_tasks"] = 3
    settings["train"]["grpo"].update(steps=2, tasks_per_step=4, samples_per_task=2)
    params.write_text(yaml.safe_dump(settings))
    return params


def run_on_policy(folder, champion, meter=None):
    params = folder / "params.yaml"
    return train.run(cfg.load("base", params), cfg.load("train", params), folder / "none.parquet",
                     champion, folder / "candidate", folder / "replay", folder / "candidate.ckpt",
                     folder / "steps.csv", specs=cfg.environments(params), root=folder,
                     meter=meter, rollout=cfg.load("rollout", params),
                     reward=cfg.load("reward", params), episodes=folder / "episodes")


def test_on_policy_steps_play_an_earlier_cycles_task_from_the_replay(tmp_path, champion,
                                                                     monkeypatch):
    replay_project(tmp_path)
    earlier_replay(tmp_path, monkeypatch)
    metrics = run_on_policy(tmp_path, champion)
    # the pool: the cycle's 3 tasks and the replay's one playable task (the erased trace's, the
    # dropped environment's, the cycle's own t0 and the old part's give none)
    assert (metrics["cycle_tasks"], metrics["replay_tasks_in_pool"],
            metrics["replay_tasks_available"], metrics["replay_tasks_drawn"]) == (3, 1, 1, 2)
    for part in sorted((tmp_path / "episodes").glob("step-*.parquet")):
        rows = pq.read_table(part).to_pylist()
        ids = {r["task_id"] for r in rows}
        assert "spread:old1" in ids and not {"spread:trace:gone1", "dropped:x"} & ids
        old1 = [r for r in rows if r["task_id"] == "spread:old1"]
        # played and scored as the earlier cycle stored it: its question and its answer
        assert len(old1) == 2 and all(r["reward"] is not None for r in old1)
        assert json.loads(old1[0]["task"])["messages"][0]["content"] == "7+7"
        t0 = json.loads(next(r["task"] for r in rows if r["task_id"] == "spread:t0"))
        assert t0["messages"][0]["content"] != "9+9"  # the cycle's own version of its task
    assert [int(r["replay_tasks"]) for r in steps_file(tmp_path)] == [1, 1]
    # this cycle's part keeps the tasks it played, the replayed one too: a later cycle's pool
    mine = [p for p in (tmp_path / "replay").glob("part-*.parquet")
            if p.name not in ("part-a.parquet", "part-b.parquet")]
    stored = pq.read_table(mine[0]).to_pylist()
    assert len(mine) == 1 and all(r["task"] for r in stored)
    assert {r["task_id"] for r in stored} >= {"spread:old1", "spread:t0"}


def test_replay_reads_parts_without_tasks_and_keeps_tasks_in_new_ones(tmp_path, monkeypatch):
    """Parts written before the replay kept tasks: SFT replays their examples as before, and
    they give on-policy GRPO no task; an erased trace's task is never offered."""
    monkeypatch.chdir(tmp_path)  # store_and_replay checks the project's tombstones (none here)
    old = [{k: v for k, v in {**replay_row("spread:old2", "spread", None), "correct": 1.0}
            .items() if k != "task"}]
    replay = tmp_path / "replay"
    replay.mkdir()
    pq.write_table(pa.Table.from_pylist(old, schema=OLD_REPLAY), replay / "part-b.parquet")
    task = {"task_id": "t5", **arith.chat_task("2+5")}
    now = [{**replay_row("spread:t5", "spread", task), "correct": 1.0}]
    chosen, available = train.store_and_replay(now, replay, "sft", 1.0, 0, [])
    assert available == 1 and chosen[0]["task_id"] == "spread:old2"
    new = next(p for p in replay.glob("part-*.parquet") if p.name != "part-b.parquet")
    assert json.loads(pq.read_table(new).column("task")[0].as_py()) == task
    specs = {"spread": None}
    assert train.replay_tasks(replay, specs, [], 1.0, 0, erasure.Tombstones(tmp_path)) == ([], 1)
    assert train.replay_tasks(replay, specs, [("spread", {"task_id": "t0"})], 1.0, 0,
                              erasure.Tombstones(tmp_path)) == ([("spread", task)], 1)
    new.unlink()
    assert train.replay_tasks(replay, specs, [("spread", {"task_id": "t0"})], 1.0, 0,
                              erasure.Tombstones(tmp_path)) == ([], 0)
    # a trace erased since: its task is neither offered nor counted
    earlier_replay(tmp_path / "erased", monkeypatch)
    tombstones = erasure.Tombstones(tmp_path / "erased")
    many = [("spread", {"task_id": f"c{i}"}) for i in range(10)]
    chosen, available = train.replay_tasks(tmp_path / "erased" / "replay", specs, many, 1.0, 0,
                                           tombstones)
    assert [t["task_id"] for _, t in chosen] == ["old1", "t0"] and available == 2
    assert not erasure.Tombstones(tmp_path)  # (the check above is the tombstones' doing)
    chosen, _ = train.replay_tasks(tmp_path / "erased" / "replay", specs, many, 1.0, 0,
                                   erasure.Tombstones(tmp_path))
    assert "trace:gone1" in [t["task_id"] for _, t in chosen]


def test_erase_removes_a_replayed_task_with_its_row(tmp_path):
    """`offseason erase` rewrites replay parts row by row: the erased trace's task goes with its
    row, the other rows keep theirs."""
    from flows.orchestration import erase

    part = tmp_path / "part-a.parquet"
    rows = [replay_row("spread:trace:gone1", "spread",
                       {"task_id": "trace:gone1", **arith.chat_task("8+8")}),
            replay_row("spread:old1", "spread", {"task_id": "old1", **arith.chat_task("7+7")})]
    pq.write_table(pa.Table.from_pylist(rows, schema=train.REPLAY), part)
    assert erase.filter_parquet(part, erase.Found(traces={"gone1"})) == 1
    kept = pq.read_table(part)
    assert kept.schema.equals(train.REPLAY) and b"gone1" not in part.read_bytes()
    assert kept.to_pylist() == rows[1:]


def test_on_policy_replayed_draws_resume_after_a_stop(tmp_path, champion, monkeypatch):
    """A stop after step 1 and a rerun: the rerun draws from the same pool (the replay's task
    included) and gives the uninterrupted run's episodes and weights."""
    from stages import budget as budgets

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    for folder in (whole, stopped):
        replay_project(folder)
        earlier_replay(folder, monkeypatch)
    before = train.replay_tasks(whole / "replay", {"spread": None},
                                [("spread", {"task_id": f"t{i}"}) for i in (0, 1, 10)], 1.0,
                                0, erasure.Tombstones(whole))
    assert run_on_policy(whole, champion)["replay_tasks_drawn"] == 2
    meter = budgets.Meter("train", cfg.Budget(max_usd=1e-9), cfg.Cost(cpu_hour_usd=0.05))
    with pytest.raises(budgets.BudgetSpent):
        run_on_policy(stopped, champion, meter)
    # the pool is in the saved state's name: a replay that changed meanwhile starts afresh
    changed = tmp_path / "changed"
    shutil.copytree(stopped, changed)
    (changed / "replay" / "part-a.parquet").unlink()
    fresh = run_on_policy(changed, champion)
    assert fresh["resumed_from_step"] == 0 and fresh["replay_tasks_drawn"] == 0
    again = run_on_policy(stopped, champion)
    assert again["resumed_from_step"] == 1 and again["replay_tasks_drawn"] == 2
    assert gate.weights_hash(stopped / "candidate") == gate.weights_hash(whole / "candidate")
    for part in sorted((whole / "episodes").glob("*.parquet")):
        assert pq.read_table(stopped / "episodes" / part.name).equals(pq.read_table(part))
    # this cycle's own part, stored at the end, changes nothing in the pool: a run killed
    # after storing it and rerun resumes the same draws
    assert train.replay_tasks(whole / "replay", {"spread": None},
                              [("spread", {"task_id": f"t{i}"}) for i in (0, 1, 10)], 1.0, 0,
                              erasure.Tombstones(whole)) == before
