"""OpenAI Responses API exports, one JSON object a line, mapped onto the normalized trace form.

Reads a line that is a Response object as `GET /v1/responses/{id}` returns it, or a bare
`{"id", "input", "output"}`; the items read are `message`, `function_call`,
`function_call_output` and `reasoning`. Other item types (hosted tools, images, files, audio) are
refused rather than silently truncated. `instructions` becomes a leading system message, function
`tools` are nested into the chat shape, `usage` kept, a failed response recorded as
`feedback["error"]`, the `conversation` -> `conversation_id`. Writes nothing: ingest calls it.

Details: docs/traces.md, "Reading OpenAI Responses API exports (stages/traces/sources/openai_responses.py)".
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from stages.traces.schema import ROLES, TEXT_ONLY, BadRecord, NoContent

NAME = "openai-responses"
# what to change when a line does not have the shape this reader maps (a quarantine's fix)
FIX = ("log each Responses API object as the SDK returns it (response.model_dump()), with the "
       "request's `input` beside it, one a line")

_TEXT_PARTS = ("input_text", "output_text", "text")


def detect(record: dict) -> bool:
    """True for a Response object, or an `{"id", "input", "output"}` line; cheap, no validation."""
    if not isinstance(record, dict) or "messages" in record or "resourceSpans" in record:
        return False
    return record.get("object") == "response" or isinstance(record.get("output"), list)


def parse(record: dict) -> dict:
    """One Responses record to one normalized trace; raises BadRecord with the reason."""
    if not isinstance(record, dict):
        raise BadRecord(f"a Responses record must be a JSON object, got {type(record).__name__}")
    trace_id = record.get("id")
    if isinstance(trace_id, int) and not isinstance(trace_id, bool):
        trace_id = str(trace_id)
    if not isinstance(trace_id, str) or not trace_id:
        raise BadRecord("no 'id': a Responses record must carry its response id",
                        fix="log the Response object whole (response.model_dump()), its id "
                        "included")
    output = record.get("output")
    if not isinstance(output, list):
        raise BadRecord("'output' is missing or not a list of items")

    state = _State()
    instructions = record.get("instructions")
    if isinstance(instructions, str) and instructions.strip():
        state.messages.append({"role": "system", "content": instructions})
    elif isinstance(instructions, list):  # a stored prompt expands to input items
        for i, item in enumerate(instructions):
            _add_item(state, item, f"instructions[{i}]")
    elif instructions is not None and not isinstance(instructions, str):
        raise BadRecord(f"'instructions' must be a string or a list, got "
                        f"{type(instructions).__name__}")

    inputs = record.get("input")
    if isinstance(inputs, str):
        inputs = [{"type": "message", "role": "user", "content": inputs}]
    elif inputs is None:
        inputs = []  # a plain Response object does not echo its input
    elif not isinstance(inputs, list):
        raise BadRecord(f"'input' must be a string or a list of items, got {type(inputs).__name__}")
    for where, items in (("input", inputs), ("output", output)):
        for i, item in enumerate(items):
            _add_item(state, item, f"{where}[{i}]")
    state.flush_reasoning()
    if not state.messages:
        raise NoContent("no messages: 'input' and 'output' hold no items")

    return {
        "trace_id": trace_id,
        "model": record["model"] if isinstance(record.get("model"), str) else None,
        "created_at": _created_at(record.get("created_at")),
        "messages": state.messages,
        "tools": _tools(record.get("tools")),
        "feedback": _feedback(record),
        "usage": _usage(record.get("usage")),
        "conversation_id": _conversation_id(record.get("conversation")),
    }


def _conversation_id(value: object) -> str | None:
    """A Response's `conversation`: an id string or `{"id": ...}` (what the API returns)."""
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) and value else None


class _State:
    """The chat messages built so far, and what the next item may attach to."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.reasoning: list[str] = []  # reasoning waiting for the next assistant message
        self.open: dict | None = None  # assistant message that further function_calls join
        self.calls: set[str] = set()  # call_ids seen so far: outputs must follow their call

    def assistant(self) -> dict:
        """A new assistant message, carrying the reasoning that preceded it."""
        message: dict = {"role": "assistant", "content": None}
        if self.reasoning:
            message["reasoning_content"] = "\n\n".join(self.reasoning)
            self.reasoning = []
        self.messages.append(message)
        self.open = message
        return message

    def flush_reasoning(self) -> None:
        # Reasoning with no assistant turn after it (a response cut off while reasoning) is
        # kept on an empty assistant message rather than dropped.
        if self.reasoning:
            self.assistant()
        self.open = None


def _add_item(state: _State, item: object, where: str) -> None:
    if not isinstance(item, dict):
        raise BadRecord(f"{where} is not an object")
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        _add_message(state, item, where)
    elif kind == "function_call":
        _add_call(state, item, where)
    elif kind == "function_call_output":
        _add_output(state, item, where)
    elif kind == "reasoning":
        text = _reasoning_text(item, where)
        if text:
            state.reasoning.append(text)
            state.open = None  # reasoning starts a new assistant turn
    elif isinstance(kind, str):
        raise BadRecord(f"{where}: item type {kind!r} has no chat completions equivalent",
                        fix=TEXT_ONLY)
    else:
        raise BadRecord(f"{where} has no 'type'")


def _add_message(state: _State, item: dict, where: str) -> None:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise BadRecord(f"{where}: message role {role!r} is not user, system, developer or "
                        "assistant", fix=ROLES)
    content = _text(item.get("content"), f"{where}.content")
    if role == "assistant":
        message = state.assistant()
        message["content"] = content
        return
    state.flush_reasoning()
    state.messages.append({"role": role, "content": content})


def _add_call(state: _State, item: dict, where: str) -> None:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise BadRecord(f"{where}: function_call has no 'call_id'")
    if not isinstance(name, str) or not name:
        raise BadRecord(f"{where}: function_call {call_id!r} has no 'name'")
    if call_id in state.calls:
        raise BadRecord(f"{where}: function_call call_id {call_id!r} appears twice")
    arguments = item.get("arguments", "")
    if isinstance(arguments, (dict, list)):  # some exporters decode the string; re-encode
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise BadRecord(f"{where}: function_call {call_id!r} arguments must be a JSON string")
    if arguments.strip():
        try:
            json.loads(arguments)
        except json.JSONDecodeError as err:
            raise BadRecord(f"{where}: function_call {call_id!r} arguments are not valid JSON "
                            f"({err.msg} at column {err.colno})") from None
    else:
        arguments = "{}"  # a call with no parameters
    state.calls.add(call_id)
    message = state.open if state.open is not None and not state.reasoning else state.assistant()
    message.setdefault("tool_calls", []).append({
        "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})


def _add_output(state: _State, item: dict, where: str) -> None:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRecord(f"{where}: function_call_output has no 'call_id'")
    if call_id not in state.calls:
        raise BadRecord(f"function_call_output call_id {call_id!r} has no matching function_call "
                        f"({where})")
    output = item.get("output")
    if isinstance(output, list):
        content = _text(output, f"{where}.output")
    elif isinstance(output, str):
        content = output
    elif output is None:
        content = ""
    else:  # structured results are passed to the model as their JSON text
        content = json.dumps(output, ensure_ascii=False)
    state.flush_reasoning()
    state.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})


def _text(content: object, where: str) -> str | None:
    """Message content (a string or a list of text parts) as one string."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRecord(f"{where} must be a string or a list of parts")
    texts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRecord(f"{where}[{i}]: content part type {kind!r} is not text; only text "
                            "content can be mapped to chat messages", fix=TEXT_ONLY)
    return "\n".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    # Raw reasoning (`content`, open-weight models) is what reasoning_content means in chat
    # exports; the summary is the fallback most OpenAI reasoning models give.
    for field, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field) or []
        if not isinstance(parts, list):
            raise BadRecord(f"{where}: reasoning {field!r} must be a list of parts")
        texts = [p["text"] for p in parts if isinstance(p, dict)
                 and p.get("type") == kind and isinstance(p.get("text"), str)]
        if texts:
            return "\n\n".join(texts)
    return ""  # encrypted-only reasoning carries no readable text


def _created_at(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        stamp = datetime.fromtimestamp(value, tz=timezone.utc)
        return stamp.isoformat().replace("+00:00", "Z")
    return value if isinstance(value, str) and value else None


def _tools(tools: object) -> list[dict]:
    out = []
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue  # hosted tools (web_search, file_search, mcp, ...) have no chat schema
        if isinstance(tool.get("function"), dict):  # already in chat shape
            out.append(tool)
            continue
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        if "name" in function:
            out.append({"type": "function", "function": function})
    return out


def _usage(usage: object) -> dict:
    if not isinstance(usage, dict):
        return {}
    out = {k: usage[k] for k in ("input_tokens", "output_tokens", "total_tokens")
           if isinstance(usage.get(k), int)}
    details = (("input_tokens_details", "cached_tokens", "cached_input_tokens"),
               ("output_tokens_details", "reasoning_tokens", "reasoning_tokens"))
    for field, key, name in details:
        value = (usage.get(field) or {}).get(key) if isinstance(usage.get(field), dict) else None
        if isinstance(value, int):
            out[name] = value
    return out


def _feedback(record: dict) -> dict:
    feedback = dict(record["feedback"]) if isinstance(record.get("feedback"), dict) else {}
    error, status = record.get("error"), record.get("status")
    if isinstance(error, dict) and (error.get("message") or error.get("code")):
        parts = [str(error[k]) for k in ("code", "message") if error.get(k)]
        feedback.setdefault("error", ": ".join(parts))
    elif status == "incomplete":
        details = record.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        feedback.setdefault("error", f"incomplete: {reason}" if reason else "incomplete")
    elif status in ("failed", "cancelled"):
        feedback.setdefault("error", status)
    return feedback
