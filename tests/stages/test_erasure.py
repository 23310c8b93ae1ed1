"""stages/erasure.py with ingest: the subject index it keeps, and the tombstones it honours."""

import json

import pyarrow.parquet as pq

from stages import config as cfg
from stages import erasure, ingest, io

KEY = b"test-salt"


def line(i: int, user: str, **extra) -> str:
    return json.dumps({"id": f"t-{i}", "user": user, "session_id": f"s-{user}",
                       "metadata": {"customer_id": f"C-{user}"},
                       "messages": [{"role": "user", "content": f"{i}+1 from {user}"},
                                    {"role": "assistant", "content": "answer:2"}], **extra})


def ingest_run(tmp_path, tombstones=None):
    return ingest.run(cfg.Ingest(), tmp_path / "inbox", tmp_path / "traces",
                      tmp_path / "ingested.parquet", tmp_path / "q.jsonl", KEY,
                      ("metadata.customer_id",), tombstones)


def test_the_index_holds_each_subject_salted_and_where_its_traces_went(tmp_path):
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "a.jsonl").write_text(
        "\n".join([line(1, "ann"), line(2, "bob"), json.dumps({"id": "bad", "user": "ann",
                                                               "messages": [{"content": "x"}]})])
        + "\n")
    metrics = ingest_run(tmp_path)
    assert metrics["accepted"] == 2 and metrics["quarantined"] == 1
    index = pq.read_table(tmp_path / "traces" / "index-a.jsonl.parquet").to_pylist()
    ann = [r for r in index if r["subject"] == erasure.digest(KEY, "user", "ann")]
    assert {(r["trace_id"], r["status"], r["source_line"]) for r in ann} == {
        ("t-1", "accepted", 1), ("bad", "quarantined", 3)}
    field = erasure.digest(KEY, "field:metadata.customer_id", "C-bob")
    assert [r["trace_id"] for r in index if r["subject"] == field] == ["t-2"]
    assert [r["trace_id"] for r in index if r["subject"] == erasure.digest(KEY, "session", "s-bob")
            ] == ["t-2"]
    raw = (tmp_path / "traces" / "index-a.jsonl.parquet").read_bytes()
    assert b"ann" not in raw and b"C-bob" not in raw  # no personal data, only hashes
    assert json.loads((tmp_path / "traces" / "manifest.json").read_text())["a.jsonl"][
        "index_part"] == "index-a.jsonl.parquet"


def test_a_tombstoned_subject_is_written_nowhere(tmp_path, monkeypatch):
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "a.jsonl").write_text(
        "\n".join([line(1, "ann"), line(2, "bob"), json.dumps({"id": "bad", "user": "ann",
                                                               "messages": [{"content": "x"}]})])
        + "\n")
    monkeypatch.setenv(erasure.SALT_ENV, KEY.decode())
    io.write_jsonl(tmp_path / erasure.TOMBSTONES,
                   [{"hash": erasure.digest(KEY, "user", "ann"), "kind": "user"}])
    tombstones = erasure.Tombstones(tmp_path)
    assert tombstones and tombstones.erased([("user", "ann")])
    metrics = ingest_run(tmp_path, tombstones)
    assert metrics["erased"] == 2 and metrics["accepted"] == 1 and metrics["quarantined"] == 0
    for path in (tmp_path / "ingested.parquet", tmp_path / "q.jsonl",
                 *(tmp_path / "traces").glob("*")):
        assert b"from ann" not in path.read_bytes() and b"t-1" not in path.read_bytes()


def test_stages_drop_tombstoned_traces_by_trace_and_by_task(tmp_path, monkeypatch):
    monkeypatch.setenv(erasure.SALT_ENV, KEY.decode())
    io.write_jsonl(tmp_path / erasure.TOMBSTONES,
                   [{"hash": erasure.digest(KEY, "trace", "t-1"), "kind": "trace"}])
    tombstones = erasure.Tombstones(tmp_path)
    rows = [{"task_id": "t-1"}, {"task_id": "arith:trace:t-1", "environment": "arith"},
            {"task_id": "trace:t-1"}, {"task_id": "t-2"}, {"task_id": "arith:7", "environment":
                                                           "arith"}]
    assert tombstones.keep_rows(rows) == rows[3:]
    assert not erasure.Tombstones(tmp_path / "elsewhere")  # no tombstones: nothing is hashed


def test_a_checkout_with_another_salt_is_refused_by_ingest_and_erase(tmp_path, monkeypatch):
    """A fresh clone has no .offseason/erasure.salt and would make a new one: indexing under it
    would split the index between two salts, and `erase` would find none of the earlier traces
    and report the person erased (the tombstones would stop matching too). Both refuse, saying
    which salt to bring back; the project's own salt goes on."""
    import pytest

    from flows.orchestration import erase

    inbox, traces = tmp_path / "inbox", tmp_path / "data" / "traces"
    inbox.mkdir()
    (inbox / "a.jsonl").write_text(line(1, "ann") + "\n")

    def ingested(key: bytes) -> dict:
        return ingest.run(cfg.Ingest(), inbox, traces, tmp_path / "ingested.parquet",
                          tmp_path / "q.jsonl", key)

    assert ingested(KEY)["accepted"] == 1
    check = pq.read_schema(traces / "index-a.jsonl.parquet").metadata[erasure.SALT_CHECK]
    assert check.decode() == erasure.salt_check(KEY) != erasure.salt_check(b"another")
    assert KEY not in check  # a check value, not the salt
    (inbox / "b.jsonl").write_text(line(2, "bob") + "\n")
    with pytest.raises(erasure.SaltMismatch, match=r"index-a\.jsonl\.parquet was indexed under "
                       r"another erasure salt .*Copy \.offseason/erasure\.salt from the machine"):
        ingested(b"another")
    assert not (traces / "index-b.jsonl.parquet").exists()  # nothing indexed under it
    monkeypatch.setenv(erasure.SALT_ENV, "another")
    with pytest.raises(erase.EraseError, match=f"{erasure.SALT_ENV} to its value"):
        erase.erase(tmp_path, "user", "ann", "", cfg.Erase(), "m")
    assert ingested(KEY)["accepted"] == 1  # the project's own salt: b.jsonl indexed
