"""Reward: the environment's verifier scores each rollout, component by component.

Reads `data/rollouts.parquet`; writes `data/rewards.parquet` (every rollout column plus `correct`,
`reward`, `verifier`, `error`, one `score_<component>` column per reward component and
`hack_suspected`, the verifier's note of a likely reward hack) and `metrics/reward.json` (with the
`hack_suspected` episodes counted per reason).

- A verifier's `score()` returns its components, or None ("cannot judge": counted, left out of
  the reward). One that raises is an error: its cause goes to the `error` column and is counted,
  never turned into a zero. If every rollout errors, the stage fails.
- Before scoring, each task's gold completion (`env.gold`) must score full marks on every
  component, or the task is set aside (its rollouts get no reward; the reason is in `error`) and
  counted.
- `reward = sum(reward.weights[c] * component c)` over the components every environment has
  (correct, format, tool_ok); the others are kept as columns. `verifier` records the environment
  and its verifier's version (`arith/exact-match@2`), so `rescore` can re-score stored rollouts
  after the verifier changed.
- Fan-out: `runtime.reward.workers` local processes (0 = one per core, 1 = in this process), or the Ray
  cluster at `runtime.reward.ray_address` (`auto` or `host:port`; its workers need offseason installed,
  as any Ray job's dependencies). Same results, in the same order, either way.

With an `environments:` section the rollouts are chat episodes of the user's modules, scored by
each one's own `reward` in this process (`score_chat`), or its `reward_group` over all samples of
a task at once: the reward is the mean of its components, full marks in every one is `correct`,
`verifier` is `<environment>/<VERSION>`. A reward that calls the LLM judge (`stages/envs/judge.py`)
adds a `judgment` column (the judge and its reasoning) and `judges` metrics (requests, tokens,
cache hits, failures by kind); its paid judgments persist in `--judgments` (data/judgments), and a
spent judge budget stops the stage.

Feedback as a reward (the `environments:` path): `--validated` (data/validated.parquet) holds the
production traces with their users' feedback. A trace's rating (thumbs up 1.0, down 0.0, else the
`feedback.scores` entry `reward.feedback_score` names, in [0, 1]) is about production's answer, so
an episode of that trace's task (task id `<environment>:trace:<trace id>`) whose final answer is
production's (whitespace and case aside) gets the rating as its `feedback` component
(`score_feedback`); any other episode, and any task without a rated trace, has no such component
(absent, never 0). The reward is then the weighted mean of the components present: each of the
environment's weighs 1, `feedback` weighs `reward.weights.feedback` (default 0: recorded, not
mixed in), renormalised, so an episode without feedback keeps its environment's mean. `correct`
stays the environment's verdict (full marks in its own components): a rating is not a verifier.
The metrics' `feedback` counts the rated traces, the episodes rated and those that answered
otherwise. The tag protocol (`environments: {}`) has no feedback component.

    python -m stages.reward data/rollouts.parquet data/rewards.parquet metrics/reward.json \
        --judgments data/judgments --validated data/validated.parquet
    offseason rescore [data/rewards.parquet] [--output data/rescored.parquet]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import budget as budgets
from stages import config as cfg
from stages import io, remote
from stages.envs import contract
from stages.envs.registry import COMPONENTS, ENVIRONMENTS, score_chunk

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
    import json

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
    import json

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


def verifier_id(env) -> str:
    """The verifier's id, `<environment>/<version>`, recorded with each reward."""
    return f"{env.NAME}/{env.VERSION}"


def chat_verifier(name: str, env) -> str:
    """An `environments:` entry's verifier id, `<name>/<VERSION>` (the module where it has none),
    recorded with each of its rewards.
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


def _chunks(jobs: list, parts: int) -> list[list]:
    size = max(1, -(-len(jobs) // parts))
    return [jobs[i:i + size] for i in range(0, len(jobs), size)]


def probe_ray(address: str, timeout: float | None = None) -> None:
    """Fail within the probe's deadline, naming the setting, when nothing answers at a
    `host:port` Ray address, whether nothing listens or a listener never answers
    (`stages.remote`: Ray's GCS is a gRPC server); `ray.init` would otherwise retry for minutes,
    printing "Failed to get cluster ID". "auto" is left to Ray.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    remote.probe(address, setting="runtime.reward.ray_address", kind="grpc", timeout=timeout,
                 fix="start the cluster (`ray start --head`), fix the address, or set "
                     "runtime.reward.ray_address to '' for the local process pool")


@contextmanager
def verifier_pool(workers: int = 0, ray_address: str = ""):
    """(map, parts): `map(env_name, chunks)` yields score_chunk's result for each chunk, in order,
    on the Ray cluster at `ray_address`, in this process (`workers` 1) or in a local process pool
    of `workers` (0 = one per core); `parts` is how many chunks keep it busy.
    """
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
                    f"to '' for the local process pool") from err
        try:
            remote = ray.remote(score_chunk)
            # submitted all at once, collected in submission order: the order of the jobs
            yield (lambda env_name, chunks: (ray.get(ref) for ref in
                                             [remote.remote(env_name, c) for c in chunks]),
                   max(1, int(ray.cluster_resources().get("CPU", 1))) * 4)
        finally:
            if connect:
                ray.shutdown()
        return
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        yield (lambda env_name, chunks: (score_chunk(env_name, c) for c in chunks)), 10
        return
    # spawn: a fresh interpreter per worker, safe whatever threads this process runs
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield (lambda env_name, chunks: pool.map(score_chunk, [env_name] * len(chunks), chunks),
               workers * 4)


def fan_out(env_name: str, jobs: list[tuple], pool, progress: bool = True
            ) -> list[tuple[dict | None, str | None]]:
    """score_job over every job on a verifier_pool, results in the order of the jobs."""
    mapper, parts = pool
    started, results = time.time(), []
    for chunk in mapper(env_name, _chunks(jobs, parts)):
        results.extend(chunk)
        if progress:
            rate = len(results) / max(time.time() - started, 1e-9)
            print(f"reward: {len(results)}/{len(jobs)} verified ({rate:.0f}/s)", file=sys.stderr,
                  flush=True)
    return results


def _full_marks(components: dict | None) -> bool:
    return components is not None and all(value == 1.0 for value in components.values())


def _set_aside(tasks: dict, gold: list) -> tuple[dict[str, str], set[str]]:
    """{task id: why it is set aside}, and the tasks whose gold check raised."""
    set_aside, gold_errors = {}, set()
    for task_id, (components, cause) in zip(tasks, gold):
        if cause is not None:
            set_aside[task_id] = f"verifier raised on the gold completion: {cause}"
            gold_errors.add(task_id)
        elif components is None:
            set_aside[task_id] = "task set aside: the verifier cannot judge its gold completion"
        elif not _full_marks(components):
            set_aside[task_id] = f"task set aside: its gold completion scores {components}, " \
                                 f"not full marks"
    return set_aside, gold_errors


def score_table(env_name: str, config: cfg.Reward, table: pa.Table, progress: bool = True
                ) -> tuple[pa.Table, dict]:
    """The rollouts with the reward columns appended, and the metrics."""
    env = ENVIRONMENTS[env_name]
    rows = table.select(["task_id", "question", "answer", "completion"]).to_pylist()
    tasks = {}
    for row in rows:
        tasks.setdefault(row["task_id"], (row["question"], row["answer"]))
    # Before scoring: each task's gold completion must score full marks, or it is set aside.
    with verifier_pool(config.workers, config.ray_address) as pool:
        gold = fan_out(env_name, [(q, a, None) for q, a in tasks.values()], pool, progress=False)
        set_aside, gold_errors = _set_aside(tasks, gold)
        todo = [i for i, row in enumerate(rows) if row["task_id"] not in set_aside]
        scored = dict(zip(todo, fan_out(
            env_name, [(rows[i]["question"], rows[i]["answer"], rows[i]["completion"])
                       for i in todo], pool, progress)))
    names = list(COMPONENTS)
    for components, _ in scored.values():
        names += [n for n in components or {} if n not in names]
    columns = {name: [] for name in ("correct", "reward", "error")}
    parts = {name: [] for name in names}
    unjudged = errors = 0
    for i, row in enumerate(rows):
        components, cause = scored.get(i, (None, set_aside.get(row["task_id"])))
        errors += cause is not None and (i in scored or row["task_id"] in gold_errors)
        unjudged += i in scored and cause is None and components is None
        columns["correct"].append(None if components is None else components["correct"])
        columns["reward"].append(None if components is None else
                                 sum(config.weights[c] * components[c] for c in COMPONENTS))
        columns["error"].append(cause)
        for name in names:
            parts[name].append(None if components is None else components.get(name))
    judged = [i for i, r in enumerate(columns["reward"]) if r is not None]
    if rows and not judged and unjudged == 0:
        example = next(e for e in columns["error"] if e)
        raise VerifierBroken(
            f"the {env_name} verifier ({verifier_id(env)}) scored none of {len(rows)} rollouts: "
            f"{errors} errors, {len(set_aside)} of {len(tasks)} tasks set aside, e.g. {example}; "
            f"fix the verifier (or its tasks) before training on its scores")
    # the rows scored, and those of tasks whose gold the verifier raised on (set aside, erred)
    tried = [i for i, row in enumerate(rows) if i in scored or row["task_id"] in gold_errors]
    failed = [columns["error"][i] for i in tried if columns["error"][i]]
    check_errors(len(failed), len(tried), failed[0] if failed else None,
                 config.max_error_fraction)
    out = table
    for name in ("correct", "reward"):
        out = out.append_column(name, pa.array(columns[name], pa.float64()))
    hacks = [contract.suspected(scored.get(i, (None, None))[0]) or None for i in range(len(rows))]
    out = out.append_column("verifier", pa.array([verifier_id(env)] * len(rows), pa.string())) \
        .append_column("error", pa.array(columns["error"], pa.string())) \
        .append_column(contract.HACK_SUSPECTED, pa.array(hacks, pa.string()))
    for name in names:
        out = out.append_column(f"score_{name}", pa.array(parts[name], pa.float64()))
    solved = {}
    for i, row in enumerate(rows):
        if row["task_id"] not in set_aside:
            solved[row["task_id"]] = solved.get(row["task_id"], False) \
                or columns["correct"][i] == 1.0
    mean = lambda values: round(sum(values) / len(values), 4) if values else 0.0  # noqa: E731
    metrics = {"episodes": len(rows), "judged": len(judged), "unjudgeable": unjudged,
               "errors": errors, "tasks": len(tasks), "tasks_set_aside": len(set_aside),
               "episodes_set_aside": sum(row["task_id"] in set_aside for row in rows),
               "verifier": verifier_id(env),
               "mean_reward": mean([columns["reward"][i] for i in judged]),
               "correct_episodes": int(sum(columns["correct"][i] for i in judged)),
               "pass_at_k": mean([float(s) for s in solved.values()]),
               "components": {name: mean([parts[name][i] for i in judged
                                          if parts[name][i] is not None]) for name in names},
               contract.HACK_SUSPECTED: hack_counts(hacks)}
    return out, metrics


def hack_counts(notes: list[str | None]) -> dict:
    """How many episodes a verifier suspected of a reward hack, and how many per reason (the
    sandbox's notes name what the code touched: `imported unittest`, `replaced builtins` ...).
    """
    reasons: dict[str, int] = {}
    for note in filter(None, notes):
        reasons[note] = reasons.get(note, 0) + 1
    return {"episodes": sum(reasons.values()), "reasons": dict(sorted(reasons.items()))}


def score_chat(specs: dict, table: pa.Table, root: Path, config: cfg.Reward | None = None,
               feedback: dict | None = None, meter: budgets.Meter | None = None
               ) -> tuple[pa.Table, dict]:
    """Chat rollouts (an `environments:` section) scored by each environment's own `reward`.

    The reward is the mean of the module's components (a float is its one component); `correct`
    is 1.0 when every component reaches 1.0 (full marks, as a gold must score). A task whose
    `gold` does not score full marks is set aside; a `reward` that raises, or an episode whose
    tool call broke at rollout, is an error with its cause, never a zero. `feedback`: the
    traces' ratings (`trace_feedback`), added as the `feedback` component where an episode of
    a trace's task gave production's rated answer (`with_feedback`).
    """
    import json

    envs = {name: contract.load(name, spec.module, root) for name, spec in specs.items()}
    rows = table.select(["task_id", "environment", "task", "messages", "error"]).to_pylist()
    unknown = sorted({r["environment"] for r in rows} - set(envs))
    if unknown:
        raise cfg.ParamsError(f"environments: the rollouts come from {', '.join(unknown)}, which "
                              f"params.yaml no longer lists; rerun the rollout stage")
    set_aside, checked = {}, set()  # each task's gold is checked once
    for row in rows:
        key = (row["environment"], row["task_id"])
        if key in checked or row["error"]:
            continue
        checked.add(key)
        try:
            contract.check_gold(envs[key[0]], json.loads(row["task"]))
        except contract.GoldError as err:
            set_aside[key] = f"task set aside: {err}"
        except Exception as err:  # the reward itself broke on the gold
            set_aside[key] = f"reward() raised on the gold: {type(err).__name__}: {err}"
    from stages.envs.judge import JudgeBudget
    from stages.remote import RemoteDown

    # an environment with reward_group scores all samples of a task at once (a relative judge)
    grouped: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        if envs[row["environment"]].reward_group is not None and not row["error"] and \
                (row["environment"], row["task_id"]) not in set_aside:
            grouped.setdefault((row["environment"], row["task_id"]), []).append(i)
    group_scores: dict[int, object] = {}
    for (name, _), members in grouped.items():
        env = envs[name]
        try:
            results = env.reward_group(json.loads(rows[members[0]]["task"]),
                                       [json.loads(rows[i]["messages"]) for i in members])
            if not isinstance(results, list) or len(results) != len(members):
                raise contract.VerifierError(
                    f"{env.where}: reward_group() returned {type(results).__name__} for "
                    f"{len(members)} episodes; return a list with one result per episode")
            for i, result in zip(members, results):
                group_scores[i] = contract.normalize(env, result)
        except (JudgeBudget, RemoteDown):  # a spent budget, a judge that is down: stop
            raise
        except Exception as err:  # a broken reward: its cause, never a zero
            for i in members:
                group_scores[i] = f"{env.where}: reward_group() raised {type(err).__name__}: {err}"
    scores, causes = [], []
    for i, row in enumerate(rows):
        env, key = envs[row["environment"]], (row["environment"], row["task_id"])
        cause = row["error"] or set_aside.get(key)
        if cause is None and i in group_scores:
            if isinstance(group_scores[i], str):
                cause = group_scores[i]
            else:
                scores.append(group_scores[i])
        elif cause is None:
            if meter is not None:  # the judge's paid judgments are cached: a rerun reuses them
                from stages.envs import judge

                meter.check(f"{i} of {len(rows)} episodes scored", f"{len(rows) - i} episodes",
                            judge_tokens=sum(j.tokens for j in judge.used()))
            try:
                scores.append(contract.score(env, json.loads(row["task"]),
                                             json.loads(row["messages"])))
            except (JudgeBudget, RemoteDown):  # a spent budget, a judge that is down: stop
                raise
            except Exception as err:  # a broken reward: its cause, never a zero
                cause = f"{env.where}: reward() raised {type(err).__name__}: {err}"
        if cause is not None:
            scores.append(None)
        causes.append(cause)
    rated = with_feedback(rows, scores, feedback or {})
    weight = (config or cfg.Reward()).weights[FEEDBACK]
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
                 (config or cfg.Reward()).max_error_fraction)
    verifier = {name: chat_verifier(name, env) for name, env in envs.items()}
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
    from stages.envs import judge

    return out, {**summary(every), **judge.spent(), "unjudgeable": unjudged, FEEDBACK: rated,
                 "tasks_set_aside": len(set_aside),
                 "components": {n: mean([c[n] for c in scores if c and n in c]) for n in names},
                 "environments": {name: {**summary([i for i in every
                                                    if rows[i]["environment"] == name]),
                                         "verifier": verifier[name]} for name in envs}}


def run(base: cfg.Base, config: cfg.Reward, rollouts: Path, rewards: Path,
        specs: dict | None = None, root: Path | None = None,
        validated: Path | None = None, meter: budgets.Meter | None = None) -> dict:
    """Score every rollout; returns the stage metrics. `specs`: the `environments:` section
    (chat rollouts, scored by the user's modules, imported from `root`); `validated`: the
    validated traces, whose users' ratings become the `feedback` component (`trace_feedback`).
    `meter`: the cycle's budget, checked first and before each episode a judge may score
    (`stages/budget.py`).
    """
    if meter is not None:
        meter.check("no episode scored yet", "every episode")
    if specs:
        out, metrics = score_chat(specs, pq.read_table(rollouts), root or Path.cwd(), config,
                                  trace_feedback(validated, config.feedback_score), meter)
        io.write_parquet(rewards, out)
        return metrics
    out, metrics = score_table(base.environment, config, pq.read_table(rollouts))
    io.write_parquet(rewards, out)
    return metrics


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) < 1e-12)


def rescore(base: cfg.Base, config: cfg.Reward, rewards: Path, out: Path,
            everything: bool = False, specs: dict | None = None, root: Path | None = None
            ) -> dict:
    """Re-score stored rewards whose verifier version is not the current one (all with
    `everything`); writes the result to `out` and returns a summary of what changed. `specs`:
    the `environments:` section (chat rows, scored by the modules under `root`, each row by its
    own environment's verifier; a `feedback` component the row had is kept).
    """
    import json

    table = pq.read_table(rewards)
    needed = ("task_id", "environment", "task", "messages") if specs else \
        ("task_id", "question", "answer", "completion")
    missing = [c for c in needed if c not in table.schema.names]
    if missing:
        kind = "chat " if specs else ""
        raise ValueError(f"{rewards}: not a {kind}rollouts or rewards table (no "
                         f"{', '.join(missing)} column); give the data/rewards.parquet or "
                         f"data/rollouts.parquet of a cycle run with these params"
                         + (" (params.yaml has `environments:`: the chat path)" if specs else ""))
    old_names = [n for n in table.schema.names
                 if n in COLUMNS or n.startswith("score_") or n == "judgment"]
    old = {n: table.column(n).to_pylist() for n in old_names}
    rollouts = table.drop_columns(old_names)
    before = old.get("verifier", [None] * len(table))
    if specs:
        envs = {name: contract.load(name, spec.module, root or Path.cwd())
                for name, spec in specs.items()}
        ids = {name: chat_verifier(name, env) for name, env in envs.items()}
        environment = table.column("environment").to_pylist()
        now = [ids.get(name) for name in environment]
        current = ", ".join(sorted(set(filter(None, now)))) or "none"
        # the rollout's error goes back in; the reward stage's own causes are decided again
        errors = old.get("error", [None] * len(table))
        rollouts = rollouts.append_column("error", pa.array(
            [rollout_error(e) for e in errors] if "verifier" in old else errors, pa.string()))
    else:
        now = [verifier_id(ENVIRONMENTS[base.environment])] * len(table)
        current = now[0] if now else verifier_id(ENVIRONMENTS[base.environment])
    stale = [i for i, v in enumerate(before) if everything or v != now[i]]
    new_cols = {}
    if stale and specs:
        # the users' ratings the rows had: the same component for the same answer
        rows, kept = rollouts.take(stale).to_pylist(), old.get(f"score_{FEEDBACK}")
        feedback = {}
        for i, row in zip(stale, rows):
            if kept and kept[i] is not None:
                last = (json.loads(row["messages"]) or [{}])[-1]
                feedback[row["task_id"].partition(":trace:")[2]] = (
                    kept[i], contract.text_of(last.get("content")))
        scored, _ = score_chat(specs, rollouts.take(stale), root or Path.cwd(), config, feedback)
    elif stale:
        scored, _ = score_table(base.environment, config, rollouts.take(stale))
    if stale:
        new_cols = {n: scored.column(n).to_pylist() for n in scored.schema.names
                    if n in COLUMNS or n.startswith("score_") or n == "judgment"}
    if specs:
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
    from stages.envs import judge

    if args.judgments is not None:
        args.judgments.mkdir(parents=True, exist_ok=True)  # an output, judged or not
        judge.use_cache(args.judgments)
    try:
        metrics = run(cfg.load("base", args.params), cfg.load("reward", args.params),
                      args.rollouts, args.rewards, cfg.environments(args.params),
                      Path(args.params).resolve().parent, args.validated,
                      budgets.Meter.of("reward", args.params))
    except (VerifierBroken, ConnectionError) as err:  # a broken verifier, an absent cluster
        print(f"reward: error: {err}", file=sys.stderr)
        sys.exit(1)
    except Exception as err:
        from stages.envs.judge import JudgeBudget

        if not isinstance(err, JudgeBudget):
            raise
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
