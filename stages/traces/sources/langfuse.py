"""Langfuse exports (traces, observations, scores) mapped onto the normalized trace form.

Format. The objects of Langfuse's public API (OpenAPI spec at
cloud.langfuse.com/generated/api/openapi.yml: `TraceWithFullDetails`, `Observation`, `Score`), as
the API and the UI's export write them, in a JSON array or JSONL, in any mix:

- trace: `{"id", "timestamp", "name", "input", "output", "sessionId", "userId", "metadata",
  "tags", "observations", "scores"}`; `GET /traces/{id}` nests the observation and score
  objects, the trace list gives their ids only (which are ignored; the objects must then be
  records of their own);
- observation: `{"id", "traceId", "type": "GENERATION" | "SPAN" | "EVENT" | "AGENT" | "TOOL" |
  ..., "name", "startTime", "model", "input", "output", "usage" | "usageDetails", "level",
  "statusMessage", "parentObservationId"}`;
- score: `{"traceId", "observationId", "name", "value", "stringValue", "dataType": "NUMERIC" |
  "CATEGORICAL" | "BOOLEAN"}`.

Also the UI's "Download JSON" of one trace (`{"trace": {...}, "observations": [...]}`) and
pages of the list endpoints (`{"data": [...], "meta": {...}}`). Observations Langfuse made
from OpenTelemetry spans keep the span's attributes in `metadata.attributes` (metadata, input
and output often stored as JSON text, sometimes encoded twice): GenAI parts-form messages in
`input` / `output`, `gen_ai.system_instructions` -> a leading system message,
`gen_ai.tool.definitions` -> tools; an OpenInference span's messages are read from its
`llm.input_messages.*` / `llm.output_messages.*` attributes (`openinference.call_of`).

Mapping. Records are grouped by Langfuse trace id, which becomes `trace_id` unchanged. The
conversation comes from the GENERATION observations in `startTime` order, joined by prefix
matching (each generation's input repeats the history so far; see `messages.join_calls`).
A generation's `input` is a list of chat messages, `{"messages": [...], "tools": [...]}` (the
OpenAI integration when tools are passed) or a prompt string; its `output` an assistant message
(OpenAI dict, or LangChain's with `tool_calls` as `{"name", "args", "id"}`), a `choices` response
or a string. The LangChain callback handler appends the tools offered to the input as
`{"role": "tool", "content": <tool schema>}`: those become `tools`, not messages. `usageDetails`
(`input` plus its `input_*` parts, likewise `output`; else `usage`) -> `usage`, summed over the
generations; the `model` of the
last generation in the conversation -> `model`; scores -> `feedback["scores"]` (`{name: value}`,
BOOLEAN as bool, CATEGORICAL as its label); the `statusMessage` of a root observation (no parent
in the trace) at level ERROR -> `feedback["error"]`. Scores of sessions or dataset runs (no
`traceId`) are not about one trace and are skipped. The trace's `sessionId` ->
`conversation_id` (None when the file has no trace record for it, or it has no session);
`userId` has no place in the normalized form.
"""

from __future__ import annotations

import json
from typing import Any

from stages.traces.schema import BadRecord, attempt, first_error
from stages.traces.sources import openinference
from stages.traces.sources.messages import (
    Call,
    chat_messages,
    epoch,
    iso_time,
    make_trace,
    token_counts,
    tool_schema,
)

NAME = "langfuse"
# what to change when a record does not have the shape this reader maps (a quarantine's fix)
FIX = ("drop in the export as Langfuse writes it, unchanged: the trace page's Download JSON, "
       "/api/public pages, or the UI's table exports")

_OBSERVATION_TYPES = ("GENERATION", "SPAN", "EVENT", "AGENT", "TOOL", "CHAIN", "RETRIEVER",
                      "EVALUATOR", "EMBEDDING", "GUARDRAIL")
# Keys only a Langfuse trace has (camelCase), to tell it from other objects with an id and a time.
_TRACE_KEYS = ("observations", "scores", "sessionId", "userId", "htmlPath", "latency",
               "totalCost", "projectId")


def detect(record: dict) -> bool:
    """True for a Langfuse trace, observation or score."""
    return _kind(record) is not None


def _kind(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    if (isinstance(record.get("trace"), dict) and isinstance(record.get("observations"), list)
            and "id" in record["trace"]):
        return "export"  # the UI's "Download JSON" of one trace
    if (isinstance(record.get("data"), list) and isinstance(record.get("meta"), dict)
            and record["data"] and all(_kind(item) in ("trace", "observation", "score")
                                       for item in record["data"])):
        return "page"  # a page of the public API's trace, observation or score list
    if record.get("type") in _OBSERVATION_TYPES and ("traceId" in record or "startTime" in record):
        return "observation"
    if ("traceId" in record or "sessionId" in record) and "name" in record and (
            "value" in record or "stringValue" in record) and "type" not in record:
        return "score"
    if "id" in record and "timestamp" in record and "traceId" not in record and (
            any(k in record for k in _TRACE_KEYS) or ("input" in record and "name" in record)):
        return "trace"
    return None


def parse(records: list[dict]) -> list[dict]:
    """All records of a file to normalized traces, one per Langfuse trace id, in file order.

    Raises BadRecord, naming the trace and observation, when a trace cannot be mapped.
    """
    return first_error(parse_each(records))


def _unwrap(records: list) -> list:
    """Single-trace exports and list pages as the plain records they hold."""
    out = []
    for record in records:
        kind = _kind(record)
        if kind == "export":
            out.append({**record["trace"], "observations": record["observations"]})
        elif kind == "page":
            out.extend(record["data"])
        else:
            out.append(record)
    return out


def parse_each(records: list[dict]) -> list[tuple[str, dict | Exception]]:
    """(Langfuse trace id, its normalized trace or the error that kept it from being read) for
    each trace of a file, in file order: one bad trace does not sink the others.

    Raises BadRecord for a record that is not Langfuse's or names no trace.
    """
    records = _unwrap(records)
    traces: dict[str, dict] = {}
    observations: dict[str, dict[str, dict]] = {}
    scores: dict[str, list[dict]] = {}
    order: dict[str, None] = {}  # trace ids in order of first appearance
    for n, record in enumerate(records, 1):
        kind = _kind(record)
        if kind == "trace":
            trace_id = str(record["id"])
            traces[trace_id] = record
            order.setdefault(trace_id)
            for i, item in enumerate(record.get("observations") or []):
                if isinstance(item, dict):  # the list endpoint gives ids only
                    _add_observation(observations, {"traceId": trace_id, **item},
                                     f"record {n} observations[{i}]")
            scores.setdefault(trace_id, []).extend(
                {"traceId": trace_id, **s} for s in record.get("scores") or []
                if isinstance(s, dict))
        elif kind == "observation":
            trace_id = _add_observation(observations, record, f"record {n}")
            order.setdefault(trace_id)
        elif kind == "score":
            if record.get("traceId"):  # session and dataset-run scores are not about a trace
                scores.setdefault(str(record["traceId"]), []).append(record)
                order.setdefault(str(record["traceId"]))
        else:
            keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else ""
            raise BadRecord(f"record {n} is not a Langfuse trace, observation or score"
                            + (f" (keys: {keys})" if keys else
                               f" (a JSON {type(record).__name__})"))
    return [(trace_id, attempt(_trace, trace_id, traces.get(trace_id),
                               list(observations.get(trace_id, {}).values()),
                               scores.get(trace_id, []))) for trace_id in order]


def _add_observation(observations: dict[str, dict[str, dict]], record: dict, where: str) -> str:
    if not record.get("traceId"):
        raise BadRecord(f"{where}: observation {record.get('id')!r} has no traceId")
    trace_id = str(record["traceId"])
    # A trace with nested observations and the same observations as records: keep one of each.
    key = str(record.get("id") or f"#{len(observations.get(trace_id, {}))}")
    observations.setdefault(trace_id, {})[key] = record
    return trace_id


def _trace(trace_id: str, trace: dict | None, observations: list[dict],
           scores: list[dict]) -> dict:
    where = f"trace {trace_id}"
    if trace is None and not observations:
        raise BadRecord(f"{where}: the file has scores for it but not the trace or its "
                        f"observations", fix="put the trace and its observations in the same file "
                        "as its scores")
    generations = [o for o in observations if o.get("type") == "GENERATION"]
    if not generations:
        raise BadRecord(f"{where}: no GENERATION observation among its "
                        f"{len(observations)} observation(s)",
                        fix="export the trace with its observations (the trace page's Download "
                        "JSON, or /api/public/observations?traceId=<id>: a trace list item "
                        "carries only their ids); if they are there, record the model calls as "
                        "generations (Langfuse's OpenAI or LangChain integration, or "
                        "@observe(as_type=\"generation\"))")
    calls = [_call(o, f"{where}: generation {o.get('id')}") for o in generations]
    feedback: dict[str, Any] = {}
    if scores:
        feedback["scores"] = {str(s["name"]): _score_value(s) for s in scores}
    ids = {o["id"] for o in observations if o.get("id")}
    roots = sorted((o for o in observations if o.get("parentObservationId") not in ids),
                   key=lambda o: _start(o, where))
    error = next((o for o in roots if o.get("level") == "ERROR"), None)
    if error is not None:
        message = error.get("statusMessage") or "level ERROR"
        feedback["error"] = f"{error['name']}: {message}" if error.get("name") else message
    created = (trace or {}).get("timestamp")
    if created is None:
        created = min(observations, key=lambda o: _start(o, where)).get("startTime")
    return make_trace(trace_id, calls, created_at=iso_time(created), feedback=feedback,
                      where=where, conversation_id=(trace or {}).get("sessionId"))


def _start(observation: dict, where: str) -> tuple[bool, float]:
    seconds = epoch(observation.get("startTime"), f"{where}: observation {observation.get('id')}")
    return seconds is None, seconds or 0.0


def _call(generation: dict, where: str) -> Call:
    attributes = _attributes(generation, where)
    input_tokens, output_tokens = _usage(generation)
    model = generation.get("model")
    start = epoch(generation.get("startTime"), where)
    if any(k.startswith(("llm.input_messages.", "llm.output_messages.")) for k in attributes):
        # an OpenInference span: its input/output are the raw request and response (shaped by
        # each SDK), its attributes the messages, in OpenInference's one form
        call = openinference.call_of(attributes, start, where)
        call.model = str(model) if model else call.model
        if input_tokens is not None or output_tokens is not None:
            call.input_tokens, call.output_tokens = input_tokens, output_tokens
        return call
    messages, tools = _input(_decoded(generation.get("input")), where)
    system = attributes.get("gen_ai.system_instructions")
    if system is not None and messages and messages[0]["role"] not in ("system", "developer",
                                                                        "tool"):
        # the GenAI conventions keep the system prompt out of gen_ai.input.messages (an input
        # that opens with a tool result continues a conversation: it had its system prompt)
        parts = _decoded(system)
        parts = parts if isinstance(parts, list) else [parts]
        text = "\n".join(p if isinstance(p, str) else str(p.get("content") or "")
                         for p in parts if isinstance(p, str | dict))
        messages.insert(0, {"role": "system", "content": text})
    definitions = _decoded(attributes.get("gen_ai.tool.definitions"))
    for i, schema in enumerate(definitions if isinstance(definitions, list) else []):
        found = tool_schema(schema, f"{where} metadata gen_ai.tool.definitions[{i}]")
        if found:
            tools.append(found)
    return Call(start=start, input=messages,
                output=_output(_decoded(generation.get("output")), where), tools=tools,
                model=str(model) if model else None, input_tokens=input_tokens,
                output_tokens=output_tokens)


def _decoded(value: Any) -> Any:
    """A value Langfuse stored as JSON text (once, or twice: a JSON string of JSON text) decoded;
    plain text is kept as it is.
    """
    for _ in range(3):
        if not isinstance(value, str) or not value.lstrip().startswith(("[", "{", '"')):
            return value
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _attributes(observation: dict, where: str) -> dict:
    """The OpenTelemetry span attributes Langfuse keeps in an observation's
    `metadata.attributes` (metadata itself often stored as JSON text), or {}.
    """
    metadata = _decoded(observation.get("metadata"))
    attributes = metadata.get("attributes") if isinstance(metadata, dict) else None
    attributes = _decoded(attributes)
    if not isinstance(attributes, dict):
        return {}
    return openinference.flatten(attributes)


def _usage(generation: dict) -> tuple[int | None, int | None]:
    """Input and output tokens of a generation.

    In `usageDetails` the parts of a count have keys of their own (`input_cached_tokens`,
    `output_reasoning`) and `input` / `output` hold the rest, so each count is the sum of its
    keys; the older `usage` has plain `input` / `output`.
    """
    details = generation.get("usageDetails")
    if isinstance(details, dict) and details:
        counts = []
        for side in ("input", "output"):
            values = [v for k, v in details.items() if (k == side or k.startswith(side + "_"))
                      and isinstance(v, int | float) and not isinstance(v, bool)]
            counts.append(int(sum(values)) if values else None)
        if counts != [None, None]:
            return counts[0], counts[1]
        return token_counts(details)
    return token_counts(generation.get("usage"))


def _input(value: Any, where: str) -> tuple[list[dict], list[dict]]:
    tools: list[dict] = []
    if value is None:
        return [], tools
    if isinstance(value, str):  # a completion prompt
        return [{"role": "user", "content": value}], tools
    if isinstance(value, dict):
        if "messages" in value:
            for key in ("tools", "functions"):
                for i, schema in enumerate(value.get(key) or []):
                    found = tool_schema(schema, f"{where} input.{key}[{i}]")
                    if found:
                        tools.append(found)
            value = value["messages"]
        elif "role" in value or "lc" in value:
            value = [value]
        else:
            raise BadRecord(f"{where}: input is an object without 'messages' "
                            f"(keys: {', '.join(sorted(value)[:8])})")
    if not isinstance(value, list):
        raise BadRecord(f"{where}: input is a JSON {type(value).__name__}, not a list of messages")
    messages: list[dict] = []
    for i, message in enumerate(value):
        if _is_offered_tool(message):
            found = tool_schema(message["content"], f"{where} input[{i}]")
            if found:
                tools.append(found)
            continue
        messages.extend(chat_messages(message, f"{where} input[{i}]"))
    return messages, tools


def _is_offered_tool(message: Any) -> bool:
    """The LangChain handler's `{"role": "tool", "content": <schema>}` for each tool offered."""
    if not isinstance(message, dict) or message.get("role") != "tool":
        return False
    content = message.get("content")
    return (isinstance(content, dict) and not message.get("tool_call_id")
            and (isinstance(content.get("function"), dict)
                 or ("name" in content and any(k in content for k in
                                               ("parameters", "input_schema", "description")))))


def _output(value: Any, where: str) -> list[dict]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list):
        return [m for i, item in enumerate(value)
                for m in chat_messages(item, f"{where} output[{i}]")]
    if not isinstance(value, dict):
        raise BadRecord(f"{where}: output is a JSON {type(value).__name__}, not a message")
    if isinstance(value.get("choices"), list) and value["choices"]:  # a whole API response
        choice = value["choices"][0]
        value = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(value, dict):
            raise BadRecord(f"{where}: output.choices[0] has no message")
    if value.get("role") is None and "lc" not in value and "data" not in value:
        # The OpenAI integration's streamed output and LangChain's raw tool-call output have
        # no role; they are the model's reply all the same.
        if not any(k in value for k in ("content", "tool_calls", "function_call")):
            raise BadRecord(f"{where}: output is an object with no message in it "
                            f"(keys: {', '.join(sorted(value)[:8])})")
        value = {**value, "role": "assistant"}
    return chat_messages(value, f"{where} output")


def _score_value(score: dict) -> Any:
    kind = score.get("dataType")
    value, label = score.get("value"), score.get("stringValue")
    if kind == "BOOLEAN":
        return bool(value) if value is not None else str(label).lower() == "true"
    if kind == "CATEGORICAL":
        return label if label is not None else value
    return value if value is not None else label
