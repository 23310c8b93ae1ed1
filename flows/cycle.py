"""The cycle flow: DVC stages in order, then promotion, recorded in MLflow and git.

One Prefect flow run is one cycle. Each stage is a Prefect task that runs `dvc repro --single-item
<stage>` in the repo root and streams its output into the run log; DVC skips what is up to date,
so a cycle killed midway and run again redoes only the stages that had not finished. The flow opens
one MLflow run per cycle (`gen-N`) with a child run per stage (params, metrics, DVC hashes), logs
and registers the candidate as a new model version, and on a gate pass (approved by a person when
`promotion.require_approval` asks for it) promotes it: the MLflow alias `champion`,
`models/champion` with `dvc add`, the promotion log, as one transaction (flows/promotion.py). Every cycle that reaches the gate is committed
(`dvc.lock`, pointer files, metrics, params) and tagged `gen-N`, passed or not, so a rejected
candidate can be audited like a promoted one.

    offseason run          # the CLI entry; `python -m flows.cycle` does the same
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger, runtime, task

from flows import lineage, notify, overrides, promotion, tracking
from flows import report as cycle_report
from flows.serve import workspace_slot
from flows.workspace import (
    WorkspaceError,
    configure_env,
    dvc,
    find_root,
    generations,
    git,
    inputs_fingerprint,
    note_cycle,
    read_at,
)
from stages import config as cfg

STAGES = ["ingest", "validate", "rollout", "reward", "train", "champion_scores", "gate"]
SECTION = {"champion_scores": "gate"}  # the params section of a stage named otherwise


def changed_since_last_cycle(root: Path) -> list[str]:
    """Which inputs differ from the last committed cycle's, in words."""
    last = (read_at(root, "HEAD", "metrics/promotion.json") or {}).get("inputs", {})
    now = inputs_fingerprint(root)
    words = {"inbox": "new traces in data/inbox", "params": "params.yaml changed",
             "code": "stage code or dvc.yaml changed"}
    return [words[key] for key in now if now[key] != last.get(key)]


def nothing_changed(root: Path) -> str | None:
    """Before any Prefect or MLflow start: the no-change message when the inbox snapshot is up
    to date and inbox, params and code all equal the last cycle's; else None (run the cycle).
    """
    if not (root / "data" / "inbox.dvc").exists():
        return None
    try:  # `dvc status -q` exits 1 when the inbox differs from its snapshot
        dvc(root, "status", "--quiet", "data/inbox.dvc")
    except WorkspaceError:
        return None
    if changed_since_last_cycle(root):
        return None
    last = generations(root)
    return (f"nothing changed since gen-{last[-1] if last else 0} (no new traces, same params, "
            f"same code): nothing to learn from, no stage reran")


@task(task_run_name="{stage}")
def run_stage(root: Path, stage: str) -> bool:
    """Run one DVC stage, streaming its output into the Prefect log; returns whether it reran."""
    logger = get_run_logger()
    reran = False

    def forward(line: str) -> None:
        nonlocal reran
        reran |= line.startswith(f"Running stage '{stage}'")
        if line.strip():
            logger.info("%s | %s", stage, line)

    dvc(root, "repro", "--single-item", stage, on_line=forward)
    if not reran:
        logger.info("%s: up to date, skipped (DVC)", stage)
    return reran


@task
def snapshot_inbox(root: Path) -> int:
    """`dvc add` the inbox, so the exact traces of this cycle are versioned; returns the file count."""
    files = [p for p in (root / "data" / "inbox").glob("*.jsonl")]
    if files:
        dvc(root, "add", "--quiet", "data/inbox")
    return len(files)


@task
def promote(root: Path, generation: int, verdict: dict, decision: dict, run_id: str,
            model_name: str, changes: dict) -> dict:
    """Register the candidate, promote it if it passed (and was approved), commit and tag gen-N."""
    return promotion.promote(root, generation, verdict, decision, run_id, model_name, changes)


@flow(name="offseason-cycle", log_prints=True)
def cycle(repo: str = ".", algorithm: str | None = None, samples_per_task: int | None = None,
          epochs: float | None = None, require_approval: bool | None = None) -> dict:
    """One continuous-learning cycle over the stages of dvc.yaml, then promotion.

    Args:
        repo: the project folder.
        algorithm: train.algorithm for this run (empty: params.yaml's value).
        samples_per_task: rollout.samples_per_task for this run (empty: params.yaml's value).
        epochs: train.epochs for this run (empty: params.yaml's value).
        require_approval: promotion.require_approval for this run (empty: params.yaml's value).

    """
    root = find_root(repo)
    configure_env(root)
    changes = overrides.from_parameters(algorithm=algorithm, samples_per_task=samples_per_task,
                                        epochs=epochs, require_approval=require_approval)
    with workspace_slot(root), overrides.applied(root, changes):
        try:
            result = run_cycle(root, changes)
        except Exception as err:  # not Prefect's pause/suspend signals (BaseException)
            notify.send("failed", f"cycle in {root} failed: {type(err).__name__}: {err}",
                        workspace=str(root))
            raise
    if result.get("status") == "done":
        notify.send("promoted" if result["promoted"] else "rejected", result["message"],
                    workspace=str(root), **{k: result[k] for k in
                                            ("generation", "model_version", "run_id", "commit")})
    return result


def run_cycle(root: Path, changes: dict) -> dict:
    """The cycle's steps, inside the flow run (params.yaml already holds this run's overrides)."""
    logger = get_run_logger()
    # a second `offseason run` is refused naming this flow run
    note_cycle(root, flow_run=f"{runtime.flow_run.name} ({runtime.flow_run.id})")
    configs = cfg.load_all(root / "params.yaml")
    if not (root / "models" / "champion.dvc").exists():
        raise WorkspaceError("no champion yet (models/champion.dvc is missing); run "
                             "`offseason init` first")
    for line in promotion.recover(root, configs["base"].registered_model):
        logger.warning("an unfinished promotion was undone: %s", line)
    # before any stage reads it: `dvc checkout` restores altered cache bytes without a word
    lineage.check_champion(root)
    files = snapshot_inbox(root)
    if files == 0:
        message = ("the inbox is empty (no *.jsonl in data/inbox): nothing to learn from. Put "
                   "trace files there or run `offseason simulate`")
        logger.warning(message)
        return {"status": "empty-inbox", "message": message}
    reasons = changed_since_last_cycle(root)
    last = generations(root)
    if not reasons:
        message = (f"nothing changed since gen-{last[-1] if last else 0} (no new traces, same "
                   f"params, same code): nothing to learn from, no stage reran")
        logger.info(message)
        return {"status": "nothing-changed", "message": message}
    generation = (last[-1] + 1) if last else 1
    logger.info("cycle gen-%d: %s", generation, "; ".join(reasons))
    if changes:
        logger.info("run overrides (written into params.yaml for this run): %s", changes)

    import mlflow

    experiment_id = tracking.experiment(root)
    parent = mlflow.MlflowClient().create_run(experiment_id, run_name=f"gen-{generation}", tags={
        "offseason.generation": str(generation),
        "offseason.parent_commit": git(root, "rev-parse", "HEAD")})
    run_id = parent.info.run_id
    note_cycle(root, mlflow_run_id=run_id)
    client = mlflow.MlflowClient()
    tracking.log_params(run_id, {section: asdict(values) for section, values in configs.items()})
    metrics, reran = {}, {}
    try:
        for stage in STAGES:
            reran[stage] = run_stage(root, stage)
            metrics[stage] = tracking.metrics_file(root, stage)
            section = SECTION.get(stage, stage)
            params = {"base": asdict(configs["base"]), section: asdict(configs[section])}
            tracking.log_stage(root, run_id, experiment_id, stage, params, metrics[stage],
                               reran[stage])
            if stage == "validate" and metrics["validate"].get("accepted", 0) == 0:
                message = (f"no new valid traces this cycle ({metrics['ingest'].get('rows_read')} "
                           f"lines read, {metrics['ingest'].get('accepted')} new): nothing to "
                           f"learn from; quarantine reasons are in data/quarantine/")
                logger.warning(message)
                client.set_tag(run_id, "offseason.outcome", "no-new-traces")
                client.set_terminated(run_id)
                return {"status": "no-new-traces", "message": message, "run_id": run_id}
        verdict = metrics["gate"]
        decision = promotion.await_approval(generation, verdict, configs["promotion"])
        record = promote(root, generation, verdict, decision, run_id,
                         configs["base"].registered_model, changes)
        message, commit = record["message"], record["commit"]
        for key, value in {"offseason.git_commit": commit, "offseason.git_tag": f"gen-{generation}",
                           "offseason.outcome": "promoted" if record["promoted"] else "rejected",
                           "offseason.model_version": record["model_version"]}.items():
            client.set_tag(run_id, key, value)
        for key, value in tracking.numeric({"gate": verdict}).items():
            client.log_metric(run_id, key, value)
        client.set_terminated(run_id)
    except BaseException as err:
        from prefect.exceptions import Pause

        # suspended for approval in a deployment: the run resumes later as a new MLflow run
        client.set_terminated(run_id, status="KILLED" if isinstance(err, Pause) else "FAILED")
        raise
    cycle_report.publish(root, generation, metrics, reran, record,
                         experiment_id=experiment_id, run_id=run_id)
    logger.info(message)
    return {"status": "done", "generation": generation, "message": message, "run_id": run_id,
            "commit": commit, "promoted": record["promoted"], "reran": reran,
            "model_version": record["model_version"], "decision": record["decision"]}


if __name__ == "__main__":
    print(json.dumps(cycle(sys.argv[1] if len(sys.argv) > 1 else "."), indent=2))
