"""Replayed tools: the ingest fixtures' tool-call traces as an environment (stages/envs/replay.py).

    pytest -q tests/stages/envs/test_replay.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from judge_server import Scripted

from stages import config as cfg
from stages import ingest
from stages.envs import contract, judge, replay

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"


def fixture_traces() -> list[dict]:
    """Every trace of the ingest fixtures that called a tool, as ingest normalizes it."""
    out = []
    for path in sorted(FIXTURES.iterdir()):
        for _, _, trace in ingest.traces_of_file(path, cfg.Ingest()):
            if isinstance(trace, dict) and any(m.get("tool_calls")
                                               for m in trace.get("messages") or []):
                out.append(trace)
    return out


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml here: no judge, the reference answer decides
    return contract.load("replay", "stages.envs.replay", Path(__file__).parents[3])


def test_every_fixture_trace_with_tool_calls_replays_its_own_calls(env):
    traces = fixture_traces()
    assert len(traces) >= 4, "the ingest fixtures hold traces with tool calls"
    router = contract.Router({"replay": env})
    replayed = 0
    for trace in traces:
        routed = router.task_of(trace["messages"], trace.get("tools"))
        if routed is None:  # e.g. a trace that ends on a tool call: no final answer
            continue
        task = json.loads(routed)
        assert task["environment"] == "replay" and task["messages"][-1]["role"] != "assistant"
        for call in task["recorded"]:
            # as the agent would send them: a JSON string, keys in another order
            arguments = json.dumps(dict(reversed(list(call["arguments"].items())))) \
                if isinstance(call["arguments"], dict) else json.dumps(call["arguments"])
            text, why = contract.call(env, task, call["name"], arguments)
            assert why is None and text == call["result"], (call, text)
            replayed += 1
        # production's own episode scores full marks: its final answer is the reference
        episode = trace["messages"]
        assert contract.score(env, task, episode) == {"reward": 1.0}
    assert replayed >= 4


def test_an_unrecorded_call_is_an_error_the_agent_sees(env):
    task = replay.task_from_trace([
        {"role": "user", "content": "Where is order 42?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "lookup_order", "arguments": '{"order_id": "42"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
        {"role": "assistant", "content": "It has shipped."}])
    assert task["tools"][0]["function"]["name"] == "lookup_order"  # the log kept no schema
    assert contract.call(env, task, "lookup_order", '{"order_id": "42"}') == \
        ('{"status": "shipped"}', None)
    text, why = contract.call(env, task, "lookup_order", '{"order_id": "43"}')
    assert text.startswith("Error: no recorded result for lookup_order({\"order_id\":\"43\"})")
    assert 'lookup_order({"order_id":"42"})' in why
    said = task["messages"] + [{"role": "assistant", "content": "it has   SHIPPED."}]
    assert contract.score(env, task, said) == {"reward": 1.0}
    wrong = task["messages"] + [{"role": "assistant", "content": "It is lost."}]
    assert contract.score(env, task, wrong) == {"reward": 0.0}
    # no user turn, or no final answer: no task
    assert replay.task_from_trace([{"role": "assistant", "content": "hi"}]) is None
    assert replay.task_from_trace(task["messages"] + [{"role": "assistant", "content": None,
                                                       "tool_calls": [{"id": "x"}]}]) is None


def test_with_a_judge_configured_the_judge_scores_against_the_reference(tmp_path, monkeypatch,
                                                                        env):
    server = Scripted([{"reasoning": "same as production", "score": 0.9}])
    try:
        (tmp_path / "params.yaml").write_text(yaml.safe_dump({
            "judge": {"model": "judge-7b", "rubric": "Is it as good as production's answer?"},
            "runtime": {"judge": {"url": server.url}}}))
        judge.use_cache(None)
        task = replay.task_from_trace([{"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello! How can I help?"}])
        scores = contract.score(env, task, task["messages"] + [
            {"role": "assistant", "content": "Hey."}])
        assert scores == {"judge": 0.9} and scores.judgment["reasoning"] == "same as production"
        shown = server.requests[0]["body"]["messages"][1]["content"]
        assert "Hello! How can I help?" in shown and "Hey." in shown
    finally:
        server.close()
        judge.use_cache(None)
