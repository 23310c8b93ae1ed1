"""Run parameters written into params.yaml for one run, and the `deployments:` section."""

import pytest
import yaml
from conftest import REPO

from flows.project import overrides
from flows.project import params as settings
from stages import config as cfg


def test_rewrite_changes_only_the_value_and_keeps_comments():
    text = (REPO / "params.yaml").read_text()
    new = overrides.rewrite(text, {"rollout.samples_per_task": 8, "train.sft.epochs": 2.5})
    params = yaml.safe_load(new)
    assert params["rollout"]["samples_per_task"] == 8 and params["train"]["sft"]["epochs"] == 2.5
    assert params["train"]["dpo"] == yaml.safe_load(text)["train"]["dpo"]
    assert params["simulate"] == yaml.safe_load(text)["simulate"]
    changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines()) if a != b]
    assert changed == [("  samples_per_task: 4", "  samples_per_task: 8"),
                       ("    epochs: 8", "    epochs: 2.5")]


def test_a_missing_key_is_added_to_its_section():
    new = overrides.rewrite("train:\n  lr: 0.1  # why\ngate:\n  confidence: 0.9\n",
                            {"train.batch_size": 3})
    assert new == "train:\n  batch_size: 3\n  lr: 0.1  # why\ngate:\n  confidence: 0.9\n"
    text = "train:\n  algorithm: sft\n  dpo:\n    beta: 0.1\n\ngate:\n  confidence: 0.9\n"
    assert overrides.rewrite(text, {"train.dpo.epochs": 2}) == text.replace(
        "  dpo:\n", "  dpo:\n    epochs: 2\n")
    assert overrides.rewrite(text, {"train.grpo.epochs": 2}) == text.replace(
        "  algorithm: sft\n", "  grpo:\n    epochs: 2\n  algorithm: sft\n")
    assert overrides.rewrite(text, {"train.dpo.beta": 0.5}) == text.replace("0.1", "0.5")


def test_epochs_belong_to_the_runs_algorithm(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text((REPO / "params.yaml").read_text())
    assert overrides.from_parameters(path, epochs=2) == {"train.sft.epochs": 2}
    assert overrides.from_parameters(path, algorithm="grpo", epochs=2) == {
        "train.algorithm": "grpo", "train.grpo.epochs": 2}
    with overrides.applied(tmp_path, {"train.algorithm": "dpo", "train.dpo.epochs": 1.5}):
        config = cfg.load("train", path)
        assert config.method == cfg.DPO(epochs=1.5) and config.sft == cfg.SFT()


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


def test_a_committed_run_leaves_the_work_tree_clean(tmp_path):
    """The cycle's commit holds the run's values; the standing ones, put back, are committed back
    at once: params.yaml never shows as edited after a run with overrides (issue 53.9)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    original = (REPO / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(original)
    git("init", "-q")
    git("add", "params.yaml")
    git("commit", "-qm", "standing")
    with overrides.applied(tmp_path, {"rollout.samples_per_task": 3}):
        pass  # a run that failed before its commit: nothing to commit back
    assert git("rev-list", "--count", "HEAD").strip() == "1"
    with overrides.applied(tmp_path, {"rollout.samples_per_task": 3}):
        git("commit", "-qam", "gen-1")  # as the cycle commits, with the run's values
    assert git("status", "--porcelain") == ""
    assert git("show", "HEAD:params.yaml") == original
    assert "samples_per_task: 3" in git("show", "HEAD~1:params.yaml")
    assert "rollout.samples_per_task=3" in git("log", "-1", "--format=%s")


def test_a_bad_override_fails_naming_the_key_and_restores(tmp_path):
    path = tmp_path / "params.yaml"
    original = (REPO / "params.yaml").read_text()
    path.write_text(original)
    with pytest.raises(cfg.ParamsError, match="rollout.samples_per_task: must be > 0"):
        with overrides.applied(tmp_path, {"rollout.samples_per_task": 0}):
            pass
    assert path.read_text() == original
    with pytest.raises(cfg.ParamsError, match="unknown run parameter"):
        overrides.from_parameters(path, temperature=0.5)
    assert overrides.from_parameters(path, samples_per_task=8, algorithm=None) == {
        "rollout.samples_per_task": 8}


def test_deployments_section_is_checked(tmp_path):
    def load(deployments):
        params = yaml.safe_load((REPO / "params.yaml").read_text())
        params["deployments"] = deployments
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(params))
        return settings.load_all(path)["deployments"]

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


def test_the_run_form_offers_the_algorithms_by_name():
    """Prefect's Run form is built from the flow's parameter schema: a drop-down of the
    algorithms (cfg.ALGORITHMS), not a free-text field, and no "None" among the choices."""
    from prefect.utilities.callables import parameter_schema

    from flows.orchestration.cycle import cycle
    from stages.config import ALGORITHMS

    field = parameter_schema(cycle.fn).model_dump()["properties"]["algorithm"]
    assert field["enum"] == list(ALGORITHMS) and field["type"] == "string", field


def test_the_run_form_has_whole_epochs_and_no_project_folder(tmp_path):
    """Epochs is an integer field; the project folder is not a field (a deployment belongs to
    one checkout: flows/orchestration/serve.py sets OFFSEASON_PROJECT for its runs). The
    deployments' form has each field's type alone and no default (issue 53.5: Prefect's UI drew
    `X | None` as a choice with "None", and sent an untouched field's null, which its server then
    refused); approval is a yes/no drop-down, which the flow reads as a switch."""
    from prefect.utilities.callables import parameter_schema

    from flows.orchestration import serve
    from flows.orchestration.cycle import cycle

    form = parameter_schema(cycle.fn).model_dump()["properties"]
    assert set(form) == {"algorithm", "samples_per_task", "epochs", "require_approval"}
    assert form["epochs"]["type"] == "integer" and form["epochs"]["minimum"] == 1, form
    assert form["require_approval"]["enum"] == ["yes", "no"], form
    assert "<" not in form["epochs"]["description"]  # the UI reads it as HTML: `<algorithm>` vanished
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["deployments"]["weekly"]["parameters"] = {"require_approval": True}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    made = {d.name: d for d in serve.deployments(tmp_path, flow=cycle)}
    for deployment in made.values():
        fields = deployment._parameter_openapi_schema.properties
        assert not any("default" in field or "anyOf" in field for field in fields.values())
    assert made["weekly"].parameters == {"require_approval": "yes"}
    # the flow takes the form's yes/no as the switch it is
    assert cycle.validate_parameters({"require_approval": "no"})["require_approval"] is False
