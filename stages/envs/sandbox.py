"""Running untrusted Python (a candidate solution and its unit tests) in a sandbox.

    run_tests(code, tests) -> Result       # tests import the candidate from the module `solution`
    run_code(code) -> Result               # just run it (the coding environment's `<run>` tool)
    python -m stages.envs.sandbox               # say which isolation this machine gives, and probe it

Every run is a fresh process tree under the real interpreter (`os.path.realpath(sys.executable)`,
never a version manager's shim, in isolated mode `-I`: no PYTHON* variables, no user site), in a
new session (its own process group), with a clean environment (only HOME, TMPDIR, PATH, LANG: no
inherited variable, so no secret, reaches it), a private temporary directory as cwd and HOME, and
limits set by util-linux's `prlimit`: CPU seconds, address space, file size, open files, processes,
no core dumps. A run past its wall-clock limit is killed with all its children (`os.killpg`).

Two kinds of isolation, picked by `isolation=`:
- "bwrap" (bubblewrap, Debian's package `bubblewrap`; `make setup` installs it when run as root):
  new pid, network, ipc and uts namespaces (the network namespace has only a loopback device that
  nothing listens on: every connect fails at once, nothing leaves the machine), a new root holding
  read-only binds of /usr and of the interpreter's prefix and nothing else (no /home, /root, /etc,
  repository or secrets files), a size-limited tmpfs as the work directory and another as /tmp
  (writes anywhere else fail: read-only or absent), `--die-with-parent`, and pid 1 of the sandbox
  taking every process in it down when it ends (a child that calls setsid() cannot outlive the run).
  When we are root, the sandboxed code runs as a fresh unprivileged uid (random per run, dropped with
  `setpriv`, capabilities cleared, no_new_privs) because the kernel never enforces RLIMIT_NPROC on
  uid 0: that is what bounds a fork bomb. When we are not root, bwrap uses a user namespace.
- "rlimit" (the fallback where bwrap is missing or the kernel refuses its namespaces): the limits,
  the session, the clean environment and the temporary directory all hold; in addition, as root,
  the code gets its own network namespace (`unshare --net`, so no network either, where the
  container lets root unshare: `net_namespace_works()`) and runs as an
  unprivileged uid when the interpreter's installation is world-readable (`drops_root()`: Debian's
  /usr/bin/python3 is, a pyenv interpreter under /root is not). What does NOT hold without
  bwrap: the filesystem is the machine's (the code can read whatever its uid can, and write
  wherever its uid may; run as root with an interpreter under /root it stays root: then it may
  write anywhere, RLIMIT_NPROC does not bound a fork bomb, and it reads every process's
  environment in /proc, so only the sandbox's own environment is clean), disk use is
  bounded per file (RLIMIT_FSIZE) but not in total, a child that calls setsid() escapes the kill
  (RLIMIT_CPU still ends it if it spins), and without root there is no network isolation at all and
  the process limit is the user's current count plus `processes`, shared with the user's other
  processes.
"auto" (the default) takes bwrap when a probe run works, else "rlimit" with a warning.

Outcomes: "passed" (every test ran and passed), "failed" (a test failed or errored, or the code did
not import), "timeout" (wall clock or CPU limit), "memory" (MemoryError under the address-space
limit), "killed" (ended by a signal, e.g. SIGSEGV; Python ignores SIGXFSZ, so writing past the
file-size limit raises OSError: "failed"), "crashed" (the code exited the
harness itself: sys.exit or os._exit before the tests reported). All of those are the candidate's
doing: a wrong answer. When our own machinery breaks (bwrap or prlimit missing, the interpreter
cannot start, the harness never came up, a killed run that will not die) `SandboxError` is raised:
an error with its cause, never a score of zero. The harness reports over a file descriptor with a
random nonce it reads from stdin before the candidate's code is imported, so printing a fake
"all passed" or exiting 0 early does not pass.
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
WORK = "/work"  # the work directory's path inside the bwrap sandbox
UID_BASE = 1 << 20  # uids handed to sandboxed code when we are root (no real user has these)


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
    isolation: str  # "bwrap" or "rlimit"

    @property
    def passed(self) -> bool:
        """True if the tests passed."""
        return self.outcome == "passed"


# The harness: runs first in the sandbox, reads the nonce, then imports the candidate and its tests.
# It reports on the fd in argv[1] as lines "<nonce> <json>"; `ready` before any candidate code runs.
# The nonce lives only in main()'s frame, not in a module global: code that walks the frames of its
# own process could still find it (nothing in-process stops that), printing or exiting cannot.
HARNESS = r"""
import io, json, os, sys, traceback

def main(nonce=sys.stdin.readline().strip(), fd=int(sys.argv[1]), mode=sys.argv[2]):
    sys.stdin = io.StringIO()

    def report(**fields):
        os.write(fd, (nonce + " " + json.dumps(fields) + "\n").encode())

    def last_line(e):
        return traceback.format_exception_only(type(e), e)[-1].strip()[:300]

    report(ready=True)
    sys.path.append(os.getcwd())
    try:
        if mode == "code":
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
        import unittest
        try:
            import test_solution
        except MemoryError:
            raise
        except BaseException as e:
            report(done=True, ok=False, reason="import failed: " + last_line(e))
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
               memory=any("MemoryError" in text for _, text in problems),
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
    """Whether the rlimit fallback, run as root, can run `python` as an unprivileged uid."""
    return os.geteuid() == 0 and _world_reachable(python) and _world_reachable(_prefix(python))


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
    args += ["--chdir", WORK, "--clearenv"]
    for key, value in _env(WORK).items():
        args += ["--setenv", key, value]
    args.append("--")
    if uid is not None:
        args += [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--inh-caps=-all", "--"]
    return args


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


@functools.cache
def bwrap_problem() -> str | None:
    """None if a probe run under bwrap works here, else why not."""
    if shutil.which("bwrap") is None and not os.access("/usr/bin/bwrap", os.X_OK):
        return "bwrap is not installed (Debian: apt-get install bubblewrap; `make setup` does it as root)"
    try:
        result = _run({"main.py": "print('ok')"}, "code", Limits(), "bwrap", interpreter())
    except SandboxError as e:
        return str(e)
    return None if result.passed and result.stdout.strip() == "ok" else result.reason


def choose_isolation(requested: str = "auto") -> str:
    """The isolation a run gets: "bwrap" or "rlimit"; raises if "bwrap" is required but fails."""
    if requested not in ("auto", "bwrap", "rlimit"):
        raise SandboxError(f"isolation must be auto, bwrap or rlimit, not {requested!r}")
    if requested == "rlimit":
        return "rlimit"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if requested == "bwrap":
        raise SandboxError(f"bubblewrap is required but does not work here: {problem}")
    _warn_fallback(problem)
    return "rlimit"


@functools.cache
def _warn_fallback(problem: str) -> None:
    log.warning("sandbox: bubblewrap unavailable (%s); falling back to rlimits and a process group, "
                "without filesystem isolation (see stages/envs/sandbox.py for what holds)", problem)


def run_tests(code: str, tests: str, *, limits: Limits = Limits(), isolation: str = "auto",
              python: str | None = None) -> Result:
    """Run unit tests (unittest source importing from `solution`) against `code` in a sandbox."""
    return _run({"solution.py": code, "test_solution.py": tests}, "tests", limits,
                choose_isolation(isolation), python or interpreter())


def run_code(code: str, *, limits: Limits = Limits(), isolation: str = "auto",
             python: str | None = None) -> Result:
    """Run `code` as a script in a sandbox; "passed" if it exits normally."""
    return _run({"main.py": code}, "code", limits, choose_isolation(isolation),
                python or interpreter())


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", "replace")
    return text + ("\n[... output truncated]" if len(data) > limit else "")


def _run(files: dict[str, str], mode: str, limits: Limits, kind: str, python: str) -> Result:
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        raise SandboxError(f"interpreter {python!r} is not an executable file: pass the real "
                           f"interpreter (os.path.realpath(sys.executable))")
    python = os.path.realpath(python)
    if _prefix(python) == "/":
        raise SandboxError(f"interpreter {python!r} lies in /bin or /sbin outside /usr: the sandbox "
                           f"binds the interpreter's installation and will not bind all of /")
    root = os.geteuid() == 0
    nonce = secrets.token_hex(16)
    private = Path(tempfile.mkdtemp(prefix="offseason-sandbox-"))  # ours: never visible inside
    try:
        for name, text in files.items():
            (private / name).write_text(text)
        out, err, res = (open(private / n, "w+b") for n in (".stdout", ".stderr", ".result"))
        fds = {name: os.open(private / name, os.O_RDONLY) for name in files}
        try:
            if kind == "bwrap":
                uid = UID_BASE + secrets.randbelow(1 << 20) if root else None
                nproc = limits.processes if root else _own_tasks() + limits.processes
                cwd, env = "/", None
                argv = (_prlimit(limits, nproc) + _bwrap_args(python, uid, limits, fds)
                        + [python, "-I", "-c", HARNESS, str(res.fileno()), mode])
            else:
                work = private / "work"
                work.mkdir()
                for name in files:
                    shutil.copy(private / name, work / name)
                prefix, uid = [], None
                if net_namespace_works():
                    prefix = [_tool("unshare"), "--net", "--"]
                if root:
                    if drops_root(python):
                        uid = UID_BASE + secrets.randbelow(1 << 20)
                        os.chmod(private, 0o711)
                        for path in [work, *work.iterdir()]:
                            os.chown(path, uid, uid)
                        prefix += [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}",
                                   "--clear-groups", "--"]
                nproc = limits.processes if uid is not None else _own_tasks() + limits.processes
                cwd, env = str(work), _env(str(work))
                argv = (_prlimit(limits, nproc) + prefix
                        + [python, "-I", "-c", HARNESS, str(res.fileno()), mode])
            started = time.monotonic()
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                        cwd=cwd, env=env if env is not None else {},
                                        start_new_session=True, close_fds=True,
                                        pass_fds=(*fds.values(), res.fileno()))
            except OSError as e:
                raise SandboxError(f"cannot start the sandbox ({argv[0]}): {e}") from e
            return _wait(proc, nonce, limits, kind, started, private)
        finally:
            for fd in fds.values():
                os.close(fd)
            for f in (out, err, res):
                f.close()
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _wait(proc: subprocess.Popen, nonce: str, limits: Limits, kind: str, started: float,
          private: Path) -> Result:
    try:
        proc.stdin.write(f"{nonce}\n".encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died before reading: the missing `ready` below says so
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired as e:
            raise SandboxError(f"sandbox process {proc.pid} survived SIGKILL to its group "
                               f"for 5 s") from e
    seconds = time.monotonic() - started
    if kind == "rlimit":
        # children left in the group (not the ones that called setsid: see the docstring)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stdout, stderr = (_read(private / n, limits.output_bytes) for n in (".stdout", ".stderr"))
    reports = []
    for line in (private / ".result").read_bytes()[:1 << 20].decode("utf-8", "replace").splitlines():
        head, _, body = line.partition(" ")
        if head == nonce:
            try:
                reports.append(json.loads(body))
            except json.JSONDecodeError:
                continue
    code = None if timed_out else proc.returncode

    def result(outcome: str, reason: str) -> Result:
        return Result(outcome, code, stdout, stderr, reason, round(seconds, 3), kind)

    if not any(r.get("ready") for r in reports):
        if timed_out:
            raise SandboxError(f"the sandbox did not start within {limits.wall_seconds} s "
                               f"(machine overloaded?): {stderr[-500:]}")
        raise SandboxError(f"the sandbox did not start ({kind}, exit {code}): "
                           f"{stderr.strip()[-1000:] or 'no output'}")
    final = next((r for r in reports if r.get("done")), None)
    if timed_out:
        return result("timeout", f"wall-clock limit of {limits.wall_seconds} s: killed with its "
                                 f"children")
    number = -code if code is not None and code < 0 else None
    if kind == "bwrap" and code is not None and code > 128 and final is None:
        number = code - 128  # bwrap's pid 1 passes a signal death on as 128 + its number
    if number is not None and number in signal.valid_signals():
        sig = signal.Signals(number)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and seconds >= limits.cpu_seconds):
            return result("timeout", f"CPU limit of {limits.cpu_seconds} s ({sig.name})")
        if sig == signal.SIGXFSZ:
            return result("killed", f"file size limit of {limits.file_mb} MB ({sig.name})")
        return result("killed", f"ended by {sig.name}")
    if final is None:
        return result("crashed", f"exited with {code} before the tests reported "
                                 f"(sys.exit or os._exit in the code?)")
    if final.get("memory"):
        return result("memory", f"memory limit of {limits.memory_mb} MB: "
                                f"{final.get('reason') or 'MemoryError'}")
    if final.get("ok") and code == 0:
        return result("passed", f"{final['tests']} tests passed" if "tests" in final else "exit 0")
    return result("failed", final.get("reason") or f"exit {code}")


def main(argv: list[str] | None = None) -> None:
    """Say which isolation this machine gives and probe it (the command line)."""
    parser = argparse.ArgumentParser(description="Say which sandbox isolation this machine gives "
                                                 "(bwrap or the rlimit fallback) and probe it.")
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "rlimit"],
                        help="auto (default): bwrap if it works here, else the rlimit fallback")
    args = parser.parse_args(argv)
    problem = bwrap_problem()
    print(f"bubblewrap: {'works' if problem is None else problem}; network namespace for the "
          f"fallback: {'yes' if net_namespace_works() else 'no'}")
    kind = choose_isolation(args.isolation)
    result = run_tests("def add(a, b):\n    return a + b\n",
                       "import unittest\nfrom solution import add\n\n"
                       "class T(unittest.TestCase):\n    def test(self):\n"
                       "        self.assertEqual(add(2, 3), 5)\n", isolation=kind)
    print(f"isolation: {kind}; interpreter: {interpreter()}; probe: {result.outcome} "
          f"({result.reason}, {result.seconds} s)")


if __name__ == "__main__":
    main()
