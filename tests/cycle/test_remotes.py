"""Every remote has a bound: nothing listening, or a listener that accepts and never answers.

For each remote offseason talks to (a Ray cluster, OpenAI-compatible rollout servers, an MLflow
server, a Prefect server, a webhook) both faults are tried on loopback; each fails the stage or
command (a webhook: warns) within the probe's deadline (`OFFSEASON_PROBE_TIMEOUT`, 2 s here),
naming the setting, the address and what to do. RELIABILITY.md has the matrix.

    pytest -q tests/cycle/test_remotes.py
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import BIN, cli_env

from flows.project import notify
from stages import config as cfg
from stages import remote, reward
from stages.generation import openai_backend

BOUND_S = 2.0  # OFFSEASON_PROBE_TIMEOUT in these tests
SLACK_S = 20.0  # start-up of the command around the probe (imports, DVC), on a busy machine
# (the suite on 2 cores with 3 workers took 10-12 s in all): the bound is against minutes


def refused() -> str:
    """A loopback host:port where nothing listens (it was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def black_hole():
    """A loopback host:port whose listener accepts connections (the kernel completes them into
    its backlog) and never reads or answers: a wedged server, a half-open tunnel.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(autouse=True)
def short_probe(monkeypatch):
    monkeypatch.setenv("OFFSEASON_PROBE_TIMEOUT", str(BOUND_S))


FAULTS = ["refused", "black hole"]


def address(fault: str, hole: str) -> str:
    return refused() if fault == "refused" else hole


def says(err: str, fault: str) -> bool:
    return ("nothing listens there" in err) if fault == "refused" else \
        (f"did not answer within {BOUND_S:g} s" in err)


@pytest.mark.parametrize("fault", FAULTS)
def test_ray(fault, black_hole, tmp_path):
    # the reward stage's one path: runtime.reward.ray_address is probed before anything is scored
    where = address(fault, black_hole)
    task = {"task_id": "t0", "messages": [{"role": "user", "content": "2*3"}], "answer": "6"}
    rollouts = tmp_path / "rollouts.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "task_id": "arith:t0", "environment": "arith", "task": json.dumps(task),
        "messages": json.dumps(task["messages"] + [{"role": "assistant", "content": "6"}]),
        "error": None}]), rollouts)
    specs = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith")}
    started = time.monotonic()
    with pytest.raises(remote.RemoteDown) as err:
        reward.run(cfg.Reward(ray_address=where), rollouts, tmp_path / "rewards.parquet", specs)
    assert time.monotonic() - started < BOUND_S + 1
    assert f"runtime.reward.ray_address='{where}'" in str(err.value) and says(str(err.value), fault)
    assert "ray start --head" in str(err.value)


@pytest.mark.parametrize("fault", FAULTS)
def test_ray_auto_finds_the_cluster_last_started_here_gone(fault, black_hole, tmp_path,
                                                           monkeypatch):
    """`auto` as Ray resolves it: the cluster last started on this machine (its address in Ray's
    temp folder), which has died or wedged since. ray.init waited two minutes to say so; the
    probe says it within its bound, naming the address auto found (issue 51.4)."""
    where = address(fault, black_hole)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(where + "\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = time.monotonic()
    with pytest.raises(remote.RemoteDown) as err:
        reward.probe_ray("auto")
    assert time.monotonic() - started < BOUND_S + 1
    assert "runtime.reward.ray_address='auto'" in str(err.value) and says(str(err.value), fault)
    assert f"auto found {where}" in str(err.value)
    (tmp_path / "ray" / "ray_current_cluster").unlink()  # no cluster started here at all
    from ray._private.services import find_gcs_addresses

    if not find_gcs_addresses():  # (another test's cluster, running beside, would be found)
        with pytest.raises(remote.RemoteDown, match="no Ray cluster runs on this machine"):
            reward.probe_ray("auto")


@pytest.mark.parametrize("fault", FAULTS)
def test_rollout_servers(fault, black_hole, tmp_path):
    url = f"http://{address(fault, black_hole)}/v1"
    config = cfg.Rollout(backend="openai", urls=f"http://{refused()}/v1, {url}"
                         if fault == "black hole" else url)
    started = time.monotonic()
    with contextlib.ExitStack() as stack, pytest.raises(remote.RemoteDown) as err:
        openai_backend.servers(config, tmp_path, stack)
    assert time.monotonic() - started < BOUND_S + 1
    assert "runtime.rollout.urls=" in str(err.value) and "/v1/models" in str(err.value)


def test_a_grpc_probe_tells_an_http_server_from_ray():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert remote.probe(f"http://127.0.0.1:{server.server_address[1]}/health",
                            setting="x", fix="y") < BOUND_S  # a 501 is an answer
        with pytest.raises(remote.RemoteDown, match="not as a gRPC server"):
            remote.probe(f"127.0.0.1:{server.server_address[1]}", setting="x", fix="y",
                         kind="grpc")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("variable", ["MLFLOW_TRACKING_URI", "PREFECT_API_URL"])
@pytest.mark.parametrize("fault", FAULTS)
def test_mlflow_and_prefect_servers(variable, fault, black_hole, simulated):
    where = f"http://{address(fault, black_hole)}" + ("/api" if variable == "PREFECT_API_URL" else "")
    env = {**cli_env(simulated), variable: where, "OFFSEASON_PROBE_TIMEOUT": str(BOUND_S)}
    started = time.monotonic()
    result = subprocess.run([str(BIN / "offseason"), "run"], cwd=simulated, env=env,
                            capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{variable}='{where}'" in result.stderr and says(result.stderr, fault), result.stderr
    assert "then run `offseason run` again" in result.stderr and "Traceback" not in result.stderr
    assert "Running stage" not in result.stdout + result.stderr  # failed before any stage
    assert took < BOUND_S + SLACK_S, took
    tags = subprocess.run(["git", "tag"], cwd=simulated, capture_output=True, text=True).stdout
    assert tags.split() == ["gen-0"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_an_http_dvc_remote(fault, black_hole, simulated):
    """Promotion pushes to the default DVC remote at the cycle's end: a server remote that is down
    fails the cycle before its first stage, naming the remote, not after every stage has run.
    """
    where = f"http://{address(fault, black_hole)}/dvc-store"
    (simulated / ".dvc" / "config.local").write_text(
        f"[core]\n    remote = web\n['remote \"web\"']\n    url = {where}\n")
    env = {**cli_env(simulated), "OFFSEASON_PROBE_TIMEOUT": str(BOUND_S)}
    started = time.monotonic()
    result = subprocess.run([str(BIN / "offseason"), "run"], cwd=simulated, env=env,
                            capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    assert f".dvc/config remote \"web\" url='{where}'" in result.stderr, result.stderr
    assert says(result.stderr, fault) and "dvc remote default" in result.stderr, result.stderr
    assert "Running stage" not in result.stdout + result.stderr and took < BOUND_S + SLACK_S, took
    # the local folder again: nothing to probe
    (simulated / ".dvc" / "config.local").unlink()
    from flows.orchestration import pipeline

    pipeline.check_dvc_remote(simulated)


@pytest.mark.parametrize("fault", FAULTS)
def test_an_ssh_dvc_remote(fault, black_hole, tmp_path):
    """An SSH remote is there when its server greets within the deadline."""
    from flows.orchestration import pipeline

    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text(
        f"[core]\n    remote = box\n['remote \"box\"']\n"
        f"    url = ssh://{address(fault, black_hole)}/srv/dvc\n")
    started = time.monotonic()
    with pytest.raises(remote.RemoteDown) as err:
        pipeline.check_dvc_remote(tmp_path)
    assert time.monotonic() - started < BOUND_S + 1
    assert '.dvc/config remote "box" url=' in str(err.value) and says(str(err.value), fault)


def test_an_ssh_server_that_greets_is_there():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def greet():
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                time.sleep(0.5)

        import threading

        thread = threading.Thread(target=greet)
        thread.start()
        remote.probe(f"127.0.0.1:{server.getsockname()[1]}", setting="x", fix="y", kind="ssh")
        thread.join()


@pytest.mark.parametrize("fault", FAULTS)
def test_webhook_warns_and_never_fails(fault, black_hole, monkeypatch, caplog):
    monkeypatch.setenv("OFFSEASON_WEBHOOK_URL", f"http://{address(fault, black_hole)}/hook/tok")
    monkeypatch.setenv("OFFSEASON_WEBHOOK_TIMEOUT", "1")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert notify.send("failed", "cycle failed", attempts=2) is False
    assert time.monotonic() - started < 2 * 1 + 0.5 + 1  # two attempts, one back-off
    assert "not delivered" in caplog.text and "tok" not in caplog.text


def test_the_temporary_prefect_server_still_starting_is_not_probed(monkeypatch):
    """`offseason demo` holds one temporary Prefect server for its cycles; the cycle's probe runs
    while it may still be starting: ours is not probed, a configured one is.
    """
    from flows.audit import ui
    from flows.orchestration import pipeline

    where = f"http://{refused()}/api"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", where)
    with pytest.raises(remote.RemoteDown, match="PREFECT_API_URL="):
        pipeline.check_servers()
    monkeypatch.setitem(ui._STARTING, where, lambda: None)
    pipeline.check_servers()  # the temporary server of this process: not probed
