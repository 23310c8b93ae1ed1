"""Model stages started warm: torch and transformers imported once per cycle, not once per stage.

A cycle's DVC session starts one fork server as its first `dvc repro` begins: it imports the model
stages (rollout, reward, train, champion_scores, gate) once, then forks a child for each such
stage command that runs it exactly as `python -m stages.X ARGS` would. A `python` shim first on
DVC's PATH hands the command over, or runs the real interpreter (the cold path) when it cannot.
What a stage computes does not change; reads and writes nothing of its own. No server on a
machine with an NVIDIA device.

    python -m flows.orchestration.forkserver FD MODULE...   # the server (internal): started by `Server`

Details: docs/cycle.md, "How model stages start warm (flows/orchestration/forkserver.py)".
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ADDRESS = "OFFSEASON_FORKSERVER"  # the server's socket, in the environment of DVC's stage commands
SERVED = ("stages.rollout", "stages.reward", "stages.train", "stages.champion_scores",
          "stages.gate")
# differences that are not the command's: the shell's own, DVC's per-stage variables, and PATH
# (DVC may rewrite it; nothing imported reads it)
UNCOMPARED = {"PATH", "PWD", "OLDPWD", "SHLVL", "_"}
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
HEADER = struct.Struct("!I")
PREFIX = "offseason-fork-"  # the temporary folder of a session's socket and shim


def available() -> bool:
    """Whether stages may be forked here: Linux (fork, pidfd, SCM_RIGHTS) and no NVIDIA device."""
    return (sys.platform == "linux" and hasattr(os, "pidfd_open")
            and not any(Path("/dev").glob("nvidia[0-9]*")))


def precedes_served(dvc_args: list[str]) -> bool:
    """Whether a DVC command is a cycle's `dvc repro` that runs served stages, or runs validate,
    after which they come: the server then imports while ingest and validate run. Other commands
    (a `dvc repro ingest`, `dvc add`, `dvc push`) start none, so no import is spent in vain.
    """
    if dvc_args[:1] != ["repro"]:
        return False
    targets = [a for a in dvc_args[1:] if not a.startswith("-")]
    return not targets or any(t in {"validate", *(m.split(".")[1] for m in SERVED)}
                              for t in targets)


def comparable(env: dict) -> dict:
    """What of an environment must match the server's for a command to be served."""
    return {k: v for k, v in env.items() if k not in UNCOMPARED and not k.startswith("DVC_")}


def shim(folder: Path, modules: list[str]) -> Path:
    """Write the `python` that DVC's stage commands find first on PATH; returns its folder.

    A shell script (a `#!` line naming the interpreter could outgrow the kernel's limit in a deep
    folder) that runs the real interpreter with `-S` (no site-packages: the client needs only the
    standard library, and starts in about 15 ms) on `client()` for the served `modules`.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
            f"from flows.orchestration.forkserver import client; client({sys.executable!r}, {modules!r})")
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S -c {shlex.quote(code)} "$@"\n')
    path.chmod(0o755)
    return folder


class Server:
    """The fork server of one DVC session, started by `start()`; `stop()` ends it."""

    def __init__(self, root: Path, modules: tuple[str, ...] = SERVED):
        """Start the server of `modules` (importable from `root`, the commands' working folder)
        and point this process's environment, which DVC's stage commands inherit, at it.
        """
        _remove_stale()
        self.folder = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.folder / "owner").write_text(str(os.getpid()))
        self.address = str(self.folder / "socket")
        self.bin = shim(self.folder / "bin", list(modules))
        os.environ[ADDRESS] = self.address
        os.environ["PATH"] = f"{self.bin}{os.pathsep}{os.environ['PATH']}"
        # listening before the server process starts: a command that comes while it imports
        # waits in the backlog instead of finding no socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(self.address)
            listener.listen(16)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flows.orchestration.forkserver", str(listener.fileno()), *modules],
                cwd=root, stdin=subprocess.PIPE, pass_fds=[listener.fileno()],
                env=dict(os.environ))  # as DVC passes it to the commands: os.environ's view

    def stop(self) -> None:
        """End the server (it ends when its stdin closes) and remove its socket and shim."""
        os.environ.pop(ADDRESS, None)
        os.environ["PATH"] = os.environ["PATH"].replace(f"{self.bin}{os.pathsep}", "", 1)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _remove_stale() -> None:
    """Remove the socket and shim folders of sessions that were killed before `stop()`."""
    import time

    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            if not (folder / "owner").exists():  # still being made, or made before owners
                made = folder.stat()
                if time.time() - made.st_mtime > 60 and made.st_uid == os.getuid():
                    shutil.rmtree(folder, ignore_errors=True)
                continue
            os.kill(int((folder / "owner").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):  # another user's: not ours to judge
            continue


def start(root: Path) -> Server | None:
    """A fork server for the DVC session in `root`, where `available()`."""
    return Server(root) if available() else None


# --- the client: the `python` of DVC's stage commands --------------------------------------------

def client(python: str, modules: list[str]) -> None:
    """Run `python ARGS` through the server when it serves them (`-m` one of `modules`), else
    exec the real interpreter.
    """
    args = sys.argv[1:]
    address = os.environ.get(ADDRESS)
    if address and len(args) >= 2 and args[0] == "-m" and args[1] in modules:
        status = _through_server(address, args)
        if status is not None:
            _end_as(status)
    elif address and len(args) >= 2 and args[0] == "-m" and \
            args[1].split(".")[0] in {m.split(".")[0] for m in modules}:
        _wake(address)  # an earlier stage (ingest, validate): time for the server to import
    os.execv(python, [python, *args])


def _wake(address: str) -> None:
    """Tell the server a stage has started: a connection that sends nothing. It imports then (if
    it has not yet), and drops the connection as a request too short to run.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)  # a full backlog must not hold the stage up
            sock.connect(address)
    except OSError:
        pass


def _through_server(address: str, args: list[str]) -> int | None:
    """The served command's wait status, or None where the server would not or could not run it
    (then nothing of it has run).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        body = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(sock, [HEADER.pack(len(body)) + body], [0, 1, 2])
        reply = _read_message(sock)
    except OSError as err:
        reply = {"refused": f"no server answers ({err})"}
    if reply is None or "pid" not in reply:  # refused, or the server ended before forking
        sock.close()
        why = "the server ended (see its error above)" if reply is None else reply["refused"]
        print(f"forkserver: {args[1]} starts cold: {why}", file=sys.stderr)  # a slower start
        return None
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C reaches the child itself
    try:  # (a forwarded signal's handler interrupts the wait; Python resumes it)
        done = _read_message(sock)
    except OSError:  # reset: the server was killed
        done = None
    if done is None or "status" not in done:  # the server was killed, and the child with it
        return signal.SIGKILL  # a wait status: killed by SIGKILL
    return done["status"]


def _end_as(status: int) -> None:
    """Exit as the child did: with its exit code, or dead by its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _read_message(sock: socket.socket) -> dict | None:
    head = _read_exactly(sock, HEADER.size)
    if head is None:
        return None
    body = _read_exactly(sock, HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _send(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    try:
        sock.sendall(HEADER.pack(len(body)) + body)
    except OSError:  # the client is gone; its child is killed when its EOF is seen
        pass


# --- the server ---------------------------------------------------------------------------------

def serve(fd: int, modules: list[str]) -> int:
    """Import `modules` once the first command connects, then, on the listening socket `fd`,
    fork one child per command that runs one of them, until stdin (the DVC session) closes.
    """
    listener = socket.socket(fileno=fd)
    # SIGTERM (a cancelled cycle's kill_tree) ends the server through its `finally`, which kills
    # its children: none runs on unseen, its client gone
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # Ctrl-C reaches the children from the terminal; the server must not end (and kill them)
    # before they have handled it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    own = comparable(dict(os.environ))
    # nothing imported until a stage command comes, served or woken by `_wake`: a session whose
    # `dvc repro` runs no stage spends nothing (the connection waits in the backlog meanwhile)
    import select

    if sys.stdin in select.select([listener, sys.stdin], [], [])[0] and \
            not os.read(sys.stdin.fileno(), 4096):
        return 0
    import importlib

    from stages import io

    # frozen as they load: the children share these pages instead of copying them as the GC
    # touches them, and no collection walks them meanwhile (0.9 of the server's 4 CPU seconds)
    with io.heavy_imports():
        for name in modules:
            importlib.import_module(name)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    children: dict[int, tuple[socket.socket, int]] = {}  # pid: (client, pidfd)
    try:
        while True:
            for key, _ in selector.select():
                what = key.data
                if what == "listener":
                    conn, _ = listener.accept()
                    pid = _start(conn, own, modules, listener, selector)
                    if pid is None:
                        conn.close()
                        continue
                    pidfd = os.pidfd_open(pid)
                    children[pid] = (conn, pidfd)
                    selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
                    selector.register(conn, selectors.EVENT_READ, ("client", pid))
                elif what == "parent":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return 0
                elif what[0] == "exited":
                    conn, pidfd = children.pop(what[1])
                    _, status = os.waitpid(what[1], 0)
                    _send(conn, {"status": status})
                    selector.unregister(pidfd)
                    if conn in selector.get_map():  # not after its client's end was seen
                        selector.unregister(conn)
                    os.close(pidfd)
                    conn.close()
                elif what[0] == "client" and what[1] in children:  # readable: only EOF is expected
                    if not children[what[1]][0].recv(1):
                        selector.unregister(children[what[1]][0])
                        _kill(what[1])
    finally:
        for pid in children:
            _kill(pid)
        listener.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _start(conn: socket.socket, own: dict, modules: list[str], listener, selector) -> int | None:
    """Read one command and fork its child; None where it is not served (the client runs it)."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if len(data) < HEADER.size:
            raise OSError("short request")
        size = HEADER.unpack(data[:HEADER.size])[0]
        body = data[HEADER.size:]
        if len(body) < size:
            body += _read_exactly(conn, size - len(body)) or b""
        request = json.loads(body)
    except (OSError, ValueError):
        return None
    args, cwd, env = request["args"], request["cwd"], request["env"]
    refusal = None
    if len(fds) != 3 or args[:1] != ["-m"] or args[1] not in modules:
        refusal = "not a served stage command"
    elif (theirs := comparable(env)) != own:
        differ = sorted(k for k in theirs.keys() | own.keys() if theirs.get(k) != own.get(k))
        refusal = f"its environment differs from the server's in {', '.join(differ)}"
    elif os.path.realpath(cwd) != os.path.realpath(sys.path[0] or os.getcwd()):
        refusal = "another working folder"
    if refusal:
        for fd in fds:
            os.close(fd)
        _send(conn, {"refused": refusal})
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: becomes `python -m stages.X ARGS`, never returns
        listener.close()
        selector.close()
        _become(conn, fds, args, cwd, env)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    return pid


def _become(conn, fds: list[int], args: list[str], cwd: str, env: dict) -> None:
    code = 1
    try:
        _die_with_parent()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for signum in FORWARDED + (signal.SIGCHLD,):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        code = _run_module(args[1], args[2:])
    finally:
        _exit(code)


def _die_with_parent() -> None:
    """SIGKILL this child when the server dies, however it dies (PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the server died before the call
        os._exit(128 + signal.SIGKILL)


def _exit(code: int) -> None:
    """End the child as Python's exit would, without unwinding into the server's frames (its
    `finally` would remove the server's socket) and without the teardown: non-daemon threads
    joined, atexit handlers run (the same ones a cold stage process runs: it imports the same
    modules), stdout and stderr flushed.
    """
    import atexit
    import threading

    try:
        shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def _run_module(name: str, argv: list[str]) -> int:
    """`python -m NAME ARGV` in this process: its exit code, as the interpreter would give it."""
    import runpy

    sys.argv = [name, *argv]  # runpy puts the module's file first, as -m does
    # as in a fresh interpreter, the module runs as __main__ only, not also as the `stages.X` the
    # server imported (an import of it from here on loads it anew, as it would there)
    sys.modules.pop(name, None)
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.argv[2:]))
