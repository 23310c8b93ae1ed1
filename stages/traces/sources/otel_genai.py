"""OpenTelemetry GenAI traces, as OTLP JSON, mapped onto the normalized trace form.

Reads what the OpenTelemetry Collector's file exporter writes (OTLP JSON `TracesData`, one object
or one a line); spans are grouped by `traceId` into one normalized trace each, from the GenAI
semantic conventions' span attributes (`gen_ai.input.messages`, `gen_ai.output.messages`,
`gen_ai.tool.definitions`, `gen_ai.usage.*`, ...) and their older names (OpenLLMetry's flattened
`gen_ai.prompt.N.*`). Traces with no GenAI span are skipped; one whose model calls recorded no
content, or only placeholders, is refused (`NoContent`, naming the capture switch). The
conversation is assembled from the model-call spans by prefix matching. Writes nothing.

Details: docs/traces.md, "Reading OpenTelemetry GenAI traces (stages/traces/sources/otel_genai.py)".
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

from stages.traces.schema import (
    ROLES,
    TEXT_ONLY,
    TOOL_TURNS,
    BadRecord,
    NoContent,
    attempt,
    first_error,
    placeholder_problem,
)
from stages.traces.sources import otlp

NAME = "otel-genai"
# what to change when a trace's spans do not have the shape this reader maps (a quarantine's fix)
FIX = ("make the instrumentation write the GenAI semantic conventions "
       "(gen_ai.input.messages / gen_ai.output.messages as the spec's JSON schemas; update it), "
       "or take the trace out of the file")

_INFERENCE_OPS = ("chat", "text_completion", "generate_content")
_AGENT_OPS = ("invoke_agent", "create_agent", "invoke_workflow")
_CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.prompt",
                 "gen_ai.completion")
_INDEXED = re.compile(r"^gen_ai\.(prompt|completion)\.(\d+)\.(.+)$")
_FUNCTIONS = re.compile(r"^llm\.request\.functions\.(\d+)\.(name|description|parameters)$")
# Parts that carry content a chat message cannot hold; other unknown part types are the
# spec's provider-specific "generic" parts (e.g. redacted thinking, cache markers) and are skipped.
_UNMAPPABLE_PARTS = ("blob", "file", "file_data", "uri", "server_tool_call",
                     "server_tool_call_response")
_ROLES = ("system", "user", "assistant", "tool", "developer")
_ROLE_ALIASES = {"model": "assistant"}  # Gemini's name for the assistant
# Instrumentations known by their scope name, and what records their messages where this reader
# reads them, for a trace whose messages they did not record (content capture off)
_CAPTURE_BY_SCOPE = {
    # google/adk-python src/google/adk/telemetry/tracing.py (tracer and otel_logger
    # "gcp.vertex.agent"), context.py (TelemetryConfig); under its stable conventions (ADK 1.x,
    # and ADK 2's schema 1) the messages are log events of "<elided>" while capture is off, and
    # their Gemini Content bodies when it is on; with the current ones each call's messages are
    # gen_ai.input.messages / gen_ai.output.messages (checked with google-adk 1.39.1, 2.13.0)
    "gcp.vertex.agent": "Google ADK records no messages while content capture is off: set "
                        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY and "
                        "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental where the agent "
                        "runs, so each model call's messages are on its span",
    # open-telemetry/opentelemetry-python-contrib instrumentation-genai/opentelemetry-
    # instrumentation-google-genai/src/opentelemetry/instrumentation/google_genai/
    # generate_content.py (_CONTENT_ELIDED) and flags.py
    "opentelemetry.instrumentation.google_genai":
        "turn opentelemetry-instrumentation-google-genai's content capture on: set "
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY and "
        "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental where the app runs",
    # pydantic/pydantic-ai pydantic_ai_slim/pydantic_ai/models/instrumented.py (scope
    # "pydantic-ai", InstrumentationSettings.include_content) and messages.py (a text part
    # without its content while include_content is off)
    "pydantic-ai": "Pydantic AI records no message text with include_content=False: "
                   "instrument with InstrumentationSettings(include_content=True) (Agent("
                   "instrument=...), Agent.instrument_all(...), or "
                   "logfire.instrument_pydantic_ai(include_content=True))",
}


def detect(record: dict) -> bool:
    """True for an OTLP JSON document of spans or log records (`resourceSpans`, `resourceLogs`)."""
    return otlp.detect(record)


def parse(document: dict) -> list[dict]:
    """One OTLP JSON document to its normalized traces, one per GenAI trace id, in file order.

    Raises BadRecord, naming the trace and span, for a span that cannot be mapped.
    """
    return first_error(parse_each(document))


def parse_each(document: dict) -> list[tuple[str, dict | Exception]]:
    """(trace id, its normalized trace or the error that kept it from being read) for each
    GenAI trace of one OTLP JSON document, in file order: one bad trace does not sink the
    others. Traces without any GenAI span are left out.

    Raises BadRecord for a span that names no trace.
    """
    if not detect(document):
        raise BadRecord("not an OTLP JSON document: no 'resourceSpans' or 'resourceLogs' list")
    by_trace: dict[str, list[dict]] = {}
    for i, resource in enumerate(document.get("resourceSpans") or []):
        if not isinstance(resource, dict):
            raise BadRecord(f"resourceSpans[{i}] is not an object")
        # instrumentationLibrarySpans: the name before OTLP 0.15, still seen in old exports
        scopes = resource.get("scopeSpans") or resource.get("instrumentationLibrarySpans") or []
        for j, scope in enumerate(scopes):
            spans = scope.get("spans") if isinstance(scope, dict) else None
            name = _scope_name(scope)
            for k, raw in enumerate(spans or []):
                span = _span(raw, f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}]", name)
                by_trace.setdefault(span["trace_id"], []).append(span)
    _join_events(by_trace, document.get("resourceLogs") or [])
    results = []
    for trace_id, spans in by_trace.items():
        spans.sort(key=lambda s: s["start"])  # stable: file order breaks ties
        trace = attempt(_trace, trace_id, spans)
        if trace is not None:  # None: not a GenAI trace (a health check, plain HTTP)
            results.append((trace_id, trace))
    return results


# --- OTLP JSON -------------------------------------------------------------------------------

def _scope_name(scope: object) -> str | None:
    """The instrumentation scope's name (`instrumentationLibrary` before OTLP 0.15)."""
    if not isinstance(scope, dict):
        return None
    named = scope.get("scope") or scope.get("instrumentationLibrary")
    return named.get("name") if isinstance(named, dict) else None


def _span(raw: object, where: str, scope: str | None) -> dict:
    if not isinstance(raw, dict):
        raise BadRecord(f"{where} is not an object")
    trace_id, span_id = raw.get("traceId"), raw.get("spanId")
    if not isinstance(trace_id, str) or not trace_id:
        raise BadRecord(f"{where} has no 'traceId'")
    if not isinstance(span_id, str) or not span_id:
        raise BadRecord(f"{where} (trace {trace_id}) has no 'spanId'")
    label = f"trace {trace_id} span {span_id}"
    try:
        start = int(raw.get("startTimeUnixNano") or 0)
        attrs = _attributes(raw.get("attributes"))
        events = [{"name": e.get("name"), "attrs": _attributes(e.get("attributes"))}
                  for e in raw.get("events") or []]
    except (TypeError, ValueError, AttributeError, KeyError) as err:
        raise BadRecord(f"{label}: malformed OTLP span ({err})") from None
    # semconv 1.26 put prompt and completion on span events; read them as attributes
    for event in events:
        for name, key in (("gen_ai.content.prompt", "gen_ai.prompt"),
                          ("gen_ai.content.completion", "gen_ai.completion")):
            if event["name"] == name and key in event["attrs"]:
                attrs.setdefault(key, event["attrs"][key])
    status = raw.get("status") if isinstance(raw.get("status"), dict) else {}
    return {"trace_id": trace_id, "span_id": span_id, "label": label,
            "parent": raw.get("parentSpanId") or "", "start": start, "attrs": attrs,
            "events": events, "status": status, "scope": scope}


# GenAI events (log records) with one message each (semconv 1.28 to 1.36), and the role each
# gives its body; gen_ai.choice is the model's answer.
_MESSAGE_EVENTS = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                   "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}
_DETAILS_EVENT = "gen_ai.client.inference.operation.details"  # semconv 1.37 on: one per call


def _join_events(by_trace: dict[str, list[dict]], resource_logs: list) -> None:
    """GenAI events in OTLP log records, joined to their spans by trace and span id.

    Each model call's messages become its span's attributes, as if captured on the span:
    the `gen_ai.client.inference.operation.details` event's `gen_ai.input.messages` /
    `gen_ai.output.messages` / `gen_ai.system_instructions` / `gen_ai.tool.definitions`
    attributes as they are; the per-message events (`gen_ai.{system,user,assistant,tool}.message`
    bodies `{"content", "tool_calls", "id"}`, in time order, and `gen_ai.choice` bodies
    `{"index", "finish_reason", "message"}`) as `gen_ai.prompt` / `gen_ai.completion` chat
    messages. An event whose span is not in the document stands for a span of its own. Log
    records of other events, or of no trace, are left out.
    """
    records = []
    for resource in resource_logs:
        if not isinstance(resource, dict):
            continue
        for scope in resource.get("scopeLogs") or resource.get("instrumentationLibraryLogs") or []:
            scope_name = _scope_name(scope)
            for raw in (scope.get("logRecords") if isinstance(scope, dict) else None) or []:
                if not isinstance(raw, dict) or not raw.get("traceId"):
                    continue
                attrs = _attributes(raw.get("attributes"))
                # the event name: a field of its own since OTLP 1.5, an attribute before
                name = raw.get("eventName") or attrs.get("event.name")
                if name in _MESSAGE_EVENTS or name in ("gen_ai.choice", _DETAILS_EVENT):
                    records.append((int(raw.get("timeUnixNano") or raw.get(
                        "observedTimeUnixNano") or 0), name, attrs, raw, scope_name))
    records.sort(key=lambda r: r[0])  # stable: file order breaks ties
    for time, name, attrs, raw, scope_name in records:
        trace_id, span_id = str(raw["traceId"]), str(raw.get("spanId") or "")
        spans = by_trace.setdefault(trace_id, [])
        span = next((s for s in spans if s["span_id"] == span_id), None)
        if span is None:
            span = {"trace_id": trace_id, "span_id": span_id,
                    "label": f"trace {trace_id} span {span_id or '(none)'}", "parent": "",
                    "start": time, "attrs": {"gen_ai.operation.name": "chat"}, "events": [],
                    "status": {}, "scope": scope_name}
            spans.append(span)
        span_attrs = span["attrs"]
        if name == _DETAILS_EVENT:
            for key, value in attrs.items():
                if key.startswith("gen_ai."):
                    span_attrs.setdefault(key, value)
            continue
        body = otlp.any_value(raw.get("body"))
        if isinstance(body, str):
            body = {"content": body}
        if not isinstance(body, dict):
            raise BadRecord(f"{span['label']}: the {name} event's body is not an object")
        if name == "gen_ai.choice":
            message = body.get("message") if isinstance(body.get("message"), dict) else body
            span_attrs.setdefault("_event_completion", []).append(
                (body.get("index") or 0, {"role": "assistant", **message}))
        else:
            span_attrs.setdefault("_event_prompt", []).append(
                {**body, "role": body.get("role") or _MESSAGE_EVENTS[name]})
    for spans in by_trace.values():
        for span in spans:
            attrs = span["attrs"]
            prompt, completion = attrs.pop("_event_prompt", None), \
                attrs.pop("_event_completion", None)
            if prompt and not any(k in attrs for k in _CONTENT_KEYS):
                attrs["gen_ai.prompt"] = prompt
            if completion and "gen_ai.output.messages" not in attrs:
                attrs.setdefault("gen_ai.completion",
                                 [m for _, m in sorted(completion, key=lambda c: c[0])])


def _attributes(pairs: object) -> dict:
    return {pair["key"]: otlp.any_value(pair.get("value")) for pair in pairs or []}


# --- one trace -------------------------------------------------------------------------------

def _trace(trace_id: str, spans: list[dict]) -> dict | None:
    with_content = [s for s in spans if _has_content(s["attrs"])]
    calls = [s for s in with_content if _op(s) not in _AGENT_OPS] or with_content
    if not calls:
        # OpenLLMetry's model calls name no operation (and have a switch of their own), Semantic
        # Kernel's name it "chat.completions" (its content switch is in CAPTURE)
        openllmetry = any(s["attrs"].get("llm.request.type") in ("chat", "completion")
                          for s in spans)
        if openllmetry or any(_op(s) in _INFERENCE_OPS + ("invoke_agent", "chat.completions")
                              for s in spans):
            raise NoContent(f"trace {trace_id}: its GenAI spans record no messages (content "
                            "capture is off, or its log records were not exported with them)",
                            fix="turn OpenLLMetry's content tracing on: TRACELOOP_TRACE_CONTENT="
                            "true" if openllmetry else _capture_fix(spans))
        return None  # not a GenAI trace

    threads: list[list[dict]] = []
    touched: list[int] = []  # when each thread was last extended
    for n, span in enumerate(calls):
        inputs, outputs = _span_messages(span)
        keys = [_key(m) for m in inputs]
        best, best_k = -1, 0
        for t, thread in enumerate(threads):
            k = _common_prefix([_key(m) for m in thread], keys)
            if k > best_k or (k == best_k and k > 0):
                best, best_k = t, k
        if best < 0:
            threads.append(inputs + outputs)
            touched.append(n)
            continue
        thread = threads[best]
        # keep the thread's copy of the shared prefix: it has the reasoning inputs don't echo
        if best_k == len(thread):
            thread += inputs[best_k:] + outputs
            touched[best] = n
        else:  # a retry or a branch from an earlier point: a new thread, the old one stays
            threads.append(thread[:best_k] + inputs[best_k:] + outputs)
            touched.append(n)
    messages = threads[max(range(len(threads)), key=lambda t: (len(threads[t]), touched[t]))]
    if not messages:
        raise NoContent(f"trace {trace_id}: its GenAI spans hold no messages",
                        fix=_capture_fix(calls))
    problem = placeholder_problem(messages)  # "<elided>" where each message was, say
    if problem is not None:
        raise NoContent(f"trace {trace_id}: {problem[0]}", fix=_capture_fix(calls) or problem[1])

    return {
        "trace_id": trace_id,
        "model": _model(calls),
        "created_at": _iso(min(s["start"] for s in spans)),
        "messages": messages,
        "tools": _tools(calls),
        "feedback": _feedback(spans, calls),
        "usage": _usage(calls),
        "conversation_id": _conversation_id(spans),
        "user_id": _user_id(spans),
    }


def _capture_fix(spans: list[dict]) -> str | None:
    """What records the messages of the instrumentation that wrote these spans, where its scope
    name says which (`_CAPTURE_BY_SCOPE`); else None.
    """
    return next((_CAPTURE_BY_SCOPE[s["scope"]] for s in spans
                 if s["scope"] in _CAPTURE_BY_SCOPE), None)


def _conversation_id(spans: list[dict]) -> str | None:
    """The first `gen_ai.conversation.id` of the spans (in start order), as a string."""
    for span in spans:
        value = span["attrs"].get("gen_ai.conversation.id")
        if value is not None and value != "":
            return str(value)
    return None


def _user_id(spans: list[dict]) -> str | None:
    """The first `user.id` (or the older `enduser.id`) of the spans, in start order: the user
    the trace served, which only erasure's index keeps (as a salted hash).
    """
    for span in sorted(spans, key=lambda s: s["start"]):
        for key in ("user.id", "enduser.id"):
            value = span["attrs"].get(key)
            if value not in (None, ""):
                return str(value)
    return None


def _op(span: dict) -> str | None:
    return span["attrs"].get("gen_ai.operation.name")


def _has_content(attrs: dict) -> bool:
    return any(k in attrs for k in _CONTENT_KEYS) or any(_INDEXED.match(k) for k in attrs)


def _common_prefix(a: list[str], b: list[str]) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def _key(message: dict) -> str:
    """What must agree for a message echoed in a later input to count as the same message."""
    calls = [{"id": c["id"], "name": c["function"]["name"],
              "arguments": json.loads(c["function"]["arguments"])}
             for c in message.get("tool_calls") or []]
    content = " ".join((message.get("content") or "").split())
    return json.dumps([message["role"], content, calls, message.get("tool_call_id")],
                      sort_keys=True, ensure_ascii=False)


def _iso(nanos: int) -> str | None:
    if nanos <= 0:
        return None
    stamp = datetime.fromtimestamp(nanos // 10**9, tz=timezone.utc)
    stamp += timedelta(microseconds=nanos % 10**9 // 1000)
    return stamp.isoformat().replace("+00:00", "Z")


def _model(calls: list[dict]) -> str | None:
    for key in ("gen_ai.response.model", "gen_ai.request.model"):
        for span in reversed(calls):
            if isinstance(span["attrs"].get(key), str) and span["attrs"][key]:
                return span["attrs"][key]
    return None


def _usage(calls: list[dict]) -> dict:
    names = {"input_tokens": ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
             "output_tokens": ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"),
             "cached_input_tokens": ("gen_ai.usage.cache_read.input_tokens",),
             "reasoning_tokens": ("gen_ai.usage.reasoning.output_tokens",)}
    usage: dict[str, int] = {}
    for span in calls:
        for name, keys in names.items():
            value = next((span["attrs"][k] for k in keys if k in span["attrs"]), None)
            if isinstance(value, int) and not isinstance(value, bool):
                usage[name] = usage.get(name, 0) + value
    return usage


def _tools(calls: list[dict]) -> list[dict]:
    tools: dict[str, dict] = {}
    for span in calls:
        attrs = span["attrs"]
        defined = attrs.get("gen_ai.tool.definitions")
        if defined is not None:
            defined = _json(defined, "gen_ai.tool.definitions", span["label"])
        indexed: dict[int, dict] = {}
        for key, value in attrs.items():
            match = _FUNCTIONS.match(key)
            if match:
                indexed.setdefault(int(match[1]), {})[match[2]] = value
        for tool in (defined if isinstance(defined, list) else []) + [
                indexed[i] for i in sorted(indexed)]:
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                continue  # provider-hosted tools have no chat schema
            function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            name = function.get("name")
            if not isinstance(name, str) or name in tools:
                continue
            entry = {"name": name}
            if function.get("description"):
                entry["description"] = function["description"]
            parameters = function.get("parameters")
            if isinstance(parameters, str):  # OpenLLMetry records the schema as a JSON string
                parameters = _json(parameters, "llm.request.functions parameters", span["label"])
            if parameters:
                entry["parameters"] = parameters
            tools[name] = {"type": "function", "function": entry}
    return list(tools.values())


def _feedback(spans: list[dict], calls: list[dict]) -> dict:
    feedback: dict = {}
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent"] not in ids]
    for span in roots + calls[-1:]:
        code = span["status"].get("code")
        if code in (2, "2", "STATUS_CODE_ERROR"):
            feedback["error"] = (span["status"].get("message")
                                 or span["attrs"].get("error.type") or "error")
            break
    scores = {}
    for span in spans:
        for event in span["events"]:
            attrs = event["attrs"]
            if event["name"] == "gen_ai.evaluation.result" and attrs.get("gen_ai.evaluation.name"):
                value = attrs.get("gen_ai.evaluation.score.value")
                if value is None:
                    value = attrs.get("gen_ai.evaluation.score.label")
                scores[attrs["gen_ai.evaluation.name"]] = value
    if scores:
        feedback["scores"] = scores
    return feedback


# --- one span's messages ---------------------------------------------------------------------

class _Calls:
    """Tool calls seen in one span's messages, so that every tool reply names a call before it."""

    def __init__(self, label: str, scope: str | None) -> None:
        self.label, self.scope = label, scope
        self.known: set[str] = set()
        self.waiting: list[str] = []  # calls not yet answered, in order
        self.count = 0

    def call(self, call_id: object, name: object, arguments: object, where: str) -> dict:
        if not isinstance(name, str) or not name:
            raise BadRecord(f"{self.label}: {where}: tool call has no 'name'")
        # The spec lets the id be null; number the call by its place in the history, so the
        # same call gets the same id in every later span that repeats it.
        call_id = str(call_id).strip() if call_id not in (None, "") else f"call_{self.count}"
        self.count += 1
        self.known.add(call_id)
        self.waiting.append(call_id)
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": self.arguments(arguments, call_id, where)}}

    def arguments(self, value: object, call_id: str, where: str) -> str:
        if value is None or (isinstance(value, str) and not value.strip()):
            return "{}"
        if not isinstance(value, str):  # the current conventions record an object
            return json.dumps(value, ensure_ascii=False)
        try:
            json.loads(value)
        except json.JSONDecodeError as err:
            raise BadRecord(f"{self.label}: {where}: tool call {call_id!r} arguments are not "
                            f"valid JSON ({err.msg} at column {err.colno})") from None
        return value

    def reply(self, call_id: object, response: object, where: str) -> dict:
        if call_id not in (None, ""):
            call_id = str(call_id).strip()
            if call_id not in self.known:
                raise BadRecord(f"{self.label}: {where}: tool_call_response id {call_id!r} has "
                                "no matching tool_call", fix=TOOL_TURNS)
            if call_id in self.waiting:
                self.waiting.remove(call_id)
        elif self.waiting:
            call_id = self.waiting.pop(0)  # no id: it answers the oldest open call
        else:
            raise BadRecord(f"{self.label}: {where}: tool_call_response has no id and no tool "
                            "call is waiting for one", fix=TOOL_TURNS)
        if response is None:
            content = ""
        elif isinstance(response, str):
            content = response
        else:
            content = json.dumps(response, ensure_ascii=False)
        return {"role": "tool", "tool_call_id": call_id, "content": content}


def _span_messages(span: dict) -> tuple[list[dict], list[dict]]:
    """A model-call span's input and (first) output as chat messages."""
    attrs, label = span["attrs"], span["label"]
    calls = _Calls(label, span["scope"])
    inputs: list[dict] = []
    system = attrs.get("gen_ai.system_instructions")
    if system is not None:
        text = _system_text(_json(system, "gen_ai.system_instructions", label, text=True))
        if text:
            inputs.append({"role": "system", "content": text})

    if "gen_ai.input.messages" in attrs:
        raw_in = _json(attrs["gen_ai.input.messages"], "gen_ai.input.messages", label)
        inputs += _messages(raw_in, "gen_ai.input.messages", calls, "user", current=True)
    elif "gen_ai.prompt" in attrs:
        raw_in = _json(attrs["gen_ai.prompt"], "gen_ai.prompt", label, text=True)
        inputs += _messages(raw_in, "gen_ai.prompt", calls, "user")
    else:
        inputs += _messages(_indexed(attrs, "prompt"), "gen_ai.prompt", calls, "user")

    if "gen_ai.output.messages" in attrs:
        raw_out = _json(attrs["gen_ai.output.messages"], "gen_ai.output.messages", label)
        name = "gen_ai.output.messages"
    elif "gen_ai.completion" in attrs:
        raw_out = _json(attrs["gen_ai.completion"], "gen_ai.completion", label, text=True)
        name = "gen_ai.completion"
    else:
        raw_out, name = _indexed(attrs, "completion"), "gen_ai.completion"
    current = name == "gen_ai.output.messages"
    if isinstance(raw_out, list):
        raw_out = raw_out[:1]  # each output message is a separate choice: keep the first
    return inputs, _messages(raw_out, name, calls, "assistant", current)


def _json(value: object, name: str, label: str, text: bool = False) -> object:
    """A structured attribute, decoded if it was recorded as a JSON string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        # The older attributes sometimes hold the bare prompt or completion text.
        if text and not value.lstrip().startswith(("[", "{")):
            return value
        raise BadRecord(f"{label}: {name} is not valid JSON ({err.msg} at line {err.lineno} "
                        f"column {err.colno})") from None


def _system_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # an early draft: {"role": ..., "message": {text part}}
        value = [value.get("message") or value]
    texts = [p.get("content") for p in value or [] if isinstance(p, dict)
             and p.get("type", "text") == "text" and isinstance(p.get("content"), str)]
    return "\n".join(texts)


def _messages(raw: object, name: str, calls: _Calls, default_role: str,
              current: bool = False) -> list[dict]:
    """Messages of the current conventions (`current`: parts required) or the older ones."""
    if raw is None:
        return []
    if not current and isinstance(raw, str):  # bare text
        return [{"role": default_role, "content": raw}]
    if not current and isinstance(raw, dict):  # a single message or choice
        raw = [raw]
    if not isinstance(raw, list):
        raise BadRecord(f"{calls.label}: {name} must be a list of messages, got "
                        f"{type(raw).__name__}")
    out: list[dict] = []
    for i, message in enumerate(raw):
        where = f"{name}[{i}]"
        if isinstance(message, dict) and isinstance(message.get("message"), dict):
            message = message["message"]  # a chat completions choice
        if not isinstance(message, dict):
            raise BadRecord(f"{calls.label}: {where} is not an object")
        role = message.get("role", default_role)
        role = _ROLE_ALIASES.get(role, role)
        if role not in _ROLES:
            raise BadRecord(f"{calls.label}: {where} has role {role!r}, not one of "
                            f"{', '.join(_ROLES)}", fix=ROLES)
        if current or "parts" in message:
            out += _from_parts(role, message.get("parts"), calls, where)
        else:
            out += _from_chat(role, message, calls, where)
    return out


def _from_parts(role: str, parts: object, calls: _Calls, where: str) -> list[dict]:
    """A message in the current conventions' parts form."""
    if not isinstance(parts, list):
        raise BadRecord(f"{calls.label}: {where} has no 'parts' list")
    texts, reasoning, tool_calls, replies = [], [], [], []
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if "content" not in part:  # the spec requires it: Pydantic AI's include_content=False
                raise NoContent(f"{calls.label}: {at} is a text part with no content: the "
                                "instrumentation did not record it",
                                fix=_CAPTURE_BY_SCOPE.get(calls.scope))
            texts.append(str(part.get("content") or ""))
        elif kind == "reasoning":
            reasoning.append(str(part.get("content") or ""))
        elif kind == "tool_call":
            tool_calls.append(calls.call(part.get("id"), part.get("name"),
                                         part.get("arguments"), at))
        elif kind == "tool_call_response":
            # "response" per the JSON schema; one spec example says "result"
            response = part["response"] if "response" in part else part.get("result")
            replies.append(calls.reply(part.get("id"), response, at))
        elif kind in _UNMAPPABLE_PARTS:
            raise BadRecord(f"{calls.label}: {at}: part type {kind!r} cannot be mapped to a "
                            "chat message (only text, reasoning and tool parts can)",
                            fix=TEXT_ONLY)
        elif not isinstance(kind, str):
            raise BadRecord(f"{calls.label}: {at} has no 'type'")
    text = "\n".join(texts)
    if role == "assistant":
        message: dict = {"role": "assistant", "content": text or None}
        if reasoning:
            message["reasoning_content"] = "\n\n".join(reasoning)
        if tool_calls:
            message["tool_calls"] = tool_calls
        return [message] + replies
    if role == "tool" and not replies:  # a tool message carrying its reply as text
        return [calls.reply(None, text, where)]
    # Tool replies can sit in a user message (Anthropic's tool_result blocks): chat needs
    # them as tool messages, ahead of any text the user turn adds.
    rest = [{"role": role, "content": text}] if texts or not replies else []
    return replies + rest


def _from_chat(role: str, message: dict, calls: _Calls, where: str) -> list[dict]:
    """A message in the chat-completions form the older attributes carry."""
    content = _chat_content(message.get("content"))
    if role == "tool":
        return [calls.reply(message.get("tool_call_id") or message.get("id"), content or "",
                            where)]
    out: dict = {"role": role, "content": content}
    if role == "assistant":
        tool_calls = list(message.get("tool_calls") or [])
        if isinstance(message.get("function_call"), dict):  # the pre-tools function calling
            tool_calls.append(message["function_call"])
        entries = []
        for j, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call.get("function"), dict) else call
            entries.append(calls.call(call.get("id"), function.get("name"),
                                      function.get("arguments"), f"{where}.tool_calls[{j}]"))
        if entries:
            out["tool_calls"] = entries
        if isinstance(message.get("reasoning_content"), str):
            out["reasoning_content"] = message["reasoning_content"]
    elif content is None:
        out["content"] = ""
    return [out]


def _chat_content(content: object) -> str | None:
    if isinstance(content, str):
        # OpenLLMetry JSON-encodes list content into the flattened attribute
        if content.startswith("[{"):
            try:
                decoded = json.loads(content)
            except json.JSONDecodeError:
                return content
            if all(isinstance(p, dict) and "type" in p for p in decoded):
                content = decoded
            else:
                return content
        else:
            return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or p.get("content") or "") for p in content
                         if isinstance(p, dict) and p.get("type") in ("text", "input_text"))
    return None if content is None else json.dumps(content, ensure_ascii=False)


def _indexed(attrs: dict, kind: str) -> list[dict] | None:
    """OpenLLMetry's flattened messages (`gen_ai.prompt.0.role`, ...) as chat-style dicts."""
    rows: dict[int, dict] = {}
    for key, value in attrs.items():
        match = _INDEXED.match(key)
        if not match or match[1] != kind:
            continue
        row = rows.setdefault(int(match[2]), {})
        field = match[3]
        nested = re.match(r"^tool_calls\.(\d+)\.(id|name|arguments)$", field)
        if nested:
            row.setdefault("_calls", {}).setdefault(int(nested[1]), {})[nested[2]] = value
        elif field.startswith("function_call."):
            row.setdefault("function_call", {})[field.split(".", 1)[1]] = value
        else:
            row[field] = value
    if not rows:
        return None
    out = []
    for i in sorted(rows):
        row = rows[i]
        calls = row.pop("_calls", {})
        if calls:
            row["tool_calls"] = [calls[j] for j in sorted(calls)]
        out.append(row)
    return out
