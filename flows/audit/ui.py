"""`offseason ui`: the Prefect and MLflow UIs of this workspace, on 127.0.0.1, until Ctrl-C.

Starts `prefect server start` (its database in `<repo>/.prefect`, the same one `offseason run`
uses, so past flow runs and report artifacts are there) and `mlflow server` on the workspace's
SQLite store (one worker, MLflow's job runner off: a small footprint for a laptop), waits until
both answer their health endpoints, prints their URLs, and on Ctrl-C or SIGTERM stops both
process groups (each server's own workers included), SIGTERM first, SIGKILL after 10 s. Their
logs are in `.offseason/ui/`.

    offseason ui                                  # Prefect on :4200, MLflow on :5000
    offseason ui --prefect-port 0 --mlflow-port 0 # any free ports
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from flows.project.workspace import TELEMETRY_OFF, WorkspaceError


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(url: str) -> bool:
    """True if the URL answers 200 within two seconds."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def port_in_use(port: int) -> bool:
    """True if something listens on the localhost port."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def commands(root: Path, prefect_port: int, mlflow_port: int) -> dict[str, dict]:
    """The Prefect and MLflow server commands, with their environments and URLs."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, **TELEMETRY_OFF, "PREFECT_HOME": os.environ.get(
        "PREFECT_HOME", str(root / ".prefect")), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("PREFECT_API_URL", None)  # the server is the API; it must not point at another one
    return {
        "Prefect": {
            "cmd": [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1",
                    "--port", str(prefect_port), "--analytics-off"],
            "url": f"http://127.0.0.1:{prefect_port}",
            "health": f"http://127.0.0.1:{prefect_port}/api/health", "env": env},
        "MLflow": {
            "cmd": [str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                    str(mlflow_port), "--workers", "1",
                    "--backend-store-uri", os.environ.get("MLFLOW_TRACKING_URI",
                                                          f"sqlite:///{root / 'mlflow.db'}"),
                    "--default-artifact-root", (root / "mlartifacts").as_uri()],
            "url": f"http://127.0.0.1:{mlflow_port}",
            "health": f"http://127.0.0.1:{mlflow_port}/health", "env": env},
    }


def stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM to each server's process group, SIGKILL to what is left after 10 s."""
    for proc in procs.values():
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + 10
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs.values():
        try:  # the group may outlive its leader (uvicorn workers): clear it either way
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def serve_ui(root: Path, prefect_port: int = 4200, mlflow_port: int = 5000,
             timeout: float = 300) -> int:
    """Run the Prefect and MLflow UIs until interrupted; returns the exit code."""
    prefect_port = prefect_port or free_port()
    mlflow_port = mlflow_port or free_port()
    for name, port in (("Prefect", prefect_port), ("MLflow", mlflow_port)):
        if port_in_use(port):
            raise WorkspaceError(f"port {port} on 127.0.0.1 is taken (wanted for {name}); stop "
                                 f"what runs there or pick another with "
                                 f"--{name.lower()}-port (0 picks a free one)")
    logs = root / ".offseason" / "ui"
    logs.mkdir(parents=True, exist_ok=True)
    specs = commands(root, prefect_port, mlflow_port)
    procs: dict[str, subprocess.Popen] = {}
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name, spec in specs.items():
            log = open(logs / f"{name.lower()}.log", "w")  # noqa: SIM115 (kept open for the child)
            procs[name] = subprocess.Popen(spec["cmd"], cwd=root, env=spec["env"], stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        print(f"ui: starting Prefect and MLflow (logs in {logs}) ...", flush=True)
        waiting, started = set(specs), time.time()
        while waiting and not stopping:
            for name in sorted(waiting):
                if procs[name].poll() is not None:
                    tail = (logs / f"{name.lower()}.log").read_text().splitlines()[-15:]
                    raise WorkspaceError(f"the {name} server exited ({procs[name].returncode}) "
                                         f"before answering:\n" + "\n".join(tail))
                if answers(specs[name]["health"]):
                    waiting.discard(name)
            if time.time() - started > timeout:
                raise WorkspaceError(f"{', '.join(sorted(waiting))} did not answer within "
                                     f"{timeout:.0f} s; see the logs in {logs}")
            time.sleep(0.5)
        if not stopping:
            print(f"ui: Prefect {specs['Prefect']['url']}  MLflow {specs['MLflow']['url']}  "
                  f"(ready in {time.time() - started:.0f} s; Ctrl-C stops both)", flush=True)
            print(f"ui: to send flow runs to this Prefect server: export "
                  f"PREFECT_API_URL={specs['Prefect']['url']}/api", flush=True)
        while not stopping:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise WorkspaceError(f"the {name} server stopped ({proc.returncode}); see "
                                         f"{logs / (name.lower() + '.log')}")
            time.sleep(0.5)
        print("ui: stopping both servers ...", flush=True)
        return 0
    finally:
        stop(procs)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if procs:
            print("ui: stopped", flush=True)


_STARTING: dict[str, object] = {}  # API url -> waits until that temporary server answers


def on_temporary_prefect() -> bool:
    """Whether this process's flows go to a temporary_prefect() server (gone when it ends)."""
    return os.environ.get("PREFECT_API_URL") in _STARTING


@contextmanager
def temporary_prefect(root: Path):
    """Prefect's temporary local server for this process, started at once, stopped at the end.

    Prefect starts the same server itself (`SubprocessASGIServer`: uvicorn on a free port of
    127.0.0.1, no UI, its database in PREFECT_HOME) when a flow first needs the API, and waits for
    it then. Started here instead, it comes up while the first stages run. Yields a function that
    waits until the server answers. Does nothing when PREFECT_API_URL names a server already, or
    when Prefect is loaded already (its settings were read then: the flow will start its own).
    """
    if os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:
        # an enclosing temporary_prefect (`offseason demo`'s cycles share one) or a real server
        yield _STARTING.get(os.environ.get("PREFECT_API_URL"), lambda: None)
        return
    port = free_port()
    package = Path(importlib.util.find_spec("prefect").origin).parent
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
           "PREFECT__SERVER_FINAL": "1"}
    log_path = root / ".offseason" / "prefect-server.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(package.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"], cwd=root, env=env, stdout=log,
            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    os.environ["PREFECT_API_URL"] = url  # read once, when Prefect loads: before that
    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 180))

    def ready() -> None:
        started = time.time()
        while not up and not answers(f"{url}/health"):
            if server.poll() is not None or time.time() - started > timeout:
                tail = log_path.read_text(errors="replace").splitlines()[-15:]
                raise WorkspaceError(
                    f"Prefect's temporary server did not answer on {url} ("
                    + (f"it exited with {server.returncode}" if server.poll() is not None else
                       f"not within {timeout:.0f} s") + f"; its log is {log_path}):\n"
                    + "\n".join(tail))
            time.sleep(0.1)
        up.append(True)

    up: list[bool] = []
    _STARTING[url] = ready
    try:
        yield ready
    finally:
        del _STARTING[url]
        if "prefect" in sys.modules:  # what the flow logged is sent before the server goes
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=10)
            EventsWorker.drain_all(timeout=10)
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        del os.environ["PREFECT_API_URL"]
