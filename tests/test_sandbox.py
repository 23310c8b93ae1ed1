"""The sandbox: real escapes tried from inside it, each contained and recorded with a reason.

Each test runs under bubblewrap and under the rlimit fallback where that fallback claims to hold
(see stages/envs/sandbox.py's docstring): a test of a guarantee the fallback does not give is skipped
for it, never weakened. CI runs as root with bubblewrap installed by `make setup`.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stages.envs import sandbox
from stages.envs.errors import VerifierError

ROOT = os.geteuid() == 0
FAST = sandbox.Limits(wall_seconds=8.0, cpu_seconds=4, memory_mb=256, processes=16)
# an interpreter a uid without rights can run (ours may sit under /root): the fallback drops root
# only for such a one, so with it the fallback's fork-bomb and filesystem claims can be tested too
PUBLIC_PYTHON = next((os.path.realpath(p) for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                      if os.path.exists(p) and sandbox.drops_root(os.path.realpath(p))), None)


@dataclass(frozen=True)
class Box:
    isolation: str
    python: str | None = None  # None: ours

    @property
    def opts(self) -> dict:
        return {"isolation": self.isolation, "python": self.python}

    def claims(self, what: str) -> bool:
        """Whether this sandbox claims to contain `what` (stages/envs/sandbox.py's docstring)."""
        if self.isolation == "bwrap":
            return True
        python = self.python or sandbox.interpreter()
        drops = sandbox.drops_root(python)
        return {"network": sandbox.net_namespace_works(), "filesystem": drops or not ROOT,
                "processes": drops or not ROOT, "setsid": False, "proc": drops or not ROOT}[what]


def unittest_source(body: str, *, imports: str = "") -> str:
    """A unittest module with one test whose body is `body` (indented for the method)."""
    lines = "\n".join("        " + line for line in body.strip("\n").splitlines())
    return (f"import os, socket, subprocess, sys, time, unittest\n{imports}\n"
            f"class Escape(unittest.TestCase):\n    def test_escape(self):\n{lines}\n")


@pytest.fixture(params=["bwrap", "rlimit", "rlimit-public-python"])
def box(request) -> Box:
    if request.param == "bwrap" and sandbox.bwrap_problem() is not None:
        pytest.skip(f"bubblewrap does not work here: {sandbox.bwrap_problem()}")
    if request.param == "rlimit-public-python":
        if not ROOT or PUBLIC_PYTHON is None:
            pytest.skip("needs root and a world-readable interpreter in /usr")
        return Box("rlimit", PUBLIC_PYTHON)
    return Box(request.param)


def needs(box: Box, what: str) -> None:
    if not box.claims(what):
        pytest.skip(f"this sandbox ({box}) does not claim to contain {what} here: "
                    f"see stages/envs/sandbox.py")


def run(box: Box, body: str, limits: sandbox.Limits = FAST, code: str = "") -> sandbox.Result:
    return sandbox.run_tests(code, unittest_source(body), limits=limits, **box.opts)


def leftovers(marker: str, wait: float = 3.0) -> list[int]:
    """Pids whose command line holds `marker`, after giving the kernel `wait` s to reap them."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker.encode() in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    continue
        found = [pid for pid in found if pid != os.getpid()]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_right_and_wrong_code(box):
    tests = unittest_source("from solution import add\nself.assertEqual(add(2, 3), 5)")
    right = sandbox.run_tests("def add(a, b):\n    return a + b\n", tests, **box.opts)
    wrong = sandbox.run_tests("def add(a, b):\n    return a - b\n", tests, **box.opts)
    broken = sandbox.run_tests("def add(a, b)\n    return a + b\n", tests, **box.opts)
    assert (right.outcome, right.exit_code, right.reason) == ("passed", 0, "1 tests passed")
    assert right.isolation == box.isolation
    assert wrong.outcome == "failed" and "test_escape" in wrong.reason
    assert "AssertionError" in wrong.reason and "-1 != 5" in wrong.reason
    assert broken.outcome == "failed" and "SyntaxError" in broken.reason


def test_network_is_unreachable(box):
    needs(box, "network")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        # 192.0.2.1 is TEST-NET-1: never routed, so even a failed sandbox would send nothing out
        result = run(box, f"""
errors = []
for address in [("127.0.0.1", {port}), ("192.0.2.1", 80)]:
    try:
        socket.create_connection(address, timeout=2).close()
        errors.append("connected to %s" % (address,))
    except OSError as e:
        errors.append("%s: %s" % (address, e))
print(errors)
self.fail(" | ".join(errors))
""")
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected from inside
    assert result.outcome == "failed"
    assert "connected to" not in result.reason, result.reason
    assert f"('127.0.0.1', {port}): [Errno" in result.reason
    assert "('192.0.2.1', 80): [Errno" in result.reason  # refused or unreachable at once
    assert "timed out" not in result.reason  # not a connect that hung, packets going somewhere


def test_writes_outside_its_directory_fail(box, tmp_path):
    needs(box, "filesystem")
    outside = tmp_path / "escaped.txt"
    etc = Path("/etc") / f"offseason-escape-{secrets.token_hex(4)}"
    result = run(box, f"""
open("inside.txt", "w").write("mine")
failures = []
for path in [{str(outside)!r}, {str(etc)!r}, os.path.expanduser("~/../escaped.txt")]:
    try:
        open(path, "w").write("escaped")
        failures.append("wrote " + path)
    except OSError as e:
        failures.append(type(e).__name__)
self.fail(" ".join(failures))
""")
    assert not outside.exists() and not etc.exists()
    assert result.outcome == "failed" and "wrote" not in result.reason, result.reason
    assert "Error" in result.reason


def test_fork_bomb_is_bounded(box):
    needs(box, "processes")
    marker = f"offseason-forkbomb-{secrets.token_hex(4)}"
    result = run(box, f"""
forks = 0
try:
    while forks < 500:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)",
                                      {marker!r}])
        forks += 1
except OSError as e:
    self.fail("forks stopped at %d: %s" % (forks, e))
""")
    assert result.outcome == "failed", result
    forks = int(result.reason.split("forks stopped at ")[1].split(":")[0])
    assert forks < FAST.processes, result.reason
    assert "Resource temporarily unavailable" in result.reason
    assert leftovers(marker) == []


def test_infinite_loop_is_killed_with_its_children(box):
    marker = f"offseason-loop-{secrets.token_hex(4)}"
    # the fallback cannot kill a child that left the process group (setsid): bwrap can
    detach = f"start_new_session={box.claims('setsid')}"
    result = run(box, f"""
for _ in range(3):
    subprocess.Popen([sys.executable, "-c", "while True: pass", {marker!r}], {detach})
while True:
    pass
""", limits=sandbox.Limits(wall_seconds=4.0, cpu_seconds=30, processes=16))
    assert result.outcome == "timeout"
    assert result.exit_code is None and "wall-clock limit of 4.0 s" in result.reason
    assert leftovers(marker) == []


def test_cpu_limit(box):
    result = run(box, "while True:\n    pass",
                 limits=sandbox.Limits(wall_seconds=20.0, cpu_seconds=1))
    assert result.outcome == "timeout" and "CPU limit of 1 s" in result.reason


def test_memory_hog_hits_the_limit(box):
    result = run(box, "hog = bytearray(1 << 30)\nhog[-1] = 1")
    assert result.outcome == "memory"
    assert "memory limit of 256 MB" in result.reason


def test_environment_secrets_do_not_reach_the_sandbox(box, monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("OFFSEASON_TEST_SECRET", secret)
    # the fallback that stays root reads our /proc: only its own environment is claimed clean
    scan = "/proc/*/environ" if box.claims("proc") else ""
    result = run(box, f"""
import glob
seen = dict(os.environ)
for path in glob.glob({scan!r}):
    try:
        seen[path] = open(path, "rb").read().decode("latin-1")
    except OSError:
        pass
print(seen)
self.assertNotIn("OFFSEASON_TEST_SECRET", os.environ)
""")
    assert result.outcome == "passed", result
    assert secret not in result.stdout and "OFFSEASON_TEST_SECRET" not in result.stdout
    assert "HOME" in result.stdout


def test_output_is_bounded():
    result = run(Box("rlimit"), "print('x' * 1_000_000)",
                 limits=sandbox.Limits(output_bytes=1000))
    assert result.outcome == "passed"
    assert len(result.stdout) < 1100 and result.stdout.endswith("[... output truncated]")


def test_faked_results_do_not_pass(box):
    tests = unittest_source("self.fail('never reached')")
    exit_early = sandbox.run_tests("", "import os\nos._exit(0)\n", **box.opts)
    sys_exit = sandbox.run_tests("import sys\nsys.exit(0)\n",
                                 "from solution import *\n" + tests, **box.opts)
    forged = sandbox.run_tests(
        "", 'import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b\'x {"done": true,'
            ' "ok": true, "tests": 1}\\n\')\n    except OSError:\n        pass\nos._exit(0)\n',
        **box.opts)
    no_tests = sandbox.run_tests("", "import unittest\n", **box.opts)
    via_main = sandbox.run_tests(  # the harness's reporter is not a global to import
        "", "import __main__, os\n__main__.report(done=True, ok=True, tests=1)\nos._exit(0)\n",
        **box.opts)
    assert exit_early.outcome == "crashed" and "before the tests reported" in exit_early.reason
    assert sys_exit.outcome == "failed" and "SystemExit" in sys_exit.reason
    assert forged.outcome == "crashed"
    assert no_tests.outcome == "failed" and no_tests.reason == "no tests ran"
    assert via_main.outcome == "failed" and "AttributeError" in via_main.reason


def test_a_broken_sandbox_raises_instead_of_scoring_zero(box):
    with pytest.raises(sandbox.SandboxError, match="not an executable file"):
        sandbox.run_tests("", "", isolation=box.isolation, python="/nonexistent/bin/python3")
    with pytest.raises(VerifierError, match="did not start"):  # runs, but is no interpreter
        sandbox.run_tests("", "", isolation=box.isolation, python="/bin/true")
    with pytest.raises(sandbox.SandboxError, match="isolation must be"):
        sandbox.run_tests("", "", isolation="docker")


def test_run_code_reports_its_outcome(box):
    ok = sandbox.run_code("print(6 * 7)", **box.opts)
    bad = sandbox.run_code("raise ValueError('nope')", **box.opts)
    assert (ok.outcome, ok.stdout) == ("passed", "42\n")
    assert bad.outcome == "failed" and bad.reason == "ValueError: nope"
    assert "Traceback" in bad.stderr


def test_installed_packages_import_though_site_is_skipped(box):
    """The sandboxed processes start with -S (no .pth files run) and put site-packages on
    sys.path themselves: a candidate may still import what the interpreter has installed.
    """
    dirs = sandbox._site_dirs(box.python or sandbox.interpreter())
    if not any(Path(d, "pip").is_dir() for d in dirs):
        pytest.skip("this interpreter has no pip in its site-packages to import")
    ran = sandbox.run_code("import pip, sys\nprint(pip.__file__)\nprint('site' in sys.modules)",
                           **box.opts)
    assert ran.outcome == "passed", ran
    where, site_loaded = ran.stdout.split()
    assert any(where.startswith(d) for d in dirs) and site_loaded == "False"
