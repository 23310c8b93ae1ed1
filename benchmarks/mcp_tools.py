"""MCP tool calls per second through offseason against a bare `mcp` client loop.

The stdio server of the tests (tests/fixtures/mcp/shop_server.py, the `mcp` SDK's MCPServer)
answers `lookup_order`. The same calls go through `stages.envs.contract.call` on an environment
with that server (`contract.load_spec`: the arguments checked against the server's schema, the
call made from a synchronous rollout thread onto the session's event loop) and through the SDK's
own `Client.call_tool` awaited in a loop, one call at a time each, over one session each.

    .venv/bin/python benchmarks/mcp_tools.py --calls 500
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import config as cfg  # noqa: E402
from stages.envs import contract  # noqa: E402

SERVER = "tests/fixtures/mcp/shop_server.py"


async def bare(calls: int) -> float:
    """Calls per second of the SDK's client, awaited one after another."""
    from mcp import Client, StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=[SERVER], cwd=str(ROOT))
    async with Client(params) as client:
        await client.call_tool("lookup_order", {"order_id": "42"})  # warm
        started = time.perf_counter()
        for _ in range(calls):
            await client.call_tool("lookup_order", {"order_id": "42"})
        return calls / (time.perf_counter() - started)


def ours(calls: int) -> float:
    """Calls per second through contract.call on an environment with the server."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "bench_env.py").write_text(
            "TOOLS = []\n\ndef reward(task, messages):\n    return 1.0\n")
        spec = cfg.EnvironmentSpec(module="bench_env", mcp={"shop": {
            "command": f"python {ROOT / SERVER}", "timeout": 30}})
        env = contract.load_spec("bench", spec, tmp)
        task = {"task_id": "t", "messages": []}
        contract.call(env, task, "lookup_order", '{"order_id": "42"}')  # warm
        started = time.perf_counter()
        for _ in range(calls):
            contract.call(env, task, "lookup_order", '{"order_id": "42"}')
        return calls / (time.perf_counter() - started)


def main() -> None:
    """Alternate the two, twice, and print the better of each as a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per measurement")
    args = parser.parse_args()
    rows = [(anyio.run(bare, args.calls), ours(args.calls)) for _ in range(2)]
    b, o = max(r[0] for r in rows), max(r[1] for r in rows)
    print(f"| what | calls/s | vs bare |\n|---|---|---|\n"
          f"| bare `mcp.Client.call_tool` loop (baseline) | {b:.0f} | 1.00 |\n"
          f"| `contract.call` on an environment's MCP server | {o:.0f} | {o / b:.2f} |")


if __name__ == "__main__":
    main()
