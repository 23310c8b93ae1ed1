"""The cycle's DVC session and its stage-by-stage reading, on a small real DVC pipeline."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import BIN

from flows.orchestration import pipeline
from flows.project import workspace
from flows.project.workspace import WorkspaceError

PY = sys.executable


def stage(cmd: str, deps: list[str], outs: list[str]) -> dict:
    return {"cmd": cmd, "deps": deps, "outs": outs}


def write(root: Path, stages: dict) -> None:
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git + DVC repo whose stages are named like the cycle's: validate writes its metrics."""
    root = tmp_path / "repo"
    root.mkdir()
    for cmd in (["git", "init", "-q"], [str(BIN / "dvc"), "init", "-q"]):
        subprocess.run(cmd, cwd=root, check=True)
    (root / "in.txt").write_text("3\n")
    (root / "metrics").mkdir()
    validate = (f"{PY} -c \"import json; n = int(open('in.txt').read()); "
                f"open('v.txt', 'w').write(str(n)); print('validate: accepted', n); "
                f"json.dump({{'accepted': n}}, open('metrics/validate.json', 'w'))\"")
    write(root, {
        "ingest": stage("echo ingesting && cp in.txt i.txt", ["in.txt"], ["i.txt"]),
        "validate": stage(validate, ["i.txt"], ["v.txt"]),
        "rollout": stage("echo rolling out && cp v.txt r.txt", ["v.txt"], ["r.txt"]),
        "gate": stage("echo gating && cp r.txt g.txt", ["r.txt"], ["g.txt"]),
    })
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    return root


def read_all(pipe: pipeline.Pipeline) -> dict:
    """Each stage with whether it reran, its lines and its error."""
    found, other = {}, []
    while (item := pipe.stage(on_other=other.append)) is not None:
        lines = list(item)
        found[item.name] = {"reran": item.reran, "lines": lines, "error": item.error,
                            "lock": item.lock, "times": (item.started, item.ended)}
    return found


def test_a_session_is_one_dvc_process_giving_dvcs_output_and_exit_codes(repo):
    session = pipeline.Session(repo)
    try:
        pid = session.proc.pid
        code, out = session.run(["repro", "ingest"])
        assert code == 0 and "Running stage 'ingest':" in out and "ingesting" in out
        assert (repo / "i.txt").read_text() == "3\n"
        code, out = session.run(["status", "--quiet", "ingest"], check=False)
        assert code == 0
        (repo / "in.txt").write_text("4\n")
        assert session.run(["status", "--quiet", "ingest"], check=False)[0] == 1
        with pytest.raises(WorkspaceError, match=r"`dvc repro nosuchstage` failed \(exit"):
            session.run(["repro", "nosuchstage"])
        # while it is open, workspace.dvc() goes through it
        seen = []
        workspace.dvc(repo, "repro", "ingest", on_line=seen.append)
        assert "Running stage 'ingest':" in seen
        assert session.proc.pid == pid and session.proc.poll() is None  # one process throughout
    finally:
        session.close()
    assert session.proc.returncode == 0 and repo not in workspace.SESSIONS


def test_the_pipeline_is_read_back_stage_by_stage_each_once(repo):
    found = read_all(pipeline.Pipeline(pipeline.Session(repo)))
    assert list(found) == ["ingest", "validate", "rollout", "gate"]
    assert all(s["reran"] and s["error"] is None for s in found.values())
    assert "ingesting" in found["ingest"]["lines"]
    assert "validate: accepted 3" in found["validate"]["lines"]
    assert found["gate"]["lines"][0] == "Running stage 'gate':"
    # dvc.lock as it was when each stage ended: that stage in it, later ones not yet
    assert "rollout:" in found["rollout"]["lock"] and "gate:" not in found["rollout"]["lock"]
    assert (repo / "g.txt").read_text() == "3"
    # when DVC opened and closed each (MLflow's child runs show these)
    times = [s["times"] for s in found.values()]
    assert all(start <= end for start, end in times)
    assert all(a[1] <= b[0] for a, b in zip(times, times[1:]))

    again = read_all(pipeline.Pipeline(pipeline.Session(repo)))  # nothing changed: all skipped
    assert list(again) == ["ingest", "validate", "rollout", "gate"]
    assert not any(s["reran"] for s in again.values())


def test_nothing_accepted_stops_after_validate(repo):
    (repo / "in.txt").write_text("0\n")
    pipe = pipeline.Pipeline(pipeline.Session(repo))
    found = read_all(pipe)
    assert list(found) == ["ingest", "validate"]
    pipe.thread.join(10)
    assert not pipe.running() and not (repo / "r.txt").exists()


def test_a_failed_stage_fails_in_its_own_part_and_the_rest_never_runs(repo):
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())
    spec["stages"]["rollout"]["cmd"] = "echo about to fail && exit 3"
    write(repo, spec["stages"])
    found = read_all(pipeline.Pipeline(pipeline.Session(repo)))
    assert list(found) == ["ingest", "validate", "rollout"]
    error = found["rollout"]["error"]
    assert isinstance(error, WorkspaceError)
    assert "`dvc repro --single-item rollout gate` failed (exit" in str(error) and "about to fail" in str(error)
    assert found["validate"]["error"] is None


def test_a_failure_before_any_stage_is_raised_by_stage(repo):
    (repo / "dvc.yaml").write_text("stages: [not, a, mapping\n")
    pipe = pipeline.Pipeline(pipeline.Session(repo))
    with pytest.raises(WorkspaceError, match="`dvc repro validate` failed"):
        pipe.stage()
    pipe.session.close()


def sleepers() -> list[Path]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if b"time.sleep(600)" in (entry / "cmdline").read_bytes():
                found.append(entry)
        except OSError:
            continue
    return found


def test_closing_a_running_pipeline_stops_its_stage(repo):
    spec = yaml.safe_load((repo / "dvc.yaml").read_text())
    spec["stages"]["rollout"]["cmd"] = f"{PY} -c 'import time; time.sleep(600)' && cp v.txt r.txt"
    write(repo, spec["stages"])
    pipe = pipeline.Pipeline(pipeline.Session(repo))
    while (item := pipe.stage()).name != "rollout":
        list(item)
    time.sleep(1)  # the sleeping stage command is running now
    assert sleepers()
    started = time.time()
    pipeline.Start("run", "", pipeline=pipe).close()
    assert time.time() - started < 30
    assert not sleepers()
    assert pipe.session.proc.poll() is not None
    pipe.thread.join(10)
    assert not pipe.running()


def test_dvc_routine_lines_are_not_relayed_as_a_stage_said_them():
    """Every cycle logged DVC's "WARNING: 'data/holdout' is empty." and "Use `dvc push` ..."
    (issue 53): an output legitimately empty and the push the cycle does itself. A stage's
    lines now leave them out, and keep everything else, warnings included."""
    import queue
    import types

    said = ["validate: 981 of 981 traces valid", "WARNING: 'data/holdout' is empty.",
            "WARNING: 'data/quarantine/validate.jsonl' is empty.", "Updating lock file 'dvc.lock'",
            "Use `dvc push` to send your updates to remote storage.",
            "WARNING: the validated traces drifted"]
    events = queue.Queue()
    for text in said:
        events.put(("line", text, "", 0.0))
    events.put(("command-end", None, "", 0.0))
    stage = pipeline.Stage(types.SimpleNamespace(events=events, pending=None), "validate",
                           "Running stage 'validate':", 0.0)
    assert list(stage) == ["Running stage 'validate':", "validate: 981 of 981 traces valid",
                           "Updating lock file 'dvc.lock'",
                           "WARNING: the validated traces drifted"]
