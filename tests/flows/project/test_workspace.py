import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.project.workspace import WorkspaceError, cycle_lock, find_root, inputs_fingerprint


def test_second_cycle_is_refused_naming_the_first(tmp_path):
    with cycle_lock(tmp_path, "offseason run"):
        with pytest.raises(WorkspaceError, match=r"another cycle is running .*offseason run \(pid "):
            with cycle_lock(tmp_path, "offseason run"):
                pass
    with cycle_lock(tmp_path, "offseason run"):  # released: free again
        pass


def test_stale_lock_of_a_dead_process_is_cleared(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / ".offseason" / "cycle.lock"
    lock.parent.mkdir()
    lock.write_text(json.dumps({"pid": dead.pid, "what": "offseason run", "started": "earlier"}))
    with cycle_lock(tmp_path, "offseason run"):
        assert json.loads(lock.read_text())["what"] == "offseason run"
    assert not lock.exists()


def test_find_root_says_where_it_looked(tmp_path):
    with pytest.raises(WorkspaceError, match="not inside an offseason project"):
        find_root(tmp_path)


def test_fingerprint_follows_inbox_params_and_code(tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "a.py").write_text("x = 1\n")
    (tmp_path / "params.yaml").write_text("base: {}\n")
    first = inputs_fingerprint(tmp_path)
    (tmp_path / "stages" / "a.py").write_text("x = 2\n")
    second = inputs_fingerprint(tmp_path)
    assert first["code"] != second["code"] and first["params"] == second["params"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "inbox.dvc").write_text("outs: [md5: 1]\n")
    assert inputs_fingerprint(tmp_path)["inbox"] != second["inbox"]
    (tmp_path / "stages" / "envs").mkdir()
    (tmp_path / "stages" / "envs" / "b.py").write_text("y = 1\n")  # a subpackage's code counts
    assert inputs_fingerprint(tmp_path)["code"] != second["code"]


def test_the_environments_note_follows_each_modules_code_and_data(tmp_path):
    import json
    import os

    import yaml

    from flows.project.workspace import ENVIRONMENT_SOURCES, note_environments

    (tmp_path / "note_envs").mkdir()
    module = tmp_path / "note_envs" / "greeter.py"
    module.write_text("TOOLS = []\nVERSION = 'g@1'\n\ndef reward(task, messages):\n    return 1.0\n")
    (tmp_path / "note_envs" / "names.json").write_text('["Ada"]')
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"environments": {
        "greeter": {"module": "note_envs.greeter"}, "arith": {"module": "stages.envs.arith"}}}))
    first = note_environments(tmp_path)
    assert first["greeter"] == {"module": "note_envs.greeter", "version": "g@1",
                                "source": "note_envs/greeter.py", "files": 2,
                                "sha256": first["greeter"]["sha256"]}
    # a built-in module is named the same on every machine, wherever it is installed
    assert first["arith"]["source"] == "stages/envs/arith.py"
    path = tmp_path / ENVIRONMENT_SOURCES
    assert json.loads(path.read_text()) == first
    fingerprint = inputs_fingerprint(tmp_path)["environments"]
    os.utime(path, (1, 1))
    assert note_environments(tmp_path) == first and path.stat().st_mtime == 1  # unchanged: kept
    (tmp_path / "note_envs" / "names.json").write_text('["Ada", "Grace"]')  # the data it reads
    second = note_environments(tmp_path)
    assert second["greeter"]["sha256"] != first["greeter"]["sha256"]
    assert second["arith"] == first["arith"]
    assert inputs_fingerprint(tmp_path)["environments"] != fingerprint


def test_history_counts_no_new_traces_for_a_cycle_that_did_not_ingest(tmp_path):
    """A cycle started by a changed module (or params) reuses ingest: its committed
    metrics/ingest.json is the last cycle's, and history counted those traces again."""
    from flows.cli import history_rows

    def commit(tag, files):
        for name, content in files.items():
            (tmp_path / "metrics" / name).write_text(json.dumps(content))
        subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", tag],
                       cwd=tmp_path, check=True)
        subprocess.run(["git", "tag", tag], cwd=tmp_path, check=True)

    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=tmp_path, check=True)
    (tmp_path / "metrics").mkdir()
    verdict = {"candidate_score": 0.5, "champion_score": 0.4, "interval": [0.0, 0.2]}
    commit("gen-0", {"init.json": {"benchmark_score": 0.4}, "promotion.json": {}})
    commit("gen-1", {"gate.json": verdict, "ingest.json": {"accepted": 34},
                     "cost.json": {"stages": {"ingest": {"cpu_seconds": 1.0}}, "total": {}}})
    commit("gen-2", {"cost.json": {"stages": {"ingest": {"reused": True}}, "total": {}}})
    assert [r["new_traces"] for r in history_rows(tmp_path)] == [None, 34, 0]
    # who said no: the gate, a person, or nobody in time (each was "rejected")
    for tag, decision in (("gen-3", "rejected"), ("gen-4", "timeout"), ("gen-5", "not-required")):
        commit(tag, {"promotion.json": {"promoted": False, "decision": {"decision": decision}}})
    assert [r["verdict"] for r in history_rows(tmp_path)][3:] == \
        ["declined", "timed out", "rejected"]


@pytest.mark.parametrize("argv", [["approve", "some-run", "--reason", ""],
                                  ["reject", "some-run", "--reason", "  "],
                                  ["rollback", "--to", "gen-0", "--reason", " \t"]])
def test_a_blank_reason_is_refused_before_anything_is_done(argv, capsys):
    """A reason is kept forever (promotions.jsonl, the commit, the model version's tags): an empty
    one was accepted and recorded as ""."""
    from flows import cli

    with pytest.raises(SystemExit) as exit_:
        cli.parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "argument --reason: give the reason in words" in capsys.readouterr().err


@pytest.mark.parametrize("days", ["0", "-3", "two"])
def test_simulate_refuses_days_that_write_nothing(days, capsys):
    """`simulate --days 0` (or -3) wrote nothing, said nothing and exited 0."""
    from flows import cli

    with pytest.raises(SystemExit) as exit_:
        cli.parser().parse_args(["simulate", "--days", days])
    assert exit_.value.code == 2
    assert "a whole number of days, 1 or more" in capsys.readouterr().err


def test_the_plotted_champion_follows_a_rollback():
    """gen-1 promoted (0.58), then a rollback to gen-0 (0.05): gen-2 was gated against 0.05 and
    rejected. The history and report plots kept the champion at 0.58 through gen-2."""
    from flows.audit.report import champion_after

    rows = [{"score": 0.05, "promoted": True, "champion_score": None},
            {"score": 0.58, "promoted": True, "champion_score": 0.05},
            {"score": 0.04, "promoted": False, "champion_score": 0.05},
            {"score": 0.30, "promoted": False, "champion_score": 0.05}]
    assert champion_after(rows) == [0.05, 0.58, 0.05, 0.05]


def test_a_cycle_paused_for_approval_tells_the_next_one_to_decide_not_to_wait(tmp_path):
    """A second `offseason run` (or a rollback) while the first is paused for a person's
    decision was told "wait for it, or stop that process"; it now names the decision to make."""
    from flows.project.workspace import note_cycle

    with cycle_lock(tmp_path, "offseason run"):
        note_cycle(tmp_path, awaiting="gen-2", awaiting_run="1f0e-run")
        with pytest.raises(WorkspaceError) as refused:
            with cycle_lock(tmp_path, "offseason rollback"):
                pass
        assert "gen-2 waits for approval: decide first, `offseason approve 1f0e-run --reason " \
            "...` or `offseason reject 1f0e-run --reason ...`" in str(refused.value)
        assert "stop that process" not in str(refused.value)
        note_cycle(tmp_path, awaiting="", awaiting_run="")  # decided: the plain message again
        with pytest.raises(WorkspaceError, match="wait for it, or stop that process"):
            with cycle_lock(tmp_path, "offseason run"):
                pass


def test_a_rollback_to_a_generation_that_does_not_exist_says_which_do(tmp_path):
    """`rollback --to gen-9` said "gen-9 was never a champion"; there is no gen-9 at all."""
    from flows.orchestration import promotion

    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=tmp_path, check=True)
    (tmp_path / promotion.LOG).write_text(json.dumps(
        {"action": "init", "generation": 0, "champion_generation": 0}) + "\n")
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "gen-0"],
                   cwd=tmp_path, check=True)
    for tag in ("gen-0", "gen-1"):
        subprocess.run(["git", "tag", tag], cwd=tmp_path, check=True)
    with pytest.raises(WorkspaceError, match=r"no generation gen-9: the tags are gen-0, gen-1$"):
        promotion.rollback(tmp_path, "m", "a reason", "me", to=9)


def test_the_inbox_is_never_among_what_a_cycle_commits_to_git(tmp_path):
    """Before the first cycle `dvc add`s it there is no data/inbox.dvc, and the inbox (production
    traces as they came, personal data and all) was taken for a dep that git keeps: `offseason
    init` committed it, and the first `offseason run` then failed (DVC will not add what git
    tracks), saying nothing because of --quiet.
    """
    from pathlib import Path

    from flows.project.workspace import cycle_inputs, quiet_hint

    repo = Path(__file__).resolve().parents[3]
    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_text((repo / name).read_text())
    (tmp_path / "data" / "inbox").mkdir(parents=True)
    (tmp_path / "data" / "inbox" / "prod.jsonl").write_text('{"messages": []}\n')
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    inputs = cycle_inputs(tmp_path)
    assert not [p for p in inputs if p == "data/inbox" or p.startswith("data/inbox/")], inputs
    # a DVC command that failed saying nothing says how to see why
    assert quiet_hint(["/x/.venv/bin/dvc", "add", "--quiet", "data/inbox"], []) == \
        "(nothing said: --quiet hides the reason; run `/x/.venv/bin/dvc add data/inbox` in the " \
        "project to see it)"
    assert quiet_hint(["dvc", "add", "--quiet", "x"], ["ERROR: output 'x' is already tracked"]) == ""


def test_the_demos_closing_commands_work_as_typed(monkeypatch, tmp_path):
    """The demo's last words suggested `offseason history` and `dvc metrics diff`, neither on
    PATH after `make demo` (issue 53.8): each command is now printed as it can be typed in the
    shell, whose PATH is not the process's (configure_env puts this environment first, for DVC)."""
    from flows import cli
    from flows.project.workspace import USER_PATH, configure_env

    here = Path(sys.executable).parent
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(USER_PATH, raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # this environment not on the shell's PATH
    before = dict(os.environ)
    try:
        configure_env(tmp_path)  # as `offseason demo` does
        assert os.environ["PATH"].startswith(str(here))
        for tool in ("offseason", "dvc"):
            typed = cli.as_typed(tool)
            assert Path(tmp_path, typed).resolve() == (here / tool).resolve(), typed
            assert subprocess.run([typed, "--help"], capture_output=True, cwd=tmp_path,
                                  env={**before, "PATH": "/usr/bin:/bin"}).returncode == 0
        os.environ[USER_PATH] = f"{here}:/usr/bin:/bin"  # an activated venv: the bare name
        assert cli.as_typed("offseason") == "offseason"
    finally:  # what configure_env set, undone
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)


def test_embedded_runs_link_to_where_offseason_ui_serves_them(tmp_path):
    """Without a Prefect server, each run's temporary one is gone when it ends: Prefect's "View
    at ..." lines and links point where `offseason ui` serves the same runs (issue 53.8); with a
    server, at that server."""
    code = ("import sys; from pathlib import Path\n"
            "from flows.project.workspace import configure_env\n"
            "configure_env(Path(sys.argv[1]))\n"
            "from prefect.utilities.urls import url_for\n"
            "print(url_for('flow-run', obj_id='abc'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    embedded = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                              text=True, env=env, check=True).stdout.strip()
    assert embedded == "http://127.0.0.1:4200/runs/flow-run/abc"
    served = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                            text=True, check=True,
                            env={**env, "PREFECT_API_URL": "http://127.0.0.1:4311/api"}
                            ).stdout.strip()
    assert served == "http://127.0.0.1:4311/runs/flow-run/abc"
