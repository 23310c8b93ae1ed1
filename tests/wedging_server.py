"""Scripted remotes on loopback that answer N requests and then wedge: accept, read the request,
never reply (a hung server, an overloaded one). For the stall bounds of issue 51.4
(RELIABILITY.md, "Remotes that stall mid-stage"):

- `DvcRemote`: an HTTP DVC remote (`url = http://127.0.0.1:PORT/store`): HEAD and GET answer
  from a folder, POST and PUT store the body there (DVC's HTTP remote uploads with POST, chunked);
  it wedges once it stored N objects;
- `Proxy`: an HTTP reverse proxy in front of a real server (an `mlflow server`).

Each counts the requests it answered (`answered`, `uploads`) and, with `slow`, trickles each
upload's answer a header line at a time (a slow remote that keeps sending). `release()` frees
the wedged handlers, `close()` stops it.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler, answer: int | None, slow: float = 0.0):
        super().__init__(("127.0.0.1", 0), handler)
        self.answer, self.slow = answer, slow  # answer: requests answered before it wedges
        self.answered, self.uploads, self.wedged = 0, 0, 0
        self.count = threading.Lock()
        self.freed = threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def turn(self) -> bool:
        """True when this request is to be answered; False: wedged from here on."""
        with self.count:
            if self.answer is not None and self.answered >= self.answer:
                self.wedged += 1
                return False
            self.answered += 1
            return True

    def release(self) -> None:
        self.freed.set()

    def close(self) -> None:
        self.release()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def wedge(self) -> None:
        """Read, then never answer (until the test releases it)."""
        self.server.freed.wait()
        self.close_connection = True

    def reply(self, status: int, data: bytes = b"", slow: float = 0.0) -> None:
        self.send_response(status)
        for n in range(8 if slow else 0):  # a header line at a time: bytes keep coming
            self.send_header(f"X-Trickle-{n}", "x")
            self.flush_headers()
            time.sleep(slow / 8)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class DvcRemote(_Server):
    """An HTTP DVC remote storing its objects under `folder`; it wedges once it has stored
    `uploads` objects (whatever number of existence checks came before), or answered `answer`
    requests.
    """

    def __init__(self, folder: Path, uploads: int | None = None, answer: int | None = None,
                 slow: float = 0.0):
        self.folder, self.store_at_most = folder, uploads
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(_DvcHandler, answer, slow)

    def turn(self, upload: bool = False) -> bool:
        with self.count:
            if (self.store_at_most is not None and self.uploads >= self.store_at_most) or \
                    (self.answer is not None and self.answered >= self.answer):
                self.wedged += 1
                return False
            self.answered += 1
            self.uploads += upload
            return True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/store"

    def objects(self) -> set[str]:
        return {str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file()}


class _DvcHandler(_Handler):
    def path_of(self) -> Path:
        return self.server.folder / self.path.split("?")[0].removeprefix("/store/").lstrip("/")

    def do_HEAD(self):
        if not self.server.turn():
            return self.wedge()
        path = self.path_of()
        self.reply(200 if path.is_file() else 404)

    def do_GET(self):
        if not self.server.turn():
            return self.wedge()
        path = self.path_of()
        self.reply(200, path.read_bytes()) if path.is_file() else self.reply(404)

    def do_POST(self):
        data = self.body()
        if not self.server.turn(upload=True):
            return self.wedge()
        path = self.path_of()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.reply(200, slow=self.server.slow)

    do_PUT = do_POST


class Proxy(_Server):
    """A reverse proxy to http://127.0.0.1:`target`."""

    def __init__(self, target: int, answer: int | None = None):
        self.target = target
        super().__init__(_ProxyHandler, answer)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class _ProxyHandler(_Handler):
    def forward(self):
        data = self.body() if self.command in ("POST", "PUT", "PATCH", "DELETE") else b""
        if not self.server.turn():
            return self.wedge()
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.target, timeout=60)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "transfer-encoding", "content-length")}
        upstream.request(self.command, self.path, body=data or None, headers=headers)
        answer = upstream.getresponse()
        payload = answer.read()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "content-length", "connection", "date",
                                   "server"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        upstream.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward
