"""The fork server (flows/orchestration/forkserver.py): a served stage command behaves as `python -m` would,
and anything it would not serve runs cold, as before.

A probe package stands in for a stage module (the real ones take seconds to import; the whole
cycles of the other tests run theirs through the server): it reports the process that ran it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.orchestration import forkserver

REPO = Path(__file__).resolve().parents[3]

PROBE = '''
import gc, json, os, sys, time
from pathlib import Path
mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                      "name": __name__, "stdin": sys.stdin.read(), "probe": os.environ.get("PROBE"),
                      "gc": gc.isenabled()}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
if mode == "hang":
    Path(sys.argv[2]).write_text(str(os.getpid()))
    time.sleep(600)
if mode == "fail":
    raise ValueError("a stage that breaks")
'''


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A server of `probe.stage` for commands run in `tmp_path/root`, and the env they get."""
    root = tmp_path / "root"
    (root / "probe").mkdir(parents=True)
    (root / "probe" / "__init__.py").write_text("")
    (root / "probe" / "stage.py").write_text(PROBE)
    (root / "probe" / "other.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # flows.orchestration.forkserver, for the server process
    monkeypatch.setenv("PROBE", "from the server's environment")
    server = forkserver.Server(root, ("probe.stage",))
    env = dict(os.environ)  # what DVC's commands inherit: the address, the shim first on PATH
    try:
        yield root, server, env
    finally:
        server.stop()
    assert not Path(server.address).exists() and forkserver.ADDRESS not in os.environ


def python(root, env, *args, **kwargs):
    """`python ARGS` as DVC's shell runs it: the first `python` on PATH."""
    return subprocess.run(["python", *args], cwd=root, env=env, capture_output=True, text=True,
                          **kwargs)


def report(out):
    import json

    return json.loads(out.stdout)


def test_a_served_command_runs_in_a_child_of_the_server_as_python_m_would(served):
    root, server, env = served
    out = python(root, env, "-m", "probe.stage", "report", "3", input="from stdin")
    assert out.returncode == 3, out.stderr
    seen = report(out)
    assert seen["ppid"] == server.proc.pid  # forked, not started
    assert seen == {"ppid": server.proc.pid, "argv": ["report", "3"], "cwd": str(root),
                    "name": "__main__", "stdin": "from stdin",
                    "probe": "from the server's environment",
                    "gc": True}  # collecting, as a cold process: paused only while it imported
    assert out.stderr == "to stderr\n"
    # and the cold run of the same command says the same, from a process of its own
    cold = subprocess.run([sys.executable, "-m", "probe.stage", "report", "3"], cwd=root, env=env,
                          capture_output=True, text=True, input="from stdin")
    assert cold.returncode == 3 and cold.stderr == out.stderr
    assert {**report(cold), "ppid": 0} == {**seen, "ppid": 0}
    assert report(cold)["ppid"] != server.proc.pid


def test_what_the_server_does_not_serve_runs_cold(served):
    root, server, env = served
    # another module, another interpreter option, another environment, another folder
    other = python(root, env, "-m", "probe.other", "report", "0")
    assert other.returncode == 0 and report(other)["ppid"] != server.proc.pid
    assert python(root, env, "-c", "print(6 * 7)").stdout == "42\n"
    changed = python(root, {**env, "PROBE": "changed since the server started"}, "-m",
                     "probe.stage", "report", "0")
    assert "probe.stage starts cold: its environment differs from the server's in PROBE" in \
        changed.stderr
    seen = report(changed)
    assert seen["ppid"] != server.proc.pid and seen["probe"] == "changed since the server started"
    shutil.copytree(root / "probe", root / "sub" / "probe")
    elsewhere = python(root / "sub", env, "-m", "probe.stage", "report", "0")
    assert report(elsewhere)["ppid"] != server.proc.pid
    # DVC's own variables and the shell's do not count as a difference
    dvc = python(root, {**env, "DVC_STAGE": "rollout", "DVC_ROOT": str(root), "SHLVL": "2"},
                 "-m", "probe.stage", "report", "0")
    assert report(dvc)["ppid"] == server.proc.pid


def test_a_stage_that_raises_prints_its_traceback_and_exits_1(served):
    root, server, env = served
    out = python(root, env, "-m", "probe.stage", "fail")
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "ValueError: a stage that breaks" in out.stderr


def wait_gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def started(root, env, marker: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(["python", "-m", "probe.stage", "hang", str(marker)], cwd=root,
                            env=env)
    deadline = time.time() + 60
    while not marker.exists() or not marker.read_text():
        assert time.time() < deadline and proc.poll() is None, "the served probe never started"
        time.sleep(0.05)
    return proc, int(marker.read_text())


def test_sigterm_reaches_the_child_and_the_client_dies_of_it_too(served, tmp_path):
    root, server, env = served
    proc, child = started(root, env, tmp_path / "pid")
    assert child != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # what DVC sees, as from a cold stage
    assert wait_gone(child)


def test_a_killed_client_takes_its_child_with_it(served, tmp_path):
    root, server, env = served
    proc, child = started(root, env, tmp_path / "pid")
    proc.kill()  # SIGKILL: nothing to forward; the server sees the connection close
    proc.wait()
    assert wait_gone(child), "the child of a killed client still runs"
    # and the server goes on serving
    assert report(python(root, env, "-m", "probe.stage", "report", "0"))["ppid"] == \
        server.proc.pid


def test_with_the_server_gone_every_command_runs_cold(served):
    root, server, env = served
    server.proc.kill()
    server.proc.wait()
    out = python(root, env, "-m", "probe.stage", "report", "0")
    assert out.returncode == 0 and report(out)["ppid"] != server.proc.pid
    assert "probe.stage starts cold: no server answers" in out.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_server_that_dies_takes_its_children_and_their_clients_end(served, tmp_path, signum):
    root, server, env = served
    proc, child = started(root, env, tmp_path / "pid")
    server.proc.send_signal(signum)
    assert wait_gone(child), "a child outlived its server"
    assert proc.wait(timeout=30) == -signal.SIGKILL  # the stage did not finish: DVC sees it


def test_the_server_imports_only_once_a_stage_command_starts(tmp_path, monkeypatch):
    root = tmp_path / "root"
    (root / "probe").mkdir(parents=True)
    (root / "probe" / "__init__.py").write_text("")
    # the served module notes each process that imports it; an earlier stage prints
    (root / "probe" / "stage.py").write_text(
        "import os\nwith open(os.environ['IMPORTED'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    (root / "probe" / "earlier.py").write_text("print('an earlier stage')")
    imported = tmp_path / "imported"
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("IMPORTED", str(imported))
    # a session that runs no stage: its server imports nothing, and ends when told
    idle = forkserver.Server(root, ("probe.stage",))
    idle.stop()
    assert idle.proc.returncode == 0 and not imported.exists()
    # an earlier stage's command (not served: it runs cold) is the server's cue to import
    server = forkserver.Server(root, ("probe.stage",))
    try:
        env = dict(os.environ)
        earlier = python(root, env, "-m", "probe.earlier")
        assert earlier.returncode == 0 and earlier.stdout == "an earlier stage\n", earlier.stderr
        deadline = time.time() + 60
        while not imported.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert imported.read_text() == f"{server.proc.pid}\n"
        served = python(root, env, "-m", "probe.stage")  # forked: it runs as __main__ in a child
        assert served.returncode == 0, served.stderr
        lines = imported.read_text().split()
        assert len(lines) == 2 and lines[1] != lines[0] and "starts cold" not in served.stderr
    finally:
        server.stop()


def test_the_session_starts_a_server_only_for_commands_that_lead_to_model_stages():
    for args, starts in ((["repro", "validate"], True), (["repro"], True),
                         (["repro", "--single-item", "rollout", "reward"], True),
                         (["repro", "ingest"], False), (["add", "models/champion"], False),
                         (["push"], False)):
        assert forkserver.precedes_served(args) is starts, args


def test_the_folders_of_killed_sessions_are_removed_by_the_next_server(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = tmp_path / f"{forkserver.PREFIX}stale", tmp_path / f"{forkserver.PREFIX}live"
    for folder, owner in ((stale, dead.pid), (live, os.getpid())):
        folder.mkdir()
        (folder / "owner").write_text(str(owner))
        (folder / "socket").touch()
    # no owner: one being made now is left alone, an old one (from before owners) removed
    young, old = tmp_path / f"{forkserver.PREFIX}young", tmp_path / f"{forkserver.PREFIX}old"
    young.mkdir()
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "root" / "probe").mkdir(parents=True)
    for name in ("__init__.py", "stage.py"):
        (tmp_path / "root" / "probe" / name).write_text("")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    server = forkserver.Server(tmp_path / "root", ("probe.stage",))
    try:
        assert not stale.exists() and live.exists()
        assert young.exists() and not old.exists()
        assert server.folder.parent == tmp_path and (server.folder / "owner").read_text() == \
            str(os.getpid())
    finally:
        server.stop()
    assert not server.folder.exists()
