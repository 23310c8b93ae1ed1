"""A server of the model as a local process: started from a command, healthy, stopped.

`serve(command, model)` fills `{model}` and `{port}` into a command (vLLM's OpenAI-compatible
server, SGLang's, `stages.generation.serve_tiny`), starts it in a process group of its own, waits
until GET /health answers 200, yields its base URL, and stops the whole group (SIGTERM, then
SIGKILL) however the block ends, a SIGTERM to the stage included. Its output goes to a log in the
temporary folder, named in every error. Used by the rollout stage (`runtime.rollout.
server_command`) and the judge (`runtime.judge.server_command`); neither imports the other.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


class ServerError(RuntimeError):
    """A server failed a request for good; the message names the URL and what to do."""


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_process_group(process: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            # the leader is gone; children that ignored SIGTERM may not be: kill the group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def serve(command: str, model: Path | str, *, timeout: float = 600.0, host: str = "127.0.0.1",
          setting: str = "runtime.rollout.server_command", who: str = "rollout"):
    """Start `command` ({model} and {port} filled in), yield its base URL once healthy, stop it.
    `setting` (the params key of the command) and `who` (the stage) name it in messages. The
    server's output goes to a log in the temporary folder, kept (and named) when the server or
    the work beside it failed, removed when all went well: one per stage run would pile up.
    """
    port = free_port()
    argv = shlex.split(command.format(model=model, port=port))
    log_file = tempfile.NamedTemporaryFile(prefix="offseason-server-", suffix=".log", delete=False)
    log = Path(log_file.name)
    print(f"{who}: starting the server: {' '.join(argv)} (log: {log})", file=sys.stderr,
          flush=True)
    try:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as err:
        raise ServerError(f"{setting}: cannot start {argv[0]!r}: {err}") from None
    finally:
        log_file.close()
    previous = signal.getsignal(signal.SIGTERM)

    def terminated(signum, frame):  # DVC or Prefect stopping the stage: still stop the server
        raise SystemExit(128 + signum)

    in_main = _main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, terminated)
    failed = True
    try:
        base = f"http://{host}:{port}"
        _wait_healthy(base, process, timeout, log, setting)
        print(f"{who}: server up at {base}", file=sys.stderr, flush=True)
        yield f"{base}/v1"
        failed = False
    finally:
        stop_process_group(process)
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        if failed:
            print(f"{who}: server stopped; its log: {log}", file=sys.stderr, flush=True)
        else:
            log.unlink(missing_ok=True)
            print(f"{who}: server stopped", file=sys.stderr, flush=True)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _wait_healthy(base: str, process: subprocess.Popen, timeout: float, log: Path,
                  setting: str = "runtime.rollout.server_command") -> None:
    deadline, last = time.time() + timeout, ""
    while time.time() < deadline:
        if process.poll() is not None:
            raise ServerError(
                f"{setting} exited with code {process.returncode} before it was "
                f"healthy; its last output ({log}):\n{_tail(log)}")
        try:
            if httpx.get(f"{base}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError as err:
            last = f"{type(err).__name__}: {err}"
        time.sleep(0.5)
    raise ServerError(
        f"{setting}: {base}/health did not answer 200 within {timeout:.0f} s "
        f"({setting.rpartition('.')[0]}.server_timeout; last: {last or 'a non-200 answer'}); its last output "
        f"({log}):\n{_tail(log)}")
