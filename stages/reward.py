"""Reward: each environment's own reward scores the rollouts of its tasks, component by component.

Reads `data/rollouts.parquet` (the chat episodes of the `environments:` modules); writes
`data/rewards.parquet` (every rollout column plus `correct`, `reward`, `verifier`, `error`,
`hack_suspected`, the verifier's note of a likely reward hack, and one `score_<component>`
column per reward component) and `metrics/reward.json` (with the `hack_suspected` episodes
counted per reason).
Each episode is scored by its environment's `reward` (or `reward_group`); a reward that raises is
an error with its cause, never a zero. Runs in `runtime.reward.workers` processes or on a Ray
cluster; `--validated` adds users' ratings as a `feedback` component. A budget that stops the
stage (`stages/budget.py`, checked as each result comes in) leaves the finished scores in
`data/rewards.parquet.partial`; the rerun scores only the rest, to the same table.

    python -m stages.reward data/rollouts.parquet data/rewards.parquet metrics/reward.json \
        --judgments data/judgments --validated data/validated.parquet
    offseason rescore [data/rewards.parquet] [--output data/rescored.parquet]

Details: docs/environments.md, "How the reward stage works (stages/reward.py)".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import budget as budgets
from stages import config as cfg
from stages import io, remote
from stages.envs import contract, judge, sandbox

COLUMNS = ("correct", "reward", "verifier", "error", "hack_suspected")  # plus score_<component>
FEEDBACK = cfg.FEEDBACK


def rating(feedback: dict, score_name: str = "") -> float | None:
    """A user's rating of a trace in [0, 1]: its thumbs (up 1.0, down 0.0), else the score
    `score_name` of its `feedback.scores` (a number in [0, 1], or a boolean); None when neither.
    """
    thumbs = feedback.get("thumbs_up")
    if isinstance(thumbs, bool):
        return float(thumbs)
    value = (feedback.get("scores") or {}).get(score_name) if score_name else None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and 0.0 <= value <= 1.0:
        return float(value)
    return None


def trace_feedback(validated: Path | None, score_name: str = "") -> dict[str, tuple[float, str]]:
    """{trace_id: (the user's rating, production's final answer)} of the validated traces that
    carry a rating (`rating`) and end with an answer (an assistant turn without tool calls).
    """
    if validated is None or not validated.exists():
        return {}
    out = {}
    table = pq.read_table(validated, columns=["trace_id", "messages", "feedback"])
    for row in table.to_pylist():
        score = rating(json.loads(row["feedback"] or "{}"), score_name)
        messages = json.loads(row["messages"] or "[]")
        last = messages[-1] if messages else {}
        if score is None or last.get("role") != "assistant" or last.get("tool_calls"):
            continue
        answer = contract.text_of(last.get("content"))
        if answer.strip():
            out[row["trace_id"]] = (score, answer)
    return out


def _normal(text: str) -> str:
    return " ".join(text.split()).lower()


def with_feedback(rows: list[dict], scores: list, feedback: dict) -> dict:
    """Add the `feedback` component to each scored episode of a trace's task (task id
    `<environment>:trace:<trace id>`, as the rollout stage names them) whose final answer is
    production's (whitespace and case aside), the one the user rated: the rating is about that
    answer, so an episode that answered otherwise gets no feedback component (absent, not 0).
    A module's own `feedback` component is left as it is. Returns the counts for the metrics.
    """
    counts = {"rated_traces": len(feedback), "episodes": 0, "other_answer": 0}
    for row, components in zip(rows, scores):
        trace = row["task_id"].partition(":trace:")[2]
        if components is None or trace not in feedback or FEEDBACK in components:
            continue
        score, answer = feedback[trace]
        messages = json.loads(row["messages"])
        last = messages[-1] if messages else {}
        said = contract.text_of(last.get("content")) if last.get("role") == "assistant" else ""
        if said.strip() and _normal(said) == _normal(answer):
            components[FEEDBACK] = score
            counts["episodes"] += 1
        else:
            counts["other_answer"] += 1
    return counts


def mixed(components: dict, feedback_weight: float) -> float:
    """An episode's reward: the weighted mean of its components, each of the environment's
    weighing 1 and `feedback` weighing `reward.weights.feedback`; the weights renormalised over
    the components present, so an episode without feedback keeps its environment's mean.
    """
    weights = {name: feedback_weight if name == FEEDBACK else 1.0 for name in components}
    total = sum(weights.values())
    if not total:  # only a module's own `feedback` component, weighted 0: its plain mean
        return contract.mean(components)
    return sum(weights[name] * value for name, value in components.items()) / total


class VerifierBroken(RuntimeError):
    """Every score failed, or more than `reward.max_error_fraction` of them: the verifier, judge
    or tool server is broken, not the rollouts.
    """


def check_errors(errors: int, attempted: int, example: str | None, limit: float) -> None:
    """Fail when more than `limit` of the `attempted` episodes (those not set aside) erred."""
    if attempted and errors / attempted > limit:
        raise VerifierBroken(
            f"{errors} of {attempted} episodes could not be scored ({errors / attempted:.0%}, more "
            f"than reward.max_error_fraction={limit:g}), e.g. {example}; fix the judge, verifier "
            f"or tool server and run again (judgments already made are kept), or raise "
            f"reward.max_error_fraction in params.yaml to train on the rest")


def verifier_id(name: str, env) -> str:
    """An environment's verifier id, `<name>/<VERSION>` (the module where it has none), recorded
    with each of its rewards.
    """
    return f"{name}/{env.version or env.module}"


def rollout_error(cause: str | None) -> str | None:
    """The rollout's own error (a tool call that broke) in a chat rewards table's `error`, which
    also holds the reward stage's causes (a task set aside, a reward that raised): None for those,
    which a re-score decides again.
    """
    if cause is None or cause.startswith(("task set aside", "reward() raised on the gold")) \
            or ": reward() raised " in cause or ": reward_group() " in cause:
        return None
    return cause


def probe_ray(address: str, timeout: float | None = None) -> None:
    """Fail within the probe's deadline, naming the setting, when nothing answers at the Ray
    address, whether nothing listens or a listener never answers (`stages.remote`: Ray's GCS is
    a gRPC server); `ray.init` would otherwise retry for minutes, printing "Failed to get cluster
    ID". "auto" is first resolved as Ray resolves it (RAY_ADDRESS, else the cluster last started
    on this machine, which may have died since: that took `ray.init` two minutes to say).
    """
    fix = ("start the cluster (`ray start --head`), fix the address, or set "
           "runtime.reward.ray_address to '' for the local process pool")
    probed = address
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        try:  # the address as found, before Ray turns a loopback one into this node's address
            probed = get_ray_address_from_environment("auto", None) or ""
        except ConnectionError:
            probed = ""
        if not probed:
            raise remote.RemoteDown(
                "runtime.reward.ray_address='auto': no Ray cluster runs on this machine (RAY_ADDRESS "
                f"is unset and none was started here with `ray start`); {fix}")
    host, _, port = probed.rpartition(":")
    if not host or not port.isdigit():
        return
    remote.probe(probed, setting="runtime.reward.ray_address", kind="grpc", timeout=timeout,
                 value=address if address != probed else None,
                 fix=fix if address == probed else f"{fix} (auto found {probed}: the cluster "
                                                   f"last started here, gone since?)")


# what stops the stage rather than erring one episode: a spent judge budget, a judge that is down
STOPS = (judge.JudgeBudget, remote.RemoteDown)
PROGRESS_EVERY_S = 10.0


class Stalled(RuntimeError):
    """Nothing scored for runtime.reward.stall_seconds; the message names where it waited.
    `results`: each job's result as `run` returns it, None where it was not finished.
    """

    def __init__(self, message: str, results: list | None = None):
        """`message` names where it waited; `results` the finished jobs'."""
        super().__init__(message)
        self.results = results or []


CHUNK_MAX = 64  # jobs per chunk sent to a worker at most: each chunk done is visible progress


def _ready(handles: list, ray) -> list:
    """The handles (futures, Ray object refs) done now, after waiting up to half a second for
    one: never longer, so the stall bound is checked twice a second.
    """
    futures = [h for h in handles if isinstance(h, Future)]
    refs = [h for h in handles if not isinstance(h, Future)]
    if futures:
        wait(futures, timeout=0.5 if not refs else 0.25, return_when=FIRST_COMPLETED)
    if refs:
        ray.wait(refs, num_returns=1, timeout=0.5 if not futures else 0.25, fetch_local=False)
    ready = [f for f in futures if f.done()]
    if refs:
        ready += ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]
    return ready


def _where(waiting: dict, ray_address: str, workers: int) -> str:
    """What a stalled stage waited on, in words."""
    places = []
    if any(not isinstance(h, Future) for h in waiting):
        places.append(f"the Ray cluster at runtime.reward.ray_address={ray_address!r}")
    if any(isinstance(h, Future) for h in waiting):
        places.append(f"the local workers (runtime.reward.workers={workers}) or the judged "
                      f"environments' threads")
    return " and ".join(places)


def _chunks(jobs: list, parts: int) -> list[list]:
    size = max(1, -(-len(jobs) // parts))
    return [jobs[i:i + size] for i in range(0, len(jobs), size)]


@contextmanager
def scorer(envs: dict, modules: dict[str, str], root: Path, workers: int = 0,
           ray_address: str = "", stall_seconds: float = 300.0):
    """`run(jobs, between=None)`: the results of scoring jobs, in their order, wherever they ran
    (module docstring, "Fan-out"). A job is `(kind, environment, task JSON, payload JSON)`
    (`contract.run_job`); `envs`: the loaded environments by name, `modules`: the module each
    was loaded from. `between(done)` is called as results come in (a budget check may raise:
    the error then carries `results`, as `Stalled` does, and the workers are ended).
    Nothing finished anywhere for `stall_seconds` (runtime.reward.stall_seconds) and `run`
    raises `Stalled`, naming where it waited: a Ray worker or a process that wedges would
    otherwise hold the stage for ever (`ray.get` has no bound of its own).
    """
    unisolated = os.environ.get(sandbox.ALLOW_UNISOLATED_ENV) == "1"
    where = str(Path(root).resolve())
    workers = workers or os.cpu_count() or 1
    local = workers == 1 and not ray_address  # every job in this process
    ray = connect = None
    if ray_address:
        probe_ray(ray_address)
        import ray

        connect = not ray.is_initialized()
        if connect:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # privacy by default
            try:
                ray.init(address=ray_address, log_to_driver=False)
            except ConnectionError as err:
                raise ConnectionError(
                    f"runtime.reward.ray_address={ray_address!r}: no Ray cluster to connect to "
                    f"({err}); start one (`ray start --head`) or set runtime.reward.ray_address "
                    f"to '' for the local processes") from err
        on_ray = ray.remote(contract.run_jobs)
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    pools: dict[str, object] = {}

    def pool(name: str):
        if name not in pools:
            pools[name] = (
                # the judge bounds its own requests in flight (runtime.judge.concurrency)
                ThreadPoolExecutor(64, thread_name_prefix="judged") if name == "threads" else
                # spawn: a fresh interpreter per worker, safe whatever threads this process runs
                ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")))
        return pools[name]

    def here(job: tuple) -> list:
        kind, name, task, payload = job
        return [contract.run_job(envs[name], kind, task, payload, STOPS)]

    def run(jobs: list[tuple], between=None) -> list:
        judged = [i for i, job in enumerate(jobs) if envs[job[1]].judged]
        rest = [i for i, job in enumerate(jobs) if not envs[job[1]].judged]
        # the judged ones start at once, on threads; collected after the rest
        judging = [([i], pool("threads").submit(here, jobs[i])) for i in judged]
        if rest and not local:  # in chunks, to the workers: only where to find the modules
            # small enough that a chunk finishing is progress the stall bound can see
            parts = _chunks(rest, max(workers * 4, -(-len(rest) // CHUNK_MAX)))
            shipped = [[(kind, name, modules[name], where, task, payload)
                        for kind, name, task, payload in (jobs[i] for i in part)]
                       for part in parts]
            pending = list(zip(parts, [on_ray.remote(chunk, unisolated) for chunk in shipped]
                                if ray_address else [pool("processes").submit(
                                    contract.run_jobs, chunk, unisolated) for chunk in shipped]))
        else:  # one at a time in this thread, while the judged ones run beside
            pending = [([i], None) for i in rest]
        pending += judging
        results: list = [None] * len(jobs)
        done, started, last = 0, time.time(), time.time()

        def progressed() -> None:
            if between is not None:
                try:
                    between(done)
                except Exception as err:  # a budget stop: what finished goes with it, to keep
                    err.results = results
                    raise
        waiting = {}  # handle -> the jobs' indices, for those running elsewhere
        for indices, handle in pending:
            if handle is None:  # here, in this thread, now
                got = here(jobs[indices[0]])
            else:
                waiting[handle] = indices
                continue
            for i, result in zip(indices, got):
                results[i] = result
            done += len(indices)
            progressed()
        progress = time.monotonic()
        while waiting:
            ready = _ready(list(waiting), ray)
            if not ready:
                quiet = time.monotonic() - progress
                if quiet > stall_seconds:
                    raise Stalled(
                        f"reward: nothing scored for {quiet:.0f} s ({done} of {len(jobs)} done; "
                        f"runtime.reward.stall_seconds={stall_seconds:g}) while waiting on "
                        f"{_where(waiting, ray_address, workers)}: a worker is wedged (a reward "
                        f"that never returns, a dead node). Fix or restart it, or raise "
                        f"stall_seconds for rewards that are slow, not stuck, and run again",
                        results)
                continue
            progress = time.monotonic()
            for handle in ready:
                indices = waiting.pop(handle)
                got = handle.result() if isinstance(handle, Future) else ray.get(handle)
                for i, result in zip(indices, got):
                    results[i] = result
                done += len(indices)
                progressed()
            if time.time() - last >= PROGRESS_EVERY_S:
                last = time.time()
                print(f"reward: {done}/{len(jobs)} scored ({done / (last - started):.0f}/s)",
                      file=sys.stderr, flush=True)
        return results

    stalled = False
    try:
        yield run
    except (Stalled, budgets.BudgetSpent):  # the work left is not wanted: ended, not awaited
        stalled = True
        raise
    finally:
        for executor in pools.values():
            if stalled and isinstance(executor, ProcessPoolExecutor):
                # a wedged worker would hold shutdown for ever: its processes are ended
                for process in list(getattr(executor, "_processes", {}).values()):
                    process.kill()
            # a wedged judged thread cannot be ended: left behind (daemon), not waited for
            executor.shutdown(wait=not stalled, cancel_futures=True)
        if connect:
            ray.shutdown()


def hack_counts(notes: list[str | None]) -> dict:
    """How many episodes a verifier suspected of a reward hack, and how many per reason (the
    sandbox's notes name what the code touched: `imported unittest`, `replaced builtins` ...).
    """
    reasons: dict[str, int] = {}
    for note in filter(None, notes):
        reasons[note] = reasons.get(note, 0) + 1
    return {"episodes": sum(reasons.values()), "reasons": dict(sorted(reasons.items()))}


def score(specs: dict, table: pa.Table, root: Path, config: cfg.Reward | None = None,
          feedback: dict | None = None, meter: budgets.Meter | None = None,
          scoring=None, kept: dict | None = None) -> tuple[pa.Table, dict]:
    """The rollouts (chat episodes of the `environments:` modules, imported from `root`) scored
    by each environment's own `reward` (or `reward_group`), where `config` says they run
    (module docstring, "Fan-out"); returns the rewards table and the metrics.

    The reward is the mean of the module's components (a float is its one component); `correct`
    is 1.0 when every component reaches 1.0 (full marks, as a gold must score). A task whose
    `gold` does not score full marks is set aside; a `reward` that raises, or an episode whose
    tool call broke at rollout, is an error with its cause, never a zero. `feedback`: the
    traces' ratings (`trace_feedback`), added as the `feedback` component where an episode of
    a trace's task gave production's rated answer (`with_feedback`). `meter`: the cycle's
    budget, checked as each result comes in (the judge's tokens counted); a stop raises
    `BudgetSpent` whose `rows` are the finished results (`_kept` reads them back). `scoring`: a
    `scorer` already open (on-policy training scores every step with one pool of workers).
    `kept`: {job key: (result, cause)} finished by a run a budget stopped: not scored again.
    Identical episodes of a task (the same messages, as samples of an easy task often are) are
    scored once and share the result.
    """
    config = config or cfg.Reward()
    envs = {name: contract.load(name, spec.module, root) for name, spec in specs.items()}
    rows = table.select(["task_id", "environment", "task", "messages", "error"]).to_pylist()
    unknown = sorted({r["environment"] for r in rows} - set(envs))
    if unknown:
        raise cfg.ParamsError(f"environments: the rollouts come from {', '.join(unknown)}, which "
                              f"params.yaml no longer lists; rerun the rollout stage")
    first: dict[tuple, int] = {}  # each task's gold is checked once, with its first good row
    for i, row in enumerate(rows):
        if not row["error"]:
            first.setdefault((row["environment"], row["task_id"]), i)

    # under a budget each result that comes in is followed by a check (no batches: a batch's
    # tail would leave workers idle); a stop keeps every finished result (`err.rows`, `run`
    # writes them beside the output) and a rerun given them (`kept`: job key -> (result,
    # cause)) scores only the rest. A judged environment's results are not kept here: the
    # judge's cache has them, keyed by its model and rubric
    limited = meter is not None and meter.limited
    finished, keep = dict(kept or {}), []

    def record(key: str, job: tuple, result) -> None:
        finished[key] = tuple(result)
        if not envs[job[1]].judged:
            keep.append(key)

    def scored(run, these: list[tuple], what: str) -> list:
        keys = [_job_key(job) for job in these]
        # each job once: identical episodes (a task's samples that came out the same) share
        # one result, in a run as in a rerun after a stop
        todo = {key: job for job, key in zip(these, keys) if key not in finished}
        before = len(set(keys)) - len(todo)

        def check(done: int) -> None:
            meter.check(f"{before + done} of {before + len(todo)} {what}",
                        f"{len(todo) - done} {what}",
                        judge_tokens=sum(j.tokens for j in judge.used()))

        try:
            got = run(list(todo.values()), check if limited else None) if todo else []
        except (Stalled, budgets.BudgetSpent) as err:  # what finished is kept, then the stop
            for (key, job), result in zip(todo.items(), getattr(err, "results", [])):
                if result is not None:
                    record(key, job, result)
            raise
        for (key, job), result in zip(todo.items(), got):
            record(key, job, result)
        return [finished[key] for key in keys]

    try:
        with contextlib.nullcontext(scoring) if scoring is not None else \
                scorer(envs, {name: spec.module for name, spec in specs.items()}, root,
                       config.workers, config.ray_address, config.stall_seconds) as run:
            gold = scored(run, [("gold", name, rows[i]["task"], None)
                                 for (name, _), i in first.items()], "gold checks")
            set_aside = {key: cause for key, (_, cause) in zip(first, gold) if cause is not None}
            # an environment with reward_group scores all samples of a task at once (a relative
            # judge); every other episode is scored on its own
            groups: dict[object, list[int]] = {}  # a job's rows: its task's, or one episode (i)
            for i, row in enumerate(rows):
                key = (row["environment"], row["task_id"])
                if not row["error"] and key not in set_aside:
                    groups.setdefault(key if envs[key[0]].reward_group else i, []).append(i)
            jobs = [("group", rows[m[0]]["environment"], rows[m[0]]["task"],
                     "[" + ",".join(rows[i]["messages"] for i in m) + "]")
                    if envs[rows[m[0]]["environment"]].reward_group else
                    ("reward", rows[m[0]]["environment"], rows[m[0]]["task"],
                     rows[m[0]]["messages"]) for m in groups.values()]
            results = scored(run, jobs, "scores")
    except (budgets.BudgetSpent, Stalled) as err:
        err.rows = [{"key": key, "result": _encoded(finished[key][0]),
                     "cause": finished[key][1]} for key in dict.fromkeys([*(kept or {}), *keep])]
        raise
    scored: dict[int, object] = {}  # row -> its Scores (or None: cannot judge) or its cause
    for (kind, *_), members, (result, cause) in zip(jobs, groups.values(), results):
        for n, i in enumerate(members):
            scored[i] = cause if cause is not None else result[n] if kind == "group" else result
    scores, causes = [], []
    for i, row in enumerate(rows):
        cause = row["error"] or set_aside.get((row["environment"], row["task_id"]))
        if cause is None and isinstance(scored[i], str):
            cause = scored[i]
        scores.append(None if cause is not None else scored[i])
        causes.append(cause)
    rated = with_feedback(rows, scores, feedback or {})
    weight = config.weights[FEEDBACK]
    names = list(dict.fromkeys(n for components in scores for n in components or {}))
    reward = [None if c is None else mixed(c, weight) for c in scores]
    correct = [None if c is None else float(contract.full_marks(
        {k: v for k, v in c.items() if k != FEEDBACK})) for c in scores]
    errors = sum(c is not None and not c.startswith("task set aside") for c in causes)
    unjudged = sum(s is None and c is None for s, c in zip(scores, causes))
    if rows and all(c is not None for c in causes):
        raise VerifierBroken(f"no rollout could be scored: {errors} errors, {len(set_aside)} "
                             f"tasks set aside, e.g. {causes[0]}; fix the environment before "
                             f"training on its scores")
    check_errors(errors, sum(not c or not c.startswith("task set aside") for c in causes),
                 next((c for c in causes if c and not c.startswith("task set aside")), None),
                 config.max_error_fraction)
    verifier = {name: verifier_id(name, env) for name, env in envs.items()}
    hacks = [contract.suspected(c) or None for c in scores]
    judgments = [json.dumps(c.judgment, ensure_ascii=False) if getattr(c, "judgment", None)
                 else None for c in scores]
    # the rollout's own error column (a tool call that broke) becomes the reward's
    out = table.drop_columns(["error"]) \
        .append_column("correct", pa.array(correct, pa.float64())) \
        .append_column("reward", pa.array(reward, pa.float64())) \
        .append_column("verifier", pa.array([verifier[r["environment"]] for r in rows],
                                            pa.string())) \
        .append_column("error", pa.array(causes, pa.string())) \
        .append_column(contract.HACK_SUSPECTED, pa.array(hacks, pa.string()))
    if any(judgments):  # the judge's identity and reasoning, beside its score
        out = out.append_column("judgment", pa.array(judgments, pa.string()))
    for name in names:
        out = out.append_column(f"score_{name}", pa.array(
            [None if c is None else c.get(name) for c in scores], pa.float64()))
    mean = lambda values: round(sum(values) / len(values), 4) if values else 0.0  # noqa: E731

    def summary(indices: list[int]) -> dict:
        judged = [i for i in indices if reward[i] is not None]
        solved = {}
        for i in indices:
            key = (rows[i]["environment"], rows[i]["task_id"])
            if key not in set_aside:
                solved[key] = solved.get(key, False) or correct[i] == 1.0
        return {"episodes": len(indices), "judged": len(judged),
                "errors": sum(causes[i] is not None and not causes[i].startswith(
                    "task set aside") for i in indices),
                "tasks": len({(rows[i]["environment"], rows[i]["task_id"]) for i in indices}),
                "mean_reward": mean([reward[i] for i in judged]),
                "correct_episodes": int(sum(correct[i] for i in judged)),
                "pass_at_k": mean([float(v) for v in solved.values()]),
                contract.HACK_SUSPECTED: hack_counts([hacks[i] for i in indices])}

    every = list(range(len(rows)))
    return out, {**summary(every), **judge.spent(), "unjudgeable": unjudged, FEEDBACK: rated,
                 "tasks_set_aside": len(set_aside), "resumed_scores": len(kept or {}),
                 "components": {n: mean([c[n] for c in scores if c and n in c]) for n in names},
                 "environments": {name: {**summary([i for i in every
                                                    if rows[i]["environment"] == name]),
                                         "verifier": verifier[name]} for name in envs}}


def run(config: cfg.Reward, rollouts: Path, rewards: Path, specs: dict,
        root: Path | None = None, validated: Path | None = None,
        meter: budgets.Meter | None = None) -> dict:
    """Score every rollout; returns the stage metrics. `specs`: the `environments:` section (the
    user's modules, imported from `root`); `validated`: the validated traces, whose users'
    ratings become the `feedback` component (`trace_feedback`). `meter`: the cycle's budget,
    checked first and as the scores come in (`stages/budget.py`).
    """
    if meter is not None:
        meter.check("no episode scored yet", "every episode")
    root = root or Path.cwd()
    # scores a budget stop kept (beside the output, which DVC deletes before a run): a rerun
    # scores only the rest, and the table is the one an unstopped run writes
    partial = rewards.with_name(rewards.name + ".partial")
    key = _resume_key(specs, root)
    kept = _kept(partial, key)
    if kept:
        print(f"reward: {len(kept)} scores kept from a run a budget or a stall stopped",
              file=sys.stderr)
    try:
        out, metrics = score(specs, pq.read_table(rollouts), root, config,
                             trace_feedback(validated, config.feedback_score), meter, kept=kept)
    except (budgets.BudgetSpent, Stalled) as err:
        io.write_parquet(partial, pa.Table.from_pylist(err.rows, schema=PARTIAL)
                         .replace_schema_metadata({"offseason.resume": key}))
        raise type(err)(f"{err} ({len(err.rows)} finished scores are kept in {partial.name}; "
                        f"the rerun scores only the rest)") from err
    io.write_parquet(rewards, out)
    partial.unlink(missing_ok=True)
    return metrics


# what a budget stop keeps of the reward stage: each finished job's result and cause
PARTIAL = pa.schema([("key", pa.string()), ("result", pa.string()), ("cause", pa.string())])


def _job_key(job: tuple) -> str:
    """A scoring job's identity: its kind, environment, task and episode(s)."""
    return hashlib.sha256(json.dumps(job).encode()).hexdigest()


def _encoded(result) -> str:
    """A job's result (None, `Scores`, or a list of them) as JSON, its notes kept."""
    def one(scores):
        return None if scores is None else {"scores": dict(scores),
                                            "hack": contract.suspected(scores),
                                            "judgment": scores.judgment}
    return json.dumps([one(s) for s in result] if isinstance(result, list) else one(result))


def _decoded(text: str):
    """The result `_encoded` wrote."""
    def one(data):
        if data is None:
            return None
        scores = contract.Scores.of(data["scores"], data["hack"])
        if data["judgment"]:
            scores.judgment = data["judgment"]
        return scores
    data = json.loads(text)
    return [one(d) for d in data] if isinstance(data, list) else one(data)


def _resume_key(specs: dict, root: Path) -> str:
    """What kept scores must have been made with: the `environments:` section and each module's
    own file (a change of either: nothing kept is reused).
    """
    digest = hashlib.sha256(repr(sorted((n, repr(s)) for n, s in specs.items())).encode())
    for name, spec in sorted(specs.items()):
        source = contract.load(name, spec.module, root).source
        digest.update(Path(source).read_bytes() if source else b"")
    return digest.hexdigest()[:24]


def _kept(partial: Path, key: str) -> dict:
    """{job key: (result, cause)} a budget stop kept under `key`; none when the file is missing
    or was written for other environments (then it is removed).
    """
    if not partial.exists():
        return {}
    table = pq.read_table(partial)
    if (table.schema.metadata or {}).get(b"offseason.resume", b"").decode() != key:
        partial.unlink()
        return {}
    return {r["key"]: (_decoded(r["result"]), r["cause"]) for r in table.to_pylist()}


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) < 1e-12)


def rescore(config: cfg.Reward, rewards: Path, out: Path, specs: dict,
            everything: bool = False, root: Path | None = None) -> dict:
    """Re-score stored rewards whose verifier version is not the current one (all with
    `everything`); writes the result to `out` and returns a summary of what changed. Each row is
    scored by its own environment's current verifier (`specs`, the `environments:` section, the
    modules under `root`); a `feedback` component the row had is kept.
    """
    table = pq.read_table(rewards)
    missing = [c for c in ("task_id", "environment", "task", "messages")
               if c not in table.schema.names]
    if missing:
        raise ValueError(f"{rewards}: not a rollouts or rewards table (no {', '.join(missing)} "
                         f"column); give the data/rewards.parquet or data/rollouts.parquet of a "
                         f"cycle (a table of the retired tag protocol has question and "
                         f"completion columns instead: it cannot be re-scored)")
    old_names = [n for n in table.schema.names
                 if n in COLUMNS or n.startswith("score_") or n == "judgment"]
    old = {n: table.column(n).to_pylist() for n in old_names}
    rollouts = table.drop_columns(old_names)
    before = old.get("verifier", [None] * len(table))
    envs = {name: contract.load(name, spec.module, root or Path.cwd())
            for name, spec in specs.items()}
    ids = {name: verifier_id(name, env) for name, env in envs.items()}
    now = [ids.get(name) for name in table.column("environment").to_pylist()]
    current = ", ".join(sorted(set(filter(None, now)))) or "none"
    # the rollout's error goes back in; the reward stage's own causes are decided again
    errors = old.get("error", [None] * len(table))
    rollouts = rollouts.append_column("error", pa.array(
        [rollout_error(e) for e in errors] if "verifier" in old else errors, pa.string()))
    stale = [i for i, v in enumerate(before) if everything or v != now[i]]
    new_cols = {}
    if stale:
        # the users' ratings the rows had: the same component for the same answer
        rows, kept = rollouts.take(stale).to_pylist(), old.get(f"score_{FEEDBACK}")
        feedback = {}
        for i, row in zip(stale, rows):
            if kept and kept[i] is not None:
                last = (json.loads(row["messages"]) or [{}])[-1]
                feedback[row["task_id"].partition(":trace:")[2]] = (
                    kept[i], contract.text_of(last.get("content")))
        scored, _ = score(specs, rollouts.take(stale), root or Path.cwd(), config, feedback)
        new_cols = {n: scored.column(n).to_pylist() for n in scored.schema.names
                    if n in COLUMNS or n.startswith("score_") or n == "judgment"}
    rollouts = rollouts.drop_columns(["error"])
    names = list(dict.fromkeys([*COLUMNS, *(["judgment"] if "judgment" in {*old, *new_cols}
                                            else []),
                                *[n for n in new_cols if n.startswith("score_")],
                                *[n for n in old_names if n.startswith("score_")]]))
    merged = {n: list(old.get(n, [None] * len(table))) for n in names}
    for j, i in enumerate(stale):
        for n in names:
            merged[n][i] = new_cols[n][j] if n in new_cols else None
    result = rollouts
    for n in names:
        kind = pa.string() if n in ("verifier", "error", "judgment", contract.HACK_SUSPECTED) \
            else pa.float64()
        result = result.append_column(n, pa.array(merged[n], kind))
    io.write_parquet(out, result)
    old_reward = old.get("reward", [None] * len(table))
    old_correct = old.get("correct", [None] * len(table))
    changed = [i for i in stale if not _same(old_reward[i], merged["reward"][i])]
    judged = lambda values: [v for v in values if v is not None]  # noqa: E731
    mean = lambda values: round(sum(values) / len(values), 4) if values else None  # noqa: E731
    from_versions = {}
    for i in stale:
        from_versions[str(before[i])] = from_versions.get(str(before[i]), 0) + 1
    return {"input": str(rewards), "output": str(out), "rows": len(table),
            "rescored": len(stale), "verifier": current, "from_verifiers": from_versions,
            "changed": len(changed),
            "became_correct": sum(merged["correct"][i] == 1.0 and old_correct[i] != 1.0
                                  for i in changed),
            "became_incorrect": sum(merged["correct"][i] != 1.0 and old_correct[i] == 1.0
                                    for i in changed),
            "mean_reward_before": mean(judged(old_reward)),
            "mean_reward_after": mean(judged(merged["reward"])),
            "examples": [{"task_id": table.column("task_id")[i].as_py(),
                          "sample": table.column("sample")[i].as_py()
                          if "sample" in table.schema.names else None,
                          "reward_before": old_reward[i], "reward_after": merged["reward"][i],
                          "error": merged["error"][i]} for i in changed[:5]]}


def main(argv: list[str] | None = None) -> None:
    """Score the rollouts (the DVC stage's command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("rollouts", "rewards", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--judgments", type=Path, default=None,
                        help="where the LLM judge keeps its paid judgments (a persistent output)")
    parser.add_argument("--validated", type=Path, default=None,
                        help="the validated traces: their users' ratings become `feedback`")
    args = parser.parse_args(argv)
    io.watch_gpus()  # per GPU busy seconds, peak memory (the cost ledger); none: nothing
    if args.judgments is not None:
        args.judgments.mkdir(parents=True, exist_ok=True)  # an output, judged or not
        judge.use_cache(args.judgments)
    try:
        metrics = run(cfg.load("reward", args.params), args.rollouts, args.rewards,
                      cfg.environments(args.params), Path(args.params).resolve().parent,
                      args.validated, budgets.Meter.of("reward", args.params))
    # a broken verifier, an absent cluster, a spent judge budget
    except (VerifierBroken, ConnectionError, judge.JudgeBudget) as err:
        print(f"reward: error: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        judge.stop_servers()  # a judge server the stage started (runtime.judge.server_command)
    metrics["runtime"] = cfg.runtime_of(cfg.load("reward", args.params))  # what ran where
    judged = cfg.load("judge", args.params)
    if judged.model:  # and where the judge ran
        metrics["runtime"]["judge"] = cfg.runtime_of(judged)
    io.write_metrics(args.metrics, metrics)
    print(f"reward: mean {metrics['mean_reward']} over {metrics['judged']} judged episodes, "
          f"pass@k {metrics['pass_at_k']}, {metrics['errors']} errors, "
          f"{metrics['tasks_set_aside']} tasks set aside", file=sys.stderr)


if __name__ == "__main__":
    with budgets.stops_cleanly("reward"), io.explained("reward"):
        main()
    io.exit_soon()
