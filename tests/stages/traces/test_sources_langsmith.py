import json
from pathlib import Path

import pytest

from stages.traces.schema import BadRecord
from stages.traces.sources import langfuse, langsmith, openinference

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
LS1 = "1f0c8a52-4b7e-4c1d-9a3e-2b6d5f8e7a10"
LS2 = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
ANSWER = ("Go to Settings > API keys and click Rotate. The old key keeps working for 24 hours, "
          "so update your services within that window.")


def records():
    return [json.loads(line) for line in (FIXTURES / "langsmith.jsonl").read_text().splitlines()]


def by_id(traces):
    return {t["trace_id"]: t for t in traces}


def llm_run(id_, trace_id, start, messages, outputs, parent=None, **more):
    return {"id": id_, "trace_id": trace_id, "parent_run_id": parent, "run_type": "llm",
            "name": "ChatModel", "start_time": start, "inputs": {"messages": messages},
            "outputs": outputs, "error": None, "extra": {}, **more}


def test_langgraph_agent_with_serialized_langchain_messages():
    traces = langsmith.parse(records())
    assert [t["trace_id"] for t in traces] == [LS1, LS2]
    trace = traces[0]
    assert trace["messages"] == [
        {"role": "system", "content": "You are the Acme developer-docs assistant. "
                                      "Search the docs before answering."},
        {"role": "user", "content": "How do I rotate an API key?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_Kf2r9", "type": "function",
                         "function": {"name": "search_docs",
                                      "arguments": '{"query": "rotate API key"}'}}]},
        {"role": "tool", "content": "Settings > API keys > Rotate. The old key stays valid "
                                    "for 24 hours.", "tool_call_id": "call_Kf2r9"},
        {"role": "assistant", "content": ANSWER},
    ]
    assert trace["model"] == "gpt-4o-mini-2024-07-18"  # the answering model, not the alias
    assert trace["created_at"] == "2025-03-06T14:20:00.000000"
    assert trace["usage"] == {"input_tokens": 142 + 201, "output_tokens": 17 + 31}
    assert trace["feedback"] == {"scores": {"user_score": 1.0, "correctness": 0.8}}
    assert [t["function"]["name"] for t in trace["tools"]] == ["search_docs"]
    assert trace["conversation_id"] == "th-55"  # extra.metadata.thread_id
    assert traces[1]["conversation_id"] is None  # no thread metadata


@pytest.mark.parametrize(("metadata", "expected"), [
    ({"thread_id": "t1", "session_id": "s1", "conversation_id": "c1"}, "t1"),
    ({"session_id": "s1", "conversation_id": "c1"}, "s1"),
    ({"conversation_id": "c1"}, "c1"),
    ({"ls_model_name": "m"}, None),
])
def test_thread_id_metadata_keys_in_langsmith_order(metadata, expected):
    run = {"id": "r1", "trace_id": "r1", "run_type": "llm", "start_time": "2025-01-01T00:00:00",
           "inputs": {"messages": [{"role": "user", "content": "hi"}]},
           "outputs": {"choices": [{"message": {"role": "assistant", "content": "hello"}}]},
           "extra": {"metadata": metadata}}
    assert langsmith.parse([run])[0]["conversation_id"] == expected


def test_openai_wrapper_run_with_an_error_and_categorical_feedback():
    trace = by_id(langsmith.parse(records()))[LS2]
    assert trace["messages"] == [
        {"role": "system", "content": "Answer with a citation from the employee handbook."},
        {"role": "user", "content": "How many vacation days do new hires get?"},
        {"role": "assistant", "content": "New hires get 20 vacation days a year."},
    ]
    assert trace["model"] == "gpt-4o-mini-2024-07-18"
    assert trace["usage"] == {"input_tokens": 41, "output_tokens": 11}
    assert trace["feedback"] == {
        "scores": {"tone": "friendly"},
        "error": "answer_question: ValueError('answer failed the citation check')"}


def test_detect_only_its_own_format():
    assert all(langsmith.detect(r) for r in records())
    others = json.loads((FIXTURES / "langfuse.json").read_text())
    others += [json.loads(line) for line in
               (FIXTURES / "openinference.jsonl").read_text().splitlines()]
    assert not any(langsmith.detect(r) for r in others)
    assert not langsmith.detect({"messages": [{"role": "user", "content": "hi"}]})
    assert not any(openinference.detect(r) or langfuse.detect(r) for r in records())


def test_runs_without_trace_id_are_placed_by_their_parents():
    recs = [{k: v for k, v in r.items() if k != "trace_id"} for r in records()]
    assert by_id(langsmith.parse(recs)) == by_id(langsmith.parse(records()))


def test_message_dict_forms_and_batched_generations():
    # messages_to_dict form ({"type", "data"}), flat LangChain dicts, a 1-prompt batch.
    run = llm_run("r1", "t", "2025-01-01T00:00:00", [[
        {"type": "system", "data": {"content": "Be brief.", "type": "system"}},
        {"type": "human", "content": "Capital of Peru?"},
    ]], {"generations": [[{"text": "Lima.", "message": {
        "type": "ai", "data": {"content": [{"type": "text", "text": "Lima."}],
                               "additional_kwargs": {"reasoning_content": "It is Lima."},
                               "usage_metadata": {"input_tokens": 9, "output_tokens": 2}}}}]]},
        extra={"metadata": {"ls_model_name": "deepseek-reasoner"}})
    [trace] = langsmith.parse([run])
    assert trace["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of Peru?"},
        {"role": "assistant", "content": "Lima.", "reasoning_content": "It is Lima."},
    ]
    assert trace["usage"] == {"input_tokens": 9, "output_tokens": 2}
    assert trace["model"] == "deepseek-reasoner"


@pytest.mark.parametrize("recs, reason", [
    ([{"id": "c", "trace_id": "t", "run_type": "chain", "inputs": {}, "outputs": {}}],
     r"trace t: no llm run among its 1 run\(s\) \(chain\)"),
    ([{"id": "x", "name": "run"}],
     r"record 1 is not a LangSmith run \(no run_type; keys: id, name\)"),
    ([llm_run("r", "t", "2025-01-01T00:00:00", [[{"role": "user", "content": "a"}],
                                                 [{"role": "user", "content": "b"}]], {})],
     "trace t: run r: inputs.messages holds a batch of 2 prompts"),
    ([llm_run("r", "t", "2025-01-01T00:00:00", [{"role": "user", "content": "a"}],
              {"text_out": "b"})],
     r"trace t: run r: outputs have no generations, choices or messages \(keys: text_out\)"),
    ([{"id": "r", "parent_run_id": "gone", "run_type": "llm", "inputs": {}}],
     "record 1: run r has no trace_id and its root run is not in the file"),
    ([llm_run("r", "t", "2025-01-01T00:00:00",
              [{"lc": 1, "type": "constructor", "id": ["langchain", "prompts", "PromptTemplate"],
                "kwargs": {}}], {})],
     r"inputs.messages\[0\] is a serialized PromptTemplate, not a message"),
    ([llm_run("r", "t", "2025-01-01T00:00:00",
              [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "args": {}}]}], {})],
     r"inputs.messages\[1\].tool_calls\[0\] has no function name"),
    ([llm_run("r", "t", "2025-01-01T00:00:00", [{"role": "tool", "content": "42"}], {})],
     "message 0 is a tool result with no tool_call_id and no unanswered tool call before it"),
])
def test_broken_runs_say_what_is_wrong(recs, reason):
    with pytest.raises(BadRecord, match=reason):
        langsmith.parse(recs)


def test_a_run_tree_with_nested_child_runs_reads_as_its_runs():
    """A run tree as `read_run(load_child_runs=True)` or a RunTree serializes it: the children
    nested in `child_runs`. It was quarantined ("no llm run among its 1 run(s)") with a fix that
    asked for the runs the file held."""
    runs = [json.loads(line) for line in (FIXTURES / "langsmith.jsonl").read_text().splitlines()]
    trace = str(runs[0]["trace_id"])
    flat = [r for r in runs if str(r["trace_id"]) == trace]
    tree = {**flat[0], "child_runs": flat[1:]}
    assert langsmith.parse_each([json.loads(json.dumps(tree))]) == langsmith.parse_each(flat)
    assert not isinstance(langsmith.parse_each([tree])[0][1], Exception)
