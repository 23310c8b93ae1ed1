"""Message helpers shared by the trace sources: vendor message shapes to the normalized form.

`openinference.py`, `langfuse.py` and `langsmith.py` read LLM calls in different envelopes but
with the same message shapes inside: OpenAI chat dicts, LangChain messages, Anthropic content
blocks and Vercel AI SDK parts. This module maps those onto normalized messages
(`chat_messages`), tool calls and tool schemas (`tool_call`, `tool_schema`), reads time stamps
and token counts (`epoch`, `iso_time`, `token_counts`), and joins a trace's LLM calls, each of
which repeats the history so far, into one conversation (`Call`, `join_calls`, `make_trace`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from stages.traces.schema import ROLES, TEXT_ONLY, TOOL_TURNS, BadRecord, NoContent

_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "ai": "assistant",
          "model": "assistant", "system": "system", "developer": "developer", "tool": "tool",
          "function": "tool"}
# LangChain message classes (serialized `{"lc": 1, "type": "constructor", "id": [..., cls]}`).
_LC_CLASSES = {"HumanMessage": "user", "AIMessage": "assistant", "SystemMessage": "system",
               "ToolMessage": "tool", "FunctionMessage": "tool", "ChatMessage": None}
_TEXT_PARTS = ("text", "input_text", "output_text")
_REASONING_PARTS = ("reasoning", "thinking")
_CALL_PARTS = ("tool_use", "tool_call", "tool-call", "function_call")
_RESULT_PARTS = ("tool_result", "tool-result", "tool_call_response")
_SKIPPED_PARTS = ("redacted_thinking",)  # encrypted reasoning: nothing readable to keep
_PART_KINDS = _TEXT_PARTS + _REASONING_PARTS + _CALL_PARTS + _RESULT_PARTS + _SKIPPED_PARTS


@dataclass
class Call:
    """One LLM call of a trace: the messages it was sent and those it returned, normalized."""

    start: float | None
    input: list[dict]
    output: list[dict]
    tools: list[dict] = field(default_factory=list)
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    repeat: bool = False  # set by join_calls when the call only repeats messages already seen


def make_trace(trace_id: str, calls: list[Call], *, created_at: str | None, feedback: dict,
               where: str, conversation_id: Any = None, user_id: Any = None) -> dict:
    """The normalized trace from a trace's LLM calls; raises BadRecord if no conversation.

    `conversation_id` is the session or thread the trace belongs to (kept as a string);
    `user_id` the user it served, which only erasure's index keeps (as a salted hash).
    """
    calls = sorted(calls, key=lambda c: (c.start is None, c.start or 0.0))  # stable on ties
    messages, used = join_calls(calls)
    if not messages:
        raise NoContent(f"{where}: its {len(calls)} LLM call(s) recorded no messages")
    messages = finish_messages(messages, where)
    tools: list[dict] = []
    for call in used:
        add_tools(tools, call.tools)
    usage = {}
    counted = [c for c in calls if not c.repeat]
    for key, attr in (("input_tokens", "input_tokens"), ("output_tokens", "output_tokens")):
        values = [getattr(c, attr) for c in counted if getattr(c, attr) is not None]
        if values:
            usage[key] = sum(values)
    return {"trace_id": str(trace_id),
            "model": next((c.model for c in reversed(used) if c.model), None),
            "created_at": created_at, "messages": messages, "tools": tools,
            "feedback": feedback, "usage": usage,
            "conversation_id": None if conversation_id in (None, "") else str(conversation_id),
            "user_id": None if user_id in (None, "") else str(user_id)}


class _Thread:
    def __init__(self, messages: list[dict], call: Call) -> None:
        self.messages = list(messages)
        self.keys = [_key(m) for m in messages]
        self.calls = [call]


def join_calls(calls: list[Call]) -> tuple[list[dict], list[Call]]:
    """The conversation the calls (in start order) build, and the calls that built it.

    Each call repeats the history so far in its input. A call whose input starts with a
    conversation seen so far extends the longest such one with the rest of its input and its
    output (the conversation keeps its own copies, which hold the reasoning and ids that inputs
    often drop, filling in what a later copy adds: see `_fill`); a call whose messages are all a
    prefix of one seen is a repeat (marked, so its tokens are not counted twice); any other call
    starts a new conversation, except one whose input opens with a tool result: it sends only
    what is new since the previous response, so it continues the latest conversation. The longest
    conversation wins, the latest on a tie (a later, equally long one is a retry).
    """
    threads: list[_Thread] = []
    last: _Thread | None = None  # the thread the latest call extended or started
    for call in calls:
        messages = call.input + call.output
        if not messages:
            continue
        keys = [_key(m) for m in messages]
        head = keys[:len(call.input)]
        best = None
        for thread in threads:
            n = len(thread.keys)
            if n <= len(head) and head[:n] == thread.keys and (
                    best is None or n >= len(best.keys)):
                best = thread
        if best is None and last is not None and call.input and call.input[0]["role"] == "tool":
            # An input that opens with a tool result sends only what is new since the last
            # response (OpenAI Responses' previous_response_id; Microsoft Agent Framework):
            # it continues the latest conversation, it cannot start one.
            last.messages.extend(messages)
            last.keys.extend(keys)
            last.calls.append(call)
            continue
        if best is not None:
            n = len(best.keys)
            best.messages[:n] = map(_fill, best.messages[:n], messages[:n])
            best.messages.extend(messages[n:])
            best.keys.extend(keys[n:])
            best.calls.append(call)
            last = best
        elif repeated := next((t for t in threads if keys == t.keys[:len(keys)]), None):
            call.repeat = True
            repeated.messages[:len(keys)] = map(_fill, repeated.messages[:len(keys)], messages)
        else:
            last = _Thread(messages, call)
            threads.append(last)
    if not threads:
        return [], []
    longest = max(len(t.messages) for t in threads)
    best = [t for t in threads if len(t.messages) == longest][-1]
    return best.messages, best.calls


def _fill(kept: dict, again: dict) -> dict:
    """A message as first recorded, with what a later record of it adds.

    A streamed output may lack tool-call ids, and an input may echo reasoning an output lacked.
    """
    merged = dict(kept)
    if again.get("reasoning_content") and not kept.get("reasoning_content"):
        merged["reasoning_content"] = again["reasoning_content"]
    if kept.get("tool_calls") and again.get("tool_calls"):
        merged["tool_calls"] = [{**mine, "id": theirs["id"]} if theirs["id"] and not mine["id"]
                                else mine
                                for mine, theirs in zip(kept["tool_calls"], again["tool_calls"])]
    if kept["role"] == "tool" and again.get("tool_call_id") and not kept.get("tool_call_id"):
        merged["tool_call_id"] = again["tool_call_id"]
    return merged


def _key(message: dict) -> tuple:
    """What two records of one message share: ids, reasoning and whitespace are left out."""
    calls = tuple((c["function"]["name"], _canonical(c["function"]["arguments"]))
                  for c in message.get("tool_calls") or [])
    return message["role"], " ".join((message.get("content") or "").split()), calls


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (json.JSONDecodeError, TypeError):
        return arguments


def finish_messages(messages: list[dict], where: str) -> list[dict]:
    """Give id-less tool calls an id and link tool results to the calls they answer.

    A tool result without `tool_call_id` answers the first unanswered call of the assistant
    message before it (OpenAI's order); one naming an id no earlier call has is an error.
    """
    out = []
    made: set[str] = set()
    pending: list[str] = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for j, call in enumerate(message["tool_calls"]):
                call = {**call, "id": call["id"] or f"call_{i}_{j}"}
                calls.append(call)
                made.add(call["id"])
            message["tool_calls"] = calls
            pending = [c["id"] for c in calls]
        elif message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not call_id:
                if not pending:
                    raise BadRecord(f"{where}: message {i} is a tool result with no "
                                    f"tool_call_id and no unanswered tool call before it",
                                    fix=TOOL_TURNS)
                call_id = pending[0]
            elif call_id not in made:
                raise BadRecord(f"{where}: message {i} answers tool call {call_id!r}, "
                                f"which no earlier assistant message made", fix=TOOL_TURNS)
            message["tool_call_id"] = call_id
            if call_id in pending:
                pending.remove(call_id)
        out.append(message)
    return out


def chat_messages(message: Any, where: str) -> list[dict]:
    """One source message to normalized messages (usually one; Anthropic-style user messages
    holding `tool_result` blocks become one tool message per result, then the text, if any).

    Reads OpenAI chat dicts, LangChain messages (serialized `{"lc": 1, "type": "constructor",
    "id": [..., "AIMessage"], "kwargs": {...}}`, `{"type": "ai", "data": {...}}` or flat
    `{"type": "ai", "content": ...}`), and content given as a string or a list of parts
    (OpenAI text parts, Anthropic `text` / `thinking` / `tool_use` / `tool_result` blocks,
    LangChain standard blocks, Vercel AI SDK `tool-call` / `tool-result` parts).
    """
    if not isinstance(message, dict):
        raise BadRecord(f"{where} is a JSON {type(message).__name__}, not a message object")
    if message.get("lc") == 1 and message.get("type") == "constructor":
        path = message.get("id") if isinstance(message.get("id"), list) else [None]
        cls = str(path[-1]).removesuffix("Chunk")
        fields = message.get("kwargs") if isinstance(message.get("kwargs"), dict) else {}
        if cls not in _LC_CLASSES:
            raise BadRecord(f"{where} is a serialized {path[-1]}, not a message")
        role = _LC_CLASSES[cls] or _role(fields.get("role"), where)
    elif isinstance(message.get("data"), dict) and isinstance(message.get("type"), str):
        fields = message["data"]
        kind = message["type"]
        role = _role(fields.get("role") if kind in ("chat", "ChatMessage") else kind, where)
    elif "role" in message:
        fields = message
        role = _role(message["role"], where)
    elif isinstance(message.get("type"), str) and "content" in message:
        fields = message
        role = _role(message.get("role") if message["type"] == "chat" else message["type"],
                     where)
    else:
        raise BadRecord(f"{where} has no 'role' (keys: {', '.join(sorted(message)[:8])})")
    extra = fields.get("additional_kwargs")
    extra = extra if isinstance(extra, dict) else {}
    content = fields.get("content")
    if content is None and isinstance(fields.get("parts"), list):  # the GenAI conventions' form
        content = fields["parts"]
    text, reasoning, block_calls, results = _content(content, where)
    reasoning = reasoning or _reasoning(fields) or _reasoning(extra)
    if role == "assistant":
        raw = fields.get("tool_calls") or extra.get("tool_calls") or []
        raw = list(raw) + list(fields.get("invalid_tool_calls") or [])
        calls = [_tool_call_of(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(raw)]
        legacy = fields.get("function_call") or extra.get("function_call")
        if legacy and not calls:
            calls = [_tool_call_of(legacy, f"{where}.function_call")]
        seen = {c["id"] for c in calls if c["id"]}
        calls += [c for c in block_calls if not c["id"] or c["id"] not in seen]
        out: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else text)}
        if calls:
            out["tool_calls"] = calls
        if reasoning:
            out["reasoning_content"] = reasoning
        return [out]
    if role == "tool":
        if results:
            return results
        call_id = fields.get("tool_call_id") or fields.get("tool_use_id")
        out = {"role": "tool", "content": text if text is not None else ""}
        if call_id:
            out["tool_call_id"] = str(call_id)
        return [out]
    if results and not text:  # Anthropic: a user turn that only carries tool results
        return results
    return results + [{"role": role, "content": text}]


def _role(value: Any, where: str) -> str:
    role = _ROLES.get(str(value).lower()) if isinstance(value, str) else None
    if role is None:
        raise BadRecord(f"{where} has role {value!r}; expected one of "
                        f"system, developer, user, assistant, tool", fix=ROLES)
    return role


def _content(content: Any, where: str) -> tuple[str | None, str | None, list[dict], list[dict]]:
    """Text, reasoning, tool calls and tool results of a message's content."""
    if content is None or isinstance(content, str):
        return content, None, [], []
    if isinstance(content, dict) and content.get("type") in _PART_KINDS:
        content = [content]
    if not isinstance(content, list):
        return _plain(content), None, [], []
    texts, thoughts, calls, results = [], [], [], []
    for j, part in enumerate(content):
        here = f"{where} content[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise BadRecord(f"{here} is a JSON {type(part).__name__}, not a content part")
        kind = part.get("type")
        if kind in _TEXT_PARTS or (kind is None and isinstance(part.get("text"), str)):
            # the GenAI conventions' text part holds `content`, the others `text`
            texts.append(part.get("text", part.get("content")) or "")
        elif kind in _REASONING_PARTS:
            thoughts.append(_reasoning_text(part))
        elif kind in _CALL_PARTS:
            arguments = next((part[k] for k in ("input", "args", "arguments") if k in part), None)
            calls.append(tool_call(part.get("id") or part.get("toolCallId") or part.get("call_id"),
                                   part.get("name") or part.get("toolName"), arguments, here))
        elif kind in _RESULT_PARTS:
            result_text = _content(next((part[k] for k in ("content", "output", "result",
                                                            "response") if k in part), None),
                                   here)[0]
            call_id = part.get("tool_use_id") or part.get("toolCallId") or (
                part.get("id") if kind == "tool_call_response" else None)
            result = {"role": "tool", "content": result_text or ""}
            if call_id:
                result["tool_call_id"] = str(call_id)
            results.append(result)
        elif kind in _SKIPPED_PARTS:
            continue
        else:
            raise BadRecord(f"{here} is a {kind!r} part, which the text-only normalized "
                            f"form cannot hold", fix=TEXT_ONLY)
    return "\n".join(texts), "\n".join(t for t in thoughts if t) or None, calls, results


def _plain(value: Any) -> str:
    if isinstance(value, dict) and value.get("type") in ("text", "json") and "value" in value:
        value = value["value"]  # Vercel AI SDK tool output: {"type": "json", "value": ...}
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _reasoning_text(part: dict) -> str:
    for key in ("thinking", "reasoning", "text", "content"):
        if isinstance(part.get(key), str):
            return part[key]
    summary = part.get("summary")  # OpenAI Responses: [{"type": "summary_text", "text"}]
    if isinstance(summary, list):
        return "\n".join(s.get("text", "") for s in summary if isinstance(s, dict))
    return ""


def _reasoning(fields: dict) -> str | None:
    for key in ("reasoning_content", "reasoning"):
        value = fields.get(key)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, dict):
            return _reasoning_text(value) or None
    return None


def _tool_call_of(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise BadRecord(f"{where} is not a tool call object")
    function = call.get("function")
    if isinstance(function, dict):  # OpenAI: {"id", "type": "function", "function": {...}}
        return tool_call(call.get("id"), function.get("name"), function.get("arguments"), where)
    # LangChain {"name", "args", "id"}, Anthropic {"name", "input", "id"}, legacy function_call
    arguments = next((call[k] for k in ("args", "input", "arguments") if k in call), None)
    return tool_call(call.get("id"), call.get("name"), arguments, where)


def tool_call(call_id: Any, name: Any, arguments: Any, where: str) -> dict:
    """A normalized tool call; arguments become a JSON string (a string is kept as written)."""
    if not isinstance(name, str) or not name:
        raise BadRecord(f"{where} has no function name")
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = "{}"  # a call without arguments
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": str(call_id) if call_id else "", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_schema(schema: Any, where: str) -> dict | None:
    """A tool definition as OpenAI chat `tools` wants it, or None for a non-function tool.

    Reads `{"type": "function", "function": {...}}`, a bare function `{"name", "description",
    "parameters"}`, Anthropic's `{"name", "input_schema"}`, each also as a JSON string.
    Provider built-in tools (web search, code interpreter) have no function schema to keep.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise BadRecord(f"{where}: tool schema is not valid JSON") from None
    if not isinstance(schema, dict):
        raise BadRecord(f"{where}: tool schema is a JSON {type(schema).__name__}, not an object")
    if isinstance(schema.get("function"), dict):
        function = dict(schema["function"])
    elif isinstance(schema.get("name"), str) and schema.get("type") in (None, "function"):
        function = {"name": schema["name"]}
        if schema.get("description") is not None:
            function["description"] = schema["description"]
        parameters = schema.get("parameters", schema.get("input_schema"))
        if parameters is not None:
            function["parameters"] = parameters
    else:
        return None
    if not isinstance(function.get("name"), str):
        raise BadRecord(f"{where}: tool schema has no function name")
    return {"type": "function", "function": function}


def add_tools(tools: list[dict], new: list[dict]) -> None:
    """Append the tools not offered yet (by function name), keeping first-seen order."""
    names = {t["function"]["name"] for t in tools}
    for tool in new:
        if tool["function"]["name"] not in names:
            tools.append(tool)
            names.add(tool["function"]["name"])


def epoch(value: Any, where: str) -> float | None:
    """Seconds since 1970 of an ISO 8601 string or a Unix time in s, ms, us or ns (for sorting)."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        # Magnitude tells the unit (OTLP writes nanoseconds, JavaScript milliseconds): 1e11 s
        # is the year 5138, 1e11 ms is 1973.
        for threshold, per_second in ((1e17, 1e9), (1e14, 1e6), (1e11, 1e3)):
            if abs(value) >= threshold:
                return value / per_second
        return float(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise BadRecord(f"{where}: start time {value!r} is not an ISO 8601 time") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)  # exports write UTC
        return moment.timestamp()
    raise BadRecord(f"{where}: start time {value!r} is not a time")


def iso_time(value: Any) -> str | None:
    """ISO 8601 for a created_at: strings as the source wrote them, Unix times in UTC."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and not value.strip().isdigit():
        return value
    number = int(value) if isinstance(value, str) else value
    if isinstance(number, int) and number >= 10**17:  # nanoseconds: exact to the microsecond
        whole, nanos = divmod(number, 10**9)
        moment = datetime.fromtimestamp(whole, timezone.utc).replace(microsecond=nanos // 1000)
    else:
        moment = datetime.fromtimestamp(epoch(number, "created_at") or 0.0, timezone.utc)
    return moment.isoformat()


def token_counts(usage: Any) -> tuple[int | None, int | None]:
    """(input, output) tokens of a usage object, whatever its vendor's key names."""
    if not isinstance(usage, dict):
        return None, None

    def first(*keys: str) -> int | None:
        return next((as_int(usage[k]) for k in keys if as_int(usage.get(k)) is not None), None)

    return (first("input_tokens", "prompt_tokens", "input", "promptTokens", "inputTokens"),
            first("output_tokens", "completion_tokens", "output", "completionTokens",
                  "outputTokens"))


def as_int(value: Any) -> int | None:
    """An integer count from a number or numeric string; None for anything else (bools too)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
