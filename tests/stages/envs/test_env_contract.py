"""Bring your own agent (stages/envs/contract.py): a user's module as the environment.

A user's module is found with the project folder on sys.path: `load(name, module, root=REPO)`
imports examples/support/support_env.py as `examples.support.support_env`, as params.yaml would
name it; an installed package's module is found by its entry point (group
`offseason.environments`), which the tests fake with a dist-info folder on sys.path.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import uuid

import pytest
from conftest import REPO

from stages.envs import contract
from stages.envs.contract import ContractError, GoldError, TaskFileError, ToolError, VerifierError

EXAMPLE = REPO / "examples" / "support"
MODULE = "examples.support.support_env"


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Undo what loading does to sys.path and sys.modules (user modules of other tests)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("user_env_"):
            del sys.modules[name]


@pytest.fixture(scope="module")
def env():
    return contract.load("support", MODULE, root=REPO)


@pytest.fixture(scope="module")
def task(env):
    return contract.load_tasks(EXAMPLE / "tasks.jsonl", env)[1]  # A1002, shipped


def user_module(tmp_path, source: str) -> str:
    """Write a user's module into tmp_path (the project folder); return its dotted name."""
    name = f"user_env_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return name


GOOD = """
    TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]

    def call_tool(task, name, arguments):
        return arguments.get("x", "")

    def reward(task, messages):
        return 1.0
"""


# loading


def test_load_by_module_path(env):
    assert env.name == "support" and env.module == MODULE and env.entry_point is None
    assert env.tool_names == ["lookup_order"]
    assert env.max_turns == 3 and env.version == "support@1"
    assert env.gold is not None and env.task_from_trace is not None
    assert env.source == str(EXAMPLE / "support_env.py")


def test_two_project_folders_each_load_their_own_module_of_one_name(tmp_path):
    # one process, two projects with `my_envs/greeter.py` each: the second got the first's module
    # (sys.modules), and a test session's project then committed the wrong folder's files
    roots = []
    for version in ("one@1", "two@1"):
        root = tmp_path / version[:3]
        (root / "my_envs").mkdir(parents=True)
        (root / "my_envs" / "greeter.py").write_text(
            f"VERSION = {version!r}\nTOOLS = []\n\n\ndef reward(task, messages):\n"
            f"    return 1.0\n")
        roots.append(root)
    for root, version in [(roots[0], "one@1"), (roots[1], "two@1"), (roots[0], "one@1")]:
        env = contract.load("greeter", "my_envs.greeter", root)
        assert (env.version, env.source) == (version, str(root / "my_envs" / "greeter.py"))


def test_load_by_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "support_envs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: support-envs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[offseason.environments]\nsupport-demo = {MODULE}\nbroken = user_env_absent.nothing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = contract.load("help", "support-demo", root=REPO)
    assert env.module == MODULE and env.entry_point == "support-demo"
    assert env.tool_names == ["lookup_order"]
    with pytest.raises(ContractError, match="entry point 'broken'.*does not import"):
        contract.load("help", "broken", root=REPO)


def test_load_a_plain_module_from_the_project_folder(tmp_path):
    name = user_module(tmp_path, GOOD)
    env = contract.load("echo", name, root=tmp_path)
    assert env.max_turns is None and env.version is None and env.gold is None
    assert contract.call(env, {}, "echo", '{"x": "hi"}') == ("hi", None)


def test_a_module_without_tools_needs_no_call_tool(tmp_path):
    name = user_module(tmp_path, "TOOLS = []\ndef reward(task, messages):\n    return None\n")
    env = contract.load("chat", name, root=tmp_path)
    assert env.call_tool is None
    text, error = contract.call(env, {}, "anything", "{}")
    assert "unknown tool 'anything'" in error and text.startswith("Error: ")


# the example: tasks, gold, tool calls, reward


def test_every_gold_of_the_example_scores_full_marks(env):
    tasks = contract.load_tasks(EXAMPLE / "tasks.jsonl", env)
    benchmark = contract.load_tasks(EXAMPLE / "benchmark.jsonl", env)
    assert len(tasks) >= 10 and len(benchmark) >= 8
    assert not {t["task_id"] for t in tasks} & {t["task_id"] for t in benchmark}
    assert not {t["messages"][-1]["content"] for t in tasks} & \
        {t["messages"][-1]["content"] for t in benchmark}
    for task in tasks + benchmark:
        assert contract.check_gold(env, task) == {"called_tool": 1.0, "answer": 1.0}


def test_a_wrong_answer_scores_less(env, task):
    lookup = env.gold(task)[:2]
    wrong = lookup + [{"role": "assistant", "content": "It was delivered yesterday."}]
    assert contract.score(env, task, task["messages"] + wrong) == {"called_tool": 1.0,
                                                                   "answer": 0.0}
    guess = [{"role": "assistant", "content": "Your order has shipped."}]
    assert contract.score(env, task, task["messages"] + guess) == {"called_tool": 0.0,
                                                                   "answer": 1.0}
    assert contract.score(env, {"task_id": "x", "messages": []}, guess) is None


def test_call_a_tool(env, task):
    text, error = contract.call(env, task, "lookup_order", '{"order_id": "A1002"}')
    assert error is None and json.loads(text)["status"] == "shipped"


@pytest.mark.parametrize("name, arguments, expected", [
    ("lookup_order", '{"order_id": "Z0000"}', "no order 'Z0000'"),  # ToolError
    ("lookup_order", '{"order_id": ', "not valid JSON"),
    ("lookup_order", "[1, 2]", "must be a JSON object"),
    ("lookup_order", '{"order_id": 1002}', "invalid arguments for lookup_order: 1002 is not of "
                                           "type 'string'"),
    ("lookup_order", "{}", "'order_id' is a required property"),
    ("cancel_order", '{"order_id": "A1002"}', "unknown tool 'cancel_order'; the tools are: "
                                              "lookup_order"),
])
def test_a_bad_call_is_an_error_the_agent_sees(env, task, name, arguments, expected):
    text, error = contract.call(env, task, name, arguments)
    assert expected in error
    assert text == f"Error: {error}"


def test_an_infrastructure_failure_propagates(env, task):
    def down(task, name, arguments):
        raise ConnectionError("orders database unreachable")

    with pytest.raises(ConnectionError, match="unreachable"):
        contract.call(dataclasses.replace(env, call_tool=down), task, "lookup_order",
                      '{"order_id": "A1002"}')
    with pytest.raises(ContractError, match="call_tool returned a dict .* return a string"):
        contract.call(dataclasses.replace(env, call_tool=lambda t, n, a: {"status": "x"}), task,
                      "lookup_order", '{"order_id": "A1002"}')

    def raises_tool_error(task, name, arguments):
        raise ToolError("rate limited, try again")

    assert contract.call(dataclasses.replace(env, call_tool=raises_tool_error), task,
                         "lookup_order", '{"order_id": "A1002"}')[1] == "rate limited, try again"


@pytest.mark.parametrize("returned, expected", [
    (0.5, {"reward": 0.5}), (1, {"reward": 1.0}), (None, None),
    ({"a": 1, "b": 0.25}, {"a": 1.0, "b": 0.25}),
])
def test_score_normalises_the_reward(env, task, returned, expected):
    scored = dataclasses.replace(env, reward=lambda t, m: returned)
    assert contract.score(scored, task, task["messages"]) == expected


@pytest.mark.parametrize("returned", [
    "1.0", True, float("nan"), float("inf"), {}, {"a": "high"}, {1: 1.0}, {"a": None}, [1.0],
])
def test_score_refuses_what_is_not_a_reward(env, task, returned):
    scored = dataclasses.replace(env, reward=lambda t, m: returned)
    with pytest.raises(VerifierError, match=f"module '{MODULE}'.*reward\\(\\) returned"):
        contract.score(scored, task, task["messages"])


def test_a_gold_short_of_full_marks_is_refused(env, task):
    lazy = dataclasses.replace(env, gold=lambda t: [{"role": "assistant",
                                                     "content": "On its way!"}])
    with pytest.raises(GoldError, match="task 'support-002': the gold does not score full marks: "
                                        r"\{'called_tool': 0.0, 'answer': 0.0\}.*fix"):
        contract.check_gold(lazy, task)
    bad_call = dataclasses.replace(env, gold=lambda t: [{"role": "assistant", "content": None,
        "tool_calls": [{"id": "1", "type": "function",
                        "function": {"name": "lookup_order", "arguments": "{}"}}]}])
    with pytest.raises(GoldError, match="calls a tool wrongly: .*'order_id' is a required"):
        contract.check_gold(bad_call, task)
    with pytest.raises(GoldError, match="return a non-empty list"):
        contract.check_gold(dataclasses.replace(env, gold=lambda t: "shipped"), task)


def test_task_from_trace(env):
    trace = [{"role": "system", "content": "Be nice."},
             {"role": "user", "content": "where is A1004??"},
             {"role": "assistant", "content": "Out for delivery."}]
    task = env.task_from_trace(trace, env.tools)
    assert task == {"messages": trace[:2], "order_id": "A1004",
                    "expected_status": "out for delivery"}
    assert env.task_from_trace(trace, [{"type": "function", "function": {"name": "x"}}]) is None
    assert env.task_from_trace(trace[:1] + [{"role": "user", "content": "hi"}], None) is None


# contract errors: each names the environment, the module and the fix


def test_a_module_that_does_not_import(tmp_path):
    name = user_module(tmp_path, "TOOLS = []\nraise RuntimeError('no config file')\n")
    with pytest.raises(ContractError) as err:
        contract.load("support", name, root=tmp_path)
    assert f"environment 'support' (module '{name}') does not import: RuntimeError: no config " \
           f"file; fix the module (run `python -c 'import {name}'`" in str(err.value)

    name = user_module(tmp_path, "import user_env_dependency_not_installed\n")
    with pytest.raises(ContractError, match="imports 'user_env_dependency_not_installed', which "
                                            "is not installed; install it"):
        contract.load("support", name, root=tmp_path)


def test_a_module_that_does_not_exist(tmp_path):
    with pytest.raises(ContractError) as err:
        contract.load("support", "user_env_nowhere.support", root=tmp_path)
    message = str(err.value)
    assert "environment 'support' (module 'user_env_nowhere.support'): no module" in message
    assert "no entry point 'user_env_nowhere.support' in the group 'offseason.environments'" \
        in message
    assert "environments.support.module of params.yaml" in message
    with pytest.raises(ContractError, match="must name a module"):
        contract.load("support", "", root=tmp_path)


def test_a_module_without_reward(tmp_path):
    name = user_module(tmp_path, GOOD.replace("def reward(", "def score("))
    with pytest.raises(ContractError, match=rf"environment 'support' \(module '{name}'\) defines "
                                            r"no 'reward'; add `def reward\(task, messages\)`"):
        contract.load("support", name, root=tmp_path)


def test_a_tool_schema_that_is_not_json_schema(tmp_path):
    name = user_module(tmp_path, GOOD.replace('"type": "string"', '"type": "strin"'))
    with pytest.raises(ContractError) as err:
        contract.load("support", name, root=tmp_path)
    message = str(err.value)
    assert f"environment 'support' (module '{name}'): TOOLS[0] (echo): function.parameters is " \
           "not a valid JSON schema: 'strin' is not valid" in message
    assert "at parameters['properties']['x']['type']; fix the schema" in message


@pytest.mark.parametrize("change, expected", [
    (("TOOLS = [", "TOOLS = {"), "SyntaxError"),  # does not import
    (('"name": "echo"', '"name": "echo me"'), "'echo me' is not a tool name"),
    (('"type": "function"', '"type": "fn"'), "TOOLS[0] is not an OpenAI function tool"),
    (('"type": "object"', '"type": "string"'), "must be the JSON schema of an object"),
    (("TOOLS = [", "TOOLS = 2 * ["), "the name repeats TOOLS[0]"),
    (("TOOLS = [", "NOTOOLS = ["), "defines no TOOLS; add `TOOLS = []`"),
    (("TOOLS = [", "TOOLS = {'a': 1} or ["), "TOOLS is a dict"),
    (("def call_tool(task, name, arguments)", "def call_tool(task, name)"),
     "call_tool(task, name) cannot be called as call_tool(task, name, arguments); define "
     "`def call_tool(task, name, arguments)`"),
    (("def call_tool(", "def tool(",), "defines no 'call_tool'"),
    (("def reward(task, messages):", "reward = 1.0\n    def r(task, messages):"),
     "reward is a float, not a function"),
    (("TOOLS = [", "MAX_TURNS = 0\n    TOOLS = ["), "MAX_TURNS must be an int >= 1"),
    (("TOOLS = [", "VERSION = 2\n    TOOLS = ["), "VERSION must be a non-empty string"),
])
def test_each_contract_error_names_the_fix(tmp_path, change, expected):
    name = user_module(tmp_path, GOOD.replace(*change))
    with pytest.raises(ContractError) as err:
        contract.load("support", name, root=tmp_path)
    assert f"environment 'support' (module '{name}')" in str(err.value)
    assert expected in str(err.value)


def test_task_file_errors_name_the_file_and_line(tmp_path, env):
    path = tmp_path / "tasks.jsonl"
    good = {"task_id": "t1", "messages": [{"role": "user", "content": "hi"}], "order_id": "A1"}
    cases = [
        ({"task_id": "t2", "order_id": "A1"}, "task 't2' has no 'messages' (a non-empty list of "
                                              "chat messages"),
        ({"task_id": "t2", "messages": []}, "has no 'messages'"),
        ({"messages": good["messages"]}, "missing 'task_id' (a non-empty string)"),
        (good, "task_id 't1' repeats line 1; give each task its own id"),
        ({"task_id": "t2", "messages": [{"role": "bot", "content": "x"}]},
         "messages[0].role is 'bot'; use one of system, user, assistant, tool"),
        ({"task_id": "t2", "messages": [{"role": "user"}]}, "messages[0] (user) needs a 'content'"),
        ([1], "a task is a JSON object"),
    ]
    for row, expected in cases:
        path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")
        with pytest.raises(TaskFileError) as err:
            contract.load_tasks(path, env)
        assert f"{path}:3: " in str(err.value) and expected in str(err.value), row
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(TaskFileError, match=r"tasks.jsonl:2: not valid JSON"):
        contract.load_tasks(path, env)
    with pytest.raises(TaskFileError, match="task file of environment 'support' .* not found"):
        contract.load_tasks(tmp_path / "missing.jsonl", env)
    path.write_text(json.dumps(good) + "\n")
    assert contract.load_tasks(path, "support") == [good]  # extra fields kept


def test_tool_error_is_a_plain_exception():
    assert issubclass(ToolError, Exception) and not issubclass(ToolError, (ValueError,
                                                                          RuntimeError))
    assert issubclass(ContractError, ValueError) and issubclass(GoldError, ContractError)
