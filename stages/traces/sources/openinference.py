"""OpenInference spans, as Arize Phoenix exports them, mapped onto the normalized trace form.

Format. OpenInference (github.com/Arize-ai/openinference: `spec/semantic_conventions.md`,
`spec/llm_spans.md`, `spec/tool_calling.md`) is a set of OpenTelemetry span attributes for LLM
applications. Lists of objects are flattened with zero-based indices, so one chat message is
`llm.input_messages.<i>.message.role` / `.message.content` / `.message.contents.<j>.
message_content.type|text` / `.message.tool_calls.<k>.tool_call.id|function.name|
function.arguments` / `.message.tool_call_id`, and the same under `llm.output_messages.`.

Accepted records (one parsed JSON value each; a file may mix them):

- OTLP JSON, as the OpenTelemetry Collector's file exporter writes it:
  `{"resourceSpans": [{"scopeSpans": [{"spans": [...]}]}]}`, each span with hex `traceId` /
  `spanId` / `parentSpanId`, `startTimeUnixNano` and attributes as
  `[{"key": ..., "value": {"stringValue" | "intValue" | ...: ...}}]`.
- One span as Phoenix's span JSON: `context.trace_id` / `context.span_id`, `parent_id`,
  `span_kind`, `start_time` (ISO 8601), `status_code` / `status_message`, and `attributes` as a
  flat dict of dotted keys or nested dicts (lists of objects as JSON lists, e.g.
  `{"llm": {"input_messages": [{"message": {"role": ...}}]}}`); pandas-style rows with
  `attributes.<name>` columns are read too.
- A Phoenix span or trace annotation (`{"span_id" | "trace_id", "name", "result": {"label",
  "score"}}`), the shape of Phoenix's annotations API.

Mapping. Spans are grouped by trace id into one normalized trace whose `trace_id` is the
OTel trace id exactly as written. The conversation comes from the `LLM` spans
(`openinference.span.kind`) in start-time order; every such span repeats the history so far in
its input, so calls are joined by prefix matching (`join_calls`): a call whose input starts with
a conversation seen so far extends it, one that only repeats it (a framework span and the client
span nested in it record the same call) adds nothing, and one that shares no prefix (a router
or judge call) starts another conversation; the longest one is the trace. `llm.tools.<i>.tool.
json_schema` -> `tools`; `llm.model_name` -> `model`; `llm.token_count.prompt` / `.completion`
-> `usage` (summed over all LLM calls but the repeats); `annotations.<i>.annotation.*` and
`evaluations.<i>.evaluation.*` (also `trace.`-prefixed) and annotation records -> `feedback
["scores"]` (score, else label); an `ERROR` status on a root span (one whose parent is not in the
trace) -> `feedback["error"]`. `session.id` (of the first span in start order that has one)
-> `conversation_id`; `user.id` has no place in the normalized form.

Reasoning parts (`message_content.type == "reasoning"`) become the assistant message's
`reasoning_content`. Image, audio and video parts raise `BadRecord`: the normalized content is
text, and dropping them would leave a conversation that refers to something it no longer has.

The second half of this module is shared with `langfuse.py` and `langsmith.py`: message shapes
(OpenAI chat, LangChain, Anthropic content blocks) to normalized messages, tool schemas, time
stamps, and the joining of LLM calls into one conversation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from stages.traces.schema import BadRecord
from stages.traces.sources import otlp

NAME = "openinference"

_KINDS = {"LLM", "EMBEDDING", "CHAIN", "RETRIEVER", "RERANKER", "TOOL", "AGENT", "GUARDRAIL",
          "EVALUATOR", "PROMPT", "DECISION", "UNKNOWN"}
# Attributes whose value is itself a JSON document: a nested export may hold them as objects,
# and flattening those would scatter one value over many keys.
_JSON_LEAVES = ("tool.json_schema", "function.arguments", "input.value", "output.value",
                "llm.invocation_parameters", "metadata", "tool.parameters",
                "llm.prompt_template.variables", "message.function_call_arguments_json")
_FEEDBACK = re.compile(r"^((?:trace\.)?(?:annotations|evaluations))\.(\d+)\."
                       r"(?:annotation|evaluation)\.(name|score|label)$")
_ERROR_CODES = ("ERROR", "STATUS_CODE_ERROR", "2", 2)


def detect(record: dict) -> bool:
    """True for OTLP JSON holding OpenInference spans, a Phoenix span, or a Phoenix annotation."""
    if not isinstance(record, dict):
        return False
    if isinstance(record.get("resourceSpans"), list):
        # Any OTel export has resourceSpans; OpenInference ones carry openinference.span.kind.
        return any(kv.get("key") == "openinference.span.kind"
                   for span in _otlp_raw_spans(record)
                   for kv in span.get("attributes") or [] if isinstance(kv, dict))
    if _is_annotation(record):
        return True
    context = record.get("context")
    has_trace = ((isinstance(context, dict) and "trace_id" in context)
                 or "context.trace_id" in record)
    if not has_trace:
        return False
    attributes = record.get("attributes")
    if isinstance(attributes, dict):
        nested = attributes.get("openinference")
        if "openinference.span.kind" in attributes or isinstance(nested, dict):
            return True
    return (str(record.get("span_kind")).upper() in _KINDS
            or "attributes.openinference.span.kind" in record)


def parse(records: list[dict]) -> list[dict]:
    """All records of a file to normalized traces, one per trace id, in order of first span.

    Raises BadRecord, naming the trace and span, when a trace cannot be mapped.
    """
    spans: list[dict] = []
    annotations: list[dict] = []
    for n, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise BadRecord(f"record {n} is a JSON {type(record).__name__}, not an object")
        if isinstance(record.get("resourceSpans"), list):
            spans.extend(_otlp_span(raw, n) for raw in _otlp_raw_spans(record))
        elif _is_annotation(record):
            annotations.append(record)
        else:
            spans.append(_json_span(record, n))
    groups: dict[str, list[dict]] = {}
    for span in spans:
        groups.setdefault(span["trace_id"], []).append(span)
    span_trace = {span["span_id"]: span["trace_id"] for span in spans if span["span_id"]}
    scores: dict[str, dict[str, Any]] = {}
    for record in annotations:
        trace_id = record.get("trace_id") or span_trace.get(record.get("span_id"))
        if trace_id not in groups:
            target = record.get("span_id") or record.get("trace_id")
            raise BadRecord(f"annotation {record.get('name')!r} is for {target!r}, "
                            f"which is not a span or trace in this file")
        result = record.get("result") or {}
        value = result.get("score") if result.get("score") is not None else result.get("label")
        scores.setdefault(trace_id, {})[str(record["name"])] = value
    return [_trace(trace_id, group, scores.get(trace_id, {})) for trace_id, group in groups.items()]


def _trace(trace_id: str, spans: list[dict], extra_scores: dict[str, Any]) -> dict:
    where = f"trace {trace_id}"
    ids = {span["span_id"] for span in spans if span["span_id"]}
    calls = [_call(span, f"{where}: span {span['span_id']}") for span in spans
             if span["kind"] == "LLM"]
    if not calls:
        raise BadRecord(f"{where}: no LLM span (openinference.span.kind = LLM) among its "
                        f"{len(spans)} span(s)")
    feedback: dict[str, Any] = {}
    scores: dict[str, Any] = {}
    for span in sorted(spans, key=_start_key):
        scores.update(_span_scores(span["attributes"]))
    scores.update(extra_scores)
    if scores:
        feedback["scores"] = scores
    roots = sorted((s for s in spans if s["parent_id"] not in ids), key=_start_key)
    error = next((f"{s['name']}: {s['error']}" if s["name"] else s["error"]
                  for s in roots if s["error"]), None)
    if error:
        feedback["error"] = error
    first = min(spans, key=_start_key)
    session = next((s["attributes"]["session.id"] for s in sorted(spans, key=_start_key)
                    if s["attributes"].get("session.id") not in (None, "")), None)
    return make_trace(trace_id, calls, created_at=iso_time(first["start"]), feedback=feedback,
                      where=where, conversation_id=session)


def _start_key(span: dict) -> tuple[bool, float]:
    return span["start_epoch"] is None, span["start_epoch"] or 0.0


def _call(span: dict, where: str) -> Call:
    attributes = span["attributes"]
    tools = []
    for i, fields in _indexed(attributes, "llm.tools"):
        schema = fields.get("tool.json_schema")
        if schema is None and "tool.name" in fields:
            schema = {"name": fields["tool.name"], "description": fields.get("tool.description"),
                      "parameters": _json_value(fields.get("tool.parameters"))}
        found = tool_schema(schema, f"{where} llm.tools.{i}") if schema is not None else None
        if found:
            tools.append(found)
    parameters = _json_value(attributes.get("llm.invocation_parameters"))
    model = (attributes.get("llm.model_name") or attributes.get("llm.response.model_name")
             or attributes.get("llm.request.model_name")
             or (parameters.get("model") if isinstance(parameters, dict) else None))
    return Call(start=span["start_epoch"],
                input=_oi_messages(attributes, "llm.input_messages", where),
                output=_oi_messages(attributes, "llm.output_messages", where),
                tools=tools, model=str(model) if model else None,
                input_tokens=_int(attributes.get("llm.token_count.prompt")),
                output_tokens=_int(attributes.get("llm.token_count.completion")))


def _oi_messages(attributes: dict, prefix: str, where: str) -> list[dict]:
    messages = []
    for i, fields in _indexed(attributes, prefix):
        here = f"{where} {prefix}.{i}"
        contents = []
        for j, part in _indexed(fields, "message.contents"):
            kind = part.get("message_content.type") or "text"
            if kind == "tool_use":
                continue  # the same call is recorded under message.tool_calls
            if kind not in ("text", "reasoning"):
                raise BadRecord(f"{here} message.contents.{j} is a {kind!r} part, which the "
                                f"text-only normalized form cannot hold")
            contents.append({"type": kind, "text": part.get("message_content.text")})
        content: Any = fields.get("message.content")
        if contents and not content:
            content = contents
        elif contents:  # text in message.content; keep the reasoning parts of contents
            content = [c for c in contents if c["type"] == "reasoning"]
            content.append({"type": "text", "text": fields["message.content"]})
        message: dict[str, Any] = {"role": fields.get("message.role"), "content": content}
        calls = [{"id": call.get("tool_call.id"),
                  "function": {"name": call.get("tool_call.function.name"),
                               "arguments": call.get("tool_call.function.arguments")}}
                 for _, call in _indexed(fields, "message.tool_calls")]
        if calls:
            message["tool_calls"] = calls
        if fields.get("message.function_call_name"):  # the legacy single function call
            message["function_call"] = {
                "name": fields["message.function_call_name"],
                "arguments": fields.get("message.function_call_arguments_json")}
        if fields.get("message.tool_call_id") is not None:
            message["tool_call_id"] = fields["message.tool_call_id"]
        if message["role"] is None:
            raise BadRecord(f"{here} has no message.role")
        messages.extend(chat_messages(message, here))
    return messages


def _indexed(attributes: dict, prefix: str) -> list[tuple[int, dict]]:
    """`prefix.<i>.rest` keys grouped by i (in index order) as {rest: value}."""
    groups: dict[int, dict] = {}
    start = len(prefix) + 1
    for key, value in attributes.items():
        if key.startswith(prefix + "."):
            index, _, rest = key[start:].partition(".")
            if index.isdigit() and rest:
                groups.setdefault(int(index), {})[rest] = value
    return sorted(groups.items())


def _span_scores(attributes: dict) -> dict[str, Any]:
    found: dict[tuple[str, str], dict] = {}
    for key, value in attributes.items():
        match = _FEEDBACK.match(key)
        if match:
            found.setdefault((match[1], match[2]), {})[match[3]] = value
    scores = {}
    for parts in found.values():
        if parts.get("name") is not None:
            value = parts.get("score") if parts.get("score") is not None else parts.get("label")
            scores[str(parts["name"])] = value
    return scores


def _is_annotation(record: dict) -> bool:
    return (isinstance(record.get("result"), dict) and isinstance(record.get("name"), str)
            and ("span_id" in record or "trace_id" in record) and "context" not in record)


def _otlp_raw_spans(record: dict) -> list[dict]:
    spans = []
    for resource in record.get("resourceSpans") or []:
        if not isinstance(resource, dict):
            continue
        # instrumentationLibrarySpans: the name before OTLP 0.15, still seen in old dumps
        scopes = resource.get("scopeSpans") or resource.get("instrumentationLibrarySpans")
        for scope in scopes or []:
            if isinstance(scope, dict):
                spans.extend(s for s in scope.get("spans") or [] if isinstance(s, dict))
    return spans


def _otlp_span(span: dict, n: int) -> dict:
    if not span.get("traceId"):
        raise BadRecord(f"record {n}: an OTLP span ({span.get('name')!r}) has no traceId")
    attributes = flatten(_otlp_attributes(span.get("attributes"), f"record {n}"))
    status = span.get("status") if isinstance(span.get("status"), dict) else {}
    error = None
    if status.get("code") in _ERROR_CODES:
        error = status.get("message") or _exception(span.get("events")) or "status ERROR"
    start = span.get("startTimeUnixNano")
    return {"trace_id": str(span["traceId"]), "span_id": span.get("spanId"),
            "parent_id": span.get("parentSpanId") or None, "name": span.get("name"),
            "kind": str(attributes.get("openinference.span.kind") or "").upper() or None,
            "attributes": attributes,
            "start": start, "start_epoch": epoch(start, f"record {n} span {span.get('spanId')}"),
            "error": error}


def _json_span(record: dict, n: int) -> dict:
    context = record.get("context") if isinstance(record.get("context"), dict) else {}
    trace_id = context.get("trace_id") or record.get("context.trace_id")
    if not trace_id:
        raise BadRecord(f"record {n} is neither an OTLP document nor a span: "
                        f"no context.trace_id (keys: {', '.join(sorted(record)[:8])})")
    span_id = context.get("span_id") or record.get("context.span_id")
    raw = record.get("attributes")
    if isinstance(raw, list):
        raw = _otlp_attributes(raw, f"record {n}")
    attributes = flatten(raw) if isinstance(raw, dict) else {}
    for key, value in record.items():  # pandas-style rows: one column per attribute
        if key.startswith("attributes."):
            attributes.update(flatten(value, key[len("attributes."):]))
    kind = attributes.get("openinference.span.kind")
    if kind is None and str(record.get("span_kind")).upper() in _KINDS:
        kind = record["span_kind"]
    status = record.get("status") if isinstance(record.get("status"), dict) else {}
    code = record.get("status_code") or status.get("status_code") or status.get("code")
    error = None
    if isinstance(code, str | int) and str(code).upper() in [str(c) for c in _ERROR_CODES]:
        error = (record.get("status_message") or status.get("description")
                 or status.get("message") or _exception(record.get("events")) or "status ERROR")
    start = record.get("start_time")
    return {"trace_id": str(trace_id), "span_id": span_id,
            "parent_id": record.get("parent_id") or None,
            "name": record.get("name"), "kind": str(kind).upper() if kind else None,
            "attributes": attributes, "start": start,
            "start_epoch": epoch(start, f"record {n} span {span_id}"), "error": error}


def _otlp_attributes(attributes: Any, where: str) -> dict:
    if attributes is None:
        return {}
    if not isinstance(attributes, list):
        raise BadRecord(f"{where}: span attributes are not a list of key/value pairs")
    return {kv["key"]: otlp.any_value(kv.get("value")) for kv in attributes
            if isinstance(kv, dict) and "key" in kv}


def _exception(events: Any) -> str | None:
    for event in events or []:
        if isinstance(event, dict) and event.get("name") == "exception":
            attributes = event.get("attributes")
            if isinstance(attributes, list):
                attributes = _otlp_attributes(attributes, "event")
            if isinstance(attributes, dict) and attributes.get("exception.message"):
                return str(attributes["exception.message"])
    return None


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested attribute dicts/lists of objects to OpenInference's dotted, indexed keys."""
    out: dict[str, Any] = {}

    def walk(item: Any, path: str) -> None:
        leaf = any(path == s or path.endswith("." + s) for s in _JSON_LEAVES)
        if isinstance(item, dict) and not leaf:
            for key, sub in item.items():
                walk(sub, f"{path}.{key}" if path else str(key))
        elif (isinstance(item, list) and item and not leaf
              and all(isinstance(sub, dict) for sub in item)):
            for i, sub in enumerate(item):
                walk(sub, f"{path}.{i}")
        else:
            out[path] = item

    walk(value, prefix)
    return out


def _json_value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Shared with langfuse.py and langsmith.py.
# ---------------------------------------------------------------------------------------------

_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "ai": "assistant",
          "model": "assistant", "system": "system", "developer": "developer", "tool": "tool",
          "function": "tool"}
# LangChain message classes (serialized `{"lc": 1, "type": "constructor", "id": [..., cls]}`).
_LC_CLASSES = {"HumanMessage": "user", "AIMessage": "assistant", "SystemMessage": "system",
               "ToolMessage": "tool", "FunctionMessage": "tool", "ChatMessage": None}
_TEXT_PARTS = ("text", "input_text", "output_text")
_REASONING_PARTS = ("reasoning", "thinking")
_CALL_PARTS = ("tool_use", "tool_call", "tool-call", "function_call")
_RESULT_PARTS = ("tool_result", "tool-result")
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
               where: str, conversation_id: Any = None) -> dict:
    """The normalized trace from a trace's LLM calls; raises BadRecord if no conversation.

    `conversation_id` is the session or thread the trace belongs to (kept as a string).
    """
    calls = sorted(calls, key=lambda c: (c.start is None, c.start or 0.0))  # stable on ties
    messages, used = join_calls(calls)
    if not messages:
        raise BadRecord(f"{where}: its {len(calls)} LLM call(s) recorded no messages")
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
            "conversation_id": None if conversation_id in (None, "") else str(conversation_id)}


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
    starts a new conversation. The longest
    conversation wins, the latest on a tie (a later, equally long one is a retry).
    """
    threads: list[_Thread] = []
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
        if best is not None:
            n = len(best.keys)
            best.messages[:n] = map(_fill, best.messages[:n], messages[:n])
            best.messages.extend(messages[n:])
            best.keys.extend(keys[n:])
            best.calls.append(call)
        elif repeated := next((t for t in threads if keys == t.keys[:len(keys)]), None):
            call.repeat = True
            repeated.messages[:len(keys)] = map(_fill, repeated.messages[:len(keys)], messages)
        else:
            threads.append(_Thread(messages, call))
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
                                    f"tool_call_id and no unanswered tool call before it")
                call_id = pending[0]
            elif call_id not in made:
                raise BadRecord(f"{where}: message {i} answers tool call {call_id!r}, "
                                f"which no earlier assistant message made")
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
    text, reasoning, block_calls, results = _content(fields.get("content"), where)
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
                        f"system, developer, user, assistant, tool")
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
            texts.append(part.get("text") or "")
        elif kind in _REASONING_PARTS:
            thoughts.append(_reasoning_text(part))
        elif kind in _CALL_PARTS:
            arguments = next((part[k] for k in ("input", "args", "arguments") if k in part), None)
            calls.append(tool_call(part.get("id") or part.get("toolCallId") or part.get("call_id"),
                                   part.get("name") or part.get("toolName"), arguments, here))
        elif kind in _RESULT_PARTS:
            result_text = _content(part.get("content", part.get("output", part.get("result"))),
                                   here)[0]
            call_id = part.get("tool_use_id") or part.get("toolCallId")
            result = {"role": "tool", "content": result_text or ""}
            if call_id:
                result["tool_call_id"] = str(call_id)
            results.append(result)
        elif kind in _SKIPPED_PARTS:
            continue
        else:
            raise BadRecord(f"{here} is a {kind!r} part, which the text-only normalized "
                            f"form cannot hold")
    return "\n".join(texts), "\n".join(t for t in thoughts if t) or None, calls, results


def _plain(value: Any) -> str:
    if isinstance(value, dict) and value.get("type") in ("text", "json") and "value" in value:
        value = value["value"]  # Vercel AI SDK tool output: {"type": "json", "value": ...}
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _reasoning_text(part: dict) -> str:
    for key in ("thinking", "reasoning", "text"):
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
        return next((_int(usage[k]) for k in keys if _int(usage.get(k)) is not None), None)

    return (first("input_tokens", "prompt_tokens", "input", "promptTokens", "inputTokens"),
            first("output_tokens", "completion_tokens", "output", "completionTokens",
                  "outputTokens"))
