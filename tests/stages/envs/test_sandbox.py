"""The sandbox: real escapes tried from inside it, each contained and recorded with a reason.

Each test runs in every isolation mode this host can give (tests/sandboxes.py: bubblewrap and the
unshare sandbox, offseason as root and as a user) and under "rlimit" (no isolation) where that
mode claims to hold (see stages/envs/sandbox.py's docstring): a test of a guarantee a mode does
not give is skipped for it, never weakened. CI runs as root with bubblewrap installed by `make
setup`; the unshare and user modes run there too.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.envs import sandbox
from stages.envs.errors import VerifierError
from tests.sandboxes import MODES, Box, box_of

REPO = Path(__file__).resolve().parents[3]
FAST = sandbox.Limits(wall_seconds=8.0, cpu_seconds=4, memory_mb=256, processes=16)


def unittest_source(body: str, *, imports: str = "") -> str:
    """A unittest module with one test whose body is `body` (indented for the method)."""
    lines = "\n".join("        " + line for line in body.strip("\n").splitlines())
    return (f"import os, signal, socket, subprocess, sys, time, unittest\n{imports}\n"
            f"class Escape(unittest.TestCase):\n    def test_escape(self):\n{lines}\n")


@pytest.fixture(params=MODES)
def box(request) -> Box:
    return box_of(request.param)


def needs(box: Box, what: str) -> None:
    if not box.claims(what):
        pytest.skip(f"this sandbox ({box}) does not claim to contain {what} here: "
                    f"see stages/envs/sandbox.py")


def run(box: Box, body: str, limits: sandbox.Limits = FAST, code: str = "") -> sandbox.Result:
    return box.run_tests(code, unittest_source(body), limits=limits)


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
    right = box.run_tests("def add(a, b):\n    return a + b\n", tests)
    wrong = box.run_tests("def add(a, b):\n    return a - b\n", tests)
    broken = box.run_tests("def add(a, b)\n    return a + b\n", tests)
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
    exit_early = box.run_tests("", "import os\nos._exit(0)\n")
    sys_exit = box.run_tests("import sys\nsys.exit(0)\n",
                                 "from solution import *\n" + tests)
    forged = box.run_tests(
        "", 'import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b\'x {"done": true,'
            ' "ok": true, "tests": 1}\\n\')\n    except OSError:\n        pass\nos._exit(0)\n')
    no_tests = box.run_tests("", "import unittest\n")
    via_main = box.run_tests(  # the harness's reporter is not a global to import
        "", "import __main__, os\n__main__.report(done=True, ok=True, tests=1)\nos._exit(0)\n")
    assert exit_early.outcome == "crashed" and "before the tests reported" in exit_early.reason
    assert sys_exit.outcome == "failed" and "SystemExit" in sys_exit.reason
    assert forged.outcome == "crashed"
    assert no_tests.outcome == "failed" and no_tests.reason == "no tests ran"
    assert via_main.outcome == "failed" and "AttributeError" in via_main.reason


def test_a_broken_sandbox_raises_instead_of_scoring_zero(box):
    with pytest.raises(sandbox.SandboxError, match="not an executable file"):
        box.run_tests("", "", python="/nonexistent/bin/python3")
    with pytest.raises(VerifierError, match="did not start"):  # runs, but is no interpreter
        box.run_tests("", "", python="/bin/true")
    with pytest.raises(sandbox.SandboxError, match="isolation must be"):
        sandbox.run_tests("", "", isolation="docker")


def test_run_code_reports_its_outcome(box):
    ok = box.run_code("print(6 * 7)")
    bad = box.run_code("raise ValueError('nope')")
    assert (ok.outcome, ok.stdout) == ("passed", "42\n")
    assert bad.outcome == "failed" and bad.reason == "ValueError: nope"
    assert "Traceback" in bad.stderr


def test_installed_packages_import_though_site_is_skipped(box):
    """The sandboxed processes start with -S (no .pth files run) and put site-packages on
    sys.path themselves: a candidate may still import what the interpreter has installed.
    """
    dirs = sandbox._site_dirs(box.interpreter)
    if not any(Path(d, "pip").is_dir() for d in dirs):
        pytest.skip("this interpreter has no pip in its site-packages to import")
    ran = box.run_code("import pip, sys\nprint(pip.__file__)\nprint('site' in sys.modules)")
    assert ran.outcome == "passed", ran
    where, site_loaded = ran.stdout.split()
    assert any(where.startswith(d) for d in dirs) and site_loaded == "False"


def test_code_runs_unprivileged_and_sees_no_process_outside_its_sandbox(box):
    """The hole of the old fallback: as root, model-written code ran as uid 0 and saw (and could
    signal) every process on the machine. A sentinel process of ours, outside: the code must not
    find it in /proc, and a signal sent to its pid on the machine must not reach it.
    """
    needs(box, "pids")
    marker = f"offseason-sentinel-{secrets.token_hex(4)}"
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        result = run(box, f"""
pids = [p for p in os.listdir("/proc") if p.isdigit()]
seen = []
for pid in pids:
    try:
        if {marker!r}.encode() in open("/proc/%s/cmdline" % pid, "rb").read():
            seen.append(pid)
    except OSError:
        pass
try:
    os.kill({sentinel.pid}, signal.SIGTERM)  # its pid on the machine: here nobody, or one of ours
    sent = "sent"
except OSError as e:
    sent = type(e).__name__
print("uid", os.getuid(), os.geteuid(), os.getgid(), "pids", len(pids), "seen", seen, sent)
self.assertEqual(seen, [])
self.assertNotEqual(os.geteuid(), 0)
self.assertNotEqual(os.getuid(), 0)
self.assertNotEqual(os.getgid(), 0)
self.assertLess(len(pids), 8)  # the sandbox's own few: its pid 1, the harness
""")
        assert result.outcome == "passed", result
        time.sleep(0.2)
        assert sentinel.poll() is None, "the code reached a process outside its sandbox"
    finally:
        sentinel.kill()
        sentinel.wait()


def test_the_unprivileged_uid_is_one_this_namespace_maps():
    """As root in a container that maps fewer ids (rootless: 65,536 subuids), the uid the code
    gets must be mapped, or every run would fail to start; with only root mapped, none is given.
    """
    ranges = sandbox._free_ids()
    if os.geteuid() == 0:
        assert ranges and all(0 < start < end for start, end in ranges)
        uid = sandbox._drop_uid()
        assert any(start <= uid < end for start, end in ranges)


# Run in a user namespace that maps only root (to us) and may make no further one: a container in
# which neither bubblewrap nor the unshare sandbox can make an unprivileged uid. Prints what the
# sandbox and the environment contract decided, without and with runtime.sandbox.allow_unisolated.
NO_ISOLATION = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from stages.envs import contract, sandbox
out = {"euid": os.geteuid(), "free_ids": list(sandbox._free_ids())}
try:
    sandbox.run_code("print('ran')")
    out["auto"] = "ran"
except sandbox.SandboxError as e:
    out["auto"] = str(e)
try:
    contract.load("code", "stages.envs.coding", sys.argv[1])
    out["load"] = "loaded"
except contract.ContractError as e:
    out["load"] = str(e)
out["runs_no_code"] = contract.load("arith", "stages.envs.arith", sys.argv[1]).name
sandbox.allow_unisolated(True)
result = sandbox.run_code("import os; print('ran as', os.geteuid())")
out["allowed"] = [result.isolation, result.stdout.strip()]
out["loaded_when_allowed"] = contract.load("code", "stages.envs.coding", sys.argv[1]).name
print(json.dumps(out))
"""


def test_with_no_isolation_code_is_refused_unless_allowed():
    """Where no sandbox can be made, code is refused before it runs (`auto`), and an environment
    that runs code is refused when a stage loads it, naming the setting (an environment that runs
    none loads); with runtime.sandbox.allow_unisolated it runs with rlimits only, and says so.
    """
    made = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--", "sh", "-c",
         'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh",
         sys.executable, "-c", NO_ISOLATION, str(REPO)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    if made.returncode != 0 and "Traceback" not in made.stderr:
        pytest.skip(f"this host cannot make such a container: {made.stderr[-300:]}")
    assert made.returncode == 0, made.stderr[-2000:]
    out = json.loads(made.stdout)
    assert out["euid"] == 0 and out["free_ids"] == []
    assert "no sandbox works on this machine" in out["auto"]
    assert "runtime.sandbox.allow_unisolated: true" in out["auto"]
    assert "environment 'code'" in out["load"] and "runtime.sandbox.allow_unisolated" in out["load"]
    assert out["runs_no_code"] == "arith"
    assert out["allowed"] == ["rlimit", "ran as 0"]
    assert out["loaded_when_allowed"] == "code"
    assert "NO ISOLATION" in made.stderr  # said in the log of the stage that runs it
