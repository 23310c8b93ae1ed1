"""When does Ray pay? The reward stage's scoring on a local Ray cluster against the local process pool.

    .venv/bin/python benchmarks/reward_scaleout.py            # the demo's size and 50x that
    .venv/bin/python benchmarks/reward_scaleout.py --sizes 800 40000 --envs arith code

Runs itself inside a network namespace with only loopback (`unshare -n`, needs root), where Ray
binds 127.0.0.1 only. For each environment and size: rollouts of the suite's tasks (arith:
answered right and wrong; code: each reference solution, run in the sandbox), scored by
the reward stage's own command (`python -m stages.reward`, as DVC runs it) with the local process
pool (one worker per core) and with `runtime.reward.ray_address` set to a local Ray cluster
started beforehand (2 CPUs), each timed from start to exit (start-up and imports included; for
Ray also connecting and shipping the work). The rewards must be equal. Prints a Markdown table.

One machine cannot show what Ray is for (more cores than one machine has): it shows Ray's cost
per stage (connecting, scheduling, moving the rows) against the pool's, so that the gain from
more machines can be weighed against it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rollouts(env_name: str, n: int):
    """`n` rollouts of the environment's suite tasks, in the rollout stage's schema."""
    import pyarrow as pa

    from stages import rollout
    from stages.envs import coding

    rng = random.Random(0)
    rows = []
    if env_name == "code":
        tasks = coding.load_tasks(ROOT / "data/tasks/code.jsonl")
        for i in range(n):
            t = tasks[i % len(tasks)]
            rows.append((t["id"], t["question"], t["answer"],
                         coding.gold_completion(t["question"], t["answer"])))
    else:  # 200 questions (the demo's suite size), each sampled n / 200 times, half right
        questions = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(200)]
        for i in range(n):
            a, b = questions[i % 200]
            answer = a * b if rng.random() < 0.5 else a * b + 1
            rows.append((f"t{i % 200}", f"{a}*{b}", str(a * b),
                         f"<calc>{a}*{b}</calc><result>{a * b}</result>answer:{answer}"))
    return pa.Table.from_pylist([
        {"task_id": t, "trace_id": t, "sample": i, "question": q, "answer": a, "prompt": q,
         "completion": c, "token_ids": [], "model_mask": [], "logprobs": [], "finish": "eos",
         "tool_calls": 0} for i, (t, q, a, c) in enumerate(rows)], schema=rollout.SCHEMA)


def inside(args) -> int:
    """The measurements, in the namespace: the reward stage's command, timed, with and without
    `runtime.reward.ray_address` (a Ray cluster this process started and keeps up).
    """
    import tempfile

    import pyarrow.parquet as pq
    import ray
    import yaml

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=200 * 1024 ** 2,
             log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    work = Path(tempfile.mkdtemp(prefix="offseason-scaleout-"))
    results = []
    for env_name in args.envs:
        for n in args.sizes:
            if env_name == "code":
                n = min(n, args.code_cap)
            table = work / f"{env_name}-{n}.parquet"
            pq.write_table(rollouts(env_name, n), table)
            timings, outputs = {}, {}
            for how, where in (("pool", ""), ("ray", address)):
                params = work / "params.yaml"
                params.write_text(yaml.safe_dump({
                    "base": {"environment": env_name}, "reward": {},
                    "runtime": {"reward": {"ray_address": where}}}))
                out = work / f"{how}.parquet"
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "stages.reward", str(table), str(out),
                                str(work / f"{how}.json"), "--params", str(params)],
                               check=True, cwd=ROOT, capture_output=True)
                timings[how] = time.perf_counter() - started
                outputs[how] = pq.read_table(out)
            assert outputs["pool"].equals(outputs["ray"]), "different rewards"
            results.append({"env": env_name, "rollouts": n, **{k: round(v, 2)
                                                               for k, v in timings.items()}})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    ray.shutdown()
    print("| environment | rollouts | local pool, s | Ray (local cluster), s | Ray / pool |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['env']} | {r['rollouts']} | {r['pool']} | {r['ray']} | "
              f"{r['ray'] / r['pool']:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Re-run inside a loopback-only network namespace, then measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[800, 40_000],
                        help="rollouts per run (default: the demo's 800 and 50x that)")
    parser.add_argument("--envs", nargs="+", default=["arith", "code"])
    parser.add_argument("--code-cap", type=int, default=2000,
                        help="at most this many code rollouts (each runs the sandbox)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    command = [sys.executable, __file__, "--inside", "--sizes", *map(str, args.sizes),
               "--envs", *args.envs, "--code-cap", str(args.code_cap)]
    return subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                           *command], cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main())
