"""The sandbox's isolation modes as the tests run them: each `Box` runs `run_tests` / `run_code`
as offseason would in that mode, so an escape or a reward hack is tried in every mode this host
can give (stages/envs/sandbox.py's docstring; RELIABILITY.md states each mode's guarantee).

    bwrap          bubblewrap, offseason running as root (as in CI)
    unshare        the unshare sandbox (no bubblewrap), offseason running as root
    unshare-user   the unshare sandbox, offseason running as an unprivileged user
    bwrap-user     bubblewrap, offseason running as an unprivileged user
    rlimit         no isolation (runtime.sandbox.allow_unisolated), with our interpreter
    rlimit-public-python   the same with a world-readable interpreter (it drops root)

"As a user" is real: the sandbox's module runs in a process of its own under a fresh
unprivileged uid (`setpriv`, no capabilities), with a world-readable interpreter and a
world-readable copy of the modules it imports; the candidate's code runs under that
interpreter. A mode this host cannot give is skipped, saying why.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from stages.envs import sandbox

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0
# an interpreter a uid without rights can run (ours may sit under /root)
PUBLIC_PYTHON = next((os.path.realpath(p) for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                      if os.path.exists(p) and sandbox.drops_root(os.path.realpath(p))), None)
MODES = ["bwrap", "unshare", "unshare-user", "bwrap-user", "rlimit", "rlimit-public-python"]
ISOLATED = ["bwrap", "unshare", "unshare-user", "bwrap-user"]  # the modes `auto` may pick

# Runs in the unprivileged process: one call of the sandbox, its Result (or error) as JSON.
DRIVER = r"""
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from stages.envs import sandbox
call = json.loads(sys.stdin.read())
try:
    result = getattr(sandbox, call["function"])(*call["args"], limits=sandbox.Limits(**call["limits"]),
                                                isolation=call["isolation"], python=call["python"])
    print(json.dumps({"result": dataclasses.asdict(result)}))
except sandbox.SandboxError as e:
    print(json.dumps({"error": str(e)}))
"""


@functools.cache
def public_modules() -> str:
    """A world-readable folder holding `stages.envs.sandbox` and `contract` and what they import
    (the standard library only, beside them).
    """
    folder = Path(tempfile.mkdtemp(prefix="offseason-sandbox-modules-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for module in ("stages/__init__.py", "stages/envs/__init__.py", "stages/envs/errors.py",
                   "stages/envs/sandbox.py", "stages/envs/contract.py"):
        (folder / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / module, folder / module)
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(folder)


@dataclass(frozen=True)
class Box:
    isolation: str
    python: str | None = None  # None: ours (or, as a user, PUBLIC_PYTHON)
    user: bool = False  # offseason itself runs as an unprivileged uid

    def __str__(self) -> str:
        return self.isolation + ("-user" if self.user else "") + \
            ("" if self.python is None else f"({self.python})")

    def run_tests(self, code: str, tests: str, limits: sandbox.Limits = sandbox.Limits(),
                  python: str | None = None) -> sandbox.Result:
        return self._call("run_tests", [code, tests], limits, python)

    def run_code(self, code: str, limits: sandbox.Limits = sandbox.Limits(),
                 python: str | None = None) -> sandbox.Result:
        return self._call("run_code", [code], limits, python)

    def _call(self, function: str, args: list, limits: sandbox.Limits, python: str | None):
        python = python or self.python
        if not self.user:
            return getattr(sandbox, function)(*args, limits=limits, isolation=self.isolation,
                                              python=python)
        uid = (1 << 19) + secrets.randbelow(1 << 18)
        call = {"function": function, "args": args, "limits": dataclasses.asdict(limits),
                "isolation": self.isolation, "python": python or PUBLIC_PYTHON}
        out = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
             "--inh-caps=-all", "--bounding-set=-all", PUBLIC_PYTHON, "-I", "-c", DRIVER,
             public_modules()],
            input=json.dumps(call), capture_output=True, text=True, timeout=120, cwd="/")
        if out.returncode != 0:
            raise AssertionError(f"the unprivileged driver failed ({out.returncode}): "
                                 f"{out.stderr[-2000:]}")
        answer = json.loads(out.stdout)
        if "error" in answer:
            raise sandbox.SandboxError(answer["error"])
        return sandbox.Result(**answer["result"])

    @property
    def interpreter(self) -> str:
        """The interpreter the sandboxed code runs under."""
        return self.python or (PUBLIC_PYTHON if self.user else sandbox.interpreter())

    def claims(self, what: str) -> bool:
        """Whether this sandbox claims to contain `what` (stages/envs/sandbox.py's docstring)."""
        if self.isolation != "rlimit":
            return True
        drops = sandbox.drops_root(self.interpreter)
        return {"network": sandbox.net_namespace_works(), "filesystem": drops or not ROOT,
                "processes": drops or not ROOT, "setsid": False, "proc": drops or not ROOT,
                "pids": False}[what]


@functools.cache
def _user_problem(isolation: str) -> str | None:
    """None if offseason can run `isolation` as an unprivileged user here, else why not."""
    if not ROOT:
        return "needs root to start a process as a fresh unprivileged uid"
    if PUBLIC_PYTHON is None:
        return "needs a world-readable interpreter (/usr/bin/python3) for the unprivileged process"
    try:
        result = Box(isolation, user=True).run_code("print('ok')")
    except (sandbox.SandboxError, AssertionError) as e:
        return str(e)[-500:]
    return None if result.stdout.strip() == "ok" else result.reason


def box_of(mode: str) -> Box:
    """The Box of `mode` (MODES), or skip: this host cannot give that mode."""
    if mode == "rlimit":
        return Box("rlimit")
    if mode == "rlimit-public-python":
        if not ROOT or PUBLIC_PYTHON is None:
            pytest.skip("needs root and a world-readable interpreter in /usr")
        return Box("rlimit", PUBLIC_PYTHON)
    isolation, _, user = mode.partition("-")
    problem = {"bwrap": sandbox.bwrap_problem, "unshare": sandbox.unshare_problem}[isolation]()
    if user:
        problem = problem or _user_problem(isolation)
    if problem is not None:
        pytest.skip(f"this host cannot give the {mode} sandbox: {problem}")
    return Box(isolation, user=bool(user))
