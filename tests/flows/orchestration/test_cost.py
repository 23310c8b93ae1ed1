"""The cost ledger's exact counts, GPUs through NVML, and budgets that stop a stage mid-way."""

import json
import re
import resource
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, train_config
from tiny_arith import BAD, GOOD, SPECS, build_champion, scored

from flows.orchestration import cost
from stages import budget as budgets
from stages import config as cfg
from stages import gate, io, rollout, train
from stages.envs import arith

pytestmark = pytest.mark.xdist_group("cost")

@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    return build_champion(tmp_path_factory.mktemp("models") / "champion")


def cpu_now():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def validated(tmp_path, questions):
    """Validated traces, each routed to the arith environment's task of its question."""
    path = tmp_path / "validated.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"trace_id": f"tr{i}", "question": json.dumps({**arith.chat_task(q), "environment": "arith"})}
        for i, q in enumerate(questions)]), path)
    return path


def roll(config, tasks, champion, out, meter=None):
    """The rollout stage on the arith environment's trace tasks."""
    return rollout.run(cfg.Base(), config, SPECS, champion, out, validated=tasks, meter=meter)


def test_the_ledgers_token_counts_are_the_rollouts_and_the_batches_own(tmp_path, champion):
    # the rollout: its episodes' own token ids, per environment
    config = cfg.Rollout(samples_per_task=3, max_new_tokens=24, batch_size=8)
    rolled = roll(config, validated(tmp_path, ["2*3", "7+5", "9-4", "3*3"]), champion,
                  tmp_path / "episodes.parquet")
    table = pq.read_table(tmp_path / "episodes.parquet").to_pylist()
    generated = sum(m for row in table for m in row["model_mask"])
    read = sum(len(row["token_ids"]) for row in table) - generated
    calls = sum(row["tool_calls"] for row in table)
    assert generated > 0 and read > 0 and len(table) == 12
    # the training batches: SFT on the verified-correct completions, two whole epochs
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD, GOOD])] * 3 + [("2*3", [BAD])])
    trained = train.run(cfg.Base(), train_config(min_examples=1, batch_size=2, epochs=2),
                        rewards, champion, tmp_path / "candidate", tmp_path / "replay",
                        tmp_path / "candidate.ckpt", tmp_path / "steps.csv")
    examples = {(r["task_id"], r["completion"]): r for r in pq.read_table(rewards).to_pylist()
                if r["correct"] == 1.0}
    assert len(examples) == 3  # one per task: GOOD, once per distinct completion
    # each row trains as the conversation it is: every id a real token, the loss on the
    # model's own ones (its end tokens included)
    tokens = 2 * sum(len(r["token_ids"]) for r in examples.values())
    seen = 2 * sum(sum(r["model_mask"]) for r in examples.values())
    assert trained["trained"] and seen < tokens
    spent = cost.ledger({"rollout": rolled, "train": trained}, {"rollout": True, "train": True},
                        cfg.Cost())
    row = spent["stages"]["rollout"]
    assert (row["generated_tokens"], row["prompt_tokens"], row["tool_calls"]) == (generated, read,
                                                                                  calls)
    assert row["environments"]["arith"] == {"episodes": 12, "generated_tokens": generated,
                                            "prompt_tokens": read, "tool_calls": calls}
    assert (spent["stages"]["train"]["trained_tokens"],
            spent["stages"]["train"]["loss_tokens"]) == (tokens, seen)
    assert spent["total"]["trained_tokens"] == tokens
    assert {"generated_tokens", "trained_tokens", "judge_tokens"} <= set(spent["exact"])
    assert "cpu_seconds" in spent["measured"] and "cpu_seconds" not in spent["exact"]


def test_a_budget_stops_training_mid_way_and_a_raised_one_finishes_as_if_unlimited(
        tmp_path, champion):
    rewards = scored(tmp_path, champion, [("2*3", [GOOD, BAD])] * 6)
    config = train_config(min_examples=1, batch_size=2, epochs=3, checkpoint_steps=1000)

    def run(folder, meter):
        return train.run(cfg.Base(), config, rewards, champion, folder / "candidate",
                         folder / "replay", folder / "candidate.ckpt", folder / "steps.csv",
                         meter=meter)

    whole = run(tmp_path / "whole", None)
    assert whole["steps"] == 9
    stopped = tmp_path / "stopped"
    meter = budgets.Meter("train", cfg.Budget(max_usd=1e-9), cfg.Cost(cpu_hour_usd=0.05),
                          since_cpu=cpu_now())
    with pytest.raises(budgets.BudgetSpent) as err:
        run(stopped, meter)
    message = str(err.value)
    assert "budget.max_usd=1e-09 reached" in message and "1 of 9 optimizer steps" in message
    assert "left to do: 8 steps" in message and "this cycle spent $" in message
    assert not (stopped / "candidate").exists()  # nothing half-done is left as an output
    assert list((stopped / "candidate.ckpt").glob("*/checkpoint-1/trainer_state.json"))
    raised = budgets.Meter("train", cfg.Budget(max_usd=1000.0), cfg.Cost(), since_cpu=cpu_now())
    again = run(stopped, raised)
    assert again["resumed_from_step"] == 1 and again["steps"] == 9
    assert gate.weights_hash(stopped / "candidate") == gate.weights_hash(tmp_path / "whole" /
                                                                         "candidate")
    # the trained tokens count every step, those before the stop too
    assert again["trained_tokens"] == whole["trained_tokens"] > 0
    # and the seconds: the stopped attempt's, noted beside its checkpoint, join the resumed
    # run's, in its meter and its metrics' resources (the ledger); they were lost before
    before = again["before_resume"]
    assert before["cpu_seconds"] > 0 and before["wall_seconds"] > 0
    assert raised.own()["cpu_seconds"] >= before["cpu_seconds"]
    io.write_metrics(tmp_path / "train.json", again, carried=before)
    written = json.loads((tmp_path / "train.json").read_text())["resources"]
    assert written["cpu_seconds"] >= before["cpu_seconds"] + 0.001
    assert whole.get("before_resume") == {}


def test_a_budget_stops_the_rollout_between_batches_and_a_raised_one_gives_the_unlimited_rollouts(
        tmp_path, champion):
    tasks = validated(tmp_path, ["2*3", "1+1", "4+5", "7-2", "3*3", "8+1"])
    config = cfg.Rollout(samples_per_task=4, batch_size=4)  # 24 episodes in 6 batches
    whole, stopped = tmp_path / "whole.parquet", tmp_path / "stopped.parquet"
    before = cpu_now()
    roll(config, tasks, champion, whole)
    batch = (cpu_now() - before) / 6  # CPU seconds of a batch, the model's loading included
    prices = cfg.Cost(cpu_hour_usd=3600.0)  # a dollar a CPU-second: max_usd counts CPU seconds
    # half a batch: the check before the first batch passes, one after a batch stops the stage
    meter = budgets.Meter("rollout", cfg.Budget(max_usd=batch / 2), prices, since_cpu=cpu_now())
    with pytest.raises(budgets.BudgetSpent) as err:
        roll(config, tasks, champion, stopped, meter)
    message = str(err.value)
    assert "budget.max_usd=" in message and "reached" in message, message
    done = re.search(r"done: (\d+) of 24 episodes; left to do: (\d+) episodes", message)
    assert done, message  # between batches: some done, the rest named
    assert 0 < int(done[1]) < 24 and int(done[1]) % 4 == 0 and int(done[2]) == 24 - int(done[1])
    assert not stopped.exists()  # no partial table is left as the stage's output
    # but the finished episodes are kept beside it, and the message says where
    partial = stopped.with_name("stopped.parquet.partial")
    assert len(pq.read_table(partial)) == int(done[1]) and partial.name in message
    raised = budgets.Meter("rollout", cfg.Budget(max_usd=1e6), prices, since_cpu=cpu_now())
    again = roll(config, tasks, champion, stopped, raised)
    assert again["resumed_episodes"] == int(done[1])  # only the rest was played
    kept = ["task_id", "sample", "completion", "token_ids", "model_mask"]
    assert pq.read_table(stopped, columns=kept).to_pylist() == \
        pq.read_table(whole, columns=kept).to_pylist()
    assert not partial.exists()  # used up


def test_a_budget_spent_before_the_rollout_stops_it_naming_the_key(tmp_path, champion):
    before = {"reward": {"cpu_seconds": 0.0, "gpu_seconds": 0.0, "judge_tokens": 900}}
    meter = budgets.Meter("rollout", cfg.Budget(max_judge_tokens=500), cfg.Cost(), before,
                          since_cpu=cpu_now())
    with pytest.raises(budgets.BudgetSpent, match=r"budget.max_judge_tokens=500 reached: this "
                       r"cycle spent 900 judge tokens .*left to do: 4 episodes"):
        roll(cfg.Rollout(samples_per_task=2), validated(tmp_path, ["2*3", "1+1"]), champion,
             tmp_path / "r.parquet", meter)
    assert not (tmp_path / "r.parquet").exists()
    with pytest.raises(cfg.ParamsError, match="budget.max_usd: must be >= 0"):
        cfg.Budget(max_usd=-1)


def test_prices_by_gpu_name_by_judge_model_and_for_a_billing_rollout_server():
    prices = cfg.Cost(cpu_hour_usd=0.0, gpu_hour_usd=3.0, gpu_hour_usd_by_name={"A10G": 1.0},
                      judge_usd_per_million_tokens=2.0,
                      judge_usd_per_million_tokens_by_model={"judge-mini": 0.5},
                      rollout_usd_per_million_tokens=10.0)
    hour = 3600.0
    two_gpus = {"resources": {"wall_seconds": hour, "cpu_seconds": 5.0, "gpus": [
        {"index": 0, "name": "NVIDIA A10G", "busy_seconds": 100.0},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "busy_seconds": 50.0}]}}
    row = cost.stage_row(two_gpus, 0, prices)
    assert row["gpu_seconds"] == 2 * hour and row["usd"] == 1.0 + 3.0  # each GPU at its rate
    judged = {"resources": {"wall_seconds": 1.0, "cpu_seconds": 1.0}, "judges": [
        {"judge": "judge-mini/rubric-ab12", "tokens": 2_000_000, "requests": 10},
        {"judge": "judge-large/rubric-cd34", "tokens": 1_000_000, "requests": 5}]}
    row = cost.stage_row(judged, 0, prices)
    assert row["judge_tokens_by_model"] == {"judge-mini": 2_000_000, "judge-large": 1_000_000}
    assert row["usd"] == 2 * 0.5 + 1 * 2.0
    served = {"resources": {"wall_seconds": 1.0, "cpu_seconds": 1.0}, "backend": "openai",
              "prompt_tokens": 300_000, "generated_tokens": 200_000}
    row = cost.stage_row(served, 0, prices)
    assert row["served_tokens"] == 500_000 and row["usd"] == 5.0
    # a rollout on this machine's transformers is no billed tokens
    assert cost.stage_row({**served, "backend": "transformers"}, 0, prices)["usd"] == 0.0
    # the budget's meter prices a judge's tokens as its model's
    meter = budgets.Meter("reward", cfg.Budget(max_usd=1.5), prices, since_cpu=cpu_now(),
                          judge="judge-mini")
    meter.check("some", "the rest", judge_tokens=2_000_000)  # $1.00: under
    with pytest.raises(budgets.BudgetSpent, match="budget.max_usd=1.5 reached"):
        meter.check("more", "the rest", judge_tokens=3_000_000)  # $1.50
    with pytest.raises(cfg.ParamsError, match="cost.gpu_hour_usd_by_name.H100: must be >= 0"):
        cfg.Cost(gpu_hour_usd_by_name={"H100": -1.0})


def test_the_months_budget_counts_the_committed_cycles_of_the_month_inside_the_stages(
        tmp_path):
    import datetime as dt
    import json
    import os
    import subprocess

    import yaml

    now = dt.datetime.now(dt.timezone.utc)
    last_month = (now.replace(day=1) - dt.timedelta(days=2)).isoformat()

    def commit(usd: float, tag: str, when: str | None = None):
        (tmp_path / "metrics").mkdir(exist_ok=True)
        (tmp_path / "metrics/cost.json").write_text(json.dumps({"total": {"usd": usd}}))
        env = {**os.environ, **({"GIT_COMMITTER_DATE": when, "GIT_AUTHOR_DATE": when}
                                if when else {})}
        for cmd in (["git", "add", "-A"], ["git", "-c", "user.name=t", "-c", "user.email=t@t",
                                           "commit", "-qm", tag], ["git", "tag", tag]):
            subprocess.run(cmd, cwd=tmp_path, env=env, check=True)

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    commit(5.0, "gen-1", last_month)  # last month's: not this month's spend
    commit(0.75, "gen-2")
    commit(0.5, "gen-3")
    assert budgets.month_spent(tmp_path) == (1.25, ["gen-2", "gen-3"])
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"budget": {"monthly_usd": 1.5},
                                      "cost": {"cpu_hour_usd": 3600.0}}))
    meter = budgets.Meter.of("train", params)
    assert meter.month == 1.25 and meter.limited
    meter.since_cpu = cpu_now()  # this process's work so far is not the stage's
    meter.check("nothing yet", "everything")  # $1.25 + about $0: under
    meter.month = 1.5  # another cycle committed meanwhile: the month is spent
    with pytest.raises(budgets.BudgetSpent, match=r"budget.monthly_usd=1.5 reached: .* this "
                                                  r"month with the committed cycles"):
        meter.check("step 1", "8 steps")


def test_without_a_gpu_the_ledger_has_no_gpu_figures_and_says_what_it_sampled():
    if io.watch_gpus() is not None:
        pytest.skip("a GPU is here: test_nvml_samples_a_busy_gpu covers it")
    assert "gpus" not in io.resources()
    row = cost.stage_row({"resources": io.resources()}, 0, cfg.Cost())
    assert row["gpu_seconds"] == 0 and row["gpu_busy_seconds"] == 0 and "gpus" not in row


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert io.visible_gpus(4) == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert io.visible_gpus(4) == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert io.visible_gpus(4) == []


@pytest.mark.gpu
def test_nvml_samples_a_busy_gpu():
    torch = pytest.importorskip("torch")
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install .[gpu])")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    watch = io.watch_gpus(interval=0.1)
    assert watch is not None
    x = torch.randn(4096, 4096, device="cuda")
    deadline = __import__("time").monotonic() + 3
    while __import__("time").monotonic() < deadline:
        x = (x @ x).clamp(-1, 1)
    torch.cuda.synchronize()
    used = io.resources()["gpus"]
    mine = used[0]
    assert mine["busy_seconds"] > 0.5 and mine["peak_memory_mb"] > 64
    assert 0 < mine["mean_utilisation"] <= 100 and mine["samples"] > 5
    row = cost.stage_row({"resources": io.resources()}, 0, cfg.Cost())
    assert row["gpu_count"] == len(used) and row["gpu_busy_seconds"] > 0.5


def test_gpus_counted_without_nvml_are_priced_and_budgeted_for_the_wall_time(tmp_path):
    """Where NVML cannot be read, the GPUs torch sees are counted (io.HeldGpus), each held for
    the stage's wall time: the ledger prices them and `budget.max_gpu_hours` trips (issue 51.3:
    they counted 0 and the budget never tripped). Two devices of a DeepSpeed run, 30 minutes."""
    import yaml

    held = io.HeldGpus(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"])
    metrics = {"resources": {"wall_seconds": 1800.0, "cpu_seconds": 10.0,
                             "gpus": held.summary()}}
    row = cost.stage_row(metrics, 0, cfg.Cost())
    assert row["gpu_count"] == 2 and row["gpu_seconds"] == 3600.0 and row["gpu_busy_seconds"] == 0
    assert budgets.units_of(metrics)["gpu_seconds"] == 3600.0
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"budget": {"max_gpu_hours": 0.5}}))
    meter = budgets.Meter.of("train", params)
    meter.before = {"rollout": budgets.units_of(metrics)}  # an hour of two GPUs spent before
    with pytest.raises(budgets.BudgetSpent, match=r"budget.max_gpu_hours=0.5"):
        meter.check("step 1", "8 steps")


@pytest.mark.gpu
def test_without_nvml_the_gpus_torch_sees_are_counted():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = ("import sys; sys.modules['pynvml'] = None\n"  # as without nvidia-ml-py
            "from stages import io\n"
            "held = io.watch_gpus()\n"
            "print(type(held).__name__, len(io.resources()['gpus']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.split()
    assert out == ["HeldGpus", str(torch.cuda.device_count())], out


def test_the_estimate_fits_a_fixed_part_and_a_rate_and_says_its_spread():
    # a stage with a start-up cost of 5 s and 0.1 s a unit: the line, not the ratio
    assert cost.predict([(10, 6.0), (50, 10.0)], 100) == [15.0, 15.0, 15.0]
    low, middle, high = cost.predict([(10, 6.5), (30, 7.5), (50, 10.0)], 100)
    assert low < middle < high and 14 < middle < 16
    # units too alike to separate the parts: a rate alone
    assert cost.predict([(50, 10.0), (51, 10.4)], 100)[1] == pytest.approx(100 * 20.4 / 101,
                                                                           abs=1e-3)
    # more units cost no more (the demo's train stage: start-up, one step): a fixed cost
    assert cost.predict([(1.0, 9.084), (3.0, 8.581)], 4.5) == [8.581, 8.832, 9.084]
    assert cost.predict([], 10) == [0.0, 0.0, 0.0]


SLOW_REWARD = '''
import time
from pathlib import Path

from stages.envs import arith

TOOLS, call_tool, gold = arith.TOOLS, arith.call_tool, arith.gold


def reward(task, messages):
    end = time.process_time() + 0.01  # 10 ms of CPU a score: what the budget meters
    while time.process_time() < end:
        pass
    with open(Path(__file__).with_name("calls.txt"), "a") as calls:
        calls.write(task["task_id"] + "\\n")
    return arith.reward(task, messages)
'''


def test_a_budget_stops_the_reward_stage_mid_way_and_a_raised_one_gives_the_unlimited_rewards(
        tmp_path, champion):
    from tiny_arith import episodes

    from stages import reward

    (tmp_path / "slow_env.py").write_text(SLOW_REWARD)
    specs = {"arith": cfg.EnvironmentSpec(module="slow_env")}
    rollouts = tmp_path / "rollouts.parquet"
    groups = [(f"{a}+{b}", [GOOD, BAD, reward_bad, GOOD]) for a, b, reward_bad in
              [(1, 2, BAD), (3, 4, GOOD), (2, 2, BAD), (5, 1, BAD), (6, 3, GOOD), (7, 1, BAD),
               (2, 8, BAD), (4, 4, GOOD), (9, 1, BAD), (3, 3, BAD), (5, 5, GOOD), (1, 1, BAD)]]
    pq.write_table(pa.Table.from_pylist(episodes(champion, groups), schema=rollout.SCHEMA),
                   rollouts)
    # a gold check per task, a score per distinct episode (a group's four are two answers, each
    # twice: identical episodes share one score): 10 ms of CPU each
    jobs = 12 + 24
    calls = tmp_path / "calls.txt"
    config = cfg.Reward(workers=1)  # in this process: its CPU is what the meter reads
    whole, stopped = tmp_path / "whole.parquet", tmp_path / "stopped.parquet"
    reward.run(config, rollouts, whole, specs, tmp_path)
    assert len(calls.read_text().split()) == jobs
    calls.unlink()
    prices = cfg.Cost(cpu_hour_usd=3600.0)  # a dollar a CPU-second: max_usd counts CPU seconds
    # half the scores' CPU: the gold checks pass, a check after a later score (one after each
    # result) stops the stage
    meter = budgets.Meter("reward", cfg.Budget(max_usd=jobs * 0.01 / 2), prices,
                          since_cpu=cpu_now())
    with pytest.raises(budgets.BudgetSpent) as err:
        reward.run(config, rollouts, stopped, specs, tmp_path, meter=meter)
    message = str(err.value)
    assert "budget.max_usd=" in message and "reached" in message, message
    assert re.search(r"done: \d+ of 24 scores; left to do: \d+ scores", message), message
    assert not stopped.exists()  # no partial table is left as the stage's output
    partial = stopped.with_name("stopped.parquet.partial")
    kept = len(pq.read_table(partial))
    assert partial.name in message and f"{kept} finished scores are kept" in message
    done = len(calls.read_text().split())
    assert 12 < done < jobs and kept == done
    calls.unlink()
    raised = budgets.Meter("reward", cfg.Budget(max_usd=1e6), prices, since_cpu=cpu_now())
    again = reward.run(config, rollouts, stopped, specs, tmp_path, meter=raised)
    assert again["resumed_scores"] == kept
    assert len(calls.read_text().split()) == jobs - done  # only the rest was scored
    assert pq.read_table(stopped).equals(pq.read_table(whole))
    assert not partial.exists()  # used up
