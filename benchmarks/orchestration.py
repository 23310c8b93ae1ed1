"""Orchestration overhead of a cycle, and the time of a cycle in which nothing changed.

    .venv/bin/python benchmarks/orchestration.py            # the demo's params (real demo cycles)
    .venv/bin/python benchmarks/orchestration.py --tiny     # the tests' tiny params (quicker)
    .venv/bin/python benchmarks/orchestration.py --cycles 3 # more cycles (default 2)

In a fresh project (a temporary folder): `offseason init`, then per cycle `offseason simulate` and a
timed `offseason run` (a whole cycle: the command's wall time, from its start to its exit), then
one more timed `offseason run` with nothing new (it must say "nothing changed"; target 15 s).

The time inside the stage commands is measured outside offseason: in the throwaway project each
stage's `cmd` in dvc.yaml is prefixed with a small timer script that records when the command
(`python -m stages.<name> ...`, interpreter start-up and exit included) starts and ends. The
overhead is the cycle's wall time minus the time inside the stage commands, as a share of the wall
time (target: under 10%). Everything else counts as overhead: the CLI, Prefect (its temporary
server, the flow and task runs, the log), MLflow, DVC (start-up, hashing and caching outputs, the
lock file), git, the promotion. Work that runs while a stage runs only counts where it makes the
cycle longer. Prints a table and JSON.

Set PREFECT_API_URL to measure against a running Prefect server (`offseason ui` starts one)
instead of the temporary local server `offseason run` starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

TIMER = """#!/bin/sh
# times one stage command for benchmarks/orchestration.py
start=$(date +%s.%N)
"$@"
rc=$?
echo "$start $(date +%s.%N) $*" >> {log}
exit $rc
"""


def timed(cli: str, root: Path, env: dict, *args: str) -> tuple[float, str]:
    """Run one `offseason` command; returns its wall seconds and output."""
    started = time.time()
    out = subprocess.run([cli, *args], cwd=root, env=env, capture_output=True, text=True)
    wall = time.time() - started
    if out.returncode != 0:
        raise SystemExit(f"offseason {' '.join(args)} failed:\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")
    return wall, out.stdout + out.stderr


def stage_times(log: Path) -> dict[str, float]:
    """Seconds inside each stage command, from the timer's records."""
    times: dict[str, float] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        start, end, *args = line.split()
        name = args[2].split(".", 1)[1]  # python -m stages.<name> ...
        times[name] = times.get(name, 0.0) + float(end) - float(start)
    return times


def main(argv: list[str] | None = None) -> int:
    """Time whole cycles of a fresh project and print each; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny params")
    parser.add_argument("--cycles", type=int, default=2, help="cycles to time (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the project folder")
    args = parser.parse_args(argv)
    from conftest import TINY, make_project

    tmp = Path(tempfile.mkdtemp(prefix="offseason-orch-"))
    root = make_project(tmp / "project", TINY if args.tiny else {})
    log, timer = tmp / "stages.log", tmp / "timer"
    timer.write_text(TIMER.format(log=log))
    timer.chmod(0o755)
    pipeline = yaml.safe_load((root / "dvc.yaml").read_text())
    for stage in pipeline["stages"].values():
        stage["cmd"] = f"{timer} {stage['cmd']}"
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qam",
                    "time the stage commands"], cwd=root, check=True)
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home")}
    env.pop("MLFLOW_TRACKING_URI", None)
    cli = str(Path(sys.executable).parent / "offseason")
    print(f"benchmark project in {root}", file=sys.stderr)
    timed(cli, root, env, "init")
    cycles = []
    for number in range(1, args.cycles + 1):
        timed(cli, root, env, "simulate")
        log.unlink(missing_ok=True)
        wall, output = timed(cli, root, env, "run")
        stages = stage_times(log)
        inside = sum(stages.values())
        cycles.append({"cycle": f"gen-{number}", "wall_s": round(wall, 2),
                       "inside_stage_commands_s": round(inside, 2),
                       "overhead_s": round(wall - inside, 2),
                       "overhead_share": round((wall - inside) / wall, 4),
                       "stages_s": {k: round(v, 2) for k, v in stages.items()},
                       "outcome": output.strip().splitlines()[-1][:200]})
        print(f"gen-{number}: {wall:.1f} s, {inside:.1f} s inside the stage commands, overhead "
              f"{wall - inside:.1f} s ({(wall - inside) / wall:.1%})", file=sys.stderr)
    idle_wall, idle_output = timed(cli, root, env, "run")
    if "nothing changed" not in idle_output:
        raise SystemExit(f"the last run was not a no-change run:\n{idle_output[-2000:]}")
    result = {
        "params": "tiny (tests)" if args.tiny else "demo (params.yaml)",
        "prefect": env.get("PREFECT_API_URL") or "temporary local server",
        "cycles": cycles, "nothing_changed_wall_s": round(idle_wall, 2),
        "load_average": os.getloadavg(),
    }
    print(f"{'cycle':<8}{'wall s':>9}{'inside s':>10}{'overhead s':>12}{'share':>8}  stages (s)")
    for c in cycles:
        print(f"{c['cycle']:<8}{c['wall_s']:>9.1f}{c['inside_stage_commands_s']:>10.1f}"
              f"{c['overhead_s']:>12.1f}{c['overhead_share']:>8.1%}  "
              + ", ".join(f"{k} {v:.1f}" for k, v in c["stages_s"].items()))
    print(f"cycle with nothing changed: {idle_wall:.1f} s (target < 15 s); overhead target < 10%")
    print(json.dumps(result, indent=2))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(tmp)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
