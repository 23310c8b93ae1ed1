"""The whole loop, end to end, through the real CLI, Prefect flow, DVC, MLflow and GE."""

import json
import subprocess

import pytest
import yaml
from conftest import (
    BIN,
    cli_env,
    kill_and_reap,
    make_project,
    offseason,
    stage_process,
    write_params,
)

pytestmark = pytest.mark.slow

STAGES = ["ingest", "validate", "rollout", "reward", "train", "champion_scores", "gate"]


def git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def mlflow_client(root):
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    return mlflow.MlflowClient()


@pytest.mark.embedded_prefect  # what a fresh clone runs: no server anywhere
def test_init_simulate_and_one_cycle(project):
    out = offseason(project, "init")
    assert "generation 0 is the champion" in out.stdout
    assert git(project, "tag", "--list") == "gen-0"
    assert (project / "models/champion.dvc").exists()
    assert (project / "models/champion/model.safetensors").exists()

    offseason(project, "simulate")
    lines = (project / "data/inbox/traffic-000.jsonl").read_text().splitlines()
    assert len(lines) == 48 + 3  # the day's traces plus a duplicate, a cut line and small talk
    assert any("jane.doe@example.com" in line for line in lines)

    result = offseason(project, "run")
    assert "gen-1: candidate" in result.stdout

    # the gate verdict, committed and tagged
    assert "gen-1" in git(project, "tag", "--list").split()
    verdict = json.loads(git(project, "show", "gen-1:metrics/gate.json"))
    assert isinstance(verdict["passed"], bool)
    assert 0 <= verdict["candidate_score"] <= 1 and 0 <= verdict["champion_score"] <= 1
    assert verdict["interval"][0] <= verdict["difference"] <= verdict["interval"][1]
    assert git(project, "status", "--porcelain", "--", "dvc.lock", "metrics") == ""

    # ingest and validate counted every line
    ingest = json.loads((project / "metrics/ingest.json").read_text())
    assert (ingest["rows_read"], ingest["duplicates"], ingest["quarantined"]) == (51, 1, 1)
    assert ingest["accepted"] == 49 and ingest["pii_redactions"]["email"] == 1
    validate = json.loads((project / "metrics/validate.json").read_text())
    assert validate["rows_read"] == 49 and validate["quarantined"] == 1  # the small talk
    traces = (project / "data/ingested.parquet").read_bytes()
    assert b"jane.doe@example.com" not in traces

    # dvc.lock has every stage with hashed deps and outs
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert set(STAGES) <= set(lock)
    assert all(out["md5"] for stage in STAGES for out in lock[stage]["outs"])
    champion_dep = next(d for d in lock["rollout"]["deps"] if d["path"] == "models/champion")
    assert champion_dep["md5"]

    # MLflow: one run per cycle, a child per stage with DVC hashes, a new model version, the alias
    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("offseason")
    runs = client.search_runs([experiment.experiment_id], "tags.`offseason.generation` = '1'")
    assert len(runs) == 1
    parent = runs[0]
    assert parent.data.tags["offseason.git_tag"] == "gen-1"
    assert parent.data.tags["offseason.git_commit"] == git(project, "rev-parse", "gen-1")
    assert parent.data.params["train.sft.lr"] == "0.001"
    children = client.search_runs([experiment.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.tags["offseason.stage"] for c in children) == sorted(STAGES)
    ingest_run = next(c for c in children if c.data.tags["offseason.stage"] == "ingest")
    assert ingest_run.data.metrics["accepted"] == 49
    assert ingest_run.data.tags["dvc.out.data/ingested.parquet"] == next(
        o["md5"] for o in lock["ingest"]["outs"] if o["path"] == "data/ingested.parquet")
    train_run = next(c for c in children if c.data.tags["offseason.stage"] == "train")
    train_metrics = json.loads((project / "metrics/train.json").read_text())
    # the settings a stage's metrics echo are params of its run, not single-bar metric charts
    assert "lora_r" not in train_run.data.metrics and "deepspeed" not in train_run.data.metrics
    assert train_run.data.params["train.lora_r"] == "0"
    if train_metrics["trained"]:  # the per-step curve, with its step numbers
        losses = client.get_metric_history(train_run.info.run_id, "step.loss")
        assert sorted(m.step for m in losses) == list(range(1, train_metrics["steps"] + 1))
    versions = client.search_model_versions("name = 'offseason-agent'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    new = next(v for v in versions if str(v.version) == "2")
    assert new.run_id == parent.info.run_id and new.tags["generation"] == "1"
    champion = client.get_model_version_by_alias("offseason-agent", "champion")
    assert str(champion.version) == ("2" if verdict["passed"] else "1")
    promotion = json.loads((project / "metrics/promotion.json").read_text())
    assert promotion["promoted"] == verdict["passed"]

    # history shows both generations and marks the champion
    rows = json.loads(offseason(project, "history", "--json", "--plot", "h.png").stdout)
    assert (project / "h.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["tag"] for r in rows] == ["gen-0", "gen-1"]
    assert [r["champion"] for r in rows] == ([False, True] if verdict["passed"] else [True, False])
    # what the cycle cost: every stage ran and used CPU; its rollout's tokens counted exactly
    spent = json.loads((project / "metrics/cost.json").read_text())
    assert set(spent["stages"]) == set(STAGES)
    assert all(spent["stages"][s]["cpu_seconds"] > 0 for s in STAGES)
    rollout_metrics = json.loads((project / "metrics/rollout.json").read_text())
    assert spent["total"]["generated_tokens"] == rollout_metrics["generated_tokens"] > 0
    assert spent["total"]["usd"] == pytest.approx(
        spent["total"]["cpu_seconds"] / 3600 * spent["prices"]["cpu_hour_usd"], abs=1e-5)
    assert rows[1]["cost_usd"] == spent["total"]["usd"] and rows[0]["cost_usd"] is None
    assert "points_per_usd" in rows[1]
    assert "cost $" in offseason(project, "history").stdout

    # nothing changed: nothing reruns, and it says so; nor does a change of where work runs
    # (runtime:, which no stage lists as a DVC param)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["runtime"] = {"reward": {"workers": 1}, "rollout": {
        "concurrency": 7, "request_timeout": 30.0, "retries": 2, "server_timeout": 60.0,
        "api_key_env": "MY_KEY", "urls": "http://127.0.0.1:9/v1"},
        "judge": {"url": "http://127.0.0.1:9/v1", "request_timeout": 5.0, "retries": 1,
                  "api_key_env": "JUDGE_KEY"}}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    again = offseason(project, "run")
    assert "nothing changed since gen-1" in again.stdout and "no stage reran" in again.stdout
    assert git(project, "tag", "--list").split() == ["gen-0", "gen-1"]
    dvc_status = subprocess.run([str(BIN / "dvc"), "status", "--json"], cwd=project,
                                capture_output=True, text=True, check=True).stdout
    assert json.loads(dvc_status) == {}, dvc_status  # every stage up to date

    # `dvc repro` alone agrees that the cycle is complete
    status = subprocess.run([str(BIN / "dvc"), "status", "rollout", "reward", "ingest",
                             "validate"], cwd=project, capture_output=True, text=True)
    assert status.returncode == 0


def test_killed_cycle_redoes_only_unfinished_stages(simulated):
    project = simulated
    env = cli_env(project)
    proc = subprocess.Popen([str(BIN / "offseason"), "run"], cwd=project, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    stage_process(project, "train", proc)
    kill_and_reap(proc)  # midway, like a lost machine
    assert "gen-1" not in git(project, "tag", "--list")

    result = offseason(project, "run")  # the stale lock of the killed process is cleared
    log = result.stdout + result.stderr
    for stage in ("ingest", "validate", "rollout", "reward"):
        assert f"Running stage '{stage}'" not in log
        assert f"{stage}: up to date, skipped" in log
    assert "Running stage 'train'" in log and "Running stage 'gate'" in log
    assert "gen-1" in git(project, "tag", "--list").split()


def test_bad_params_fail_before_any_stage(project):
    (project / "data/inbox").mkdir(parents=True)
    (project / "data/inbox/t.jsonl").write_text('{"messages": []}\n')
    write_params(project, {"train": {"sft": {"epochz": 3}}})
    result = offseason(project, "run", check=False)
    assert result.returncode == 2
    assert "unknown key 'train.sft.epochz'" in result.stderr and \
        "did you mean 'train.sft.epochs'" in result.stderr
    assert not (project / "dvc.lock").exists()
    params = yaml.safe_load((project / "params.yaml").read_text())
    del params["train"]["sft"]["epochz"]
    params["rollout"]["temperature"] = "hot"
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    result = offseason(project, "run", check=False)
    assert "rollout.temperature: expected a number" in result.stderr
    params["rollout"]["temperature"] = 0.7
    del params["gate"]
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    result = offseason(project, "check", check=False)
    assert result.returncode == 2 and "missing section 'gate:'" in result.stderr
    assert not (project / "data/ingested.parquet").exists()


def test_empty_inbox_ends_early_with_a_message(initialised):
    project = initialised
    result = offseason(project, "run")
    assert "the inbox is empty" in result.stdout and "offseason simulate" in result.stdout
    assert git(project, "tag", "--list") == "gen-0"


def test_run_before_init_says_what_to_do(tmp_path):
    root = make_project(tmp_path / "p")
    result = offseason(root, "run", check=False)
    assert result.returncode != 0 and "offseason init" in result.stderr
