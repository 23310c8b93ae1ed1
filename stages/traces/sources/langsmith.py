"""LangSmith runs exports mapped onto the normalized trace form.

Reads LangSmith's run records, one JSON object per run, as `Client.list_runs`, the runs API or a
bulk export write them. Runs are grouped by `trace_id`; the conversation comes from the `llm`
runs (LangChain or OpenAI message shapes) in `start_time` order, joined by prefix matching; tools,
model, token usage, the root's error, `feedback_stats` and the thread id fill the rest of the
normalized trace. Writes nothing: ingest calls it.

Details: docs/traces.md, "Reading LangSmith runs exports (stages/traces/sources/langsmith.py)".
"""

from __future__ import annotations

from typing import Any

from stages.traces.schema import BadRecord, attempt, first_error
from stages.traces.sources.messages import (
    Call,
    chat_messages,
    epoch,
    iso_time,
    make_trace,
    token_counts,
    tool_schema,
)

NAME = "langsmith"
# what to change when a run does not have the shape this reader maps (a quarantine's fix)
FIX = ("drop in the runs as LangSmith's Client.list_runs or a bulk export writes them, unchanged, "
       "one run a line")
_ONE_PROMPT = "a batch is no conversation: call the model with one prompt a run to learn from it"


def detect(record: dict) -> bool:
    """True for a LangSmith run (it has a `run_type` and the run's inputs or trace id)."""
    return (isinstance(record, dict) and isinstance(record.get("run_type"), str)
            and any(k in record for k in ("inputs", "trace_id", "dotted_order")))


def parse(records: list[dict]) -> list[dict]:
    """All runs of a file to normalized traces, one per trace id, in order of first run.

    Raises BadRecord, naming the trace and run, when a trace cannot be mapped.
    """
    return first_error(parse_each(records))


def parse_each(records: list[dict]) -> list[tuple[str, dict | Exception]]:
    """(trace id, its normalized trace or the error that kept it from being read) for each
    trace of a file, in order of first run: one bad trace does not sink the others.

    Raises BadRecord for a record that is not a run or whose trace cannot be told. A run tree
    (`read_run(load_child_runs=True)`, a `RunTree`: children nested in `child_runs`) counts as
    its runs one after the other.
    """
    records = list(_flat(records))
    for n, record in enumerate(records, 1):
        if not detect(record):
            keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else ""
            raise BadRecord(f"record {n} is not a LangSmith run (no run_type"
                            + (f"; keys: {keys})" if keys else ")"))
    by_id = {str(r["id"]): r for r in records if r.get("id") is not None}
    groups: dict[str, list[dict]] = {}
    for n, run in enumerate(records, 1):
        groups.setdefault(_trace_id(run, by_id, n), []).append(run)
    return [(trace_id, attempt(_trace, trace_id, runs)) for trace_id, runs in groups.items()]


def _flat(records: list):
    """Each run, then the runs nested in its `child_runs` (depth first), without that key."""
    for record in records:
        children = record.get("child_runs") if isinstance(record, dict) else None
        if isinstance(children, list) and children:
            yield {k: v for k, v in record.items() if k != "child_runs"}
            yield from _flat(children)
        else:
            yield record


def _trace_id(run: dict, by_id: dict[str, dict], n: int) -> str:
    if run.get("trace_id"):
        return str(run["trace_id"])
    current, seen = run, set()
    while current.get("parent_run_id") is not None:  # older exports: climb to the root run
        parent = str(current["parent_run_id"])
        if parent not in by_id or parent in seen:
            raise BadRecord(f"record {n}: run {run.get('id')} has no trace_id and its root run "
                            f"is not in the file", fix="export the runs with their trace_id "
                            "(Client.list_runs writes it), or with their root run in the same "
                            "file")
        seen.add(parent)
        current = by_id[parent]
    if current.get("id") is None:
        raise BadRecord(f"record {n}: run has neither a trace_id nor an id")
    return str(current["id"])


def _trace(trace_id: str, runs: list[dict]) -> dict:
    where = f"trace {trace_id}"
    llm_runs = [r for r in runs if r.get("run_type") == "llm"]
    if not llm_runs:
        kinds = ", ".join(sorted({str(r.get("run_type")) for r in runs}))
        raise BadRecord(f"{where}: no llm run among its {len(runs)} run(s) ({kinds})",
                        fix="export every run of the trace (Client.list_runs(trace_id=...)), not "
                        "only its root; if they are there, trace the model calls as llm runs "
                        "(langsmith.wrappers.wrap_openai, or @traceable(run_type=\"llm\"))")
    calls = [_call(r, f"{where}: run {r.get('id')}") for r in llm_runs]
    ids = {str(r.get("id")) for r in runs}
    ordered = sorted(runs, key=lambda r: _start(r, where))
    roots = [r for r in ordered if r.get("parent_run_id") is None
             or str(r["parent_run_id"]) not in ids]
    feedback: dict[str, Any] = {}
    scores: dict[str, Any] = {}
    root_ids = {id(r) for r in roots}
    for run in [r for r in ordered if id(r) not in root_ids] + roots:  # the roots' feedback wins
        for key, stats in (run.get("feedback_stats") or {}).items():
            value = _feedback_value(stats)
            if value is not None:
                scores[str(key)] = value
    if scores:
        feedback["scores"] = scores
    error = next((r for r in roots if r.get("error")), None)
    if error is not None:
        # The error field holds the whole traceback; its first line names the exception.
        first = str(error["error"]).strip().splitlines()[0]
        feedback["error"] = f"{error['name']}: {first}" if error.get("name") else first
    thread = next((t for t in (_thread_id(r) for r in roots + ordered) if t is not None), None)
    return make_trace(trace_id, calls, created_at=iso_time(ordered[0].get("start_time")),
                      feedback=feedback, where=where, conversation_id=thread)


def _thread_id(run: dict) -> str | None:
    """The thread id in a run's metadata (LangSmith's keys for it, in its order), or None."""
    extra = run.get("extra") if isinstance(run.get("extra"), dict) else {}
    metadata = extra.get("metadata") if isinstance(extra.get("metadata"), dict) else {}
    for key in ("thread_id", "session_id", "conversation_id"):
        if metadata.get(key) not in (None, ""):
            return str(metadata[key])
    return None


def _start(run: dict, where: str) -> tuple[bool, float, str]:
    seconds = epoch(run.get("start_time"), f"{where}: run {run.get('id')}")
    return seconds is None, seconds or 0.0, str(run.get("dotted_order") or "")


def _feedback_value(stats: Any) -> Any:
    if not isinstance(stats, dict):
        return stats
    if stats.get("avg") is not None:
        return stats["avg"]
    values = stats.get("values")
    if isinstance(values, dict) and values:
        return next(iter(values)) if len(values) == 1 else values
    return None


def _call(run: dict, where: str) -> Call:
    inputs = run.get("inputs") if isinstance(run.get("inputs"), dict) else {}
    outputs = run.get("outputs") if isinstance(run.get("outputs"), dict) else {}
    extra = run.get("extra") if isinstance(run.get("extra"), dict) else {}
    params = extra.get("invocation_params") if isinstance(extra.get("invocation_params"),
                                                          dict) else {}
    metadata = extra.get("metadata") if isinstance(extra.get("metadata"), dict) else {}
    llm_output = outputs.get("llm_output") if isinstance(outputs.get("llm_output"), dict) else {}
    output = _outputs(outputs, where)
    tools = []
    for key, source in (("tools", params), ("tools", inputs), ("functions", params),
                        ("functions", inputs)):
        if source.get(key):
            for i, schema in enumerate(source[key]):
                found = tool_schema(schema, f"{where} {key}[{i}]")
                if found:
                    tools.append(found)
            break
    generation = _first_generation(outputs)
    message = _fields(generation.get("message")) if generation else {}
    response_metadata = message.get("response_metadata") or {}
    model = (llm_output.get("model_name") or outputs.get("model")
             or response_metadata.get("model_name") or params.get("model")
             or params.get("model_name") or metadata.get("ls_model_name"))
    tokens = (token_counts(llm_output.get("token_usage") or llm_output.get("usage")),
              (_int_or_none(run.get("prompt_tokens")), _int_or_none(run.get("completion_tokens"))),
              token_counts(outputs.get("usage")), token_counts(message.get("usage_metadata")))
    input_tokens, output_tokens = next((t for t in tokens if t != (None, None)), (None, None))
    return Call(start=epoch(run.get("start_time"), where),
                input=_inputs(inputs, where), output=output, tools=tools,
                model=str(model) if model else None, input_tokens=input_tokens,
                output_tokens=output_tokens)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _fields(message: Any) -> dict:
    """The fields of a message in any of its shapes (serialized, `data`, flat)."""
    if not isinstance(message, dict):
        return {}
    for key in ("kwargs", "data"):
        if isinstance(message.get(key), dict):
            return message[key]
    return message


def _inputs(inputs: dict, where: str) -> list[dict]:
    messages = inputs.get("messages")
    if messages is None and isinstance(inputs.get("prompts"), list):  # a completion-style LLM
        prompts = inputs["prompts"]
        if len(prompts) != 1:
            raise BadRecord(f"{where}: inputs.prompts holds {len(prompts)} prompts; only "
                            f"single-prompt runs map to one conversation", fix=_ONE_PROMPT)
        return [{"role": "user", "content": str(prompts[0])}]
    if not isinstance(messages, list):
        raise BadRecord(f"{where}: an llm run whose inputs have no 'messages' list "
                        f"(keys: {', '.join(sorted(inputs)[:8]) or 'none'})")
    if messages and isinstance(messages[0], list):  # LangChain: one message list per prompt
        if len(messages) != 1:
            raise BadRecord(f"{where}: inputs.messages holds a batch of {len(messages)} "
                            f"prompts; only single-prompt runs map to one conversation",
                            fix=_ONE_PROMPT)
        messages = messages[0]
    return [m for i, item in enumerate(messages)
            for m in chat_messages(item, f"{where} inputs.messages[{i}]")]


def _first_generation(outputs: dict) -> dict | None:
    generations = outputs.get("generations")
    if not isinstance(generations, list) or not generations:
        return None
    first = generations[0]
    if isinstance(first, list):  # one list of candidates per prompt of the batch
        first = first[0] if first else None
    return first if isinstance(first, dict) else None


def _outputs(outputs: dict, where: str) -> list[dict]:
    if not outputs:
        return []  # the run failed before answering, or outputs were not recorded
    if "generations" in outputs:
        generation = _first_generation(outputs)
        if generation is None:
            return []
        if isinstance(generation.get("message"), dict):
            return chat_messages(generation["message"],
                                 f"{where} outputs.generations[0][0].message")
        return [{"role": "assistant", "content": str(generation.get("text") or "")}]
    if isinstance(outputs.get("choices"), list) and outputs["choices"]:  # an OpenAI response
        choice = outputs["choices"][0]
        if isinstance(choice, dict) and isinstance(choice.get("message"), dict):
            return chat_messages(choice["message"], f"{where} outputs.choices[0].message")
        if isinstance(choice, dict) and "text" in choice:
            return [{"role": "assistant", "content": str(choice["text"])}]
        raise BadRecord(f"{where}: outputs.choices[0] has no message")
    if isinstance(outputs.get("messages"), list):
        return [m for i, item in enumerate(outputs["messages"])
                for m in chat_messages(item, f"{where} outputs.messages[{i}]")]
    if isinstance(outputs.get("message"), dict):
        return chat_messages(outputs["message"], f"{where} outputs.message")
    if "role" in outputs or "lc" in outputs:
        return chat_messages(outputs, f"{where} outputs")
    if isinstance(outputs.get("output"), str):
        return [{"role": "assistant", "content": outputs["output"]}]
    if isinstance(outputs.get("output"), dict):
        return chat_messages(outputs["output"], f"{where} outputs.output")
    raise BadRecord(f"{where}: outputs have no generations, choices or messages "
                    f"(keys: {', '.join(sorted(outputs)[:8])})")
