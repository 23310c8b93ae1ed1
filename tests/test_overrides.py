"""Run parameters written into params.yaml for one run, and the `deployments:` section."""

import pytest
import yaml
from conftest import REPO

from flows import overrides
from stages import config as cfg


def test_rewrite_changes_only_the_value_and_keeps_comments():
    text = (REPO / "params.yaml").read_text()
    new = overrides.rewrite(text, {"rollout.samples_per_task": 8, "train.epochs": 2.5})
    params = yaml.safe_load(new)
    assert params["rollout"]["samples_per_task"] == 8 and params["train"]["epochs"] == 2.5
    assert params["simulate"] == yaml.safe_load(text)["simulate"]
    changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines()) if a != b]
    assert changed == [("  samples_per_task: 4", "  samples_per_task: 8"),
                       ("  epochs: 8", "  epochs: 2.5")]


def test_a_missing_key_is_added_to_its_section():
    new = overrides.rewrite("train:\n  lr: 0.1  # why\ngate:\n  confidence: 0.9\n",
                            {"train.epochs": 3})
    assert new == "train:\n  epochs: 3\n  lr: 0.1  # why\ngate:\n  confidence: 0.9\n"


def test_applied_restores_the_exact_text(tmp_path):
    path = tmp_path / "params.yaml"
    original = (REPO / "params.yaml").read_text()
    path.write_text(original)
    with overrides.applied(tmp_path, {"rollout.samples_per_task": 3}):
        assert cfg.load("rollout", path).samples_per_task == 3
    assert path.read_text() == original
    with pytest.raises(RuntimeError), overrides.applied(tmp_path, {"rollout.samples_per_task": 3}):
        raise RuntimeError("a failed cycle")
    assert path.read_text() == original


def test_a_bad_override_fails_naming_the_key_and_restores(tmp_path):
    path = tmp_path / "params.yaml"
    original = (REPO / "params.yaml").read_text()
    path.write_text(original)
    with pytest.raises(cfg.ParamsError, match="rollout.samples_per_task: must be > 0"):
        with overrides.applied(tmp_path, {"rollout.samples_per_task": 0}):
            pass
    assert path.read_text() == original
    with pytest.raises(cfg.ParamsError, match="unknown run parameter"):
        overrides.from_parameters(temperature=0.5)
    assert overrides.from_parameters(samples_per_task=8, algorithm=None) == {
        "rollout.samples_per_task": 8}


def test_deployments_section_is_checked(tmp_path):
    def load(deployments):
        params = yaml.safe_load((REPO / "params.yaml").read_text())
        params["deployments"] = deployments
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(params))
        return cfg.load_all(path)["deployments"]

    ok = load({"nightly": {"cron": "0 1 * * *", "parameters": {"samples_per_task": 2}}})
    assert ok.nightly["parameters"] == {"samples_per_task": 2} and ok.weekly["cron"]
    with pytest.raises(cfg.ParamsError, match="deployments.nightly.cron: expected a 5-field"):
        load({"nightly": {"cron": "every night"}})
    with pytest.raises(cfg.ParamsError, match="deployments.weekly.parameters.temperature"):
        load({"weekly": {"cron": "0 4 * * 6", "parameters": {"temperature": 1}}})
    with pytest.raises(cfg.ParamsError, match="deployments.manual.cron"):
        load({"manual": {"cron": "0 4 * * 6"}})
    with pytest.raises(cfg.ParamsError, match="deployments.nightly: expected a mapping"):
        load({"nightly": "0 2 * * *"})
