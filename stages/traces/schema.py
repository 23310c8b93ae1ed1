"""The one trace schema every source format maps onto.

Each reader in `stages/traces/sources/` turns its format into a normalized trace (a dict: `trace_id`,
`model`, `created_at`, `messages` as OpenAI chat messages, `tools`, `feedback`, `usage`);
`make_row` scrubs it, hashes it and flattens it into one Parquet row of this schema (nested parts
as JSON strings): `trace_id`, `source_file`, `source_line`, `format`, `content_hash` (the
duplicate key), `model`, `created_at`, `conversation_id`, `messages`, `tools`, `feedback`,
`usage`, `user_text`, `n_messages`, `n_tool_calls`, `thumbs_up`. Reads and writes no file.

Details: docs/traces.md, "The normalized trace schema (stages/traces/schema.py)".
"""

from __future__ import annotations

import hashlib
import json
import re

import pyarrow as pa

from stages.traces.pii import maybe_pii

SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("source_file", pa.string()), ("source_line", pa.int64()),
    ("format", pa.string()), ("content_hash", pa.string()), ("model", pa.string()),
    ("created_at", pa.string()), ("conversation_id", pa.string()), ("messages", pa.string()),
    ("tools", pa.string()),
    ("feedback", pa.string()), ("usage", pa.string()), ("user_text", pa.string()),
    ("n_messages", pa.int64()),
    ("n_tool_calls", pa.int64()), ("thumbs_up", pa.bool_()),
])


class BadRecord(ValueError):
    """A record that cannot become a trace; the message is the quarantine reason, `fix` what to
    change where the reader knows it (else ingest gives the format's own, its reader's `FIX`).
    Ingest adds the file, the line or trace id, and the fix (stages/ingest.quarantine_reason).
    """

    def __init__(self, message: str, fix: str | None = None):
        """A refusal for `message`; `fix`: what to change so that such a record is read."""
        super().__init__(message)
        self.fix = fix


class NoContent(BadRecord):
    """A trace whose model calls recorded no messages, or no user turn, or a placeholder in place
    of a message (`placeholder_problem`): the instrumentation does not capture the content (or
    the log holds only the answer). The fix is the setting that records it: the reader's where it
    knows the instrumentation, else the format's content-capture switch, `CAPTURE[format]`.
    """


# The fixes readers of several formats give (a quarantine's "to fix").
TEXT_ONLY = ("nothing in the export: offseason learns from text and function-tool turns only, so "
             "a trace with this content stays out (leave it quarantined, or take it out of the "
             "inbox)")
ROLES = ("log the messages with the roles system, developer, user, assistant and tool (map the "
         "agent's own role names onto them where it logs them)")
TOOL_TURNS = ("log the whole conversation of each model call: every tool result after the "
              "assistant message that made its call, with that call's id")

# What to change when a format's traces come without their messages: each tool's own switch.
CAPTURE = {
    "otel-genai": "turn the instrumentation's content capture on: "
                  "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true for OpenTelemetry's "
                  "(SPAN_ONLY, or EVENT_ONLY with its log records exported too, under the "
                  "current conventions); for Semantic Kernel "
                  "SEMANTICKERNEL_EXPERIMENTAL_GENAI_ENABLE_OTEL_DIAGNOSTICS_SENSITIVE=true",
    "openinference": "let the instrumentation record messages: unset OPENINFERENCE_HIDE_INPUTS, "
                     "OPENINFERENCE_HIDE_OUTPUTS, OPENINFERENCE_HIDE_INPUT_MESSAGES and "
                     "OPENINFERENCE_HIDE_OUTPUT_MESSAGES (TraceConfig's hide_* fields)",
    "langfuse": "record the generations' input and output (no `mask` that empties them; "
                "@observe with capture_input and capture_output on)",
    "langsmith": "let LangSmith record inputs and outputs: unset LANGSMITH_HIDE_INPUTS and "
                 "LANGSMITH_HIDE_OUTPUTS (Client's hide_inputs / hide_outputs)",
    "openai-responses": "a Responses object as the SDK returns it carries no `input`: log the "
                        "request's `input` beside it",
    "openai-chat": "log the request's `messages`, the user's turn included, on each line",
}


# What instrumentations write in place of a message's content they did not record (content
# capture off, hidden, masked or scrubbed), as patterns, each with the setting that records the
# content instead; read from each tool's own source, named beside it. A message whose whole text
# is such placeholders is no text to learn from (`placeholder_problem`).
PLACEHOLDERS = {
    # google/adk-python src/google/adk/telemetry/_stable_semconv.py (USER_CONTENT_ELIDED) and
    # open-telemetry/opentelemetry-python-contrib instrumentation-genai/opentelemetry-
    # instrumentation-google-genai/src/opentelemetry/instrumentation/google_genai/
    # generate_content.py (_CONTENT_ELIDED): the content of each gen_ai.system.message /
    # gen_ai.user.message / gen_ai.choice log event while capture is off, their default
    r"<elided>": "record the messages: Google ADK and opentelemetry-instrumentation-google-genai "
                 "write <elided> for each one while content capture is off; set "
                 "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY and "
                 "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental where the agent runs",
    # Arize-ai/openinference python/openinference-instrumentation/src/openinference/
    # instrumentation/config.py (REDACTED_VALUE, TraceConfig.mask): each message's text under
    # hide_input_text / hide_output_text (hide_inputs / hide_outputs drop the messages instead)
    r"__REDACTED__": "let OpenInference record message text: unset "
                     "OPENINFERENCE_HIDE_INPUT_TEXT and OPENINFERENCE_HIDE_OUTPUT_TEXT "
                     "(TraceConfig's hide_input_text / hide_output_text) where the app runs",
    # langfuse/langfuse-python langfuse/_client/constants.py (MASK_FALLBACK_VALUE): the whole
    # input or output when the client's `mask` function raised (langfuse/_client/span.py)
    r"<fully masked due to failed mask function>":
        "fix the Langfuse client's `mask` function: it raised, so the SDK wrote this in place "
        "of the whole input and output (offseason scrubs personal data itself at ingest)",
    # pydantic/logfire logfire/_internal/scrubbing.py (BaseScrubber._redact): a value that
    # mentions a sensitive word (password, secret, auth, session, cookie, api key, ...) whole
    r"\[Scrubbed due to '[^'\n]{1,80}'\]":
        "keep the messages out of Logfire's scrubbing: logfire.configure(scrubbing="
        "logfire.ScrubbingOptions(callback=...)) returning the message values, or "
        "scrubbing=False (offseason scrubs personal data and secrets itself at ingest)",
}
_MARKER = re.compile("|".join(PLACEHOLDERS))
_PLACEHOLDER = re.compile(r"\s*(?:(?:" + _MARKER.pattern + r")\s*)+")  # only placeholders


def placeholder_problem(messages: list[dict]) -> tuple[str, str] | None:
    """(what is wrong, what to change) when a message's whole text is placeholders, what an
    instrumentation writes in place of content it did not record (`PLACEHOLDERS`); None if
    none is. One such message is enough: a conversation with a hole is not what production
    saw, and learning from it would teach the placeholder. Text that only mentions one
    ("... shows <elided> where ...") is text.
    """
    found = []
    for message in messages:
        content = message.get("content")
        text = content if isinstance(content, str) else _text(content) if content else ""
        if text and _PLACEHOLDER.fullmatch(text):
            found.append(text)
    if not found:
        return None
    marker = _MARKER.search(found[0]).group(0)
    fix = next(fix for pattern, fix in PLACEHOLDERS.items() if re.fullmatch(pattern, marker))
    return (f"{len(found)} of {len(messages)} messages hold only {marker!r}, what an "
            f"instrumentation writes in place of content it did not record"), fix


# What a reader raises on a record shaped in a way it did not foresee: quarantined, never a crash.
READER_ERRORS = (BadRecord, ValueError, TypeError, KeyError, AttributeError, IndexError)


def attempt(read, *args) -> dict | Exception:
    """`read(*args)` (one trace), or the error that kept it from being read: the readers'
    `parse_each` read each trace on its own, so one bad trace does not sink the others.
    """
    try:
        return read(*args)
    except READER_ERRORS as err:
        return err


def first_error(results: list[tuple[str, dict | Exception]]) -> list[dict]:
    """The traces of a reader's `parse_each`, or its first error raised (the strict `parse`)."""
    for _, result in results:
        if isinstance(result, Exception):
            raise result
    return [result for _, result in results]


_IDS = re.compile(r'"(?:id|tool_call_id)": "(?:[^"\\]|\\.)*"(?:, )?')
_SPACE = re.compile(r"(?:\s|\\[nrt])+")


def content_hash(messages_json: str) -> str:
    """Key for duplicates: the serialized messages (keys sorted) with call ids left out and runs
    of whitespace collapsed, so a re-sent trace whose ids were regenerated counts as the same.
    """
    canonical = _IDS.sub("", messages_json) if '"id": "' in messages_json or \
        '"tool_call_id": "' in messages_json else messages_json
    # the regex only where it changes something (it tries at every space: 18 us of a 22 us hash,
    # a sixth of ingest): in printable ASCII that is a double space or an escaped \n, \r, \t
    if ("  " in canonical or "\\" in canonical or "\t" in canonical) and (
            "  " in canonical or "\\n" in canonical or "\\r" in canonical or "\\t" in canonical
            or not (canonical.isascii() and canonical.isprintable())):
        canonical = _SPACE.sub(" ", canonical)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _dump(value, sort: bool = False) -> str:
    # stored as logged: a chat template renders tools and object arguments with `tojson` in their
    # keys' order, so a re-sorted schema is a prompt production never saw; sorted only for the hash
    return (_SORTED if sort else _LOGGED).encode(value)


# built once: `json.dumps` with any argument builds an encoder a call (5 calls a trace)
_LOGGED, _SORTED = json.JSONEncoder(ensure_ascii=False), json.JSONEncoder(ensure_ascii=False, sort_keys=True)


FEEDBACK_KEYS = ("thumbs_up", "scores", "error")  # what the reward and train stages read


def feedback_problem(feedback) -> tuple[str, str] | None:
    """(kind, what) when a trace's `feedback` holds something but no rating the reward and train
    stages read (`thumbs_up` true or false, or a score in [0, 1] or a boolean); None for none at
    all, a readable rating, or only an `error`. The trace is accepted either way: ingest counts
    these and says so, rather than learning from them as unrated in silence.
    """
    if feedback is None or feedback == {}:
        return None
    if not isinstance(feedback, dict):
        kind = {str: "a string", list: "an array", bool: "a boolean"}.get(type(feedback), "a number")
        return "not an object", f"feedback is {kind} ({_short(feedback)}), not an object"
    thumbs, scores = feedback.get("thumbs_up"), feedback.get("scores")
    if thumbs is not None and not isinstance(thumbs, bool):
        return "thumbs_up not true or false", f"thumbs_up is {_short(thumbs)}, not true or false"
    if scores is not None and not isinstance(scores, dict):
        return "scores not an object", f"scores is {_short(scores)}, not an object of name: value"
    scores = scores or {}
    if isinstance(thumbs, bool) or any(
            isinstance(v, bool) or (isinstance(v, (int, float)) and 0 <= v <= 1)
            for v in scores.values()):
        return None
    unknown = [key for key in feedback if key not in FEEDBACK_KEYS]
    if unknown:
        return "keys not read", f"feedback has {', '.join(map(repr, unknown))}, which no stage reads"
    for name, value in scores.items():
        if isinstance(value, (int, float)):
            return "score outside [0, 1]", f"scores.{name} is {_short(value)}, outside [0, 1]"
        return "score not a number", f"scores.{name} is {_short(value)}, not a number or boolean"
    return None


# an id or a time of the usual shapes: a word, then digits, hex and dashes (`bench-00000001`,
# `call_12`, a UUID, a hex trace id), or an ISO time: none holds an address or a key
_PLAIN_ID = re.compile(r"[A-Za-z]{0,16}[\-_:.]?[0-9a-fA-F\-]{1,64}|[0-9T:.\-+Z /]{4,40}")
# a usage record of names and whole numbers: `{"prompt_tokens": 12, "total_tokens": 40}`
_PLAIN_USAGE = re.compile(r'\{(?:"[a-z_]{1,40}": (?:\d{1,7}|\{[^{}"]*(?:"[a-z_]{1,40}": \d{1,7}(?:, )?)*\})'
                          r'(?:, )?)*\}')


def _may_name(value: str) -> bool:
    """True if an id or a time may hold personal data: not of a usual shape, and past the gate."""
    return _PLAIN_ID.fullmatch(value) is None and maybe_pii(value)


def id_holds_pii(trace_id: str, scrubber=None) -> bool:
    """True if ingest replaces this trace id by the trace's `<file>:<line>` (it holds personal
    data); `scrubber` counts what it finds (a fresh one of every kind when None). `make_row`
    decides by it, and `offseason lineage --trace` explains a lookup that finds nothing by it.
    """
    if not _may_name(trace_id):
        return False
    if scrubber is None:
        from stages.traces.pii import KINDS, Scrubber
        scrubber = Scrubber(set(KINDS))
    return scrubber.text(trace_id) != trace_id


def _text(content) -> str:
    """A message's content as text: a list of parts (`[{"type": "text", "text": ...}]`, images
    too) is its text parts joined, not the list's Python repr.
    """
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return str(content or "")


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def make_row(trace: dict, source_file: str, source_line: int, fmt: str, scrubber) -> dict:
    """A normalized trace as one row of SCHEMA, every string scrubbed by `scrubber` first."""
    if not trace["messages"]:
        raise NoContent("the trace has no messages")
    problem = placeholder_problem(trace["messages"])
    if problem is not None:  # a reader that knows the instrumentation refused it with its setting
        raise NoContent(problem[0], fix=problem[1])
    feedback = trace.get("feedback")  # a source may pass on what is no object (`feedback_problem`)
    parts = {"messages": trace["messages"], "tools": trace.get("tools") or [],
             "feedback": feedback if isinstance(feedback, dict) else {}}
    # the strings not remembered as cleared (a trace's system prompt, tool schemas and keys are
    # the last trace's) tested together, and the walk only where that finds something: a third
    # of the time of testing the whole serialized trace, and less the longer the prompts
    parts = {key: value if scrubber.clean(value) else scrubber.walk(value)
             for key, value in parts.items()}
    text = {key: _dump(value) for key, value in parts.items()}
    messages, feedback = parts["messages"], parts["feedback"]
    thumbs = feedback.get("thumbs_up")
    user_text = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), None)
    if user_text is None:  # a conversation with no request is no task to learn from
        raise NoContent(f"no user turn in the trace ({len(messages)} messages, roles "
                        f"{sorted({str(m.get('role')) for m in messages})})")
    # the trace's other strings too: an id or usage record may name its user (`ann@corp.com`).
    # Ids and times of the usual shapes (`bench-00000001`, a UUID, `2026-11-30T12:00:00Z`) and a
    # usage record of numbers are let through untested: testing them cost a tenth of ingest
    trace_id, conversation_id, model, usage, created_at = (trace.get(key) for key in (
        "trace_id", "conversation_id", "model", "usage", "created_at"))
    if trace_id is not None and id_holds_pii(str(trace_id), scrubber):
        trace_id = None  # an id that held PII: the file and line name the trace instead
    conversation_id, model, created_at = (
        scrubber.text(value) if isinstance(value, str) and _may_name(value) else value
        for value in (conversation_id, model, created_at))
    usage = usage or {}
    dumped = json.dumps(usage)
    if not _PLAIN_USAGE.fullmatch(dumped) and maybe_pii(dumped):
        dumped = json.dumps(scrubber.walk(usage))
    return {
        "trace_id": str(trace_id) if trace_id is not None else f"{source_file}:{source_line}",
        "source_file": source_file,
        "source_line": source_line,
        "format": fmt,
        "content_hash": content_hash(_dump(messages, sort=True)),
        "model": model,
        "created_at": created_at,
        "conversation_id": conversation_id,
        "messages": text["messages"],
        "tools": text["tools"],
        "feedback": text["feedback"],
        "usage": dumped,
        "user_text": user_text,
        "n_messages": len(messages),
        "n_tool_calls": sum(len(m.get("tool_calls") or []) for m in messages),
        "thumbs_up": thumbs if isinstance(thumbs, bool) else None,
    }
