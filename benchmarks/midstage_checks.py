"""What the mid-stage checks cost (issue 51: at most 1 % of a stage): the budget checks and the
stall watches that run inside the rollout and reward stages.

    .venv/bin/python benchmarks/midstage_checks.py                 # both stages, 3 rounds
    .venv/bin/python benchmarks/midstage_checks.py --rollouts 240 --episodes 256 --repeats 5

Two measures per stage, since on a shared 2-core machine a stage's wall time moves by more than
1 % from run to run:
- **with and without**, alternating rounds, medians: the same work with the checks on (a budget
  that never trips, so every check runs in full; `stall_seconds` set) and off (no budget; for the
  served rollout, no stall watch);
- **counted**: each check's own cost, timed alone (thousands of calls), times the checks the run
  made, over the run's wall time: an upper bound that does not drown in the noise.

The reward stage: `stages.reward.score` on the code environment's tasks (data/tasks/code.jsonl),
each rollout a reference solution made distinct by a comment (a sandbox run of its unit tests
per score and per gold check), in 2 local worker processes; a budget check after each result.
The rollout stage's served path: `stages.generation.openai_backend.chat_rollout` against two
`stages.generation.serve_tiny` server processes (a warm-started tiny chat model that calls the
calculator), 64 requests in flight; with `stall_seconds` the global watch and, with two URLs, the
per-URL watch of every request; a budget check per batch (`rollout.batch_size`) as the stage
makes. The DVC commands' stall watch (flows/project/stall.py), counted only: one sample of a
process tree, as often as the default bound has it sampled. Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reward_scaleout import rollouts  # noqa: E402  (distinct code rollouts, its own)

from stages import budget as budgets  # noqa: E402
from stages import config as cfg  # noqa: E402


def cpu_seconds() -> float:
    """CPU seconds of this process so far (every thread), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def never_trips() -> budgets.Meter:
    """A meter with a budget so large that every check runs in full and none stops the stage."""
    return budgets.Meter("reward", cfg.Budget(max_usd=1e9), cfg.Cost(), since_cpu=cpu_seconds())


def per_call(fn, calls: int = 2000) -> float:
    """Seconds one call of `fn` takes, the best of 3 rounds of `calls`."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def reward_stage(n: int, repeats: int) -> dict:
    """The reward stage with and without its budget checks; the counted cost."""
    from stages import reward

    table, specs = rollouts(n), {"code": cfg.EnvironmentSpec(module="stages.envs.coding")}
    config = cfg.Reward(workers=2)
    times: dict[str, list[float]] = {"on": [], "off": []}
    checks = [0]

    class Counted(budgets.Meter):
        def check(self, *args, **kwargs):
            checks[0] += 1
            return super().check(*args, **kwargs)

    outputs = {}
    reward.score(specs, rollouts(8), ROOT, config)  # warm-up: imports, the first sandbox runs
    for round_ in range(repeats):
        for arm in (("on", "off") if round_ % 2 == 0 else ("off", "on")):
            meter = None
            if arm == "on":
                meter = Counted("reward", cfg.Budget(max_usd=1e9), cfg.Cost(),
                                since_cpu=cpu_seconds())
                checks[0] = 0
            started = time.perf_counter()
            out, _ = reward.score(specs, table, ROOT, config, meter=meter)
            times[arm].append(time.perf_counter() - started)
            outputs[arm] = out
            print(json.dumps({"reward": arm, "seconds": round(times[arm][-1], 2)}),
                  file=sys.stderr, flush=True)
    assert outputs["on"].equals(outputs["off"]), "the checks changed the rewards"
    meter = never_trips()
    one = per_call(lambda: meter.check("x", "y"))
    wall = statistics.median(times["on"])
    return {"what": f"reward: {n} code rollouts + 20 gold checks, 2 worker processes",
            "off": statistics.median(times["off"]), "on": wall,
            "checks": f"{checks[0]} budget checks (one after each result that came in)",
            "counted": checks[0] * one, "share": checks[0] * one / wall}


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_folder(work: Path) -> Path:
    """A tiny chat model warm-started to call the calculator (as the backends' tests build)."""
    from stages import tinylm
    from stages.envs import arith
    from stages.generation import chat
    from stages.training import warmstart

    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
    warmstart.train(model, warmstart.demonstrations(template, arith, random.Random(0), 1.0, 32),
                    steps=60, lr=1e-2, tokenizer=tokenizer, seed=0)
    folder = work / "champion"
    tinylm.save(model, tokenizer, folder)
    return folder


def served_rollout(episodes: int, repeats: int) -> dict:
    """The served rollout with and without its stall watches and per-batch budget checks."""
    import urllib.request

    from stages import tinylm
    from stages.envs import arith, contract
    from stages.generation import chat, openai_backend

    work = Path(tempfile.mkdtemp(prefix="offseason-midstage-"))
    folder = model_folder(work)
    model, tokenizer = tinylm.load(folder)
    ports = [free_port(), free_port()]
    servers = [subprocess.Popen([sys.executable, "-m", "stages.generation.serve_tiny",
                                 str(folder), "--port", str(port), "--threads", "1"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for port in ports]
    urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
    try:
        for url in urls:
            deadline = time.time() + 120
            while True:
                try:
                    urllib.request.urlopen(f"{url}/models", timeout=2).read()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.5)
        env = contract.load("arith", "stages.envs.arith")
        questions = [f"{random.Random(i).randint(2, 99)}*{random.Random(-i).randint(2, 99)}"
                     for i in range(episodes)]
        tasks = [{"task_id": f"t{i}", **arith.chat_task(q)} for i, q in enumerate(questions)]
        batch = cfg.Rollout().batch_size
        times: dict[str, list[float]] = {"on": [], "off": []}
        cpu: dict[str, list[float]] = {"on": [], "off": []}
        outputs = {}
        for round_ in range(-1, repeats):  # round -1: a warm-up of both arms, not counted
            for arm in (("on", "off") if round_ % 2 == 0 else ("off", "on")):
                meter = never_trips() if arm == "on" else None
                started, used, got = time.perf_counter(), cpu_seconds(), []
                for start in range(0, episodes, batch):
                    if meter is not None:
                        meter.check("x", "y", served_tokens=0)
                    part, _ = openai_backend.chat_rollout(
                        tokenizer, env, tasks[start:start + batch],
                        list(range(start, min(episodes, start + batch))), urls=urls,
                        parser="hermes", max_turns=4, context=model.config.max_position_embeddings,
                        ends=chat.end_ids(model, tokenizer), temperature=1.0,
                        max_new_tokens=40, concurrency=64, progress=False,
                        stall=300.0 if arm == "on" else None)
                    got += [e.token_ids for e in part]
                if round_ < 0:
                    continue
                times[arm].append(time.perf_counter() - started)
                cpu[arm].append(cpu_seconds() - used)
                outputs[arm] = got
                print(json.dumps({"rollout": arm, "seconds": round(times[arm][-1], 2),
                                  "client_cpu": round(cpu[arm][-1], 2)}),
                      file=sys.stderr, flush=True)
        assert outputs["on"] == outputs["off"], "the checks changed the episodes"
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)

    # counted: the watches' wake-ups (one a second per request in flight, with two URLs, and
    # one a second for the batch), each an asyncio.wait that times out, timed alone
    async def wakeups(n: int) -> None:
        never = asyncio.get_running_loop().create_future()
        for _ in range(n):
            await asyncio.wait({never}, timeout=0)
        never.cancel()

    started = time.perf_counter()
    asyncio.run(wakeups(5000))
    wakeup = (time.perf_counter() - started) / 5000
    wall = statistics.median(times["on"])
    per_request_watches = 64 * wall + wall  # at most 64 requests in flight, each woken 1/s
    meter = never_trips()
    checks = -(-episodes // batch)
    counted = per_request_watches * wakeup + checks * per_call(lambda: meter.check("x", "y"))
    return {"what": f"rollout, served: {episodes} episodes from 2 serve_tiny processes, 64 in "
                    f"flight", "off": statistics.median(times["off"]), "on": wall,
            "cpu_off": statistics.median(cpu["off"]), "cpu_on": statistics.median(cpu["on"]),
            "checks": f"{checks} budget checks (one per batch of {batch}); the stall watches: "
                      f"at most {per_request_watches:.0f} wake-ups",
            "counted": counted, "share": counted / wall}


def dvc_watch() -> dict:
    """The DVC commands' stall watch (flows/project/stall.py), counted: one sample of a process
    tree (the /proc walk, each process's I/O and sockets, the kernel's TCP counters over
    netlink) as often as the default bound has it sampled while `dvc push`, `pull` or `fetch`
    runs.
    """
    from flows.project import stall, workspace

    one = per_call(lambda: stall.sample(workspace.processes_below(os.getpid())), 200)
    every = stall.Watch(os.getpid(), cfg.Dvc().stall_seconds, lambda: None, list).every
    return {"what": "dvc push / pull / fetch: the stall watch's samples (this process's tree, "
                    f"{len(list(Path('/proc').glob('[0-9]*')))} processes on the machine)",
            "off": None, "on": None, "checks": f"a sample every {every:g} s (runtime.dvc."
                                               f"stall_seconds {cfg.Dvc().stall_seconds:g}), "
                                               f"{one * 1000:.1f} ms each",
            "counted": one / every, "share": one / every}


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--rollouts", type=int, default=120, help="code rollouts to score")
    parser.add_argument("--episodes", type=int, default=256, help="served episodes to play")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of each arm")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    rows = [reward_stage(args.rollouts, args.repeats),
            served_rollout(args.episodes, args.repeats), dvc_watch()]
    print(f"{os.cpu_count()} cores, load average {load:.1f} before, {os.getloadavg()[0]:.1f} "
          f"after; medians of {args.repeats} alternating rounds")
    print("\n| stage | without the checks, s | with, s | difference | the checks made | "
          "counted cost | share of the stage |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if row["off"] is None:  # counted only: a second of the command's time
            print(f"| {row['what']} | - | - | - | {row['checks']} | "
                  f"{row['counted'] * 1000:.2f} ms a second | {row['share']:.3%} |")
            continue
        diff = (row["on"] - row["off"]) / row["off"]
        print(f"| {row['what']} | {row['off']:.2f} | {row['on']:.2f} | {diff:+.1%} | "
              f"{row['checks']} | {row['counted'] * 1000:.2f} ms | {row['share']:.3%} |")
    served = rows[1]
    print(f"\nThe served rollout's client CPU: {served['cpu_off']:.2f} s without, "
          f"{served['cpu_on']:.2f} s with the checks.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
