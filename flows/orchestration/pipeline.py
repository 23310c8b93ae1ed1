"""A cycle's DVC work in one long-lived DVC process, read back by the flow one stage at a time.

One session process per cycle runs DVC's own entry point for each command sent to it, so DVC's
start-up is paid once per cycle: `dvc repro validate`, then, when validate accepted traces, the
other stages with `--single-item`. The flow reads their output back split by stage, one Prefect
task per stage. `begin()` runs first (undo an unfinished promotion, check the champion, pull new
traces, decide whether anything changed). Writes what DVC writes (`dvc.lock`, the stages'
outputs); `dvc repro` alone runs the same cycle.

    python -m flows.orchestration.pipeline MARKER   # the session process (internal): one JSON argv per stdin line

Details: docs/cycle.md, "How a cycle's DVC work runs (flows/orchestration/pipeline.py)".
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from flows.orchestration import forkserver
from flows.project import workspace
from flows.project.workspace import WorkspaceError, generations, inputs_fingerprint, read_at
from stages import io

# DVC's lines that open a stage's part of the output (dvc/stage/run.py, dvc/stage/__init__.py)
# DVC's routine lines, said every cycle, that ask nothing of anyone (issue 53): an output
# legitimately empty (no row quarantined, no trace held out) and the push the cycle does itself
NOISE = re.compile(r"WARNING: '[^']+' is empty\.$|Use `dvc push` to send your updates to "
                   r"remote storage\.$")
ANNOUNCED = re.compile(r"(?:Running stage '([^']+)':|Stage '([^']+)' (?:didn't change, skipping|"
                       r"is cached - skipping run))")
NEW_TRACES = "new traces in data/inbox"
EMPTY_INBOX = ("the inbox is empty (no *.jsonl in data/inbox): nothing to learn from. Put trace "
               "files there or run `offseason simulate`")


def kill_tree(pid: int) -> None:
    """SIGTERM a process and every process below it (DVC's stage commands), deepest first."""
    workspace.signal_all(workspace.processes_below(pid), signal.SIGTERM)


class Session:
    """One DVC process for a cycle's DVC commands, run one at a time, each as `dvc ARGS` would."""

    def __init__(self, root: Path):
        """Start the DVC session process for the project at `root`."""
        self.root = root
        self.marker = f"offseason-dvc-session-{uuid.uuid4().hex[:12]}"
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.orchestration.pipeline", self.marker], cwd=root, text=True,
            bufsize=1, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        workspace.SESSIONS[root] = self
        # a kill of this process leaves the session running: the lock says which it is (where
        # this process holds it already; `offseason run` notes it once it does)
        workspace.note_children(root, self.proc.pid, self.marker)

    def run(self, args: list[str], on_line=None, check: bool = True,
            on_end=None, stall: float | None = None) -> tuple[int, str]:
        """Run `dvc ARGS` in the session; returns the exit code and the output. `on_line` gets
        each line as it comes; `on_end` gets the exit code (None: the process ended first) as the
        command ends, before another command can run. `stall`: when the session moves no bytes
        for that many seconds (a push to a wedged remote), it is ended and DvcStalled says so.
        """
        from flows.project.stall import Watch

        command = f"`dvc {' '.join(args)}`"
        watch = Watch(self.proc.pid, stall, lambda: workspace.kill_below(self.proc.pid),
                      workspace.processes_below) if stall else None
        with self.lock:
            lines, code = [], None
            try:
                self.proc.stdin.write(json.dumps(args) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # ended (killed) or closed
                pass
            else:
                with watch or contextlib.nullcontext():
                    for raw in self.proc.stdout:
                        text, found, rest = raw.rstrip("\n").partition(self.marker)
                        if found:
                            code = int(rest)
                            break
                        lines.append(text)
                        if on_line is not None:
                            on_line(text)
            if on_end is not None:
                on_end(code)
        while lines and not lines[-1].strip():  # the session's own newline before its marker
            lines.pop()
        if watch is not None and watch.stalled is not None:
            raise workspace.DvcStalled(workspace.dvc_stalled(self.root, args, watch, lines))
        if code is None:
            raise WorkspaceError(f"{command} did not finish: the DVC process ended (exit "
                                 f"{self.proc.wait()})" + "".join(f"\n{x}" for x in lines[-15:]))
        if check and code != 0:
            raise WorkspaceError(f"{command} failed (exit {code}):\n" + "\n".join(lines[-15:])
                                 + workspace.quiet_hint(["dvc", *args], lines))
        return code, "\n".join(lines)

    def close(self, kill: bool = False) -> None:
        """End the session; with `kill`, stop a command still running (and its stage) first."""
        if workspace.SESSIONS.get(self.root) is self:
            del workspace.SESSIONS[self.root]
        if kill and self.proc.poll() is None:
            kill_tree(self.proc.pid)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
        if self.lock.acquire(timeout=30):  # a command's reader, if any, has seen the end
            self.proc.stdout.close()
            self.lock.release()


def stage_order(root: Path) -> list[str]:
    """dvc.yaml's stages, each after every stage whose outputs it reads (file order otherwise)."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]

    def paths(entries) -> list[str]:
        return [next(iter(e)) if isinstance(e, dict) else str(e) for e in entries or []]

    outs = {name: paths(spec.get("outs")) + paths(spec.get("metrics")) + paths(spec.get("plots"))
            for name, spec in stages.items()}

    def reads(reader: str, writer: str) -> bool:
        return any(dep == out or dep.startswith(out + "/") or out.startswith(dep + "/")
                   for dep in paths(stages[reader].get("deps")) for out in outs[writer])

    order, left = [], list(stages)
    while left:  # a cycle (DVC refuses one) would leave none ready: take the first then
        ready = next((n for n in left if not any(reads(n, m) for m in left if m != n)), left[0])
        order.append(ready)
        left.remove(ready)
    return order


def accepted_traces(root: Path) -> int:
    """How many traces validate accepted for training in its last run, those held out for the
    benchmarks not counted (0 when it has not run).
    """
    path = root / "metrics" / "validate.json"
    if not path.exists():
        return 0
    metrics = json.loads(path.read_text())
    return metrics.get("accepted", 0) - metrics.get("held_out", 0)


class Stage:
    """One stage's part of DVC's output, read while DVC runs it."""

    def __init__(self, pipeline: Pipeline, name: str, first: str, started: float):
        """A stage DVC opened at `started`; `first` is its first line of output."""
        self.name, self.reran = name, first.startswith("Running stage")
        self.error: Exception | None = None
        self.lock = ""  # dvc.lock as it was when the stage ended
        self.started, self.ended = started, started  # when DVC opened and closed it (time.time)
        self._pipeline, self._first, self._open = pipeline, first, True

    def __iter__(self):
        """Its lines, as DVC prints them, until the next stage or the command's end."""
        if self._first is not None:
            yield self._first
            self._first = None
        while self._open:
            kind, text, lock, when = self._pipeline.events.get()
            if kind == "line" and not ANNOUNCED.match(text):
                if not NOISE.match(text.strip()):
                    yield text
                continue
            self._open, self.lock, self.ended = False, lock, when
            if kind == "line":  # the next stage's first line: the next stage() reads it
                self._pipeline.pending = (kind, text, lock, when)
            elif kind == "end":
                self.error = text
                self._pipeline.pending = (kind, None, lock, when)


class Pipeline:
    """The cycle's stages, run in a session by a thread of their own; read back by stage."""

    def __init__(self, session: Session):
        """Start the thread that runs the cycle's stages in the session."""
        self.session, self.root = session, session.root
        self.events: queue.Queue = queue.Queue()
        self.pending: tuple | None = None
        self.seen: set[str] = set()
        self.current: Stage | None = None
        self.thread = threading.Thread(target=self._drive, name="offseason-stages", daemon=True)
        self.thread.start()

    def _lock_text(self) -> str:
        # read between DVC's writes: at a stage's first line and at a command's end
        path = self.root / "dvc.lock"
        return path.read_text() if path.exists() else ""

    def _drive(self) -> None:
        first: set[str] = set()

        def line(text: str) -> None:
            match = ANNOUNCED.match(text)
            if match:
                first.add(match.group(1) or match.group(2))
            self.events.put(("line", text, self._lock_text() if match else "", time.time()))

        def done(code: int | None) -> None:
            if code == 0:  # a failure ends the stage that failed, with its error ("end")
                self.events.put(("command-end", None, self._lock_text(), time.time()))

        error = None
        try:
            self.session.run(["repro", "validate"], on_line=line, on_end=done)
            if accepted_traces(self.root):  # else the flow stops: nothing new to learn from
                # the rest in order, without checking again what the first command just ran
                rest = [name for name in stage_order(self.root) if name not in first]
                self.session.run(["repro", "--single-item", *rest], on_line=line, on_end=done)
        except Exception as err:  # a stage failed; the flow raises it in that stage's task
            error = err
        self.events.put(("end", error, self._lock_text(), time.time()))

    def running(self) -> bool:
        """True while DVC is still running the pipeline."""
        return self.thread.is_alive()

    def stage(self, on_other=None) -> Stage | None:
        """The next stage DVC opens (each once a cycle), None once it has run them all. Lines
        between stages (DVC checking a data source) go to `on_other`; a failure before any stage
        opened is raised here.
        """
        if self.current is not None:
            for _ in self.current:  # what the last stage's reader left unread
                pass
        while True:
            kind, text, lock, when = self.pending or self.events.get()
            self.pending = None
            if kind == "end":
                self.pending = (kind, text, lock, when)  # asked again: still the end
                if text is not None and (self.current is None or self.current.error is None):
                    raise text
                return None
            if kind == "command-end":
                continue
            match = ANNOUNCED.match(text)
            name = match and (match.group(1) or match.group(2))
            if name and name not in self.seen:
                self.seen.add(name)
                self.current = Stage(self, name, text, when)
                return self.current
            if name:  # a stage announced again (a later `repro` rechecks it): dropped
                continue
            if text.strip() and on_other is not None:
                on_other(text)


@dataclass
class Start:
    """What begin() found: run a cycle (its stages are running), or why not."""

    status: str  # run | empty-inbox | nothing-changed
    message: str
    generation: int = 0
    reasons: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)  # what an unfinished promotion left
    pipeline: Pipeline | None = None
    pulled: str = ""  # what the pull before the cycle did (params.yaml's `pull:`), if any
    judged: str = ""  # what the production gate on a baking canary did, if any (fleet.py)

    def close(self) -> None:
        """End the session; stages still running (the flow failed) are stopped."""
        if self.pipeline is not None:
            self.pipeline.session.close(kill=self.pipeline.running())


CHANGES = {"inbox": NEW_TRACES, "params": "params.yaml changed",
           "code": "stage code or dvc.yaml changed",
           "environments": "an environment's module changed (data/environments.json)"}


def changed_inputs(root: Path) -> list[str]:
    """Which inputs (`inputs_fingerprint`'s keys) differ from the last committed cycle's."""
    last = (read_at(root, "HEAD", "metrics/promotion.json") or {}).get("inputs", {})
    now = inputs_fingerprint(root)
    return [key for key in now if now[key] != last.get(key)]


def changed_since_last_cycle(root: Path) -> list[str]:
    """Which inputs differ from the last committed cycle's, in words."""
    return [CHANGES[key] for key in changed_inputs(root)]


def begin(root: Path, session: Session | None = None) -> Start:
    """Before any stage: repair, check, and decide; starts the stages when there is work. Takes
    over `session` (a caller may open it early: DVC loads in it meanwhile).
    """
    from flows.audit import lineage
    from flows.orchestration import promotion

    session = session or Session(root)
    try:
        if not (root / "models" / "champion.dvc").exists():
            raise WorkspaceError("no champion yet (models/champion.dvc is missing); run "
                                 "`offseason init` first")
        recovered = promotion.recover_files(root)
        # the production gate on a canary the fleet bakes, on the traces earlier cycles
        # ingested: before any stage reads the champion, which a failed canary puts back
        from flows.orchestration import fleet

        judged = fleet.before_cycle(root)
        if judged:
            print(judged, file=sys.stderr, flush=True)
        # before any stage reads it: `dvc checkout` restores altered cache bytes without a word
        lineage.check_champion(root)
        # params.yaml's `pull:` names a tracing service: its new traces join the inbox first
        from flows.intake import pull

        pulled = pull.before_cycle(root, root / "data" / "inbox", root / "params.yaml") or ""
        if pulled:
            print(pulled, file=sys.stderr, flush=True)
        if (held := workspace.held_by_collect(root)):  # acknowledged, not yet in the inbox
            print(f"warning: {held}", file=sys.stderr, flush=True)
        last = generations(root)
        if not list((root / "data" / "inbox").glob("*.jsonl")):
            session.close()
            return Start("empty-inbox", EMPTY_INBOX, recovered=recovered, pulled=pulled,
                         judged=judged)
        if (root / "data" / "inbox.dvc").exists():
            # exit 1: the inbox differs from its snapshot (`dvc repro` takes a new one)
            new_traces = session.run(["status", "--quiet", "data/inbox.dvc"], check=False)[0] != 0
        else:  # the first cycle: the snapshot that `dvc repro` keeps up to date from now on
            session.run(["add", "data/inbox"])  # (not --quiet: that hides why it failed)
            new_traces = True
        # the environments' modules by content: a dep of the stages that run them (dvc.yaml)
        workspace.note_environments(root)
        reasons = changed_since_last_cycle(root)
        if new_traces and NEW_TRACES not in reasons:
            reasons.insert(0, NEW_TRACES)
        if not reasons:
            session.close()
            return Start("nothing-changed",
                         f"nothing changed since gen-{last[-1] if last else 0} (no new traces, "
                         f"same params, same code): nothing to learn from, no stage reran",
                         recovered=recovered, pulled=pulled, judged=judged)
        check_servers(root)  # before a stage runs: a server that is down fails the cycle in seconds
        return Start("run", "", (last[-1] + 1) if last else 1, reasons, recovered,
                     Pipeline(session), pulled, judged=judged)
    except BaseException:
        session.close(kill=True)
        raise


def check_servers(root: Path | None = None) -> None:
    """The servers a cycle talks to, when they are servers (`MLFLOW_TRACKING_URI`,
    `PREFECT_API_URL`, not the temporary one `offseason run` starts; the default DVC remote of
    `root`, which promotion pushes to), answer a probe within `stages.remote`'s deadline; else
    `stages.remote.RemoteDown` names the setting, the address and what to do. Without them the
    MLflow client retries each request for minutes, a server that accepts and never answers
    holds it for its full request timeout, retry after retry, and a DVC remote that is down
    fails promotion's push only after every stage of the cycle has run (an HTTP remote after its
    `read_timeout`, 60 s a request by default).
    """
    from stages import remote

    mlflow = os.environ.get("MLFLOW_TRACKING_URI", "")
    if mlflow.startswith(("http://", "https://")):
        remote.probe(f"{mlflow.rstrip('/')}/health", setting="MLFLOW_TRACKING_URI", value=mlflow,
                     fix="start that server, or unset MLFLOW_TRACKING_URI for the embedded "
                         "default (mlflow.db in the project); then run `offseason run` again")
    from flows.audit.ui import on_temporary_prefect

    prefect = os.environ.get("PREFECT_API_URL", "")
    if prefect and not on_temporary_prefect():  # our own temporary server may still be starting
        remote.probe(f"{prefect.rstrip('/')}/health", setting="PREFECT_API_URL", value=prefect,
                     fix="start that server (`offseason ui` starts one), or unset "
                         "PREFECT_API_URL for Prefect's temporary local server; then run "
                         "`offseason run` again")
    if root is not None:
        check_dvc_remote(root)


def check_dvc_remote(root: Path) -> None:
    """The default DVC remote answers, when it is a server: an HTTP(S) or WebDAV URL (any HTTP
    status is an answer), an SSH host (its greeting), or an object store with an `endpointurl`
    (S3-compatible, e.g. MinIO). A local folder (the default, `.dvcstore/`) needs no probe; a
    cloud store at its provider's endpoint is left to DVC's own retries.
    """
    from urllib.parse import urlsplit

    from stages import remote

    default, remotes = workspace.dvc_remotes(root)
    settings = remotes.get(default or "", {})
    url = settings.get("url", "")
    scheme = urlsplit(url).scheme
    setting = f'.dvc/config remote "{default}" url'
    fix = ("start that server, or make a reachable remote the default (`dvc remote default "
           "<name>`; `dvc remote add -d local ../.dvcstore` keeps objects in a local folder); "
           "then run `offseason run` again (nothing was run or lost: DVC's cache keeps every "
           "output until it is pushed)")
    if scheme in ("http", "https", "webdav", "webdavs"):
        where = url.replace("webdav", "http", 1)
        remote.probe(where, setting=setting, value=url, fix=fix)
    elif scheme in ("ssh", "sftp"):
        parts = urlsplit(url)
        remote.probe(f"{parts.hostname}:{parts.port or int(settings.get('port', 22))}",
                     setting=setting, value=url, fix=fix, kind="ssh")
    elif settings.get("endpointurl", "").startswith(("http://", "https://")):
        remote.probe(settings["endpointurl"], setting=f'.dvc/config remote "{default}" endpointurl',
                     value=settings["endpointurl"], fix=fix)


_HANDED_OVER: dict[Path, Start] = {}


def hand_over(root: Path, start: Start) -> None:
    """Leave a started cycle for the flow this process runs next (`offseason run`)."""
    _HANDED_OVER[root] = start


def adopt(root: Path) -> Start | None:
    """The cycle `offseason run` started before the flow began, if any."""
    return _HANDED_OVER.pop(root, None)


def main(argv: list[str] | None = None) -> int:
    """The session process: each stdin line a JSON list of DVC arguments, run in turn."""
    marker = (argv if argv is not None else sys.argv[1:])[0]
    # loaded while the parent is still busy with its own checks, not when the first command comes
    with io.heavy_imports():
        from dvc.cli import main as dvc_main
        from dvc.cli import parse_args
        from dvc.repo import Repo  # noqa: F401

        parse_args(["status"])  # builds DVC's parser: every command's module
    server = None
    try:
        for line in sys.stdin:
            args = json.loads(line)
            if server is None and forkserver.precedes_served(args):
                server = forkserver.start(Path.cwd())
            code = dvc_main(args)
            sys.stderr.flush()
            # on a line of its own, whatever the stage's last output line ended with
            print(f"\n{marker}{code}", flush=True)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group
        return 130
    finally:
        if server is not None:
            server.stop()
    io.exit_soon()
    return 0


if __name__ == "__main__":
    sys.exit(main())
