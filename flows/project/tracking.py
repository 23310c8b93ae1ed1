"""MLflow records: one run per cycle with a child run per stage, and the model registry.

The tracking URI comes from the environment (`MLFLOW_TRACKING_URI`, set by `configure_env` to the
repo's SQLite file by default). Artifacts go to `<repo>/mlartifacts`, always as an absolute URI:
MLflow's own default follows the working directory. A tracking server's requests are bounded by
`runtime.mlflow.stall_seconds` (`workspace.mlflow_requests` fits MLflow's timeout and retries
inside it); one it did not answer ends the cycle (`not_answering` says what it had finished).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag

from stages import config as cfg
from stages import io

EXPERIMENT = "offseason"
ALIAS = "champion"


def find_experiment():
    """The project's MLflow experiment, or None. Often MLflow's first call in a process, which
    loads its tracking store then (for the SQLite default, SQLAlchemy and MLflow's table models:
    a second of imports), so with the garbage collector paused (`stages.io.heavy_imports`; 1.2 of
    `offseason lineage`'s 3 CPU seconds were collections during that import).
    """
    with io.heavy_imports():
        return mlflow.get_experiment_by_name(EXPERIMENT)


# the MLflow UI (3.x) opens an experiment by its kind: without this tag it guessed GenAI (empty
# Traces, Latency and Errors panels, the report's links landing under Evaluations); ours are
# training runs, shown first as such
KIND = {"mlflow.experimentKind": "custom_model_development"}


def experiment(root: Path) -> str:
    """The id of the project's MLflow experiment, created when missing, marked as training."""
    found = find_experiment()
    if found is None:
        return mlflow.create_experiment(EXPERIMENT, tags=KIND,
                                        artifact_location=(root / "mlartifacts").as_uri())
    if any(found.tags.get(key) != value for key, value in KIND.items()):  # made before the tag
        for key, value in KIND.items():
            MlflowClient().set_experiment_tag(found.experiment_id, key, value)
    return found.experiment_id


def flat(prefix: str, value, out: dict) -> dict:
    """A nested dict as dotted keys in `out` (returned), for MLflow params and metrics."""
    if isinstance(value, dict):
        for key, inner in value.items():
            flat(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value
    return out


def numeric(metrics: dict) -> dict[str, float]:
    """The numeric leaves of a metrics file, under names MLflow accepts."""
    return {re.sub(r"[^\w\-. :/]", "_", k).strip("_"): float(v)
            for k, v in flat("", metrics, {}).items() if isinstance(v, (int, float))}


def log_params(run_id: str, params: dict) -> None:
    """Nested params as flat `section.key` MLflow params, in one request."""
    MlflowClient().log_batch(run_id, params=[Param(k, str(v)) for k, v in flat("", params, {}).items()])


def split_settings(values: dict[str, float], params: dict) -> tuple[dict, dict]:
    """A stage's numeric metrics -> (what it measured, the settings it echoed). The echoes are
    MLflow params, not single-bar metric charts: a key whose last part names one of the stage's
    params (train: lora_r; gate: alpha), the `runtime:` settings it ran with (rollout:
    runtime.concurrency, request_timeout ...), and each guard's threshold (the gate's margins).
    """
    settings = {key.rsplit(".", 1)[-1] for key in flat("", params, {})}
    measured, echoed = {}, {}
    for key, value in values.items():
        last = key.rsplit(".", 1)[-1]
        setting = last in settings or key.startswith("runtime.") or last == "threshold"
        (echoed if setting else measured)[key] = value
    given = flat("", params, {})  # logged as they are; an echo of one is the same value
    return measured, {k: int(v) if float(v).is_integer() else v for k, v in echoed.items()
                      if k not in given}


def dvc_hashes(root: Path, stage: str, lock_text: str | None = None) -> dict[str, str]:
    """The md5 of each dep and out of a stage, as recorded in dvc.lock (or in `lock_text`, the
    file as it was when the stage ended: DVC may be rewriting it for the next stage by now).
    """
    if lock_text is None:
        path = root / "dvc.lock"
        lock_text = path.read_text() if path.exists() else ""
    lock = cfg.parse_yaml(lock_text) if lock_text else {}
    entry = (lock or {}).get("stages", {}).get(stage, {})
    hashes = {}
    for kind in ("deps", "outs"):
        for item in entry.get(kind, []):
            hashes[f"dvc.{kind[:-1]}.{item['path']}"] = item.get("md5", "")
    return hashes


def log_stage(root: Path, parent_id: str, experiment_id: str, stage: str, params: dict,
              metrics: dict, ran: bool, lock_text: str | None = None,
              times: tuple[float, float] | None = None) -> str:
    """A child run of the cycle's run: the stage's params, metrics and DVC hashes; `times`: when
    the stage started and ended (time.time()), which the run's own times then show.
    """
    client = MlflowClient()
    start, end = (int(t * 1000) for t in times) if times else (None, None)
    run = client.create_run(experiment_id, run_name=stage, start_time=start, tags={
        "mlflow.parentRunId": parent_id, "offseason.stage": stage,
        "offseason.reran": str(ran).lower()})
    run_id = run.info.run_id
    now = int(time.time() * 1000)
    measured, echoed = split_settings(numeric(metrics), params)
    client.log_batch(
        run_id,
        metrics=[Metric(k, v, now, 0) for k, v in measured.items()],
        params=[Param(k, str(v)) for k, v in {**flat("", params, {}), **echoed}.items()],
        tags=[RunTag(k, v) for k, v in dvc_hashes(root, stage, lock_text).items()],
    )
    client.log_dict(run_id, metrics, f"{stage}.json")
    if stage == "train":
        log_steps(run_id, root / "metrics" / "train_steps.csv")
    client.set_terminated(run_id, end_time=end)
    return run_id


def tag_text(value) -> str:
    """A tag's value as a person reads it in the MLflow UI: `true`, `none` and `3`, never
    Python's `True`, `None` or `3.0`.
    """
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def log_outcome(run_id: str, tags: dict[str, str], metrics: dict) -> None:
    """The cycle's outcome on its run: tags and the numeric leaves of `metrics`, in one request."""
    now = int(time.time() * 1000)
    MlflowClient().log_batch(run_id, metrics=[Metric(k, v, now, 0)
                                              for k, v in numeric(metrics).items()],
                             tags=[RunTag(k, tag_text(v)) for k, v in tags.items()])


def log_steps(run_id: str, path: Path) -> int:
    """The train stage's per-step curves (loss, learning rate, gradient norm, tokens/s, ...) as
    MLflow metrics with their step numbers; returns how many values were logged.
    """
    if not path.exists():
        return 0
    import csv

    now = int(time.time() * 1000)
    values = [Metric(f"step.{key}", float(value), now, int(row["step"]))
              for row in csv.DictReader(path.open()) for key, value in row.items()
              if key != "step" and value not in ("", None)]
    for start in range(0, len(values), 1000):  # MLflow takes at most 1000 metrics a request
        MlflowClient().log_batch(run_id, metrics=values[start:start + 1000])
    return len(values)


def register(model_dir: Path, run_id: str, name: str, tags: dict) -> str:
    """Log a model folder to a run and register it as a new version; returns the version."""
    client = MlflowClient()
    client.log_artifacts(run_id, str(model_dir), "model")
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(name, description="offseason agent generations")
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    version = client.create_model_version(name, source=source, run_id=run_id,
                                          tags={k: tag_text(v) for k, v in tags.items()})
    return version.version


def set_champion(name: str, version: str) -> None:
    """Point the champion alias of the registered model at `version`."""
    MlflowClient().set_registered_model_alias(name, ALIAS, version)


def unanswered(err: Exception) -> bool:
    """An MLflow error that is no answer from its tracking server (a timeout, a refused or reset
    connection, after MLflow's tries), not one the server (or the local store) answered with.
    """
    from mlflow.exceptions import RestException

    remote = os.environ.get("MLFLOW_TRACKING_URI", "").startswith(("http://", "https://"))
    return remote and not isinstance(err, RestException)


def not_answering(root: Path, err: Exception, done: list[str] | None = None,
                  run_id: str = "") -> str:
    """What a cycle stopped by a tracking server that did not answer says: the server, the
    bound, MLflow's error, the stages `done` (kept in DVC's cache) and its run, what to do.
    """
    from stages import config as cfg

    stall = cfg.mlflow(root / "params.yaml").stall_seconds
    finished = ""
    if done is not None:
        finished = (f" after its stages {', '.join(done)} (kept in DVC's cache)" if done else
                    " before any of its stages finished") + (
            f", its MLflow run {run_id} left marked running" if run_id else "")
    return (f"MLflow at {os.environ.get('MLFLOW_TRACKING_URI')} did not answer within "
            f"runtime.mlflow.stall_seconds={stall:g}, MLflow's tries included "
            f"({str(err)[:300]}). The cycle stopped{finished}; a cycle counts once it is "
            f"committed and tagged gen-N. Start that server (or unset MLFLOW_TRACKING_URI for "
            f"the embedded default; raise runtime.mlflow.stall_seconds for a server that is slow, "
            f"not stuck) and run `offseason run` again: finished stages are not redone")


def champion_version(name: str) -> str | None:
    """The registered model's champion version, or None when it has none."""
    try:
        return MlflowClient().get_model_version_by_alias(name, ALIAS).version
    except mlflow.exceptions.MlflowException as err:
        if unanswered(err):  # not "no such alias": the server is not answering
            raise
        return None


def version_exists(name: str, version: str) -> bool:
    """True if the registered model has this version."""
    try:
        MlflowClient().get_model_version(name, version)
        return True
    except mlflow.exceptions.MlflowException as err:
        if unanswered(err):
            raise
        return False


def metrics_file(root: Path, stage: str) -> dict:
    """A stage's metrics file, metrics/<stage>.json ({} when missing)."""
    path = root / "metrics" / f"{stage}.json"
    return json.loads(path.read_text()) if path.exists() else {}
