"""Langfuse exports (traces, observations, scores) mapped onto the normalized trace form.

Reads the objects of Langfuse's public API (traces, observations, scores) as the API and the UI's
export write them, in a JSON array or JSONL in any mix, plus the UI's "Download JSON" of one trace
and pages of the list endpoints. Records are grouped by Langfuse trace id; the conversation comes
from the GENERATION observations joined by prefix matching, with the agent frameworks' own shapes
read too (Vercel AI SDK, LlamaIndex, pydantic-ai, Koog, LangChain, Agno, Claude Agent SDK, ...).
Usage, model, scores, the root's error and `sessionId` fill the rest. Writes nothing.

Details: docs/traces.md, "Reading Langfuse exports (stages/traces/sources/langfuse.py)".
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
    tool_call,
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
    read = _read_generations(_without_wrappers(generations, where), observations, where)
    generations, calls = [g for g, _ in read], [c for _, c in read]
    _fill_dropped(generations, calls, where)
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
                      where=where, conversation_id=(trace or {}).get("sessionId"),
                      user_id=(trace or {}).get("userId"))


# The Vercel AI SDK's spans for a whole call, whose `.doGenerate` / `.doStream` children are the
# provider calls that make it up.
_AI_SDK_WRAPPERS = ("ai.generateText", "ai.streamText", "ai.generateObject", "ai.streamObject")


def _without_wrappers(generations: list[dict], where: str) -> list[dict]:
    """The generations less the Vercel AI SDK's wrappers of the provider calls under them.

    A wrapper's input is the caller's prompt and its usage the sum of its steps, so reading it
    as a call of its own would count tokens twice and lose the tools its children offered.
    """
    parents = {o.get("parentObservationId") for o in generations}
    return [o for o in generations if not (
        o.get("id") in parents and _attributes(o, where).get("ai.operationId") in _AI_SDK_WRAPPERS)]


def _read_generations(generations: list[dict], observations: list[dict],
                      where: str) -> list[tuple[dict, Call]]:
    """Each generation with its call, in start order; a turn recorded without its history
    (see `_is_bare_turn`) is added to the call before it instead.
    """
    read: list[tuple[dict, Call]] = []
    latest: dict[Any, Call] = {}  # parent observation id -> the latest call under it
    ran: set = set()  # the TOOL observations already read as results
    for generation in sorted(generations, key=lambda o: _start(o, where)):
        here = f"{where}: generation {generation.get('id')}"
        try:
            call = _call(generation, here)
        except BadRecord:
            head = latest.get(generation.get("parentObservationId"))
            if head is None or not _is_bare_turn(generation):
                raise
            _add_turn(head, generation, observations, ran, here)
            continue
        read.append((generation, call))
        latest[generation.get("parentObservationId")] = call
    for generation, call in read:
        _add_system(call, generation, observations)
    return read


def _is_bare_turn(generation: dict) -> bool:
    """A generation whose output is an assistant message and whose input holds no messages.

    LangSmith's Claude Agent SDK integration records each assistant message of a query as a run
    of its own: the first with the prompt as input, the others with `{"content": "role"}`.
    """
    value = _decoded(generation.get("input"))
    output = _decoded(generation.get("output"))
    return (isinstance(value, dict) and not any(k in value for k in ("messages", "role", "lc"))
            and isinstance(output, dict) and output.get("role") == "assistant")


def _add_turn(head: Call, generation: dict, observations: list[dict], ran: set,
              where: str) -> None:
    """Continue `head` with a bare turn: the results of the tools its calls ran (TOOL
    observations under the same parent, started before the turn, matched to a call by name and
    arguments), then the turn's reply. Assistant messages with nothing between them are one
    reply (the API returns one message; the integration records each content block).
    """
    start = epoch(generation.get("startTime"), where)
    pending = _unanswered(head.input + head.output)
    results = []
    for tool in sorted(observations, key=lambda o: _start(o, where)):
        if (tool.get("type") != "TOOL" or tool.get("parentObservationId")
                != generation.get("parentObservationId") or tool.get("id") in ran
                or (epoch(tool.get("startTime"), where) or 0.0) > (start or 0.0)):
            continue
        arguments = _decoded(tool.get("input"))
        if isinstance(arguments, dict) and set(arguments) == {"input"}:
            arguments = arguments["input"]  # LangSmith's tool run: {"input": <arguments>}
        call = next((c for c in pending if c["function"]["name"] == tool.get("name")
                     and _json_or_text(c["function"]["arguments"]) == arguments), None)
        if call is not None:
            pending.remove(call)
            ran.add(tool.get("id"))
            results.append({"role": "tool", "tool_call_id": call["id"],
                            "content": _result_text(_decoded(tool.get("output")))})
    reply = _output(_decoded(generation.get("output")), where)
    if pending and (results or not any(m.get("tool_calls") for m in reply)):
        # (a turn of more tool calls with no result before it is the same reply going on)
        names = ", ".join(c["function"]["name"] for c in pending)
        raise BadRecord(f"{where}: the tool call(s) {names} before this turn have no TOOL "
                        f"observation with that name and input under the same parent")
    if not results and head.output and head.output[-1]["role"] == "assistant" and len(reply) == 1:
        head.output[-1] = _merged(head.output[-1], reply[0])
    else:
        head.output.extend(results + reply)
    input_tokens, output_tokens = _usage(generation)
    if input_tokens is not None:
        head.input_tokens = (head.input_tokens or 0) + input_tokens
    if output_tokens is not None:
        head.output_tokens = (head.output_tokens or 0) + output_tokens


def _merged(first: dict, second: dict) -> dict:
    """Two assistant messages as the one reply they are parts of."""
    text = "\n".join(m["content"] for m in (first, second) if m.get("content"))
    merged = {"role": "assistant", "content": text or None}
    calls = (first.get("tool_calls") or []) + (second.get("tool_calls") or [])
    if calls:
        merged["tool_calls"] = calls
    reasoning = "\n".join(m["reasoning_content"] for m in (first, second)
                          if m.get("reasoning_content"))
    if reasoning:
        merged["reasoning_content"] = reasoning
    return merged


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _result_text(value: Any) -> str:
    """A tool observation's output as a tool message's text.

    MCP's `{"content": [text parts]}` becomes its text; other JSON stays JSON.
    """
    if isinstance(value, dict) and isinstance(value.get("content"), list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in value["content"]):
        return "\n".join(str(p.get("text") or "") for p in value["content"])
    if value is None or isinstance(value, str):
        return value or ""
    return json.dumps(value, ensure_ascii=False)


def _add_system(call: Call, generation: dict, observations: list[dict]) -> None:
    """The system prompt a call's parent got as `{"prompt", "system"}` (the Claude Agent SDK's
    query options, as LangSmith records the conversation), when the call opens with that prompt
    and has no system message of its own.
    """
    parent = next((o for o in observations if o.get("id") is not None
                   and o.get("id") == generation.get("parentObservationId")), None)
    options = _decoded(parent.get("input")) if parent else None
    if (isinstance(options, dict) and isinstance(options.get("system"), str)
            and call.input and call.input[0]["role"] == "user"
            and options.get("prompt") == call.input[0].get("content")):
        call.input.insert(0, {"role": "system", "content": options["system"]})


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
        outputs = _indices(attributes, "llm.output_messages")
        if outputs and outputs[0] != 0:
            raise BadRecord(f"{where}: its llm.output_messages start at index {outputs[0]}: "
                            f"the first {outputs[0]} output message(s) (stream chunks) are "
                            f"missing, so the reply is incomplete",
                            fix="export the trace with all its output messages, or trace the "
                            "calls unstreamed")
        if not call.output and generation.get("output") is not None:
            # Agno's instrumentation records no llm.output_messages; the response is the
            # observation's output (the provider's raw response)
            call.output = _output(_decoded(generation.get("output")), where)
        if input_tokens is not None or output_tokens is not None:
            call.input_tokens, call.output_tokens = input_tokens, output_tokens
        return call
    messages, tools = _input(_decoded(generation.get("input")), where)
    for i, schema in enumerate(_decoded(attributes.get("ai.prompt.tools")) or []):
        # the Vercel AI SDK's offered tools: {"type": "function", "name", "inputSchema"}
        schema = _decoded(schema)
        if isinstance(schema, dict) and "inputSchema" in schema:
            schema = {"type": schema.get("type"), "name": schema.get("name"),
                      "description": schema.get("description"),
                      "parameters": schema["inputSchema"]}
        found = tool_schema(schema, f"{where} metadata ai.prompt.tools[{i}]")
        if found:
            tools.append(found)
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


def _indices(attributes: dict, prefix: str) -> list[int]:
    """The message indices of OpenInference's `prefix.<i>.*` attributes, in order."""
    found = {key[len(prefix) + 1:].partition(".")[0] for key in attributes
             if key.startswith(prefix + ".")}
    return sorted(int(i) for i in found if i.isdigit())


def _fill_dropped(generations: list[dict], calls: list[Call], where: str) -> None:
    """Put back the input messages an OpenInference instrumentation left out.

    Agno's leaves out the assistant message that made tool calls (its `llm.input_messages`
    skip that index), so the next call's tool result answers nothing. The message at a skipped
    index is the one an earlier call of the trace had there (its input and its reply), found by
    matching the messages around it.
    """
    order = sorted(range(len(calls)), key=lambda k: (calls[k].start is None, calls[k].start or 0))
    for rank, k in enumerate(order):
        here = f"{where}: generation {generations[k].get('id')}"
        present = _indices(_attributes(generations[k], here), "llm.input_messages")
        dropped = [i for i in range(present[-1]) if i not in present] if present else []
        if not dropped:
            continue
        call = calls[k]
        if len(call.input) != len(present):
            raise BadRecord(f"{here}: llm.input_messages.{dropped[0]} is missing (the "
                            f"instrumentation left it out)")
        full: list[dict | None] = [None] * (present[-1] + 1)
        for index, message in zip(present, call.input):
            full[index] = message
        for earlier in reversed(order[:rank]):
            prior = calls[earlier].input + calls[earlier].output
            if len(prior) > dropped[-1] and all(
                    _same(prior[i], full[i]) for i in present if i < len(prior)):
                for i in dropped:
                    full[i] = prior[i]
                break
        else:
            raise BadRecord(f"{here}: llm.input_messages.{dropped[0]} is missing (the "
                            f"instrumentation left it out) and no earlier call of the trace "
                            f"has the messages around it")
        call.input = [m for m in full if m is not None]


def _same(a: dict | None, b: dict | None) -> bool:
    """Two records of one message (role and text, whitespace aside)."""
    return a is not None and b is not None and a["role"] == b["role"] and (
        " ".join((a.get("content") or "").split()) == " ".join((b.get("content") or "").split()))


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
        elif isinstance(value.get("prompt"), str):
            # the Vercel AI SDK's generateText({system, prompt}) (its doGenerate child has the
            # same call as messages)
            system = value.get("system")
            return ([{"role": "system", "content": system}] if isinstance(system, str) else []) + [
                {"role": "user", "content": value["prompt"]}], tools
        elif (set(value) <= {"args", "kwargs"} and isinstance(value.get("args"), list)
              and value["args"] and isinstance(value["args"][0], str)):
            # LlamaIndex's instrumentation records the call's arguments: complete(prompt, ...)
            return [{"role": "user", "content": value["args"][0]}], tools
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
        messages.extend(chat_messages(_framework_message(message, messages),
                                      f"{where} input[{i}]"))
    return messages, tools


# The roles `messages.chat_messages` reads (a message with another role is an error there).
_KNOWN_ROLES = ("user", "human", "assistant", "ai", "model", "system", "developer", "tool",
                "function")
_MEAI_REASONING = "Microsoft.Extensions.AI.TextReasoningContent"


def _framework_message(message: Any, before: list[dict]) -> Any:
    """A message as one framework writes it, in the shape `chat_messages` reads.

    `before` is the conversation read so far (normalized). What each framework does:

    - Koog records a tool call as a message whose content is the JSON text of OpenAI tool calls
      (`[{"function": {"name", "arguments"}, "id", "type": "function"}]`), with role
      `assistant` in an output and `tool` in the next input: the model's call either way.
    - LangChain JS's handler gives a tool result the tool's name as its role and no
      `tool_call_id`: it answers the unanswered call of that name.
    - Microsoft.Extensions.AI writes reasoning as a `TextReasoningContent` part,
      `{"content": {"text", "protectedData"}}`: its text is kept as reasoning; a part with
      only `protectedData` (the provider's encrypted reasoning, often with empty text) has
      nothing readable and is left out, like Anthropic's `redacted_thinking`.
    - A GenAI `gen_ai.choice` event (`{"index", "message", "event.name"}`, as pydantic-ai
      logs it) holds its message under `message`.
    """
    if not isinstance(message, dict):
        return message
    if "role" not in message and isinstance(message.get("message"), dict) and (
            "index" in message or message.get("event.name") == "gen_ai.choice"):
        message = message["message"]
    calls = _calls_in_text(message)
    if calls is not None:
        return {"role": "assistant", "content": None, "tool_calls": calls}
    role = message.get("role")
    if (isinstance(role, str) and role.lower() not in _KNOWN_ROLES
            and not message.get("tool_call_id")):
        call = next((c for c in _unanswered(before) if c["function"]["name"] == role), None)
        if call is not None:
            message = {**message, "role": "tool", "tool_call_id": call["id"]}
    for key in ("parts", "content"):
        parts = message.get(key)
        if isinstance(parts, list) and any(isinstance(p, dict) and p.get("type") == _MEAI_REASONING
                                           for p in parts):
            kept = []
            for part in parts:
                if isinstance(part, dict) and part.get("type") == _MEAI_REASONING:
                    body = part.get("content")
                    text = body.get("text") if isinstance(body, dict) else body
                    if isinstance(text, str) and text.strip():
                        kept.append({"type": "reasoning", "text": text})
                    continue
                kept.append(part)
            message = {**message, key: kept}
    return message


def _calls_in_text(message: dict) -> list[dict] | None:
    """The OpenAI tool calls a Koog message holds as JSON text in its content, or None."""
    content = message.get("content")
    if (message.get("role") not in ("assistant", "tool") or message.get("tool_calls")
            or message.get("tool_call_id") or not isinstance(content, str)
            or not content.startswith("[{")):
        return None
    try:
        calls = json.loads(content)
    except json.JSONDecodeError:
        return None
    if all(isinstance(c, dict) and c.get("type") == "function" and isinstance(
            c.get("function"), dict) and isinstance(c["function"].get("name"), str)
           and "arguments" in c["function"] for c in calls):
        return calls
    return None


def _unanswered(messages: list[dict]) -> list[dict]:
    """The tool calls of the latest assistant message that no tool result answers yet."""
    pending: list[dict] = []
    for message in messages:
        if message.get("tool_calls"):
            pending = list(message["tool_calls"])
        elif message["role"] == "tool" and pending:
            answered = message.get("tool_call_id")
            pending = ([c for c in pending if c["id"] != answered] if answered
                       else pending[1:])
    return pending


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
        if value and all(isinstance(item, dict) and "toolCallId" in item and "toolName" in item
                         for item in value):
            # the Vercel AI SDK's tool calls (ai.response.toolCalls): one reply that calls tools
            return [{"role": "assistant", "content": None, "tool_calls": [
                tool_call(item["toolCallId"], item["toolName"],
                          item.get("input", item.get("args")), f"{where} output[{i}]")
                for i, item in enumerate(value)]}]
        return [m for i, item in enumerate(value)
                for m in chat_messages(_framework_message(item, []), f"{where} output[{i}]")]
    if not isinstance(value, dict):
        raise BadRecord(f"{where}: output is a JSON {type(value).__name__}, not a message")
    value = _framework_message(value, [])
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
