"""Orchestration overhead of a cycle, and the time of a cycle in which nothing changed.

    .venv/bin/python benchmarks/orchestration.py            # the demo's params (a real demo cycle)
    .venv/bin/python benchmarks/orchestration.py --tiny     # the tests' tiny params (quicker)

In a fresh project (a temporary folder): `offseason init`, `offseason simulate`, then a timed
`offseason run` (a whole cycle), then a second timed `offseason run` with nothing new (it must
say "nothing changed"). Each stage command DVC runs (`python -m stages.<name> ...`) is timed from
the run's log timestamps, from DVC's `> python -m stages.X` line to its `Updating lock file` line
(a `python` shim on PATH is tried first, but `configure_env` puts the venv's bin ahead of it): the
overhead is the cycle's wall time minus the time inside the stage commands, as a share of the
wall time (target: under 10%), and the no-change cycle's wall time has a target of 15 s. Also
splits the overhead by where it goes, from the run's own log timestamps. Prints a table and JSON.

Set PREFECT_API_URL to measure against a running Prefect server (`offseason ui` starts one)
instead of Prefect's temporary local server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

SHIM = """#!/bin/sh
# times a stage command for benchmarks/orchestration.py, then runs the real interpreter
start=$(date +%s.%N)
{real} "$@"
rc=$?
echo "$start $(date +%s.%N) $*" >> {log}
exit $rc
"""


def timed_run(root: Path, env: dict) -> tuple[float, str]:
    started = time.time()
    out = subprocess.run([str(Path(sys.executable).parent / "offseason"), "run"], cwd=root,
                         env=env, capture_output=True, text=True)
    wall = time.time() - started
    if out.returncode != 0:
        raise SystemExit(f"offseason run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return wall, out.stdout + out.stderr


def stage_times(log: Path, output: str = "") -> dict[str, float]:
    """Seconds inside each stage command: from the shim's records when it ran, else from the
    run's log (the `> python -m stages.X` line to DVC's `Updating lock file` line after it).
    """
    times: dict[str, float] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            start, end, *args = line.split()
            if len(args) >= 2 and args[0] == "-m" and args[1].startswith("stages."):
                name = args[1].split(".", 1)[1]
                times[name] = times.get(name, 0.0) + float(end) - float(start)
    if times:
        return times
    started = None
    for line in output.splitlines():
        match = re.match(r"(\d\d):(\d\d):(\d\d)\.(\d+) \| .*?> python -m stages\.(\w+)", line)
        stamp = re.match(r"(\d\d):(\d\d):(\d\d)\.(\d+) \| ", line)
        if not stamp:
            continue
        h, m, sec, frac = stamp.groups()[:4]
        when = int(h) * 3600 + int(m) * 60 + int(sec) + float(f"0.{frac}")
        if match:
            started = (match.group(5), when)
        elif started and "Updating lock file" in line:
            times[started[0]] = times.get(started[0], 0.0) + when - started[1]
            started = None
    return times


def log_marks(output: str) -> dict[str, float]:
    """Seconds between the run's own log lines: Prefect's server start, first stage, the end."""
    stamps = []
    for line in output.splitlines():
        match = re.match(r"(\d\d):(\d\d):(\d\d)\.(\d+) \| ", line)
        if match:
            h, m, s, frac = match.groups()
            stamps.append((int(h) * 3600 + int(m) * 60 + int(s) + float(f"0.{frac}"), line))
    marks = {}
    if stamps:
        first = stamps[0][0]
        for when, line in stamps:
            if "Beginning flow run" in line and "flow_started" not in marks:
                marks["flow_started"] = when - first
            if "Running stage" in line and "first_stage" not in marks:
                marks["first_stage"] = when - first
        marks["last_log"] = stamps[-1][0] - first
    return marks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny params")
    parser.add_argument("--keep", action="store_true", help="keep the project folder")
    args = parser.parse_args(argv)
    from conftest import TINY, make_project

    tmp = Path(tempfile.mkdtemp(prefix="offseason-orch-"))
    root = make_project(tmp / "project", TINY if args.tiny else {})
    shim_dir, log = tmp / "shim", tmp / "stages.log"
    shim_dir.mkdir()
    (shim_dir / "python").write_text(SHIM.format(real=sys.executable, log=log))
    (shim_dir / "python").chmod(0o755)
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home")}
    env.pop("MLFLOW_TRACKING_URI", None)
    cli = str(Path(sys.executable).parent / "offseason")
    print(f"benchmark project in {root}", file=sys.stderr)
    for command in (["init"], ["simulate"]):
        subprocess.run([cli, *command], cwd=root, env=env, check=True, capture_output=True)
    # configure_env puts the venv's bin first on PATH unless it is already first: put the shim
    # before it, and the venv's bin right after
    env["PATH"] = os.pathsep.join([str(shim_dir), str(Path(sys.executable).parent),
                                   env.get("PATH", "")])
    wall, output = timed_run(root, env)
    stages = stage_times(log, output)
    inside = sum(stages.values())
    log.unlink(missing_ok=True)
    idle_wall, idle_output = timed_run(root, env)
    if "nothing changed" not in idle_output:
        raise SystemExit(f"the second run was not a no-change run:\n{idle_output[-2000:]}")
    result = {
        "params": "tiny (tests)" if args.tiny else "demo (params.yaml)",
        "prefect": env.get("PREFECT_API_URL") or "temporary local server",
        "cycle_wall_s": round(wall, 1), "inside_stage_commands_s": round(inside, 1),
        "overhead_s": round(wall - inside, 1), "overhead_share": round((wall - inside) / wall, 3),
        "stages_s": {k: round(v, 1) for k, v in stages.items()},
        "cycle_log_marks_s": log_marks(output),
        "nothing_changed_wall_s": round(idle_wall, 1),
        "nothing_changed_log_marks_s": log_marks(idle_output),
        "load_average": os.getloadavg(),
    }
    print(f"{'cycle wall time':<34}{wall:8.1f} s")
    print(f"{'inside the stage commands':<34}{inside:8.1f} s  "
          + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    print(f"{'orchestration overhead':<34}{wall - inside:8.1f} s  "
          f"({(wall - inside) / wall:.1%} of the cycle; target < 10%)")
    print(f"{'cycle with nothing changed':<34}{idle_wall:8.1f} s  (target < 15 s)")
    print(json.dumps(result, indent=2))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(tmp)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
