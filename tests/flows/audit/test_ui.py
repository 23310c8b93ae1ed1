"""`offseason ui`: real Prefect and MLflow servers on loopback, stopped cleanly by Ctrl-C."""

import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest
from conftest import BIN, cli_env

pytestmark = pytest.mark.slow


def get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_ui_starts_both_servers_and_stops_them_on_ctrl_c(project):
    env = {**cli_env(project, shared_prefect=False), "PREFECT_HOME": str(project / ".prefect")}
    proc = subprocess.Popen([str(BIN / "offseason"), "ui", "--prefect-port", "0",
                             "--mlflow-port", "0"], cwd=project, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen, urls = [], None
    try:
        deadline = time.time() + 300
        for line in proc.stdout:
            seen.append(line)
            urls = re.search(r"ui: Prefect (http://127\.0\.0\.1:\d+)\s+MLflow "
                             r"(http://127\.0\.0\.1:\d+)", line)
            if urls or time.time() > deadline:
                break
        assert urls, "".join(seen[-30:])
        prefect, mlflow = urls.groups()
        status, body = get(f"{prefect}/api/health")
        assert status == 200 and body.strip() == "true"
        status, body = get(f"{mlflow}/health")
        assert status == 200 and body.strip() == "OK"
        # MLflow answers from the workspace's own store: the experiment list is an API call
        status, _ = get(f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=5")
        assert status == 200
        # the children of each server (uvicorn workers) live in their own process groups
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        groups = {os.getpgid(int(pid)) for pid in children}
        assert len(groups) == 2 and proc.pid not in groups

        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, rest
        assert "ui: stopped" in rest
        for pgid in groups:
            assert not group_alive(pgid), f"process group {pgid} survived Ctrl-C"
        for url in (prefect, mlflow):
            with pytest.raises(OSError):
                urllib.request.urlopen(url, timeout=3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
