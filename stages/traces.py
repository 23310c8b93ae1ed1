"""The one trace schema every source format maps onto, and the OpenAI chat JSONL reader.

A trace, as ingestion writes it (one Parquet row; nested parts as JSON strings, since Parquet
readers and Great Expectations handle flat columns best):

| column         | type        | meaning                                                           |
|----------------|-------------|-------------------------------------------------------------------|
| trace_id       | str         | the source's own id (lineage audits and deletion requests follow it); `<file>:<line>` if it had none |
| source_file    | str         | inbox file name                                                   |
| source_line    | int         | 1-based line in that file                                         |
| format         | str         | `openai-chat`                                                     |
| content_hash   | str         | sha256 of the normalized, scrubbed messages: the duplicate key   |
| model          | str or null | the model that answered                                           |
| created_at     | str or null | timestamp as the source gave it                                   |
| messages       | str (JSON)  | OpenAI chat messages, scrubbed                                    |
| tools          | str (JSON)  | tool schemas offered, or `[]`                                     |
| feedback       | str (JSON)  | user feedback as given (`{"thumbs_up": true}`), or `{}`           |
| user_text      | str or null | the first user message, scrubbed                                  |
| n_messages     | int         |                                                                   |
| n_tool_calls   | int         |                                                                   |
| thumbs_up      | bool or null| the feedback signal, where there was one                          |

An OpenAI chat JSONL line is an object with `messages` (roles system/user/assistant/tool,
assistant `tool_calls` with JSON-string arguments, tool replies with `tool_call_id`) and optionally
`id`, `model`, `created_at`, `tools` and `feedback`.
"""

from __future__ import annotations

import hashlib
import json
import re

import pyarrow as pa

SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("source_file", pa.string()), ("source_line", pa.int64()),
    ("format", pa.string()), ("content_hash", pa.string()), ("model", pa.string()),
    ("created_at", pa.string()), ("messages", pa.string()), ("tools", pa.string()),
    ("feedback", pa.string()), ("user_text", pa.string()), ("n_messages", pa.int64()),
    ("n_tool_calls", pa.int64()), ("thumbs_up", pa.bool_()),
])

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")


class BadRecord(ValueError):
    """A line that cannot become a trace; the message is the quarantine reason."""


def scrub(messages: list[dict], emails: bool) -> tuple[list[dict], dict[str, int]]:
    """Replace e-mail addresses with placeholders, the same address with the same one in a trace."""
    counts = {"email": 0}
    if not emails:
        return messages, counts
    seen: dict[str, str] = {}

    def replace(match: re.Match) -> str:
        counts["email"] += 1
        return seen.setdefault(match[0].lower(), f"<EMAIL_{len(seen) + 1}>")

    def walk(value):
        if isinstance(value, str):
            return EMAIL.sub(replace, value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return walk(messages), counts


def content_hash(messages: list[dict]) -> str:
    """Key for duplicates: the messages with whitespace collapsed, keys sorted."""
    def norm(value):
        if isinstance(value, str):
            return " ".join(value.split())
        if isinstance(value, list):
            return [norm(v) for v in value]
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items() if k != "id" and k != "tool_call_id"}
        return value
    canonical = json.dumps(norm(messages), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord(f"messages[{i}] is not an object")
        if not isinstance(message.get("role"), str):
            raise BadRecord(f"messages[{i}] has no 'role'")
        for j, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise BadRecord(f"messages[{i}].tool_calls[{j}] has no function name")


def parse_openai_chat(line: str, source_file: str, source_line: int, scrub_emails: bool
                      ) -> tuple[dict, dict[str, int]]:
    """One JSONL line to one trace row (and redaction counts); raises BadRecord with the reason."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise BadRecord(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise BadRecord(f"a line must be a JSON object, got {type(record).__name__}")
    if "messages" not in record:
        raise BadRecord("no 'messages' field (expected OpenAI chat format)")
    _check_messages(record["messages"])
    messages, counts = scrub(record["messages"], scrub_emails)
    feedback = record.get("feedback") if isinstance(record.get("feedback"), dict) else {}
    thumbs = feedback.get("thumbs_up")
    user_text = next((str(m.get("content") or "") for m in messages if m["role"] == "user"), None)
    row = {
        "trace_id": str(record.get("id") or f"{source_file}:{source_line}"),
        "source_file": source_file,
        "source_line": source_line,
        "format": "openai-chat",
        "content_hash": content_hash(messages),
        "model": str(record["model"]) if record.get("model") is not None else None,
        "created_at": str(record["created_at"]) if record.get("created_at") is not None else None,
        "messages": json.dumps(messages, ensure_ascii=False),
        "tools": json.dumps(record.get("tools") or [], ensure_ascii=False),
        "feedback": json.dumps(feedback, ensure_ascii=False),
        "user_text": user_text,
        "n_messages": len(messages),
        "n_tool_calls": sum(len(m.get("tool_calls") or []) for m in messages),
        "thumbs_up": thumbs if isinstance(thumbs, bool) else None,
    }
    return row, counts
