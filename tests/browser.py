"""A headless Chromium the tests drive through the DevTools protocol (its own websocket API).

`--dump-dom` shows a page but cannot click; the Prefect UI's forms need clicks and typing. So:
Chromium is started with `--remote-debugging-port=0`, the port it picked is read from its
`DevToolsActivePort` file, and one page is driven with `Runtime.evaluate`. No Selenium or
Playwright: neither is installed, and what the tests need is four calls.

    with Browser(chromium) as browser:
        browser.open("http://127.0.0.1:4200/deployments")
        browser.wait_for("document.body.innerText.includes('manual')")
        text = browser.eval("document.body.innerText")
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


class Browser:
    """One headless Chromium page on loopback, closed with the context."""

    def __init__(self, chromium: str, width: int = 1400, height: int = 1000):
        self.profile = Path(tempfile.mkdtemp(prefix="chromium-"))
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("headless Chromium did not open its DevTools port")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10)
                           .read())
        page = next(p for p in pages if p.get("type") == "page")
        from websockets.sync.client import connect

        self.socket = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.ids = itertools.count(1)

    def send(self, method: str, **params) -> dict:
        """One DevTools call; its result (events meanwhile are skipped)."""
        call = next(self.ids)
        self.socket.send(json.dumps({"id": call, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=120))
            if message.get("id") == call:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def wait_for(self, condition: str, timeout: float = 90) -> None:
        """Until a JavaScript condition holds in the page (a single-page app renders late)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.eval(f"!!({condition})"):
                    return
            except RuntimeError:  # the page is between documents
                pass
            if time.monotonic() > deadline:
                text = self.eval("document.body ? document.body.innerText : ''") or ""
                raise AssertionError(f"not within {timeout} s: {condition}; the page says: "
                                     f"{text[:2000]}")
            time.sleep(0.25)

    def text(self, selector: str = "body") -> str:
        """The text a person reads in the first element `selector` finds (innerText)."""
        return self.eval(f"document.querySelector({json.dumps(selector)}).innerText")

    def click(self, label: str, within: str = "body") -> None:
        """Click the button whose text is `label` inside the first element `within` finds."""
        found = self.eval(f"""(() => {{
            const b = [...document.querySelector({json.dumps(within)}).querySelectorAll('button')]
                .find(e => e.innerText.trim() === {json.dumps(label)});
            if (b) b.click();
            return !!b; }})()""")
        if not found:
            raise AssertionError(f"no button {label!r} in {within}: {self.text(within)[:2000]}")

    def close(self) -> None:
        socket = getattr(self, "socket", None)
        if socket is not None:
            socket.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
