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
    """An environment with the shop server, as `cfg.environments` gives it: where the server runs
    (runtime.mcp.servers) joined with what it is (environments.<name>.mcp)."""
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
    params.write_text("environments:\n  x:\n    module: m\n    mcp: {shop: {}}\nruntime:\n  mcp:\n"
                      "    servers: {shop: {command: a, url: b}}\n")
    with pytest.raises(cfg.ParamsError, match=r"runtime.mcp.servers.shop: give one of command"):
        cfg.environments(params)


def test_an_allow_list_naming_a_missing_tool_fails_at_load(project):
    with pytest.raises(mcp_tools.McpError, match=r"allow names \['delete_everything'\]"):
        contract.load_spec("bad", spec(project, allow=["delete_everything"]), project)


def test_an_mcp_server_in_the_old_form_is_refused_with_the_yaml_to_write(tmp_path):
    """command, url, timeout and memory_mb under environments.<name>.mcp.<server> (before issue
    51) would make moving a server a DVC param change: refused, naming the key, with the YAML of
    runtime.mcp.servers to write, which then loads as the same servers."""
    params = tmp_path / "params.yaml"
    old = {"shop": {"command": "python tools/shop_server.py", "allow": ["lookup_order"],
                    "timeout": 10},
           "docs": {"url": "http://127.0.0.1:9000/mcp"}}
    written = {"environments": {"support": {"module": "m", "network": True, "mcp": old}},
               "runtime": {"mcp": {"stall_seconds": 60.0}}}
    params.write_text(yaml.safe_dump(written, sort_keys=False))
    with pytest.raises(cfg.ParamsError) as err:
        cfg.environments(params)
    message = str(err.value)
    assert message.startswith(f"{params}: environments.support.mcp.shop.command: where a tool "
                              f"server runs moved to runtime.mcp.servers")
    assert ("runtime:\n  mcp:\n    servers:\n      shop: {command: python tools/shop_server.py, "
            "timeout: 10}\n      docs: {url: 'http://127.0.0.1:9000/mcp'}\n") in message
    assert message.endswith("keep under environments.support.mcp only what each server is: "
                            "{shop: {allow: [lookup_order]}, docs: {}}")
    # what it says to write loads, as the same servers
    fix = yaml.safe_load(message[message.index("runtime:"):message.index("and keep")])
    keep = yaml.safe_load(message.rsplit("what each server is: ", 1)[1])
    written["runtime"]["mcp"].update(fix["runtime"]["mcp"])
    written["environments"]["support"]["mcp"] = keep
    params.write_text(yaml.safe_dump(written, sort_keys=False))
    servers = cfg.environments(params)["support"].mcp
    assert servers == mcp_tools.check("m", old)


def test_a_server_an_environment_names_must_be_in_runtime_and_keys_are_checked(tmp_path):
    params = tmp_path / "params.yaml"

    def refused(environment: dict, runtime: dict, message: str):
        params.write_text(yaml.safe_dump({
            "environments": {"support": {"module": "m", "mcp": environment}},
            "runtime": {"mcp": {"servers": runtime}}}))
        with pytest.raises(cfg.ParamsError, match=message):
            cfg.environments(params)

    # named by the environment, missing where servers run: both keys, and what to write
    refused({"shop": {}}, {}, r"environments\.support\.mcp\.shop: runtime\.mcp\.servers\.shop "
                             r"is missing: say where the server runs there, e.g. `runtime: "
                             r"\{mcp: \{servers: \{shop: \{command: .*runtime\.mcp\.servers has "
                             r"no servers")
    refused({"shpo": {}}, {"shop": SERVER}, r"environments\.support\.mcp\.shpo: "
                                            r"runtime\.mcp\.servers\.shpo is missing \(did you "
                                            r"mean 'shop'\?\).*runtime\.mcp\.servers has shop")
    # unknown keys in either place, with the nearest; a key of the other place says where it goes
    refused({"shop": {"alow": []}}, {"shop": SERVER},
            r"unknown key 'environments\.support\.mcp\.shop\.alow' \(did you mean "
            r"'environments\.support\.mcp\.shop\.allow'\?\); valid keys: allow, version")
    refused({"shop": {}}, {"shop": {"comand": "python x.py"}},
            r"unknown key 'runtime\.mcp\.servers\.shop\.comand' \(did you mean "
            r"'runtime\.mcp\.servers\.shop\.command'\?\); valid keys: command, url, timeout, "
            r"memory_mb")
    refused({"shop": {}}, {"shop": {**SERVER, "allow": ["refund"]}},
            r"runtime\.mcp\.servers\.shop\.allow says what the server is, not where it runs: it "
            r"goes under environments\.<name>\.mcp\.shop\.allow")
    refused({"shop": {"version": 1.4}}, {"shop": SERVER},
            r"environments\.support\.mcp\.shop\.version: .*as a string \(quote it")
    params.write_text(yaml.safe_dump({"environments": {"support": {"module": "m"}},
                                      "runtime": {"mcp": {"server": {"shop": SERVER}}}}))
    with pytest.raises(cfg.ParamsError, match=r"unknown key 'runtime\.mcp\.server' \(did you "
                                              r"mean 'runtime\.mcp\.servers'\?\)"):
        cfg.environments(params)  # checked even where no environment names a server


def test_a_server_of_another_version_than_declared_is_refused_naming_both(project):
    """environments.<name>.mcp.<server>.version pins what the server is: a server that reports
    another serverInfo.version (the fixture reports 1.4.0) fails the stage when it starts it,
    naming the server, both versions and the key to change."""
    params = project / "params.yaml"

    def environment(pinned: dict):
        params.write_text(yaml.safe_dump({
            "environments": {"pinned": {"module": f"shop_env_{project.name}",
                                        "mcp": {"shop": pinned}}},
            "runtime": {"mcp": {"servers": {"shop": {**SERVER, "timeout": 5}}}}}))
        return cfg.environments(params)["pinned"]

    with pytest.raises(mcp_tools.McpError, match=r"MCP server 'shop' of environment 'pinned' "
                       r"\(python tests/fixtures/mcp/shop_server.py\): reports version 1\.4\.0, "
                       r"but environments\.pinned\.mcp\.shop\.version is 2\.0\.0; point "
                       r"runtime\.mcp\.servers\.shop at a server of version 2\.0\.0, or write "
                       r"environments\.pinned\.mcp\.shop\.version: \"1\.4\.0\""):
        contract.load_spec("pinned", environment({"version": "2.0.0"}), project)
    env = contract.load_spec("pinned", environment({"version": "1.4.0", "allow": ["refund"]}),
                             project)
    try:
        assert [t["function"]["name"] for t in env.tools] == ["greet", "refund"]
    finally:
        for servers in mcp_tools._OPEN.values():
            servers.close()
        mcp_tools._OPEN.clear()


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
    entry = {"module": "m", "mcp": {"docs": {}}}
    runtime = {"mcp": {"servers": {"docs": {"url": "http://127.0.0.1:9000/mcp"}, "shop": SERVER}}}
    params.write_text(yaml.safe_dump({"environments": {"support": entry}, "runtime": runtime}))
    with pytest.raises(cfg.ParamsError, match=r"environments\.support\.mcp\.docs: url "
                                              r"http://127.0.0.1:9000/mcp reaches a server over "
                                              r"the network \(runtime.mcp.servers.docs.url\).*"
                                              r"add `network: true` to environments\.support"):
        cfg.environments(params)
    params.write_text(yaml.safe_dump({"environments": {"support": {**entry, "network": True}},
                                      "runtime": runtime}))
    assert cfg.environments(params)["support"].network is True
    # a stdio server is local: no network asked
    params.write_text(yaml.safe_dump({"environments": {"support": {
        "module": "m", "mcp": {"shop": {}}}}, "runtime": runtime}))
    assert cfg.environments(params)["support"].network is False


@pytest.mark.parametrize("timeout", [30.0, 0.4])  # calls that wait, or time out one by one
def test_an_mcp_server_that_stalls_mid_stage_stops_it_by_name_within_the_stall_bound(
        tmp_path, timeout):
    """A server that answers 3 calls and then nothing (up, never replying): once it answered
    nothing for runtime.mcp.stall_seconds the call raises McpStalled, naming the server and
    what it answered, which stops the stage (a tool call's McpError only errs its episode: each
    episode after waited the call's `timeout` again); every call after fails at once."""
    server = {"flaky": {"command": f"{MISBEHAVING} stall 3", "timeout": timeout}}
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "environments": {"wedged": {"module": "wedged_env", "mcp": {"flaky": {}}}},
        "runtime": {"mcp": {"stall_seconds": 1.0, "servers": server}}}))
    cfg.environments(params)  # where a stage reads runtime.mcp for its process
    stalling = mcp_tools.Servers("wedged", mcp_tools.check("m", server), REPO)
    mcp_tools.STALL_SECONDS[0] = cfg.Mcp().stall_seconds  # the other tests' default again
    assert stalling.stall_seconds == 1.0
    try:
        assert [stalling.call("ping", {}) for _ in range(3)] == ["pong"] * 3
        started = time.monotonic()
        timed_out = 0
        with pytest.raises(mcp_tools.McpStalled, match=r"MCP server 'flaky' of environment "
                           r"'wedged' \(.*stall 3\): no answer for \d+ s \(runtime.mcp."
                           r"stall_seconds=1; waiting on tools/call ping\); it answered 3 calls"):
            while time.monotonic() - started < 20:
                try:
                    stalling.call("ping", {})
                except mcp_tools.McpStalled:
                    raise
                except mcp_tools.McpError:  # a call past its own timeout: the episode's error
                    timed_out += 1
        assert time.monotonic() - started < 10  # the bound, not 30 s, nor calls without end
        assert timed_out <= 3
        with pytest.raises(mcp_tools.McpStalled):
            stalling.call("ping", {})  # at once
    finally:
        stalling.close()



CALC_ENV = '''
from stages.envs import arith

TOOLS = []  # the calculator is the MCP server's (tests/fixtures/mcp/calc_server.py)
reward = arith.reward
'''


def test_a_rollout_whose_tool_server_stalls_fails_keeping_its_finished_episodes(tmp_path):
    """The arithmetic environment's calculator behind an MCP server that wedges mid-rollout: the
    stage fails within runtime.mcp.stall_seconds naming the server (not one episode error after
    another, each past the call's timeout of 30 s), its finished batches kept beside the output;
    rerun with the server restarted, it plays only the rest and the table is an unstalled run's."""
    import json
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages import rollout, tinylm
    from stages.envs import arith
    from stages.generation import chat
    from stages.training import warmstart

    # a very small chat model that has seen tool demonstrations, so it calls the tool
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
    warmstart.train(model, warmstart.demonstrations(template, arith, random.Random(0), 1.0, 32),
                    steps=25, lr=2e-2, tokenizer=tokenizer, seed=0)
    tinylm.save(model, tokenizer, tmp_path / "champion")
    (tmp_path / "calc_env.py").write_text(CALC_ENV)
    (tmp_path / "calc_server.py").write_text(
        (REPO / "tests/fixtures/mcp/calc_server.py").read_text())
    specs = {"arith": cfg.EnvironmentSpec(module="calc_env", mcp={"calc": {
        "command": "python calc_server.py", "timeout": 30.0}})}
    validated = tmp_path / "validated.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"trace_id": f"tr{i}", "question": json.dumps({**arith.chat_task(q),
                                                       "environment": "arith"})}
        for i, q in enumerate(["2*3", "1+1", "4+5", "7-2", "3*3", "8+1", "6*2", "9-3"])]),
        validated)
    config = cfg.Rollout(samples_per_task=1, batch_size=2, max_new_tokens=40)  # 4 batches

    def roll(out):
        try:
            return rollout.run(cfg.Base(), config, specs, tmp_path / "champion", out, tmp_path,
                               validated)
        finally:  # the stage's process ends, and its MCP sessions with it
            for servers in mcp_tools._OPEN.values():
                servers.close()
            mcp_tools._OPEN.clear()

    whole = tmp_path / "whole.parquet"
    roll(whole)
    # the calls that reached the server (not those the schema refused first), per episode
    calls = [row["tool_calls"] - row["tool_errors"] for row in pq.read_table(whole).to_pylist()]
    batches = [sum(calls[i:i + 2]) for i in range(0, len(calls), 2)]
    first = batches[0]  # the first batch's: the server wedges on the next call, in batch `b`
    b = next((b for b in range(1, len(batches)) if batches[b]), None)
    assert b is not None, calls
    (tmp_path / "stall_after.txt").write_text(str(first))
    mcp_tools.STALL_SECONDS[0] = 1.0  # runtime.mcp.stall_seconds, as cfg.environments sets it
    stopped = tmp_path / "stopped.parquet"
    started = time.monotonic()
    try:
        with pytest.raises(mcp_tools.McpStalled, match=rf"MCP server 'calc' of environment "
                           rf"'arith' .*no answer for \d+ s .*it answered {first} calls this "
                           rf"run.*\({2 * b} finished episodes are kept in stopped.parquet.partial"):
            roll(stopped)
    finally:
        mcp_tools.STALL_SECONDS[0] = cfg.Mcp().stall_seconds
    assert time.monotonic() - started < 25  # the bound (1 s), not the call's timeout (30 s)
    assert not stopped.exists() and len(pq.read_table(tmp_path / "stopped.parquet.partial")) == \
        2 * b
    (tmp_path / "stall_after.txt").unlink()  # the server restarted, well
    again = roll(stopped)
    assert again["resumed_episodes"] == 2 * b
    assert pq.read_table(stopped).equals(pq.read_table(whole))
