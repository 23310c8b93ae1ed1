import json
import os
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
from stages.envs import arith, toolcall
from stages.envs.registry import load_tasks

TOOLCALL = cfg.Base(environment="toolcall")
INLINE = cfg.Reward(workers=1)


def table(rows: list[tuple[str, str, str, str]]) -> pa.Table:
    """Rollouts (task_id, question, answer, completion), the rollout stage's schema."""
    return pa.Table.from_pylist([
        {"task_id": task_id, "trace_id": task_id, "sample": i, "question": question,
         "answer": answer, "prompt": question, "completion": completion, "token_ids": [],
         "model_mask": [], "logprobs": [], "finish": "eos", "tool_calls": 0}
        for i, (task_id, question, answer, completion) in enumerate(rows)], schema=rollout.SCHEMA)


def write(tmp_path, rows, name="rollouts.parquet"):
    path = tmp_path / name
    pq.write_table(table(rows), path)
    return path


def call(name, arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def toolcall_rows():
    """Every suite task, answered right, with the wrong tool, malformed and with bad arguments."""
    rows = []
    for task in load_tasks("data/tasks/toolcall.jsonl"):
        expected = json.loads(task["answer"])["expected"]
        args = expected["arguments"] or {}
        rows += [(task["task_id"], task["question"], task["answer"], c) for c in (
            toolcall.gold_completion(task["question"], task["answer"]), call("no_such_tool", args),
            '<tool_call>{"name": ' + expected["name"], call(expected["name"], {"bogus": 1}))]
    return rows


def test_components_are_kept_and_weighted(tmp_path):
    path = write(tmp_path, [("t0", "2*3", "6", "<calc>2*3</calc><result>6</result>answer:6"),
                            ("t0", "2*3", "6", "<calc>2 x 3</calc><result>?</result>answer:6"),
                            ("t0", "2*3", "6", "<calc>2*3</calc>"),
                            ("t0", "2*3", "6", "answer:5")])
    config = cfg.Reward(weights={"correct": 0.5, "format": 0.25, "tool_ok": 0.25}, workers=1)
    m = reward.run(cfg.Base(), config, path, tmp_path / "rewards.parquet")
    out = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert [r["score_correct"] for r in out] == [1.0, 1.0, 0.0, 0.0]
    assert [r["score_format"] for r in out] == [1.0, 1.0, 0.0, 1.0]
    assert [r["score_tool_ok"] for r in out] == [1.0, 0.0, 1.0, 1.0]
    assert [r["reward"] for r in out] == [1.0, 0.75, 0.25, 0.5]
    assert [r["correct"] for r in out] == [r["score_correct"] for r in out]
    assert m["components"] == {"correct": 0.5, "format": 0.75, "tool_ok": 0.75}
    assert m["mean_reward"] == 0.625 and m["pass_at_k"] == 1.0


def test_toolcall_rewards_and_extra_components(tmp_path):
    path = write(tmp_path, toolcall_rows())
    m = reward.run(TOOLCALL, INLINE, path, tmp_path / "rewards.parquet")
    out = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert m["tasks"] == 20 and m["tasks_set_aside"] == 0 and m["errors"] == 0
    assert [r["correct"] for r in out[:4]] == [1.0, 0.0, 0.0, 0.0]
    assert [r["score_right_tool"] for r in out[:4]] == [1.0, 0.0, 0.0, 1.0]
    assert [r["score_arguments_valid"] for r in out[:4]] == [1.0, 0.0, 0.0, 0.0]
    assert all(r["verifier"] == "toolcall/json-schema@1" for r in out)
    assert m["pass_at_k"] == 1.0 and m["mean_reward"] == 0.25


def test_gold_check_sets_tasks_aside(tmp_path):
    good = json.loads(load_tasks("data/tasks/toolcall.jsonl")[0]["answer"])
    # expected arguments its own schema rejects: the gold call cannot score full marks
    broken = {**good, "expected": {"name": "get_weather", "arguments": {"city": 3}}}
    path = write(tmp_path, [
        ("ok", "weather in Paris?", json.dumps(good), call("get_weather", {"city": "Paris"})),
        ("bad", "weather in Paris?", json.dumps(broken), call("get_weather", {"city": 3})),
        ("bad", "weather in Paris?", json.dumps(broken), call("get_weather", {"city": "Paris"})),
        ("junk", "weather in Paris?", "not json", call("get_weather", {"city": "Paris"}))])
    m = reward.run(TOOLCALL, INLINE, path, tmp_path / "rewards.parquet")
    out = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert (m["tasks_set_aside"], m["episodes_set_aside"], m["judged"], m["errors"]) == (2, 3, 1, 0)
    assert out[0]["reward"] == 1.0 and out[0]["error"] is None
    assert all(r["reward"] is None and r["correct"] is None for r in out[1:])
    assert "gold completion scores" in out[1]["error"] and "not full marks" in out[1]["error"]
    assert "cannot judge its gold" in out[3]["error"]


def test_a_verifier_that_raises_is_an_error_with_its_cause(tmp_path):
    task = json.loads(load_tasks("data/tasks/toolcall.jsonl")[0]["answer"])
    remote = {**task, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"$ref": "https://schemas.example.com/w.json"}}}]}
    rows = [("ok", "weather?", json.dumps(task), call("get_weather", {"city": "Paris"})),
            ("remote", "weather?", json.dumps(remote), call("get_weather", {"city": "Paris"}))]
    # the default local process pool: the error crosses the process boundary as text
    m = reward.run(TOOLCALL, cfg.Reward(workers=2), write(tmp_path, rows),
                   tmp_path / "rewards.parquet")
    out = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert m["errors"] == 1 and m["judged"] == 1 and out[0]["reward"] == 1.0
    assert out[1]["reward"] is None and out[1]["correct"] is None  # never a zero
    assert "VerifierError: the schema of tool 'get_weather'" in out[1]["error"]
    with pytest.raises(reward.VerifierBroken, match="scored none of 1 rollouts.*VerifierError"):
        reward.run(TOOLCALL, INLINE, write(tmp_path, rows[1:], "only.parquet"),
                   tmp_path / "rewards2.parquet")


def test_more_errors_than_max_error_fraction_fail_the_stage(tmp_path):
    # a judge answering garbage for most episodes trained a cycle on the few it scored; now more
    # than reward.max_error_fraction (0.5) failing is a broken scorer, naming the knob
    task = json.loads(load_tasks("data/tasks/toolcall.jsonl")[0]["answer"])
    remote = {**task, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"$ref": "https://schemas.example.com/w.json"}}}]}
    ok = ("ok", "weather?", json.dumps(task), call("get_weather", {"city": "Paris"}))
    bad = [(f"r{i}", "weather?", json.dumps(remote), call("get_weather", {"city": "Paris"}))
           for i in range(2)]
    with pytest.raises(reward.VerifierBroken, match=r"2 of 3 episodes could not be scored \(67%, "
                       r"more than reward.max_error_fraction=0.5\), e.g. .*VerifierError"):
        reward.run(TOOLCALL, INLINE, write(tmp_path, [ok, *bad]), tmp_path / "rewards.parquet")
    m = reward.run(TOOLCALL, cfg.Reward(workers=1, max_error_fraction=0.7),
                   write(tmp_path, [ok, *bad], "again.parquet"), tmp_path / "rewards.parquet")
    assert (m["errors"], m["judged"]) == (2, 1)
    with pytest.raises(cfg.ParamsError, match="reward.max_error_fraction: must be in"):
        cfg.Reward(max_error_fraction=1.5)


def test_unjudgeable_rollouts_are_counted_and_dropped(tmp_path, monkeypatch):
    score = arith.score
    monkeypatch.setattr(arith, "score", lambda q, a, c: None if "?" in c else score(q, a, c))
    path = write(tmp_path, [("t0", "2*3", "6", "answer:6"), ("t0", "2*3", "6", "answer:?")])
    m = reward.run(cfg.Base(), INLINE, path, tmp_path / "rewards.parquet")
    assert (m["judged"], m["unjudgeable"], m["errors"], m["mean_reward"]) == (1, 1, 0, 1.0)
    out = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert out[1]["reward"] is None and out[1]["error"] is None


def test_weights_in_params(tmp_path):
    def load(reward_section):
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump({"reward": reward_section}))
        return cfg.load("reward", path)

    assert load({"weights": {"format": 1}}).weights == \
        {"correct": 0.0, "format": 1.0, "tool_ok": 0.0, "feedback": 0.0}
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights\.corect: unknown reward component "
                                              r"\(did you mean 'reward\.weights\.correct'\?\)"):
        load({"weights": {"corect": 1.0}})
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights\.format: expected a number"):
        load({"weights": {"format": "high"}})
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights: expected a mapping"):
        load({"weights": [1.0]})
    with pytest.raises(cfg.ParamsError, match=r"reward\.weights\.tool_ok: must be >= 0"):
        load({"weights": {"tool_ok": -1}})


# A local Ray cluster in a network namespace of its own with only loopback up: Ray binds the host's
# network address whatever it is told, and the tests talk to 127.0.0.1 only. The cluster, the
# reward stage connecting to it by its address, and a look at what listens, all inside it.
RAY_IN_NETNS = r"""
import json, os, subprocess, sys
import ray, yaml
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 ** 2,
         log_to_driver=False)
address = ray.get_runtime_context().gcs_address
params, table, out, metrics = sys.argv[1:5]
with open(params, "w") as f:
    yaml.safe_dump({"base": {"environment": "toolcall"}, "reward": {},
                    "runtime": {"reward": {"ray_address": address}}}, f)
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
    import shutil

    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not netns_available(), reason="Ray runs only in a loopback-only network "
                    "namespace here (needs root, unshare and ip)")
def test_process_pool_and_ray_give_identical_rewards(tmp_path):
    rows = toolcall_rows() + [(f"x{i}", "2*3", "6", f"answer:{i}") for i in range(4)]
    rows += [("remote", "weather?", json.dumps({"tools": [{"type": "function", "function": {
        "name": "w", "parameters": {"$ref": "https://example.com/w.json"}}}],
        "expected": {"name": "w", "arguments": None}}), call("w", {}))]
    path = write(tmp_path, rows)
    pooled, m_pool = reward.score_table("toolcall", cfg.Reward(workers=2), pq.read_table(path))
    # the stage as DVC runs it, connecting to the cluster by its address
    ran = subprocess.run(
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1" "$2" "$3" "$4" "$5"',
         sys.executable, RAY_IN_NETNS, str(tmp_path / "params.yaml"), str(path),
         str(tmp_path / "ray.parquet"), str(tmp_path / "ray.json")],
        capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert seen["address"].startswith("127.0.0.1:")
    # only loopback (or every address, of which this namespace has no other) is listened on
    assert "loopback" in seen["listening"] and set(seen["listening"]) <= {"loopback", "any"}, seen
    assert pq.read_table(tmp_path / "ray.parquet").equals(pooled)
    on_ray = json.loads((tmp_path / "ray.json").read_text())
    assert on_ray.pop("runtime") == {"workers": 0, "ray_address": seen["address"]}
    assert on_ray.pop("resources")["cpu_seconds"] > 0  # what the stage used (measured)
    assert on_ray == m_pool
    assert m_pool["errors"] == 1 and m_pool["episodes"] == len(rows)


def rewards_file(tmp_path):
    path = write(tmp_path, [("t0", "2*3", "6", "answer:6"), ("t0", "2*3", "6", "answer: +6"),
                            ("t1", "4+4", "8", "answer:+8"), ("t1", "4+4", "8", "answer:9")])
    reward.run(cfg.Base(), INLINE, path, tmp_path / "rewards.parquet")
    return tmp_path / "rewards.parquet"


def lenient(monkeypatch):
    """A new verifier version that accepts a leading '+' on the final answer."""
    score = arith.score
    monkeypatch.setattr(arith, "VERSION", "exact-match@3")
    monkeypatch.setattr(arith, "score", lambda q, a, c: score(q, a, c.replace("+", "")))


def test_rescore_after_a_verifier_change(tmp_path, monkeypatch):
    stored = rewards_file(tmp_path)
    assert [r["correct"] for r in pq.read_table(stored).to_pylist()] == [1.0, 0.0, 0.0, 0.0]
    same = reward.rescore(cfg.Base(), INLINE, stored, tmp_path / "same.parquet")
    assert same["rescored"] == 0 and same["changed"] == 0
    assert pq.read_table(tmp_path / "same.parquet").equals(pq.read_table(stored))
    lenient(monkeypatch)
    summary = reward.rescore(cfg.Base(), INLINE, stored, tmp_path / "rescored.parquet")
    out = pq.read_table(tmp_path / "rescored.parquet").to_pylist()
    assert [r["correct"] for r in out] == [1.0, 1.0, 1.0, 0.0]
    assert all(r["verifier"] == "arith/exact-match@3" for r in out)
    assert summary["rescored"] == 4 and summary["changed"] == 2 and summary["became_correct"] == 2
    assert summary["from_verifiers"] == {"arith/exact-match@2": 4}
    assert (summary["mean_reward_before"], summary["mean_reward_after"]) == (0.25, 0.75)
    assert [(e["task_id"], e["sample"]) for e in summary["examples"]] == [("t0", 1), ("t1", 2)]
    assert pq.read_table(stored).column("verifier")[0].as_py() == "arith/exact-match@2"  # kept


def test_rescore_command(tmp_path, monkeypatch, capsys):
    rewards_file(tmp_path)
    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_text((cli.find_root() / name).read_text())
    monkeypatch.chdir(tmp_path)
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    # the patched verifier lives in this process; the tag protocol's rewards (no environments)
    params.setdefault("runtime", {}).setdefault("reward", {})["workers"] = 1
    params["environments"] = {}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    lenient(monkeypatch)
    assert cli.main(["rescore", "--output", "data/rescored.parquet"]) == 2  # no data/rewards
    assert "data/rewards.parquet: no stored rewards" in capsys.readouterr().err
    assert cli.main(["rescore", "rewards.parquet", "--output", "data/rescored.parquet"]) == 0
    summary = json.loads((tmp_path / "data" / "rescored.json").read_text())
    assert summary["changed"] == 2 and summary["verifier"] == "arith/exact-match@3"
    assert "2 rewards changed" in capsys.readouterr().err
    assert pq.read_table(tmp_path / "data" / "rescored.parquet").num_rows == 4


def test_rescore_a_generation_from_its_tag(tmp_path, monkeypatch, capsys):
    # a project whose cycle 1 left data/rewards.parquet in DVC, tagged gen-1, since removed
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    rewards_file(root / "data")
    (root / "data" / "rollouts.parquet").unlink()
    params = yaml.safe_load((cli.find_root() / "params.yaml").read_text())
    # the patched verifier lives in this process; the tag protocol's rewards (no environments)
    params.setdefault("runtime", {}).setdefault("reward", {})["workers"] = 1
    params["environments"] = {}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
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
    lenient(monkeypatch)
    assert cli.main(["rescore", "--generation", "2"]) == 2
    assert "no generation 2 (git tag gen-2)" in capsys.readouterr().err
    assert cli.main(["rescore", "--generation", "1", "--output", "gen1.parquet"]) == 0
    summary = json.loads((root / "gen1.json").read_text())
    assert summary["input"].endswith(".offseason/rewards-gen-1.parquet")
    assert summary["rescored"] == 4 and summary["changed"] == 2


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
    """A chat rewards table of the `grader` environment (strict, grader@1), as the reward stage
    writes it: one task, one rated trace task, and one episode whose tool call broke."""
    (tmp_path / "grader_v1.py").write_text(GRADER.format(version="grader@1", lenient=False))
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
    out, _ = reward.score_chat(specs, pq.read_table(tmp_path / "rollouts.parquet"), tmp_path,
                               INLINE, feedback)
    io.write_parquet(tmp_path / "rewards.parquet", out)
    return tmp_path / "rewards.parquet"


def test_rescore_on_the_chat_path_after_an_environment_changed(tmp_path):
    """`offseason rescore` with an `environments:` section (the demo's path, and any user's):
    each row re-scored by its own environment's current verifier, a user's rating kept as the
    same `feedback` component, a tool call that broke at rollout still an error. It raised
    "not a rollouts or rewards table (no question, answer column)" on the table it named."""
    stored = chat_rewards(tmp_path, ["Paris", "paris", " PARIS "])
    before = pq.read_table(stored).to_pylist()
    assert [r["correct"] for r in before] == [0.0, 1.0, 0.0, None]
    assert before[2]["score_feedback"] == 1.0 and before[3]["error"].endswith("KeyError: 'x'")
    strict = {"grader": cfg.EnvironmentSpec(module="grader_v1")}
    same = reward.rescore(cfg.Base(), INLINE, stored, tmp_path / "same.parquet", specs=strict,
                          root=tmp_path)
    assert same["rescored"] == 0 and same["verifier"] == "grader/grader@1"
    (tmp_path / "grader_v2.py").write_text(GRADER.format(version="grader@2", lenient=True))
    lenient = {"grader": cfg.EnvironmentSpec(module="grader_v2")}
    summary = reward.rescore(cfg.Base(), INLINE, stored, tmp_path / "rescored.parquet",
                             specs=lenient, root=tmp_path)
    after = pq.read_table(tmp_path / "rescored.parquet").to_pylist()
    assert [r["correct"] for r in after] == [1.0, 1.0, 1.0, None]
    assert all(r["verifier"] == "grader/grader@2" for r in after)
    assert after[2]["score_feedback"] == 1.0 and after[2]["score_answer"] == 1.0
    assert before[2]["reward"] < 1.0 and after[2]["reward"] == 1.0  # the answer's component rose
    assert after[3]["error"] == before[3]["error"] and after[3]["reward"] is None
    assert summary["rescored"] == 4 and summary["changed"] == 2 and summary["became_correct"] == 2
    assert summary["from_verifiers"] == {"grader/grader@1": 4}
    assert [r["messages"] for r in after] == [r["messages"] for r in before]  # rollouts kept
    # the tag protocol's table is not this path's: the file is named, and what to give instead
    with pytest.raises(ValueError, match=r"rewards\.parquet: not a chat rollouts or rewards "
                                         r"table \(no environment, task, messages column\)"):
        (tmp_path / "tag").mkdir()
        reward.rescore(cfg.Base(), INLINE, rewards_file(tmp_path / "tag"), tmp_path / "x.parquet",
                       specs=lenient, root=tmp_path)
