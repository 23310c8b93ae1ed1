"""Running untrusted Python (a candidate solution and its unit tests) in a sandbox.

    run_tests(code, tests) -> Result       # tests import the candidate from the module `solution`
    run_code(code) -> Result               # just run it (the coding environment's `<run>` tool)
    python -m stages.envs.sandbox               # say which isolation this machine gives, and probe it

Reads and writes nothing of the project: every run is a fresh process tree under the real
interpreter, with a clean environment, a private temporary directory and `prlimit` limits, killed
with all its children past its wall-clock limit. Isolation (`isolation=`, "auto" by default):
"bwrap", else "unshare", else refused with `SandboxError` unless `runtime.sandbox.allow_unisolated`
allows "rlimit"; `require_isolation` checks it before a stage starts. A wrong or hostile answer is
an outcome ("failed", "timeout", "memory", "killed", "crashed"); our own machinery breaking raises
`SandboxError`, never a score of zero.

Details: docs/environments.md, "How the code sandbox works (stages/envs/sandbox.py)".
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from stages.envs.errors import VerifierError

log = logging.getLogger(__name__)

OUTCOMES = ("passed", "failed", "timeout", "memory", "killed", "crashed")
ISOLATIONS = ("bwrap", "unshare", "rlimit")
WORK = "/work"  # the work directory's path inside the bwrap and unshare sandboxes
UID_BASE = 1 << 20  # uids handed to sandboxed code when we are root (no real user has these)
# set (to "1") by `allow_unisolated(True)`: inherited by the verifier processes a stage starts
ALLOW_UNISOLATED_ENV = "OFFSEASON_SANDBOX_ALLOW_UNISOLATED"


class SandboxError(VerifierError):
    """The sandbox itself broke (not the code in it): an infrastructure error, never a zero."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run."""

    wall_seconds: float = 10.0  # killed with all its children after this
    cpu_seconds: int = 5  # RLIMIT_CPU: SIGXCPU, then SIGKILL a second later
    memory_mb: int = 512  # RLIMIT_AS: address space
    file_mb: int = 16  # RLIMIT_FSIZE: largest file it may write; also the work tmpfs is 4x this
    processes: int = 32  # RLIMIT_NPROC: processes and threads it may have at once
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 16_384  # stdout and stderr kept in the result, each


@dataclass(frozen=True)
class Result:
    """What happened in one sandboxed run."""

    outcome: str  # one of OUTCOMES
    exit_code: int | None  # negative: the signal that ended it; None: killed on our timeout
    stdout: str
    stderr: str
    reason: str  # why, in a line: the first failing test, the limit hit, the exit code
    seconds: float
    isolation: str  # "bwrap", "unshare" or "rlimit"
    # what the candidate did that an honest solution has no reason to do (imported the test
    # framework, the garbage collector or frame inspection, changed builtins); "" for nothing
    suspect: str = ""

    @property
    def passed(self) -> bool:
        """True if the tests passed."""
        return self.outcome == "passed"


# The `run_code` harness: runs first in the sandbox, reads the nonce, then runs the code. It
# reports on the fd in argv[1] as lines "<nonce> <json>"; `ready` before any code of the run's.
# The nonce lives only in main()'s frame, not in a module global.
HARNESS = r"""
import io, json, os, sys, traceback

def main(nonce=sys.stdin.readline().strip(), fd=int(sys.argv[1])):
    sys.stdin = io.StringIO()

    def report(**fields):
        os.write(fd, (nonce + " " + json.dumps(fields) + "\n").encode())

    def last_line(e):
        return traceback.format_exception_only(type(e), e)[-1].strip()[:300]

    report(ready=True)
    sys.path.append(os.getcwd())
    try:
        import runpy
        try:
            runpy.run_path("main.py", run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                report(done=True, ok=False, reason="exit " + str(e.code)[:300])
                return 1
        except MemoryError:
            raise
        except BaseException as e:
            traceback.print_exc()
            report(done=True, ok=False, reason=last_line(e))
            return 1
        report(done=True, ok=True)
        return 0
    except MemoryError:
        report(done=True, ok=False, memory=True, reason="MemoryError")
        return 1

sys.exit(main())
"""

# Values cross between the candidate's process and the tests' as data only: JSON with tags for
# what JSON lacks. Only these exact types (no subclass: an int subclass could override __eq__)
# are encoded; anything else is "returned an object of type X", a failed test.
CODEC = r"""
import math

class Unencodable(Exception):
    pass

def encode(value, depth=0):
    if depth > 100:
        raise Unencodable("a value nested more than 100 deep")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -2**53 < value < 2**53 else {"int": str(value)}
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [encode(item, depth + 1) for item in value]
    if kind is tuple:
        return {"tuple": [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {kind.__name__: [encode(item, depth + 1) for item in value]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [repr(value.real), repr(value.imag)]}
    raise Unencodable("an object of type " + kind.__module__ + "." + kind.__qualname__)

def decode(data):
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(item) for item in data]
    (tag, body), = data.items()
    if tag == "int":
        return int(body)
    if tag == "float":
        return float(body)
    if tag == "tuple":
        return tuple(decode(item) for item in body)
    if tag == "dict":
        return {decode(k): decode(v) for k, v in body}
    if tag == "set":
        return {decode(item) for item in body}
    if tag == "frozenset":
        return frozenset(decode(item) for item in body)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag == "complex":
        return complex(float(body[0]), float(body[1]))
    raise ValueError("unknown tag " + repr(tag))
"""

# The candidate's side: imports `solution` and answers calls, one request a line (hex marshal) on the fd
# in argv[1], each answer one line on the fd in argv[2]. It holds no report channel and no secret:
# whatever it writes is only a claim about what its own functions returned. It notes what an
# honest solution has no reason to do (import the test framework, reach for frames or the
# garbage collector, change builtins) as `suspect`.
CANDIDATE = CODEC + r"""
import builtins, marshal, os, sys
from _json import encode_basestring_ascii as _string

def dumps(value):
    # JSON of what encode() returns, without importing json (its import was a fifth of this
    # process's start-up); the tests' side parses it with json, which checks it
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    kind = type(value)
    if kind is str:
        return _string(value)
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        return float.__repr__(value)
    if kind is list:
        return "[" + ",".join([dumps(item) for item in value]) + "]"
    return "{" + ",".join([_string(k) + ":" + dumps(v) for k, v in value.items()]) + "}"

def main(requests=os.fdopen(int(sys.argv[1]), "rb"), answers=int(sys.argv[2])):
    sys.stdin = open(os.devnull)

    def send(**fields):
        os.write(answers, (dumps(fields) + "\n").encode())

    def last_line(e):
        try:
            import traceback
            return traceback.format_exception_only(type(e), e)[-1].strip()[:300]
        except BaseException:
            return type(e).__name__

    builtin_ids = {k: id(v) for k, v in vars(builtins).items()}
    watched = ("unittest", "gc", "ctypes", "_testcapi")

    def suspect():
        why = [m for m in watched if m in sys.modules and m not in preloaded]
        why += ["builtins." + k for k, v in vars(builtins).items() if builtin_ids.get(k) != id(v)]
        return ", ".join(why)

    preloaded = set(sys.modules)
    send(ready=True)
    sys.path.append(os.getcwd())
    try:
        import solution
    except MemoryError:
        send(imported=False, memory=True, reason="MemoryError")
        return 1
    except BaseException as e:
        send(imported=False, reason="import failed: " + last_line(e))
        return 1
    send(imported=True, suspect=suspect())
    for line in requests:
        try:  # from the tests' process (trusted): marshal, hex-encoded, one a line
            request = marshal.loads(bytes.fromhex(line.decode().strip()))
            number, op, name = request["id"], request["op"], request["name"]
        except (ValueError, KeyError, TypeError, EOFError):
            return 2
        try:
            value = getattr(solution, name)
        except AttributeError:
            send(id=number, missing=True)
            continue
        try:
            if op == "get":
                if callable(value):
                    send(id=number, callable=True)
                    continue
            else:
                value = value(*decode(request["args"]), **decode(request["kwargs"]))
        except MemoryError:
            send(id=number, memory=True, reason="MemoryError")
            return 1
        except BaseException as e:
            kind = next((c.__name__ for c in type(e).__mro__
                         if getattr(builtins, c.__name__, None) is c), "Exception")
            send(id=number, raised=kind, reason=last_line(e), suspect=suspect())
            continue
        try:
            data = encode(value)
        except Unencodable as e:
            send(id=number, unencodable="returned " + str(e), suspect=suspect())
            continue
        except RecursionError:
            send(id=number, unencodable="returned a value nested too deep", suspect=suspect())
            continue
        send(id=number, value=data, suspect=suspect())
    return 0

sys.exit(main())
"""

# The tests' side: never imports the candidate's code (it is not in this sandbox). `solution` is a
# module whose attributes are proxies: a call crosses to the candidate's process as data and its
# answer comes back as data, so assertions only ever see plain values. The verdict goes out on the
# report fd (argv[1]) with the nonce from stdin, which lives only in main()'s frame; the candidate's
# process never sees either.
TESTER = CODEC + r"""
import builtins, io, json, marshal, os, sys, types

class CandidateError(Exception):
    pass

def main(nonce=sys.stdin.readline().strip(), fd=int(sys.argv[1])):
    sys.stdin = io.StringIO()
    requests, answers = int(sys.argv[2]), os.fdopen(int(sys.argv[3]), "rb")
    state = {"number": 0, "dead": "", "suspect": set(), "memory": False}

    def report(**fields):
        os.write(fd, (nonce + " " + json.dumps(fields) + "\n").encode())

    def last_line(e):
        import traceback
        return traceback.format_exception_only(type(e), e)[-1].strip()[:300]

    def receive():
        line = answers.readline()
        if not line:
            state["dead"] = "the candidate's process ended"
            raise CandidateError(state["dead"])
        try:
            answer = json.loads(line)
            answer.get
        except (ValueError, AttributeError):
            state["dead"] = "the candidate's process sent something that is not an answer"
            raise CandidateError(state["dead"]) from None
        if answer.get("suspect"):
            state["suspect"].add(answer["suspect"])
        if answer.get("memory"):
            state["memory"] = True
        return answer

    def ask(op, name, args=(), kwargs=None):
        if state["dead"]:
            raise CandidateError(state["dead"])
        state["number"] += 1
        request = {"id": state["number"], "op": op, "name": name}
        if op == "call":
            request.update(args=encode(list(args)), kwargs=encode(dict(kwargs or {})))
        try:
            os.write(requests, (marshal.dumps(request).hex() + "\n").encode())
        except OSError:
            state["dead"] = "the candidate's process ended"
            raise CandidateError(state["dead"]) from None
        answer = receive()
        if answer.get("id") != state["number"]:
            state["dead"] = "the candidate's process answered out of turn"
            raise CandidateError(state["dead"])
        if answer.get("memory"):
            raise MemoryError("the candidate's process ran out of memory")
        if answer.get("missing"):
            raise AttributeError("the candidate's module has no " + repr(name))
        if "unencodable" in answer:
            raise CandidateError(name + "() " + answer["unencodable"])
        if "raised" in answer:
            kind = getattr(builtins, answer["raised"], None)
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = CandidateError
            raise kind(answer["reason"])
        return answer

    def proxy(name):
        def call(*args, **kwargs):
            return decode(ask("call", name, args, kwargs)["value"])
        call.__name__ = call.__qualname__ = name
        return call

    solution = types.ModuleType("solution")

    def attribute(name):
        if name.startswith("__"):
            raise AttributeError(name)
        answer = ask("get", name)
        return proxy(name) if answer.get("callable") else decode(answer["value"])

    solution.__getattr__ = attribute
    sys.modules["solution"] = solution
    report(ready=True)
    try:
        started = receive()
        report(candidate_ready=bool(started.get("ready")))
        imported = receive()
    except CandidateError as e:
        report(done=True, ok=False, reason=str(e) + " before its code was imported")
        return 1
    if not imported.get("imported"):
        report(done=True, ok=False, memory=bool(imported.get("memory")),
               reason=imported.get("reason") or "import failed")
        return 1
    sys.path.append(os.getcwd())
    try:
        import unittest
        try:
            import test_solution
        except MemoryError:
            raise
        except BaseException as e:
            report(done=True, ok=False, reason="import failed: " + last_line(e),
                   suspect=", ".join(sorted(state["suspect"])))
            return 1
        suite = unittest.defaultTestLoader.loadTestsFromModule(test_solution)
        result = unittest.TextTestRunner(stream=sys.stderr, verbosity=1).run(suite)
        problems = result.failures + result.errors
        first = ""
        if problems:
            test, text = problems[0]
            first = test.id().split(".", 1)[-1] + ": " + text.strip().splitlines()[-1][:300]
        report(done=True, ok=result.wasSuccessful() and result.testsRun > 0,
               tests=result.testsRun, failures=len(result.failures), errors=len(result.errors),
               memory=state["memory"] or any("MemoryError" in text for _, text in problems),
               candidate=state["dead"], suspect=", ".join(sorted(state["suspect"])),
               reason=first or ("no tests ran" if result.testsRun == 0 else ""))
        return 0 if result.wasSuccessful() else 1
    except MemoryError:
        report(done=True, ok=False, memory=True, reason="MemoryError")
        return 1

sys.exit(main())
"""


def interpreter() -> str:
    """The real interpreter behind this one: a venv's python or a shim is a symlink to it."""
    return os.path.realpath(sys.executable)


@functools.cache
def _tool(name: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/bin/{name}", f"/usr/sbin/{name}") if os.access(p, os.X_OK)),
        None)
    if path is None:
        raise SandboxError(f"`{name}` not found: the sandbox needs util-linux's {name} "
                           f"(Debian: apt-get install util-linux) or bubblewrap for bwrap")
    return path


def _own_tasks() -> int:
    """Processes and threads of our uid now: RLIMIT_NPROC counts them too when we are not root."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if int(fields.get("Uid", "-1").split()[0]) == uid:
                count += int(fields.get("Threads", "1"))
    return count


def _prefix(python: str) -> str:
    """The installation an interpreter belongs to (PREFIX/bin/python3.11 -> PREFIX)."""
    return os.path.dirname(os.path.dirname(python))


def drops_root(python: str) -> bool:
    """Whether "rlimit", run as root, can run `python` as an unprivileged uid."""
    return os.geteuid() == 0 and _world_reachable(python) and \
        _world_reachable(_prefix(python)) and bool(_free_ids())


@functools.cache
def _free_ids() -> tuple[tuple[int, int], ...]:
    """Ranges [start, end) of ids to hand sandboxed code when we are root: UID_BASE and up (no
    real user has these), as far as this user namespace maps them in both uid_map and gid_map;
    in a container that maps fewer (rootless: 65,536 from the host's subuids), its mapped ids
    from 10,000 up; none where only root is mapped (then no sandbox can drop root: refused).
    """
    def mapped(path: str) -> list[tuple[int, int]]:
        try:
            lines = Path(path).read_text().split("\n")
        except OSError:
            return [(0, 1 << 32)]
        return [(int(f[0]), int(f[0]) + int(f[2])) for f in map(str.split, lines) if len(f) == 3]

    both = [(max(a, c), min(b, d)) for a, b in mapped("/proc/self/uid_map")
            for c, d in mapped("/proc/self/gid_map") if max(a, c) < min(b, d)]
    for low, high in ((UID_BASE, UID_BASE + (1 << 20)), (10_000, 1 << 31)):
        ranges = tuple((max(a, low), min(b, high)) for a, b in both if max(a, low) < min(b, high))
        if ranges:
            return ranges
    return ()


def _drop_uid() -> int:
    """A fresh unprivileged uid (and gid) for one run, from `_free_ids`."""
    ranges = _free_ids()
    if not ranges:
        raise SandboxError("no unprivileged uid to run the code as: this user namespace maps only "
                           "root (/proc/self/uid_map); map a range of ids into the container "
                           "(subuids), or run offseason as a user")
    start, end = ranges[secrets.randbelow(len(ranges))]
    return start + secrets.randbelow(end - start)


def _world_reachable(path: str) -> bool:
    """Whether a uid with no rights can traverse to and read `path` (every parent o+x)."""
    parts = Path(path).resolve()
    return all(os.stat(p).st_mode & 0o001 for p in [parts, *parts.parents] if p != parts) and \
        bool(os.stat(parts).st_mode & 0o004)


def _bwrap_args(python: str, uid: int | None, limits: Limits, files: dict[str, int]) -> list[str]:
    binds = sorted({_prefix(python), os.path.dirname(python)})
    args = [_tool("bwrap"), "--die-with-parent", "--new-session",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if uid is not None:
        # root: no user namespace (it would map to uid 0, which RLIMIT_NPROC ignores); the caps
        # to drop to `uid` are kept for setpriv only and are gone once it has switched
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{top}"):  # merged /usr: keep the symlinks the loader expects
            args += ["--symlink", os.readlink(f"/{top}"), f"/{top}"]
        elif os.path.isdir(f"/{top}"):
            args += ["--ro-bind", f"/{top}", f"/{top}"]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in binds:
        if path == "/usr" or path.startswith("/usr/"):
            continue  # bound above
        # bwrap copies the host's mode onto the parents it creates (/root is 0700): open them up
        for parent in reversed(Path(path).parents[:-1]):
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    size = str(limits.file_mb * 4 << 20)
    args += ["--dev", "/dev", "--proc", "/proc",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "0777", "--size", size, "--tmpfs", WORK]
    for name, fd in files.items():
        args += ["--perms", "0644", "--file", str(fd), f"{WORK}/{name}"]
    # the new root is bwrap's own tmpfs, unbounded and, in a user namespace, the user's: read-only
    # (only the work tmpfs and /tmp, both bounded, take writes)
    args += ["--remount-ro", "/", "--chdir", WORK, "--clearenv"]
    for key, value in _env(WORK).items():
        args += ["--setenv", key, value]
    args.append("--")
    if uid is not None:
        args += [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--inh-caps=-all", "--"]
    return args


# The "unshare" sandbox's set-up, run by /bin/sh as pid 1 of the new namespaces, before any code
# of the run's: a new root on a tmpfs holding read-only binds (the same as bwrap's), a /proc of
# the new pid namespace, a few devices and size-limited tmpfs work and /tmp directories with the
# run's files; `pivot_root` into it, the machine's root detached; then run the drop (its argv
# after the binds' "--") and the command as its child, and exit as it did (a signal as 128 + its
# number, as bwrap's pid 1 does). It stays pid 1, outside the code's reach: as root, a uid the
# code is not; as a user, with capabilities the code lacks (so it cannot be traced), and the init
# of the pid namespace (so it cannot be signalled from inside). When it exits, the kernel ends
# every process left in the namespace (setsid() included). Arguments: the new root's mount point (an empty folder
# of ours), the work files' folder, the tmpfs size in bytes, the uid to chown the work files to
# ("" to leave them), the paths to bind, "--", the drop and the command.
UNSHARE_SETUP = r"""set -e
PATH=/usr/sbin:/usr/bin:/sbin:/bin
root=$1 files=$2 size=$3 owner=$4
shift 4
mount -t tmpfs -o mode=0755,size=1m offseason-sandbox "$root"
cd "$root"
mkdir usr proc dev tmp work etc
mount --bind -o ro /usr usr
for top in bin lib lib64 sbin; do
  if [ -L "/$top" ]; then ln -s "$(readlink "/$top")" "$top"
  elif [ -d "/$top" ]; then mkdir "$top"; mount --bind -o ro "/$top" "$top"; fi
done
if [ -e /etc/ld.so.cache ]; then
  touch etc/ld.so.cache; mount --bind -o ro /etc/ld.so.cache etc/ld.so.cache
fi
while [ "$1" != "--" ]; do
  mkdir -p "$root$1"; mount --bind -o ro "$1" "$root$1"; shift
done
shift
mount -t proc -o nosuid,nodev,noexec proc proc
mount -t tmpfs -o mode=0755,size=64k dev dev
for node in null zero full random urandom; do
  touch "dev/$node"; mount --bind "/dev/$node" "dev/$node"
done
mkdir dev/shm
mount -t tmpfs -o "mode=1777,size=$size,nosuid,nodev" shm dev/shm
mount -t tmpfs -o "mode=1777,size=$size,nosuid,nodev" tmp tmp
mount -t tmpfs -o "mode=0755,size=$size,nosuid,nodev" work work
cp -R "$files"/. work/
if [ -n "$owner" ]; then chown -R "$owner:$owner" work; fi
mount -o remount,bind,ro "$root"
pivot_root . .
umount -l .
cd /work
PATH=/usr/bin:/bin
set +e
"$@"
exit $?
"""


def _unshare_args(python: str, uid: int | None, limits: Limits, files: Path) -> list[str]:
    """The argv before the command of an "unshare" sandbox (UNSHARE_SETUP): as root, namespaces
    and a drop to `uid`; as a user (`uid` None), namespaces in a user namespace and the code as
    the user's own uid in a second one.
    """
    binds = sorted({_prefix(python), os.path.dirname(python)} - {"/usr"})
    binds = [b for b in binds if not b.startswith("/usr/")]  # bound with /usr
    namespaces = ["--pid", "--fork", "--kill-child", "--mount", "--net", "--ipc", "--uts"]
    drop = [_tool("setpriv"), "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    if uid is not None:
        drop[1:1] = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        owner = str(uid)
    else:
        # mapped to root in the first namespace (to mount), to the user's own ids in the second
        namespaces = ["--user", "--map-root-user"] + namespaces
        drop = [_tool("unshare"), "--user", f"--map-user={os.getuid()}",
                f"--map-group={os.getgid()}", "--"] + drop
        owner = ""
    return [_tool("unshare"), *namespaces, "--", _tool("sh"), "-c", UNSHARE_SETUP, "sh",
            str(files.parent / "root"), str(files), str(limits.file_mb * 4 << 20), owner,
            *binds, "--", *drop, "--"]


def _env(home: str) -> dict[str, str]:
    return {"HOME": home, "TMPDIR": "/tmp" if home == WORK else home, "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def _prlimit(limits: Limits, nproc: int) -> list[str]:
    mem = limits.memory_mb << 20
    return [_tool("prlimit"), f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
            f"--as={mem}", f"--fsize={limits.file_mb << 20}", f"--nproc={nproc}",
            f"--nofile={limits.open_files}", "--core=0", "--"]


@functools.cache
def net_namespace_works() -> bool:
    """Whether `unshare --net` works here (root, and a container that lets root unshare)."""
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run([_tool("unshare"), "--net", "--", "true"], capture_output=True,
                              env={"PATH": "/usr/bin:/bin"}, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def server_prefix(memory_mb: int, network: bool, open_files: int = 1024) -> list[str]:
    """The launcher of a long-running local server (a stdio MCP server): the argv to put before
    its command. The limits of a sandboxed run that suit a server (RLIMIT_AS `memory_mb`, file
    size, open files, no core dumps; no CPU-seconds limit: it lives as long as its sessions), in a
    network namespace of its own with nothing in it (`unshare --net`) unless `network`. What the
    rlimit isolation says above holds (a process group, limits, no network); the filesystem is
    the machine's (the server reads the project, as its command needs). Where no network
    namespace can be made (not root, a container that refuses it) a server without `network`
    is refused with SandboxError, naming what to do, rather than run with the network.
    """
    prefix = [_tool("prlimit"), f"--as={memory_mb << 20}", f"--fsize={Limits.file_mb << 20}",
              f"--nofile={open_files}", "--core=0", "--"]
    if not network:
        if not net_namespace_works():
            raise SandboxError("cannot start it without the network: `unshare --net` does not "
                               "work here (it needs root, and a container that lets root "
                               "unshare); run offseason as root, or set `network: true` on the "
                               "environment to let its tools reach the network")
        prefix += [_tool("unshare"), "--net", "--"]
    return prefix


@functools.cache
def bwrap_problem() -> str | None:
    """None if a probe run under bwrap works here, else why not."""
    if shutil.which("bwrap") is None and not os.access("/usr/bin/bwrap", os.X_OK):
        return "bwrap is not installed (Debian: apt-get install bubblewrap; `make setup` does it as root)"
    return _probe("bwrap")


@functools.cache
def unshare_problem() -> str | None:
    """None if a probe run of the "unshare" sandbox works here, else why not (a container that
    lets neither root nor a user namespace make namespaces, say).
    """
    try:
        for tool in ("unshare", "setpriv", "sh"):
            _tool(tool)
    except SandboxError as e:
        return str(e)
    return _probe("unshare")


def _probe(kind: str) -> str | None:
    try:
        result = _run({"main.py": "print('ok')"}, Limits(), kind, _checked(interpreter()))
    except SandboxError as e:
        return str(e)
    return None if result.passed and result.stdout.strip() == "ok" else result.reason


def allow_unisolated(allowed: bool) -> None:
    """Whether code may run with no isolation ("rlimit") where neither bwrap nor unshare works:
    `runtime.sandbox.allow_unisolated` in params.yaml, applied by the stages that load
    environments (for this process and the verifier processes it starts).
    """
    os.environ[ALLOW_UNISOLATED_ENV] = "1" if allowed else "0"


def _unisolated_allowed() -> bool:
    return os.environ.get(ALLOW_UNISOLATED_ENV) == "1"


def choose_isolation(requested: str = "auto") -> str:
    """The isolation a run gets: "bwrap", "unshare" or "rlimit" (module docstring). "auto" refuses
    with SandboxError where no isolation works and unisolated runs are not allowed; a named
    isolation that does not work here raises.
    """
    if requested not in ("auto", *ISOLATIONS):
        raise SandboxError(f"isolation must be auto, {', '.join(ISOLATIONS)}, not {requested!r}")
    if requested == "rlimit":
        return "rlimit"
    if requested in ("auto", "bwrap"):
        problem = bwrap_problem()
        if problem is None:
            return "bwrap"
        if requested == "bwrap":
            raise SandboxError(f"bubblewrap is required but does not work here: {problem}")
    fallback = unshare_problem()
    if fallback is None:
        if requested == "auto":
            _warn_fallback(problem)
        return "unshare"
    if requested == "unshare":
        raise SandboxError(f"the unshare sandbox is required but does not work here: {fallback}")
    if not _unisolated_allowed():
        raise SandboxError(
            f"no sandbox works on this machine, so model-written code is not run: bubblewrap: "
            f"{problem}; unshare: {fallback}. Install bubblewrap (Debian: apt-get install "
            f"bubblewrap), or run where namespaces are allowed (as root, or with user namespaces "
            f"enabled; a container needs them allowed by its runtime); to run the code with no "
            f"isolation anyway (its limits only: it sees the machine's files and processes), set "
            f"runtime.sandbox.allow_unisolated: true in params.yaml")
    _warn_unisolated(problem, fallback)
    return "rlimit"


def require_isolation(where: str) -> str:
    """The isolation this machine gives the code of `where` (an environment that runs code in
    this sandbox), checked before a stage starts: raises SandboxError, naming `where` and the fix,
    where there is none and unisolated runs are not allowed.
    """
    try:
        return choose_isolation("auto")
    except SandboxError as e:
        raise SandboxError(f"{where} runs model-written code in the sandbox: {e}") from None


@functools.cache
def _warn_fallback(problem: str) -> None:
    log.warning("sandbox: bubblewrap unavailable (%s); using the unshare sandbox (namespaces and "
                "an unprivileged uid made with util-linux: see stages/envs/sandbox.py)", problem)


@functools.cache
def _warn_unisolated(bwrap: str, unshare: str) -> None:
    # once per process, so once in every stage that runs code: a cycle's log always says it
    log.warning("sandbox: NO ISOLATION (runtime.sandbox.allow_unisolated is true): model-written "
                "code runs with rlimits only and sees this machine's files and processes; "
                "bubblewrap: %s; unshare: %s", bwrap, unshare)


def run_tests(code: str, tests: str, *, limits: Limits = Limits(), isolation: str = "auto",
              python: str | None = None) -> Result:
    """Run unit tests (unittest source importing from `solution`) against `code`: the code in one
    sandbox, the tests in another that never imports it (module docstring); `limits` apply to each.
    """
    kind = choose_isolation(isolation)
    return _run_tests(code, tests, limits, kind, _checked(python or interpreter()))


def run_code(code: str, *, limits: Limits = Limits(), isolation: str = "auto",
             python: str | None = None) -> Result:
    """Run `code` as a script in a sandbox; "passed" if it exits normally."""
    return _run({"main.py": code}, limits, choose_isolation(isolation),
                _checked(python or interpreter()))


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", "replace")
    return text + ("\n[... output truncated]" if len(data) > limit else "")


def _checked(python: str) -> str:
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        raise SandboxError(f"interpreter {python!r} is not an executable file: pass the real "
                           f"interpreter (os.path.realpath(sys.executable))")
    python = os.path.realpath(python)
    if _prefix(python) == "/":
        raise SandboxError(f"interpreter {python!r} lies in /bin or /sbin outside /usr: the sandbox "
                           f"binds the interpreter's installation and will not bind all of /")
    return python


@functools.lru_cache(maxsize=None)
def _site_dirs(python: str) -> list[str]:
    """The interpreter's site-packages folders. The sandboxed processes start with `-S` and put
    these on sys.path themselves: `site` would also run every `.pth` file there, which on a
    machine with a few of them (setuptools' distutils hook, a certificate bundle) cost 36 ms of a
    50 ms start-up, for every process of every verification.
    """
    code = "import json, site; print(json.dumps([p for p in site.getsitepackages()]))"
    try:
        out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True,
                             timeout=60, env={})
        return [p for p in json.loads(out.stdout) if os.path.isdir(p)]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []  # not an interpreter that runs: the sandbox's own start says so, precisely


@dataclass
class _Box:
    """One sandboxed process: its files, output and where it runs."""

    proc: subprocess.Popen
    folder: Path  # ours, never visible inside: the process's .stdout and .stderr

    def output(self, limits: Limits) -> tuple[str, str]:
        return tuple(_read(self.folder / n, limits.output_bytes) for n in (".stdout", ".stderr"))


def _start(files: dict[str, str], harness: str, fds: list[int], limits: Limits, kind: str,
           python: str, folder: Path) -> _Box:
    """Start `python -I -S -c harness fd...` in a sandbox of `kind` holding `files` (and nothing
    else of ours), with `fds` passed in (their numbers are the harness's arguments); the
    candidate's harnesses put the interpreter's site-packages on sys.path (`_site_dirs`).
    """
    root = os.geteuid() == 0
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    out, err = (open(folder / n, "w+b") for n in (".stdout", ".stderr"))
    readable = {name: os.open(folder / name, os.O_RDONLY) for name in files}
    try:
        if harness is not TESTER:  # the candidate's code may import what is installed
            harness = f"import sys\nsys.path.extend({_site_dirs(python)!r})\n" + harness
        command = [python, "-I", "-S", "-c", harness, *map(str, fds)]
        if kind == "bwrap":
            uid = _drop_uid() if root else None
            nproc = limits.processes if root else _own_tasks() + limits.processes
            cwd, env = "/", None
            argv = _prlimit(limits, nproc) + _bwrap_args(python, uid, limits, readable) + command
        elif kind == "unshare":
            work = folder / "work"  # copied into the sandbox's own tmpfs by UNSHARE_SETUP
            work.mkdir()
            (folder / "root").mkdir()
            for name in files:
                shutil.copy(folder / name, work / name)
            uid = _drop_uid() if root else None
            nproc = limits.processes if root else _own_tasks() + limits.processes
            cwd, env = str(folder), _env(WORK)
            argv = _prlimit(limits, nproc) + _unshare_args(python, uid, limits, work) + command
        else:
            work = folder / "work"
            work.mkdir()
            for name in files:
                shutil.copy(folder / name, work / name)
            prefix, uid = [], None
            if net_namespace_works():
                prefix = [_tool("unshare"), "--net", "--"]
            if root and drops_root(python):
                uid = _drop_uid()
                os.chmod(folder.parent, 0o711)
                os.chmod(folder, 0o711)
                for path in [work, *work.iterdir()]:
                    os.chown(path, uid, uid)
                prefix += [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}",
                           "--clear-groups", "--"]
            nproc = limits.processes if uid is not None else _own_tasks() + limits.processes
            cwd, env = str(work), _env(str(work))
            argv = _prlimit(limits, nproc) + prefix + command
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    cwd=cwd, env=env if env is not None else {},
                                    start_new_session=True, close_fds=True,
                                    pass_fds=(*readable.values(), *fds))
        except OSError as e:
            raise SandboxError(f"cannot start the sandbox ({argv[0]}): {e}") from e
        return _Box(proc, folder)
    finally:
        for fd in readable.values():
            os.close(fd)
        out.close()
        err.close()


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    """`proc.wait(timeout)`, woken the moment the process ends: Popen.wait with a timeout polls
    with sleeps that grow to 50 ms, which added tens of milliseconds to every verification (and
    left the core idle meanwhile). A pidfd (Linux 5.3) becomes readable when the process exits.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfds here (or the process is already reaped)
        proc.wait(timeout=timeout)
        return
    try:
        import select

        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0, int(timeout * 1000))) and proc.poll() is None:
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(fd)
    proc.wait()


def _stop(box: _Box, kind: str, deadline: float) -> bool:
    """Wait for the process until `deadline` (monotonic); past it, kill its group. True if it
    had to be killed.
    """
    timed_out = False
    try:
        _wait(box.proc, max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(box.proc.pid, signal.SIGKILL)
        try:
            box.proc.wait(timeout=5)
        except subprocess.TimeoutExpired as e:
            raise SandboxError(f"sandbox process {box.proc.pid} survived SIGKILL to its group "
                               f"for 5 s") from e
    if kind == "rlimit":
        # children left in the group (not the ones that called setsid: see the docstring)
        try:
            os.killpg(box.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return timed_out


def _send_nonce(box: _Box, nonce: str) -> None:
    try:
        box.proc.stdin.write(f"{nonce}\n".encode())
        box.proc.stdin.close()
    except BrokenPipeError:
        pass  # it died before reading: the missing `ready` says so


def _reports(path: Path, nonce: str) -> list[dict]:
    reports = []
    for line in path.read_bytes()[:1 << 20].decode("utf-8", "replace").splitlines():
        head, _, body = line.partition(" ")
        if head == nonce:
            try:
                reports.append(json.loads(body))
            except json.JSONDecodeError:
                continue
    return reports


def _signal_of(code: int | None, kind: str, reported: bool) -> signal.Signals | None:
    number = -code if code is not None and code < 0 else None
    if kind != "rlimit" and code is not None and code > 128 and not reported:
        number = code - 128  # the sandbox's pid 1 passes a signal death on as 128 + its number
    return signal.Signals(number) if number is not None and number in signal.valid_signals() \
        else None


def _signal_outcome(sig: signal.Signals, seconds: float, limits: Limits,
                    whose: str) -> tuple[str, str]:
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and seconds >= limits.cpu_seconds):
        return "timeout", f"CPU limit of {limits.cpu_seconds} s ({sig.name}{whose})"
    if sig == signal.SIGXFSZ:
        return "killed", f"file size limit of {limits.file_mb} MB ({sig.name}{whose})"
    return "killed", f"ended by {sig.name}{whose}"


def _run(files: dict[str, str], limits: Limits, kind: str, python: str) -> Result:
    """`run_code`: the code as main.py under HARNESS, reporting on a result file."""
    nonce = secrets.token_hex(16)
    private = Path(tempfile.mkdtemp(prefix="offseason-sandbox-"))  # ours: never visible inside
    try:
        with open(private / ".result", "w+b") as res:
            started = time.monotonic()
            box = _start(files, HARNESS, [res.fileno()], limits, kind, python, private / "run")
        _send_nonce(box, nonce)
        timed_out = _stop(box, kind, started + limits.wall_seconds)
        seconds = time.monotonic() - started
        stdout, stderr = box.output(limits)
        reports = _reports(private / ".result", nonce)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    code = None if timed_out else box.proc.returncode

    def result(outcome: str, reason: str) -> Result:
        return Result(outcome, code, stdout, stderr, reason, round(seconds, 3), kind)

    if not any(r.get("ready") for r in reports):
        _not_started(timed_out, limits, kind, code, stderr)
    final = next((r for r in reports if r.get("done")), None)
    if timed_out:
        return result("timeout", f"wall-clock limit of {limits.wall_seconds} s: killed with its "
                                 f"children")
    return result(*_verdict(final, code, kind, seconds, limits, "exit 0",
                            "it reported (sys.exit or os._exit in the code?)"))


def _verdict(final: dict | None, code: int | None, kind: str, seconds: float, limits: Limits,
             passed: str, crashed: str) -> tuple[str, str]:
    """(outcome, reason) of a harness process that ended by itself, from its exit and its final
    report: a signal, no report ("crashed": exited before `crashed`), memory, passed or failed.
    """
    sig = _signal_of(code, kind, final is not None)
    if sig is not None:
        return _signal_outcome(sig, seconds, limits, "")
    if final is None:
        return "crashed", f"exited with {code} before {crashed}"
    if final.get("memory"):
        return "memory", f"memory limit of {limits.memory_mb} MB: " \
                         f"{final.get('reason') or 'MemoryError'}"
    if final.get("ok") and code == 0:
        return "passed", passed
    return "failed", final.get("reason") or f"exit {code}"


def _not_started(timed_out: bool, limits: Limits, kind: str, code, stderr: str, what: str = ""):
    if timed_out:
        raise SandboxError(f"the sandbox{what} did not start within {limits.wall_seconds} s "
                           f"(machine overloaded?): {stderr[-500:]}")
    raise SandboxError(f"the sandbox{what} did not start ({kind}, exit {code}): "
                       f"{stderr.strip()[-1000:] or 'no output'}")


def _run_tests(code: str, tests: str, limits: Limits, kind: str, python: str) -> Result:
    """The candidate under CANDIDATE in one sandbox, the tests under TESTER in another, joined by
    two pipes that carry data only; the verdict is the tester's report (module docstring).
    """
    nonce = secrets.token_hex(16)
    private = Path(tempfile.mkdtemp(prefix="offseason-sandbox-"))
    calls_r, calls_w = os.pipe()  # tester -> candidate: requests
    answers_r, answers_w = os.pipe()  # candidate -> tester: answers
    try:
        with open(private / ".result", "w+b") as res:
            started = time.monotonic()
            candidate = tester = None
            try:
                candidate = _start({"solution.py": code}, CANDIDATE, [calls_r, answers_w], limits,
                                   kind, python, private / "candidate")
                tester = _start({"test_solution.py": tests}, TESTER,
                                [res.fileno(), calls_w, answers_r], limits, kind, python,
                                private / "tester")
            finally:
                for fd in (calls_r, calls_w, answers_r, answers_w):
                    os.close(fd)  # theirs now: an end closes when its process ends
                if tester is None and candidate is not None:
                    _stop(candidate, kind, 0)
        candidate.proc.stdin.close()
        _send_nonce(tester, nonce)
        deadline = started + limits.wall_seconds
        tester_late = _stop(tester, kind, deadline)
        # the tests are done (or out of time): the candidate gets a moment to end by itself
        candidate_late = _stop(candidate, kind, min(deadline, time.monotonic() + 1.0))
        seconds = time.monotonic() - started
        (c_out, c_err), (t_out, t_err) = candidate.output(limits), tester.output(limits)
        reports = _reports(private / ".result", nonce)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    stdout, stderr = c_out + t_out, c_err + t_err
    code = None if tester_late else tester.proc.returncode
    final = next((r for r in reports if r.get("done")), None)
    suspect = (final or {}).get("suspect", "")

    def result(outcome: str, reason: str) -> Result:
        return Result(outcome, code, stdout, stderr, reason, round(seconds, 3), kind, suspect)

    if not any(r.get("ready") for r in reports):
        _not_started(tester_late, limits, kind, code, t_err, " (tests)")
    if not any(r.get("candidate_ready") for r in reports):
        if final is not None and not tester_late:
            _not_started(candidate_late, limits, kind, candidate.proc.returncode, c_err,
                         " (candidate)")
    if tester_late:
        return result("timeout", f"wall-clock limit of {limits.wall_seconds} s: killed with its "
                                 f"children")
    # the candidate's process ended by a signal (its CPU limit, a crash) while tests still failed
    candidate_code = None if candidate_late else candidate.proc.returncode
    sig = _signal_of(candidate_code, kind, False)
    if sig is not None and not (final or {}).get("ok"):
        return result(*_signal_outcome(sig, seconds, limits, " in the candidate's process"))
    outcome, reason = _verdict(final, code, kind, seconds, limits,
                               f"{(final or {}).get('tests')} tests passed",
                               "the tests reported (sys.exit or os._exit in the tests?)")
    if outcome == "failed" and final.get("candidate") and candidate_code not in (None, 0):
        reason += f" ({final['candidate']} with exit {candidate_code})"
    return result(outcome, reason)


def main(argv: list[str] | None = None) -> None:
    """Say which isolation this machine gives and probe it (the command line)."""
    parser = argparse.ArgumentParser(
        description="Say which sandbox isolation this machine gives to model-written code "
                    "(bubblewrap, the unshare sandbox, or none) and probe it.")
    parser.add_argument("--isolation", default="auto", choices=["auto", *ISOLATIONS],
                        help="auto (default): bwrap if it works here, else unshare, else refuse")
    parser.add_argument("--allow-unisolated", action="store_true",
                        help="as runtime.sandbox.allow_unisolated: true: with no sandbox, run "
                             "with rlimits only rather than refuse")
    args = parser.parse_args(argv)
    if args.allow_unisolated:
        allow_unisolated(True)
    print(f"running as uid {os.geteuid()}")
    print(f"bubblewrap: {bwrap_problem() or 'works'}")
    print(f"unshare: {unshare_problem() or 'works'}")
    print(f"network namespace for MCP servers: {'yes' if net_namespace_works() else 'no'}")
    try:
        kind = choose_isolation(args.isolation)
    except SandboxError as e:
        sys.exit(f"isolation: none: {e}")
    result = run_tests("def add(a, b):\n    return a + b\n",
                       "import unittest\nfrom solution import add\n\n"
                       "class T(unittest.TestCase):\n    def test(self):\n"
                       "        self.assertEqual(add(2, 3), 5)\n", isolation=kind)
    print(f"isolation: {kind}; interpreter: {interpreter()}; probe: {result.outcome} "
          f"({result.reason}, {result.seconds} s)")

if __name__ == "__main__":
    main()
