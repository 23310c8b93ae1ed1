import json
from pathlib import Path

import pyarrow.parquet as pq

from stages import config as cfg
from stages import ingest


def chat(trace_id, question, answer="answer", email=None):
    user = f"What is {question}?" + (f" mail {email}" if email else "")
    return json.dumps({"id": trace_id, "messages": [{"role": "user", "content": user},
                                                    {"role": "assistant", "content": answer}]})


def counts_add_up(m):
    return m["rows_read"] == m["accepted"] + m["quarantined"] + m["duplicates"]


def run(tmp_path, inbox=None, **config):
    """The stage on `inbox` (tmp_path/inbox; a single file: an inbox of that file alone)."""
    if inbox is not None and inbox.is_file():
        (tmp_path / "inbox").mkdir(parents=True)
        (tmp_path / "inbox" / inbox.name).write_bytes(inbox.read_bytes())
    return ingest.run(cfg.Ingest(**config), tmp_path / "inbox", tmp_path / "traces",
                      tmp_path / "ingested.parquet", tmp_path / "q.jsonl")


def test_junk_is_quarantined_or_counted_and_nothing_is_lost(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    lines = [chat("a", "1+2"), chat("b", "3*4", email="Ann@Example.com"), chat("a", "1+2"),
             '{"id": "c", "messages": [', "[1, 2]", '{"id": "d"}',
             json.dumps({"id": "e", "messages": [{"content": "no role"}]}), "",
             chat("f", "5-6")]
    (inbox / "day-0.jsonl").write_text("\n".join(lines) + "\n")
    m = run(tmp_path)
    # the array on line 5 holds two records, each a row of its own
    assert (m["rows_read"], m["accepted"], m["quarantined"], m["duplicates"]) == (9, 3, 5, 1)
    assert counts_add_up(m)
    bad = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [b["source_line"] for b in bad] == [4, 5, 5, 6, 7]
    assert all(b["source_file"] == "day-0.jsonl" and b["reason"] for b in bad)
    assert "not valid JSON" in bad[0]["reason"] and "no 'role'" in bad[4]["reason"]
    assert "must be a JSON object, got int" in bad[1]["reason"]
    assert "unknown" not in {b["format"] for b in bad}
    rows = pq.read_table(tmp_path / "ingested.parquet").to_pylist()
    assert [r["trace_id"] for r in rows] == ["a", "b", "f"]
    assert rows[1]["source_line"] == 2


def test_emails_are_scrubbed_consistently(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    messages = [{"role": "user", "content": "1+2 to bob@x.org, cc ann@y.com and bob@x.org"},
                {"role": "assistant", "content": "3, sent to bob@x.org"}]
    (inbox / "d.jsonl").write_text(json.dumps({"id": "t", "messages": messages}) + "\n")
    m = run(tmp_path)
    text = pq.read_table(tmp_path / "ingested.parquet").column("messages")[0].as_py()
    assert "@" not in text
    assert text.count("<EMAIL_1>") == 3 and text.count("<EMAIL_2>") == 1
    assert m["pii_redactions"]["email"] == 4


def test_incremental_never_ingests_twice(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "day-0.jsonl").write_text(chat("a", "1+2") + "\n" + chat("b", "2+2") + "\n")
    first = run(tmp_path)
    assert first["accepted"] == 2
    before = (inbox / "day-0.jsonl").read_bytes()
    rated = {**json.loads(chat("b2", "2+2")), "feedback": {"thumbs_up": True}}
    (inbox / "day-1.jsonl").write_text(json.dumps(rated) + "\n" + chat("c", "9*9") + "\n")
    second = run(tmp_path)
    assert (second["rows_read"], second["accepted"], second["duplicates"]) == (2, 1, 1)
    # the duplicate's id, where it was, which trace it repeats and its user's rating are kept
    [repeat] = pq.read_table(tmp_path / "traces/duplicates-day-1.jsonl.parquet").to_pylist()
    assert repeat == {"trace_id": "b2", "source_file": "day-1.jsonl", "source_line": 1,
                      "duplicate_of": "b", "feedback": '{"thumbs_up": true}'}
    assert second["files_seen_before"] == 1 and second["total_traces"] == 3
    assert [r["trace_id"] for r in pq.read_table(tmp_path / "ingested.parquet").to_pylist()] == ["c"]
    assert (inbox / "day-0.jsonl").read_bytes() == before  # raw files are never modified
    # a rerun on the same inbox (a killed stage, say) gives the same outputs
    again = run(tmp_path)
    assert again == second
    assert [r["trace_id"] for r in pq.read_table(tmp_path / "ingested.parquet").to_pylist()] == ["c"]


def test_too_many_messages_is_quarantined(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "d.jsonl").write_text(chat("a", "1+2") + "\n")
    m = run(tmp_path, max_messages=1)
    assert m["quarantined"] == 1 and "ingest.max_messages=1" in (tmp_path / "q.jsonl").read_text()


def test_normalized_duplicates_share_a_hash():
    from stages.traces.schema import content_hash
    assert content_hash('[{"content": "a  b", "role": "user"}]') == \
        content_hash('[{"content": "a\\nb", "role": "user"}]')
    assert content_hash('[{"id": "call_1", "role": "tool", "tool_call_id": "c1"}]') == \
        content_hash('[{"id": "call_9", "role": "tool", "tool_call_id": "c9"}]')
    assert content_hash('[{"content": "a b", "role": "user"}]') != \
        content_hash('[{"content": "a c", "role": "user"}]')


def test_files_sharing_a_name_up_to_the_first_dot_keep_their_own_parts(tmp_path):
    # a Collector's file exporter rotates into names like these
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "traces.2026-12-05.jsonl").write_text(chat("a", "1+2") + "\n")
    (inbox / "traces.2026-12-06.jsonl").write_text(chat("b", "3+4") + "\n")
    assert run(tmp_path)["accepted"] == 2
    manifest = json.loads((tmp_path / "traces" / ingest.MANIFEST).read_text())
    parts = {name: entry["part"] for name, entry in manifest.items()}
    assert len(set(parts.values())) == 2, parts
    for name, part in parts.items():
        rows = pq.read_table(tmp_path / "traces" / part).to_pylist()
        assert [r["source_file"] for r in rows] == [name]
    # the next cycle knows both as seen: the same traces again are duplicates
    (inbox / "traces.2026-12-07.jsonl").write_text(chat("a", "1+2") + "\n" + chat("b", "3+4") + "\n")
    m = run(tmp_path)
    assert (m["accepted"], m["duplicates"]) == (0, 2)


def test_a_byte_order_mark_is_no_reason_to_refuse_a_file(tmp_path):
    """Windows tools (PowerShell's Out-File, Excel) write UTF-8 with a BOM: a JSONL file lost its
    first line to it ("Unexpected UTF-8 BOM") and a pretty-printed OTLP document was read line by
    line, each line quarantined (766 rows for one file)."""
    fixtures = Path(__file__).parents[1] / "fixtures" / "traces"
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    bom = b"\xef\xbb\xbf"
    (inbox / "chat.jsonl").write_bytes(bom + (chat("a", "1+2") + "\n").encode())
    (inbox / "otel.json").write_bytes(bom + (fixtures / "otel_genai.json").read_bytes())
    plain = run(tmp_path / "plain", inbox=fixtures / "otel_genai.json")
    m = run(tmp_path)
    assert counts_add_up(m) and m["quarantined"] == 0, m
    assert m["accepted"] == 1 + plain["accepted"]


def test_a_document_cut_off_is_one_quarantined_row_not_one_per_line(tmp_path):
    """A pretty-printed JSON file cut short (a copy interrupted): it was read line by line and
    every line quarantined (201 rows); it is one row now, saying what to do."""
    fixtures = Path(__file__).parents[1] / "fixtures" / "traces"
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "otel.json").write_bytes((fixtures / "otel_genai.json").read_bytes()[:5000])
    m = run(tmp_path)
    assert (m["rows_read"], m["quarantined"]) == (1, 1), m
    [bad] = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert "not valid JSON: the file is one JSON document over several lines" in bad["reason"]
    assert "re-export the file whole from its source" in bad["reason"]


def test_a_cut_span_file_accepts_no_trace_that_may_be_partial(tmp_path):
    """A LangSmith export gzipped and cut short: a trace whose runs straddled the cut was
    accepted with 3 of its 5 messages, and the fix said (copy the file again) did nothing, the
    name being known. No trace of such a file is accepted now, and the fix names a new name."""
    import gzip

    fixtures = Path(__file__).parents[1] / "fixtures" / "traces"
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    whole = gzip.compress((fixtures / "langsmith.jsonl").read_bytes(), mtime=0)
    (inbox / "ls.jsonl.gz").write_bytes(whole[:1500])
    m = run(tmp_path)
    assert m["accepted"] == 0 and m["quarantined"] >= 1 and counts_add_up(m), m
    bad = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert all("none of them is known whole" in b["reason"] or "file cut off" in b["reason"]
               for b in bad), bad
    assert all("under a new name" in b["reason"] for b in bad), bad


def test_a_gzipped_document_cut_short_is_quarantined_not_a_crash(tmp_path):
    """A pretty-printed JSON document over 64 kB, gzipped and cut: its first 64 kB decompress, the
    whole does not, and the stage raised EOFError (found by the long fuzz run)."""
    import gzip

    fixtures = Path(__file__).parents[1] / "fixtures" / "traces"
    document = json.loads((fixtures / "otel_genai.json").read_text())
    big = json.dumps({"resourceSpans": document["resourceSpans"] * 60}, indent=2).encode()
    assert len(big) > 1 << 17
    packed = gzip.compress(big, mtime=0)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "otel.json.gz").write_bytes(packed[: int(len(packed) * 0.7)])
    m = run(tmp_path)
    assert m["accepted"] == 0 and m["quarantined"] >= 1 and counts_add_up(m), m


def test_tools_and_arguments_keep_the_order_they_were_logged_in(tmp_path):
    # a chat template renders tools and object arguments with `tojson` in their keys' order:
    # sorted keys made a prompt production never saw (a walkthrough's agent then called "team")
    from stages.envs import contract, replay

    tools = [{"type": "function", "function": {
        "name": "get_account", "description": "an account by id",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                       "required": ["id"]}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_account", "arguments": {"id": "A1", "fields": "all"}}}
    messages = [{"role": "user", "content": "Who owns A1?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "Ann"},
                {"role": "assistant", "content": "Ann owns it."}]
    reordered = json.loads(json.dumps(messages, sort_keys=True))
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "day.jsonl").write_text(
        json.dumps({"id": "t", "messages": messages, "tools": tools}) + "\n"
        + json.dumps({"id": "u", "messages": reordered, "tools": tools}) + "\n")
    m = run(tmp_path)
    assert (m["accepted"], m["duplicates"]) == (1, 1)  # the same conversation, keys aside
    row = pq.read_table(tmp_path / "ingested.parquet").to_pylist()[0]
    assert json.dumps(json.loads(row["tools"])) == json.dumps(tools)  # order and all
    stored = json.loads(row["messages"])
    assert list(stored[1]["tool_calls"][0]["function"]["arguments"]) == ["id", "fields"]
    assert list(stored[0]) == ["role", "content"]
    # and the task the replay environment makes of it: its tools as logged
    env = contract.load("replay", replay.__name__, Path.cwd())
    task = json.loads(contract.Router({"replay": env}).task_of(stored, json.loads(row["tools"])))
    assert json.dumps(task["tools"]) == json.dumps(tools)


def test_feedback_no_stage_reads_is_counted_and_named(tmp_path, capsys):
    # the shapes a walkthrough's team logged: each accepted as unrated, in silence, before
    shapes = [{"thumbs_up": "yes"}, {"thumbs_up": 1}, {"rating": 5}, {"scores": {"csat": 4}},
              {"scores": {"csat": "0.8"}}, "thumbs_up", {"thumbs_down": True},
              [{"thumbs_up": True}], {"score": 0.9}, {"scores": "good"}]
    readable = [{"thumbs_up": False}, {"scores": {"csat": 0.4}}, {"thumbs_up": None},
                {"error": "timeout"}, {}]
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "day.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "feedback": feedback, "messages": [
            {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a"}]})
        + "\n" for i, feedback in enumerate(shapes + readable)))
    m = run(tmp_path)
    assert m["accepted"] == len(shapes) + len(readable)
    unread = m["feedback_unread"]
    assert unread["traces"] == len(shapes)
    assert unread["reasons"] == {"thumbs_up not true or false": 2, "keys not read": 3,
                                 "score outside [0, 1]": 1, "score not a number": 1,
                                 "not an object": 2, "scores not an object": 1}
    assert unread["first"] == 'day.jsonl line 1: thumbs_up is "yes", not true or false'
    rows = pq.read_table(tmp_path / "ingested.parquet").to_pylist()
    assert json.loads(rows[5]["feedback"]) == {}  # a string is kept as no feedback
    # the stage says so, with what a rating looks like
    again = tmp_path / "again"
    ingest.main([str(tmp_path / "inbox"), *(str(again / name) for name in (
        "traces", "ingested.parquet", "q.jsonl", "m.json")),
        "--params", str(Path(__file__).parents[2] / "params.yaml")])
    err = capsys.readouterr().err
    assert "10 accepted trace(s) carry feedback that gives no rating" in err
    assert 'first: day.jsonl line 1: thumbs_up is "yes"' in err and '{"thumbs_up": true' in err


def test_a_duplicates_rating_is_counted_and_said_not_dropped_in_silence(tmp_path, capsys):
    """The same conversation logged twice, the second time with the user's thumbs-up: ingest
    keeps the first copy (unrated), and the rating went nowhere without a word."""
    first = json.loads(chat("t1", "2+2", "4"))
    rated = {**first, "id": "t1-again", "feedback": {"thumbs_up": True}}
    plain = {**first, "id": "t1-thrice"}
    (tmp_path / "inbox").mkdir()
    (tmp_path / "inbox" / "day.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in (first, rated, plain)))
    ingest.main([str(tmp_path / "inbox"), *(str(tmp_path / name) for name in (
        "traces", "ingested.parquet", "q.jsonl", "m.json")),
        "--params", str(Path(__file__).parents[2] / "params.yaml")])
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["accepted"], m["duplicates"], m["duplicates_rated"]) == (1, 2, 1)
    assert "1 duplicate(s) carried a rating" in capsys.readouterr().err
    kept = pq.read_table(tmp_path / "traces" / "duplicates-day.jsonl.parquet").to_pylist()
    assert [json.loads(r["feedback"]) for r in kept] == [{"thumbs_up": True}, {}]


def test_a_file_changed_since_a_cycle_read_it_is_said(tmp_path, capsys):
    """A line deleted from an inbox file already ingested (an erasure attempted by hand) changed
    nothing and said nothing: ingest reads each file name once."""
    (tmp_path / "inbox").mkdir()
    day = tmp_path / "inbox" / "day.jsonl"
    day.write_text(chat("t1", "1+1", "2") + "\n" + chat("t2", "2+2", "4") + "\n")

    def main():
        ingest.main([str(tmp_path / "inbox"), *(str(tmp_path / name) for name in (
            "traces", "ingested.parquet", "q.jsonl", "m.json")),
            "--params", str(Path(__file__).parents[2] / "params.yaml")])
        return json.loads((tmp_path / "m.json").read_text())

    assert main()["files_changed_since_read"] == []
    day.write_text(chat("t2", "2+2", "4") + "\n")
    (tmp_path / "inbox" / "day2.jsonl").write_text(chat("t3", "3+3", "6") + "\n")
    m = main()
    assert m["files_changed_since_read"] == ["day.jsonl"] and m["accepted"] == 1
    assert "day.jsonl changed since a cycle read it" in capsys.readouterr().err
