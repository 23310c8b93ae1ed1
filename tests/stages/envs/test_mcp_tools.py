"""MCP tools in an environment: a real stdio MCP server (tests/fixtures/mcp/shop_server.py,
written with the `mcp` SDK) and the SDK's own client, through `contract.load_spec`.

    pytest -q tests/stages/envs/test_mcp_tools.py
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from stages import config as cfg
from stages.envs import contract, mcp_tools, sandbox

REPO = Path(__file__).resolve().parents[3]
SERVER = {"command": "python tests/fixtures/mcp/shop_server.py"}
MODULE = '''
TOOLS = [{"type": "function", "function": {"name": "greet", "parameters": {"type": "object"}}}]


def call_tool(task, name, arguments):
    return "hello"


def reward(task, messages):
    return 1.0
'''
TASK = {"task_id": "t", "messages": [{"role": "user", "content": "Where is order 42?"}]}


@pytest.fixture
def project(tmp_path):
    (tmp_path / "tests" / "fixtures" / "mcp").mkdir(parents=True)
    (tmp_path / "tests/fixtures/mcp/shop_server.py").write_text(
        (REPO / "tests/fixtures/mcp/shop_server.py").read_text())
    (tmp_path / f"shop_env_{tmp_path.name}.py").write_text(MODULE)
    return tmp_path


def spec(project, **server):
    return cfg.EnvironmentSpec(module=f"shop_env_{project.name}",
                               mcp={"shop": {**SERVER, **server}})


def test_an_environment_offers_and_calls_its_mcp_servers_tools(project):
    env = contract.load_spec("support", spec(project, allow=["lookup_order", "refund"],
                                             timeout=5), project)
    names = [t["function"]["name"] for t in env.tools]
    assert names == ["greet", "lookup_order", "refund"]  # the module's own, then the allowed
    lookup = env.tools[1]["function"]
    assert lookup["parameters"]["required"] == ["order_id"]  # from the server's tools/list
    assert contract.call(env, TASK, "lookup_order", '{"order_id": "42"}') == \
        ("order 42: shipped", None)
    assert contract.call(env, TASK, "greet", "{}") == ("hello", None)
    # a tool error the agent sees and may recover from
    text, why = contract.call(env, TASK, "refund", '{"order_id": "42", "amount": 5}')
    assert "refunds need a manager's approval" in why and text.startswith("Error: ")
    text, why = contract.call(env, TASK, "lookup_order", '{"order_id": "7"}')
    assert "no order 7" in why
    # not allowed: not offered, so an unknown tool
    text, why = contract.call(env, TASK, "slow_report", '{"days": 1}')
    assert "unknown tool" in why
    # arguments are checked against the server's schema before any call
    text, why = contract.call(env, TASK, "lookup_order", '{"order": "42"}')
    assert "order_id" in why


def test_a_hanging_tool_and_a_dead_server_are_infrastructure_failures(project):
    env = contract.load_spec("hang", spec(project, timeout=1), project)
    started = time.monotonic()
    with pytest.raises(mcp_tools.McpError, match=r"MCP server 'shop' of environment 'hang'.*"
                                                  r"slow_report gave no answer within 1 s"):
        contract.call(env, TASK, "slow_report", '{"days": 1}')
    assert time.monotonic() - started < 8
    # the session survives a timed-out call
    assert contract.call(env, TASK, "lookup_order", '{"order_id": "43"}')[0] == \
        "order 43: processing"
    # the server dies mid-rollout: the next call says which server
    servers = mcp_tools.servers_of("hang", spec(project, timeout=1).mcp, project.resolve())
    import psutil

    def runs_the_server(process) -> bool:
        try:
            return "shop_server.py" in " ".join(process.cmdline()) and \
                process.cwd() == str(project.resolve())
        except psutil.Error:  # another child of this worker, ended (a zombie) or gone meanwhile
            return False

    mine = [p for p in psutil.Process().children(recursive=True) if runs_the_server(p)]
    assert len(mine) == 1, "the environment's stdio server runs, once"
    os.kill(mine[0].pid, signal.SIGKILL)
    mine[0].wait(10)
    with pytest.raises(mcp_tools.McpError, match="MCP server 'shop' of environment 'hang'"):
        contract.call(env, TASK, "lookup_order", '{"order_id": "42"}')
    servers.close()


def test_bad_mcp_settings_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"environments.x.mcp.shop: give one of command"):
        mcp_tools.check("environments.x.mcp", {"shop": {"allow": []}})
    with pytest.raises(ValueError, match=r"unknown key 'cmd'"):
        mcp_tools.check("environments.x.mcp", {"shop": {"cmd": "x"}})
    with pytest.raises(ValueError, match=r"timeout: seconds > 0"):
        mcp_tools.check("environments.x.mcp", {"shop": {"url": "http://h/mcp", "timeout": 0}})
    params = tmp_path / "params.yaml"
    params.write_text("environments:\n  x:\n    module: m\n    mcp: {shop: {command: a, url: b}}\n")
    with pytest.raises(cfg.ParamsError, match="give one of command"):
        cfg.environments(params)


def test_an_allow_list_naming_a_missing_tool_fails_at_load(project):
    with pytest.raises(mcp_tools.McpError, match=r"allow names \['delete_everything'\]"):
        contract.load_spec("bad", spec(project, allow=["delete_everything"]), project)


@pytest.mark.parametrize("fault", ["refused", "black hole"])
def test_an_mcp_url_that_is_down_fails_by_name_within_its_bound(fault):
    """Nothing listening, or a listener that never answers: the environment does not load, and
    the error names the server, in seconds (its `timeout` per request of the SDK's handshake).
    """
    import socket

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/mcp"
        if fault == "black hole":
            hole.listen(8)
        else:
            hole.close()
        servers = mcp_tools.Servers("docs_env", mcp_tools.check("m", {"docs": {
            "url": url, "timeout": 1}}), REPO)
        started = time.monotonic()
        with pytest.raises(mcp_tools.McpError, match=f"MCP server 'docs' of environment "
                                                     f"'docs_env' \\({url}\\)"):
            servers.start()
        assert time.monotonic() - started < 30


MISBEHAVING = "python tests/fixtures/mcp/misbehaving_server.py"


@pytest.fixture
def listener():
    """A TCP listener on this machine's loopback: what a server in the sandbox must not reach."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.settimeout(0.5)
        yield sock


@pytest.mark.skipif(not sandbox.net_namespace_works(), reason="needs unshare --net (root)")
def test_a_stdio_server_has_no_network_unless_its_environment_allows_it(listener):
    port = listener.getsockname()[1]
    command = {"command": f"{MISBEHAVING} connect {port}", "timeout": 5}
    closed = mcp_tools.Servers("offline", mcp_tools.check("m", {"net": command}), REPO)
    with pytest.raises(mcp_tools.McpError, match=r"MCP server 'net' of environment 'offline' "
                                                  r"\(python tests/fixtures/mcp/misbehaving_"
                                                  r"server.py connect \d+\): cannot start"):
        closed.start()
    import socket

    with pytest.raises(socket.timeout):
        listener.accept()  # it never got here
    # environments.<name>.network: true lets the same server reach it
    opened = mcp_tools.Servers("online", mcp_tools.check("m", {"net": command}), REPO,
                               network=True)
    try:
        assert [t["function"]["name"] for t in opened.tools()] == ["ping"]
        assert opened.call("ping", {}) == "pong"
        listener.accept()[0].close()
    finally:
        opened.close()


@pytest.mark.skipif(not sandbox.net_namespace_works(), reason="needs unshare --net (root)")
def test_a_stdio_server_past_its_memory_limit_fails_by_name():
    hungry = mcp_tools.Servers("greedy", mcp_tools.check("m", {"hog": {
        "command": f"{MISBEHAVING} memory 1024", "memory_mb": 512, "timeout": 5}}), REPO)
    with pytest.raises(mcp_tools.McpError, match=r"MCP server 'hog' of environment 'greedy'.*"
                                                  r"cannot start"):
        hungry.start()
    # within its limit it starts and answers
    modest = mcp_tools.Servers("modest", mcp_tools.check("m", {"hog": {
        "command": f"{MISBEHAVING} memory 16", "memory_mb": 512, "timeout": 5}}), REPO)
    try:
        assert modest.call("ping", {}) == "pong"
    finally:
        modest.close()


def test_a_url_server_needs_the_network_named_in_params(tmp_path):
    params = tmp_path / "params.yaml"
    entry = {"module": "m", "mcp": {"docs": {"url": "http://127.0.0.1:9000/mcp"}}}
    params.write_text(yaml.safe_dump({"environments": {"support": entry}}))
    with pytest.raises(cfg.ParamsError, match=r"environments\.support\.mcp\.docs: url "
                                              r"http://127.0.0.1:9000/mcp reaches a server over "
                                              r"the network.*add `network: true` to "
                                              r"environments\.support"):
        cfg.environments(params)
    params.write_text(yaml.safe_dump({"environments": {"support": {**entry, "network": True}}}))
    assert cfg.environments(params)["support"].network is True
    # a stdio server is local: no network asked
    params.write_text(yaml.safe_dump({"environments": {"support": {
        "module": "m", "mcp": {"shop": SERVER}}}}))
    assert cfg.environments(params)["support"].network is False
