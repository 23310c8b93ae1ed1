"""Is a remote service there and answering? A bounded probe, before work depends on it.

A remote that is down hangs a cycle when nothing checks it first: a Ray address where nothing
listens makes `ray.init` retry for minutes, and a listener that accepts connections and never
answers (a wedged server, a half-open tunnel) keeps an HTTP client waiting for its full request
timeout, retry after retry. `probe(...)` asks once, with one short deadline for connecting and
answering together (`OFFSEASON_PROBE_TIMEOUT`, default 10 s), and raises `RemoteDown` naming the
setting, the address, what happened and what to do:

- `http`: GET a health URL; any HTTP status counts as an answer (a 404 or 401 is a server there);
- `grpc`: Ray's GCS port speaks gRPC over HTTP/2, whose server answers the client's connection
  preface with a SETTINGS frame at once: that frame within the deadline is the answer;
- `ssh`: an SSH server greets first (`SSH-2.0-...`, RFC 4253): that line within the deadline.

Used by the rollout stage (each of `runtime.rollout.urls`), the reward stage
(`runtime.reward.ray_address`) and `offseason run` (MLflow and Prefect servers and the default DVC
remote, before any stage).

    python -m stages.remote http://127.0.0.1:5000/health     # probe one address by hand
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import urllib.error
import urllib.request

DEFAULT_TIMEOUT_S = 10.0
# HTTP/2 client connection preface, then an empty SETTINGS frame (length 0, type 4, no flags)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


class RemoteDown(ConnectionError):
    """A remote service did not answer a probe: nothing listens, or it never answered."""


def timeout_s() -> float:
    """The probe's deadline in seconds: OFFSEASON_PROBE_TIMEOUT, else 10."""
    try:
        return float(os.environ.get("OFFSEASON_PROBE_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def probe(address: str, *, setting: str, fix: str, kind: str = "http",
          timeout: float | None = None, value: str | None = None) -> float:
    """Seconds the remote took to answer; raises RemoteDown (naming `setting` with its `value`,
    default `address`, what was probed and `fix`) when it refuses, is unreachable or does not
    answer within `timeout`.
    """
    timeout = timeout_s() if timeout is None else timeout
    started = time.monotonic()
    try:
        if kind == "grpc":
            _grpc(address, timeout)
        elif kind == "ssh":
            _ssh(address, timeout)
        else:
            _http(address, timeout)
    except (OSError, ValueError) as err:
        waited = time.monotonic() - started
        if isinstance(err, (TimeoutError, socket.timeout)) or "timed out" in str(err):
            what = f"it accepted the connection but did not answer within {timeout:g} s"
        elif isinstance(err, ConnectionRefusedError) or "refused" in str(err).lower():
            what = "nothing listens there (connection refused)"
        else:
            what = f"{type(err).__name__}: {err}"
        probed = f"GET {address}, " if kind == "http" and value not in (None, address) else ""
        raise RemoteDown(f"{setting}={value or address!r}: {what} ({probed}after {waited:.1f} s); "
                         f"{fix}") from None
    return time.monotonic() - started


def _http(url: str, timeout: float) -> None:
    request = urllib.request.Request(url, method="GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(request, timeout=timeout) as response:
            response.read(1)
    except urllib.error.HTTPError:
        return  # a status is an answer: a server is there
    except urllib.error.URLError as err:
        reason = err.reason
        raise reason if isinstance(reason, OSError) else OSError(str(reason)) from None


def _grpc(address: str, timeout: float) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    deadline = time.monotonic() + timeout
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
        sock.sendall(_H2_PREFACE)
        received = b""
        while len(received) < 9:  # a frame header
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(64)
            if not chunk:
                raise ConnectionResetError("the connection was closed without an answer")
            received += chunk
    if received[3] != 4:  # the server's first frame must be SETTINGS
        raise ConnectionError(f"it answered, but not as a gRPC server (frame type {received[3]})")


def _ssh(address: str, timeout: float) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
        sock.settimeout(timeout)
        greeting = sock.recv(64)
    if not greeting:
        raise ConnectionResetError("the connection was closed without an answer")
    if not greeting.startswith(b"SSH-"):
        raise ConnectionError(f"it answered, but not as an SSH server ({greeting[:20]!r})")


def main(argv: list[str] | None = None) -> None:
    """Probe one address (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="an http(s) URL, or host:port with --grpc")
    parser.add_argument("--grpc", action="store_true", help="a gRPC (HTTP/2) server, e.g. Ray's GCS")
    parser.add_argument("--ssh", action="store_true", help="an SSH server (host:port)")
    args = parser.parse_args(argv)
    seconds = probe(args.address, setting="address", fix="check the address",
                    kind="grpc" if args.grpc else "ssh" if args.ssh else "http")
    print(f"{args.address}: answered in {seconds:.3f} s")


if __name__ == "__main__":
    main()
