"""A scripted OpenAI-compatible judge server on loopback (real HTTP), for the tests.

`Scripted(script)` serves from a thread of the test; run as a script it is a server process, as
`runtime.judge.server_command` starts one (GET /health and /v1/models answer, POST
/v1/chat/completions answers from the script):

    python tests/judge_server.py --port 8000 --script script.json   # [{"reasoning": "fine", "score": 0.5}]

`--requests FILE` appends each request's body to FILE as a JSON line, for a test to count.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Scripted:
    """An OpenAI-compatible /chat/completions that answers from `script` (one entry a request,
    the last one repeated): a dict (the JSON answer), "malformed", "refusal", "500", "slow",
    "stall" (never answers: up but wedged, until `close`).
    """

    def __init__(self, script, port: int = 0, log: Path | None = None,
                 by_content: dict | None = None, delay: float = 0.0):
        """Serve `script` on 127.0.0.1:`port` (0: a free one) from a background thread; `log`:
        a file each request's body is appended to, as a JSON line. `by_content`: {text: step},
        the step for a request whose conversation holds the text (whatever the order requests
        come in); `delay`: seconds each answer takes. `most_in_flight`: the most requests it
        answered at once.
        """
        self.script, self.requests = list(script), []
        self.in_flight = self.most_in_flight = 0
        self.closing = threading.Event()  # lets the stalled requests' threads go
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 (http.server's name): health and models, as vLLM
                data = json.dumps({"object": "list", "data": [{"id": "judge", "object": "model"}]}
                                  ).encode() if self.path.endswith("/models") else b"{}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):  # noqa: N802 (http.server's name)
                with lock:
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                try:
                    self.answer()
                finally:
                    with lock:
                        outer.in_flight -= 1

            def answer(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body,
                                       "auth": self.headers.get("Authorization")})
                if log is not None:
                    with log.open("a") as lines:
                        lines.write(json.dumps(body) + "\n")
                text = json.dumps(body.get("messages"))
                step = next((step for key, step in (by_content or {}).items() if key in text),
                            None)
                if step is None:
                    with lock:
                        step = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                time.sleep(delay)
                if step == "slow":
                    time.sleep(1.5)
                if step == "stall":
                    outer.closing.wait()
                    return
                if step == "500":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"overloaded")
                    return
                message = {"role": "assistant", "content": None, "refusal": None}
                if step == "refusal":
                    message["refusal"] = "I can't help with grading that."
                elif step == "malformed":
                    message["content"] = '{"reasoning": "fine", "score": '
                else:
                    message["content"] = json.dumps(step if isinstance(step, dict) else
                                                    {"reasoning": "ok", "score": 0.5})
                data = json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                                   "choices": [{"index": 0, "message": message,
                                                "finish_reason": "stop"}],
                                   "usage": {"prompt_tokens": 90, "completion_tokens": 10,
                                             "total_tokens": 100}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        """Stop serving."""
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> None:
    """Serve a script until killed (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", type=Path, default=None,
                        help="a JSON file: a list of steps, answers (objects), malformed, refusal, "
                             "500, slow, stall (default: always a score of 0.5)")
    parser.add_argument("--requests", type=Path, default=None,
                        help="append each request's body to this file, a JSON line each")
    args = parser.parse_args(argv)
    script = json.loads(args.script.read_text()) if args.script else [{"reasoning": "ok",
                                                                        "score": 0.5}]
    server = Scripted(script, args.port, args.requests)
    print(f"judge server at {server.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
