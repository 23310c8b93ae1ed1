"""`offseason collect` against a bare `opentelemetry-proto` decode loop of the same payloads.

    .venv/bin/python benchmarks/collect.py --spans 200000     # the issue's goal: >= 0.5x the loop

Builds `--spans` GenAI spans (agent turns of one `invoke_agent` root and three `chat` spans with
their messages, about 500 bytes a span) into OTLP/HTTP protobuf requests of `--batch` spans, as a
BatchSpanProcessor sends them. Then times (1) the baseline: `ExportTraceServiceRequest`
`.ParseFromString` over every request in one loop, and (2) the receiver: `offseason collect` started
in a temporary workspace (this checkout's code), `--clients` concurrent clients posting the
same requests; spans/s counts from the first request to the last 200 (each acknowledged only once
journaled and fsynced), then the time until every trace is in an inbox file, and the ingest stage
on those files (the end to end of a cycle's first step). Between the first two, the
HTTP ceiling: the same uvicorn + starlette server and clients, with a handler that only decodes.
Clients are threads with a `requests` session each, as the SDK's exporter; they run on the same
cores as the receiver. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
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

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, seen


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
                                  log_level="warning")).run(sockets=[sock])


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    """Time the decode loop and `offseason collect` on the same requests; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=200_000, help="spans in all (default 200000)")
    parser.add_argument("--batch", type=int, default=512,
                        help="spans per request (default 512, the SDK's OTEL_BSP_MAX_EXPORT_BATCH_SIZE)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--decode-only-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_only_server:  # the ceiling's server, run by this script in a child process
        decode_only(args.decode_only_server)
        return
    bodies = payloads(args.spans, args.batch)
    size = sum(map(len, bodies))
    baseline, spans = decode_loop(bodies)
    port = free_port()
    ceiling = subprocess.Popen([sys.executable, __file__, "--decode-only-server", str(port)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in ceiling.stdout.readline()
        http_only, _ = post_all(f"http://127.0.0.1:{port}/v1/traces", bodies, args.clients)
    finally:
        ceiling.terminate()
        ceiling.wait()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
        params = yaml.safe_load((ROOT / "params.yaml").read_text())
        params["runtime"]["collect"]["max_pending_spans"] = 10 * args.spans  # never sheds here
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        port = free_port()
        receiver = subprocess.Popen([sys.executable, "-m", "flows.cli", "collect", "--port",
                                     str(port)], cwd=work, stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert "listening" in receiver.stdout.readline()
            seconds, seen = post_all(f"http://127.0.0.1:{port}/v1/traces", bodies, args.clients)
            started = time.perf_counter()
            while True:
                status = requests.get(f"http://127.0.0.1:{port}/status", timeout=10).json()
                if status["traces_written"] >= spans // 4:
                    break
                time.sleep(0.1)
            written = seconds + time.perf_counter() - started
        finally:
            receiver.terminate()
            receiver.wait()
        inbox = work / "data" / "inbox"
        files = len([p for p in inbox.iterdir() if not p.name.startswith(".")])
        started = time.perf_counter()
        metrics = ingest.run(cfg.Ingest(), inbox, work / "traces", work / "ingested.parquet",
                             work / "quarantine.jsonl")
        ingest_seconds = time.perf_counter() - started
        assert metrics["accepted"] == spans // 4, metrics
    print(f"\n{spans:,} spans ({spans // 4:,} traces) in {len(bodies)} requests of {args.batch} "
          f"spans, {size / 1e6:.0f} MB of protobuf; {args.clients} clients; answers {seen}\n")
    print("| what | seconds | spans/s | vs the decode loop |")
    print("|---|---|---|---|")
    print(f"| `ExportTraceServiceRequest.ParseFromString` loop (baseline) | {baseline:.2f} | "
          f"{spans / baseline:,.0f} | 1.00x |")
    print(f"| the same HTTP server and clients, the handler only decoding (the HTTP ceiling) | "
          f"{http_only:.2f} | {spans / http_only:,.0f} | {baseline / http_only:.2f}x |")
    print(f"| `offseason collect`: accepted (200, journaled, fsynced) | {seconds:.2f} | "
          f"{spans / seconds:,.0f} | {baseline / seconds:.2f}x |")
    print(f"| `offseason collect`: every trace in an inbox file | {written:.2f} | "
          f"{spans / written:,.0f} | {baseline / written:.2f}x |")
    print(f"\nThen the ingest stage on those {files} inbox files: {metrics['accepted']:,} traces "
          f"accepted in {ingest_seconds:.1f} s, {metrics['accepted'] / ingest_seconds:,.0f} "
          f"traces/s (imports not counted).")


if __name__ == "__main__":
    main()
