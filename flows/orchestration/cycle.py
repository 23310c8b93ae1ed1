"""The cycle flow: DVC stages in order, then promotion, recorded in MLflow and git.

One Prefect flow run is one cycle. The stages run in one long-lived DVC process (flows/orchestration/pipeline.py:
`dvc repro validate`, then `dvc repro gate`), and each is a Prefect task that streams that stage's
output into the run log as DVC prints it; DVC skips what is up to date, so a cycle killed midway and
run again redoes only the stages that had not finished. The flow opens one MLflow run per cycle
(`gen-N`) with a child run per stage (params, metrics, DVC hashes), logged while DVC runs the next
stage; it logs and registers the candidate as a new model version, and on a gate pass (approved by
a person when `promotion.require_approval` asks for it) promotes it: the MLflow alias `champion`,
`models/champion` with `dvc add`, the promotion log, as one transaction (flows/orchestration/promotion.py). Every
cycle that reaches the gate is committed (`dvc.lock`, pointer files, metrics, params) and tagged
`gen-N`, passed or not, so a rejected candidate can be audited like a promoted one.

`offseason run` starts the stages before this flow (and Prefect's temporary server) is up and the
flow adopts them; a flow run of a deployment starts them itself.

    offseason run          # the CLI entry; `python -m flows.orchestration.cycle` does the same
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Literal

import yaml
from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE
from pydantic import WithJsonSchema

from flows.audit import report as cycle_report
from flows.orchestration import cost, pipeline, promotion
from flows.project import notify, overrides, tracking
from flows.project import params as settings
from flows.project.workspace import (
    WorkspaceError,
    configure_env,
    find_root,
    generations,
    git,
    note_children,
    note_cycle,
    workspace_slot,
)
from stages import budget as budgets
from stages import config as cfg
from stages.config import ALGORITHMS, CYCLE
from stages.io import write_json

STAGES = CYCLE  # in the order they run
SECTION = {"champion_scores": "gate"}  # the params section of a stage named otherwise
PROJECT_ENV = "OFFSEASON_PROJECT"  # the checkout a flow run works in (not a Run form field)


# The Run form's fields. Each parameter is optional (empty: params.yaml's value), but a field
# typed `X | None` is drawn by Prefect's UI as a choice between X and "None", with a "Property is
# type None" warning, on every field (issue 53.5): the form is given the type alone, and an empty
# field is not sent (flows/orchestration/serve.py drops the `null` defaults from the form). The
# algorithms are offered by name (a drop-down), from the one table.
Algorithm = Annotated[Literal[tuple(ALGORITHMS)] | None,
                      WithJsonSchema({"type": "string", "enum": list(ALGORITHMS)})]
Count = Annotated[int | None, WithJsonSchema({"type": "integer", "minimum": 1})]
# a yes/no drop-down, not a toggle: an untouched toggle is sent as false, which would turn
# params.yaml's approval off for the run without anyone deciding it (pydantic reads "yes" as True)
Switch = Annotated[bool | None, WithJsonSchema({"type": "string", "enum": ["yes", "no"]})]


@task(task_run_name="{name}", cache_policy=NO_CACHE)
def run_stage(name: str, stage: pipeline.Stage) -> bool:
    """One DVC stage: its output into the Prefect log as DVC prints it; returns whether it reran."""
    logger = get_run_logger()
    for line in stage:
        if line.strip():
            logger.info("%s | %s", name, line)
    if stage.error is not None:
        raise stage.error
    if not stage.reran:
        logger.info("%s: up to date, skipped (DVC)", name)
    return stage.reran


class _Explained(logging.Filter):
    """Prefect logs a flow's or task's exception with its traceback. The failures offseason
    explains itself (a stage that failed, with its output; a refused cycle; a bad params key:
    WorkspaceError and ParamsError, whose messages say what to do next) keep their message and
    lose the traceback, which only buried that message under Prefect's and our frames.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Drop the traceback of an explained failure; every record is kept."""
        from stages.config import ParamsError

        if record.exc_info and isinstance(record.exc_info[1], (WorkspaceError, ParamsError)):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_explained_failures() -> None:
    """`_Explained` on the loggers Prefect's engines report a run's exception with (once)."""
    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Explained) for f in logger.filters):
            logger.addFilter(_Explained())


@task
def promote(root: Path, generation: int, verdict: dict, decision: dict, run_id: str,
            model_name: str, changes: dict) -> dict:
    """Register the candidate, promote it if it passed (and was approved), commit and tag gen-N."""
    return promotion.promote(root, generation, verdict, decision, run_id, model_name, changes)


def fleet_push(root: Path) -> str:
    """The new champion to the fleet (`runtime.fleet`, when it names servers and
    `push_on_promote`); returns what to add to the cycle's message. A failed push leaves the
    fleet on its earlier weights, said, and fails nothing already committed.
    """
    from flows.orchestration import fleet
    from stages import weights

    config = cfg.fleet(root / "params.yaml")
    if not config.url_list or not config.push_on_promote:
        return ""
    logger = get_run_logger()
    try:
        if config.canary:
            entry = fleet.start_canary(root, config, reason="promoted")
            if isinstance(entry.get("canary"), dict):
                logger.info("fleet: %s on the canary (%s), verified; the production gate "
                            "decides after %d live traces per arm", entry["version"],
                            ", ".join(entry["replicas"]), config.bake)
                return (f"; the canary serves {entry['version']} ({len(entry['replicas'])} "
                        f"of {entry['canary']['of']} replicas, verified)")
        else:
            entry = fleet.push(root, config, reason="promoted")
    except (weights.PushFailed, fleet.NoCanary) as err:
        logger.error("fleet: %s; `offseason fleet status` shows each replica, `offseason fleet "
                     "push` tries again", err)
        return f"; the fleet push FAILED ({err})"
    logger.info("fleet: %s on %d replicas, verified, in %.1f s", entry["version"],
                len(entry["replicas"]), entry["seconds"])
    return f"; the fleet serves {entry['version']} ({len(entry['replicas'])} replicas, verified)"


def run_name() -> str:
    """The flow run's name in the Prefect UI: the generation it builds (`gen-3`), where Prefect
    gave a random pair of words (`solemn-badger`); `cycle` where the project cannot be read.
    """
    try:
        root = find_root(os.environ.get(PROJECT_ENV, "."))
        return f"gen-{max(generations(root), default=0) + 1}"
    except Exception:  # the name must never stop a run: the cycle says what is wrong itself
        return "cycle"


@flow(name="offseason-cycle", log_prints=True, flow_run_name=run_name)
def cycle(algorithm: Algorithm = None, samples_per_task: Count = None, epochs: Count = None,
          require_approval: Switch = None) -> dict:
    """One continuous-learning cycle over the stages of dvc.yaml, then promotion.

    The project is `OFFSEASON_PROJECT` (set by `offseason run` and `offseason serve` for the
    flow runs of their deployments), else the folder the run starts in. Not a parameter: a
    deployment belongs to one checkout, so the Prefect Run form has no field to point it elsewhere.

    Args:
        algorithm: train.algorithm for this run (empty: params.yaml's value).
        samples_per_task: rollout.samples_per_task for this run (empty: params.yaml's value).
        epochs: whole passes over the data for this run, of its algorithm (train.sft.epochs,
            train.dpo.epochs or train.grpo.epochs; empty: params.yaml's value, which may be
            fractional).
        require_approval: promotion.require_approval for this run, yes or no (empty:
            params.yaml's value).

    """
    quiet_explained_failures()
    root = find_root(os.environ.get(PROJECT_ENV, "."))
    # first thing: Prefect's temporary server, started for this flow run (`offseason run`), is
    # named in the lock, so a kill from here on leaves nothing the next cycle does not stop
    note_children(root)
    configure_env(root)
    changes = overrides.from_parameters(root / "params.yaml", algorithm=algorithm, samples_per_task=samples_per_task,
                                        epochs=epochs, require_approval=require_approval)
    with workspace_slot(root), overrides.applied(root, changes):
        try:
            result = run_cycle(root, changes)
        except Exception as err:  # not Prefect's pause/suspend signals (BaseException)
            notify.cycle_failed(root, err)
            raise
    if result.get("status") == "done":
        notify.send("promoted" if result["promoted"] else "rejected", result["message"],
                    workspace=str(root), **{k: result[k] for k in
                                            ("generation", "model_version", "run_id", "commit")})
    return result


def end_killed_runs(root: Path, client) -> None:
    """End the MLflow runs and the Prefect flow runs of cycles killed before this one (the stale
    lock named them, `workspace.KILLED`): nothing else would, and they showed as running forever.
    KILLED and Crashed, as a kill leaves them; a run that ended meanwhile is left as it is.
    """
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from flows.project.workspace import KILLED, killed_runs_ended

    logger = get_run_logger()
    for killed in KILLED.get(root.resolve(), []):
        run_id = killed.get("mlflow_run_id")
        try:
            if run_id and client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, status="KILLED")
                logger.info("the killed cycle's MLflow run %s ended as KILLED", run_id)
        except Exception as err:  # noqa: BLE001 (a deleted run, another store): said, not fatal
            logger.warning("could not end the killed cycle's MLflow run %s: %s", run_id, err)
        flow_run = (killed.get("flow_run") or "").rsplit("(", 1)[-1].rstrip(")")
        try:
            flow_run_id = uuid.UUID(flow_run)
        except ValueError:
            continue
        try:
            with get_client(sync_client=True) as prefect:
                state = prefect.read_flow_run(flow_run_id).state
                if state is not None and not state.is_final() and not state.is_paused():
                    prefect.set_flow_run_state(flow_run_id, Crashed(
                        message="its offseason run was killed; a later cycle took over"),
                        force=True)
                    logger.info("the killed cycle's flow run %s ended as Crashed", flow_run)
        except Exception as err:  # noqa: BLE001
            logger.warning("could not end the killed cycle's flow run %s: %s", flow_run, err)
    killed_runs_ended(root)


def run_cycle(root: Path, changes: dict) -> dict:
    """The cycle's steps, inside the flow run (params.yaml already holds this run's overrides)."""
    # a second `offseason run` is refused naming this flow run
    note_cycle(root, flow_run=f"{runtime.flow_run.name} ({runtime.flow_run.id})")
    if (refusal := promotion.waiting_refusal(root, runtime.flow_run.id)):
        raise WorkspaceError(refusal)
    configs = settings.load_all(root / "params.yaml")
    start = pipeline.adopt(root)
    guess = cost.ESTIMATES.pop(str(root.resolve()), None)
    # a served run suspended for approval is rerun from the top once resumed: the estimate made
    # before its stages ran is kept for it (made again, every stage reused, it said $0)
    made = root / ".offseason" / "estimates" / f"{runtime.flow_run.id}.json"
    if start is None and made.exists():
        guess = json.loads(made.read_text())
        start = pipeline.begin(root)
    elif start is None:  # a deployment's run: the estimate and the budget, before any stage
        guess = cost.estimate(root, configs)
        if (refusal := cost.budget_refusal(root, guess, configs["budget"])):
            raise WorkspaceError(refusal)
        made.parent.mkdir(parents=True, exist_ok=True)
        write_json(made, guess)
        start = pipeline.begin(root)
    try:
        result = follow(root, start, configs, changes, guess)
    except Exception:  # done with it; not on a pause or suspension (BaseException)
        made.unlink(missing_ok=True)
        raise
    finally:
        start.close()  # stages still running when the flow failed are stopped
    made.unlink(missing_ok=True)
    return result


def follow(root: Path, start: pipeline.Start, configs: dict, changes: dict,
           guess: dict | None = None) -> dict:
    """Record the running stages stage by stage, then gate and promote."""
    logger = get_run_logger()
    for line in start.recovered:
        logger.warning("an unfinished promotion was undone: %s", line)
    if start.pulled:
        logger.info(start.pulled)
    if start.judged:
        logger.info(start.judged)
    if start.status != "run":
        (logger.warning if start.status == "empty-inbox" else logger.info)(start.message)
        return {"status": start.status, "message": start.message}
    generation = start.generation
    logger.info("cycle gen-%d: %s", generation, "; ".join(start.reasons))
    if changes:
        logger.info("run overrides (written into params.yaml for this run): %s",
                    ", ".join(f"{key}: {yaml.safe_dump(value).splitlines()[0]}"
                              for key, value in changes.items()))

    import mlflow

    experiment_id = tracking.experiment(root)
    parent = mlflow.MlflowClient().create_run(experiment_id, run_name=f"gen-{generation}", tags={
        "offseason.generation": str(generation),
        "offseason.parent_commit": git(root, "rev-parse", "HEAD"),
        # the report links each generation to its Prefect flow run
        "offseason.prefect_flow_run_id": str(runtime.flow_run.id)})
    run_id = parent.info.run_id
    note_cycle(root, mlflow_run_id=run_id)
    client = mlflow.MlflowClient()
    end_killed_runs(root, client)
    tracking.log_params(run_id, {section: settings.plain(values)
                                 for section, values in configs.items()})
    for line in promotion.recover_alias(root, configs["base"].registered_model):
        logger.warning("an unfinished promotion was undone: %s", line)
    metrics, reran = {}, {}
    try:
        while (stage := start.pipeline.stage(on_other=lambda line: logger.info("dvc | %s", line))):
            name = stage.name
            reran[name] = run_stage(name, stage)
            metrics[name] = tracking.metrics_file(root, name)
            section = SECTION.get(name, name)
            params = {"base": asdict(configs["base"]), section: asdict(configs[section])}
            tracking.log_stage(root, run_id, experiment_id, name, params, metrics[name],
                               reran[name], stage.lock, (stage.started, stage.ended))
            if name == "validate" and pipeline.accepted_traces(root) == 0:
                message = (f"no new valid traces this cycle ({metrics['ingest'].get('rows_read')} "
                           f"lines read, {metrics['ingest'].get('accepted')} new): nothing to "
                           f"learn from; quarantine reasons are in data/quarantine/")
                logger.warning(message)
                client.set_tag(run_id, "offseason.outcome", "no-new-traces")
                client.set_terminated(run_id)
                return {"status": "no-new-traces", "message": message, "run_id": run_id}
        missing = [name for name in STAGES if name not in reran]
        if missing:  # dvc.yaml lost a stage, or DVC ended without running them
            raise WorkspaceError(f"DVC ended without running {', '.join(missing)}; check "
                                 f"dvc.yaml (`dvc dag` shows the stages)")
        verdict = metrics["gate"]
        # what this cycle's stages used, priced (committed with the cycle's metrics)
        gpus = 0 if str(metrics.get("train", {}).get("device", "cpu")).startswith("cpu") else 1
        # what every attempt of this cycle ran: a rerun after a failure, or a run resumed after
        # approval, skips what an earlier one did (priced "reused", $0, before)
        ran = {name: rerun or budgets.ran_this_cycle(root, name) for name, rerun in reran.items()}
        spent = cost.ledger(metrics, ran, configs["cost"], gpus)
        if guess is not None:  # what was predicted before the cycle, for estimate vs actual
            spent["estimate"] = guess
        spent["gain"] = cost.gain_per_dollar(root, spent, verdict)
        write_json(root / "metrics" / "cost.json", spent)
        decision = promotion.await_approval(root, generation, verdict, configs["promotion"])
        record = promote(root, generation, verdict, decision, run_id,
                         configs["base"].registered_model, changes)
        message, commit = record["message"], record["commit"]
        if record["promoted"]:
            message += fleet_push(root)
        if record.get("committed_inputs"):
            logger.info("committed with gen-%d, which read them (they were not in git as they "
                        "are): %s", generation, ", ".join(record["committed_inputs"]))
        tracking.log_outcome(run_id, {
            "offseason.git_commit": commit, "offseason.git_tag": f"gen-{generation}",
            "offseason.outcome": "promoted" if record["promoted"] else "rejected",
            "offseason.model_version": record["model_version"]},
            {"gate": verdict, "cost": {**spent["total"], **spent["gain"]}})
        client.set_terminated(run_id)
    except BaseException as err:
        from mlflow.exceptions import MlflowException
        from prefect.exceptions import Pause

        if isinstance(err, MlflowException) and tracking.unanswered(err):
            # the server stopped answering: ending the run would wait out the bound again
            raise WorkspaceError(tracking.not_answering(
                root, err, [name for name in reran if name in metrics], run_id)) from None
        # suspended for approval in a deployment: the run resumes later as a new MLflow run
        client.set_terminated(run_id, status="KILLED" if isinstance(err, Pause) else "FAILED")
        raise
    cycle_report.publish(root, generation, metrics, reran, record,
                         experiment_id=experiment_id, run_id=run_id)
    scored = metrics.get("reward") or {}
    if scored.get("errors"):  # left out of training: said where the cycle's outcome is read
        message += (f"; {scored['errors']} of {scored.get('episodes')} episodes could not be "
                    f"scored and were left out (metrics/reward.json, data/rewards.parquet `error`)")
    logger.info(message)
    return {"status": "done", "generation": generation, "message": message, "run_id": run_id,
            "commit": commit, "promoted": record["promoted"], "reran": reran,
            "model_version": record["model_version"], "decision": record["decision"]}


if __name__ == "__main__":
    os.environ[PROJECT_ENV] = str(find_root(sys.argv[1] if len(sys.argv) > 1 else "."))
    print(json.dumps(cycle(), indent=2))
