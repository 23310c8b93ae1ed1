"""Webhook notifications against a real HTTP server on 127.0.0.1."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows.project import notify


@pytest.fixture
def webhook(monkeypatch):
    """A local webhook that records each POST; `fail_first` makes it answer 500 that many times."""
    state = {"bodies": [], "fail_first": 0, "paths": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state["paths"].append(self.path)
            if state["fail_first"] > 0:
                state["fail_first"] -= 1
                self.send_response(500)
                self.end_headers()
                return
            state["bodies"].append((self.headers["Content-Type"], json.loads(body)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OFFSEASON_WEBHOOK_URL",
                       f"http://127.0.0.1:{server.server_address[1]}/hook/secret-token")
    yield state
    server.shutdown()


def test_a_promotion_is_posted_as_json(webhook):
    assert notify.send("promoted", "gen-3 promoted", generation=3, model_version="4")
    (content_type, body), = webhook["bodies"]
    assert content_type == "application/json"
    assert body["event"] == "promoted" and body["generation"] == 3
    assert body["model_version"] == "4" and body["message"] == "gen-3 promoted"
    assert body["text"] == "offseason: gen-3 promoted" and body["at"]
    assert webhook["paths"] == ["/hook/secret-token"]


def test_a_server_error_is_retried(webhook):
    webhook["fail_first"] = 2
    assert notify.send("rejected", "gen-2 not promoted", attempts=3)
    assert len(webhook["paths"]) == 3 and webhook["bodies"][0][1]["event"] == "rejected"


def test_an_unreachable_webhook_is_never_fatal(monkeypatch, caplog):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("OFFSEASON_WEBHOOK_URL", f"http://127.0.0.1:{port}/hook/secret-token")
    monkeypatch.setenv("OFFSEASON_WEBHOOK_TIMEOUT", "1")
    assert notify.send("failed", "cycle failed", attempts=2) is False
    assert "not delivered" in caplog.text and "secret-token" not in caplog.text


def test_no_webhook_configured_sends_nothing(monkeypatch):
    monkeypatch.delenv("OFFSEASON_WEBHOOK_URL", raising=False)
    assert notify.send("promoted", "x") is False


@pytest.mark.slow
def test_a_failed_cycle_posts_a_failure(webhook, tmp_path):
    from conftest import make_project, offseason

    root = make_project(tmp_path / "p")
    result = offseason(root, "run", check=False)  # no champion yet: the flow fails
    assert result.returncode == 2 and "offseason init" in result.stderr
    (_, body), = webhook["bodies"]
    assert body["event"] == "failed" and "no champion yet" in body["message"]
    assert body["workspace"] == str(root)
