"""The OpenAI chat completions reader: the conversation a trace belongs to."""

import pytest

from stages.traces.sources import openai_chat

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(("extra", "expected"), [
    ({"conversation_id": "conv-1"}, "conv-1"),
    ({"session_id": "sess-1"}, "sess-1"),
    ({"conversation_id": "conv-1", "session_id": "sess-1"}, "conv-1"),
    ({"session_id": 42}, "42"),
    ({"conversation_id": None}, None),
    ({}, None),
])
def test_conversation_id_from_a_top_level_field(extra, expected):
    trace = openai_chat.parse({"id": "t1", "messages": MESSAGES, **extra})
    assert trace["conversation_id"] == expected
    assert trace["messages"] == MESSAGES
