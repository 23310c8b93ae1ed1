"""`offseason erase` end to end: a person's traces through a real cycle (DVC, MLflow, git,
Prefect), then erased; every byte offseason owns is scanned for them afterwards."""

import gzip
import json
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import BIN, copy_project, hold_cycle_lock, offseason

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


def texts(data: bytes):
    """The bytes, and what they hold decoded: a Parquet file's rows, a gzip stream."""
    yield data
    if data[:4] == b"PAR1":
        table = pq.ParquetFile(pa.BufferReader(data)).read()
        yield json.dumps(table.to_pylist(), default=str).encode()
    if data[:2] == b"\x1f\x8b":
        yield gzip.decompress(data)


def scan(root: Path) -> dict[str, list[str]]:
    """Where any marker is: every file under the project (work tree, .dvc/cache, the local
    remote, mlflow.db, mlartifacts, .offseason), and every object of git's history."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and ".git" not in path.relative_to(root).parts:
            hits = {m for t in texts(path.read_bytes()) for m in MARKERS if m.encode() in t}
            if hits:
                found[str(path.relative_to(root))] = sorted(hits)
    objects = subprocess.run(["git", "rev-list", "--all", "--objects"], cwd=root, text=True,
                             capture_output=True, check=True).stdout.split("\n")
    log = subprocess.run(["git", "log", "--all", "--format=%B"], cwd=root,
                         capture_output=True, check=True).stdout
    for marker in MARKERS:
        if marker.encode() in log:
            found.setdefault("git commit messages", []).append(marker)
    for line in filter(None, objects):
        sha = line.split(" ", 1)[0]
        data = subprocess.run(["git", "cat-file", "-p", sha], cwd=root, capture_output=True,
                              check=True).stdout
        hits = {m for t in texts(data) for m in MARKERS if m.encode() in t}
        if hits:
            found[f"git {line}"] = sorted(hits)
    return found


@pytest.fixture(scope="module")
def learned(tmp_path_factory, simulated_once):
    """One cycle over a day of traffic and the person's inbox file; their trace ids in pull's
    state, as a pull from Langfuse leaves them."""
    root = copy_project(simulated_once, tmp_path_factory.mktemp("erase") / "project")
    (root / "data" / "inbox" / "person.jsonl").write_text(person())
    offseason(root, "run")
    state = root / ".offseason" / "pull" / "langfuse.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"service": "langfuse", "project": "", "complete_from": None,
                                 "ids": {"qv-trace-1": "2026-01-01T10:00:00+00:00",
                                         "other-1": "2026-01-01T10:00:00+00:00"}}))
    return root


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
    assert dry["found"]["traces"] == 5 and dry["found"]["inbox_files"] == ["person.jsonl"]
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
    assert receipt["status"] == "done" and receipt["found"]["traces"] == 5
    assert receipt["purged"], "older versions in the cache and the remote were deleted"
    assert {d["store"] for d in receipt["purged"]} == {"cache", "remote local"}
    assert scan(root) == {}
    assert "up to date" in dvc_status(root)
    # the receipt, its page and the request's record, with no personal data
    page = (root / ".offseason" / "erasures" / f"{receipt['id']}.txt").read_text()
    assert "done" in page and "data/inbox/person.jsonl" in page
    log = [json.loads(line) for line in (root / "erasures.jsonl").read_text().splitlines()]
    assert log[-1]["id"] == receipt["id"] and log[-1]["done"] and log[-1]["traces"] == 5
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
