"""OpenInference spans, as Arize Phoenix exports them, mapped onto the normalized trace form.

Reads OTLP JSON, Phoenix's span JSON (or rows with `attributes.<name>` columns) and Phoenix
annotations, a file may mix them; OpenInference's flattened attributes
(`llm.input_messages.<i>.message.*`, `llm.output_messages.`, `llm.tools`, `llm.token_count.*`)
are mapped onto the normalized trace, one per trace id, the `LLM` spans joined by prefix
matching. A message hidden as `__REDACTED__` is refused (`NoContent`); image, audio and video
parts raise `BadRecord`. Writes nothing: ingest calls it. Shared helpers are in `messages.py`.

Details: docs/traces.md, "Reading OpenInference spans (stages/traces/sources/openinference.py)".
"""

from __future__ import annotations

import json
import re
from typing import Any

from stages.traces.schema import (
    TEXT_ONLY,
    BadRecord,
    NoContent,
    attempt,
    first_error,
    placeholder_problem,
)
from stages.traces.sources import otlp
from stages.traces.sources.messages import (
    Call,
    as_int,
    chat_messages,
    epoch,
    iso_time,
    make_trace,
    tool_schema,
)

NAME = "openinference"
# what to change when a trace's spans do not have the shape this reader maps (a quarantine's fix)
FIX = ("export the spans as an openinference-instrumentation-<x> package writes them "
       "(llm.input_messages.* / llm.output_messages.*), unchanged, or take the trace out of the file")

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
# What OpenInference writes for a message text it hides, and the setting that hides it, by where:
# Arize-ai/openinference python/openinference-instrumentation/src/openinference/instrumentation/
# config.py (REDACTED_VALUE; TraceConfig.mask: hide_input_text / hide_output_text redact
# message.content and message_content.text, hide_inputs / hide_outputs drop the messages)
REDACTED = "__REDACTED__"
_HIDING = {"llm.input_messages.": "OPENINFERENCE_HIDE_INPUT_TEXT (TraceConfig's hide_input_text)",
           "llm.output_messages.": "OPENINFERENCE_HIDE_OUTPUT_TEXT (TraceConfig's "
                                   "hide_output_text)"}


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
    return first_error(parse_each(records))


def parse_each(records: list[dict]) -> list[tuple[str, dict | Exception]]:
    """(trace id, its normalized trace or the error that kept it from being read) for each
    trace of a file, in order of first span: one bad trace does not sink the others.

    Raises BadRecord for a record that is not a span or names no trace.
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
                            f"which is not a span or trace in this file",
                            fix="put annotations in the same file as the spans they score")
        result = record.get("result") or {}
        value = result.get("score") if result.get("score") is not None else result.get("label")
        scores.setdefault(trace_id, {})[str(record["name"])] = value
    return [(trace_id, attempt(_trace, trace_id, group, scores.get(trace_id, {})))
            for trace_id, group in groups.items()]


def _trace(trace_id: str, spans: list[dict], extra_scores: dict[str, Any]) -> dict:
    where = f"trace {trace_id}"
    ids = {span["span_id"] for span in spans if span["span_id"]}
    calls = [_call(span, f"{where}: span {span['span_id']}") for span in spans
             if span["kind"] == "LLM"]
    if not calls:
        raise BadRecord(f"{where}: no LLM span (openinference.span.kind = LLM) among its "
                        f"{len(spans)} span(s)",
                        fix="instrument the LLM client too, with openinference-instrumentation-<x> "
                        "(openai, anthropic, langchain, ...), so that each model call is an LLM "
                        "span; or export every span of the trace, not only the agent's")
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
    user = next((s["attributes"]["user.id"] for s in sorted(spans, key=_start_key)
                 if s["attributes"].get("user.id") not in (None, "")), None)
    trace = make_trace(trace_id, calls, created_at=iso_time(first["start"]), feedback=feedback,
                       where=where, conversation_id=session, user_id=user)
    problem = placeholder_problem(trace["messages"])
    if problem is not None:
        hidden = sorted({setting for span in spans if span["kind"] == "LLM"
                         for key, value in span["attributes"].items() if value == REDACTED
                         for prefix, setting in _HIDING.items() if key.startswith(prefix)})
        raise NoContent(f"{where}: {problem[0]}", fix=problem[1] if not hidden else (
            f"let OpenInference record message text: unset {' and '.join(hidden)} where the "
            f"app runs"))
    return trace


def _start_key(span: dict) -> tuple[bool, float]:
    return span["start_epoch"] is None, span["start_epoch"] or 0.0


def call_of(attributes: dict, start: float | None, where: str) -> Call:
    """The LLM call of one OpenInference LLM span, from its flattened attributes (a Langfuse
    observation keeps them in `metadata.attributes`).
    """
    return _call({"attributes": attributes, "start_epoch": start}, where)


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
                input_tokens=as_int(attributes.get("llm.token_count.prompt")),
                output_tokens=as_int(attributes.get("llm.token_count.completion")))


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
                                f"text-only normalized form cannot hold", fix=TEXT_ONLY)
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
