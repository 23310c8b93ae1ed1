"""Every quarantine reason names the file, the trace id (where the record has one) and what to
change. Walks over each reader's quarantine cases of its own tests (their parametrized broken
records, run here through the ingest stage, one inbox file each) and a corpus of what ingest
itself refuses (unreadable lines, an unknown format, content capture off, no user turn, ...).
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import test_sources_langfuse as langfuse_cases
import test_sources_langsmith as langsmith_cases
import test_sources_openai_responses as responses_cases
import test_sources_openinference as openinference_cases
import test_sources_otel_genai as otel_cases

from stages import config as cfg
from stages import ingest

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"


def cases(test) -> list[tuple]:
    """The parameter sets of a parametrized test: its broken records."""
    [mark] = [m for m in test.pytestmark if m.name == "parametrize"]
    return mark.args[1]


def jsonl(records: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def reader_cases() -> dict[str, str]:
    """Each reader test's broken records as the text of an inbox file, by file name."""
    files = {}
    for i, (recs, _) in enumerate(cases(langfuse_cases.test_broken_records_say_what_is_wrong)):
        files[f"langfuse-{i}.jsonl"] = jsonl(recs)
    for i, (recs, _) in enumerate(cases(langsmith_cases.test_broken_runs_say_what_is_wrong)):
        files[f"langsmith-{i}.jsonl"] = jsonl(recs)
    for i, (record, _) in enumerate(cases(responses_cases.test_bad_records_say_what_is_wrong)):
        files[f"responses-{i}.jsonl"] = jsonl([record])
    for i, (change, _) in enumerate(cases(openinference_cases.test_broken_files_say_what_is_wrong)):
        files[f"openinference-{i}.jsonl"] = jsonl(change(openinference_cases.records()))
    for i, (inputs, _) in enumerate(cases(otel_cases.test_unmappable_messages)):
        doc = otel_cases.otlp(otel_cases.chat_span("0a0b", 1, [], [otel_cases.text("assistant",
                                                                                     "ok")]))
        otel_cases.set_attribute(doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0],
                                 "gen_ai.input.messages", {"stringValue": json.dumps(inputs)})
        files[f"otel-{i}.json"] = json.dumps(doc)
    return files


def capture_off(name: str) -> str:
    """An OTLP fixture with every message taken off its spans: content capture off."""
    doc = json.loads((FIXTURES / name).read_text())
    for resource in doc["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                span["attributes"] = [a for a in span["attributes"] if not re.match(
                    r"gen_ai\.(input|output)\.messages|gen_ai\.(prompt|completion)|"
                    r"gen_ai\.system_instructions|llm\.(input|output)_messages", a["key"])]
                span.pop("events", None)  # semconv 1.26 carried them on span events
    return json.dumps(doc)


def ingest_cases() -> dict[str, str | bytes]:
    """What ingest refuses itself, and the readers' content cases, as inbox files."""
    chat = {"id": "c1", "messages": [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"}]}
    responses = [json.loads(line) for line in
                 (FIXTURES / "openai_responses.jsonl").read_text().splitlines()]
    return {
        "chat-lines.jsonl": b"\n".join([
            json.dumps(chat).encode(),
            b'{"id": "x", "messages": [{"role": "user"',  # cut short
            json.dumps({"id": "c3", "messages": [{"role": "user", "content": "caf\u00e9"}]},
                       ensure_ascii=False)
            .encode("latin-1"),
            json.dumps({"id": "c4", "messages": None}).encode(),  # an id of its own
            json.dumps({"messages": [{"role": "robot", "content": "hi"},
                                     {"role": "assistant", "content": "ok"}]}).encode(),  # none
            json.dumps({"id": "c6", "messages": [{"role": "assistant", "content": "ok"}]}).encode(),
            b"[]", b"7",
            json.dumps({"id": "c9", "messages": chat["messages"] * 4}).encode(),  # > max_messages
            b"[" * 150 + b"]" * 150,
            json.dumps({"id": "c11", "messages": [{"role": "user", "content": "x" * 30_000}]}).encode(),
        ]) + b"\n",
        "unknown.jsonl": '{"event": "click"}\n',
        "responses-bare.jsonl": jsonl([{k: v for k, v in responses[0].items() if k != "input"}]),
        "otel-capture-off.json": capture_off("otel_genai.json"),
        "otel-legacy-capture-off.json": capture_off("otel_genai_legacy.json"),
        # Google ADK's own export with content capture off: "<elided>" for every message
        "adk-elided.json": (FIXTURES / "capture_off" / "adk_elided.json").read_text(),
        "mixed.jsonl": jsonl([json.loads((FIXTURES / "otel_genai.json").read_text()), chat]),
        # personal data in what a quarantine row shows: an id, and a key where the excerpt ends
        "pii-lines.jsonl": jsonl([
            {"id": "jane.roe@corpmail.io", "messages": [{"role": "assistant", "content": "ok"}]},
            {"id": "c2", "messages": [{"role": "user", "content": "x" * 1935 + " key " + LEAKY_KEY
                                       + " " + "y" * 30_000}]}]),
    }


LEAKY_KEY = "ghp_R8x2LqZ7mN4pV9wK3tY6bH1cJ5aB0dE2fG4h"


def trace_ids_of(raw: str) -> set[str]:
    """The trace ids the quarantined record carries (an OTLP document may hold several)."""
    found = set(re.findall(r'"(?:traceId|trace_id)": "([^"]+)"', raw))
    if found:
        return found
    try:
        record = json.loads(raw)
    except ValueError:
        return set()  # an unreadable line names nothing
    if isinstance(record, dict) and isinstance(record.get("id"), str) and \
            "parent_run_id" not in record and record.get("type") != "GENERATION":
        return {record["id"]}  # a chat line's, a Responses object's, a Langfuse trace's own id
    return set()


@pytest.fixture(scope="module")
def quarantined(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("reasons")
    inbox = tmp / "inbox"
    inbox.mkdir()
    for name, text in {**reader_cases(), **ingest_cases()}.items():
        (inbox / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    metrics = ingest.run(cfg.Ingest(max_messages=7, max_line_bytes=20_000), inbox, tmp / "traces",
                         tmp / "ingested.parquet", tmp / "q.jsonl")
    rows = [json.loads(line) for line in (tmp / "q.jsonl").read_text().splitlines()]
    assert len(rows) == metrics["quarantined"]
    shutil.rmtree(inbox)
    return rows


def test_every_reason_names_the_file_the_trace_and_what_to_change(quarantined):
    files = {**reader_cases(), **ingest_cases()}
    # every broken case of every reader quarantined something; but langfuse-3, a line of chat
    # messages, is no Langfuse record: ingest reads it as the openai-chat line it is
    assert {row["source_file"] for row in quarantined} == set(files) - {"langfuse-3.jsonl"}
    for row in quarantined:
        reason = row["reason"]
        assert reason.startswith(row["source_file"]), reason
        where, _, rest = reason.partition(": ")
        ids = trace_ids_of(row["raw"])
        if ids:
            [named] = [i for i in ids if where.endswith(f"trace {i}")] or [reason]
            assert f"trace {named}: " not in rest  # named once
        if row["format"] in ingest.LINE_FORMATS or not ids:
            assert f" line {row['source_line']}" in where, reason
        what, _, fix = rest.rpartition("; to fix: ")
        assert what and len(fix) > 20, reason  # what is wrong, then what to change


def test_each_fix_is_the_one_for_its_case(quarantined):
    by = {}
    for row in quarantined:
        by.setdefault(row["source_file"], []).append(row["reason"])
    fixes = {
        "otel-capture-off.json": "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true",
        "adk-elided.json": "Google ADK records no messages while content capture is off",
        "responses-bare.jsonl": "log the request's `input` beside it",
        "unknown.jsonl": "convert the file into one of those formats",
        "mixed.jsonl": "put records of another format in a file of their own",
        "langfuse-0.jsonl": "/api/public/observations?traceId=",  # no GENERATION observation
        "langfuse-1.jsonl": "in the same file as its scores",
        "langsmith-0.jsonl": "Client.list_runs(trace_id=...)",  # no llm run
        "langsmith-2.jsonl": "one prompt a run",
        "langsmith-4.jsonl": "with their root run in the same file",
        "openinference-0.jsonl": "openinference-instrumentation-",  # no LLM span
        "openinference-2.jsonl": "annotations in the same file as the spans",
        "otel-0.json": "learns from text and function-tool turns only",  # an image part
        "otel-2.json": "roles system, developer, user, assistant and tool",
        "otel-5.json": "every tool result after the assistant message that made its call",
        "responses-2.jsonl": "learns from text and function-tool turns only",  # web search
        "responses-3.jsonl": "learns from text and function-tool turns only",  # an image
        "langfuse-6.jsonl": "roles system, developer, user, assistant and tool",
        "langsmith-7.jsonl": "every tool result after the assistant message",
    }
    for name, fix in fixes.items():
        assert by[name] and all(fix in reason for reason in by[name]), (name, by[name])
    # OpenLLMetry's spans, and a client's under the 1.2x conventions: each its own switch
    assert sorted(("TRACELOOP_TRACE_CONTENT=true" in r,
                   "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT" in r)
                  for r in by["otel-legacy-capture-off.json"]) == [(False, True), (True, False)]
    chat = {int(r.split(" line ")[1].split(":")[0].split(",")[0]): r
            for r in by["chat-lines.jsonl"]}
    assert "not valid JSON" in chat[2] and "re-export the file" in chat[2]
    assert "not UTF-8" in chat[3] and "as UTF-8" in chat[3]
    assert chat[4].startswith("chat-lines.jsonl line 4, trace c4: 'messages' must be")
    assert "write each line as a chat completions request" in chat[4]  # the reader's own FIX
    assert chat[5].startswith("chat-lines.jsonl line 5: no user turn")  # no id of its own
    assert "log the request's `messages`" in chat[5] and "no user turn" in chat[6]
    assert "ingest.max_messages" in chat[9] and "ingest.max_line_bytes" in chat[11]
    assert "no trace format nests so deep" in chat[10]


def test_a_quarantine_row_shows_no_personal_data(quarantined):
    """Its id and reason are scrubbed with its text, and its text is cut where no key is cut in
    half (a key's first half no longer matched its format and was kept)."""
    rows = [row for row in quarantined if row["source_file"] == "pii-lines.jsonl"]
    assert len(rows) == 2
    shown = json.dumps(rows)
    assert "corpmail" not in shown and LEAKY_KEY[:8] not in shown, shown[:3000]
    assert rows[0]["trace_id"] == "<EMAIL_1>" and "trace <EMAIL_1>" in rows[0]["reason"]
