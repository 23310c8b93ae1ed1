"""offseason: keep an agent improving after it ships, one versioned cycle at a time.

    offseason init        create generation 0, the first champion (demo warm start or --base-model)
    offseason simulate    write one day of production-like traces to data/inbox/ (the demo's traffic)
    offseason run         run one cycle: ingest, validate, rollout, reward, train, gate, promote
    offseason history     one row per generation: scores, verdict, the champion
    offseason pending     cycles waiting for approval; `approve` / `reject RUN_ID --reason ...`
    offseason rollback    make an earlier generation the champion again (--to gen-N --reason ...)
    offseason fleet       the servers that answer users: status, push the champion, judge a canary
    offseason estimate    what the next cycle will cost (units, dollars, a range), before running it
    offseason demo        init (if needed), then simulate + run three times, then the history
    offseason check       check params.yaml, print it with every default filled in; --explain: every key
    offseason rescore     re-score stored rollouts after the verifier changed (a new VERSION)
    offseason benchmark   benchmark upkeep: `benchmark refresh` swaps worn items for held-out traces
    offseason ui          the Prefect and MLflow UIs of this workspace, on 127.0.0.1
    offseason serve       run the scheduled and manual deployments of params.yaml's `deployments:`
    offseason lineage     a generation's whole chain, back to its traces; --verify, --trace
    offseason report      a static HTML page: scores, rewards, quarantine, a lineage graph
    offseason collect     receive spans and log events over OTLP/HTTP (port 4318) into data/inbox/
    offseason pull        pull traces from Langfuse or LangSmith into data/inbox/ (--since last-cycle)

Run from the project folder (where dvc.yaml is). Each command's --help says more.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import uuid
from pathlib import Path

import yaml

from flows.project import params as settings
from flows.project.workspace import (
    COLLECT_SPOOL,
    ENVIRONMENT_SOURCES,
    USER_PATH,
    WorkspaceError,
    configure_env,
    cycle_inputs,
    cycle_lock,
    dvc,
    find_root,
    generations,
    git,
    inputs_fingerprint,
    note_children,
    note_environments,
    read_at,
    stage_args,
    uncommitted,
)
from stages import config as cfg


def workspace(*, env: bool = True) -> tuple[Path, dict]:
    """Every command's first step: the project folder (found from the current directory), its
    environment set up (telemetry off, MLflow's and Prefect's local defaults; `env=False` for
    commands that start no library that reads it) and params.yaml checked, every section typed.
    """
    root = find_root()
    if env:
        configure_env(root)
    return root, settings.load_all(root / "params.yaml")


def inbox_path(root: Path) -> Path:
    """The inbox, as the ingest stage in dvc.yaml names it."""
    return root / stage_args(root, "ingest").inbox


def days(text: str) -> int:
    """`--days`: a whole number of days, at least 1 (0 or -3 wrote nothing and said nothing)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of days, 1 or more")
    return value


def cmd_init(args) -> int:
    """`offseason init`: generation 0 (built and warm-started, or --base-model), registered,
    committed, tagged.
    """
    root, configs = workspace()
    if (root / "models" / "champion.dvc").exists() and not args.force:
        print(f"already initialised: {root / 'models/champion.dvc'} exists (generation 0 was "
              f"made). Run `offseason run` for a cycle, or `offseason init --force` to start over.")
        return 0
    # what can be wrong with the inputs is checked before torch, transformers and MLflow load
    # (seconds): a bad benchmark or params key fails at once
    from stages.envs import arith, contract

    specs = configs["environments"]
    base_model = args.base_model or (Path(configs["base"].model) if configs["base"].model
                                     else None)
    demo = False  # the demo's own tiny chat model as generation 0
    if base_model is None:
        demo = any(spec.module == arith.__name__ for spec in specs.values())
        if not demo:
            raise cfg.ParamsError(
                "base.model: your environments need your chat model as generation 0; set "
                "base.model to its Hugging Face folder (or run `offseason init --base-model "
                f"PATH`); only the demo's environment ({arith.__name__}) has a tiny model "
                "offseason can build")
    elif not base_model.is_absolute():
        base_model = root / base_model
    chats = contract.benchmark_suites(specs, root, configs["gate"].benchmark_size)

    def templates_of(folder: Path) -> list:
        """The model's chat template for each environment's tools; a folder without its
        files, or a model without a chat template, fails naming what to fix.
        """
        from stages import modelfiles

        modelfiles.check(folder)  # a missing file fails before torch loads (seconds)
        from stages import io

        with io.heavy_imports():  # torch and transformers
            from stages import tinylm
            from stages.generation import chat

        tokenizer = tinylm.load_tokenizer(folder)
        return [chat.Template.of(tokenizer, list(env.tools)) for env, _ in chats.values()]

    templates = []
    if base_model is not None and (base_model / "config.json").is_file():
        # checked before anything is written (a missing folder: init.run says so)
        templates = templates_of(base_model)
        if not all(t.prefix_preserving for t in templates):
            print(f"init: the chat template of {base_model} rewrites earlier turns once a "
                  f"conversation goes on (as Qwen3's drops old thinking); rollouts render "
                  f"each turn incrementally, so the tokens the model produced stay exact",
                  flush=True)
    from stages import io

    with io.heavy_imports():  # torch and transformers
        from stages import gate, init

    with cycle_lock(root, "offseason init"):
        later = [g for g in generations(root) if g >= 1] if args.force else []
        if later:  # their tags stay: lineage audits follow them
            print(f"init: note: gen-{later[0]}..gen-{later[-1]} of the earlier lineage stay "
                  f"tagged (history, lineage and the report still list them, made from the gen-0 "
                  f"this replaces); the next cycle is gen-{later[-1] + 1}", flush=True)
        print("init: building generation 0 ...", flush=True)
        note_environments(root)  # what the stages' dep data/environments.json says
        champion = root / "models" / "champion"
        metrics = init.run(configs["base"], configs["init"], champion, base_model)
        scores = gate.score(champion, chats, configs["rollout"], configs["base"].seed)
        if demo:  # the demo's model exists only now
            templates = templates_of(champion)
        metrics["template"] = "prefix-preserving" if all(
            t.prefix_preserving for t in templates) else "incremental"
        primary = [r for r in scores if r["suite"] == configs["gate"].primary]
        metrics["benchmark_score"] = round(sum(r["correct"] or 0.0 for r in primary)
                                           / len(primary), 4)
        metrics["benchmark_items"] = len(primary)
        metrics["benchmarks"] = {name: round(sum(r["correct"] or 0.0 for r in scores
                                                 if r["suite"] == name) / len(tasks), 4)
                                 for name, (_, tasks) in chats.items()}
        io.write_json(root / "metrics" / "init.json", metrics)
        dvc(root, "add", "--quiet", "models/champion")

        with io.heavy_imports():  # only now: a model folder that does not load fails before it
            import mlflow

            from flows.orchestration import promotion
            from flows.project import tracking

        experiment_id = tracking.experiment(root)
        client = mlflow.MlflowClient()
        run = client.create_run(experiment_id, run_name="gen-0",
                                tags={"offseason.generation": "0", "offseason.stage": "init"})
        tracking.log_params(run.info.run_id, {s: dataclasses.asdict(configs[s])
                                              for s in ("base", "init")})
        for key, value in tracking.numeric(metrics).items():
            client.log_metric(run.info.run_id, key, value)
        name = configs["base"].registered_model
        version = tracking.register(champion, run.info.run_id, name,
                                    {"generation": 0, "source": metrics["source"]})
        record = {"generation": 0, "model_version": version, "promoted": True,
                  "champion_version": version, "reason": "generation 0 (offseason init)",
                  "candidate_score": metrics["benchmark_score"], "champion_score": None,
                  "inputs": inputs_fingerprint(root)}
        io.write_json(root / "metrics" / "promotion.json", record)
        entry = {"action": "init", "generation": 0, "model_version": version,
                 "champion_version": version, "champion_generation": 0,
                 "approver": promotion.who(), "reason": record["reason"], "decision": "init",
                 "gate_summary": f"benchmark pass@1 {metrics['benchmark_score']:.3f}",
                 "at": promotion.now()}
        promotion.append_log(root, entry)
        # the environments' modules, task and benchmark files it scored on, as the cycles do
        inputs = cycle_inputs(root)
        if (fresh := uncommitted(root, inputs)):
            print(f"init: committed with gen-0, which read them (they were not in git as they "
                  f"are): {', '.join(fresh)}")
        git(root, "add", "--", "models/champion.dvc", "models/.gitignore", "metrics",
            "params.yaml", promotion.LOG, str(ENVIRONMENT_SOURCES), *inputs)
        git(root, "commit", "--quiet", "-m",
            f"gen-0: first champion ({metrics['source']}), benchmark pass@1 "
            f"{metrics['benchmark_score']:.3f}")
        git(root, "tag", "-f", "gen-0")
        dvc(root, "push", "--quiet")
        tracking.set_champion(name, version)
        promotion.tag_alias_change(name, version, entry)
        client.set_tag(run.info.run_id, "offseason.git_commit", git(root, "rev-parse", "HEAD"))
        client.set_terminated(run.info.run_id)
    print(f"init: generation 0 is the champion (MLflow model '{name}' version {version}, alias "
          f"'champion'; git tag gen-0); benchmark pass@1 {metrics['benchmark_score']:.3f}")
    print(f"init: {design_line(root, configs, {n: len(t) for n, (_, t) in chats.items()})}")
    return 0


def cmd_simulate(args) -> int:
    """`offseason simulate`: --days days of the demo's traffic into data/inbox/."""
    root, configs = workspace()
    if not (root / "models" / "champion").exists():
        raise WorkspaceError("no champion to answer the traffic; run `offseason init` first")
    from stages import io

    with io.heavy_imports():  # torch and transformers
        from stages import simulate

    for _ in range(args.days):
        out = simulate.run(configs["base"], configs["simulate"], root / "models" / "champion",
                           root / "data" / "inbox", configs["environments"], configs["rollout"],
                           root)
        print(f"simulate: day {out['day']}: {out['lines']} lines in {out['file']} (the champion "
              f"answered {out['champion_correct']:.1%} correctly)")
    return 0


def read_environment_benchmarks(root: Path, specs: dict) -> None:
    """Each environment's benchmark parses and has tasks, or fails naming the file and line,
    before any stage runs.
    """
    from stages.envs import contract

    for name, spec in specs.items():
        if spec.benchmark and not contract.load_tasks(root / spec.benchmark, name):
            raise contract.TaskFileError(
                f"{spec.benchmark}: the benchmark of environment {name!r} is empty; the gate "
                f"needs items to compare on: write held-out tasks into it")


def cmd_run(args) -> int:
    """`offseason run`: one cycle under the workspace's lock, the stages started before Prefect."""
    root = find_root()
    configure_env(root)
    from flows.audit.ui import temporary_prefect
    from flows.orchestration import pipeline
    from flows.project import notify

    if args.estimate:
        return cmd_estimate(args)
    session = pipeline.Session(root)  # DVC loads in it while the checks below run
    try:
        # fail before any stage (or Prefect) starts
        configs = settings.load_all(root / "params.yaml")
        read_environment_benchmarks(root, configs["environments"])
        with cycle_lock(root, "offseason run"):
            note_children(root, session.proc.pid, session.marker)
            # the estimate before anything runs: refused over budget, else kept for the ledger
            from flows.orchestration import cost

            guess = cost.estimate(root, configs)
            if (refusal := cost.budget_refusal(root, guess, configs["budget"])):
                raise WorkspaceError(refusal)
            cost.ESTIMATES[str(root.resolve())] = guess
            # repairs, checks and the no-change decision, before Prefect or MLflow load; when
            # there is work, the stages start here and run while Prefect's temporary server starts
            try:
                start = pipeline.begin(root, session)
            except Exception as err:  # before the flow, which notifies its own failures
                notify.cycle_failed(root, err)
                raise
            try:
                if start.status != "run":
                    result = {"message": start.message}
                    for line in start.recovered:
                        print(f"run: an unfinished promotion was undone: {line}", file=sys.stderr)
                else:
                    with temporary_prefect(root) as prefect_ready:
                        result = run_flow(root, start, prefect_ready)
            finally:
                start.close()
    except BaseException:
        session.close(kill=True)  # closed already, unless it failed before begin() took it
        raise
    print(f"run: {result['message']}")
    return 0


def cmd_estimate(args) -> int:
    """`offseason estimate` (and `run --estimate`): the next cycle's units and dollars."""
    root = find_root()
    from flows.orchestration import cost

    configs = settings.load_all(root / "params.yaml")
    guess = cost.estimate(root, configs)
    if getattr(args, "json", False):
        print(json.dumps(guess, indent=2))
        return 0
    print(cost.format_estimate(guess))
    budget = configs["budget"]
    if any(dataclasses.asdict(budget).values()):
        refusal = cost.budget_refusal(root, guess, budget)
        print("budget: " + ("over: `offseason run` would refuse this cycle: "
                            + refusal.split("; nothing was started")[0] if refusal
                            else f"within {dataclasses.asdict(budget)}"))
    return 0


def run_flow(root: Path, start, prefect_ready) -> dict:
    """The cycle flow, adopting the stages `start` set going."""
    import os

    from stages import io

    with io.heavy_imports():  # Prefect and MLflow (stages/io.py)
        from mlflow.exceptions import MlflowException

        from flows.audit.ui import on_temporary_prefect
        from flows.orchestration import pipeline
        from flows.orchestration.cycle import PROJECT_ENV, cycle
        from flows.project import notify

    pipeline.hand_over(root, start)
    try:
        prefect_ready()
    except Exception as err:  # the flow never started: it cannot notify
        notify.cycle_failed(root, err)
        raise
    heartbeats = contextlib.nullcontext()
    if on_temporary_prefect():
        # a flow run's heartbeats let a lasting server tell a crashed run; this server ends
        # with the process. Off, the run also ends at once: Prefect joins the heartbeat thread,
        # which sleeps in one-second steps
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        heartbeats = temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
    try:
        os.environ[PROJECT_ENV] = str(root)  # this checkout, whatever the shell had set
        with heartbeats:
            return cycle()
    except MlflowException as err:  # MLflow's client retried with backoff before this
        from flows.project import tracking

        raise WorkspaceError(tracking.not_answering(root, err)) from None
    finally:
        pipeline.adopt(root)  # not adopted (the flow failed to start): start.close() stops it


def history_rows(root: Path) -> list[dict]:
    """One row per generation (git tag gen-N) from its committed metrics and the promotion log."""
    from flows.audit.lineage import approver_of

    rows, committed = [], []  # committed: each generation's commit time (ISO)
    for generation in generations(root):
        tag = f"gen-{generation}"
        promotion = read_at(root, tag, "metrics/promotion.json") or {}
        if generation == 0:
            init = read_at(root, tag, "metrics/init.json") or {}
            score, champ, interval, traces = init.get("benchmark_score"), None, None, None
            verdict = "initial"
        else:
            gate = read_at(root, tag, "metrics/gate.json") or {}
            ingest = read_at(root, tag, "metrics/ingest.json") or {}
            score, champ = gate.get("candidate_score"), gate.get("champion_score")
            interval, traces = gate.get("interval"), ingest.get("accepted")
            # who said no: the gate (rejected), a person (declined), or nobody in time
            decided = (promotion.get("decision") or {}).get("decision")
            verdict = "promoted" if promotion.get("promoted") else \
                {"rejected": "declined", "timeout": "timed out"}.get(decided, "rejected")
        committed.append(git(root, "log", "-1", "--format=%cI", tag))  # the date; rollbacks
        ledger = read_at(root, tag, "metrics/cost.json") or {}
        if (ledger.get("stages") or {}).get("ingest", {}).get("reused"):
            traces = 0  # ingest did not run (a cycle for a changed module): its metrics are old
        spent = ledger.get("total") or {}
        rows.append({"tag": tag, "date": committed[-1][:10], "new_traces": traces, "score": score,
                     "cost_usd": spent.get("usd"), "cpu_seconds": spent.get("cpu_seconds"),
                     "champion_score": champ, "difference_interval": interval,
                     "verdict": verdict, "model_version": promotion.get("model_version"),
                     "promoted": promotion.get("promoted", False),
                     "approver": approver_of(promotion)})
    attach_rollbacks(root, rows, committed)
    attach_erasures(root, rows)
    current = max((i for i, r in enumerate(rows) if r["promoted"]), default=None)
    if (root / "promotions.jsonl").exists():  # the promotion log knows about rollbacks
        from flows.orchestration.promotion import champion_generation

        tag = f"gen-{champion_generation(root)}"
        current = next((i for i, r in enumerate(rows) if r["tag"] == tag), current)
    for i, row in enumerate(rows):
        row["champion"] = i == current
    # the fleet: where each generation serves now, or why it left (flows/orchestration/fleet.py
    # `history`: its pushes and production gate verdicts); nothing at all without a fleet
    from flows.orchestration import fleet

    served = fleet.history(root)
    for row in rows:
        row["fleet"] = served.get(row["tag"])
        row["serving"] = row["fleet"]["serving"] if row["fleet"] else None
        if served and row["champion"] and not row["fleet"]:  # the champion users do not get
            row["fleet"] = {"serving": "never", "line": "never pushed: `offseason fleet push` "
                            "puts the champion on every replica", "pushes": [], "gates": []}
            row["serving"] = "never"
    # its canary and production gate (runtime.fleet.canary), from the promotion log
    from flows.orchestration.promotion import log_entries

    steps = [e for e in log_entries(root) if e.get("action") in ("canary", "production-gate")]
    for row in rows:
        row["fleet_steps"] = [
            {"at": e["at"], "date": e["at"][:10], "action": e["action"],
             "what": (f"{e['version']} on {e['replicas']} of {e['of']} replicas (stable "
                      f"{e['stable']})" if e["action"] == "canary" else
                      f"{e['outcome']} on live traffic: {e['reason']}")}
            for e in steps if f"gen-{e.get('generation')}" == row["tag"]]
    from flows.orchestration.cost import per_dollar

    per_dollar(rows)
    return rows


def attach_erasures(root: Path, rows: list[dict]) -> None:
    """Each generation's row gets `flagged`: the erasures (erase.models: flag) of traces it
    learned from, from erasures.jsonl (id, date, whether done): the flag history and the report
    show until a cycle without them replaces it.
    """
    from flows.orchestration.erase import LOG

    for row in rows:
        row["flagged"] = []
    path = root / LOG
    if not path.exists():
        return
    for entry in map(json.loads, filter(str.strip, path.read_text().splitlines())):
        if entry.get("policy") != "flag":
            continue
        for row in rows:
            if row["tag"] in (entry.get("generations") or []):
                row["flagged"].append({"erasure": entry["id"], "date": (entry.get("done") or
                                       entry["received"])[:10], "done": bool(entry.get("done"))})


def attach_rollbacks(root: Path, rows: list[dict], committed: list[str]) -> None:
    """Each generation's row gets `rollbacks`: the champion changes `offseason rollback` made
    after its cycle and before the next one (from, to, when, who, why), from the promotion log.
    A lineage audit sees every change of champion; without them a later row's "vs champ" fell
    with nothing saying why.
    """
    from datetime import datetime

    from flows.orchestration.promotion import log_entries

    for row in rows:
        row["rollbacks"] = []
    backs = [e for e in log_entries(root) if e.get("action") == "rollback"]
    if not backs or not rows:
        return
    made = [datetime.fromisoformat(when) for when in committed]  # each row's commit time
    for entry in backs:
        at = datetime.fromisoformat(entry["at"])
        # after the newest generation committed before it (a rollback and its cycle's commit
        # in the same second: the rollback came after)
        index = max((i for i, when in enumerate(made) if when <= at), default=0)
        rows[index]["rollbacks"].append({
            "at": entry["at"], "date": entry["at"][:10],
            "from": f"gen-{entry.get('from_generation')}", "to": f"gen-{entry['generation']}",
            "model_version": entry.get("model_version"), "approver": entry.get("approver"),
            "reason": entry.get("reason")})


def print_history(rows: list[dict]) -> None:
    """The generations as a table on stdout, with the champion's gain over generation 0; with a
    fleet, what each serves (a `serving` column and, under it, its pushes, canary, production
    gate and where it is now).
    """
    fleet = any(r.get("fleet") for r in rows)  # no fleet: no column, nothing new
    header = f"{'generation':<11}{'date':<12}{'traces':>7}{'pass@1':>8}{'vs champ':>10}" \
             f"{'interval of difference':>26}  {'verdict':<10}{'version':>8}{'cost $':>10}" \
             f"{'pts/$':>9}  {'approver':<12}" + \
             (f"{'serving':<13}" if fleet else "") + "champion"
    print(header)
    print("-" * len(header))
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        interval = "-" if not r["difference_interval"] else \
            f"[{r['difference_interval'][0]:+.3f}, {r['difference_interval'][1]:+.3f}]"
        print(f"{r['tag']:<11}{r['date']:<12}{r['new_traces'] if r['new_traces'] is not None else '-':>7}"
              f"{fmt(r['score']):>8}{fmt(r['champion_score']):>10}{interval:>26}  "
              f"{r['verdict']:<10}{str(r['model_version']):>8}"
              f"{'-' if r.get('cost_usd') is None else format(r['cost_usd'], '.4f'):>10}"
              f"{'-' if r.get('points_per_usd') is None else format(r['points_per_usd'], '.0f'):>9}"
              f"  {r.get('approver') or '':<12}"
              + (f"{r.get('serving') or '-':<13}" if fleet else "")
              + f"{'*' if r['champion'] else ''}")
        steps = [(s["at"], s["action"].replace("production-gate", "prod gate"), s["what"])
                 for s in r.get("fleet_steps") or []]
        steps += [(p["at"], "push", pushed(p)) for p in (r.get("fleet") or {}).get("pushes", [])]
        for at, what, said in sorted(steps):  # its pushes, canary and production gate in order
            print(f"{what:<11}{at[:10]:<12}{said}")
        if r.get("fleet"):
            print(f"{'serving':<11}{'now':<12}{r['fleet']['line']}")
        for flag in r.get("flagged") or []:  # erase.models: flag
            print(f"{'flagged':<11}{flag['date']:<12}{r['tag']} learned from traces erased by "
                  f"{flag['erasure']} (erase.models: flag)")
        for back in r.get("rollbacks") or []:  # a change of champion between two cycles
            print(f"{'rollback':<11}{back['date']:<12}champion {back['from']} -> {back['to']} "
                  f"(model version {back['model_version']}) by {back['approver'] or 'unknown'}: "
                  f"{back['reason']}")


def pushed(entry: dict) -> str:
    """One push of `.offseason/fleet.jsonl` (flows/orchestration/fleet.py `push`) in a line."""
    why = f": {entry['reason'][:100]}" if entry.get("reason") else ""
    if entry.get("failed"):
        error = entry["error"].split(": ", 1)[-1]
        return (f"{entry['version']} FAILED on {entry['failed']}: "
                f"{error if len(error) <= 160 else error[:159] + '…'}{why}")
    done = entry["replicas"]
    if len(done) == 1:
        url, times = next(iter(done.items()))
        return (f"{entry['version']} to {url}, verified (update {times['update_seconds']:.2f} s, "
                f"verify {times['verify_seconds']:.2f} s){why}")
    return (f"{entry['version']} to {len(done)} replicas, verified, in "
            f"{entry.get('seconds', 0):.1f} s{why}")


def cmd_history(args) -> int:
    """`offseason history`: the generations as a table, JSON, or a plot."""
    root = find_root()
    rows = history_rows(root)
    if args.plot and rows:
        from flows.audit.report import plot_history

        try:
            plot_history(rows, args.plot)
        except ValueError as err:  # matplotlib's: an extension it does not write
            print(f"offseason history: error: --plot {args.plot}: {err}; name a .png, .svg or "
                  f".pdf file", file=sys.stderr)
            return 2
        print(f"history: plot written to {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no generations yet; run `offseason init`")
    else:
        print_history(rows)
    return 0


def cmd_demo(args) -> int:
    """`offseason demo`: init if needed, then simulate and run --cycles times, then the history."""
    root = find_root()
    started = time.time()
    if not (root / "models" / "champion.dvc").exists():
        cmd_init(argparse.Namespace(base_model=None, force=False))
    from flows.audit.ui import temporary_prefect

    with temporary_prefect(root):  # one for the demo's cycles (Prefect reads its url once)
        for i in range(args.cycles):
            print(f"\n=== demo: day {i + 1} of {args.cycles}: new traffic, then a cycle ===",
                  flush=True)
            cmd_simulate(argparse.Namespace(days=1))
            cmd_run(argparse.Namespace(estimate=False))
    rows = history_rows(root)
    print(f"\n=== demo finished in {time.time() - started:.0f} s ===\n")
    print_history(rows)
    plot = root / "reports" / "history.png"
    from flows.audit.report import plot_history

    plot_history(rows, plot)
    first = rows[0]["score"]
    champion = next(r for r in rows if r["champion"])
    print(f"\nThe champion ({champion['tag']}) scores {champion['score']:.1%} pass@1 on the held-out "
          f"benchmark, {100 * (champion['score'] - first):+.1f} points over generation 0.")
    offseason, dvc = as_typed("offseason"), as_typed("dvc")
    last = rows[-1]["tag"]
    looks = [(str(plot.relative_to(root)), "pass@1 per generation, with the gate's intervals"),
             (f"{offseason} history", "this table again (--json for scripts, --plot PNG)"),
             (f"{offseason} report", "the cycle report: decisions, costs, lineage, plots"),
             (f"{offseason} ui", "the Prefect and MLflow UIs of this project, until Ctrl-C"),
             (f"{dvc} params diff gen-1 {last}",
              "how two generations' settings differ"),
             (f"{dvc} metrics diff gen-1 {last}", "and their figures (metrics/numbers/)"),
             ("git log --oneline --decorate", "one commit and tag per cycle")]
    width = max(len(command) for command, _ in looks) + 2
    print("\nWhere to look next (each command as you can type it here):")
    for command, what in looks:
        print(f"  {command.ljust(width)}{what}")
    return 0


def as_typed(tool: str) -> str:
    """`tool` as a person can type it in this shell: its bare name where PATH finds this
    environment's copy, else the path of this environment's copy (relative when shorter).
    """
    import os
    import shutil

    here = Path(sys.executable).parent / tool
    # the shell's PATH, not this process's: configure_env put this environment first for DVC
    found = shutil.which(tool, path=os.environ.get(USER_PATH, os.environ.get("PATH")))
    if found and Path(found).resolve() == here.resolve():
        return tool
    relative = os.path.relpath(here, Path.cwd())
    return relative if len(relative) < len(str(here)) else str(here)


def paused_runs() -> list:
    """Flow runs of the cycle waiting for a decision (Paused, or Suspended in a deployment)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.PAUSED]))))


def gate_summary_of(run_id) -> str:
    """The gate summary artifact of a paused flow run, as markdown."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    from flows.orchestration.promotion import GATE_ARTIFACT

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[GATE_ARTIFACT]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return found[-1].data if found else "(no gate summary recorded)"


def cmd_pending(args) -> int:
    """`offseason pending`: cycles waiting for a person's decision, with their gate summary."""
    root = find_root()
    configure_env(root)
    import os

    from flows.orchestration.promotion import awaits_decision

    # Prefect's own server, where one is set, is asked always: a worker elsewhere may run this
    # project's deployments. Without one, this workspace's own record says whether to ask.
    runs = paused_runs() if os.environ.get("PREFECT_API_URL") or awaits_decision(root) else []
    if not runs:
        print("pending: no cycle is waiting for a decision")
        return 0
    for run in runs:
        print(f"{run.id}  {run.name}  {run.state.name} since "
              f"{run.state.timestamp:%Y-%m-%d %H:%M:%S}Z\n    {gate_summary_of(run.id)}")
    print("\ndecide with `offseason approve RUN_ID --reason ...` or `offseason reject RUN_ID "
          "--reason ...`")
    return 0


def cmd_decide(args) -> int:
    """`offseason approve|reject RUN_ID`: resume a waiting cycle with the decision."""
    root = find_root()
    configure_env(root)
    from prefect.flow_runs import resume_flow_run

    from flows.orchestration.promotion import who

    waiting = {str(run.id): run for run in paused_runs()}
    if args.run_id not in waiting:
        raise WorkspaceError(f"flow run {args.run_id} is not waiting for a decision; "
                             f"`offseason pending` lists those that are"
                             + (f" ({', '.join(waiting)})" if waiting else " (none now)"))
    approve = args.command == "approve"
    from prefect.exceptions import FlowPauseTimeout

    try:
        resume_flow_run(uuid.UUID(args.run_id), run_input={"decision": args.command,
                                                            "reason": args.reason,
                                                            "approver": args.approver or who()})
    except FlowPauseTimeout:
        # a suspended (served) run past promotion.approval_timeout: Prefect fails it now
        raise WorkspaceError(f"flow run {args.run_id} waited longer than "
                             f"promotion.approval_timeout and can no longer be resumed; nothing "
                             f"was promoted. The next cycle (`offseason run`) tries again") from None
    print(f"{args.command}: {waiting[args.run_id].name} {'approved' if approve else 'rejected'} "
          f"by {args.approver or who()}: {args.reason}")
    return 0


def cmd_rollback(args) -> int:
    """`offseason rollback`: an earlier generation becomes the champion again."""
    root, configs = workspace()
    from flows.orchestration import promotion

    to = None
    if args.to is not None:
        if not args.to.startswith("gen-") or not args.to[4:].isdigit():
            raise WorkspaceError(f"--to {args.to}: expected a generation tag like gen-2")
        to = int(args.to[4:])
    with cycle_lock(root, "offseason rollback"):
        entry = promotion.rollback(root, configs["base"].registered_model, args.reason,
                                   args.approver or promotion.who(), to)
    print(f"rollback: gen-{entry['generation']} is the champion again (model version "
          f"{entry['model_version']}, was gen-{entry['from_generation']}); commit "
          f"{entry['commit'][:10]}")
    fleet_config = cfg.fleet(root / "params.yaml")
    if fleet_config.url_list and fleet_config.push_on_promote:
        return _fleet_push(root, fleet_config, f"rollback: {args.reason}")
    return 0


def _fleet_push(root: Path, config, reason: str) -> int:
    from flows.orchestration import fleet
    from stages import weights

    try:
        entry = fleet.push(root, config, reason)
    except weights.PushFailed as err:
        print(f"fleet: {err}\n`offseason fleet status` shows each replica; `offseason fleet "
              f"push` tries again", file=sys.stderr)
        return 1
    for url, done in entry["replicas"].items():
        print(f"fleet: {url} serves {entry['version']}, verified (update "
              f"{done['update_seconds']:.2f} s, verify {done['verify_seconds']:.2f} s)")
    print(f"fleet: {entry['version']} on {len(entry['replicas'])} replicas in "
          f"{entry['seconds']:.1f} s")
    return 0


def cmd_fleet(args) -> int:
    """`offseason fleet status|push`: what each replica serves; the champion to every one."""
    root, _ = workspace()
    from flows.orchestration import fleet

    config = cfg.fleet(root / "params.yaml")
    if not config.url_list:
        raise WorkspaceError("runtime.fleet.urls names no server: write the replicas' base URLs "
                             "(e.g. http://10.0.0.5:8000/v1) in params.yaml's runtime.fleet")
    if args.action == "push":
        with cycle_lock(root, "offseason fleet push"):
            return _fleet_push(root, config, args.reason or "offseason fleet push")
    if args.action == "judge":
        with cycle_lock(root, "offseason fleet judge"):
            verdict = fleet.judge(root, config)
        print(json.dumps(verdict, indent=2) if args.json else fleet.said(verdict))
        return 1 if verdict["status"] == "failed" else 0
    rows = fleet.status(root, config)
    state = fleet.read_state(root)
    if args.json:
        print(json.dumps({"replicas": rows, "canary": state.get("canary"),
                          "production_gate": state.get("production_gate")}, indent=2))
        return 0
    for row in rows:
        agrees = "" if row["live"] == row["version"] else f"  (the server says {row['live']})"
        print(f"{row['url']:<40}{row['version'] or 'never pushed':<12}"
              f"{'verified' if row['verified'] else 'NOT verified':<14}"
              f"since {row['since'] or '-'}{agrees}")
        if row.get("error"):
            print(f"    last push failed: {row['error']}")
        if row.get("paused"):
            print("    PAUSED: it holds new requests (a push was cut off between its pause and "
                  "its resume); `offseason fleet push` again resumes it")
    if (canary := state.get("canary")):
        counts = canary.get("traces") or {}
        print(f"canary: {canary['version']} on {len(canary['replicas'])} of {canary['of']} "
              f"replicas since {canary['since']}, stable {canary['stable']}; live traces "
              f"canary {counts.get('canary', '?')}, stable {counts.get('stable', '?')} of "
              f"{canary['bake']} each (as of the last judgment; `offseason fleet judge`)")
    if (last := state.get("production_gate")):
        print(f"last production gate: {last['version']} {last['status']} at {last['at']}: "
              f"{last['reason']}")
    return 0


def cmd_check(args) -> int:
    """`offseason check`: params.yaml checked and printed with every default filled in;
    `--explain`: every section and key with its type, default, bounds and description instead.
    """
    from stages.envs import contract, mcp_tools

    if args.explain:  # the declarations, not this project's params.yaml: docs/params.md's text
        print(settings.reference(), end="")
        return 0
    root, configs = workspace(env=False)
    shown = {k: settings.plain(v) for k, v in configs.items() if v or k != "environments"}
    # where work runs is shown where it is written: runtime.<stage>, apart from the stage's params
    shown["runtime"] = {section: {key: shown[section].pop(key) for key in keys}
                        for section, keys in cfg.RUNTIME.items() if section in shown}
    shown["runtime"]["collect"] = settings.plain(cfg.collect(root / "params.yaml"))
    shown["runtime"]["sandbox"] = settings.plain(cfg.sandbox(root / "params.yaml"))
    shown["runtime"]["fleet"] = settings.plain(cfg.fleet(root / "params.yaml"))
    shown["runtime"]["mcp"] = settings.plain(cfg.mcp(root / "params.yaml"))
    shown["runtime"]["mlflow"] = settings.plain(cfg.mlflow(root / "params.yaml"))
    shown["runtime"]["dvc"] = settings.plain(cfg.dvc(root / "params.yaml"))
    for spec in shown.get("environments", {}).values():  # where its servers run: runtime.mcp
        spec["mcp"] = {server: {key: entry[key] for key in mcp_tools.WHAT}
                       for server, entry in spec["mcp"].items()}
    found_envs = []  # checked before the settings are printed: an error is then the last line
    sizes = {}  # each benchmark's items, for the gate's design
    for name, spec in configs["environments"].items():  # the user's modules import and comply
        env = contract.load(name, spec.module, root)
        own = set(env.tool_names)
        if spec.mcp:  # its MCP servers start and offer what `allow` names (stages start them too)
            try:
                env = contract.load_spec(name, spec, root)
            except mcp_tools.McpError as err:
                raise WorkspaceError(f"{err}; fix environments.{name}.mcp (what each server is) "
                                     f"or runtime.mcp.servers (where it runs) in params.yaml (or "
                                     f"the server), then `offseason check` again") from None
        counts = []
        for kind in ("tasks", "benchmark"):
            if getattr(spec, kind):
                found = contract.load_tasks(root / getattr(spec, kind), env)
                if kind == "benchmark":
                    sizes[name] = min(len(found), configs["gate"].benchmark_size or len(found))
                counts.append(f"{len(found)} {kind} tasks" if kind == "benchmark"
                              else f"{len(found)} tasks")
        tools = [t if t in own else f"{t} (MCP)" for t in env.tool_names]
        found_envs.append(f"environment {name!r}: {env.module} ({env.source}), tools: "
                          f"{', '.join(tools) or 'none'}; "
                          f"{', '.join(counts) or 'no task files'}")
    print(yaml.safe_dump(shown, sort_keys=False))
    for line in found_envs:
        print(line)
    if sizes:
        print(design_line(root, configs, sizes))
    for line in power_lines(root):
        print(line)
    print("params.yaml is valid")


def next_design(root: Path, configs: dict, sizes: dict[str, int]) -> dict:
    """The next decision's design (`gate.design`) for suites of these sizes: the whole
    decision's power and the items each suite needs, at the primary's next level (gate.sequential's,
    from data/gate_history.jsonl), with the last decision's forgetting items.
    """
    from stages import gate, io

    config, specs = configs["gate"], configs["environments"]
    history = root / "data" / "gate_history.jsonl"
    earlier = [h for h in (io.read_jsonl(history) if history.exists() else [])
               if not h.get("unchanged")]
    level = gate.sequential_level(config, earlier) if config.sequential != "none" else None
    last = root / "metrics" / "gate.json"
    forgetting = (json.loads(last.read_text()).get("forgetting") or {}).get("items", 0) \
        if last.exists() else 0
    return gate.design(config, {name: {"items": n, "margin": specs[name].max_regression}
                                for name, n in sizes.items()}, forgetting, level)


def design_line(root: Path, configs: dict, sizes: dict[str, int]) -> str:
    """`next_design` in a line, with a warning when its power is below gate.power, and the
    discordance the last decision saw on the primary (metrics/gate.json) where it is well above
    gate.discordance: the design assumed fewer items answered differently, so it overstates
    its power.
    """
    config, plan = configs["gate"], next_design(root, configs, sizes)
    last = root / "metrics" / "gate.json"
    seen = (((json.loads(last.read_text()).get("design") or {}).get("suites") or {})
            .get(config.primary) or {}).get("observed_discordance") if last.exists() else None
    return (f"gate design: {plan['summary']}"
            + ("" if plan["decision_power"] >= config.power else
               "; WARNING: below gate.power: add items to the suites that need them, widen "
               "their margins or raise gate.min_detectable")
            + ("" if seen is None or seen <= 1.25 * config.discordance else
               f"; WARNING: the last decision saw a discordance of {seen:g} on the primary "
               f"'{config.primary}', above gate.discordance={config.discordance:g}: the power "
               f"stated is too high; set gate.discordance: {seen:g} in params.yaml"))


def power_lines(root: Path) -> list[str]:
    """What each gate suite can detect, from the last decision (metrics/gate.json): its size,
    the smallest change it detects at 80% power, and a warning for an underpowered guard.
    """
    path = root / "metrics" / "gate.json"
    verdict = json.loads(path.read_text()) if path.exists() else {}
    lines = []
    for name, suite in (verdict.get("suites") or {}).items():
        if "detectable_change" not in suite:
            continue
        line = (f"gate suite {name!r} ({suite.get('role')}): {suite.get('items')} items detect "
                f"a change of {suite['detectable_change']:.3f} at 80% power (last decision)")
        usage = (verdict.get("item_usage") or {}).get(name)
        if usage:
            line += (f"; its items have informed {usage['decisions_mean']:g} decisions on "
                     f"average, at most {usage['decisions_max']}")
        if suite["detectable_change"] > 1:  # pass/fail items: fewer than the exact test needs
            line += ("; WARNING: too few items for any change to be significant at gate.alpha "
                     "(McNemar's exact test needs 5 items at alpha 0.05 that one model solves "
                     "and the other not, all one way)"
                     + (": no candidate can pass; add items" if suite.get("role") == "primary"
                        else ": add items"))
        elif suite.get("underpowered"):
            line += (f"; WARNING: underpowered, its max_regression {suite.get('threshold')} is "
                     f"below that: add items (about 6.2 x disagreement / margin^2 are needed) "
                     f"or widen the margin")
        lines.append(line)
    return lines


def stored_rewards(root: Path, generation: int) -> Path:
    """data/rewards.parquet as generation N's cycle left it (git tag gen-N, DVC cache or remote),
    copied to .offseason/rewards-gen-N.parquet.
    """
    import dvc.api
    from dvc.exceptions import PathMissingError

    from flows.audit.lineage import read_parquet
    from stages import io

    tag = f"gen-{generation}"
    if generation not in generations(root):
        raise WorkspaceError(f"no generation {generation} (git tag {tag}); `offseason history` "
                             f"lists the generations")
    target = root / ".offseason" / f"rewards-{tag}.parquet"
    try:
        with dvc.api.open("data/rewards.parquet", repo=str(root), rev=tag, mode="rb") as f:
            data = f.read()
    except PathMissingError:
        raise WorkspaceError(f"{tag} has no data/rewards.parquet (generation 0 ran no cycle)"
                             ) from None
    io.write_parquet(target, read_parquet(data, None))
    return target


def cmd_rescore(args) -> int:
    """`offseason rescore`: stored rollouts scored again by the current verifiers."""
    root, configs = workspace(env=False)
    from stages import io, reward

    source = args.rewards or root / "data" / "rewards.parquet"
    if args.generation is not None:
        source = stored_rewards(root, args.generation)
    if not source.exists():
        raise FileNotFoundError(f"{source}: no stored rewards to re-score; run a cycle first "
                                f"(`offseason run`) or name a rewards or rollouts parquet file")
    out = args.output or root / "data" / "rescored.parquet"
    try:
        summary = reward.rescore(configs["reward"], source, out, configs["environments"],
                                 everything=args.all, root=root)
    except reward.VerifierBroken as err:
        print(f"offseason rescore: error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # not a table of rollouts: says which file and why
        print(f"offseason rescore: error: {err}", file=sys.stderr)
        return 2
    io.write_json(out.with_suffix(".json"), summary)
    print(json.dumps(summary, indent=2))
    print(f"rescore: {summary['rescored']} of {summary['rows']} rollouts re-scored with "
          f"{summary['verifier']}, {summary['changed']} rewards changed (mean "
          f"{summary['mean_reward_before']} -> {summary['mean_reward_after']}); written to {out}, "
          f"summary in {out.with_suffix('.json')}", file=sys.stderr)
    return 0


def holdout_path(root: Path) -> Path:
    """The pool of held-out tasks, as the validate stage in dvc.yaml names it (`--holdout`)."""
    holdout = stage_args(root, "validate").holdout
    if holdout is None:
        raise WorkspaceError("dvc.yaml: the validate stage has no `--holdout data/holdout`; add it "
                             "(and `data/holdout: {persist: true}` to its outs) to hold traces "
                             "out for the benchmarks")
    return root / holdout


def cmd_benchmark(args) -> int:
    """`offseason benchmark refresh`: worn benchmark items replaced by held-out traces' tasks."""
    from stages import erasure, gate, io
    from stages.envs import contract

    root, configs = workspace(env=False)
    specs = configs["environments"]
    if args.env and args.env not in specs:
        raise cfg.ParamsError(f"environments.{args.env}: no such environment; one of "
                              f"{', '.join(sorted(specs))}")
    pool_dir = holdout_path(root)
    history_path = root / "data" / "gate_history.jsonl"
    history = io.read_jsonl(history_path) if history_path.exists() else []
    needs = {}  # --grow: the items each suite needs for the gate's design (`offseason check`)
    if args.grow:
        if configs["gate"].benchmark_size:
            raise WorkspaceError(f"--grow: gate.benchmark_size {configs['gate'].benchmark_size} "
                                 f"has the gate read only that many items of each suite; set it "
                                 f"to 0 first")
        sizes = {n: len(contract.load_tasks(root / s.benchmark, contract.load(n, s.module, root)))
                 for n, s in specs.items() if s.benchmark}
        needs = {n: s["needs"] or 0 for n, s in next_design(root, configs, sizes)["suites"]
                 .items()}
    changed, lines = [], []
    with cycle_lock(root, "offseason benchmark refresh"):
        for name in [args.env] if args.env else sorted(specs):
            spec = specs[name]
            if not spec.benchmark:
                print(f"{name}: no benchmark (environments.{name}.benchmark); skipped")
                continue
            env = contract.load(name, spec.module, root)
            path = root / spec.benchmark
            items = contract.load_tasks(path, env)
            pool_file = pool_dir / f"{name}.jsonl"
            pool = contract.load_tasks(pool_file, env) if pool_file.exists() else []
            pool = erasure.Tombstones(root).keep_rows(pool)  # an erased trace's task: never
            decided = gate.item_decisions(history, name)
            # a suite short of its design's size grows first: fresh items also dilute wear
            longer, grown = gate.grown(items, pool, decided, needs.get(name, 0))
            new, retired, added = gate.refreshed(longer, pool, decided, args.items,
                                                 args.min_decisions)
            growth = (f"; grown from {len(items)} to {len(new)} items by held-out production "
                      f"tasks (the gate's design needs {needs[name]})" if grown else "")
            if grown and not added:
                line = f"{name}: nothing replaced{growth}"
                print(line)
                lines.append(line)
            elif not added:
                why = ("no held-out task is left in " + str(pool_file.relative_to(root))
                       if pool else f"the pool {pool_file.relative_to(root)} is empty (set "
                       f"validate.holdout_fraction to hold traces out)")
                worn = sum(1 for item in items if decided.get(str(item["task_id"]), 0)
                           >= args.min_decisions)
                print(f"{name}: nothing replaced: {worn} of {len(items)} items have informed "
                      f"{args.min_decisions}+ decisions; {why}")
                continue
            else:
                mean = sum(decided.get(str(t["task_id"]), 0) for t in retired) / len(retired)
                line = (f"{name}: {len(added)} of {len(longer)} items replaced by held-out "
                        f"production tasks (the retired ones had informed {mean:.1f} decisions "
                        f"on average; {len(pool) - len(added) - len(grown)} pool tasks left)"
                        f"{growth}")
                print(line)
                lines.append(line)
            if not args.dry_run:
                io.write_jsonl(path, new)
                changed.append(str(path.relative_to(root)))
        if changed:
            git(root, "add", "--", *changed)
            git(root, "commit", "--quiet", "-m", "benchmark refresh: " + "; ".join(lines))
            print(f"committed {', '.join(changed)}; the next cycle scores the champion on them "
                  f"again (champion_scores reruns)")
    return 0


def cmd_ui(args) -> int:
    """`offseason ui`: Prefect's and MLflow's UIs on 127.0.0.1 until Ctrl-C."""
    root = find_root()
    configure_env(root)
    from flows.audit.ui import serve_ui

    return serve_ui(root, args.prefect_port, args.mlflow_port)


def cmd_collect(args) -> int:
    """`offseason collect`: the OTLP/HTTP receiver until Ctrl-C, or --status of a running one."""
    import os

    from flows.intake import collect  # not the report: the receiver needs no MLflow

    root, _ = workspace(env=False)
    settings = cfg.collect(root / "params.yaml")
    settings = dataclasses.replace(settings, **{key: value for key, value in
                                                (("host", args.host), ("port", args.port))
                                                if value is not None})
    if args.status:
        found = collect.read_status(collect.status_url(settings),
                                    os.environ.get(settings.token_env, ""))
        print(json.dumps(found, indent=2) if args.json else collect.status_text(found))
        return 0
    return collect.serve(settings, inbox_path(root), root / COLLECT_SPOOL)


def cmd_pull(args) -> int:
    """`offseason pull langfuse|langsmith`: new traces from a tracing service into the inbox."""
    root, configs = workspace(env=False)
    from flows.intake import pull

    config = configs["pull"]
    limit = config.limit if args.limit is None else args.limit
    if limit < 0:
        raise pull.PullError(f"--limit: must be >= 0 (0: no limit), got {limit}")
    result = pull.pull(root, inbox_path(root), args.service, args.since, limit,
                       args.project or config.project, config.stall_seconds)
    print(json.dumps(result, indent=2) if args.json else result["message"])
    return 0


def cmd_serve(args) -> int:
    """`offseason serve`: the deployments of params.yaml, served here or sent to a work pool."""
    root, _ = workspace()
    import os

    from flows.audit.ui import answers

    if not os.environ.get("PREFECT_API_URL"):
        # deployments need a Prefect server that outlives this process: `offseason ui`'s
        if not answers("http://127.0.0.1:4200/api/health"):
            raise WorkspaceError("no Prefect server to register the deployments with: start "
                                 "`offseason ui` in another terminal, or set PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = "http://127.0.0.1:4200/api"
    # Prefect reads its settings once, when it loads: the url must reach them too, else this
    # process served on a temporary server of its own and every run was cancelled, its
    # concurrency slot "lost" (the flow runs' processes read the environment)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: os.environ["PREFECT_API_URL"]}):
        return _serve(root, args)


def _serve(root: Path, args) -> int:
    from flows.orchestration import serve

    if args.work_pool:
        if args.collect:
            raise WorkspaceError("--collect runs the receiver beside deployments served here; "
                                 "with --work-pool, run `offseason collect` on its own")
        ids = serve.deploy(root, args.work_pool)
        print(f"serve: {len(ids)} deployments registered to work pool {args.work_pool!r}; start "
              f"a worker for it: prefect worker start --pool {args.work_pool}")
        return 0
    receiver = None
    if args.collect:
        from flows.intake import collect

        receiver = collect.beside(root)
    try:
        serve.serve(root)
    finally:
        if receiver is not None:
            collect.stop(receiver)
    return 0


def cmd_lineage(args) -> int:
    """`offseason lineage`: a generation's chain back to its traces; --verify, --trace."""
    root = find_root()
    from flows.audit import lineage

    if args.trace:
        from flows.orchestration import erase

        request = erase.erased_trace(root, args.trace)
        if request is not None:  # its objects are gone: what was recorded when it was erased
            found = {"trace_id": args.trace, "erased": request["id"],
                     "erased_on": request.get("done"),
                     "generations": request.get("generations") or []}
        else:
            champions = {r["tag"] for r in history_rows(root) if r["champion"]}
            found = lineage.trace(root, args.trace, champions)
        text = lineage.trace_text(found) if request is None else (
            f"trace {args.trace}: ERASED by {request['id']} ({request.get('done') or 'open'}); "
            f"generations that learned from it: {', '.join(found['generations']) or 'none'} "
            f"(erase.models: {request.get('policy')}: {request.get('action')})")
        print(json.dumps(found, indent=2) if args.json else text)
        return 0
    if not args.ref:
        raise WorkspaceError("name a generation (gen-N) or a model version, or use --trace ID")
    if args.verify:
        result = lineage.verify(root, args.ref)
        print(json.dumps(result, indent=2) if args.json else lineage.verify_text(result))
        return 0 if result["ok"] else 1
    chain = lineage.lineage(root, args.ref)
    print(json.dumps(chain, indent=2) if args.json else lineage.text(chain))
    return 0


def cmd_erase(args) -> int:
    """`offseason erase`: a deletion request: a person's traces out of everything offseason keeps."""
    root, configs = workspace()
    from flows.orchestration import erase

    if args.status:
        recheck = erase.awaiting_upstream(root)
        with contextlib.ExitStack() as stack:
            if recheck:  # what the services confirm is recorded and committed: not mid-cycle
                try:
                    stack.enter_context(cycle_lock(root, "offseason erase --status"))
                except WorkspaceError as err:
                    recheck = False
                    print(f"upstream deletions not asked again: {err}", file=sys.stderr)
            text, _ = erase.status(root, configs["erase"].deadline_days, recheck=recheck)
        print(text)
        return 0
    asked = [(kind, value) for kind, value in (("user", args.user), ("session", args.session),
                                               ("trace", args.trace), ("field", args.field))
             if value is not None]
    if len(asked) != 1:
        raise WorkspaceError("name one subject: --user ID, --session ID, --trace ID or --field "
                             "NAME=VALUE (or --status)")
    kind, value = asked[0]
    if args.dry_run:
        receipt = erase.erase(root, kind, value, args.reason, configs["erase"],
                              configs["base"].registered_model, dry_run=True)
    else:
        with cycle_lock(root, "offseason erase"):
            receipt = erase.erase(root, kind, value, args.reason, configs["erase"],
                                  configs["base"].registered_model, upstream=args.upstream)
    print(json.dumps(receipt, indent=2) if args.json else erase.text(receipt))
    return 1 if receipt["status"].startswith("open") else 0  # never reported done


def cmd_report(args) -> int:
    """`offseason report`: the static HTML report of every generation."""
    root = find_root()
    from flows.audit import report

    out = report.html_report(root, history_rows(root), args.generation, args.out or
                             root / "reports" / "index.html")
    print(f"report: written to {out}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The `offseason` command line: one sub-command per task, in four groups."""
    p = argparse.ArgumentParser(prog="offseason", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cycle_commands(sub)
    approval_commands(sub)
    audit_commands(sub)
    service_commands(sub)
    return p


def cycle_commands(sub) -> None:
    """The loop itself: create generation 0, feed it traffic, run cycles, check the params."""
    s = sub.add_parser("init", help="create generation 0, the first champion",
                       description="Create generation 0: for the demo a tiny GPT-2 built from "
                       "params.yaml's `init:` section and warm-started on demonstrations; with "
                       "--base-model, a local Hugging Face model folder imported as is. Registers "
                       "it in MLflow with the alias 'champion', `dvc add`s models/champion, "
                       "commits and tags gen-0.")
    s.add_argument("--base-model", type=Path, metavar="PATH",
                   help="a local Hugging Face model folder (config.json, safetensors, tokenizer)")
    s.add_argument("--force", action="store_true", help="replace an existing generation 0")
    s.set_defaults(func=cmd_init)
    s = sub.add_parser("simulate", help="write a day of production-like traces to data/inbox/",
                       description="Write one day of traffic to data/inbox/traffic-NNN.jsonl: the "
                       "champion answering requests from a task mix that shifts each day, as "
                       "OpenAI chat JSONL with tool calls and feedback, plus the junk real logs "
                       "carry (a malformed line, a duplicate, an e-mail address, small talk).")
    s.add_argument("--days", type=days, default=1, help="how many days of traffic (default 1)")
    s.set_defaults(func=cmd_simulate)
    s = sub.add_parser("run", help="run one cycle (a Prefect flow over the DVC stages)",
                       description="Run one cycle: ingest, validate, rollout, reward, train and "
                       "gate through DVC (up-to-date stages are skipped), then promote on a pass, "
                       "commit and tag gen-N. Logged to MLflow (one run per cycle, a child run per "
                       "stage) and to Prefect (flow run log, report artifacts). Nothing new in "
                       "the inbox and nothing changed: nothing reruns. A cycle whose estimate "
                       "is over params.yaml's budget: is refused before it starts.")
    s.add_argument("--estimate", action="store_true",
                   help="print the cycle's estimate (`offseason estimate`) and exit; runs nothing")
    s.set_defaults(func=cmd_run)
    s = sub.add_parser("estimate", help="what the next cycle will cost, before running it",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Predict the next cycle's units (CPU and GPU seconds per "
                       "stage, judge tokens) and dollars, without running anything.\n\n"
                       "How: each stage's work is driven by a unit known before the cycle (inbox "
                       "lines waiting for ingest and validate; episodes = tasks x "
                       "rollout.samples_per_task for rollout and reward; trained example-epochs "
                       "for train, with the replay it will mix in; one run for champion_scores, "
                       "when the champion changed, and the gate). The last three committed "
                       "cycles' ledgers (metrics/cost.json at their gen-N tags) give each "
                       "stage's cost as a fixed part (start-up) plus a rate per unit, fitted to "
                       "them; the estimate is that fit at this cycle's units, the range those "
                       "cycles' own spread around it. Dollars by params.yaml's "
                       "cost: prices. Without a committed cycle there are no rates: it says so. "
                       "After a cycle, metrics/cost.json keeps the estimate made before it "
                       "(`estimate`) beside what it cost.")
    s.add_argument("--json", action="store_true", help="the estimate as JSON")
    s.set_defaults(func=cmd_estimate)
    s = sub.add_parser("demo", help="init, then simulate + run a few times, then the history",
                       description="The built-in demo: create generation 0 if there is none, then "
                       "for each cycle simulate a day of traffic and run a cycle, and print the "
                       "table of generations. Commits and tags into this repository.")
    s.add_argument("--cycles", type=int, default=3, help="number of cycles (default 3)")
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("check", help="check params.yaml",
                       description="Check params.yaml (unknown keys, wrong types, missing "
                       "sections) and print it with every default filled in.")
    s.add_argument("--explain", action="store_true", help="print every section and key of "
                   "params.yaml with its type, default, bounds and description (docs/params.md)")
    s.set_defaults(func=cmd_check)


def approval_commands(sub) -> None:
    """Who is champion: cycles waiting for a person, their decision, a rollback."""
    s = sub.add_parser("pending", help="cycles waiting for approval, with their gate summary",
                       description="List the cycle flow runs that passed the gate and wait for a "
                       "person's decision (promotion.require_approval): paused, or suspended in a "
                       "deployment, with the gate summary of each.")
    s.set_defaults(func=cmd_pending)
    for name, verb in (("approve", "promote"), ("reject", "do not promote")):
        s = sub.add_parser(name, help=f"{verb} the candidate of a cycle waiting for approval",
                           description=f"Resume a cycle waiting for approval and {verb} its "
                           f"candidate; the same as the form in the Prefect UI. The decision, "
                           f"reason and approver go into promotions.jsonl and the MLflow model "
                           f"version's tags.")
        s.add_argument("run_id", metavar="RUN_ID", help="the flow run id (`offseason pending`)")
        s.add_argument("--reason", required=True, type=sentence,
                       help="why, in a sentence (kept forever)")
        s.add_argument("--approver", help="who decides (default: the login name)")
        s.set_defaults(func=cmd_decide)
    s = sub.add_parser("fleet", help="the servers that answer users: what each serves; push "
                       "the champion to them",
                       description="The fleet (params.yaml's runtime.fleet): `status` lists each "
                       "replica with the generation it serves, since when, whether that was "
                       "verified, and what the server itself reports now; `push` puts the "
                       "champion on every replica, one at a time, each verified (its reported "
                       "version and probe answers token for token) before the next; a replica "
                       "that fails goes back to its earlier generation and the push stops. A "
                       "promotion and a rollback push on their own (runtime.fleet.push_on_promote); "
                       "with runtime.fleet.canary, a promotion reaches the canary replicas first "
                       "and `judge` (also run first thing in every cycle) compares canary and "
                       "stable on the ingested live traces once runtime.fleet.bake are in on "
                       "each: pass, the rest follow; fail, the canary and the champion go back.")
    s.add_argument("action", choices=["status", "push", "judge"])
    s.add_argument("--reason", help="push: why, kept in .offseason/fleet.jsonl")
    s.add_argument("--json", action="store_true", help="status, judge: as JSON")
    s.set_defaults(func=cmd_fleet)
    s = sub.add_parser("rollback", help="make an earlier generation the champion again",
                       description="Put an earlier champion back: its weights from DVC (the git "
                       "tag's models/champion.dvc, pulled from the cache or remote), the MLflow "
                       "alias moved to its model version, a line appended to promotions.jsonl, "
                       "committed. Without --to: the champion before the current one.")
    s.add_argument("--to", metavar="gen-N", help="the generation to restore")
    s.add_argument("--reason", required=True, type=sentence,
                   help="why, in a sentence (kept forever)")
    s.add_argument("--approver", help="who decides (default: the login name)")
    s.set_defaults(func=cmd_rollback)


def sentence(text: str) -> str:
    """A --reason: words, not blank (it is kept forever)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give the reason in words: it is kept forever in "
                                         "promotions.jsonl, the commit and the model version's "
                                         "tags")
    return text.strip()


def audit_commands(sub) -> None:
    """Looking back: generations, their lineage, the report, re-scoring old rollouts."""
    s = sub.add_parser("history", help="one row per generation: scores, verdict, champion",
                       description="One row per generation (git tag gen-N): new traces, the "
                       "candidate's and champion's pass@1 on the held-out benchmark, the interval "
                       "of their difference, the verdict, the MLflow model version, and a * on "
                       "the current champion.")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--plot", type=Path, metavar="PNG",
                   help="also draw pass@1 per generation, with the gate's intervals, to this file")
    s.set_defaults(func=cmd_history)
    s = sub.add_parser("lineage", help="a generation's chain back to its traces; --verify, --trace",
                       description="The lineage of a generation (gen-N, or an MLflow model "
                       "version): git commit, MLflow run, every stage's inputs and outputs with "
                       "their DVC hashes, the inbox files and trace ids it learned from, the "
                       "champion it started from, the gate verdict, the approver.")
    s.add_argument("ref", nargs="?", help="gen-N, or an MLflow model version number")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.add_argument("--verify", action="store_true", help="check that every recorded hash "
                   "resolves in the DVC cache or remote and matches; exit 1 naming what does not")
    s.add_argument("--trace", metavar="TRACE_ID", help="every generation that learned from this "
                   "trace, and whether the current champion is among them")
    s.set_defaults(func=cmd_lineage)
    s = sub.add_parser("erase", help="a deletion request: a person's traces out of every copy",
                       description="Erase a person's traces (by user, session, trace id or an "
                       "erase.subject_fields field) from the inbox, every stage's files, the DVC "
                       "cache and local remote, MLflow, the collect journal and pull's state; "
                       "tombstone them so no later cycle reads them; apply erase.models to the "
                       "generations that learned from them; with --upstream, delete the traces "
                       "`offseason pull` brought in from Langfuse or LangSmith there; write a "
                       "receipt (.offseason/erasures/) and a line in erasures.jsonl. README, "
                       "\"Deletion requests\".")
    s.add_argument("--user", metavar="ID", help="the user id the traces carry")
    s.add_argument("--session", metavar="ID", help="the session (conversation) id")
    s.add_argument("--trace", metavar="ID", help="one trace id")
    s.add_argument("--field", metavar="NAME=VALUE", help="a field erase.subject_fields names")
    s.add_argument("--reason", default="", help="why (recorded; write no personal data here)")
    s.add_argument("--dry-run", action="store_true", help="say what would be erased; change "
                   "nothing")
    s.add_argument("--upstream", action="store_true", help="also delete the traces `offseason "
                   "pull` brought in from Langfuse or LangSmith there, through the vendor's API "
                   "and the credentials pull uses; both delete asynchronously: the receipt "
                   "records the request and --status asks again until they are gone. A service "
                   "unreachable or refusing keeps the request open. offseason keeps no id of an "
                   "erased trace: give it with the erasure (--dry-run lists pulled traces)")
    s.add_argument("--status", action="store_true", help="the requests so far, open ones "
                   "against erase.deadline_days; deletions asked upstream are checked again "
                   "(pending, confirmed)")
    s.add_argument("--json", action="store_true", help="print the receipt as JSON")
    s.set_defaults(func=cmd_erase)
    s = sub.add_parser("report", help="a static HTML report of every generation",
                       description="Write reports/index.html: benchmark score per generation with "
                       "the gate's intervals, reward distributions per cycle, quarantine rates, "
                       "and the lineage graph of a generation (the latest by default).")
    s.add_argument("--generation", metavar="gen-N", help="whose lineage graph to draw")
    s.add_argument("--out", type=Path, metavar="HTML", help="default reports/index.html")
    s.set_defaults(func=cmd_report)
    s = sub.add_parser("benchmark", help="benchmark upkeep: `benchmark refresh`",
                       description="Benchmark upkeep: the environments' benchmarks refreshed.")
    actions = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = actions.add_parser(
        "refresh", help="replace worn benchmark items by held-out production tasks",
        description="Held-out items that decided many cycles wear out: a team keeps choosing "
        "candidates by them. With validate.holdout_fraction > 0, each cycle keeps that share of "
        "its production traces out of training and their tasks in data/holdout/<environment>.jsonl. "
        "This replaces the benchmark items that informed the most gate decisions "
        "(data/gate_history.jsonl) by the oldest of those tasks that never decided anything, "
        "keeping each suite's size, writes environments.<name>.benchmark and commits it. The next "
        "cycle scores the champion on the new items (champion_scores reruns).")
    s.add_argument("--env", metavar="NAME", help="only this environment (default: every one)")
    s.add_argument("--items", type=int, default=0, metavar="N",
                   help="replace at most N items per environment (default: as many as the pool "
                   "allows)")
    s.add_argument("--min-decisions", type=int, default=1, metavar="K",
                   help="only items that informed at least K decisions give way (default 1)")
    s.add_argument("--grow", action="store_true", help="first append held-out tasks to each "
                   "suite short of the items the gate's design needs (`offseason check` prints "
                   "them), as many as the pool allows")
    s.add_argument("--dry-run", action="store_true", help="say what would change; write nothing")
    s.set_defaults(func=cmd_benchmark)
    s = sub.add_parser("rescore", help="re-score stored rollouts with the current verifier",
                       description="Re-score stored rollouts whose `verifier` column is not the "
                       "current environment's verifier version (after a change of its VERSION), "
                       "with the gold check, components and weights of the reward stage. Writes "
                       "the whole table to --output and a summary of changed scores beside it "
                       "(.json). The input is left as it is.")
    s.add_argument("rewards", type=Path, nargs="?", metavar="PARQUET",
                   help="rewards (or rollouts) parquet to re-score (default data/rewards.parquet)")
    s.add_argument("--output", type=Path, metavar="PARQUET",
                   help="where to write the re-scored table (default data/rescored.parquet)")
    s.add_argument("--generation", type=int, metavar="N",
                   help="re-score generation N's stored rewards (git tag gen-N) instead")
    s.add_argument("--all", action="store_true",
                   help="re-score every rollout, not only those of another verifier version")
    s.set_defaults(func=cmd_rescore)


def service_commands(sub) -> None:
    """Long-running: the UIs, and the deployments that run cycles on a schedule."""
    s = sub.add_parser("ui", help="the Prefect and MLflow UIs of this workspace, until Ctrl-C",
                       description="Start a Prefect server (database in .prefect/) and an MLflow "
                       "server (mlflow.db, one worker, no job runner) on 127.0.0.1, wait until "
                       "both answer, print their URLs; Ctrl-C or SIGTERM stops both.")
    s.add_argument("--prefect-port", type=int, default=4200, help="default 4200; 0: a free one")
    s.add_argument("--mlflow-port", type=int, default=5000, help="default 5000; 0: a free one")
    s.set_defaults(func=cmd_ui)
    s = sub.add_parser("serve", help="serve the deployments of params.yaml (schedules, Run form)",
                       description="Register the deployments of params.yaml's `deployments:` "
                       "section (nightly and weekly cron schedules, a manual one; each with run "
                       "parameters the Prefect UI's Run form can change) and run their flow runs "
                       "here until Ctrl-C, one cycle at a time per workspace. Set PREFECT_API_URL "
                       "to a Prefect server (`offseason ui` starts one).")
    s.add_argument("--work-pool", metavar="NAME",
                   help="register the deployments to this Prefect work pool instead of serving "
                   "them here; a worker of the pool runs them (see docs/operations.md)")
    s.add_argument("--collect", action="store_true",
                   help="also receive traces (`offseason collect`, runtime.collect) beside them, "
                   "until Ctrl-C stops both")
    s.set_defaults(func=cmd_serve)
    s = sub.add_parser("collect", help="receive traces over OTLP/HTTP into the inbox, until Ctrl-C",
                       description="An OTLP/HTTP receiver (POST /v1/traces and POST /v1/logs: "
                       "protobuf or JSON, gzip or not) that any OpenTelemetry SDK or Collector "
                       "exports to: OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318. Spans and "
                       "log records (where GenAI instrumentations put message content as events) "
                       "are grouped by trace; each finished trace (its root span ended, or "
                       "runtime.collect.idle_seconds without a new span) is written whole, its "
                       "spans and log records on one line, into data/inbox/ as an OTLP JSON "
                       "file, which the next cycle ingests. Log records of no trace are counted "
                       "and dropped. A request is answered 200 only once its spans or log records "
                       "are in the fsynced journal (.offseason/collect/), so a crash loses none "
                       "acknowledged; when too many wait or the disk is short, requests get "
                       "429/503 with "
                       "Retry-After. With the environment variable named by "
                       "runtime.collect.token_env set, requests need 'Authorization: Bearer "
                       "<token>'. Settings: params.yaml's runtime.collect.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--host", help="the address to listen on (default runtime.collect.host, "
                   "127.0.0.1; 0.0.0.0 takes traces from other machines: set a token then)")
    s.add_argument("--port", type=int, help="default runtime.collect.port, 4318; 0: a free one")
    s.add_argument("--status", action="store_true",
                   help="print the counters of the receiver running on --host/--port and exit")
    s.add_argument("--json", action="store_true", help="with --status: JSON instead of text")
    s.set_defaults(func=cmd_collect)
    s = sub.add_parser("pull", help="pull traces from Langfuse or LangSmith into the inbox",
                       description="Fetch the traces that started since the last cycle (or "
                       "--since) from Langfuse or LangSmith with the vendor's own SDK (`pip "
                       "install 'offseason[langfuse]'` or `'offseason[langsmith]'`): their "
                       "observations or runs (messages, tool calls) and the users' scores or "
                       "feedback, written as one new file into data/inbox/ "
                       "(<service>-<UTC time>.jsonl, whole: temporary name, fsync, rename) that "
                       "the next cycle ingests. Credentials from the environment: "
                       "LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_HOST; or "
                       "LANGSMITH_API_KEY, LANGSMITH_ENDPOINT. The trace ids pulled are "
                       "remembered (.offseason/pull/), so pulling twice writes no trace twice. "
                       "Defaults: params.yaml's pull: section; with its service set, every cycle "
                       "pulls first. Exit 2 when the SDK, the credentials or the service fail.")
    s.add_argument("service", choices=["langfuse", "langsmith"], help="where the traces are")
    s.add_argument("--since", default="last-cycle", metavar="last-cycle|ISO-TIME",
                   help="traces started after this: 'last-cycle' (default: the last gen-N "
                   "tag's commit time, or everything before the first cycle) or an ISO time "
                   "like 2026-03-01T00:00:00Z")
    s.add_argument("--limit", type=int, metavar="N",
                   help="at most N new traces, newest first (default pull.limit; 0: all); the "
                   "next pull takes the next ones")
    s.add_argument("--project", metavar="NAME", help="LangSmith: the project (default "
                   "pull.project, else LANGSMITH_PROJECT, else 'default')")
    s.add_argument("--json", action="store_true", help="print what was pulled as JSON")
    s.set_defaults(func=cmd_pull)


def console() -> int:
    """The `offseason` command: main(), then a quick exit."""
    code = main()
    from stages import io

    io.exit_soon()
    return code


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command; a params or workspace error exits 2 with its
    message.
    """
    from stages.envs.contract import ContractError, TaskFileError
    from stages.generation.chat import TemplateError
    from stages.remote import RemoteDown

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (cfg.ParamsError, WorkspaceError, FileNotFoundError, ContractError,
            TaskFileError, TemplateError, RemoteDown) as err:
        print(f"offseason {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(console())
