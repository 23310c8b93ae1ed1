"""Is a process tree still moving bytes? The stall watch of commands that talk to a remote.

`dvc push`, `pull` and `fetch` talk to the DVC remote through their own clients (aiohttp for
HTTP and WebDAV, asyncssh, aiobotocore), each with its read timeout and retries: a remote that
accepts connections and never answers holds them for minutes. What they do while they work is
move bytes, so `Watch` samples the process and everything below it (the `tree` it is given:
`workspace.processes_below`) ten times within its bound (every 5 s at most: a sample costs a few
milliseconds, mostly the kernel's walk of its TCP table) and calls the command stalled when, for
`seconds`, none of these moved:

- the bytes its TCP sockets sent and had acknowledged, and received (the kernel's `tcp_info`
  `bytes_acked` and `bytes_received`, asked over netlink's sock_diag for every TCP socket, kept
  for the inodes the processes hold open: `/proc/<pid>/fd`). `/proc/<pid>/io` does not count
  them: `send` and `recv` on a socket bypass its `rchar` and `wchar`;
- its reads and writes of files and pipes (`/proc/<pid>/io` `rchar` + `wchar`): hashing the
  cache, copying to a local remote.

A legitimately long transfer keeps moving bytes and is never stopped; a process that started or
ended counts as movement too. Reads nothing else, writes nothing.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

# samples: ten within the bound, so that a stall is seen within a tenth of it, and at most
# every 5 s (the default bound, 300 s: 0.1 % of a core while a DVC command runs)
SAMPLES_PER_BOUND, MAX_EVERY_S = 10, 5.0

# netlink sock_diag (linux/sock_diag.h, linux/inet_diag.h): dump every TCP socket with its tcp_info
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR, _NLMSG_DONE = 4, 20, 2, 3
_INET_DIAG_INFO = 2
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_INODE_AT = 68  # in struct inet_diag_msg, after family..retrans, the socket id, expires and queues
_TCP_BYTES_AT = 120  # tcpi_bytes_acked, then tcpi_bytes_received (u64 each) in struct tcp_info


def tcp_bytes() -> dict[int, int]:
    """{socket inode: bytes sent and acknowledged + bytes received} for every TCP socket here."""
    found: dict[int, int] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0,
                              0xFFFFFFFF) + bytes(48)  # every state; a zero socket id: all
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as link:
            link.send(struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY,
                                  _NLM_F_REQUEST_DUMP, 1, 0) + request)
            done = False
            while not done:
                data, at = link.recv(1 << 20), 0
                while at + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, at)
                    if kind in (_NLMSG_DONE, _NLMSG_ERROR) or length < 16:
                        done = True
                        break
                    body = data[at + 16:at + length]
                    inode = struct.unpack_from("=I", body, _INODE_AT)[0]
                    attr = 72
                    while attr + 4 <= len(body):
                        size, what = struct.unpack_from("=HH", body, attr)
                        if size < 4:
                            break
                        if what == _INET_DIAG_INFO and size - 4 >= _TCP_BYTES_AT + 16:
                            acked, received = struct.unpack_from("=QQ", body,
                                                                 attr + 4 + _TCP_BYTES_AT)
                            found[inode] = acked + received
                        attr += (size + 3) & ~3
                    at += (length + 3) & ~3
    return found


def _sockets(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _file_bytes(pid: int) -> int:
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except (OSError, ValueError):
        return 0
    return int(fields.get("rchar", 0)) + int(fields.get("wchar", 0))


def sample(pids: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """What the processes `pids` have moved so far: ({pid: file and pipe bytes}, {socket inode:
    TCP bytes}).
    """
    held = set().union(*(_sockets(p) for p in pids)) if pids else set()
    network = {inode: moved for inode, moved in tcp_bytes().items() if inode in held}
    return {p: _file_bytes(p) for p in pids}, network


class Watch:
    """A thread that calls `on_stall()` once when `pid`'s tree moves no bytes for `seconds`
    (see the module's docstring); `stalled` is then how long it had been still, and `sent` the
    TCP bytes its sockets moved while watched. A context manager: watching from entry to exit.
    """

    def __init__(self, pid: int, seconds: float, on_stall: Callable[[], None],
                 tree: Callable[[int], list[int]]):
        """Watch `pid` and those below it (`tree(pid)`) for `seconds` of stillness; `on_stall`
        stops them.
        """
        self.pid, self.seconds, self.on_stall, self.tree = pid, seconds, on_stall, tree
        self.every = min(MAX_EVERY_S, seconds / SAMPLES_PER_BOUND)
        self.stalled: float | None = None
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stall-watch-{pid}", daemon=True)

    def __enter__(self) -> Watch:
        """Start watching."""
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop watching."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        files, network = sample(self.tree(self.pid))
        seen = dict(network)  # each socket's last count, sockets since closed included
        first = dict(network)
        still_since = time.monotonic()
        while not self._stop.wait(self.every):
            now_files, now_network = sample(self.tree(self.pid))
            if now_files != files or now_network != network:
                still_since = time.monotonic()
            files, network = now_files, now_network
            seen.update(network)
            self.sent = sum(seen.values()) - sum(first.values())
            if time.monotonic() - still_since >= self.seconds:
                self.stalled = time.monotonic() - still_since
                self.on_stall()
                return
