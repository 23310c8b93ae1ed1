"""Tool-call tasks: the agent must call the right tool with arguments its JSON schema accepts.

An environment on the contract (stages/envs/contract.py): `environments: {toolcall: {module:
stages.envs.toolcall, tasks: data/tasks/toolcall.jsonl, benchmark: data/benchmarks/toolcall.jsonl}}`.
Reads task lines that carry their own `tools` and `expected` (`{"name", "arguments"}`, arguments
may be null), and tasks from traces whose assistant called an offered tool (`task_from_trace`);
writes nothing. The last call is judged; `reward`'s components are `format`, `tool_ok`,
`right_tool`, `arguments_valid` and `correct`. Pure Python (jsonschema, no torch).

Details: docs/environments.md, "How tool-call tasks are scored (stages/envs/toolcall.py)".
"""

from __future__ import annotations

import json

import jsonschema
import referencing.exceptions

from stages.envs.errors import VerifierError

VERSION = "json-schema@1"
MAX_TURNS = 2  # one call and one retry after an error
TOOLS: list[dict] = []  # each task offers its own: the task line's `tools`


def _task(tools, expected) -> tuple[dict, dict] | None:
    """({tool name: parameters schema}, expected call) of a task; None if unusable."""
    if not isinstance(tools, list):
        return None
    schemas = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return None
        schema = function.get("parameters", {"type": "object"})
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError:
            return None
        schemas[function["name"]] = schema
    if not isinstance(expected, dict) or expected.get("name") not in schemas:
        return None
    if expected.get("arguments") is not None and not isinstance(expected["arguments"], dict):
        return None
    return schemas, {"name": expected["name"], "arguments": expected.get("arguments")}


def _valid(schema: dict, arguments: dict, name: str) -> bool:
    try:
        errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments))
    except referencing.exceptions.Unresolvable as err:
        raise VerifierError(f"the schema of tool {name!r} has a $ref that cannot be resolved "
                            f"here: {err}") from err
    return not errors


def _judge(schemas: dict, expected: dict, calls: list[dict | None], broken: bool
           ) -> dict[str, float]:
    """The components for the calls made (None: arguments that are not a JSON object);
    `broken`: a tool message answered no call the assistant made (a malformed call).
    """
    well_formed = bool(calls) and not broken and all(c is not None for c in calls)
    tool_ok = not broken and all(
        c is not None and c["name"] in schemas and _valid(schemas[c["name"]], c["arguments"],
                                                          c["name"]) for c in calls)
    last = calls[-1] if calls else None
    right_tool = last is not None and last["name"] == expected["name"]
    arguments_valid = right_tool and _valid(schemas[last["name"]], last["arguments"],
                                            last["name"])
    if expected["arguments"] is None:
        correct = arguments_valid
    else:
        correct = right_tool and last["arguments"] == expected["arguments"]
    return {"correct": float(correct), "format": float(well_formed), "tool_ok": float(tool_ok),
            "right_tool": float(right_tool), "arguments_valid": float(arguments_valid)}


def example(schema: dict):
    """A small value the schema accepts, for tasks whose expected arguments are null (simple
    schemas only: a gold that fails its own schema sets the task aside, as it should).
    """
    if "const" in schema:
        return schema["const"]
    if schema.get("examples"):  # JSON Schema's own keyword for sample values
        return schema["examples"][0]
    if "default" in schema:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "object")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        properties = schema.get("properties", {})
        return {key: example(properties.get(key, {})) for key in schema.get("required", [])}
    if kind == "array":
        return [example(schema.get("items", {})) for _ in range(schema.get("minItems", 0))]
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return "x" * max(1, schema.get("minLength", 1))


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def call_tool(task: dict, name: str, arguments: dict) -> str:
    """The reply to an accepted call (the contract already checked the name and the arguments
    against the task's schema; a refused call reaches the model as an error instead).
    """
    return json.dumps({"ok": True})


def _calls(task: dict, messages: list[dict]) -> tuple[list[dict | None], bool]:
    """The assistant's calls after the task's messages (None: arguments that are not a JSON
    object), and whether some call was malformed: a tool message answering no call it made.
    """
    calls, ids = [], set()
    for message in messages[len(task["messages"]):]:
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                ids.add(call.get("id"))
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        arguments = None
                calls.append({"name": function.get("name"), "arguments": arguments}
                             if isinstance(arguments, dict) else None)
    malformed = any(m.get("role") == "tool" and m.get("tool_call_id") not in ids
                    for m in messages[len(task["messages"]):])
    return calls, malformed


def reward(task: dict, messages: list[dict]) -> dict[str, float] | None:
    """The components (module docstring) for a conversation: the last call is judged; None when
    the task cannot be judged (no usable `tools`/`expected`).
    """
    judged = _task(task.get("tools"), task.get("expected"))
    if judged is None:
        return None
    schemas, expected = judged
    calls, malformed = _calls(task, messages)
    return _judge(schemas, expected, calls, broken=malformed)


def gold(task: dict) -> list[dict]:
    """The expected call (arguments made up from the schema when none are expected), its reply
    and a short final answer.
    """
    schemas, expected = _task(task.get("tools"), task.get("expected"))
    arguments = expected["arguments"]
    if arguments is None:
        arguments = example(schemas[expected["name"]])
    call = {"id": "call_0", "type": "function",
            "function": {"name": expected["name"], "arguments": json.dumps(arguments)}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"ok": True})},
            {"role": "assistant", "content": "Done."}]


def task_from_trace(messages: list[dict], tools: list | None) -> dict | None:
    """The task behind a trace whose assistant called one of its offered `tools`: the messages
    before the assistant's first turn, all the offered tools (the model must pick the right one),
    and the tool it called first expected with `arguments: null` (judged by its schema; a logged
    call's arguments are not known to be right). None otherwise.
    """
    question = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    call = next((c for m in messages if m.get("role") == "assistant"
                 for c in m.get("tool_calls") or []), None)
    if not question.strip() or call is None or not tools:
        return None
    name = (call.get("function") or {}).get("name")
    offered = [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    expected = {"name": name, "arguments": None}
    if _task([t for t in offered if t["function"].get("name") == name], expected) is None:
        return None
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    return {"messages": [m for m in messages[:first] if m.get("role") in ("system", "user")],
            "tools": offered, "expected": expected}
