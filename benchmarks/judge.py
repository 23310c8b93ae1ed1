"""Judge calls per second through `stages.envs.judge` against a bare HTTP loop, and the cache.

A scripted OpenAI-compatible server (its own process, loopback) answers every request with the
same JSON judgment. The same N judgments go through `Judge.score` (prompt building, the JSON-schema
request, parsing, checks, the cache written as it is paid for) and through a bare `httpx.Client`
loop of the same request body, one at a time each, both keeping their connections; then `Judge.score` again over the same episodes from
a fresh process's view of the cache (the rerun: every judgment a hit).

    .venv/bin/python benchmarks/judge.py --judgments 500               # a judge answering at once
    .venv/bin/python benchmarks/judge.py --judgments 100 --latency 0.05
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.envs import judge  # noqa: E402

ANSWER = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": json.dumps({"reasoning": "fine", "score": 0.8})}}],
    "usage": {"prompt_tokens": 90, "completion_tokens": 10, "total_tokens": 100}}).encode()


class Handler(BaseHTTPRequestHandler):
    """The scripted judge: the same JSON judgment for every request, after `latency` seconds."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        """Quiet."""

    def setup(self):
        """Keep-alive connections without Nagle's delay."""
        super().setup()  # headers and body go out as two writes: no Nagle delay between them
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    latency = 0.0

    def do_POST(self):  # noqa: N802
        """Answer a chat completion request."""
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.latency)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)


def serve(port: int, latency: float) -> None:
    """Serve the scripted judge on loopback until killed."""
    Handler.latency = latency
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    """Run the comparison and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judgments", type=int, default=300, help="judgments per row")
    parser.add_argument("--latency", type=float, default=0.0,
                        help="seconds the scripted judge takes per answer (a real one: 0.1 to 2)")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = multiprocessing.Process(target=serve, args=(port, args.latency), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}/v1"
    import httpx

    deadline = time.time() + 10
    while True:
        try:
            httpx.post(f"{url}/chat/completions", json={}, timeout=1)
            break
        except httpx.HTTPError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    task = {"task_id": "t", "messages": [{"role": "user", "content": "What is 2+2?"}]}
    episodes = [task["messages"] + [{"role": "assistant", "content": f"answer {i}"}]
                for i in range(args.judgments)]
    with tempfile.TemporaryDirectory() as tmp:
        made = judge.Judge(url=url, model="m", rubric="1 if correct", cache_dir=Path(tmp))
        body = {"model": "m", "temperature": 0.0, "messages": [
            {"role": "system", "content": judge.INSTRUCTIONS + "1 if correct"},
            {"role": "user", "content": judge._conversation(episodes[0])}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "judgment", "schema": judge.POINTWISE, "strict": True}}}
        rows = []
        client = httpx.Client(timeout=60)  # a bare client keeps its connections too
        for turn in range(2):  # alternate, so neither gets the warmer machine
            started = time.perf_counter()
            for _ in episodes:
                json.loads(client.post(f"{url}/chat/completions", json=body)
                           .json()["choices"][0]["message"]["content"])
            bare = args.judgments / (time.perf_counter() - started)
            made = judge.Judge(url=url, model="m", rubric=f"1 if correct {turn}",
                               cache_dir=Path(tmp))
            started = time.perf_counter()
            for episode in episodes:
                made.score(task, episode)
            ours = args.judgments / (time.perf_counter() - started)
            rows.append((bare, ours))
        rerun = judge.Judge(url=url, model="m", rubric="1 if correct 1", cache_dir=Path(tmp))
        started = time.perf_counter()
        for episode in episodes:
            rerun.score(task, episode)
        cached = args.judgments / (time.perf_counter() - started)
    server.terminate()
    bare, ours = max(r[0] for r in rows), max(r[1] for r in rows)
    print(f"| what | judgments/s | vs bare |\n|---|---|---|\n"
          f"| bare `httpx.Client` loop, same request (baseline) | {bare:.0f} | 1.00 |\n"
          f"| `Judge.score` (cache written per judgment) | {ours:.0f} | {ours / bare:.2f} |\n"
          f"| `Judge.score` rerun: {rerun.hits} of {args.judgments} from the cache, "
          f"{rerun.calls} requests | {cached:.0f} | {cached / bare:.1f} |")


if __name__ == "__main__":
    main()
