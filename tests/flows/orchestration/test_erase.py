"""`offseason erase` end to end: a person's traces through a real cycle (DVC, MLflow, git,
Prefect), then erased; every byte offseason owns is scanned for them afterwards."""

import gzip
import json
import os
import signal
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import BIN, cli_env, copy_project, hold_cycle_lock, offseason

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("erase")]

USER, SESSION, WORD = "u-quorvath-7731", "sess-quorvath-1", "Zyxquorvath"
MARKERS = (USER, SESSION, WORD, "qv-trace-")


def person(prefix: str = "qv-trace", n: int = 4) -> str:
    """A synthetic person's traces as an inbox file: arithmetic the demo learns from, one with
    a rating, and one record ingest quarantines (it carries their user id and words too)."""
    rows = [{"id": f"{prefix}-{i}", "user": USER, "session_id": SESSION,
             "created_at": "2026-01-01T10:00:00+00:00", "model": "offseason-agent@champion",
             "messages": [{"role": "user", "content": f"{a}+{b} ({WORD} asks, {prefix})"},
                          {"role": "assistant", "content": f"answer:{a + b}"}],
             "feedback": {"thumbs_up": i % 2 == 0}}
            for i, (a, b) in enumerate([(12, 34), (7, 8), (21, 3), (40, 2)][:n])]
    rows.append({"id": f"{prefix}-broken", "user": USER,
                 "messages": [{"content": f"{WORD} without a role"}]})
    return "".join(json.dumps(r) + "\n" for r in rows)


def _other(i: int) -> str:
    return json.dumps({"id": f"other-mixed-{i}", "user": "u-someone-else",
                       "messages": [{"role": "user", "content": f"{i}+{i} (someone else)"},
                                    {"role": "assistant", "content": f"answer:{i + i}"}]}) + "\n"


# a file shared with someone else: their line sits between two of another person's (an erasure
# removes the person's line and keeps the others, byte for byte)
OTHERS = _other(3) + _other(5)
MIXED = _other(3) + json.dumps({
    "id": "qv-trace-mixed", "user": USER, "messages": [
        {"role": "user", "content": f"9+9 ({WORD} again)"},
        {"role": "assistant", "content": "answer:18"}]}) + "\n" + _other(5)


def texts(data: bytes):
    """The bytes, and what they hold decoded: a Parquet file's rows, a gzip stream."""
    yield data
    if data[:4] == b"PAR1":
        table = pq.ParquetFile(pa.BufferReader(data)).read()
        yield json.dumps(table.to_pylist(), default=str).encode()
    if data[:2] == b"\x1f\x8b":
        yield gzip.decompress(data)


def scan(root: Path, markers=MARKERS) -> dict[str, list[str]]:
    """Where any marker (text, or bytes as they are) is: every file under the project (work
    tree, .dvc/cache, the local remote, mlflow.db, mlartifacts, .offseason), and every object of
    git's history."""
    markers = [m if isinstance(m, bytes) else m.encode() for m in markers]
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and ".git" not in path.relative_to(root).parts:
            hits = {m for t in texts(path.read_bytes()) for m in markers if m in t}
            if hits:
                found[str(path.relative_to(root))] = sorted(hits)
    objects = subprocess.run(["git", "rev-list", "--all", "--objects"], cwd=root, text=True,
                             capture_output=True, check=True).stdout.split("\n")
    log = subprocess.run(["git", "log", "--all", "--format=%B"], cwd=root,
                         capture_output=True, check=True).stdout
    for marker in markers:
        if marker in log:
            found.setdefault("git commit messages", []).append(marker)
    # every object of history, read in one `git cat-file --batch`
    lines = [line for line in objects if line]
    batch = subprocess.run(["git", "cat-file", "--batch"], cwd=root, capture_output=True,
                           check=True, input="".join(line.split(" ", 1)[0] + "\n"
                                                     for line in lines).encode()).stdout
    at = 0
    for line in lines:
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        data = batch[header_end + 1: header_end + 1 + size]
        at = header_end + 1 + size + 1
        hits = {m for t in texts(data) for m in markers if m in t}
        if hits:
            found[f"git {line}"] = sorted(hits)
    return found


@pytest.fixture(scope="module")
def cycled(tmp_path_factory, simulated_once):
    """One cycle over a day of traffic and the person's inbox file; their trace ids in pull's
    state, as a pull from Langfuse leaves them. Tests take copies of it, never it."""
    root = copy_project(simulated_once, tmp_path_factory.mktemp("erase") / "project")
    (root / "data" / "inbox" / "person.jsonl").write_text(person())
    (root / "data" / "inbox" / "mixed.jsonl").write_text(MIXED)
    offseason(root, "run")
    state = root / ".offseason" / "pull" / "langfuse.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"service": "langfuse", "project": "", "complete_from": None,
                                 "ids": {"qv-trace-1": "2026-01-01T10:00:00+00:00",
                                         "other-1": "2026-01-01T10:00:00+00:00"}}))
    return root


@pytest.fixture(scope="module")
def learned(cycled, tmp_path_factory):
    """A copy of `cycled` of the module's own."""
    return copy_project(cycled, tmp_path_factory.mktemp("erase-once") / "project")


def git_dirty(root: Path) -> str:
    """The tracked files git sees changed (an erasure commits what it changed)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                          capture_output=True, text=True, check=True).stdout


def dvc_status(root: Path) -> str:
    return subprocess.run([str(BIN / "dvc"), "status"], cwd=root, capture_output=True,
                          text=True, check=True).stdout


def test_erase_leaves_no_byte_of_the_person(learned):
    root = learned
    before = scan(root)
    # the cycle really carried them everywhere the test looks afterwards
    assert {"data/inbox/person.jsonl", "data/ingested.parquet", "data/validated.parquet",
            "data/quarantine/ingest.jsonl", "data/rollouts.parquet"} <= set(before)
    assert any(k.startswith(".dvc/cache/") for k in before)
    assert any(k.startswith(".dvcstore/") for k in before)
    index = [p for p in (root / "data" / "traces").glob("index-*.parquet")]
    # the index holds trace ids and salted hashes: no user id, session id or words
    assert index and not any(m.encode() in t for p in index for t in texts(p.read_bytes())
                             for m in (USER, SESSION, WORD))

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout
    dry = json.loads(offseason(root, "erase", "--user", USER, "--dry-run", "--json").stdout)
    assert dry["found"]["traces"] == 6
    assert dry["found"]["inbox_files"] == ["mixed.jsonl", "person.jsonl"]
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout == head and scan(root) == before

    # refused while a cycle runs
    holder = hold_cycle_lock(root)
    try:
        refused = offseason(root, "erase", "--user", USER, check=False)
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 2 and "offseason run" in refused.stderr

    receipt = json.loads(offseason(root, "erase", "--user", USER, "--reason", "request 17",
                                   "--json").stdout)
    assert receipt["status"] == "done" and receipt["found"]["traces"] == 6
    assert receipt["purged"], "older versions in the cache and the remote were deleted"
    assert {d["store"] for d in receipt["purged"]} == {"cache", "remote local"}
    assert scan(root) == {}
    assert "up to date" in dvc_status(root)
    # the receipt, its page and the request's record, with no personal data
    page = (root / ".offseason" / "erasures" / f"{receipt['id']}.txt").read_text()
    assert "done" in page and "data/inbox/person.jsonl" in page
    log = [json.loads(line) for line in (root / "erasures.jsonl").read_text().splitlines()]
    assert log[-1]["id"] == receipt["id"] and log[-1]["done"] and log[-1]["traces"] == 6
    assert (root / "data" / "inbox" / "mixed.jsonl").read_text() == OTHERS
    assert git_dirty(root) == ""
    status = offseason(root, "erase", "--status").stdout
    assert f"{receipt['id']}: done" in status and "0 open" in status

    # verify knows the purged objects as erased, not as missing or corrupt
    verified = offseason(root, "lineage", "--verify", "gen-1", check=False)
    assert verified.returncode == 0, verified.stdout
    assert "ERASED" in verified.stdout and "MISSING" not in verified.stdout
    traced = offseason(root, "lineage", "--trace", "qv-trace-0").stdout
    assert f"ERASED by {receipt['id']}" in traced
    # pull's state forgot them; the others' ids stay
    state = json.loads((root / ".offseason/pull/langfuse.json").read_text())
    assert list(state["ids"]) == ["other-1"]

    # an unknown subject deletes nothing and says so
    tree = subprocess.run(["git", "ls-files", "-s", "data"], cwd=root, capture_output=True,
                          text=True).stdout
    nobody = offseason(root, "erase", "--user", "nobody-at-all").stdout
    assert "nothing found" in nobody
    assert subprocess.run(["git", "ls-files", "-s", "data"], cwd=root, capture_output=True,
                          text=True).stdout == tree

    # the person sends traces again (a new file): the next ingest drops them, writes them nowhere
    (root / "data" / "inbox" / "again.jsonl").write_text(person("qv-again", 2))
    subprocess.run([str(BIN / "dvc"), "repro", "--quiet", "ingest"], cwd=root, check=True,
                   env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    metrics = json.loads((root / "metrics" / "ingest.json").read_text())
    assert metrics["erased"] == 3 and metrics["accepted"] == 0
    # the raw file alone, as it came (and DVC's copy of it), nothing made of it
    again = (root / "data" / "inbox" / "again.jsonl").read_bytes()
    assert {k for k in scan(root) if (root / k).read_bytes() != again} == set()


@pytest.mark.parametrize("phase", ["rewrite", "commit", "purge"])
def test_killed_in_each_phase_then_rerun_finishes_the_same_erasure(cycled, tmp_path, phase):
    """`kill -9` (OFFSEASON_FAIL_AT=erase:<phase>: after the inbox files are rewritten, after
    `dvc commit` before the push and the git commit, after the first stored object is deleted),
    then the same command: the erasure it began is finished, whole."""
    root = copy_project(cycled, tmp_path / "project")
    killed = subprocess.run([str(BIN / "offseason"), "erase", "--user", USER],
                            cwd=root, capture_output=True, text=True,
                            env={**cli_env(root), "OFFSEASON_FAIL_AT": f"erase:{phase}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    pending = json.loads(next((root / ".offseason" / "erasures").glob("*.pending.json"))
                         .read_text())
    assert scan(root), "the kill left work to finish"
    log = [json.loads(line) for line in (root / "erasures.jsonl").read_text().splitlines()]
    assert [(r["id"], r["done"]) for r in log] == [(pending["id"], None)]
    assert f"{pending['id']}: OPEN" in offseason(root, "erase", "--status").stdout

    receipt = json.loads(offseason(root, "erase", "--user", USER, "--json").stdout)
    assert receipt["id"] == pending["id"] and receipt["status"] == "done"
    assert receipt["found"]["traces"] == 6
    assert not list((root / ".offseason" / "erasures").glob("*.pending.json"))
    # nothing half-rewritten: the other person's lines whole, no temporary file left
    assert (root / "data" / "inbox" / "mixed.jsonl").read_text() == OTHERS
    assert [p for p in root.rglob(".*.tmp-*") if ".git" not in p.relative_to(root).parts] == []
    assert scan(root) == {}
    assert "up to date" in dvc_status(root) and git_dirty(root) == ""
    log = [json.loads(line) for line in (root / "erasures.jsonl").read_text().splitlines()]
    assert [r["id"] for r in log] == [pending["id"]] and log[0]["done"]
    # every object the killed run deleted was tombstoned first: erased, not missing
    verified = offseason(root, "lineage", "--verify", "gen-1", check=False)
    assert verified.returncode == 0 and "MISSING" not in verified.stdout, verified.stdout
    assert "ERASED" in verified.stdout


def test_an_unreachable_remote_or_mlflow_server_leaves_the_request_open(cycled, tmp_path):
    """The DVC remote down, then the MLflow server: each time the request stays open, named,
    never done (`--status` says so, exit 1); the rerun with both back finishes it."""
    root = copy_project(cycled, tmp_path / "project")
    dvc = [str(BIN / "dvc")]
    remote = subprocess.run(dvc + ["remote", "default"], cwd=root, capture_output=True,
                            text=True, check=True).stdout.strip()
    subprocess.run(dvc + ["remote", "modify", "--local", remote, "url",
                          "http://127.0.0.1:9/store"], cwd=root, check=True)
    down = offseason(root, "erase", "--user", USER, "--json", check=False)
    assert down.returncode == 1, down.stderr
    receipt = json.loads(down.stdout)
    assert receipt["status"].startswith("open") and receipt.get("done") is None
    assert f"the DVC remote {remote} (http://127.0.0.1:9/store)" in receipt["status"]
    status = offseason(root, "erase", "--status").stdout
    assert f"{receipt['id']}: OPEN" in status and f"the DVC remote {remote}" in status
    assert "1 open" in status
    log = [json.loads(line) for line in (root / "erasures.jsonl").read_text().splitlines()]
    assert [(r["id"], r["done"]) for r in log] == [(receipt["id"], None)]

    # the remote back, MLflow's server down: still open, and now it names the server
    (root / ".dvc" / "config.local").unlink()
    env = {**cli_env(root), "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}
    mlflow_down = subprocess.run([str(BIN / "offseason"), "erase", "--user", USER, "--json"],
                                 cwd=root, capture_output=True, text=True, env=env)
    assert mlflow_down.returncode == 1, mlflow_down.stderr
    again = json.loads(mlflow_down.stdout)
    assert again["id"] == receipt["id"] and again["status"].startswith("open")
    assert "the MLflow server http://127.0.0.1:9" in again["status"]
    assert "DVC remote" not in again["status"]

    done = json.loads(offseason(root, "erase", "--user", USER, "--json").stdout)
    assert done["id"] == receipt["id"] and done["status"] == "done" and done["done"]
    assert scan(root) == {}
    assert "up to date" in dvc_status(root) and git_dirty(root) == ""
    status = offseason(root, "erase", "--status").stdout
    assert f"{receipt['id']}: done" in status and "0 open" in status
