"""MCP tools: an environment offers the tools of MCP servers, through the official `mcp` SDK.

Where a server runs and how fast it must answer is `runtime.mcp.servers.<server>` in params.yaml:
a stdio `command` (started inside the code sandbox's limits, no network unless the environment's
`network: true`) or a Streamable HTTP `url` (needs `network: true`), with `timeout` and
`memory_mb`; no stage lists `runtime:` as a DVC param, so moving a server reruns nothing. What it
is stays in the environment's `mcp:` entry, `environments.<name>.mcp.<server>`: `allow` (its tools
the agent may call) and `version` (the serverInfo.version it must report), DVC params of the
stages that use it. `join` puts the two together. Their `tools/list` join the module's TOOLS and
calls go to `tools/call`, one session per server per process. An `is_error` result is a
`ToolError` the agent sees; a timeout, a dead server or another version is an `McpError`, an
infrastructure failure, never a zero. A server that answers nothing for
`runtime.mcp.stall_seconds` (its calls in flight, or timing out one by one) is `McpStalled`: the
stage stops, naming it and the calls it answered. Writes nothing.

    python -m stages.envs.mcp_tools "python tools/shop_server.py"     # list a server's tools

Details: docs/environments.md, "MCP servers as tools (stages/envs/mcp_tools.py)".
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import difflib
import json
import shlex
import sys
import threading
import time
from concurrent.futures import CancelledError, wait
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import yaml

from stages.envs import sandbox
from stages.envs.errors import ToolError, VerifierError
from stages.remote import RemoteDown

DEFAULT_TIMEOUT = 30.0
DEFAULT_MEMORY_MB = 2048  # RLIMIT_AS of a stdio server: Python and the SDK take ~300 MB of it
# runtime.mcp.servers.<server>: where a server runs and how fast it must answer, which changes
# no result (no stage lists runtime: as a DVC param: moving a server reruns nothing)
WHERE = ("command", "url", "timeout", "memory_mb")
# environments.<name>.mcp.<server>: what it is, which the stages' results depend on
WHAT = ("allow", "version")
KEYS = {*WHERE, *WHAT}  # a server as `check` takes it: the two joined
# runtime.mcp.stall_seconds, set for this process by `config.environments` (where the
# environments, and so their servers, are read)
STALL_SECONDS = [300.0]


class McpError(VerifierError):
    """An MCP server failed (would not start, timed out, died): an infrastructure failure."""


class McpStalled(RemoteDown):
    """An MCP server answered nothing for `runtime.mcp.stall_seconds`: the stage stops (not one
    episode's error: every episode after would wait its timeout too).
    """


def check(where: str, servers) -> dict[str, dict]:
    """Servers as the stages use them (`join`'s result: where each runs and what it is), checked:
    {server: {command | url, timeout, memory_mb, allow, version}}.
    """
    if not isinstance(servers, dict):
        raise ValueError(f"{where}: expected a mapping of server names to {{command or url, "
                         f"allow, timeout}}, got {servers!r}")
    out = {}
    for name, spec in servers.items():
        at = f"{where}.{name}"
        if not isinstance(spec, dict):
            raise ValueError(f"{at}: expected {{command or url, allow, timeout}}, got {spec!r}")
        unknown = set(spec) - KEYS
        if unknown:
            raise ValueError(f"{at}: unknown key {sorted(unknown)[0]!r}; valid keys: "
                             f"{', '.join(sorted(KEYS))}")
        if bool(spec.get("command")) == bool(spec.get("url")):
            raise ValueError(f"{at}: give one of command (a stdio server to start) or url (a "
                             f"Streamable HTTP server)")
        allow = spec.get("allow") or []
        if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
            raise ValueError(f"{at}.allow: a list of tool names, got {allow!r}")
        version = spec.get("version", "")
        if not isinstance(version, str):  # YAML reads 1.10 as the number 1.1
            raise ValueError(f"{at}.version: the version the server reports, as a string (quote "
                             f"it: version: \"{version}\"), got {version!r}")
        timeout = spec.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"{at}.timeout: seconds > 0, got {timeout!r}")
        memory = spec.get("memory_mb", DEFAULT_MEMORY_MB)
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 64:
            raise ValueError(f"{at}.memory_mb: a whole number of MB >= 64, got {memory!r}")
        out[name] = {"command": spec.get("command") or "", "url": spec.get("url") or "",
                     "allow": allow, "version": version, "timeout": float(timeout),
                     "memory_mb": memory}
    return out


def _unknown(at: str, key: str, valid: tuple[str, ...]) -> str:
    near = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean '{at}.{near[0]}'?)" if near else ""
    return f"unknown key '{at}.{key}'{hint}; valid keys: {', '.join(valid)}"


def check_servers(servers) -> dict[str, dict]:
    """`runtime.mcp.servers`, checked: {server: {command | url, timeout, memory_mb}}, where each
    server runs; what it is (`allow`, `version`) is refused here, naming where it goes.
    """
    if not isinstance(servers, dict):
        raise ValueError(f"runtime.mcp.servers: expected a mapping of server names to {{command "
                         f"or url, timeout, memory_mb}}, got {servers!r}")
    for name, spec in servers.items():
        at = f"runtime.mcp.servers.{name}"
        if not isinstance(spec, dict):
            raise ValueError(f"{at}: expected {{command or url, timeout, memory_mb}}, got {spec!r}")
        for key in spec:
            if key in WHAT:
                raise ValueError(f"{at}.{key} says what the server is, not where it runs: it goes "
                                 f"under environments.<name>.mcp.{name}.{key} of each environment "
                                 f"that uses the server (a DVC param of its stages)")
            if key not in WHERE:
                raise ValueError(_unknown(at, key, WHERE))
    return check("runtime.mcp.servers", servers)


def join(env_name: str, entries: dict, servers: dict) -> dict[str, dict]:
    """Environment `env_name`'s `mcp:` entry ({server: {allow, version}}, `{}`: all its tools),
    checked, each server with where it runs (`servers`: runtime.mcp.servers), as `check` returns
    them. An entry in the old form (command, url, ... under the environment) is refused with the
    YAML to write instead.
    """
    where = f"environments.{env_name}.mcp"
    if not isinstance(entries, dict):
        raise ValueError(f"{where}: expected a mapping of server names (of runtime.mcp.servers) "
                         f"to {{allow, version}}, got {entries!r}")
    for name, spec in entries.items():
        if not isinstance(spec, dict):
            raise ValueError(f"{where}.{name}: expected {{allow, version}} ({{}}: all its tools), "
                             f"got {spec!r}")
    moved = {name: {key: spec[key] for key in WHERE if key in spec}
             for name, spec in entries.items()}
    moved = {name: keys for name, keys in moved.items() if keys}
    if moved:
        name = next(iter(moved))
        write = yaml.safe_dump({"runtime": {"mcp": {"servers": moved}}},
                               default_flow_style=None, sort_keys=False, width=1000)
        kept = {server: {key: spec[key] for key in spec if key in WHAT}
                for server, spec in entries.items()}
        keep = yaml.safe_dump(kept, default_flow_style=True, sort_keys=False, width=1000).strip()
        raise ValueError(
            f"{where}.{name}.{next(iter(moved[name]))}: where a tool server runs moved to "
            f"runtime.mcp.servers, which no stage lists as a DVC param (moving a server reruns "
            f"nothing); write in params.yaml (beside runtime.mcp.stall_seconds, if set)\n"
            f"{write}and keep under {where} only what each server is: {keep}")
    out = {}
    for name, spec in entries.items():
        for key in spec:
            if key not in WHAT:
                raise ValueError(_unknown(f"{where}.{name}", key, WHAT))
        if name not in servers:
            near = difflib.get_close_matches(str(name), [str(s) for s in servers], n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ValueError(
                f"{where}.{name}: runtime.mcp.servers.{name} is missing{hint}: say where the "
                f"server runs there, e.g. `runtime: {{mcp: {{servers: {{{name}: {{command: "
                f"python tools/{name}_server.py}}}}}}}}` (or {{url: ...}} for one already "
                f"running); runtime.mcp.servers has "
                f"{', '.join(map(str, servers)) or 'no servers'}")
        out[name] = {**servers[name], **spec}
    return check(where, out)


class Servers:
    """The MCP servers of one environment: their tools, and calls to them."""

    def __init__(self, env_name: str, servers: dict[str, dict], root: Path,
                 network: bool = False):
        """Servers as `check` returns them; `root`: where stdio commands start; `network`:
        whether its stdio servers may reach the network (`environments.<name>.network`).
        """
        self.env_name, self.servers, self.root = env_name, servers, root
        self.network = network
        self.loop: asyncio.AbstractEventLoop | None = None
        self.clients: dict[str, object] = {}
        self.owner: dict[str, str] = {}  # tool name -> server name
        self.schemas: list[dict] = []
        self._stop: asyncio.Event | None = None
        self._done: list = []
        # the stall watch, per server: since it last answered (or since a call went out when
        # none was in flight and the last had its answer), its calls in flight and answered,
        # and once stalled, why
        self.stall_seconds = STALL_SECONDS[0]
        self._watch = threading.Lock()
        self._quiet = dict.fromkeys(servers, 0.0)
        self._unanswered = dict.fromkeys(servers, False)
        self._in_flight = dict.fromkeys(servers, 0)
        self._answered = dict.fromkeys(servers, 0)
        self._stalled: dict[str, str] = {}

    def _where(self, server: str) -> str:
        spec = self.servers[server]
        return (f"MCP server {server!r} of environment {self.env_name!r} "
                f"({spec['command'] or spec['url']})")

    def start(self) -> Servers:
        """Open a session to every server and list its tools (once per process)."""
        if self.loop is not None:
            return self
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True,
                         name=f"mcp-{self.env_name}").start()
        self._stop = asyncio.Event()
        for name in self.servers:
            ready = asyncio.run_coroutine_threadsafe(self._hold(name), self.loop)
            self._done.append(ready)
            deadline = max(30.0, self.servers[name]["timeout"])
            try:
                while name not in self.clients:  # the holder stores its client when listed
                    if ready.done():
                        ready.result()  # raises what stopped it
                        raise McpError(f"{self._where(name)}: closed before listing its tools")
                    deadline -= 0.05
                    if deadline < 0:
                        raise McpError(f"{self._where(name)}: no session within 30 s")
                    threading.Event().wait(0.05)
            except McpError:
                self.close()
                raise
            except Exception as err:
                self.close()
                while isinstance(err, BaseExceptionGroup) and err.exceptions:  # anyio's groups
                    err = err.exceptions[0]
                if isinstance(err, McpError):
                    raise err from None
                hint = ("; install the MCP SDK: pip install -e '.[mcp]'"
                        if isinstance(err, ModuleNotFoundError) else "")
                raise McpError(f"{self._where(name)}: cannot start or connect: "
                               f"{type(err).__name__}: {err}{hint}") from err
        atexit.register(self.close)
        return self

    async def _hold(self, name: str) -> None:
        """Own one server's session for the life of the process (anyio wants the same task to
        enter and leave it), publishing its client and tools, until close().
        """
        from mcp import Client, StdioServerParameters

        spec = self.servers[name]
        if spec["command"]:
            argv = shlex.split(spec["command"])
            if argv and argv[0] in ("python", "python3"):
                argv[0] = sys.executable  # the project's interpreter, as DVC's commands use
                script = next((a for a in argv[1:] if not a.startswith("-")), "")
                if script.endswith(".py") and not (self.root / script).is_file():
                    # else the SDK says only "Connection closed"
                    raise McpError(f"{self._where(name)}: {script} is not a file in {self.root}")
            # inside the sandbox's limits: its memory, no network unless the environment's
            argv = sandbox.server_prefix(spec["memory_mb"], self.network) + argv
            target = StdioServerParameters(command=argv[0], args=argv[1:], cwd=str(self.root))
        else:
            target = spec["url"]
        async with Client(target, read_timeout_seconds=spec["timeout"]) as client:
            if spec["version"]:  # what the stages' results were computed with: that server only
                info = client.server_info  # its initialize result's serverInfo
                reported = info.version if info is not None else ""
                if reported != spec["version"]:
                    key = f"environments.{self.env_name}.mcp.{name}.version"
                    raise McpError(
                        f"{self._where(name)}: reports version {reported or '(none)'}, but {key} "
                        f"is {spec['version']}; point runtime.mcp.servers.{name} at a server of "
                        f"version {spec['version']}, or write {key}: \"{reported}\" if that "
                        f"version is the one to use (the stages that use it then rerun)")
            listed = await client.list_tools()
            for tool in listed.tools:
                if spec["allow"] and tool.name not in spec["allow"]:
                    continue
                if tool.name in self.owner:
                    raise McpError(f"{self._where(name)}: tool {tool.name!r} is also offered by "
                                   f"server {self.owner[tool.name]!r}; allow it on one only")
                self.owner[tool.name] = name
                self.schemas.append({"type": "function", "function": {
                    "name": tool.name, "description": tool.description or tool.name,
                    "parameters": tool.input_schema or {"type": "object"}}})
            missing = set(spec["allow"]) - {t.name for t in listed.tools}
            if missing:
                raise McpError(f"{self._where(name)}: allow names {sorted(missing)}, which the "
                               f"server does not offer (it offers "
                               f"{sorted(t.name for t in listed.tools)})")
            self.clients[name] = client
            await self._stop.wait()

    def tools(self) -> list[dict]:
        """The servers' allowed tools as OpenAI function schemas."""
        return list(self.start().schemas)

    def offers(self, name: str) -> bool:
        """Whether a server offers the tool `name`."""
        return name in self.start().owner

    def call(self, name: str, arguments: dict) -> str:
        """One tools/call: the text of the result; ToolError when the server marks it an error
        (the agent sees it); McpError when the server times out or is gone.
        """
        self.start()
        server = self.owner[name]
        timeout = self.servers[server]["timeout"]
        with self._watch:
            if server in self._stalled:  # every call after the stall fails at once
                raise McpStalled(self._stalled[server])
            if not self._in_flight[server] and not self._unanswered[server]:
                self._quiet[server] = time.monotonic()
            self._in_flight[server] += 1
        failed = None  # the McpError of a call that failed
        answered = False  # the server said something (a result, an error): it is not stalled
        try:
            future = asyncio.run_coroutine_threadsafe(
                self.clients[server].call_tool(name, arguments, read_timeout_seconds=timeout),
                self.loop)
            began = time.monotonic()
            # polled, so that the stall bound holds whatever `timeout` says
            while not wait([future], timeout=min(1.0, self.stall_seconds / 4)).done:
                self._check_stall(server, name, future)
                if time.monotonic() - began > timeout + 5:
                    future.cancel()
                    break
            try:
                result = future.result(0)
                answered = True
            except (FutureTimeout, TimeoutError, CancelledError):
                failed = McpError(f"{self._where(server)}: tools/call {name} gave no answer "
                                  f"within {timeout:g} s (its `timeout`)")
            except Exception as err:
                text = str(err) or type(err).__name__
                answered = "timed out" not in text
                failed = McpError(f"{self._where(server)}: tools/call {name} gave no answer "
                                  f"within {timeout:g} s (its `timeout`)" if not answered else
                                  f"{self._where(server)}: tools/call {name} failed: "
                                  f"{type(err).__name__}: {text}")
                failed.__cause__ = err
        finally:
            with self._watch:
                self._in_flight[server] -= 1
                self._unanswered[server] = not answered
                if answered:
                    self._answered[server] += 1
                    self._quiet[server] = time.monotonic()
        if not answered:  # a call that timed out: its silence counts against the bound
            self._check_stall(server, name, None)
        if failed is not None:
            raise failed
        text = "\n".join(getattr(part, "text", "") or json.dumps(part.model_dump(mode="json"))
                         for part in result.content)
        if result.is_error:
            raise ToolError(text or f"{name} failed")
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content)
        return text

    def _check_stall(self, server: str, name: str, future) -> None:
        """McpStalled once `server` has answered nothing for `stall_seconds` (`future`, the call
        waited on, is cancelled).
        """
        with self._watch:
            quiet = time.monotonic() - self._quiet[server]
            if server not in self._stalled and quiet >= self.stall_seconds:
                self._stalled[server] = (
                    f"{self._where(server)}: no answer for {quiet:.0f} s (runtime.mcp."
                    f"stall_seconds={self.stall_seconds:g}; waiting on tools/call {name}); it "
                    f"answered {self._answered[server]} calls this run. The server is up but "
                    f"wedged, or overloaded: restart it (or raise runtime.mcp.stall_seconds for "
                    f"tools that are slow, not stuck) and run the stage again")
            stalled = self._stalled.get(server)
        if stalled:
            if future is not None:
                future.cancel()
            raise McpStalled(stalled)

    def close(self) -> None:
        """End every session (stdio servers exit with it)."""
        if self.loop is None or self._stop is None:
            return
        loop, self.loop = self.loop, None
        loop.call_soon_threadsafe(self._stop.set)
        for done in self._done:
            try:
                done.result(10)
            except Exception:  # noqa: BLE001 (a server that died is closed already)
                pass
        loop.call_soon_threadsafe(loop.stop)


_OPEN: dict[tuple, Servers] = {}


def servers_of(env_name: str, servers: dict, root: Path, network: bool = False) -> Servers:
    """The (one per process) Servers of an environment: its `spec.mcp` as `config.environments`
    gives it (`join`: where each server runs and what it is).
    """
    key = (env_name, json.dumps(servers, sort_keys=True), str(root), network)
    if key not in _OPEN:
        _OPEN[key] = Servers(env_name, check(f"environments.{env_name}.mcp", servers), root,
                             network)
    return _OPEN[key]


def main(argv: list[str] | None = None) -> None:
    """List a server's tools (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", help="a stdio command (quoted) or an http(s) URL")
    args = parser.parse_args(argv)
    key = "url" if args.server.startswith(("http://", "https://")) else "command"
    try:
        found = Servers("cli", check("server", {"server": {key: args.server}}), Path.cwd())
        try:
            print(json.dumps(found.tools(), indent=2))
        finally:
            found.close()
    except (McpError, ValueError) as err:
        print(f"mcp_tools: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
