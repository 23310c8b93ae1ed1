"""`offseason collect` against a bare `opentelemetry-proto` decode loop of the same payloads, and
100,000 collected traces end to end through the ingest stage.

    .venv/bin/python benchmarks/collect.py     # 400,000 spans = 100,000 traces; goal >= 0.5x the loop

Builds `--spans` GenAI spans (agent turns of one `invoke_agent` root and three `chat` spans with
their messages, about 500 bytes a span) into OTLP/HTTP protobuf requests of `--batch` spans, as a
BatchSpanProcessor sends them. Then times (1) the baseline: `ExportTraceServiceRequest`
`.ParseFromString` over every request in one loop; (2) the HTTP ceiling: the same uvicorn +
starlette server as collect's (uvloop, httptools) with a handler that only decodes; (3) the
receiver: `offseason collect` started in a temporary workspace (this checkout's code). (2) and (3)
each with two kinds of `--clients` concurrent clients, on the same cores as the server: `requests`,
threads with a `requests` session each as the SDK's exporter, and `raw`, threads sending each
request pre-encoded on a keep-alive socket (what a C load generator costs: little CPU). Spans/s
count from the first request to the last 200 (collect answers only once journaled and fsynced);
the server's CPU seconds meanwhile (/proc) are compared with the loop's, a figure the load of
other work on the machine moves less. Each is the best of `--repeat` runs. The last `raw` run of
collect goes on until every trace is in an inbox file, then the ingest stage reads those files in
a process of its own (its peak memory: getrusage's maxrss). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from flows.intake import collect
from stages import config as cfg
from stages import ingest

ROOT = Path(__file__).resolve().parents[1]


def attribute(key: str, value: str) -> KeyValue:
    """A string span attribute."""
    return KeyValue(key=key, value=AnyValue(string_value=value))


def turn(i: int) -> list[Span]:
    """One agent turn: a root span and three chat spans (a tool call, its result, the answer)."""
    trace_id, root_id = i.to_bytes(16, "big"), (i * 4 + 1).to_bytes(8, "big")
    user = {"role": "user", "parts": [{"type": "text", "content": f"What is {i} * 17? I need "
                                       f"it for invoice INV-{i:08d}, please be exact."}]}
    call = {"role": "assistant", "parts": [{"type": "tool_call", "id": f"call_{i}",
                                            "name": "calculator",
                                            "arguments": {"expression": f"{i}*17"}}]}
    result = {"role": "tool", "parts": [{"type": "tool_call_response", "id": f"call_{i}",
                                         "response": str(i * 17)}]}
    answer = {"role": "assistant", "parts": [{"type": "text", "content": f"{i} x 17 = {i * 17}."}]}
    start = 1_764_000_000_000_000_000 + i * 1_000_000
    spans = [Span(trace_id=trace_id, span_id=root_id, name="invoke_agent calc", kind=1,
                  start_time_unix_nano=start, end_time_unix_nano=start + 900_000,
                  attributes=[attribute("gen_ai.operation.name", "invoke_agent")])]
    for n, (inputs, outputs) in enumerate((([user], [call]), ([user, call, result], [answer]),
                                           ([user, call, result, answer], [answer]))):
        spans.append(Span(
            trace_id=trace_id, span_id=(i * 4 + 2 + n).to_bytes(8, "big"), parent_span_id=root_id,
            name="chat tiny", kind=3, start_time_unix_nano=start + n * 200_000,
            end_time_unix_nano=start + n * 200_000 + 150_000,
            attributes=[attribute("gen_ai.operation.name", "chat"),
                        attribute("gen_ai.request.model", "tiny"),
                        attribute("gen_ai.input.messages", json.dumps(inputs)),
                        attribute("gen_ai.output.messages", json.dumps(outputs))]))
    return spans[1:] + spans[:1]  # children end first: the root comes last, as SDKs export it


def payloads(n_spans: int, batch: int) -> list[bytes]:
    """Serialized ExportTraceServiceRequests of `batch` spans each, `n_spans` in all."""
    spans = [span for i in range(1, n_spans // 4 + 1) for span in turn(i)]
    resource = ResourceSpans().resource
    resource.attributes.append(attribute("service.name", "calc-agent"))
    out = []
    for at in range(0, len(spans), batch):
        request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource=resource, scope_spans=[ScopeSpans(spans=spans[at:at + batch])])])
        out.append(request.SerializeToString())
    return out


def decode_loop(bodies: list[bytes]) -> tuple[float, int]:
    """Seconds to decode every body, and the spans found (the baseline)."""
    started, spans = time.perf_counter(), 0
    for body in bodies:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
    return time.perf_counter() - started, spans


def post_all(url: str, bodies: list[bytes], clients: int) -> tuple[float, dict]:
    """Seconds until every body was answered 200 by `clients` threads, each a `requests` session
    as the SDK's OTLP/HTTP exporter is (429/503 retried after Retry-After), and the count of each
    status seen.
    """
    seen: dict[int, int] = {}
    queue = list(reversed(bodies))

    def client() -> None:
        with requests.Session() as http:
            while queue:
                body = queue.pop()
                while True:
                    answer = http.post(url, data=body, timeout=60,
                                       headers={"Content-Type": "application/x-protobuf"})
                    seen[answer.status_code] = seen.get(answer.status_code, 0) + 1
                    if answer.status_code == 200:
                        break
                    if answer.status_code not in (429, 503):
                        raise SystemExit(f"{url} answered {answer.status_code}: {answer.text}")
                    time.sleep(float(answer.headers.get("retry-after", 1)))

    return _run_clients(client, clients, seen)


def post_raw(url: str, bodies: list[bytes], clients: int) -> tuple[float, dict]:
    """As `post_all`, with clients that cost little CPU: each request encoded whole beforehand
    (headers and body) and sent with one `sendall` on a keep-alive socket, the answer read with
    no more parsing than its status and length (a load generator's work, not an SDK's).
    """
    host, port = url.split("//")[1].split("/")[0].split(":")
    path = "/" + url.split("//")[1].split("/", 1)[1]
    queue = [f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/x-protobuf\r\n"
             f"Content-Length: {len(body)}\r\n\r\n".encode() + body for body in reversed(bodies)]
    seen: dict[int, int] = {}

    def client() -> None:
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending = b""
            while queue:
                request = queue.pop()
                while True:
                    sock.sendall(request)
                    while b"\r\n\r\n" not in pending:
                        pending += sock.recv(65536)
                    head, _, pending = pending.partition(b"\r\n\r\n")
                    status, length = int(head[9:12]), 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    while len(pending) < length:
                        pending += sock.recv(65536)
                    pending = pending[length:]
                    seen[status] = seen.get(status, 0) + 1
                    if status == 200:
                        break
                    if status not in (429, 503):
                        raise SystemExit(f"{url} answered {status}")
                    time.sleep(5)

    return _run_clients(client, clients, seen)


def _run_clients(client, clients: int, seen: dict) -> tuple[float, dict]:
    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, seen


CLIENTS = {"requests": post_all, "raw": post_raw}


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process (all its threads) used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_mb(pid: int) -> float:
    """A running process's peak resident memory (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmHWM for process {pid}")


def decode_only(port: int) -> None:
    """The HTTP ceiling: the same server (uvicorn + starlette) whose handler only decodes."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def traces(request) -> Response:
        ExportTraceServiceRequest().ParseFromString(await request.body())
        return Response(b"", 200, media_type="application/x-protobuf")

    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    print("listening", flush=True)
    uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])]),
                                  log_level="warning", **collect.FAST)).run(sockets=[sock])


def ingest_child(inbox: Path, work: Path) -> None:
    """The ingest stage on `inbox`, in this (fresh) process: prints its seconds, accepted traces
    and the process's peak memory (MB) as JSON.
    """
    started = time.perf_counter()
    metrics = ingest.run(cfg.Ingest(), inbox, work / "traces", work / "ingested.parquet",
                         work / "quarantine.jsonl")
    seconds = time.perf_counter() - started
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child started
    # from this benchmark (holding its payloads) would report the benchmark's peak as its own
    print(json.dumps({"seconds": seconds, "accepted": metrics["accepted"],
                      "peak_mb": peak_mb(os.getpid()),
                      "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def workspace(folder: Path, spans: int) -> Path:
    """A temporary workspace for `offseason collect` (this checkout's dvc.yaml and params.yaml)."""
    (folder / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["runtime"]["collect"]["max_pending_spans"] = 10 * spans  # never sheds here
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return folder


def receive(command: list[str], cwd: Path | None, bodies: list[bytes], client: str,
            clients: int) -> tuple[subprocess.Popen, int, float, tuple[float, float], dict]:
    """Start a server (`command` plus `--port <port>`, which prints "listening" once it does), post
    every body with `client`; the running server, its port, the seconds until the last 200, the
    server's and the clients' CPU seconds meanwhile, and the statuses seen.
    """
    port = free_port()
    server = subprocess.Popen(command + [str(port)], cwd=cwd, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "listening" in server.stdout.readline()
    cpu, mine = cpu_seconds(server.pid), time.process_time()
    seconds, seen = CLIENTS[client](f"http://127.0.0.1:{port}/v1/traces", bodies, clients)
    return (server, port, seconds, (cpu_seconds(server.pid) - cpu, time.process_time() - mine),
            seen)


def main() -> None:
    """Time the decode loop, the HTTP ceiling and `offseason collect` on the same requests, with
    both clients, best of `--repeat`; then the inbox and ingest; print the tables.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=400_000,
                        help="spans in all, 4 a trace (default 400000: 100,000 traces)")
    parser.add_argument("--batch", type=int, default=512,
                        help="spans per request (default 512, the SDK's OTEL_BSP_MAX_EXPORT_BATCH_SIZE)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of each measurement, the best kept (default 2)")
    parser.add_argument("--decode-only-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ingest-child", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("port", nargs="?", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_only_server:  # the ceiling's server, run by this script in a child process
        decode_only(args.port)
        return
    if args.ingest_child:
        ingest_child(*args.ingest_child)
        return
    bodies = payloads(args.spans, args.batch)
    size = sum(map(len, bodies))
    best: dict[tuple[str, str], tuple[float, tuple]] = {}  # (what, client): (seconds, cpus)
    answers: dict[str, dict] = {}

    def keep(key: tuple[str, str], seconds: float, cpu: tuple) -> None:
        if key not in best or seconds < best[key][0]:
            best[key] = (seconds, cpu)

    loads = [os.getloadavg()[0]]
    for repeat in range(args.repeat):
        cpu = time.process_time()
        seconds, spans = decode_loop(bodies)
        keep(("loop", ""), seconds, (time.process_time() - cpu, 0.0))
        for client in CLIENTS:
            server, _, seconds, cpu, _ = receive(
                [sys.executable, __file__, "--decode-only-server"], None, bodies, client,
                args.clients)
            server.terminate()
            server.wait()
            keep(("ceiling", client), seconds, cpu)
        for client in CLIENTS:
            last = repeat == args.repeat - 1 and client == "raw"
            with tempfile.TemporaryDirectory() as tmp:
                work = workspace(Path(tmp), args.spans)
                server, port, seconds, cpu, answers[client] = receive(
                    [sys.executable, "-m", "flows.cli", "collect", "--port"], work, bodies,
                    client, args.clients)
                keep(("collect", client), seconds, cpu)
                if not last:  # what it holds stays in its journal, thrown away with the folder
                    server.kill()
                    server.wait()
                    continue
                try:  # the last run goes on: every trace into the inbox, then ingest
                    started = time.perf_counter()
                    while True:
                        status = requests.get(f"http://127.0.0.1:{port}/status", timeout=10).json()
                        if status["traces_written"] >= spans // 4:
                            break
                        time.sleep(0.1)
                    writing = time.perf_counter() - started
                    collect_peak = peak_mb(server.pid)
                finally:
                    server.terminate()
                    server.wait()
                accepting = seconds
                inbox = work / "data" / "inbox"
                files = [p for p in inbox.iterdir() if not p.name.startswith(".")]
                inbox_mb = sum(p.stat().st_size for p in files) / 1e6
                child = subprocess.run([sys.executable, __file__, "--ingest-child", str(inbox),
                                        str(work)], capture_output=True, text=True, check=True,
                                       env={**os.environ, "PYTHONPATH": str(ROOT)})
                ingested = json.loads(child.stdout.splitlines()[-1])
                assert ingested["accepted"] == spans // 4, ingested
        loads.append(os.getloadavg()[0])
    baseline, (baseline_cpu, _) = best[("loop", "")]
    print(f"\n{spans:,} spans ({spans // 4:,} traces) in {len(bodies)} requests of {args.batch} "
          f"spans, {size / 1e6:.0f} MB of protobuf; {args.clients} clients; best of "
          f"{args.repeat}; load average (1 min) {', '.join(f'{x:.1f}' for x in loads)}; "
          f"collect's answers {answers}\n")
    print("| what | client | seconds | spans/s | vs the decode loop | server CPU s | "
          "vs the loop's CPU | clients' CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| `ExportTraceServiceRequest.ParseFromString` loop (baseline) | - | {baseline:.2f} | "
          f"{spans / baseline:,.0f} | 1.00x | {baseline_cpu:.3f} | 1.00x | - |")
    names = {"ceiling": "uvicorn + starlette, the handler only decoding (the HTTP ceiling)",
             "collect": "`offseason collect`: accepted (200, journaled, fsynced)"}
    for what in ("ceiling", "collect"):
        for client in CLIENTS:
            seconds, (cpu, theirs) = best[(what, client)]
            print(f"| {names[what]} | {client} | {seconds:.2f} | {spans / seconds:,.0f} | "
                  f"{baseline / seconds:.2f}x | {cpu:.3f} | {baseline_cpu / cpu:.2f}x | "
                  f"{theirs:.2f} |")
    print(f"\nEnd to end (the last `raw` run): {spans // 4:,} traces accepted in {accepting:.1f} "
          f"s, all in the inbox {writing:.1f} s after the last 200 ({len(files)} files, "
          f"{inbox_mb:.0f} MB); collect's peak memory {collect_peak:,.0f} MB.\n")
    print("| step | seconds | traces/s | peak memory (MB) |")
    print("|---|---|---|---|")
    total = accepting + writing
    print(f"| collect: first request to every trace in the inbox | {total:.1f} | "
          f"{spans // 4 / total:,.0f} | {collect_peak:,.0f} |")
    print(f"| ingest stage on those files (own process, imports not timed) | "
          f"{ingested['seconds']:.1f} | {ingested['accepted'] / ingested['seconds']:,.0f} | "
          f"{ingested['peak_mb']:,.0f} |")
    print("\n(peak memory: each process's VmHWM; ingest's getrusage ru_maxrss read "
          f"{ingested['ru_maxrss_mb']:,.0f} MB, this benchmark's own peak carried across exec)")


if __name__ == "__main__":
    main()
