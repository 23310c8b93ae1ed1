"""Approval through real Prefect flow runs, the promotion transaction, its log, and rollback."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import BIN, REPO, cli_env, make_project

pytestmark = pytest.mark.slow

FLOW = '''
import json, sys
from prefect import flow
from flows.promotion import await_approval
from stages import config as cfg

VERDICT = {"passed": True, "candidate_score": 0.6, "champion_score": 0.4, "difference": 0.2,
           "interval": [0.1, 0.3], "confidence": 0.9, "primary": "arith", "failures": []}

@flow(name="approval-check", flow_run_name="gen-" + sys.argv[1])
def check(timeout: int):
    return await_approval(int(sys.argv[1]), VERDICT,
                          cfg.Promotion(require_approval=True, approval_timeout=timeout))

if __name__ == "__main__":
    print("DECISION " + json.dumps(check(int(sys.argv[2]))), flush=True)
'''


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A real Prefect server on 127.0.0.1, shared by the flow runs and the CLI as a team would
    share one (`offseason ui`). The embedded default works too, each process opening the same
    database in PREFECT_HOME through a temporary server, but every command then pays for starting
    one, which makes a test of three decisions slow."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path_factory.mktemp("prefect-server")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(1)
    else:
        server.kill()
        pytest.fail("the Prefect server did not start within 240 s")
    yield {"PREFECT_API_URL": url, "PREFECT_HOME": str(home)}
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=60)


def cli(root, api, *args, check=True):
    result = subprocess.run([str(BIN / "offseason"), *args], cwd=root, capture_output=True,
                            text=True, env={**cli_env(root), **api})
    if check and result.returncode != 0:
        raise AssertionError(f"offseason {' '.join(args)}: {result.stdout}\n{result.stderr}")
    return result


def start_flow(root, api, generation, timeout):
    env = {**cli_env(root), **api, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(root / "flowcheck.py"), str(generation),
                             str(timeout)], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def decision(proc):
    out, _ = proc.communicate(timeout=300)
    line = next((line for line in out.splitlines() if line.startswith("DECISION ")), None)
    assert line, out[-3000:]
    return json.loads(line[len("DECISION "):]), out


def test_approve_reject_and_timeout_through_prefect(tmp_path, prefect_api):
    root = make_project(tmp_path / "p")
    (root / "flowcheck.py").write_text(FLOW)
    approve, reject = start_flow(root, prefect_api, 1, 600), start_flow(root, prefect_api, 2, 600)
    timeout = start_flow(root, prefect_api, 3, 4)
    waiting = {}
    deadline = time.time() + 240
    while len(waiting) < 2 and time.time() < deadline:
        listing = cli(root, prefect_api, "pending").stdout
        waiting = {line.split()[1]: line.split()[0] for line in listing.splitlines()
                   if line[:1].strip() and len(line.split()) > 2 and line.split()[1] in
                   ("gen-1", "gen-2")}
    assert set(waiting) == {"gen-1", "gen-2"}, listing
    assert "gen-1: arith: candidate 0.600 vs champion 0.400" in listing  # the gate summary
    cli(root, prefect_api, "approve", waiting["gen-1"], "--reason", "clearly better",
        "--approver", "alice")
    out = cli(root, prefect_api, "reject", waiting["gen-2"], "--reason", "wait for the audit")
    assert "rejected" in out.stdout
    approved, _ = decision(approve)
    assert (approved["decision"], approved["approver"], approved["reason"]) == \
        ("approved", "alice", "clearly better")
    rejected, _ = decision(reject)
    assert rejected["decision"] == "rejected" and rejected["reason"] == "wait for the audit"
    timed_out, log = decision(timeout)
    assert timed_out["decision"] == "timeout" and "approval_timeout=4s" in timed_out["reason"]
    assert "Finished in state Completed" in log  # the run goes on, it is not failed
    again = cli(root, prefect_api, "approve", waiting["gen-1"], "--reason", "twice", check=False)
    assert again.returncode == 2 and "is not waiting for a decision" in again.stderr
