"""The cycle flow: DVC stages in order, then promotion, recorded in MLflow and git.

One Prefect flow run is one cycle. Each stage is a Prefect task that runs `dvc repro --single-item
<stage>` in the repo root and streams its output into the run log; DVC skips what is up to date,
so a cycle killed midway and run again redoes only the stages that had not finished. The flow opens
one MLflow run per cycle (`gen-N`) with a child run per stage (params, metrics, DVC hashes), logs
and registers the candidate as a new model version, and on a gate pass promotes it: the MLflow
alias `champion`, `models/champion` with `dvc add`. Every cycle that reaches the gate is committed
(`dvc.lock`, pointer files, metrics, params) and tagged `gen-N`, passed or not, so a rejected
candidate can be audited like a promoted one.

    offseason run          # the CLI entry; `python -m flows.cycle` does the same
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger, runtime, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows import tracking
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
from stages import io

STAGES = ["ingest", "validate", "rollout", "reward", "train", "gate"]


def changed_since_last_cycle(root: Path) -> list[str]:
    """Which inputs differ from the last committed cycle's, in words."""
    last = (read_at(root, "HEAD", "metrics/promotion.json") or {}).get("inputs", {})
    now = inputs_fingerprint(root)
    words = {"inbox": "new traces in data/inbox", "params": "params.yaml changed",
             "code": "stage code or dvc.yaml changed"}
    return [words[key] for key in now if now[key] != last.get(key)]


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
def promote(root: Path, generation: int, verdict: dict, run_id: str, model_name: str) -> dict:
    """Register the candidate; on a pass make it the champion. Returns the promotion record."""
    version = tracking.register(root / "models" / "candidate", run_id, model_name, {
        "generation": generation, "passed": verdict["passed"],
        "candidate_score": verdict["candidate_score"]})
    record = {"generation": generation, "model_version": version, "promoted": verdict["passed"],
              "reason": verdict["reason"], "candidate_score": verdict["candidate_score"],
              "champion_score": verdict["champion_score"], "inputs": inputs_fingerprint(root),
              "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    if verdict["passed"]:
        tmp = root / "models" / "champion.next"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(root / "models" / "candidate", tmp)
        shutil.rmtree(root / "models" / "champion")
        tmp.rename(root / "models" / "champion")
        dvc(root, "add", "--quiet", "models/champion")
        record["champion_version"] = version
    else:
        record["champion_version"] = tracking.champion_version(model_name)
    io.write_json(root / "metrics" / "promotion.json", record)
    return record


@task
def commit_and_tag(root: Path, generation: int, message: str) -> str:
    """Commit what the cycle changed and tag it gen-N; returns the commit hash."""
    paths = ["dvc.lock", "dvc.yaml", "params.yaml", "metrics", "data/inbox.dvc",
             "models/champion.dvc", "data/.gitignore", "models/.gitignore",
             "data/quarantine/.gitignore"]
    git(root, "add", "--", *[p for p in paths if (root / p).exists()])
    git(root, "commit", "--quiet", "--allow-empty", "-m", message)
    git(root, "tag", f"gen-{generation}")
    dvc(root, "push", "--quiet")  # the local remote keeps every version the tags point to
    return git(root, "rev-parse", "HEAD")


def report(root: Path, generation: int, metrics: dict, record: dict) -> str:
    ingest, validate, reward, train, gate = (metrics.get(s, {}) for s in
                                             ("ingest", "validate", "reward", "train", "gate"))
    lines = [
        f"# offseason cycle gen-{generation}: "
        f"{'promoted' if record['promoted'] else 'not promoted'}",
        "",
        f"- **Traces**: {ingest.get('rows_read', 0)} read, {ingest.get('accepted', 0)} accepted, "
        f"{ingest.get('quarantined', 0)} quarantined at ingest, {ingest.get('duplicates', 0)} "
        f"duplicates; {validate.get('quarantined', 0)} quarantined by validation",
        f"- **Drift** from the previous cycle: task mix distance "
        f"{validate.get('drift', {}).get('task_mix_distance')}, new tools "
        f"{validate.get('drift', {}).get('new_tools')}; PII scrubbed "
        f"{ingest.get('pii_redactions')}",
        f"- **Data Docs** (Great Expectations): [{root / 'data/docs/index.html'}]"
        f"({(root / 'data/docs/index.html').as_uri()})",
        f"- **Rewards**: mean {reward.get('mean_reward')}, pass@k {reward.get('pass_at_k')} over "
        f"{reward.get('episodes')} episodes",
        f"- **Training**: {train.get('examples')} examples, final loss {train.get('final_loss')}"
        if train.get("trained") else f"- **Training**: skipped ({train.get('reason')})",
        f"- **Gate**: candidate {gate.get('candidate_score')} vs champion "
        f"{gate.get('champion_score')}, difference {gate.get('difference')} with "
        f"{gate.get('confidence')} interval {gate.get('interval')}: {gate.get('reason')}",
        f"- **Model version**: {record['model_version']}; champion is version "
        f"{record['champion_version']}",
    ]
    return "\n".join(lines)


@flow(name="offseason-cycle", log_prints=True)
def cycle(repo: str = ".") -> dict:
    """One continuous-learning cycle over the stages of dvc.yaml, then promotion."""
    logger = get_run_logger()
    root = find_root(repo)
    configure_env(root)
    # a second `offseason run` is refused naming this flow run
    note_cycle(root, flow_run=f"{runtime.flow_run.name} ({runtime.flow_run.id})")
    configs = cfg.load_all(root / "params.yaml")
    if not (root / "models" / "champion.dvc").exists():
        raise WorkspaceError("no champion yet (models/champion.dvc is missing); run "
                             "`offseason init` first")
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
            params = {"base": asdict(configs["base"]), stage: asdict(configs[stage])}
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
        record = promote(root, generation, verdict, run_id, configs["base"].registered_model)
        message = (f"gen-{generation}: candidate {verdict['candidate_score']:.3f} vs champion "
                   f"{verdict['champion_score']:.3f} -> "
                   f"{'promoted' if record['promoted'] else 'not promoted'} "
                   f"(model version {record['model_version']}; {verdict['reason']})")
        commit = commit_and_tag(root, generation, message)
        if record["promoted"]:
            tracking.set_champion(configs["base"].registered_model, record["model_version"])
        for key, value in {"offseason.git_commit": commit, "offseason.git_tag": f"gen-{generation}",
                           "offseason.outcome": "promoted" if record["promoted"] else "rejected",
                           "offseason.model_version": record["model_version"]}.items():
            client.set_tag(run_id, key, value)
        for key, value in tracking.numeric({"gate": verdict}).items():
            client.log_metric(run_id, key, value)
        client.set_terminated(run_id)
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    markdown = report(root, generation, metrics, record)
    create_markdown_artifact(markdown, key="cycle-report", description=f"gen-{generation}")
    create_table_artifact([{"stage": s, "reran": reran[s],
                            **{k: v for k, v in tracking.numeric(metrics[s]).items()
                               if "." not in k}} for s in STAGES],
                          key="cycle-metrics", description=f"gen-{generation}")
    logger.info(message)
    return {"status": "done", "generation": generation, "message": message, "run_id": run_id,
            "commit": commit, "promoted": record["promoted"], "reran": reran,
            "model_version": record["model_version"]}


if __name__ == "__main__":
    print(json.dumps(cycle(sys.argv[1] if len(sys.argv) > 1 else "."), indent=2))
