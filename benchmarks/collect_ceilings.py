"""How fast can any Python HTTP server take OTLP requests that it only decodes? The ceilings that
issue 20's goal (accepted spans/s >= 0.5x a bare decode loop) runs into, server by server.

    .venv/bin/python benchmarks/collect_ceilings.py                      # uvicorn only
    .venv/bin/python -m pip install --target /tmp/granian-pkgs granian   # apart: not a dependency
    .venv/bin/python benchmarks/collect_ceilings.py --granian /tmp/granian-pkgs

The same payloads and `raw` clients as benchmarks/collect.py (400,000 GenAI spans in requests of
512, 4 keep-alive clients sending pre-encoded requests). Each server's handler reads the body,
decodes it with `ExportTraceServiceRequest.ParseFromString` and answers 200 with nothing on disk:
bare ASGI on uvicorn (uvloop, httptools: no starlette), bare ASGI on granian (a Rust HTTP server),
and granian's own RSGI interface. Prints each run's spans/s against the loop's, by wall time and by
the server's CPU seconds (the server's process and its children, from /proc), and the disk's
write rate for as many bytes as the payloads, fsynced (`dd`): what a receiver that answers only
once the spans are on disk writes.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import collect as bench  # noqa: E402  (benchmarks/collect.py: payloads, clients, /proc readers)

APP = '''
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


async def asgi(scope, receive, send):
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    ExportTraceServiceRequest().ParseFromString(b"".join(chunks))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


async def rsgi(scope, protocol):
    ExportTraceServiceRequest().ParseFromString(await protocol())
    protocol.response_bytes(200, [], b"")
'''


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and all its descendants (granian serves from a child)."""
    pids, i = [pid], 0
    while i < len(pids):
        children = Path(f"/proc/{pids[i]}/task/{pids[i]}/children")
        pids += [int(p) for p in children.read_text().split()] if children.exists() else []
        i += 1
    return sum(bench.cpu_seconds(p) for p in pids if Path(f"/proc/{p}").exists())


def serve(command: list[str], port: int, env: dict, bodies: list[bytes], runs: int,
          loop_seconds: float, name: str) -> None:
    """Start the server, time `runs` bursts of every request against it, print a row each."""
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.1)
        for _ in range(runs):
            cpu = tree_cpu(server.pid)
            seconds, seen = bench.post_raw(f"http://127.0.0.1:{port}/v1/traces", bodies, 4)
            cpu = tree_cpu(server.pid) - cpu
            print(f"| {name} | {seconds:.3f} | {loop_seconds / seconds:.2f}x | {cpu:.2f} | "
                  f"{loop_seconds / cpu:.2f}x | {seen} |", flush=True)
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    """Time the loop, then each server's bursts; the disk's fsynced write rate last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=400_000, help="spans in all (default 400000)")
    parser.add_argument("--runs", type=int, default=3, help="runs against each server (default 3)")
    parser.add_argument("--granian", metavar="DIR",
                        help="a folder where granian is installed (pip install --target DIR granian)")
    args = parser.parse_args()

    bodies = bench.payloads(args.spans, 512)
    loop = min(bench.decode_loop(bodies)[0] for _ in range(3))
    print(f"decode loop: {loop:.3f} s, {args.spans / loop:,.0f} spans/s "
          f"({sum(map(len, bodies)) / 1e6:.0f} MB of requests)\n")
    print("| server | seconds | vs the loop | server CPU s | vs the loop's CPU | answers |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=bench.ROOT) as folder:  # the disk a workspace is on
        Path(folder, "decode_app.py").write_text(APP)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [folder, args.granian]))}
        port = bench.free_port()
        serve([sys.executable, "-c", "import uvicorn; uvicorn.run('decode_app:asgi', host='127.0.0.1', "
               f"port={port}, loop='uvloop', http='httptools', access_log=False, log_level='warning')"],
              port, env, bodies, args.runs, loop, "uvicorn, bare ASGI")
        if args.granian:
            for interface in ("asgi", "rsgi"):
                port = bench.free_port()
                serve([sys.executable, "-m", "granian", "--interface", interface, "--host", "127.0.0.1",
                       "--port", str(port), "--workers", "1", "--runtime-threads", "1", "--loop",
                       "uvloop", "--no-log", f"decode_app:{interface}"],
                      port, env, bodies, args.runs, loop, f"granian, {interface.upper()}")
        target = Path(folder, "dd")
        megabytes = max(1, sum(map(len, bodies)) // 2**20)
        out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}",
                              "conv=fdatasync"], capture_output=True, text=True).stderr
        print(f"\nthe disk, {megabytes} MB written and fsynced: {out.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
