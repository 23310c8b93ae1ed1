"""The project folder as a workspace: its root, git, DVC, the cycle lock and the embedded defaults.

Everything local lives inside the repo and is git-ignored: MLflow at `sqlite:///<repo>/mlflow.db`
with artifacts in `<repo>/mlartifacts`, Prefect's local database in `<repo>/.prefect`, the DVC
remote in `<repo>/.dvcstore`. Each is one environment variable away from a real server
(`MLFLOW_TRACKING_URI`, `PREFECT_API_URL`, `dvc remote modify`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

# Privacy by default: a pipeline that reads production traces sends nothing anywhere unasked.
TELEMETRY_OFF = {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "GX_ANALYTICS_ENABLED": "False",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class WorkspaceError(RuntimeError):
    """Something about the project folder is wrong; the message says what to do."""


def find_root(start: str | Path = ".") -> Path:
    """The project folder holding `start`: the nearest with dvc.yaml and params.yaml."""
    here = Path(start).resolve()
    for folder in (here, *here.parents):
        if (folder / "dvc.yaml").exists() and (folder / "params.yaml").exists():
            return folder
    raise WorkspaceError(f"{here} is not inside an offseason project (no dvc.yaml and params.yaml "
                         f"here or above); cd into the project folder")


USER_PATH = "OFFSEASON_USER_PATH"  # PATH as it was before configure_env put the venv first


# where `offseason ui` serves the embedded mode's Prefect runs (flows/audit/ui.py)
PREFECT_UI = "http://127.0.0.1:4200"


def configure_env(root: Path) -> None:
    """Telemetry off and the embedded defaults, unless the user set them already."""
    for key, value in TELEMETRY_OFF.items():
        os.environ.setdefault(key, value)
    if not os.environ.get("PREFECT_API_URL"):
        # embedded: each run's temporary server is gone when it ends, and Prefect's "View at
        # http://127.0.0.1:<its port>/..." lines pointed at it (issue 53.8); `offseason ui`
        # serves the same runs here
        os.environ.setdefault("PREFECT_UI_URL", PREFECT_UI)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    if os.environ["MLFLOW_TRACKING_URI"].startswith(("http://", "https://")):
        from stages import config as cfg

        os.environ.update(mlflow_requests(cfg.mlflow(root / "params.yaml").stall_seconds,
                                          os.environ))
    os.environ.setdefault("PREFECT_HOME", str(root / ".prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    # the temporary local server migrates its database on first start: slow on 2 busy cores
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # DVC runs `python -m stages...`: make that the interpreter offseason itself runs in
    bin_dir = str(Path(sys.executable).parent)
    # the PATH of the user's shell, to tell them commands as they can type them (cli.as_typed)
    os.environ.setdefault(USER_PATH, os.environ.get("PATH", ""))
    if not os.environ.get("PATH", "").startswith(bin_dir + os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


# MLflow's HTTP settings (mlflow/environment_variables.py; read at each request,
# mlflow/utils/rest_utils.py `http_request`) and MLflow's defaults: 120 s a try, 7 retries,
# backoff factor 2 and 1 s of jitter: about 4 minutes of backoff, and a black hole some 20 minutes
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_TIMEOUT": 120, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 7,
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 2, "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": 1.0}


def mlflow_requests(stall: float, env) -> dict[str, str]:
    """MLflow's HTTP settings fitted inside `runtime.mlflow.stall_seconds`, so that a server that
    accepts and never answers fails a request within it, all of MLflow's tries included: at most
    4 tries, the backoff between them as much as a quarter of the bound holds (a server that
    restarts, refusing connections meanwhile, is waited for that long: at 300 s, 74 s), each try
    waiting an equal share of the rest (whole seconds, at least 1: fewer tries where that would
    not fit). A value `env` sets already is kept where it is lower.
    """
    timeout, retries, factor, jitter = (type(default)(env.get(key, default))
                                        for key, default in MLFLOW_HTTP.items())
    retries, jitter = min(retries, 3), min(jitter, stall / 16)

    def backoff(tries_after: int, factor: int) -> float:  # urllib3's: the first retry at once
        return sum(factor * 2 ** (n - 1) + jitter for n in range(2, tries_after + 1))

    while factor > 0 and backoff(retries, factor) > stall / 4:
        factor -= 1
    # MLflow's own factor (2) would give up on a restarting server within 14 s: raised as far
    # as the quarter holds, unless the user set one
    while "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR" not in env and \
            backoff(retries, factor + 1) <= stall / 4:
        factor += 1
    while True:
        share = max(1, int((stall - backoff(retries, factor)) // (retries + 1)))
        if retries == 0 or (retries + 1) * min(timeout, share) + backoff(retries, factor) <= stall:
            break
        retries -= 1
    return dict(zip(MLFLOW_HTTP, (str(min(timeout, share)), str(retries), str(factor),
                                  f"{jitter:g}")))


def run(cmd: list[str], root: Path, check: bool = True, on_line: Callable[[str], None] | None = None,
        stall: float | None = None) -> subprocess.CompletedProcess:
    """Run a command in the repo root; stream its output line by line to `on_line` if given.
    `stall`: a DVC command talking to a remote (`dvc`), stopped when it moves no bytes for that
    many seconds (flows/project/stall.py); DvcStalled then says so.
    """
    if on_line is None and stall is None:
        result = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    else:
        from flows.project.stall import Watch

        lines = []
        with subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1) as proc:
            watch = Watch(proc.pid, stall, lambda: kill_below(proc.pid),
                          processes_below) if stall else None
            try:
                with watch or contextlib.nullcontext():
                    for line in proc.stdout:
                        line = line.rstrip("\n")
                        lines.append(line)
                        if on_line is not None:
                            on_line(line)
            except BaseException:  # Ctrl-C, or on_line failed: DVC does not go on alone
                kill_below(proc.pid)
                raise
        if watch is not None and watch.stalled is not None:
            raise DvcStalled(dvc_stalled(root, cmd[1:], watch, lines))
        result = subprocess.CompletedProcess(cmd, proc.returncode, "\n".join(lines), "")
    if check and result.returncode != 0:
        output = (result.stdout + result.stderr).strip().splitlines()[-15:]
        raise WorkspaceError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n"
                             + "\n".join(output) + quiet_hint(cmd, output))
    return result


def quiet_hint(cmd: list[str], output: list[str]) -> str:
    """For a failed command that said nothing because of `--quiet` (DVC's hides its errors too):
    how to see why.
    """
    if any(line.strip() for line in output) or "--quiet" not in cmd or Path(cmd[0]).name != "dvc":
        return ""
    loud = " ".join(arg for arg in cmd if arg != "--quiet")
    return f"(nothing said: --quiet hides the reason; run `{loud}` in the project to see it)"


def git(root: Path, *args: str, check: bool = True) -> str:
    """Run git in the project; returns its output (raises on failure if `check`)."""
    identity = []
    if args and args[0] in ("commit", "tag") and not run(["git", "config", "user.email"], root,
                                                          check=False).stdout.strip():
        identity = ["-c", "user.name=offseason", "-c", "user.email=offseason@localhost"]
    return run(["git", *identity, *args], root, check=check).stdout.strip()


SESSIONS: dict[Path, object] = {}  # repo root -> its open flows.orchestration.pipeline.Session (a cycle's)


# DVC's commands that move objects to or from a remote: each runs under a stall watch
NETWORK = ("push", "pull", "fetch")


class DvcStalled(WorkspaceError):
    """A DVC command moved no bytes for `runtime.dvc.stall_seconds`: it was stopped."""


def dvc(root: Path, *args: str, on_line=None) -> str:
    """`dvc ARGS` in the repo root: in the cycle's DVC session while one is open (flows/orchestration/pipeline.py),
    else as a process of its own. A push, pull or fetch that moves no bytes for
    `runtime.dvc.stall_seconds` is stopped and raises DvcStalled naming the remote.
    """
    stall = None
    if args and args[0] in NETWORK:
        from stages import config as cfg

        stall = cfg.dvc(root / "params.yaml").stall_seconds
    session = SESSIONS.get(root)
    if session is not None:
        return session.run(list(args), on_line=on_line, stall=stall)[1]
    return run([str(Path(sys.executable).parent / "dvc"), *args], root, on_line=on_line,
               stall=stall).stdout


def kill_below(pid: int) -> None:
    """SIGKILL a process and every process below it, deepest first (a stalled DVC command: one
    blocked on a socket may not heed SIGTERM).
    """
    signal_all(processes_below(pid), signal.SIGKILL)


def dvc_stalled(root: Path, args: list[str], watch, lines: list[str]) -> str:
    """What DvcStalled says: the command, the remote it talked to (`-r NAME`, else the default)
    and its URL, the bound, what it had moved and said, what was kept, what to do.
    """
    default, remotes = dvc_remotes(root)
    name = next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("-r", "--remote")),
                default)
    url = remotes.get(name or "", {}).get("url", "?")
    said = [line.strip() for line in lines if line.strip()]
    kept = ("what it had sent stays in the remote, and the next push sends only what the remote "
            "lacks" if args[0] == "push" else "what it had fetched stays in the cache "
            "(.dvc/cache), and the next try fetches only what the cache lacks")
    return (f"`dvc {' '.join(args)}` moved no bytes for {watch.stalled:.1f} s "
            f"(runtime.dvc.stall_seconds={watch.seconds:g}) talking to the DVC remote {name!r} "
            f"({url}), after {watch.sent} bytes to and from the network: the remote is up but "
            f"not answering (wedged, or overloaded), so DVC was stopped"
            f"{'; DVC said: ' + ' | '.join(said[-5:]) if said else ''}. Nothing is lost: {kept}. Check "
            f"that server (or raise runtime.dvc.stall_seconds in params.yaml for a remote that is "
            f"slow, not stuck), then run the command again")


def dvc_remotes(root: Path) -> tuple[str | None, dict[str, dict[str, str]]]:
    """The project's DVC remotes as DVC reads them (`.dvc/config`, then `.dvc/config.local`
    over it): the default remote's name (`core.remote`) and each remote's settings (`url`, ...).
    """
    import configparser
    import re

    default, remotes = None, {}
    for name in ("config", "config.local"):
        path = root / ".dvc" / name
        if not path.exists():
            continue
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(path.read_text())
        for section in parser.sections():
            match = re.fullmatch(r"""'?remote\s+"([^"]+)"'?""", section.strip())
            if match:
                remotes.setdefault(match.group(1), {}).update(parser[section])
            elif section.strip() == "core" and parser.has_option(section, "remote"):
                default = parser.get(section, "remote")
    return default, remotes


def generations(root: Path) -> list[int]:
    """The generation numbers tagged so far (`gen-<n>`), in order."""
    tags = git(root, "tag", "--list", "gen-*").split()
    return sorted(int(t[4:]) for t in tags if t[4:].isdigit())


def read_at(root: Path, ref: str, path: str) -> dict | None:
    """A JSON file as committed at `ref`, or None."""
    out = run(["git", "show", f"{ref}:{path}"], root, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


_HELD: dict[Path, tuple[int, dict]] = {}  # lock path -> (fd, what the lock file says)
KILLED: dict[Path, list] = {}  # project -> the runs killed cycles left "running" (cycle_lock)


def _write_lock(fd: int, info: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


@contextmanager
def cycle_lock(root: Path, label: str):
    """One cycle at a time per workspace; a lock left by a killed process is cleared.

    The kernel holds the lock (`flock` on `.offseason/cycle.lock`) for exactly as long as the
    process that took it lives, so a process killed with SIGKILL frees it at once, a reused pid
    cannot keep it taken, and two processes clearing a stale lock at the same moment cannot both
    get it. The file only says who holds it: pid, what, start time and, once the flow started,
    its Prefect flow run and MLflow run (`note_cycle`).
    """
    path = root / ".offseason" / "cycle.lock"
    path.parent.mkdir(exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkspaceError(_held_by(root, path)) from None
        try:  # the holder before us may have removed the file after we opened it
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    left, stale = os.pread(fd, 1 << 16, 0), {}
    if left.strip():
        try:
            stale = json.loads(left)
            print(f"offseason: cleared a stale cycle lock: {stale.get('what')} (pid "
                  f"{stale.get('pid')}, started {stale.get('started')}) is no longer running",
                  file=sys.stderr)
            stop_leftovers(stale)
        except ValueError:
            print(f"offseason: cleared an unreadable stale cycle lock ({path})", file=sys.stderr)
    info = {"pid": os.getpid(), "what": label,
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    # the killed cycle's runs, left "running", for this cycle's flow to end (`KILLED`): kept in
    # this lock too, so a cycle killed before it ended them hands them on
    killed = list(stale.get("killed_runs") or [])
    if stale.get("mlflow_run_id") or stale.get("flow_run"):
        killed.append({key: stale.get(key) for key in ("mlflow_run_id", "flow_run")})
    if killed:
        info["killed_runs"] = KILLED[root.resolve()] = killed
    _write_lock(fd, info)
    _HELD[path] = (fd, info)
    try:
        yield
    finally:
        del _HELD[path]
        path.unlink(missing_ok=True)
        os.close(fd)


def lock_holder(root: Path) -> dict | None:
    """What the cycle lock's holder wrote (pid, what, `awaiting`...), or None when no live
    process holds it: the kernel's lock is tried, never taken for longer than the try.
    """
    path = root / ".offseason" / "cycle.lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: read what its holder says
            try:
                return json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
            except ValueError:  # its holder is writing it this very moment
                return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# what a killed cycle's holder leaves running (its DVC session, with the stage it runs; Prefect's
# temporary server): the lock notes their pids, and what their command lines hold, to tell them
# from a process that got the pid later
LEFTOVERS = {"session_pid": ("session", "the DVC session and its stage"),
             "prefect_server_pid": (None, "Prefect's temporary server")}
PREFECT_SERVER = "prefect.server.api.server"


def processes_below(pid: int) -> list[int]:
    """`pid` and every process below it, deepest first (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the command name in parentheses may hold spaces: the fields follow the last ")"
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    order, todo = [], [pid]
    while todo:
        order.append(todo.pop())
        todo.extend(children.get(order[-1], []))
    return list(reversed(order))


def signal_all(pids: list[int], sig: int) -> None:
    """Send `sig` to each of `pids` that is still there."""
    for each in pids:
        try:
            os.kill(each, sig)
        except ProcessLookupError:
            pass


def _started(pid: int) -> str:
    """When the process started (clock ticks since boot, /proc's field 22): with the pid, which
    process it is (a pid is reused).
    """
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def stop_leftovers(stale: dict, wait: float = 15.0) -> list[str]:
    """Stop what a killed cycle left running (`LEFTOVERS`, as its lock noted them): a DVC session
    that would go on writing the workspace (the next cycle's DVC then found its files "busy"),
    and a Prefect server nothing would ever stop. SIGTERM, then SIGKILL after `wait` seconds.
    Returns what was stopped, in words (also said on stderr).
    """
    stopped = []
    for key, (marker_key, words) in LEFTOVERS.items():
        pid, _, started = str(stale.get(key) or "").partition(":")
        needle = stale.get(marker_key) if marker_key else PREFECT_SERVER
        if not pid.isdigit() or not needle or needle not in _command_line(int(pid)) or \
                (started and started != _started(int(pid))):
            continue
        tree = processes_below(int(pid))
        for sig, seconds in ((signal.SIGTERM, wait), (signal.SIGKILL, 10.0)):
            signal_all(tree, sig)
            signal_all(tree, signal.SIGCONT)  # a stopped process gets its SIGTERM too
            # gone from /proc, zombies too: DVC takes a lock entry of a pid that exists as held
            deadline = time.monotonic() + seconds
            while any(Path(f"/proc/{each}").exists() for each in tree) and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
        stopped.append(f"{words} (pid {pid})")
    if stopped:
        print(f"offseason: stopped what the killed cycle left running: {', '.join(stopped)}",
              file=sys.stderr)
    return stopped


def note_children(root: Path, session_pid: int | None = None, marker: str = "") -> None:
    """Note in the cycle lock the processes a kill of this one would leave running (`LEFTOVERS`):
    the DVC session, and a Prefect temporary server this process started.
    """
    if root / ".offseason" / "cycle.lock" not in _HELD:
        return
    fields = {"session_pid": str(session_pid), "session": marker} if session_pid else {}
    for pid in processes_below(os.getpid()):
        if pid != os.getpid() and PREFECT_SERVER in _command_line(pid):
            fields["prefect_server_pid"] = f"{pid}:{_started(pid)}"
            break
    if fields:
        note_cycle(root, **fields)


def killed_runs_ended(root: Path) -> None:
    """The killed cycles' runs are ended: the lock no longer hands them on."""
    KILLED.pop(root.resolve(), None)
    held = _HELD.get(root / ".offseason" / "cycle.lock")
    if held and held[1].pop("killed_runs", None) is not None:
        _write_lock(held[0], held[1])


def note_cycle(root: Path, **fields: str) -> None:
    """Add to what the cycle lock this process holds says (run ids); no-op without the lock."""
    held = _HELD.get(root / ".offseason" / "cycle.lock")
    if held:
        held[1].update(fields)
        _write_lock(held[0], held[1])


def _held_by(root: Path, path: Path) -> str:
    try:
        held = json.loads(path.read_text())
    except ValueError:  # its holder is writing it this very moment
        held = {}
    runs = "".join(f", {name} {held[key]}" for key, name in (
        ("flow_run", "Prefect flow run"), ("mlflow_run_id", "MLflow run")) if held.get(key))
    running = (f"another cycle is running in {root}: {held.get('what', 'offseason')} (pid "
               f"{held.get('pid', '?')}, started {held.get('started', '?')}{runs})")
    if held.get("awaiting"):  # paused for a person's decision: waiting on it helps nobody
        run = held.get("awaiting_run")
        return (f"{running}; {held['awaiting']} waits for approval: decide first, `offseason "
                f"approve {run} --reason ...` or `offseason reject {run} --reason ...` (or the "
                f"Prefect UI), then run again")
    return f"{running}; wait for it, or stop that process"


ENVIRONMENT_SOURCES = Path("data") / "environments.json"  # a dep of the stages in dvc.yaml
# what the cycles and promotion `dvc add` themselves: never git's, even before their first `.dvc`
# file exists (the inbox holds production traces as they came, personal data and all)
DVC_ADDED = ("data/inbox", "models/champion")
COLLECT_SPOOL = Path(".offseason") / "collect"  # `offseason collect`'s journal and lock
# what a stopped receiver kept in its journal, unfinished (`offseason run` says so)
COLLECT_HELD = COLLECT_SPOOL / "held.json"


def note_environments(root: Path) -> dict:
    """Write `data/environments.json`: each `environments:` module of params.yaml by content.

    DVC tracks the files dvc.yaml lists; a user's environment lives in their own module (or an
    installed package), which no stage's deps can name ahead of time. This note can: per
    environment, the module, its VERSION and the SHA-256 of its source, and for a module inside
    the project the files of its folder too (the data its reward or tools read). dvc.yaml lists
    the note as a dep of the stages that run the modules, so editing a reward reruns them as
    editing a stage does; the file is rewritten only when that content changes. Importing the
    modules here also fails a cycle before any stage when one does not load (ContractError).
    """
    from stages import config as cfg
    from stages.envs import contract

    root = root.resolve()
    note = {}
    for name, spec in sorted(cfg.environments(root / "params.yaml").items()):
        env = contract.load(name, spec.module, root)
        source = Path(env.source).resolve() if env.source else None
        files = module_files(source, root)
        inside = bool(source) and source.is_relative_to(root)
        # where it is, the same on every machine: in the project, or by its dotted name
        shown = (source.relative_to(root).as_posix() if inside else
                 env.module.replace(".", "/") + ("/__init__.py" if source.name == "__init__.py"
                                                 else ".py")) if source else None
        digest = hashlib.sha256()
        for file in files:
            at = file.relative_to(root).as_posix() if inside else shown
            digest.update(at.encode() + b"\0" + file.read_bytes() + b"\0")
        note[name] = {"module": env.module, "version": env.version, "source": shown,
                      "files": len(files), "sha256": digest.hexdigest() if files else None}
    # the judge's rubric, when it is a file of the project: a changed rubric re-scores
    rubric = str(cfg.load("judge", root / "params.yaml").rubric).strip()
    if rubric and "\n" not in rubric and len(rubric) < 256 and (root / rubric).is_file():
        note["judge rubric"] = {"source": rubric, "sha256": hashlib.sha256(
            (root / rubric).read_bytes()).hexdigest()}
    path = root / ENVIRONMENT_SOURCES
    text = json.dumps(note, indent=2, sort_keys=True) + "\n"
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return note


def module_files(source: Path | None, root: Path) -> list[Path]:
    """An environment module's files as the note hashes them: the module alone, or for a module
    in a folder of the project the folder's files (the data its reward or tools read).
    """
    if source is None:
        return []
    if source.parent != root and source.is_relative_to(root):
        return sorted(f for f in source.parent.rglob("*") if f.is_file() and not any(
            part.startswith((".", "__pycache__")) for part in f.relative_to(root).parts))
    return [source]


def cycle_inputs(root: Path) -> list[str]:
    """What a cycle reads that git keeps, not DVC: every dep in dvc.yaml that no stage writes and
    no `.dvc` file tracks (the stages' code, the task and benchmark files), and the environments'
    own files in the project (each module's files as `note_environments` hashes them, its task
    and benchmark files, a judge rubric file); never what DVC is given (`DVC_ADDED`: the inbox).
    A cycle commits them with itself: one run on a module or a task file never committed could
    not be traced back or verified (`offseason lineage --verify`). Paths relative to `root`,
    those git ignores left out.
    """
    import yaml

    from stages import config as cfg
    from stages.envs import contract

    root = root.resolve()
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    written = {next(iter(entry)) if isinstance(entry, dict) else entry
               for stage in stages.values() for key in ("outs", "metrics", "plots")
               for entry in stage.get(key) or []}
    paths = {root / dep for stage in stages.values() for dep in stage.get("deps") or []
             if isinstance(dep, str) and dep not in written and not (root / f"{dep}.dvc").exists()
             and not any(dep == added or dep.startswith(added + "/") for added in DVC_ADDED)}
    params = root / "params.yaml"
    for name, spec in cfg.environments(params).items():
        env = contract.load(name, spec.module, root)
        paths.update(module_files(Path(env.source).resolve() if env.source else None, root))
        paths.update(root / p for p in (spec.tasks, spec.benchmark) if p)
    rubric = str(cfg.load("judge", params).rubric).strip()
    if rubric and "\n" not in rubric and len(rubric) < 256:
        paths.add(root / rubric)
    inside = sorted({p.resolve().relative_to(root).as_posix() for p in paths
                     if p.exists() and p.resolve().is_relative_to(root)})
    ignored = set(subprocess.run(["git", "check-ignore", "--stdin"], cwd=root, text=True,
                                 capture_output=True, input="\n".join(inside)
                                 ).stdout.splitlines()) if inside else set()
    return [p for p in inside if p not in ignored]


def held_by_collect(root: Path) -> str | None:
    """What a stopped `offseason collect` keeps in its journal, unfinished (`COLLECT_HELD`), in
    words, or None: traces it acknowledged that no cycle can see until they reach the inbox.
    """
    path = root / COLLECT_HELD
    if not path.exists():
        return None
    note = json.loads(path.read_text())
    return (f"`offseason collect`, stopped at {note.get('stopped')}, holds "
            f"{note.get('pending_traces')} unfinished traces ({note.get('pending_spans')} spans) "
            f"in {path.parent}; this cycle does not see them: they reach the inbox once they "
            f"finish after it starts again")


def uncommitted(root: Path, paths: list[str]) -> list[str]:
    """The files under `paths` that git does not hold as they are (new or changed)."""
    if not paths:
        return []
    # porcelain lines are `XY path`: not stripped (` M` begins with a space)
    status = run(["git", "status", "--porcelain", "--untracked-files=all", "--", *paths], root)
    return sorted(line[3:] for line in status.stdout.splitlines() if line[3:])


def inputs_fingerprint(root: Path) -> dict[str, str]:
    """What a cycle learns from, hashed: the inbox snapshot, the params, the pipeline's code.

    Recorded with every committed cycle. A run whose fingerprint equals the last cycle's has
    nothing new to learn from. A promotion changes the champion but not this, so promoting does
    not by itself start another cycle on the same traces.
    """
    def digest(paths: list[Path]) -> str:
        h = hashlib.sha256()
        for path in paths:
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() if path.exists() else b"-")
        return h.hexdigest()[:16]

    def params_digest() -> str:
        # without runtime: (where work runs): changing it is not a reason for a cycle
        import yaml

        path = root / "params.yaml"
        try:
            params = yaml.safe_load(path.read_text()) if path.exists() else None
        except yaml.YAMLError:
            return digest([path])
        if isinstance(params, dict):
            params.pop("runtime", None)
        text = json.dumps(params, sort_keys=True, default=str).encode()
        return hashlib.sha256(b"params.yaml\0" + text).hexdigest()[:16]

    return {"inbox": digest([root / "data" / "inbox.dvc"]),
            "params": params_digest(),
            "code": digest([root / "dvc.yaml", *sorted((root / "stages").rglob("*.py"))]),
            "environments": digest([root / ENVIRONMENT_SOURCES])}


def limit_name(root: Path) -> str:
    """The workspace's global concurrency limit: its folder name and a hash of its path."""
    return f"offseason-cycle:{root.name}-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"


@contextmanager
def workspace_slot(root: Path):
    """Inside a deployment's flow run: the workspace's concurrency slot, then its file lock.

    Outside one (`offseason run`), the CLI holds the file lock already and nothing is taken here.
    """
    from prefect.runtime import deployment, flow_run

    if not deployment.id:
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(limit_name(root), occupy=1), \
            cycle_lock(root, f"deployment {deployment.name}, flow run {flow_run.name} "
                             f"({flow_run.id})"):
        yield


def stage_args(root: Path, stage: str):
    """dvc.yaml's command of `stage`, read by the stage's own command line (`parser()` of
    `stages.<stage>`): its paths by name, never by position in the string.
    """
    import importlib
    import shlex

    import yaml

    try:
        cmd = shlex.split(yaml.safe_load((root / "dvc.yaml").read_text())["stages"][stage]["cmd"])
    except (OSError, KeyError, TypeError) as err:
        raise WorkspaceError(f"dvc.yaml: no command for the {stage} stage ({err}); restore it "
                             f"from git (`git checkout dvc.yaml`)") from None
    module = cmd[cmd.index("-m") + 1] if "-m" in cmd else f"stages.{stage}"
    args = cmd[cmd.index("-m") + 2:] if "-m" in cmd else cmd[1:]
    try:
        return importlib.import_module(module).parser().parse_args(args)
    except SystemExit:  # argparse has printed what is wrong
        raise WorkspaceError(f"dvc.yaml: the {stage} stage's command {' '.join(cmd)!r} is not "
                             f"what `python -m {module}` takes (`python -m {module} --help`)") \
            from None
