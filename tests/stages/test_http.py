"""The shared retry policy (stages/http.py) against a real scripted HTTP server on 127.0.0.1:
what is retried (429 with its Retry-After, 5xx, no answer), what is not (another 4xx), and that it
gives up after `retries`."""

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from stages import http


@pytest.fixture
def scripted():
    """A server answering request n with the n-th (status, headers) of its script (the last one
    repeated); it records when each request came.
    """
    made = []

    def start(*script):
        state = {"script": list(script), "times": []}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                state["times"].append(time.monotonic())
                steps = state["script"]
                status, headers = steps.pop(0) if len(steps) > 1 else steps[0]
                body = b'{"error": {"message": "step %d"}}' % len(state["times"])
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        state["url"] = f"http://127.0.0.1:{server.server_address[1]}/v1/x"
        return state

    yield start
    for server in made:
        server.shutdown()
        server.server_close()


def post(url: str, retries: int, backoff: float = 0.01) -> tuple[httpx.Response, int]:
    """The answer through the policy, and the retries it took."""
    retried = []
    with http.client([url], timeout=2.0) as client:
        for attempt in http.retrying(retries, backoff, on_retry=retried.append):
            with attempt:
                return http.checked(client.post(url, json={"q": 1})), len(retried)


def test_a_429_with_retry_after_and_a_503_are_retried(scripted):
    server = scripted((429, {"Retry-After": "1"}), (503, {}), (200, {}))
    response, retried = post(server["url"], retries=3)
    assert response.status_code == 200 and retried == 2 and len(server["times"]) == 3
    first, second, third = server["times"]
    assert second - first >= 0.95  # the server's Retry-After, not the 0.01 s backoff
    assert third - second < 0.9


def test_retry_after_is_capped(scripted, monkeypatch):
    monkeypatch.setattr(http, "MAX_WAIT_S", 0.2)
    server = scripted((429, {"Retry-After": "3600"}), (200, {}))
    started = time.monotonic()
    assert post(server["url"], retries=1)[0].status_code == 200
    assert time.monotonic() - started < 5


def test_a_400_is_not_retried(scripted):
    server = scripted((400, {}), (200, {}))
    with pytest.raises(http.Rejected) as err:
        post(server["url"], retries=5)
    assert err.value.status == 400 and err.value.message == "step 1"
    assert str(err.value) == "HTTP 400: step 1" and len(server["times"]) == 1


def test_it_gives_up_after_its_retries_with_the_last_error(scripted):
    server = scripted((503, {}))
    with pytest.raises(http.Transient, match="HTTP 503: step 3"):
        post(server["url"], retries=2)
    assert len(server["times"]) == 3


def test_no_answer_is_retried_then_raised():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/x"
    retried = []
    with pytest.raises(httpx.ConnectError), http.client([url], timeout=2.0) as client:
        for attempt in http.retrying(2, 0.01, on_retry=retried.append):
            with attempt:
                client.post(url, json={})
    assert len(retried) == 2


def test_the_async_policy_is_the_same(scripted):
    server = scripted((502, {}), (429, {"Retry-After": "0"}), (200, {}), (400, {}))

    async def ask():
        async with http.async_client([server["url"]], timeout=2.0) as client:
            async for attempt in http.retrying_async(3, 0.01):
                with attempt:
                    return http.checked(await client.post(server["url"], json={}))

    assert asyncio.run(ask()).status_code == 200 and len(server["times"]) == 3
    with pytest.raises(http.Rejected, match="HTTP 400"):
        asyncio.run(ask())
    assert len(server["times"]) == 4


def test_loopback_ignores_the_environment_s_proxy(scripted, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing there: used, it would fail
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    server = scripted((200, {}))
    assert post(server["url"], retries=0)[0].status_code == 200
