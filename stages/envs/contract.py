"""Bring your own agent: a user's own Python module as an environment, and the checks on it.

An environment is a plain Python module of the user's, named under params.yaml's `environments:`
(`module`, `tasks`, `benchmark`, `weight`). It defines `TOOLS`, `call_tool(task, name, arguments)`
and `reward(task, messages)`, optionally `reward_group`, `gold`, `MAX_TURNS`, `VERSION` and
`task_from_trace`; a task is one JSON line of its tasks file (`load_tasks`). Writes nothing.
`load(name, module)` imports and checks a module into an `Environment`; `call` runs a tool call as
a rollout does; `score` runs the reward and normalises it; `check_gold` checks a task's gold.
Contract problems raise `ContractError`, naming the environment, the module and the fix.
The stages read it through params.yaml's `environments:` (validate, rollout, reward,
champion_scores, gate).

Details: docs/environments.md, "The environment contract (stages/envs/contract.py)".
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import inspect
import json
import math
import numbers
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.envs import sandbox
from stages.envs.errors import TaskFileError, ToolError, VerifierError

__all__ = ["ENTRY_POINT_GROUP", "ContractError", "Environment", "GoldError", "TaskFileError",
           "ToolError", "VerifierError", "call", "check_gold", "load", "load_spec", "load_tasks",
           "run_job", "run_jobs", "score"]

ENTRY_POINT_GROUP = "offseason.environments"
ROLES = ("system", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI API accepts


class ContractError(ValueError):
    """A user's environment module that breaks the contract; the message names the environment,
    the module and the fix.
    """


class GoldError(ContractError):
    """A task whose gold messages do not score full marks (or are not messages)."""


@dataclass(frozen=True)
class Environment:
    """A checked environment: the user's name for it, where it came from and what it defines."""

    name: str  # the user's name for it (the key under `environments:` in params.yaml)
    module: str  # the dotted name of the module imported (an entry point's target module)
    tools: tuple[dict, ...]  # the TOOLS schemas (copies)
    max_turns: int | None  # MAX_TURNS, or None: the rollout's default
    version: str | None  # VERSION, or None
    call_tool: Callable[[dict, str, dict], str] | None
    reward: Callable[[dict, list], Any]
    gold: Callable[[dict], list] | None = None
    task_from_trace: Callable[[list, list | None], dict | None] | None = None
    source: str | None = None  # the module's file, for lineage (a DVC dep)
    entry_point: str | None = None  # the entry point's name it was found by; None: a dotted path
    reward_group: Callable[[dict, list], list] | None = None  # all samples of a task at once
    # its module holds stages.envs.judge (or one of its functions): its rewards run in the
    # reward stage's own process, where the judge's one cache and budget are (stages/reward.py)
    judged: bool = False
    validators: dict = field(init=False, repr=False, compare=False)  # tool name -> validator

    def __post_init__(self):
        """Build each tool's argument validator (the schemas are checked by `load`)."""
        object.__setattr__(self, "validators", _validators(self.tools))

    @property
    def where(self) -> str:
        """`environment 'x' (module 'y')`: how error messages name it."""
        return f"environment {self.name!r} (module {self.module!r})"

    @property
    def tool_names(self) -> list[str]:
        """The names of the tools, in TOOLS order."""
        return [tool["function"]["name"] for tool in self.tools]

    def tools_of(self, task: dict | None) -> tuple[dict, ...]:
        """The tools offered in `task`: its own `tools` when its line has them, else TOOLS."""
        tools = (task or {}).get("tools")
        return self.tools if tools is None else tuple(tools)

    def validators_of(self, task: dict | None) -> dict:
        """Tool name -> argument validator for the tools offered in `task`."""
        tools = (task or {}).get("tools")
        if tools is None:
            return self.validators
        key = json.dumps(tools, sort_keys=True)
        cache = self.__dict__.setdefault("_task_validators", {})
        if key not in cache:
            cache[key] = _validators(tools)
        return cache[key]


def _validators(tools) -> dict:
    from jsonschema.validators import validator_for

    validators = {}
    for tool in tools:
        schema = tool["function"]["parameters"]
        validators[tool["function"]["name"]] = validator_for(schema)(schema)
    return validators


def _where(name: str, module: str) -> str:
    return f"environment {name!r} (module {module!r})"


def _forget_other_folders(module: str, root: Path) -> None:
    """Forget `module` (and its packages) where this process imported it from another project
    folder and `root` has its own file for it: a test session, or any process that loads two
    projects' environments, otherwise ran the first folder's module for the second.
    """
    parts = module.split(".")
    if parts[0] in ("stages", "flows"):  # offseason's own (a project may hold a copy): one a process
        return
    own = root.joinpath(*parts)
    if not (own.with_suffix(".py").is_file() or (own / "__init__.py").is_file()):
        return
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and not Path(file).resolve().is_relative_to(root.resolve()):
            del sys.modules[name]


def _import(name: str, module: str, root: Path) -> tuple[Any, str, str | None]:
    """The module object, its dotted name and the entry point's value (None: a dotted path)."""
    where = _where(name, module)
    if sys.path[:1] != [str(root)]:  # first: a folder put there later must not shadow it
        if str(root) in sys.path:
            sys.path.remove(str(root))
        sys.path.insert(0, str(root))
    _forget_other_folders(module, root)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module), module, None
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if not (missing == module or module.startswith(missing + ".")):
            raise ContractError(
                f"{where} does not import: it imports {missing!r}, which is not installed; "
                f"install it in the project's environment (pip install ...), or fix the import"
            ) from err
    except Exception as err:  # a syntax error, an exception at import time
        raise ContractError(
            f"{where} does not import: {type(err).__name__}: {err}; fix the module (run "
            f"`python -c 'import {module}'` in {root} to see the traceback)"
        ) from err
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=module)
    values = sorted({ep.value for ep in found})
    if not values:
        raise ContractError(
            f"{where}: no module {module!r} in the project folder {root} or installed, and no "
            f"entry point {module!r} in the group {ENTRY_POINT_GROUP!r}; write the dotted path "
            f"of a module in the project folder (my_envs/support.py is my_envs.support) in "
            f"environments.{name}.module of params.yaml, or install the package that declares "
            f"the entry point"
        )
    if len(values) > 1:
        raise ContractError(
            f"{where}: the entry point {module!r} in the group {ENTRY_POINT_GROUP!r} is declared "
            f"by several installed packages ({', '.join(values)}); uninstall all but one, or "
            f"write the module's dotted path in environments.{name}.module of params.yaml"
        )
    ep = next(iter(found))
    try:
        loaded = ep.load()
    except Exception as err:
        raise ContractError(
            f"{where}: the entry point {module!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}) "
            f"does not import: {type(err).__name__}: {err}; fix that module or the entry point "
            f"of the package that declares it"
        ) from err
    return loaded, getattr(loaded, "__name__", ep.module), ep.value


def _takes(fn: Callable, *args: str) -> bool:
    """Whether `fn` can be called with these positional arguments (True when unknowable)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def _function(where: str, obj: Any, attr: str, params: tuple[str, ...], required: bool):
    fn = getattr(obj, attr, None)
    wanted = f"def {attr}({', '.join(params)})"
    if fn is None:
        if required:
            raise ContractError(f"{where} defines no {attr!r}; add `{wanted}` to it")
        return None
    if not callable(fn):
        raise ContractError(f"{where}: {attr} is a {type(fn).__name__}, not a function; "
                            f"define `{wanted}`")
    if not _takes(fn, *params):
        raise ContractError(f"{where}: {attr}{inspect.signature(fn)} cannot be called as "
                            f"{attr}({', '.join(params)}); define `{wanted}`")
    return fn


def _check_tools(where: str, tools: Any) -> tuple[dict, ...]:
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    example = ('TOOLS = [{"type": "function", "function": {"name": "lookup_order", '
               '"description": "...", "parameters": {"type": "object", "properties": '
               '{"order_id": {"type": "string"}}, "required": ["order_id"]}}}]')
    if tools is None:
        raise ContractError(f"{where} defines no TOOLS; add `TOOLS = []` when the agent has no "
                            f"tools, or e.g. `{example}`")
    if not isinstance(tools, (list, tuple)):
        raise ContractError(f"{where}: TOOLS is a {type(tools).__name__}, not a list of OpenAI "
                            f"function-tool schemas; write e.g. `{example}`")
    seen = {}
    for index, tool in enumerate(tools):
        at = f"{where}: TOOLS[{index}]"
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(tool.get("function"), dict)):
            raise ContractError(f"{at} is not an OpenAI function tool; write "
                                f'{{"type": "function", "function": {{"name": ..., '
                                f'"description": ..., "parameters": {{...}}}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ContractError(f"{at}: function.name {name!r} is not a tool name; use 1 to 64 "
                                f"letters, digits, '_' or '-'")
        at = f"{at} ({name})"
        if name in seen:
            raise ContractError(f"{at}: the name repeats TOOLS[{seen[name]}]; give each tool its "
                                f"own name")
        seen[name] = index
        if not isinstance(function.get("description", ""), str):
            raise ContractError(f"{at}: function.description must be a string (or left out)")
        if "parameters" not in function:
            raise ContractError(f"{at} has no function.parameters; a tool without arguments "
                                f'takes {{"type": "object", "properties": {{}}}}')
        schema = function["parameters"]
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ContractError(f"{at}: function.parameters must be the JSON schema of an object "
                                f'(the arguments), e.g. {{"type": "object", "properties": '
                                f'{{"order_id": {{"type": "string"}}}}}}; got {schema!r}')
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as err:
            path = "".join(f"[{p!r}]" for p in err.path) or "(top level)"
            raise ContractError(
                f"{at}: function.parameters is not a valid JSON schema: {err.message} at "
                f"parameters{path}; fix the schema (JSON Schema types are string, number, "
                f"integer, boolean, object, array, null)"
            ) from None
    return tuple(copy.deepcopy(list(tools)))


def load(name: str, module: str, root: str | Path | None = None) -> Environment:
    """Import and check the environment `name` (the key under `environments:` in params.yaml)
    from `module`: a dotted path importable from `root` (the project folder; default: the working
    directory, which is where the stages run), or else an entry point of the group
    `offseason.environments`. Raises ContractError naming the environment, the module and the
    fix.
    """
    if not isinstance(module, str) or not module.strip():
        raise ContractError(f"environment {name!r}: environments.{name}.module in params.yaml "
                            f"must name a module (e.g. my_envs.support) or an entry point, got "
                            f"{module!r}")
    module = module.strip()
    root = Path(root if root is not None else Path.cwd()).resolve()
    obj, dotted, target = _import(name, module, root)
    where = _where(name, dotted if target is None else f"{module} = {target}")
    entry_point = None if target is None else module
    tools = _check_tools(where, getattr(obj, "TOOLS", None))
    reward = _function(where, obj, "reward", ("task", "messages"), required=True)
    call_tool = _function(where, obj, "call_tool", ("task", "name", "arguments"),
                          required=bool(tools))
    gold = _function(where, obj, "gold", ("task",), required=False)
    from_trace = _function(where, obj, "task_from_trace", ("messages", "tools"), required=False)
    reward_group = _function(where, obj, "reward_group", ("task", "episodes"), required=False)
    max_turns = getattr(obj, "MAX_TURNS", None)
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int)
                                  or max_turns < 1):
        raise ContractError(f"{where}: MAX_TURNS must be an int >= 1 (tool calls per episode), "
                            f"got {max_turns!r}; fix it or leave it out (the rollout's default)")
    version = getattr(obj, "VERSION", None)
    if version is not None and (not isinstance(version, str) or not version.strip()):
        raise ContractError(f"{where}: VERSION must be a non-empty string (recorded with every "
                            f"score, e.g. VERSION = \"support@1\"), got {version!r}")
    if _uses(obj, sandbox.__name__):  # fail closed: model-written code never runs unisolated unasked
        try:
            sandbox.require_isolation(where)
        except sandbox.SandboxError as e:
            raise ContractError(str(e)) from e
    source = getattr(obj, "__file__", None) or getattr(sys.modules.get(dotted), "__file__", None)
    return Environment(name=name, module=dotted, tools=tools, max_turns=max_turns,
                       version=version, call_tool=call_tool, reward=reward, gold=gold,
                       task_from_trace=from_trace, source=source, entry_point=entry_point,
                       reward_group=reward_group, judged=_uses(obj, "stages.envs.judge"))


def _uses(module: Any, name: str) -> bool:
    """Whether an environment module holds the module `name` or one of its functions: the
    sandbox (stages/envs/sandbox.py: the built-in `code` environment runs code there), the
    judge (stages/envs/judge.py, `from stages.envs import judge` as its docstring shows).
    """
    return any(getattr(value, "__name__", None) == name
               or getattr(value, "__module__", None) == name
               for value in getattr(module, "__dict__", {}).values())


def load_spec(name: str, spec, root: str | Path | None = None) -> Environment:
    """`load` of an `environments:` entry, with the tools of its MCP servers (`spec.mcp`,
    stages/envs/mcp_tools.py) offered beside the module's own: their schemas from the servers'
    tools/list, their calls to the servers. Without `mcp` it is `load`.
    """
    env = load(name, spec.module, root)
    if not spec.mcp:
        return env
    import dataclasses

    from stages.envs import mcp_tools

    root = Path(root if root is not None else Path.cwd()).resolve()
    servers = mcp_tools.servers_of(name, spec.mcp, root, spec.network)
    offered = servers.tools()
    clash = {t["function"]["name"] for t in env.tools} & {t["function"]["name"] for t in offered}
    if clash:
        raise ContractError(f"{env.where}: the tool {sorted(clash)[0]!r} is in TOOLS and offered "
                            f"by an MCP server of environments.{name}.mcp; keep one")
    own = env.call_tool

    def call_tool(task: dict, tool: str, arguments: dict) -> str:
        if servers.offers(tool):
            return servers.call(tool, arguments)
        if own is None:
            raise ToolError(f"unknown tool {tool!r}")
        return own(task, tool, arguments)

    return dataclasses.replace(env, tools=(*env.tools, *offered), call_tool=call_tool)


def _env_name(environment: Environment | str) -> str:
    return environment.where if isinstance(environment, Environment) else \
        f"environment {environment!r}"


def _check_message(message: Any, index: int, roles: tuple[str, ...]) -> str | None:
    """Why `message` is not a chat message (None when it is one)."""
    if not isinstance(message, dict):
        return f"messages[{index}] is a {type(message).__name__}, not an object"
    role = message.get("role")
    if role not in roles:
        return f"messages[{index}].role is {role!r}; use one of {', '.join(roles)}"
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        return None
    if isinstance(content, str):
        return None
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and isinstance(part.get("type"), str) for part in content):
        return None
    return (f"messages[{index}] ({role}) needs a 'content': a string or a list of content parts "
            f"({{\"type\": \"text\", \"text\": ...}})")


def load_tasks(path: str | Path, environment: Environment | str) -> list[dict]:
    """The tasks of a task file of `environment`: one JSON object a line with `task_id` (a unique,
    non-empty string), `messages` (a non-empty list of OpenAI chat messages, roles system, user,
    assistant or tool) and any fields its reward needs, kept as they are. Blank lines are
    skipped. Raises TaskFileError naming the file and line.
    """
    path = Path(path)
    owner = _env_name(environment)
    if not path.is_file():
        raise TaskFileError(f"{path}: task file of {owner} not found; write it (one JSON task a "
                            f"line) or fix its path in params.yaml")
    tasks, seen = [], {}
    shape = ('{"task_id": "t1", "messages": [{"role": "user", "content": "..."}], '
             '...fields the reward needs}')
    with path.open(encoding="utf-8-sig") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise TaskFileError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); "
                                    f"each line is one task, {shape}") from None
            if not isinstance(row, dict):
                raise TaskFileError(f"{where}: a task is a JSON object, {shape}; got "
                                    f"{type(row).__name__}")
            task_id = row.get("task_id")
            if not isinstance(task_id, str) or not task_id.strip():
                raise TaskFileError(f"{where}: missing 'task_id' (a non-empty string); write "
                                    f"{shape}")
            if task_id in seen:
                raise TaskFileError(f"{where}: task_id {task_id!r} repeats line {seen[task_id]}; "
                                    f"give each task its own id")
            seen[task_id] = number
            messages = row.get("messages")
            if not isinstance(messages, list) or not messages:
                raise TaskFileError(f"{where}: task {task_id!r} has no 'messages' (a non-empty "
                                    f"list of chat messages, e.g. [{{\"role\": \"user\", "
                                    f"\"content\": \"Where is my order?\"}}]); add them")
            for index, message in enumerate(messages):
                problem = _check_message(message, index, ROLES)
                if problem:
                    raise TaskFileError(f"{where}: task {task_id!r}: {problem}")
            if "tools" in row:  # this task's own tools, checked as TOOLS are
                try:
                    row["tools"] = list(_check_tools(f"{where}: task {task_id!r}",
                                                     row["tools"]))
                except ContractError as err:
                    raise TaskFileError(str(err).replace("TOOLS", "tools")) from None
            tasks.append(row)
    return tasks


def _arguments(env: Environment, name: Any, arguments: Any, task: dict | None = None
               ) -> tuple[dict | None, str | None]:
    """(the parsed arguments, None), or (None, why they are refused): an unknown tool, arguments
    that are not a JSON object or do not match the tool's schema. Blank arguments count as {}.
    The tools are those offered in `task` (its own `tools`, else TOOLS).
    """
    from jsonschema.exceptions import best_match

    validators = env.validators_of(task)
    validator = validators.get(name) if isinstance(name, str) else None
    if validator is None:
        return None, f"unknown tool {name!r}; the tools are: {', '.join(validators) or 'none'}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return None, (f"the arguments of {name} are not valid JSON ({err.msg} at column "
                          f"{err.colno}); send a JSON object")
    if not isinstance(arguments, dict):
        return None, (f"the arguments of {name} must be a JSON object, got "
                      f"{type(arguments).__name__}")
    error = best_match(validator.iter_errors(arguments))
    if error is not None:
        at = "".join(f"[{p!r}]" for p in error.absolute_path)
        return None, f"invalid arguments for {name}: {error.message}{f' (at {at})' if at else ''}"
    return arguments, None


def call(env: Environment, task: dict, name: str, arguments_json: str | dict
         ) -> tuple[str, str | None]:
    """Run one tool call as a rollout does: (the text of the tool message, None), or, for an
    error the agent should see and may recover from (an unknown tool, arguments that are not a
    JSON object or do not match the tool's schema, a ToolError), ("Error: <why>", "<why>").
    Blank arguments count as {}. Any other exception from the module's call_tool propagates: an
    infrastructure failure, recorded with its cause.
    """
    arguments, why = _arguments(env, name, arguments_json, task)
    if why is None and env.call_tool is None:
        raise ContractError(f"{env.where}: task {task.get('task_id')!r} offers tools of its own "
                            f"but the module defines no call_tool; add "
                            f"`def call_tool(task, name, arguments) -> str`")
    if why is None:
        try:
            result = env.call_tool(task, name, arguments)
        except ToolError as err:
            why = str(err) or type(err).__name__
        else:
            if not isinstance(result, str):
                raise ContractError(f"{env.where}: call_tool returned a {type(result).__name__} "
                                    f"for {name}; return a string (json.dumps(...) for data)")
            return result, None
    return f"Error: {why}", why


def _number(value: Any) -> float | None:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if math.isfinite(value):
            return value
    return None


def text_of(content) -> str:
    """A message's content as text: a string as it is, content parts joined by their text."""
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


HACK_SUSPECTED = "hack_suspected"


class Scores(dict):
    """Reward components (names to numbers) and the verifier's note of a suspected reward hack:
    `hack_suspected`, its reason ("" when none). The note is an attribute, not an item, so that
    nothing sums, averages or weights it; it survives pickling into and out of worker processes.
    """

    hack_suspected: str = ""
    judgment: dict | None = None  # a judge's identity and reasoning (stages/envs/judge.py)

    @classmethod
    def of(cls, components: dict, hack_suspected: str = "") -> Scores:
        """Scores of `components`, noting `hack_suspected` (a reason) when given."""
        scores = cls(components)
        if hack_suspected:
            scores.hack_suspected = hack_suspected
        return scores


def suspected(scores: dict | None) -> str:
    """The reason a verifier suspected a reward hack in these scores; "" when none."""
    return getattr(scores, HACK_SUSPECTED, "") or ""


def score(env: Environment, task: dict, messages: list[dict]) -> Scores | None:
    """The reward of an episode: the module's reward(task, messages) as components (a float x is
    {"reward": x}), or None when it cannot judge; a `hack_suspected` reason in the dict becomes
    the `Scores` note. An exception from reward propagates (the verifier broke); a result that
    is not a finite number, a dict of them or None raises VerifierError naming the module.
    """
    return normalize(env, env.reward(task, messages))


def normalize(env: Environment, result: Any) -> Scores | None:
    """A result of `reward` (or one of `reward_group`'s) as `score` returns it."""
    if result is None:
        return None
    value = _number(result)
    if value is not None:
        return Scores({"reward": value})
    if isinstance(result, dict) and result:
        judgment = getattr(result, "judgment", None)  # a judge's Scores carry its reasoning
        note = result.get(HACK_SUSPECTED, "") or getattr(result, HACK_SUSPECTED, "")
        result = {k: v for k, v in result.items() if k != HACK_SUSPECTED}
        if not isinstance(note, str):
            raise VerifierError(f"{env.where}: reward() returned {HACK_SUSPECTED}={note!r}; it "
                                f"is a reason (a string), or leave it out")
        if not result:
            raise VerifierError(f"{env.where}: reward() returned only {HACK_SUSPECTED}; return "
                                f"the components too")
        components = Scores.of({}, note)
        if judgment:
            components.judgment = judgment
        for key, item in result.items():
            value = _number(item)
            if not isinstance(key, str) or not key or value is None:
                raise VerifierError(f"{env.where}: reward() returned the component {key!r}: "
                                    f"{item!r}; components map names (strings) to finite numbers")
            components[key] = value
        return components
    raise VerifierError(f"{env.where}: reward() returned {result!r}; return a finite number, a "
                        f"non-empty dict of them (named components) or None (cannot judge)")


def full_marks(scores: dict[str, float]) -> bool:
    """Whether reward components are full marks: 1.0 (to rounding) in every one of them. What a
    gold must score, and what counts an episode `correct`.
    """
    return all(value >= 1.0 - 1e-9 for value in scores.values())


def mean(scores: dict[str, float]) -> float:
    """The reward of an episode: the mean of its components (a float is one component)."""
    return sum(scores.values()) / len(scores)


def check_gold(env: Environment, task: dict) -> dict[str, float] | None:
    """Check that the task's messages plus the module's gold(task) score full marks (1.0, or at
    least 1.0 in every component) and that the gold's tool calls name known tools with valid
    arguments. Returns the gold's scores (None when the module has no gold); raises GoldError.
    """
    if env.gold is None:
        return None
    where = f"{env.where}, task {task.get('task_id')!r}"
    gold = env.gold(task)
    if not isinstance(gold, list) or not gold:
        raise GoldError(f"{where}: gold() returned {type(gold).__name__}; return a non-empty "
                        f"list of assistant/tool messages")
    for index, message in enumerate(gold):
        problem = _check_message(message, index, ("assistant", "tool"))
        if problem:
            raise GoldError(f"{where}: gold() {problem}")
        for tool_call in message.get("tool_calls") or ():
            function = tool_call.get("function") if isinstance(tool_call, dict) else None
            if not isinstance(function, dict):
                raise GoldError(f"{where}: gold() messages[{index}] has a tool call without "
                                f"'function'; write {{\"id\": ..., \"type\": \"function\", "
                                f"\"function\": {{\"name\": ..., \"arguments\": \"{{...}}\"}}}}")
            _, error = _arguments(env, function.get("name"), function.get("arguments"), task)
            if error:
                raise GoldError(f"{where}: gold() messages[{index}] calls a tool wrongly: "
                                f"{error}; fix gold() or TOOLS")
    scores = score(env, task, list(task["messages"]) + gold)
    if scores is None:
        raise GoldError(f"{where}: reward() cannot judge the gold (returned None); fix gold() "
                        f"or the task's fields")
    if not full_marks(scores):
        short = {name: value for name, value in scores.items() if value < 1.0 - 1e-9}
        raise GoldError(f"{where}: the gold does not score full marks: {short} (every "
                        f"component must reach 1.0); fix the task's fields, gold() or reward()")
    return scores


# --- scoring jobs: what the reward stage fans out (stages/reward.py, "Fan-out") ----------------

WORKER = "OFFSEASON_SCORING_WORKER"  # set in a worker process: the judge refuses to run there
_LOADED: dict[tuple, Environment] = {}  # a worker's environments, loaded once per process


def run_job(env: Environment, kind: str, task_json: str, payload_json: str | None,
            stops: tuple[type, ...] = ()) -> tuple[Any, str | None]:
    """One scoring job of `env` on a task (JSON text): (its result, None), or (None, the cause)
    when the module broke, never a zero. `kind` "gold": `check_gold` (result None; a gold short
    of full marks is the cause "task set aside: ..."); "reward": `score` of one episode
    (`payload_json`: its messages); "group": `reward_group` over every episode of the task
    (`payload_json`: a list of message lists), a result for each. An exception of `stops` (a
    spent judge budget, a judge that is down) propagates: it stops the stage.
    """
    task = json.loads(task_json)
    try:
        if kind == "gold":
            try:
                check_gold(env, task)
            except GoldError as err:
                return None, f"task set aside: {err}"
            return None, None
        if kind == "reward":
            return score(env, task, json.loads(payload_json)), None
        episodes = json.loads(payload_json)
        results = env.reward_group(task, episodes)
        if not isinstance(results, list) or len(results) != len(episodes):
            raise VerifierError(f"{env.where}: reward_group() returned {type(results).__name__} "
                                f"for {len(episodes)} episodes; return a list with one result "
                                f"per episode")
        return [normalize(env, result) for result in results], None
    except stops:
        raise
    except Exception as err:  # a broken reward: its cause, never a zero
        what = {"gold": "reward() raised on the gold:", "reward": f"{env.where}: reward() raised",
                "group": f"{env.where}: reward_group() raised"}[kind]
        return None, f"{what} {type(err).__name__}: {err}"


def run_jobs(jobs: list[tuple], unisolated: bool) -> list[tuple]:
    """A chunk of scoring jobs in a worker (a local process or a Ray worker), results in order:
    each job `(kind, name, module, root, task_json, payload_json)` (`run_job`). Only where to
    find an environment travels, never its functions: each is loaded here, once per process.
    `unisolated`: runtime.sandbox.allow_unisolated, which a Ray worker's own environment lacks.
    """
    os.environ[WORKER] = "1"
    sandbox.allow_unisolated(unisolated)
    out = []
    for kind, name, module, root, task_json, payload_json in jobs:
        if (name, module, root) not in _LOADED:
            _LOADED[name, module, root] = load(name, module, root)
        out.append(run_job(_LOADED[name, module, root], kind, task_json, payload_json))
    return out


class Router:
    """The environments as the validate stage sees them: the task behind a trace is the first
    that an environment's `task_from_trace` finds (in params.yaml order), as JSON with its
    environment's name (the rollout stage routes it back); `task_kind`, the drift report's
    category, is the environment's name.
    """

    def __init__(self, envs: dict[str, Environment]):
        """Route over `envs` ({name: Environment}, in params.yaml order)."""
        self.envs = envs

    def task_of(self, messages: list[dict], tools: list | None = None) -> str | None:
        """The task JSON, or None when no environment claims the trace."""
        for name, env in self.envs.items():
            if env.task_from_trace is None:
                continue
            try:
                task = env.task_from_trace(messages, tools)
            except Exception as err:
                raise ContractError(f"{env.where}: task_from_trace raised {type(err).__name__}: "
                                    f"{err}; it must return a task or None for any trace") from err
            if task is None:
                continue
            if not isinstance(task, dict) or not isinstance(task.get("messages"), list) \
                    or not task["messages"]:
                raise ContractError(f"{env.where}: task_from_trace returned {task!r}; return a "
                                    f"task (a dict with 'messages' and the fields its reward "
                                    f"needs) or None")
            # keys in the task's order: its tools and messages render as production logged them
            return json.dumps({**task, "environment": name})
        return None

    @staticmethod
    def task_kind(question: str | None) -> str:
        """The environment a routed task belongs to."""
        return json.loads(question)["environment"] if question else "none"


def benchmark_suites(specs: dict, root: Path, benchmark_size: int) -> dict[str, tuple]:
    """{environment name: (Environment, its benchmark tasks)} for each of the user's
    environments with a `benchmark` (the first `gate.benchmark_size` when set).
    """
    out = {}
    for name, spec in specs.items():
        if not spec.benchmark:
            continue
        env = load_spec(name, spec, root)
        tasks = load_tasks(root / spec.benchmark, env)
        if benchmark_size:
            tasks = tasks[:benchmark_size]
        if not tasks:
            raise TaskFileError(f"{spec.benchmark}: the benchmark of environment {name!r} is "
                                f"empty; the gate needs items to compare on: write held-out "
                                f"tasks into it")
        out[name] = (env, tasks)
    return out
