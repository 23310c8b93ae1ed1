"""Tool-call tasks: the agent must call the right tool with arguments its JSON schema accepts.

A task's `question` is the user's request; its `answer` is JSON:

    {"tools": [<OpenAI tool schemas: {"type": "function", "function": {"name", "parameters"}}>],
     "expected": {"name": "get_weather", "arguments": {"city": "Paris"}}}

`expected.arguments` may be null: then any arguments the tool's schema accepts are right.

The protocol, in the model's own text (each tag is one token of the demo tokenizer):

    User: What's the weather in Paris? Assistant:<tool_call>{"name": "get_weather",
    "arguments": {"city": "Paris"}}</tool_call><tool_response>{"ok": true}</tool_response>

The agent writes `<tool_call>JSON</tool_call>` with `name` and `arguments` (an object, or a JSON
string of one as OpenAI's API sends it); the environment answers `<tool_response>{"ok": true}`
or `{"error": ...}` when the call is not well-formed JSON, so the agent may try again (up to
MAX_TURNS calls). The last call is the one judged. Components of `score`:
- `format`: there is at least one call and every call is a JSON object with a string `name` and
  object `arguments`;
- `tool_ok`: every call names an offered tool and its arguments satisfy that tool's schema (what
  the tool's runtime would accept; checked with `jsonschema`);
- `right_tool`: the last call names the expected tool; `arguments_valid`: its arguments satisfy
  that tool's schema;
- `correct`: right tool and arguments equal to `expected.arguments` (JSON equality), or, when
  those are null, right tool and schema-valid arguments.
Unjudgeable (None): an answer that is not such JSON, an expected tool that is not offered, or a
tool schema that is not a valid JSON schema. A schema whose `$ref` cannot be resolved (there is no
network) raises VerifierError: the verifier broke, not the agent.

Tasks come from task suites (`data/tasks/toolcall.jsonl`, held out: `data/benchmarks/toolcall.jsonl`)
and from ingested traces whose assistant called a tool (`task_from_messages`, the trace's `tools`
giving the schemas). Pure Python (jsonschema, no torch).

On the environment contract (`stages.envs.contract`; params.yaml `environments:` with
`module: stages.envs.toolcall`), a chat model plays the same tasks with its native tool calls. Each
task line carries its own `tools` (the offered tools differ from task to task; TOOLS is empty) and
`expected`, beside the tag protocol's `question`/`answer`. The contract checks every call against
the task's schemas and shows a refused one to the model as a tool error; `call_tool` answers an
accepted one `{"ok": true}`. `reward` gives the components above for the conversation (a
malformed call is a tool message answering no call the assistant made), `gold` the expected call,
`task_from_trace` the task behind a trace that called one of its offered tools.
"""

from __future__ import annotations

import json
import re

import jsonschema
import referencing.exceptions

from stages.envs.errors import VerifierError

NAME = "toolcall"
VERSION = "json-schema@1"
MAX_TURNS = 2  # one call and one retry after an error
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOL_CLOSE = CALL_CLOSE
TAGS = [CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE]
CHARS = [chr(c) for c in range(32, 127)]  # printable ASCII: JSON of most calls
COMPONENTS = ("correct", "format", "tool_ok", "right_tool", "arguments_valid")

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE) + r"(?:"
                   + re.escape(RESPONSE_OPEN) + r".*?" + re.escape(RESPONSE_CLOSE) + r")?", re.S)


def prompt(question: str) -> str:
    """The prompt the model completes for a question."""
    return f"User: {question} Assistant:"


def parse_call(body: str) -> dict | None:
    """`{"name", "arguments"}` from a call's JSON text, or None if it is not a well-formed call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's API sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": call["name"], "arguments": arguments}


def on_tool_close(text: str) -> str:
    """The environment's reply to the call `text` ends with: ok, or why it is not a call."""
    body = text.rsplit(CALL_OPEN, 1)[-1].removesuffix(CALL_CLOSE) if CALL_OPEN in text else ""
    if parse_call(body) is None:
        reply = {"error": "not a JSON object with name and arguments"}
    else:
        reply = {"ok": True}
    return f"{RESPONSE_OPEN}{json.dumps(reply)}{RESPONSE_CLOSE}"


def _task(answer: str) -> tuple[dict, dict] | None:
    """({tool name: parameters schema}, expected call) from a task's answer; None if unusable."""
    try:
        data = json.loads(answer)
    except (TypeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        return None
    schemas = {}
    for tool in data["tools"]:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return None
        schema = function.get("parameters", {"type": "object"})
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError:
            return None
        schemas[function["name"]] = schema
    expected = data.get("expected")
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


def score(question: str, answer: str, completion: str) -> dict[str, float] | None:
    """The reward components (see the module docstring); None if the task cannot be judged."""
    task = _task(answer)
    if task is None:
        return None
    schemas, expected = task
    calls = [parse_call(match[1]) for match in _CALL.finditer(completion)]
    return _judge(schemas, expected, calls, broken=CALL_OPEN in _CALL.sub("", completion))


def _judge(schemas: dict, expected: dict, calls: list[dict | None], broken: bool
           ) -> dict[str, float]:
    """The components for the calls made (None: not a well-formed call); `broken`: a call that
    was never closed (tags) or answered no call the assistant made (chat).
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


def verify(question: str, answer: str, completion: str) -> float | None:
    """1.0 for the right tool with the right (or, if none are expected, schema-valid) arguments,
    0.0 otherwise, None if the task cannot be judged.
    """
    components = score(question, answer, completion)
    return None if components is None else components["correct"]


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


def gold_completion(question: str, answer: str) -> str:
    """The expected call (arguments made up from the schema when none are expected)."""
    task = _task(answer)
    if task is None:
        return ""
    schemas, expected = task
    arguments = expected["arguments"]
    if arguments is None:
        arguments = example(schemas[expected["name"]])
    call = json.dumps({"name": expected["name"], "arguments": arguments})
    return f"{CALL_OPEN}{call}{CALL_CLOSE}{on_tool_close(CALL_OPEN + call + CALL_CLOSE)}"


def offered_tools(answer: str) -> list[dict]:
    """The tool schemas a task offers, for backends that pass `tools=` to a chat server."""
    return json.loads(answer)["tools"]


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def task_from_messages(messages: list[dict], tools: list[dict] | None = None) -> dict | None:
    """The task behind a trace whose assistant called one of the offered `tools`, or None.

    The question is the first user message; the expected tool is the one the assistant called
    first, with `arguments: null` (judged by the schema): a logged call's arguments are not known
    to be right.
    """
    question = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    call = next((c for m in messages if m.get("role") == "assistant"
                 for c in m.get("tool_calls") or []), None)
    if not question.strip() or call is None or not tools:
        return None
    name = (call.get("function") or {}).get("name")
    offered = [t for t in tools if isinstance(t, dict)
               and isinstance(t.get("function"), dict) and t["function"].get("name") == name]
    if not offered:
        return None
    answer = json.dumps({"tools": offered, "expected": {"name": name, "arguments": None}})
    return {"question": question.strip(), "answer": answer} if _task(answer) else None


def messages_from_completion(user_text: str, completion: str, call_prefix: str) -> list[dict]:
    """An episode as OpenAI chat messages: user, assistant tool calls, tool replies, final text."""
    messages = [{"role": "user", "content": user_text}]
    pos = 0
    for i, match in enumerate(_CALL.finditer(completion)):
        call = parse_call(match[1])
        if call is None:
            continue
        call_id = f"{call_prefix}-{i}"
        reply = match[0][len(CALL_OPEN) + len(match[1]) + len(CALL_CLOSE):]
        messages.append({"role": "assistant", "content": completion[pos:match.start()] or None,
                         "tool_calls": [{"id": call_id, "type": "function", "function": {
                             "name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": reply.removeprefix(RESPONSE_OPEN).removesuffix(RESPONSE_CLOSE)})
        pos = match.end()
    if completion[pos:]:
        messages.append({"role": "assistant", "content": completion[pos:]})
    return messages


def completion_from_messages(messages: list[dict]) -> str | None:
    """None for now: a trace's own answer is not turned back into this environment's text, so its
    feedback gives no DPO pair (the train stage counts such traces as unusable).
    """
    return None


def task_kind(question: str) -> str:
    """The task kind for drift profiles: always `tool_call`."""
    return "tool_call"


def _no_demo(*args):
    raise NotImplementedError("the toolcall environment has no simulated traffic or warm start; "
                              "use it with ingested traces or data/tasks/toolcall.jsonl")


sample_question = mix_for_day = demonstration = _no_demo


# --- the environment contract: the environments: path --------------------------------------------

TOOLS: list[dict] = []  # each task offers its own: the task line's `tools`


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
    """The components of `score` for a conversation: the last call is judged; None when the task
    cannot be judged (no usable `tools`/`expected`).
    """
    judged = _task(json.dumps({"tools": task.get("tools"), "expected": task.get("expected")}))
    if judged is None:
        return None
    schemas, expected = judged
    calls, malformed = _calls(task, messages)
    return _judge(schemas, expected, calls, broken=malformed)


def gold(task: dict) -> list[dict]:
    """The expected call (arguments made up from the schema when none are expected), its reply
    and a short final answer.
    """
    schemas, expected = _task(json.dumps({"tools": task.get("tools"),
                                          "expected": task.get("expected")}))
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
    and the called tool expected with `arguments: null` (judged by its schema; a logged call's
    arguments are not known to be right). None otherwise.
    """
    found = task_from_messages(messages, tools)
    if found is None:
        return None
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    offered = [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    return {"messages": [m for m in messages[:first] if m.get("role") in ("system", "user")],
            "tools": offered, "expected": json.loads(found["answer"])["expected"]}
