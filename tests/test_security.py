"""Nothing leaves the machine, no secret is recorded, every server listens on loopback only.

One whole cycle (init, simulate, run; the TINY config) runs in a network namespace of its own
(`unshare -n`: only a loopback interface, no route anywhere), with an API key in the environment
and secrets in a trace. While it runs, every listening socket in that namespace is recorded
(all of them are offseason's: the namespace is new). Then every MLflow param, tag, metric name
and artifact, the Prefect database (flow run logs included) and every DVC output and cache
object are searched for the secrets.
"""

import gzip
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import BIN, cli_env, make_project

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("security")]

ENV_SECRET = "sk-test-" + "Zq8Wm2Rt" * 4  # what a user has exported for another tool
TRACE_SECRETS = ["sk-proj-" + "Hf3kLp9QxT" * 3, "ghp_" + "Yb7Nc2Vd4Fg6Hj8Kl0Mn" * 2,
                 "AKIA" + "QWERTYUIOP123456", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ0ZXN0dXNlciJ9."
                 "c2lnbmF0dXJlc2lnbmF0dXJl"]
BEARER = "Tk9TZWNyZXRGb3JZb3U5ODc2NTQzMjE"


def netns_available() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                           capture_output=True)
    return probe.returncode == 0


NETNS = netns_available()


def listeners(pid: int) -> set[str]:
    """Listening TCP addresses in the network namespace of `pid`, once it has one of its own.

    Until `unshare` has made its namespace (just after the fork) and again once it has exited,
    /proc/<pid>/net shows this machine's namespace, whose listeners are not offseason's (CI's
    host has its own servers): those moments are skipped.
    """
    found: set[str] = set()

    def own_namespace() -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        except OSError:
            return False

    if not own_namespace():
        return found
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            # each 32-bit word is in the kernel's (little-endian) byte order
            if name == "tcp":
                address = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:
                address = socket.inet_ntop(socket.AF_INET6, b"".join(
                    raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.add(f"{address}:{int(port, 16)}")
    # read again after: it may have exited (and /proc shown the machine's namespace) meanwhile
    return found if own_namespace() else set()


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    root = make_project(tmp / "project")
    env = {**cli_env(root, shared_prefect=False), "PREFECT_HOME": str(tmp / "prefect"), "OPENAI_API_KEY": ENV_SECRET,
           "ANTHROPIC_API_KEY": ENV_SECRET, "HF_TOKEN": ENV_SECRET}
    trace = {"id": "leaky-1", "messages": [
        {"role": "user", "content": f"What is 12+30? (my key is {TRACE_SECRETS[0]}, use "
                                    f"Authorization: Bearer {BEARER})"},
        {"role": "assistant", "content": f"answer:42 (also {TRACE_SECRETS[1]})"}],
        "feedback": {"thumbs_up": True, "comment": f"aws {TRACE_SECRETS[2]} jwt {TRACE_SECRETS[3]}"}}
    script = (f"{BIN / 'offseason'} init && {BIN / 'offseason'} simulate && "
              f"printf '%s\\n' '{json.dumps(trace)}' >> data/inbox/traffic-000.jsonl && "
              f"{BIN / 'offseason'} run")
    command = ["unshare", "-n", "sh", "-c", f"ip link set lo up && {script}"] if NETNS else \
        ["sh", "-c", script]
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: set[str] = set()
    output = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        if NETNS:
            seen |= listeners(proc.pid)
        time.sleep(0.1)
    reader.join(timeout=10)
    return {"root": root, "prefect": tmp / "prefect", "rc": proc.returncode,
            "output": "".join(output), "listeners": seen}


@pytest.mark.skipif(not NETNS, reason="needs root and unshare for a network namespace")
def test_a_whole_cycle_runs_with_no_network(cycle):
    assert cycle["rc"] == 0, cycle["output"][-4000:]
    assert "gen-1: candidate" in cycle["output"]
    tags = subprocess.run(["git", "tag"], cwd=cycle["root"], capture_output=True,
                          text=True).stdout.split()
    assert tags == ["gen-0", "gen-1"]


@pytest.mark.skipif(not NETNS, reason="needs root and unshare for a network namespace")
def test_every_server_listens_on_loopback_only(cycle):
    # Prefect's temporary API server is started for every flow run (and for `offseason init`'s
    # MLflow there is no server at all); none may listen beyond the machine
    assert cycle["listeners"], "no listening socket seen: was Prefect's server not started?"
    for address in cycle["listeners"]:
        host = address.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", "::1"), cycle["listeners"]


def texts_of(path: Path):
    """Every piece of text in a file, whatever its kind: Parquet cells, SQLite rows, gzip, raw."""
    data = path.read_bytes()
    if data[:4] == b"PAR1":
        table = pq.read_table(path)
        yield "\n".join(map(str, table.to_pylist()))
        yield "\n".join(table.column_names)
    elif data[:16] == b"SQLite format 3\x00":
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        for (table,) in db.execute("select name from sqlite_master where type='table'"):
            for row in db.execute(f'select * from "{table}"'):
                yield "\n".join(map(str, row))
        db.close()
    elif data[:2] == b"\x1f\x8b":
        yield gzip.decompress(data).decode("utf-8", "replace")
    else:
        yield data.decode("utf-8", "replace")


def test_no_secret_reaches_mlflow_prefect_or_dvc_outputs(cycle):
    assert cycle["rc"] == 0, cycle["output"][-4000:]
    root = cycle["root"]
    inbox = {p.read_bytes() for p in (root / "data/inbox").iterdir()}
    assert any(TRACE_SECRETS[0].encode() in raw for raw in inbox)  # the input really had them
    places = [root / "mlflow.db", root / "mlartifacts", root / "data", root / "models",
              root / "metrics", root / ".dvc" / "cache", root / ".dvcstore", root / "dvc.lock",
              cycle["prefect"]]
    files = [p for place in places for p in ([place] if place.is_file() else place.rglob("*"))
             if p.is_file()]
    searched, leaks = 0, []
    for path in files:
        if path.is_relative_to(root / "data/inbox") or path.read_bytes() in inbox:
            continue  # the raw input itself, and DVC's copies of it (the inbox snapshot)
        if path.suffix in (".lock",) and path.name != "dvc.lock":
            continue
        searched += 1
        for text in texts_of(path):
            for secret in [ENV_SECRET, BEARER, *TRACE_SECRETS]:
                if secret in text:
                    leaks.append(f"{path.relative_to(path.anchor)}: {secret[:12]}...")
    assert not leaks, leaks
    # the search did look where it should: MLflow params, Prefect's flow run logs, the traces
    mlflow_text = "\n".join(texts_of(root / "mlflow.db"))
    assert "train.sft.lr" in mlflow_text and "offseason.stage" in mlflow_text
    prefect_dbs = list(cycle["prefect"].rglob("*.db"))
    assert prefect_dbs
    db = sqlite3.connect(prefect_dbs[0])
    logs = [row[0] for row in db.execute("select message from log")]
    db.close()
    assert any("ingest |" in message for message in logs)
    assert any("<SECRET_" in text for text in texts_of(root / "data/ingested.parquet"))
    assert searched > 50
