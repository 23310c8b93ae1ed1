"""The reward stage's fan-out: the code environment's rewards in 1 and 2 local worker processes
and on a 2-node local Ray cluster.

    .venv/bin/python benchmarks/reward_scaleout.py                  # 400 rollouts, best of 2
    .venv/bin/python benchmarks/reward_scaleout.py --rollouts 1000 --repeats 1

Runs itself inside a network namespace with only loopback (`unshare -n`, needs root), where Ray
binds 127.0.0.1 only. The rollouts are the code environment's task file (data/tasks/code.jsonl, 20
tasks) answered by each task's reference solution (each with a comment naming its attempt, so that
no two are identical), `--rollouts` of them in the rollout stage's schema; every gold check and
every reward runs the task's unit tests in the sandbox (stages/envs/sandbox.py). The reward stage's
own command (`python -m stages.reward`, as DVC runs it) scores them with `runtime.reward.workers` 1
(in its own process) and 2 (local worker processes), and with `runtime.reward.ray_address` naming a
Ray cluster of two nodes on this machine (`ray start --head` and a second `ray start --address`, one
CPU each), each timed from start to exit (start-up, imports and, for Ray, connecting and shipping
the work included). The three must give equal rewards. Prints a Markdown table and the load average
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RAY = Path(sys.executable).parent / "ray"


def rollouts(n: int):
    """`n` rollouts of the code task file, each answered by its task's reference solution."""
    import pyarrow as pa

    from stages import rollout
    from stages.envs import coding, contract

    tasks = contract.load_tasks(ROOT / "data/tasks/code.jsonl", "code")
    rows = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        # a comment naming the attempt makes each rollout distinct: the stage scores identical
        # episodes once
        added = [{**m, "content": m["content"].replace("```python\n", f"```python\n# attempt {i}\n", 1)}
                 for m in coding.gold(task)]
        rows.append({"task_id": f"code:{task['task_id']}", "environment": "code",
                     "sample": i // len(tasks), "task": json.dumps(task),
                     "messages": json.dumps(task["messages"] + added),
                     "completion": json.dumps(added), "token_ids": [], "model_mask": [],
                     "logprobs": [], "finish": "eos", "tool_calls": 0, "tool_errors": 0,
                     "error": None, "turns": []})
    return pa.Table.from_pylist(rows, schema=rollout.SCHEMA)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_nodes() -> str:
    """A Ray cluster of two nodes on this machine, one CPU each; returns its address."""
    port = free_port()
    env = os.environ
    common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    subprocess.run([str(RAY), "start", "--head", "--port", str(port), "--include-dashboard",
                    "false", *common], check=True, env=env, capture_output=True)
    address = f"127.0.0.1:{port}"
    subprocess.run([str(RAY), "start", "--address", address, *common], check=True, env=env,
                   capture_output=True)
    return address


def inside(args) -> int:
    """The measurements, in the namespace."""
    import pyarrow.parquet as pq
    import yaml

    # the stage and both nodes: no usage stats; no token (Ray 2.60's `ray start --head` asks for
    # one, kept in the home folder): a loopback-only cluster in a namespace no one else reaches
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    work = Path(tempfile.mkdtemp(prefix="offseason-reward-fanout-"))
    table = work / "rollouts.parquet"
    pq.write_table(rollouts(args.rollouts), table)
    load_before = os.getloadavg()
    address = two_nodes()
    try:
        deadline = time.time() + 120  # the second node registers a few seconds after it starts
        while True:
            status = subprocess.run([str(RAY), "status", "--address", address],
                                    capture_output=True, text=True).stdout
            if status.count(" node_") == 2 or time.time() > deadline:
                break
            time.sleep(2)
        assert status.count(" node_") == 2, status  # both nodes up, one CPU each
        placements = {"1 worker (in the stage's process)": {"workers": 1},
                      "2 workers (local processes)": {"workers": 2},
                      "Ray, 2 nodes x 1 CPU (local cluster)": {"ray_address": address}}
        timings: dict[str, list[float]] = {}
        outputs = {}
        for _ in range(args.repeats):
            for name, runtime in placements.items():
                params = work / "params.yaml"
                params.write_text(yaml.safe_dump({
                    "reward": {}, "environments": {"code": {"module": "stages.envs.coding"}},
                    "runtime": {"reward": runtime}}))
                out = work / "rewards.parquet"
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "stages.reward", str(table), str(out),
                                str(work / "reward.json"), "--params", str(params)],
                               check=True, cwd=work, capture_output=True)
                timings.setdefault(name, []).append(time.perf_counter() - started)
                outputs[name] = pq.read_table(out)
                metrics = json.loads((work / "reward.json").read_text())
                assert metrics["correct_episodes"] == args.rollouts, metrics  # every gold passes
                print(json.dumps({name: round(timings[name][-1], 2)}), file=sys.stderr,
                      flush=True)
        first = next(iter(outputs.values()))
        assert all(t.equals(first) for t in outputs.values()), "different rewards"
    finally:
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True)
    load_after = os.getloadavg()
    best = {name: min(values) for name, values in timings.items()}
    one = best["1 worker (in the stage's process)"]
    print(f"{args.rollouts} rollouts of data/tasks/code.jsonl (20 tasks) plus 20 gold checks, "
          f"each a sandbox run; best of {args.repeats}; {os.cpu_count()} cores; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print("\n| reward stage, runtime.reward | seconds | rollouts/s | vs 1 worker |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.2f} | {args.rollouts / seconds:.1f} | "
              f"{one / seconds:.2f}x |")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Re-run inside a loopback-only network namespace, then measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, the best kept")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    command = [sys.executable, __file__, "--inside", "--rollouts", str(args.rollouts),
               "--repeats", str(args.repeats)]
    return subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                           *command], cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main())
