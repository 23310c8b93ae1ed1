"""Deployments of the cycle flow: schedules and a Run button, from params.yaml's `deployments:`.

    offseason serve                      # register the deployments and run their flow runs here
    offseason serve --work-pool NAME     # register them to a Prefect work pool instead; a worker runs them

Reads params.yaml's `deployments:`: `nightly` and `weekly` on cron schedules, `manual` without
one, each with its default run parameters the Prefect UI's Run form lets a person edit. One cycle
per workspace (a deployment concurrency limit, a global one per workspace and the workspace's
file lock). Served, the flow runs execute in subprocesses of this process, in this checkout
(`OFFSEASON_PROJECT`); stop it with Ctrl-C.

Details: docs/operations.md, "How the deployments are served (flows/orchestration/serve.py)".
"""

from __future__ import annotations

import os
from pathlib import Path

from flows.orchestration.cycle import PROJECT_ENV
from flows.project import params as settings
from flows.project.workspace import limit_name

ENTRYPOINT = "flows/orchestration/cycle.py:cycle"


def specs(root: Path) -> dict[str, dict]:
    """The deployments params.yaml defines: name -> {cron, parameters, description}."""
    config = settings.load_all(root / "params.yaml")["deployments"]
    found = {}
    for name, spec in {"nightly": config.nightly, "weekly": config.weekly,
                       "manual": config.manual}.items():
        if name != "manual" and not spec.get("cron"):
            continue  # an empty cron turns a scheduled deployment off
        found[name] = {"cron": spec.get("cron") or None, "timezone": config.timezone,
                       # a switch (require_approval) is the Run form's yes/no drop-down
                       "parameters": {key: ({True: "yes", False: "no"}[value]
                                            if isinstance(value, bool) else value)
                                      for key, value in (spec.get("parameters") or {}).items()},
                       "description": spec.get("description") or f"offseason cycle ({name})"}
    return found


def deployments(root: Path, flow=None, work_pool: str | None = None) -> list:
    """RunnerDeployments of the cycle flow, one per spec, each limited to one run at a time."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.schedules import Cron

    if flow is None:
        from flows.orchestration.cycle import cycle as flow
    out = []
    for name, spec in specs(root).items():
        out.append(flow.to_deployment(
            name=name,
            schedules=[Cron(spec["cron"], timezone=spec["timezone"])] if spec["cron"] else None,
            parameters=spec["parameters"],
            description=spec["description"],
            tags=["offseason", root.name],
            concurrency_limit=ConcurrencyLimitConfig(
                limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
            work_pool_name=work_pool,
            # the checkout is the deployment's, not a Run form field (flows/orchestration/cycle.py)
            job_variables={"env": {PROJECT_ENV: str(root)}} if work_pool else None,
        ))
        # Every parameter's default is None (params.yaml's value). Left in the Run form's schema,
        # Prefect's UI sends that null for an untouched field and its server then refuses the run
        # ("None is not of type 'integer'"): the form gets no default, so an empty field is left out.
        for field in out[-1]._parameter_openapi_schema.properties.values():
            if field.get("default", "") is None:
                del field["default"]
    return out


def ensure_limit(root: Path) -> str:
    """Create the project's global concurrency limit of 1; returns its name."""
    from prefect.client.orchestration import get_client

    name = limit_name(root)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, 1)
    return name


def serve(root: Path) -> None:
    """Register the deployments and run their flow runs in this process until stopped."""
    from prefect import serve as prefect_serve

    found = deployments(root)
    name = ensure_limit(root)
    os.environ[PROJECT_ENV] = str(root)  # the flow runs, subprocesses of this one, work here
    print(f"serve: {len(found)} deployments of offseason-cycle ("
          + ", ".join(f"{d.name}: {d.schedules[0].schedule.cron if d.schedules else 'manual'}"
                      for d in found)
          + f"); one cycle at a time (concurrency limit {name!r}). Ctrl-C stops.", flush=True)
    prefect_serve(*found, limit=1)


def deploy(root: Path, work_pool: str) -> list[str]:
    """Register the deployments to a work pool, loading the flow from this folder's code."""
    from prefect import deploy as prefect_deploy
    from prefect import flow as load_flow

    flow = load_flow.from_source(source=str(root), entrypoint=ENTRYPOINT)
    found = deployments(root, flow=flow, work_pool=work_pool)
    ensure_limit(root)
    ids = prefect_deploy(*found, work_pool_name=work_pool, build=False, push=False,
                         print_next_steps_message=False)
    return [str(i) for i in ids]
