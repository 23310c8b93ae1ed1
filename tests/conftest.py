"""Shared fixtures: a throwaway copy of the project with a tiny configuration."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from stages import config as cfg
from stages import io

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["flows", "stages", "dvc.yaml", "params.yaml", "data/benchmarks", "data/tasks", ".dvc/config",
           ".dvc/.gitignore", ".dvcignore", ".gitignore"]
BIN = Path(sys.executable).parent

# Small enough for seconds on 2 cores, big enough that every stage has real work.
TINY = {
    "init": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64, "warmup_steps": 40,
             "batch_size": 32, "lr": 0.01, "tool_fraction": 0.5},
    "simulate": {"traces_per_day": 48},
    "rollout": {"samples_per_task": 2, "batch_size": 256},
    "train": {"min_examples": 1, "sft": {"epochs": 1}, "dpo": {"epochs": 1},
              "grpo": {"epochs": 1}},
    "gate": {"benchmark_size": 40, "bootstrap_samples": 200},
}

# One torch/BLAS thread per process under xdist workers: several workers each running torch on
# every core oversubscribe the 2 cores, and OpenMP's spinning threads then train 10-20x slower.
# Set before anything imports torch; inherited by the CLI and DVC stage processes tests start.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})

os.environ.update({"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
                   "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "HF_HUB_OFFLINE": "1", "GX_ANALYTICS_ENABLED": "False"})


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules import (torch, transformers, Prefect, MLflow: millions of objects that
    live as long as the worker) with the garbage collector paused, and what they made is then
    frozen out of its reach (`stages.io.heavy_imports`): while they loaded, the heap grew by a
    quarter again and again, and each growth set off a full collection (21 in a worker's
    collection, 6 of its 11 seconds); afterwards, each full collection of the tests' own garbage
    walked them all again. (Around the whole hook: xdist's controller collects nothing.)
    """
    with io.heavy_imports():
        return (yield)


def pytest_collection_modifyitems(config, items):
    """Modules with slow tests first, in file order otherwise: under xdist the longest work
    starts at once instead of being the tail that one worker runs alone at the end. Whole
    modules move, so a module-scoped fixture is still built once per module.
    """
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)


def train_config(**values) -> cfg.Train:
    """`cfg.Train` from flat keys, as tests write them: the algorithm's own (epochs, lr, beta,
    clip, kl_coef) go into its section, `train.<algorithm>`.
    """
    algorithm = cfg.ALGORITHMS[values.get("algorithm", "sft")]
    own = {f.name: values.pop(f.name) for f in dataclasses.fields(algorithm) if f.name in values}
    return cfg.Train(**values, **{values.get("algorithm", "sft"): algorithm(**own)})


def write_params(root: Path, overrides: dict) -> None:
    """Override params.yaml section by section; `environments` is replaced as a whole (its keys
    are a project's own names, not settings to merge).
    """
    params = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in overrides.items():
        if section == "environments":
            params[section] = values
        else:
            params.setdefault(section, {}).update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def make_project(path: Path, overrides: dict | None = None) -> Path:
    """A fresh git + DVC project holding offseason's sources, committed, ready for `init`."""
    path.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        source, target = REPO / name, path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    write_params(path, TINY if overrides is None else overrides)
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start"]):
        subprocess.run(cmd, cwd=path, check=True)
    return path


_PREFECT: dict = {"embedded": False}
# The folder of the session's Prefect server (its home, database, log, url and pid files), named by
# the process that runs the session (`pytest_configure`) and inherited by the xdist workers it starts.
PREFECT_DIR = "OFFSEASON_TESTS_PREFECT_DIR"


def pytest_configure(config):
    """The session's process (xdist's controller, or the only one) names the shared Prefect
    server's folder before any worker starts, so that all of them find the one server.
    """
    if not hasattr(config, "workerinput") and PREFECT_DIR not in os.environ:
        os.environ[PREFECT_DIR] = tempfile.mkdtemp(prefix="offseason-tests-prefect-")
        _PREFECT["owner"] = True


def pytest_unconfigure(config):
    """The session's process stops the shared Prefect server once every worker is done with it
    (a worker cannot: xdist ends each one as its tests run out, while the others go on).
    """
    if _PREFECT.pop("owner", False):
        folder = Path(os.environ.pop(PREFECT_DIR))
        pid = folder / "server.pid"
        if pid.exists():
            _stop_pid(int(pid.read_text()))
        shutil.rmtree(folder, ignore_errors=True)


def shared_prefect_api() -> str:
    """One Prefect server on loopback for the whole test session, started on first use by
    whichever xdist worker needs it first and shared by all of them.

    Each CLI process in Prefect's embedded mode starts a temporary server of its own (about 7 s
    on 2 cores); the tests' cycles talk to this one instead, as a team's processes talk to the
    server of `offseason ui` (a server per worker cost 13 to 15 CPU seconds each; one serving
    all three, 15). The embedded default keeps its own tests: those marked `embedded_prefect` (a
    fresh clone's first cycle), and the no-network and `offseason ui` tests, which start their own.
    """
    if "url" not in _PREFECT:
        from filelock import FileLock

        home = Path(os.environ[PREFECT_DIR])  # named by pytest_configure
        with FileLock(str(home / "server.lock")):
            if not (home / "server.url").exists():
                _start_prefect(home)
            _PREFECT["url"] = (home / "server.url").read_text()
    return _PREFECT["url"]


def _start_prefect(home: Path) -> None:
    """Start `prefect server` in `home` (without the services no test needs) and write its url
    and pid once it answers; `pytest_unconfigure` stops it.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--no-services", "--no-ui"], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the tests' Prefect server did not start:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.5)
    (home / "server.pid").write_text(str(proc.pid))
    (home / "server.url").write_text(url)


def _stop_pid(pid: int) -> None:
    """SIGTERM the process group of `pid` (a server started with start_new_session), SIGKILL it
    if it is still there 20 s later.
    """
    try:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.time() + 20
        while time.time() < deadline:
            with contextlib.suppress(ChildProcessError):  # reaped here if it is our child
                os.waitpid(pid, os.WNOHANG)
            os.killpg(pid, 0)  # raises once the group is gone
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(autouse=True)
def _prefect_mode(request):
    """Tests marked `embedded_prefect` run the CLI in Prefect's embedded mode, as a fresh clone does."""
    _PREFECT["embedded"] = request.node.get_closest_marker("embedded_prefect") is not None
    yield
    _PREFECT["embedded"] = False


def cli_env(root: Path, shared_prefect: bool = True) -> dict:
    """The environment a user has. Prefect: the session's server (`shared_prefect_api`), or with
    `shared_prefect=False` (or the `embedded_prefect` marker) the embedded mode, its local database
    shared by the tests.
    """
    env = {**os.environ, "PREFECT_HOME": str(root.parent.parent / "prefect-home")}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    if shared_prefect and not _PREFECT["embedded"]:
        env["PREFECT_API_URL"] = shared_prefect_api()
    return env


def offseason(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The real CLI, as a user runs it, in the project folder."""
    run_env = cli_env(root)
    result = subprocess.run([str(BIN / "offseason"), *args], cwd=root, capture_output=True,
                            text=True, env=run_env)
    if check and result.returncode != 0:
        raise AssertionError(f"offseason {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def netns_available() -> bool:
    """Whether this process can make a network namespace of its own with a loopback in it
    (`unshare -n`, root): where a test runs a cycle with no network.
    """
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                           capture_output=True)
    return probe.returncode == 0


def hold_cycle_lock(root: Path) -> subprocess.Popen:
    """Another process holding the workspace's cycle lock as `offseason run` does, until killed."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from flows.project.workspace import cycle_lock\n"
        "with cycle_lock(Path(sys.argv[1]), 'offseason run'):\n"
        "    print('held', flush=True); time.sleep(600)"), str(root)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    assert holder.stdout.readline().strip() == "held"
    return holder


def stage_process(root: Path, stage: str, proc: subprocess.Popen, timeout: float = 600) -> int:
    """The pid of the project's `python -m stages.<stage>` once DVC has started it, while `proc`
    runs. Read from /proc, not from the run's output: `offseason run` starts the stages before
    its Prefect flow logs them, so a stage's lines can reach the terminal after it ended.
    """
    needle = f"\0-m\0stages.{stage}\0".encode()
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if needle in (entry / "cmdline").read_bytes() and \
                        (entry / "cwd").resolve() == root.resolve():
                    return int(entry.name)
            except OSError:  # ended meanwhile, or not ours to read
                continue
        time.sleep(0.05)
    raise AssertionError(f"stage {stage} never started (offseason run exit {proc.poll()})")


def kill_and_reap(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILL `proc`'s process group (started with start_new_session) and wait until none of it
    is left, zombies included: an orphan is reaped by init, which can take a second, and DVC takes
    the lock entries of a pid that still exists (a zombie) as held.
    """
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == proc.pid:
                    left.append(stat.parent.name)
            except (OSError, IndexError, ValueError):
                continue
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of group {proc.pid} still there after {timeout} s")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A fresh project: offseason's sources, git and DVC, committed; no `offseason init` yet."""
    return make_project(tmp_path / "project")


def copy_project(source: Path, target: Path) -> Path:
    """A working copy of an initialised project at `target`: git, DVC (cache and local remote),
    data and MLflow's SQLite store, whose artifact locations are absolute paths, moved along.
    """
    shutil.copytree(source, target, symlinks=True)
    shutil.rmtree(target / ".dvc" / "tmp", ignore_errors=True)  # DVC's state of the old inodes
    if (target / "mlflow.db").exists():
        with contextlib.closing(sqlite3.connect(target / "mlflow.db")) as db, db:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for table in tables:
                for column in db.execute(f"PRAGMA table_info('{table}')").fetchall():
                    if column[2].upper().startswith(("VARCHAR", "TEXT")):
                        db.execute(f'UPDATE "{table}" SET "{column[1]}" = '
                                   f'replace("{column[1]}", ?, ?)', (str(source), str(target)))
    return target


# TINY with a warm start long enough that some rollouts are verified correct, so that a cycle's
# train stage has examples to learn from (and trace ids to trace): the lineage and the served
# deployment start from it
LEARN = {**TINY, "init": {**TINY["init"], "n_layer": 2, "n_embd": 64, "warmup_steps": 150,
                          "tool_fraction": 0.9}}


def made_once(tmp_path_factory, name: str, make, leaf: str = "made") -> Path:
    """`make(folder)` run once per test session and shared by the xdist workers (the first one
    makes it, under a file lock, in the folder above the workers' own); returns the folder, which
    tests read or copy, never change.
    """
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    folder = shared / name / leaf
    with FileLock(str(shared / f"{name}.lock")):
        if not (folder.parent / "done").exists():
            shutil.rmtree(folder.parent, ignore_errors=True)
            make(folder)
            (folder.parent / "done").touch()
    return folder


def built_once(tmp_path_factory, name: str, params: dict) -> Path:
    """One project (`params`) after `offseason init` and a day of `offseason simulate`, made once
    per test session (`made_once`); tests take copies of it, never it.
    """
    def make(root: Path) -> None:
        make_project(root, params)
        offseason(root, "init")
        offseason(root, "simulate")

    return made_once(tmp_path_factory, name, make, leaf="project")


@pytest.fixture(scope="session")
def simulated_once(tmp_path_factory) -> Path:
    """The TINY project after `offseason init` and one day of `offseason simulate` (`built_once`)."""
    return built_once(tmp_path_factory, "simulated", TINY)


@pytest.fixture(scope="session")
def learned_once(tmp_path_factory) -> Path:
    """The LEARN project after `offseason init` and one day of `offseason simulate` (`built_once`)."""
    return built_once(tmp_path_factory, "learned", LEARN)


@pytest.fixture(scope="session")
def chat_champion_once(tmp_path_factory) -> Path:
    """A tiny Qwen2 chat model folder after a few seconds of SFT on the support example's gold
    conversations (`chat_model.build_support_agent`). Made once per session (`made_once`): read
    it, never change it (copy it first).
    """
    from chat_model import build_support_agent

    return made_once(tmp_path_factory, "chat-champion", build_support_agent)


@pytest.fixture
def simulated(simulated_once: Path, tmp_path: Path) -> Path:
    """A project of its own after `offseason init` and one day of `offseason simulate`."""
    return copy_project(simulated_once, tmp_path / "project")


@pytest.fixture
def initialised(simulated: Path) -> Path:
    """A project of its own right after `offseason init`: generation 0, an empty inbox."""
    for path in (simulated / "data" / "inbox").iterdir():
        path.unlink()
    return simulated


@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium for the tests that read pages as a person sees them (tests/browser.py
    drives it); skipped, saying why, where it is missing and cannot be installed."""
    # as `make setup` does: Debian's chromium, and Graphviz for the graph (the report falls back
    # to a layout by hand without it)
    missing = [pkg for cmd, pkg in (("chromium", "chromium"), ("dot", "graphviz"))
               if shutil.which(cmd) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
        for attempt in range(2):
            done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
            if done.returncode == 0:
                break
            subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=600)
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("Debian's chromium is not installed and cannot be installed here (needs root "
                    "and apt-get: `apt-get install -y chromium`)")
    return path
