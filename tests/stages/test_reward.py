"""The reward stage: each environment's own reward, its gold checked first, a broken reward an
error with its cause (never a zero), re-scoring after an environment changed, and the fan-out:
the same rewards in this process, in local worker processes and on a Ray cluster.

    pytest -q tests/stages/test_reward.py
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from flows import cli
from stages import config as cfg
from stages import io, reward, rollout
from stages.envs import coding, contract, toolcall

REPO = Path(__file__).resolve().parents[2]
INLINE = cfg.Reward(workers=1)
TOOLCALL = {"toolcall": cfg.EnvironmentSpec(module="stages.envs.toolcall")}

# a user's environment in the test's folder: what its reward says for an answer, a gold, and a
# reward that breaks (a grader that timed out) or cannot judge
FLAKY = '''
TOOLS = []
VERSION = "flaky@1"


def reward(task, messages):
    said = messages[-1]["content"]
    if said == "boom":
        raise TimeoutError("the grader timed out")
    if said == "?":
        return None
    return {"answer": float(said == task["answer"])}


def gold(task):
    return [{"role": "assistant", "content": task["answer"]}]
'''


def flaky(root: Path) -> dict:
    (root / "flaky_env.py").write_text(FLAKY)
    return {"flaky": cfg.EnvironmentSpec(module="flaky_env")}


def table(rows: list[tuple[str, dict, list]]) -> pa.Table:
    """Rollouts (environment, task, the messages added to the task's) in the stage's schema."""
    return pa.Table.from_pylist([
        {"task_id": f"{name}:{task['task_id']}", "environment": name, "sample": i,
         "task": json.dumps(task), "messages": json.dumps(task["messages"] + added),
         "completion": json.dumps(added), "token_ids": [], "model_mask": [], "logprobs": [],
         "finish": "eos", "tool_calls": 0, "tool_errors": 0, "error": None, "turns": []}
        for i, (name, task, added) in enumerate(rows)], schema=rollout.SCHEMA)


def write(tmp_path, rows, name="rollouts.parquet"):
    path = tmp_path / name
    pq.write_table(table(rows), path)
    return path


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def asked(task_id: str, gold: str) -> dict:
    return {"task_id": task_id, "messages": [{"role": "user", "content": "?"}], "answer": gold}


def call(name, arguments) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def toolcall_rows():
    """Every task of the toolcall task file, answered right, with the wrong tool, malformed (the
    chat path answers the call it could not parse as a tool error) and with bad arguments."""
    rows = []
    for task in contract.load_tasks(REPO / "data/tasks/toolcall.jsonl", "toolcall"):
        expected = task["expected"]
        rows += [("toolcall", task, added) for added in (
            toolcall.gold(task), [call("no_such_tool", expected["arguments"] or {})],
            [{"role": "assistant", "content": '<tool_call>{"name": ' + expected["name"]},
             {"role": "tool", "tool_call_id": "call_malformed_0", "content": "Error: no call"}],
            [call(expected["name"], {"bogus": 1})])]
    return rows


def test_components_are_kept_and_the_reward_is_their_mean(tmp_path):
    m = reward.run(INLINE, write(tmp_path, toolcall_rows()), tmp_path / "rewards.parquet",
                   TOOLCALL)
    out = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert m["tasks"] == 20 and m["tasks_set_aside"] == 0 and m["errors"] == 0
    assert [r["correct"] for r in out[:4]] == [1.0, 0.0, 0.0, 0.0]
    assert [r["score_format"] for r in out[:4]] == [1.0, 1.0, 0.0, 1.0]
    assert [r["score_tool_ok"] for r in out[:4]] == [1.0, 0.0, 0.0, 0.0]
    assert [r["score_right_tool"] for r in out[:4]] == [1.0, 0.0, 0.0, 1.0]
    assert [r["score_arguments_valid"] for r in out[:4]] == [1.0, 0.0, 0.0, 0.0]
    assert [r["reward"] for r in out[:4]] == [1.0, 0.2, 0.0, 0.4]  # the mean of the five
    assert all(r["verifier"] == "toolcall/json-schema@1" for r in out)
    assert m["pass_at_k"] == 1.0
    assert m["environments"]["toolcall"]["verifier"] == "toolcall/json-schema@1"


def test_gold_check_sets_tasks_aside(tmp_path):
    good = contract.load_tasks(REPO / "data/tasks/toolcall.jsonl", "toolcall")[0]
    # expected arguments its own schema rejects: the gold call cannot score full marks
    broken = {**good, "task_id": "bad", "expected": {"name": "get_weather",
                                                    "arguments": {"city": 3}}}
    path = write(tmp_path, [("toolcall", good, [call("get_weather", {"city": "Paris"})]),
                            ("toolcall", broken, [call("get_weather", {"city": 3})]),
                            ("toolcall", broken, [call("get_weather", {"city": "Paris"})])])
    m = reward.run(INLINE, path, tmp_path / "rewards.parquet", TOOLCALL)
    out = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert (m["tasks_set_aside"], m["judged"], m["errors"]) == (1, 1, 0)
    assert out[0]["reward"] == 1.0 and out[0]["error"] is None
    assert all(r["reward"] is None and r["correct"] is None for r in out[1:])
    assert out[1]["error"].startswith("task set aside: environment 'toolcall'")
    assert "task 'bad': gold() messages[0] calls a tool wrongly" in out[1]["error"]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_reward_that_raises_is_an_error_with_its_cause(tmp_path, workers):
    specs = flaky(tmp_path)
    rows = [("flaky", asked("ok", "6"), answer("6")), ("flaky", asked("broke", "6"), answer("boom"))]
    # with 2 workers the user's module is loaded in the worker processes, by its name and the
    # project folder, and the error crosses the process boundary as text
    out, m = reward.score(specs, table(rows), tmp_path, cfg.Reward(workers=workers))
    out = out.to_pylist()
    assert m["errors"] == 1 and m["judged"] == 1 and out[0]["reward"] == 1.0
    assert out[1]["reward"] is None and out[1]["correct"] is None  # never a zero
    assert out[1]["error"] == ("environment 'flaky' (module 'flaky_env'): reward() raised "
                               "TimeoutError: the grader timed out")
    with pytest.raises(reward.VerifierBroken, match="no rollout could be scored: 1 errors.*"
                                                    "TimeoutError"):
        reward.score(specs, table(rows[1:]), tmp_path, INLINE)


def test_more_errors_than_max_error_fraction_fail_the_stage(tmp_path):
    # a judge answering garbage for most episodes trained a cycle on the few it scored; now more
    # than reward.max_error_fraction (0.5) failing is a broken scorer, naming the knob
    specs = flaky(tmp_path)
    rows = [("flaky", asked("t", "6"), answer(said)) for said in ("6", "boom", "boom")]
    with pytest.raises(reward.VerifierBroken, match=r"2 of 3 episodes could not be scored \(67%, "
                       r"more than reward.max_error_fraction=0.5\), e.g. .*TimeoutError"):
        reward.score(specs, table(rows), tmp_path, INLINE)
    _, m = reward.score(specs, table(rows), tmp_path,
                        cfg.Reward(workers=1, max_error_fraction=0.7))
    assert (m["errors"], m["judged"]) == (2, 1)
    with pytest.raises(cfg.ParamsError, match="reward.max_error_fraction: must be between 0 and 1, got 1.5"):
        cfg.Reward(max_error_fraction=1.5)


def test_unjudgeable_rollouts_are_counted_and_dropped(tmp_path):
    rows = [("flaky", asked("t", "6"), answer("6")), ("flaky", asked("t", "6"), answer("?"))]
    out, m = reward.score(flaky(tmp_path), table(rows), tmp_path, INLINE)
    assert (m["judged"], m["unjudgeable"], m["errors"], m["mean_reward"]) == (1, 1, 0, 1.0)
    assert out.to_pylist()[1]["reward"] is None and out.to_pylist()[1]["error"] is None


def test_weights_in_params(tmp_path):
    def load(reward_section):
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump({"reward": reward_section}))
        return cfg.load("reward", path)

    assert load({"weights": {"feedback": 1}}).weights == {"feedback": 1.0}
    assert load({}).weights == {"feedback": 0.0}
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights\.feedbak: unknown reward component "
                                              r"\(did you mean 'reward\.weights\.feedback'\?\)"):
        load({"weights": {"feedbak": 1.0}})
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights\.feedback: expected a number"):
        load({"weights": {"feedback": "high"}})
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights: expected a mapping"):
        load({"weights": [1.0]})
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights\.feedback: must be >= 0"):
        load({"weights": {"feedback": -1}})


# A local Ray cluster in a network namespace of its own with only loopback up: Ray binds the host's
# network address whatever it is told, and the tests talk to 127.0.0.1 only. The cluster, the
# reward stage connecting to it by its address (as DVC runs it), and a look at what listens, all
# inside it.
RAY_IN_NETNS = r"""
import json, os, subprocess, sys
import ray, yaml
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 ** 2,
         log_to_driver=False)
address = ray.get_runtime_context().gcs_address
params, table, out, metrics = sys.argv[1:5]
with open(params) as f:
    settings = yaml.safe_load(f)
settings["runtime"] = {"reward": {"ray_address": address}}
with open(params, "w") as f:
    yaml.safe_dump(settings, f)
subprocess.run([sys.executable, "-m", "stages.reward", table, out, metrics, "--params", params],
               check=True)
listening = set()
for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(name).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            host = local.split(":")[0]
            loopback = {"0100007F", "0000000000000000FFFF00000100007F",  # v4, v4-mapped v6
                        "00000000000000000000000001000000"}  # ::1
            listening.add("loopback" if host in loopback else "any" if set(host) == {"0"}
                          else host)
ray.shutdown()
print(json.dumps({"address": address, "listening": sorted(listening)}))
"""


def netns_available() -> bool:
    """Whether this machine lets the tests make a network namespace (root, unshare, ip)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                          capture_output=True).returncode == 0


def code_rows() -> list:
    """Two code tasks, each answered by its reference solution and by code that fails its
    tests (the sandbox runs each, gold checks included)."""
    tasks = contract.load_tasks(REPO / "data/tasks/code.jsonl", "code")[:2]
    return [("code", task, added) for task in tasks
            for added in (coding.gold(task), answer("```python\ndef nothing():\n    pass\n```"))]


@pytest.mark.skipif(not netns_available(), reason="Ray runs only in a loopback-only network "
                    "namespace here (needs root, unshare and ip)")
def test_in_process_workers_and_ray_give_identical_rewards(tmp_path):
    specs = {**TOOLCALL, **flaky(tmp_path),
             "code": cfg.EnvironmentSpec(module="stages.envs.coding")}
    rows = toolcall_rows()[:12] + code_rows() + [
        ("flaky", asked(f"x{i}", "6"), answer(said))
        for i, said in enumerate(["6", "7", "boom", "?"])]
    path = write(tmp_path, rows)
    here, m_here = reward.score(specs, pq.read_table(path), tmp_path, INLINE)
    pooled, m_pool = reward.score(specs, pq.read_table(path), tmp_path, cfg.Reward(workers=2))
    assert pooled.equals(here) and m_pool == m_here
    assert m_here["errors"] == 1 and m_here["unjudgeable"] == 1 and m_here["episodes"] == len(rows)
    assert m_here["environments"]["code"]["correct_episodes"] == 2
    # the stage as DVC runs it, its params in the project folder, connecting to the cluster by
    # its address: every environment's module loaded in Ray's workers
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "reward": {}, "environments": {name: {"module": spec.module}
                                       for name, spec in specs.items()}}))
    ran = subprocess.run(
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1" "$2" "$3" "$4" "$5"',
         sys.executable, RAY_IN_NETNS, str(tmp_path / "params.yaml"), str(path),
         str(tmp_path / "ray.parquet"), str(tmp_path / "ray.json")],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen["address"].startswith("127.0.0.1:")
    # only loopback (or every address, of which this namespace has no other) is listened on
    assert "loopback" in seen["listening"] and set(seen["listening"]) <= {"loopback", "any"}, seen
    assert pq.read_table(tmp_path / "ray.parquet").equals(here)
    on_ray = json.loads((tmp_path / "ray.json").read_text())
    assert on_ray.pop("runtime") == {"workers": 0, "ray_address": seen["address"],
                                     "stall_seconds": 300.0}
    assert on_ray.pop("resources")["cpu_seconds"] > 0  # what the stage used (measured)
    assert on_ray == json.loads(json.dumps(m_here))


# a user's environment, strict then lenient (VERSION 2: case and spaces no longer matter)
GRADER = '''
TOOLS = []
VERSION = "{version}"


def reward(task, messages):
    said = messages[-1].get("content") or ""
    if {lenient}:
        said = said.strip().lower()
    return {{"answer": float(said == task["answer"])}}
'''


def chat_rewards(tmp_path: Path, answers: list[str]) -> Path:
    """A rewards table of the `grader` environment (strict, grader@1), as the reward stage
    writes it: one task, one rated trace task, and one episode whose tool call broke."""
    (tmp_path / "grader_v1.py").write_text(GRADER.format(version="grader@1", lenient=False))
    (tmp_path / "grader_v2.py").write_text(GRADER.format(version="grader@2", lenient=True))
    task = {"task_id": "t1", "answer": "paris",
            "messages": [{"role": "user", "content": "Capital of France?"}]}
    rows = [{"task_id": task_id, "environment": "grader", "task": json.dumps(task), "sample": i,
             "messages": json.dumps(task["messages"] + [{"role": "assistant", "content": a}]),
             "error": error}
            for i, (task_id, a, error) in enumerate(
                [("t1", answers[0], None), ("t1", answers[1], None),
                 ("grader:trace:tr9", answers[2], None),
                 ("t1", "", "environment 'grader' (module 'grader_v1'): call_tool('x') raised "
                            "KeyError: 'x'")])]
    io.write_parquet(tmp_path / "rollouts.parquet", pa.Table.from_pylist(rows))
    specs = {"grader": cfg.EnvironmentSpec(module="grader_v1")}
    feedback = {"tr9": (1.0, answers[2])}  # a user's thumbs-up on production's answer
    out, _ = reward.score(specs, pq.read_table(tmp_path / "rollouts.parquet"), tmp_path, INLINE,
                          feedback)
    io.write_parquet(tmp_path / "rewards.parquet", out)
    return tmp_path / "rewards.parquet"


STRICT = {"grader": cfg.EnvironmentSpec(module="grader_v1")}
LENIENT = {"grader": cfg.EnvironmentSpec(module="grader_v2")}


def test_rescore_after_an_environment_changed(tmp_path):
    """Each row re-scored by its own environment's current verifier, a user's rating kept as the
    same `feedback` component, a tool call that broke at rollout still an error."""
    stored = chat_rewards(tmp_path, ["Paris", "paris", " PARIS "])
    before = pq.read_table(stored).to_pylist()
    assert [r["correct"] for r in before] == [0.0, 1.0, 0.0, None]
    assert before[2]["score_feedback"] == 1.0 and before[3]["error"].endswith("KeyError: 'x'")
    same = reward.rescore(INLINE, stored, tmp_path / "same.parquet", STRICT, root=tmp_path)
    assert same["rescored"] == 0 and same["verifier"] == "grader/grader@1"
    assert pq.read_table(tmp_path / "same.parquet").equals(pq.read_table(stored))
    summary = reward.rescore(INLINE, stored, tmp_path / "rescored.parquet", LENIENT,
                             root=tmp_path)
    after = pq.read_table(tmp_path / "rescored.parquet").to_pylist()
    assert [r["correct"] for r in after] == [1.0, 1.0, 1.0, None]
    assert all(r["verifier"] == "grader/grader@2" for r in after)
    assert after[2]["score_feedback"] == 1.0 and after[2]["score_answer"] == 1.0
    assert before[2]["reward"] < 1.0 and after[2]["reward"] == 1.0  # the answer's component rose
    assert after[3]["error"] == before[3]["error"] and after[3]["reward"] is None
    assert summary["rescored"] == 4 and summary["changed"] == 2 and summary["became_correct"] == 2
    assert summary["from_verifiers"] == {"grader/grader@1": 4}
    assert [(e["task_id"], e["sample"]) for e in summary["examples"]] == [
        ("t1", 0), ("grader:trace:tr9", 2)]
    assert [r["messages"] for r in after] == [r["messages"] for r in before]  # rollouts kept
    assert pq.read_table(stored).column("verifier")[0].as_py() == "grader/grader@1"  # kept
    # a table of the retired tag protocol is named, with why it cannot be re-scored
    tag = tmp_path / "tag.parquet"
    pq.write_table(pa.Table.from_pylist([{"task_id": "t0", "question": "2*3", "answer": "6",
                                          "completion": "answer:6"}]), tag)
    with pytest.raises(ValueError, match=r"tag\.parquet: not a rollouts or rewards table \(no "
                                         r"environment, task, messages column\).*retired tag"):
        reward.rescore(INLINE, tag, tmp_path / "x.parquet", LENIENT, root=tmp_path)


def project_params(root: Path) -> None:
    """The repository's params.yaml with the lenient grader as the one environment (its
    benchmark a task of its own), scored in the command's own process."""
    params = yaml.safe_load((cli.find_root() / "params.yaml").read_text())
    params.setdefault("runtime", {}).setdefault("reward", {})["workers"] = 1
    (root / "bench.jsonl").write_text(json.dumps({
        "task_id": "b1", "answer": "rome",
        "messages": [{"role": "user", "content": "Capital of Italy?"}]}) + "\n")
    params["environments"] = {"grader": {"module": "grader_v2", "benchmark": "bench.jsonl"}}
    params["gate"]["primary"] = "grader"
    (root / "params.yaml").write_text(yaml.safe_dump(params))


def test_rescore_command(tmp_path, monkeypatch, capsys):
    chat_rewards(tmp_path, ["Paris", "paris", " PARIS "])
    (tmp_path / "dvc.yaml").write_text((cli.find_root() / "dvc.yaml").read_text())
    project_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["rescore", "--output", "data/rescored.parquet"]) == 2  # no data/rewards
    assert "data/rewards.parquet: no stored rewards" in capsys.readouterr().err
    assert cli.main(["rescore", "rewards.parquet", "--output", "data/rescored.parquet"]) == 0
    summary = json.loads((tmp_path / "data" / "rescored.json").read_text())
    assert summary["changed"] == 2 and summary["verifier"] == "grader/grader@2"
    assert "2 rewards changed" in capsys.readouterr().err
    assert pq.read_table(tmp_path / "data" / "rescored.parquet").num_rows == 4


def test_rescore_a_generation_from_its_tag(tmp_path, monkeypatch, capsys):
    # a project whose cycle 1 left data/rewards.parquet in DVC, tagged gen-1, since removed
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    chat_rewards(root / "data", ["Paris", "paris", " PARIS "])
    for name in ("rollouts.parquet", "grader_v1.py"):
        (root / "data" / name).unlink()
    shutil.move(root / "data" / "grader_v2.py", root / "grader_v2.py")
    project_params(root)
    (root / "dvc.yaml").write_text("stages: {}\n")  # the rewards tracked by `dvc add` here
    bin_dir = cli.Path(sys.executable).parent
    for cmd in (["git", "init", "-q", "-b", "main"], [str(bin_dir / "dvc"), "init", "-q"],
                [str(bin_dir / "dvc"), "add", "-q", "data/rewards.parquet"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "gen-1"],
                ["git", "tag", "gen-1"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    (root / "data" / "rewards.parquet").unlink()
    monkeypatch.chdir(root)
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    assert cli.main(["rescore", "--generation", "2"]) == 2
    assert "no generation 2 (git tag gen-2)" in capsys.readouterr().err
    assert cli.main(["rescore", "--generation", "1", "--output", "gen1.parquet"]) == 0
    summary = json.loads((root / "gen1.json").read_text())
    assert summary["input"].endswith(".offseason/rewards-gen-1.parquet")
    assert summary["rescored"] == 4 and summary["changed"] == 2


# a reward that never returns for one answer while a flag file exists: a grader wedged on a
# dead service (the module's text stays the same when it recovers, so kept scores stay valid)
WEDGED = '''
import time
from pathlib import Path

TOOLS = []
VERSION = "wedged@1"


def reward(task, messages):
    if messages[-1]["content"] == "hang" and Path(__file__).with_name("wedged.flag").exists():
        time.sleep(3600)
    return {"answer": float(messages[-1]["content"] in (task["answer"], "hang"))}
'''


def test_a_wedged_worker_fails_the_stage_within_its_stall_bound_and_keeps_what_finished(tmp_path):
    """A reward that never returns in a worker process: the stage fails once nothing has been
    scored for runtime.reward.stall_seconds, naming where it waited and how far it got; the
    wedged worker is ended (issue 51.4: it held the stage for ever), the finished scores are kept,
    and once the grader recovers the rerun scores only the rest, to the table an unstopped run
    writes."""
    (tmp_path / "wedged_env.py").write_text(WEDGED)
    specs = {"wedged": cfg.EnvironmentSpec(module="wedged_env")}
    rows = [("wedged", asked(f"t{i}", "6"), answer("6" if i % 2 else "7")) for i in range(6)]
    rows.append(("wedged", asked("t-hang", "6"), answer("hang")))
    rollouts = write(tmp_path, rows)
    config = cfg.Reward(workers=2, stall_seconds=3)
    unstopped, _ = reward.score(specs, table(rows), tmp_path, config)
    (tmp_path / "wedged.flag").touch()
    out = tmp_path / "rewards.parquet"
    with pytest.raises(reward.Stalled) as err:
        reward.run(config, rollouts, out, specs, root=tmp_path)
    message = str(err.value)
    assert "runtime.reward.stall_seconds=3" in message and "runtime.reward.workers=2" in message
    assert "(6 of 7 done" in message, message  # all but the wedged one
    # the 7 gold checks and the 6 scores (the gold checks were not kept before)
    assert "13 finished scores are kept in rewards.parquet.partial" in message, message
    (tmp_path / "wedged.flag").unlink()  # the grader's service is back
    metrics = reward.run(config, rollouts, out, specs, root=tmp_path)
    assert metrics["resumed_scores"] == 13
    assert pq.read_table(out).equals(unstopped)
    assert not (tmp_path / "rewards.parquet.partial").exists()
