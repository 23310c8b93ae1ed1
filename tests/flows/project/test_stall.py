"""`dvc push` / `pull` against a DVC remote that wedges mid-transfer: stopped after
`runtime.dvc.stall_seconds` without a byte moved, naming the remote; what was sent stays there
(issue 51.4; RELIABILITY.md, "Remotes that stall mid-stage").

    pytest -q tests/flows/project/test_stall.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
from conftest import BIN
from wedging_server import DvcRemote

from flows.orchestration import pipeline
from flows.project import stall, workspace

BOUND_S = 2.0
SLACK_S = 28.0  # DVC's start-up and the kill, on 2 busy cores: the bound is against minutes
FILES = 12


def project(tmp_path, url: str, bound: float = BOUND_S, files: int = FILES):
    """A git + DVC repo with a tracked folder of `files` objects and `url` its default remote."""
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=root, check=True)
    for n in range(files):
        (root / "data" / f"part-{n}.bin").write_bytes(bytes([n]) * 3000 + str(n).encode())
    subprocess.run([str(BIN / "dvc"), "add", "-q", "data"], cwd=root, check=True)
    (root / ".dvc" / "config.local").write_text(
        f"[core]\n    remote = web\n['remote \"web\"']\n    url = {url}\n")
    (root / "params.yaml").write_text(f"runtime:\n  dvc:\n    stall_seconds: {bound}\n")
    return root


def test_tcp_bytes_counts_a_sockets_traffic():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            with peer:
                inode = os.fstat(client.fileno()).st_ino
                before = stall.tcp_bytes()[inode]
                client.sendall(b"x" * 50_000)
                got = 0
                while got < 50_000:
                    got += len(peer.recv(65536))
                peer.sendall(b"y" * 700)
                client.recv(700)
                assert stall.tcp_bytes()[inode] - before == 50_700


@pytest.mark.parametrize("where", ["own process", "session"])
def test_a_push_to_a_remote_that_wedges_stops_naming_it_and_keeps_what_was_sent(where, tmp_path):
    remote = DvcRemote(tmp_path / "store", uploads=4)
    root = project(tmp_path, remote.url)
    session = pipeline.Session(root) if where == "session" else None
    try:
        started = time.monotonic()
        with pytest.raises(workspace.DvcStalled) as err:
            workspace.dvc(root, "push", "--quiet")
        took = time.monotonic() - started
    finally:
        if session is not None:
            session.close(kill=True)
        remote.close()
    message = str(err.value)
    assert took < BOUND_S + SLACK_S, took
    assert f"talking to the DVC remote 'web' ({remote.url})" in message, message
    assert f"runtime.dvc.stall_seconds={BOUND_S:g}" in message and "run the command again" in message
    sent = remote.objects()
    assert len(sent) == 4 and remote.wedged, (sent, remote.wedged)  # 4 stored, the rest held
    # the rerun against the server back: only what the remote lacks
    healthy = DvcRemote(tmp_path / "store")
    try:
        (root / ".dvc" / "config.local").write_text(
            f"[core]\n    remote = web\n['remote \"web\"']\n    url = {healthy.url}\n")
        workspace.dvc(root, "push", "--quiet")
    finally:
        healthy.close()
    assert healthy.uploads == FILES + 1 - 4  # the folder's .dir manifest is an object too
    assert sent < healthy.objects() and len(healthy.objects()) == FILES + 1


def test_a_slow_push_that_keeps_moving_bytes_is_not_stopped(tmp_path):
    # each upload's answer trickles in over 4 s, a header line every 0.5 s: longer than the
    # bound of 3 s, never that long without a byte (the slack: DVC's own work between uploads on
    # 2 cores shared with the rest of the suite took over a second)
    remote = DvcRemote(tmp_path / "store", slow=4.0)
    root = project(tmp_path, remote.url, bound=3.0, files=2)  # 3 objects, the manifest one
    try:
        started = time.monotonic()
        workspace.dvc(root, "push", "--quiet")
        took = time.monotonic() - started
    finally:
        remote.close()
    assert remote.uploads == 3 and took > 4.0, (remote.uploads, took)


def test_a_pull_from_a_remote_that_wedges_names_it(tmp_path):
    healthy = DvcRemote(tmp_path / "store")
    root = project(tmp_path, healthy.url)
    try:
        workspace.dvc(root, "push", "--quiet")
    finally:
        healthy.close()
    subprocess.run(["rm", "-rf", str(root / ".dvc" / "cache"), str(root / "data")], check=True)
    wedged = DvcRemote(tmp_path / "store", answer=3)
    (root / ".dvc" / "config.local").write_text(
        f"[core]\n    remote = web\n['remote \"web\"']\n    url = {wedged.url}\n")
    try:
        started = time.monotonic()
        with pytest.raises(workspace.DvcStalled) as err:
            workspace.dvc(root, "pull", "--quiet", "--force", "data")
        took = time.monotonic() - started
    finally:
        wedged.close()
    assert took < BOUND_S + SLACK_S, took
    assert "'web'" in str(err.value) and "stays in the cache" in str(err.value), str(err.value)
