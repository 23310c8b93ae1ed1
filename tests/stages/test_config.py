import pytest
import yaml

from flows.project import params as settings
from stages import config as cfg


def write(tmp_path, data):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


DEMO = {"arith": {"module": "stages.envs.arith", "benchmark": "data/benchmarks/arith.jsonl"}}


def full(**changes):
    data = {**{name: {} for name in settings.SECTIONS}, "environments": DEMO}
    for section, values in changes.items():
        data[section] = values
    return data


def test_defaults_load(tmp_path):
    configs = settings.load_all(write(tmp_path, full()))
    assert configs["train"].method.lr == 1e-3
    assert configs["reward"].weights == {"feedback": 0.0}


def test_repo_params_are_valid():
    configs = settings.load_all(cfg.Path(__file__).parents[2] / "params.yaml")
    assert set(configs) == set(settings.SECTIONS) | {"environments"}
    # the demo runs the built-in arith module on the environment contract, through the chat path
    assert list(configs["environments"]) == ["arith"]
    assert configs["environments"]["arith"].module == "stages.envs.arith"
    assert configs["gate"].primary == "arith"


def test_unknown_key_names_key_and_suggests(tmp_path):
    with pytest.raises(cfg.ParamsError) as err:
        settings.load_all(write(tmp_path, full(train={"sft": {"lrr": 0.1}})))
    message = str(err.value)
    assert "params.yaml" in message and "train.sft.lrr" in message and "'train.sft.lr'" in message


def test_unknown_keys_are_named_once_with_the_keys_that_belong_there(tmp_path):
    """An environment's unknown key names the file once (it was said twice); a stage section's
    lists its own keys and says apart which go under runtime (they are refused in the section)."""
    path = write(tmp_path, full(environments={"mine": {"module": "m", "wieght": 1}}))
    with pytest.raises(cfg.ParamsError) as err:
        settings.load_all(path)
    assert str(err.value).count("params.yaml") == 1, err.value
    assert "'environments.mine.wieght' (did you mean 'environments.mine.weight'?)" in str(err.value)
    with pytest.raises(cfg.ParamsError) as err:
        settings.load_all(write(tmp_path, full(rollout={"colour": 1})))
    own, _, runtime = str(err.value).partition("; where work runs goes under runtime.rollout: ")
    assert "valid keys in 'rollout': backend," in own and "urls" not in own, err.value
    assert runtime.startswith("urls, server_command"), err.value


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(cfg.ParamsError, match=r"rollout\.samples_per_task: expected a whole number"):
        settings.load_all(write(tmp_path, full(rollout={"samples_per_task": "four"})))


def test_bool_is_not_an_int(tmp_path):
    with pytest.raises(cfg.ParamsError, match="rollout.samples_per_task"):
        settings.load_all(write(tmp_path, full(rollout={"samples_per_task": True})))


def test_yaml_exponent_string_is_a_number(tmp_path):
    # PyYAML reads `1e-3` (no dot) as a string; a float field accepts it
    configs = settings.load_all(write(tmp_path, full(train={"dpo": {"lr": "1e-3"}})))
    assert configs["train"].dpo.lr == 0.001


def test_missing_section(tmp_path):
    data = full()
    del data["gate"]
    with pytest.raises(cfg.ParamsError, match="missing section 'gate:'"):
        settings.load_all(write(tmp_path, data))


def test_unknown_section(tmp_path):
    with pytest.raises(cfg.ParamsError, match="unknown section 'trian'.*did you mean 'train'"):
        settings.load_all(write(tmp_path, {**full(), "trian": {}}))


def test_cross_field_check(tmp_path):
    with pytest.raises(cfg.ParamsError, match=r"init.n_embd \(30\) must be divisible"):
        settings.load_all(write(tmp_path, full(init={"n_embd": 30, "n_head": 4})))


@pytest.mark.parametrize("changes, says", [
    # the tag protocol's keys: each names itself and says what to write instead
    ({"base": {"environment": "code"}}, "base.environment is retired with the tag protocol: each "
     "environment is an entry of `environments:`, played by a chat model; write `environments: "
     "{code: {module: stages.envs.coding, tasks: data/tasks/code.jsonl, benchmark: "
     "data/benchmarks/code.jsonl}}` and delete base.environment"),
    ({"gate": {"suites": {"arith": {"environment": "arith", "max_regression": 0.1}}}},
     "gate.suites is retired with the tag protocol: each environment's benchmark is a gate suite, "
     "with its own max_regression; write `environments: {arith: {module: stages.envs.arith, "
     "benchmark: data/benchmarks/arith.jsonl, max_regression: 0.1}}` and delete gate.suites"),
    ({"environments": {}}, "environments: empty; name the environments your agent works in "
     "(`environments: {}`, the built-in one of base.environment on the tag protocol, is retired): "
     "for the demo's arithmetic write `environments: {arith: {module: stages.envs.arith, "
     "benchmark: data/benchmarks/arith.jsonl}}`"),
    ({"environments": None}, "environments: missing; name the environments"),
    ({"rollout": {"suite_tasks": 8}}, "rollout.suite_tasks is retired with the tag protocol: an "
     "environment's task file is attempted every cycle"),
    ({"rollout": {"stop": "</calc>"}}, "rollout.stop is retired with the tag protocol"),
    ({"reward": {"weights": {"correct": 1.0, "feedback": 0.5}}}, "reward.weights.correct: the tag "
     "protocol's components are retired; an environment's own components each weigh 1 (its "
     "reward is their mean) and only `feedback` has a weight: write `weights: {feedback: 0.0}`"),
])
def test_the_tag_protocols_params_say_what_to_write_instead(tmp_path, changes, says):
    data = full(**changes)
    if data["environments"] is None:
        del data["environments"]
    with pytest.raises(cfg.ParamsError) as err:
        settings.load_all(write(tmp_path, data))
    assert f"params.yaml: {says}" in str(err.value), err.value


def test_range_check(tmp_path):
    with pytest.raises(cfg.ParamsError, match="validate.min_valid_fraction"):
        settings.load_all(write(tmp_path, full(validate={"min_valid_fraction": 1.5})))


def test_each_algorithm_has_its_own_settings(tmp_path):
    # switching train.algorithm alone picks that algorithm's section, with its own defaults
    configs = {name: settings.load_all(write(tmp_path, full(train={"algorithm": name})))["train"]
               for name in cfg.ALGORITHMS}
    assert {name: c.method for name, c in configs.items()} == {
        "sft": cfg.SFT(), "dpo": cfg.DPO(), "grpo": cfg.GRPO()}
    assert (cfg.SFT().epochs, cfg.DPO().epochs, cfg.GRPO().epochs) == (8.0, 3.0, 4.0)
    assert cfg.GRPO().clip == 0.3
    tuned = settings.load_all(write(tmp_path, full(train={"algorithm": "grpo",
                                                          "grpo": {"clip": 0.1}})))["train"]
    assert tuned.method == cfg.GRPO(clip=0.1) and tuned.sft == cfg.SFT()


def test_algorithm_errors_name_the_key_and_value(tmp_path):
    with pytest.raises(cfg.ParamsError, match=r"train.algorithm: unknown algorithm 'ppo'; choose "
                                              r"one of sft, dpo, grpo"):
        settings.load_all(write(tmp_path, full(train={"algorithm": "ppo"})))
    # the bound, the value and what the setting is (its declared description)
    with pytest.raises(cfg.ParamsError, match=r"train.grpo.kl_coef: must be >= 0, got -1.0 \(weight "
                                              r"of the KL term to the champion; 0 = none\)"):
        settings.load_all(write(tmp_path, full(train={"grpo": {"kl_coef": -1}})))
    with pytest.raises(cfg.ParamsError, match=r"section 'train.dpo' must be a mapping"):
        settings.load_all(write(tmp_path, full(train={"dpo": 3})))
    with pytest.raises(cfg.ParamsError, match=r"train.replay_fraction: must be between 0 and 1, "
                                              r"got 1.5"):
        settings.load_all(write(tmp_path, full(train={"replay_fraction": 1.5})))


def test_where_work_runs_lives_in_runtime_and_is_merged_into_its_stage(tmp_path):
    params = yaml.safe_load(open("params.yaml"))
    params["runtime"] = {"reward": {"workers": 3}, "rollout": {"concurrency": 9}}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    assert cfg.load("reward", path).workers == 3 and cfg.load("rollout", path).concurrency == 9
    assert cfg.runtime_of(cfg.load("reward", path)) == {"workers": 3, "ray_address": "",
                                                        "stall_seconds": 300.0}

    def refused(edit, message):
        changed = yaml.safe_load(open("params.yaml"))
        edit(changed)
        path.write_text(yaml.safe_dump(changed))
        with pytest.raises(cfg.ParamsError, match=message):
            settings.load_all(path)

    # in its stage's section it would be a DVC param: changing it would rerun the stage
    refused(lambda p: p["reward"].update(workers=2),
            r"reward.workers says where or how fast work runs.*runtime.reward.workers")
    refused(lambda p: p["runtime"]["rollout"].update(temperature=0.5),
            r"unknown key 'runtime.rollout.temperature' \('rollout.temperature' says what is "
            r"computed: it stays in the 'rollout:' section\)")
    refused(lambda p: p["runtime"].update(gate={"alpha": 0.1}),
            r"unknown section 'runtime.gate'; runtime settings exist for rollout, reward")
    refused(lambda p: p["runtime"]["rollout"].update(urls="localhost:8000"),
            r"runtime.rollout.urls: 'localhost:8000' is not an http\(s\) URL")
    refused(lambda p: p["runtime"]["rollout"].update(api="grpc"),
            r"runtime.rollout.api: 'grpc' is not an endpoint; use 'completions'")


def test_moving_an_mcp_server_reruns_no_stage_and_changing_what_it_is_does(tmp_path):
    """Where a tool server runs (runtime.mcp.servers) is no DVC param of any stage: `dvc status`,
    over the stages' own params lists (dvc.yaml), sees nothing change when only its command
    becomes a url; what it is (environments.<name>.mcp, its version) reruns the stages that play
    or score the environment."""
    import json
    import subprocess
    import sys

    repo = cfg.Path(__file__).parents[2]
    dvc = str(cfg.Path(sys.executable).parent / "dvc")
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        name: {"cmd": "true", "params": stage["params"]} for name, stage in stages.items()}}))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    # network: what its tools may reach, a DVC param: set before, so the url below may be used
    params["environments"]["arith"].update(network=True, mcp={"shop": {"allow": ["lookup"]}})
    params["runtime"].setdefault("mcp", {})["servers"] = {
        "shop": {"command": "python tools/shop_server.py"}}
    path = tmp_path / "params.yaml"

    def status(**server) -> dict:
        if server:
            params["runtime"]["mcp"]["servers"]["shop"] = server
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        return json.loads(subprocess.run([dvc, "status", "--json"], cwd=tmp_path, check=True,
                                         capture_output=True, text=True).stdout)

    path.write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in ([dvc, "init", "--no-scm", "-q"], [dvc, "repro", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    assert status() == {}
    assert status(url="http://10.0.0.5:9000/mcp", timeout=5, memory_mb=512) == {}
    # the stages use the moved server
    assert cfg.environments(path)["arith"].mcp["shop"]["url"] == "http://10.0.0.5:9000/mcp"
    params["environments"]["arith"]["mcp"]["shop"]["version"] = "1.4.0"
    changed = status()
    assert set(changed) == {name for name, stage in stages.items()
                            if "environments" in stage["params"]}
    assert "ingest" not in changed


def test_a_section_that_is_not_a_mapping_names_itself(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"reward": 5, "runtime": {"reward": {"workers": 1}}}))
    with pytest.raises(cfg.ParamsError, match=r"reward: expected a mapping of keys to values, got 5"):
        cfg.load("reward", params)


def test_the_cost_ledger_prices_the_stages_that_ran_and_history_divides_gain_by_it():
    from flows.orchestration import cost

    metrics = {"ingest": {"resources": {"wall_seconds": 2.0, "cpu_seconds": 1.8}},
               "rollout": {"generated_tokens": 1200,
                           "resources": {"wall_seconds": 10.0, "cpu_seconds": 18.0}},
               "reward": {"judges": [{"requests": 3, "tokens": 300}],
                          "resources": {"wall_seconds": 1.0, "cpu_seconds": 0.9}},
               "champion_scores": {"resources": {"wall_seconds": 9.0, "cpu_seconds": 9.0}}}
    ran = {"ingest": True, "rollout": True, "reward": True, "champion_scores": False}
    prices = cost.Cost(cpu_hour_usd=3.6, gpu_hour_usd=0.0, judge_usd_per_million_tokens=1000.0)
    spent = cost.ledger(metrics, ran, prices)
    assert spent["stages"]["champion_scores"] == {"reused": True}  # paid for in an earlier cycle
    assert spent["total"]["cpu_seconds"] == 20.7 and spent["total"]["generated_tokens"] == 1200
    assert spent["total"]["judge_tokens"] == 300
    assert spent["total"]["usd"] == pytest.approx(20.7 / 3600 * 3.6 + 300 / 1e6 * 1000)
    with pytest.raises(cfg.ParamsError, match="cost.cpu_hour_usd: must be >= 0"):
        cost.Cost(cpu_hour_usd=-1)
    rows = [{"score": 0.05, "champion_score": None, "cost_usd": None},
            {"score": 0.50, "champion_score": 0.05, "cost_usd": 0.02},
            {"score": 0.52, "champion_score": 0.50, "cost_usd": 0.03}]
    cost.per_dollar(rows)
    assert rows[1]["points_per_usd"] == pytest.approx(45 / 0.02)
    assert rows[2]["cumulative_usd"] == 0.05 and rows[2]["points_per_usd"] == round(2 / 0.03, 2)
    assert rows[0]["points_per_usd"] is None


def test_the_params_reference_is_generated_from_the_declarations():
    """docs/params.md is `offseason check --explain`'s text: it never drifts from the code, and
    every key has a type, a default and a description."""
    committed = (cfg.Path(__file__).parents[2] / "docs" / "params.md").read_text(encoding="utf-8")
    assert committed == settings.reference(), ("docs/params.md is stale; run `offseason check "
                                               "--explain > docs/params.md`")
    for name, cls in {**settings.SECTIONS, "environments": cfg.EnvironmentSpec,
                      "collect": cfg.Collect, "sandbox": cfg.Sandbox}.items():
        for key, field in cls.__pydantic_fields__.items():
            assert field.description, f"{name}.{key} has no description"
            assert f"| `{key}` |" in committed or key in cfg.ALGORITHMS, f"{name}.{key}"
