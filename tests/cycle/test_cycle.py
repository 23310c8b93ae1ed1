"""The cycle's front door through the real CLI: bad params, an empty inbox, `run` before `init`.

Whole cycles live elsewhere, each costing about a minute of the suite: a fresh clone's first
cycle and all it leaves in test_security.py (whose no-network cycle is one), a cycle killed in
each stage and rerun in test_faults.py.
"""

import subprocess

import yaml
from conftest import make_project, offseason, write_params


def git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


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
