"""OpenAI chat completions messages, one trace a line (JSONL): the shape most agent logs use.

A line is an object with `messages` (roles system/developer/user/assistant/tool; assistant
`tool_calls` with `function.arguments` as a JSON string; tool replies with `tool_call_id`;
optional `reasoning_content`) and optionally `id`, `model`, `created_at` (or `created`, unix
seconds), `tools` (JSON schemas), `feedback`, `usage` and `conversation_id` (or `session_id`):
the conversation the trace belongs to. Tool-call ids may be missing: they are filled in as
`call_<n>` so that tool replies still pair with their call.
"""

from __future__ import annotations

import datetime as dt

from stages.traces.schema import TOOL_TURNS, BadRecord

NAME = "openai-chat"
# what to change when a line does not have the shape this reader maps (a quarantine's fix)
FIX = ("write each line as a chat completions request with its answer: {\"messages\": [...], "
       "\"tools\": [...]}, tool calls' arguments as JSON strings, each tool result after its call")


def detect(record) -> bool:
    """True for an object with a `messages` list."""
    return isinstance(record, dict) and isinstance(record.get("messages"), list)


def parse(record: dict) -> dict:
    """One line's object to one normalized trace; raises BadRecord with the reason."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' must be a non-empty list")
    pending: list[str] = []  # ids of calls not yet answered, for replies without tool_call_id
    made: set[str] = set()
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord(f"messages[{i}] is not an object")
        if not isinstance(message.get("role"), str):
            raise BadRecord(f"messages[{i}] has no 'role'")
        message = dict(message)
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise BadRecord(f"messages[{i}].tool_calls is not a list")
            fixed = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise BadRecord(f"messages[{i}].tool_calls[{j}] has no function name")
                call = {**call, "id": call.get("id") or f"call_{i}_{j}", "type": "function"}
                pending.append(call["id"])
                made.add(call["id"])
                fixed.append(call)
            message["tool_calls"] = fixed
        if message["role"] == "tool":
            if not message.get("tool_call_id"):
                if not pending:
                    raise BadRecord(f"messages[{i}] is a tool result with no tool call before it",
                                    fix=TOOL_TURNS)
                message["tool_call_id"] = pending[0]
            if message["tool_call_id"] not in made:
                raise BadRecord(f"messages[{i}] answers tool call {message['tool_call_id']!r}, "
                                f"which no assistant message made", fix=TOOL_TURNS)
            if message["tool_call_id"] in pending:
                pending.remove(message["tool_call_id"])
        out.append(message)
    created = record.get("created_at")
    if created is None and isinstance(record.get("created"), (int, float)):
        created = dt.datetime.fromtimestamp(record["created"], dt.timezone.utc).isoformat()
    return {
        "trace_id": str(record["id"]) if record.get("id") is not None else None,
        "model": str(record["model"]) if record.get("model") is not None else None,
        "created_at": str(created) if created is not None else None,
        "messages": out,
        "tools": record.get("tools") if isinstance(record.get("tools"), list) else [],
        "feedback": record.get("feedback"),  # as written: ingest counts shapes it cannot read
        "usage": record.get("usage") if isinstance(record.get("usage"), dict) else {},
        "conversation_id": _conversation_id(record),
    }


def _conversation_id(record: dict) -> str | None:
    for key in ("conversation_id", "session_id"):
        value = record.get(key)
        if value is not None and value != "" and not isinstance(value, (dict, list, bool)):
            return str(value)
    return None
