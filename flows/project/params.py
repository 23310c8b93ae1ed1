"""The whole params.yaml as a cycle reads it: the stages' sections and the flow's own.

The stages' sections (`base:`, `init:` ... `gate:`) are `stages/config.py`'s; the flow adds
`promotion:` (a person's approval after the gate), `deployments:` (`offseason serve`'s
schedules) and `pull:` (the tracing service a cycle pulls from first, flows/intake/pull.py), which
no stage reads, and
the run parameters of a cycle (the Prefect UI's Run form)
with the params.yaml key each overrides. `load_all` checks every section before a cycle starts.

    offseason check         # check params.yaml and print it with every default filled in
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from pydantic import Field

from stages import config as cfg

SERVICES = ("langfuse", "langsmith")  # what `offseason pull` reads (flows/intake/pull.py)


@cfg.section("pull")
class Pull:
    """`pull:`: the tracing service a cycle pulls from first (`offseason pull`). Optional."""

    service: str = Field("", description="langfuse or langsmith; \"\" = no pull before a cycle")
    project: str = Field("", description="LangSmith's project name (\"\" = LANGSMITH_PROJECT, "
                                         "else \"default\")")
    limit: int = Field(0, ge=0, description="at most this many new traces a pull; 0 = every one "
                                            "in the window")
    stall_seconds: cfg.Float = Field(30.0, gt=0, description="no answer from the service for "
                                     "this long (a request, never retried after a timeout): the "
                                     "pull fails, naming it; the traces pulled before are "
                                     "written and the next pull goes on from there")

    def __post_init__(self):
        """Refuse an unknown service."""
        if self.service not in ("", *SERVICES):
            raise cfg.ParamsError(f"pull.service: {self.service!r} is not a service offseason "
                                  f"pulls from; one of {', '.join(SERVICES)} (or '' for none)")


@cfg.section("promotion")
class Promotion:
    """What happens after the gate passed: a person's approval, if the team asks for it."""

    require_approval: bool = Field(False, description="wait for `offseason approve RUN_ID` (or "
                                                      "the Prefect UI form)")
    approval_timeout: int = Field(86400, gt=0, description="seconds to wait; then nothing is "
                                                           "promoted and the run ends")


# Flow parameters of a cycle (`offseason serve` deployments, the Prefect UI's Run form) and the
# params.yaml key each one overrides for that run.
RUN_OVERRIDES = {
    "algorithm": "train.algorithm",
    "samples_per_task": "rollout.samples_per_task",
    "epochs": "train.{algorithm}.epochs",  # the run's algorithm
    "require_approval": "promotion.require_approval",
}
DEPLOYMENT_KEYS = ("cron", "parameters", "description")


@cfg.section("deployments")
class Deployments:
    """`offseason serve`: when cycles run by themselves, and with which run parameters.

    Each deployment is `{cron: "<5-field cron>", parameters: {name: value}, description: "..."}`;
    `manual` has no cron (it runs from the Prefect UI's Run button or `prefect deployment run`),
    and an empty cron turns a scheduled one off. Parameter names are those of RUN_OVERRIDES.
    """

    timezone: str = Field("UTC", description="the cron schedules' time zone (an IANA name)")
    nightly: dict = Field(default_factory=lambda: {"cron": "0 2 * * *"},
                          description="the nightly cycle: {cron, parameters, description}")
    weekly: dict = Field(
        default_factory=lambda: {"cron": "0 4 * * 6", "parameters": {"samples_per_task": 8}},
        description="the weekly cycle: {cron, parameters, description}")
    manual: dict = Field(default_factory=dict, description="run from the Prefect UI's Run button "
                                                           "or `prefect deployment run`; no cron")

    def __post_init__(self):
        """Refuse unknown keys in the deployments' specs."""
        for name, spec in {"nightly": self.nightly, "weekly": self.weekly,
                           "manual": self.manual}.items():
            for key in spec:
                if key not in DEPLOYMENT_KEYS:
                    raise cfg.ParamsError(f"deployments.{name}.{key}: unknown key; valid keys: "
                                      f"{', '.join(DEPLOYMENT_KEYS)}")
            if name == "manual" and spec.get("cron"):
                raise cfg.ParamsError("deployments.manual.cron: the manual deployment has no "
                                  "schedule; put the cron on nightly or weekly")
            cron = spec.get("cron") or ""
            if not isinstance(cron, str) or (cron and len(cron.split()) != 5):
                raise cfg.ParamsError(f"deployments.{name}.cron: expected a 5-field cron like "
                                  f"'0 2 * * *' (or '' for none), got {cron!r}")
            parameters = spec.get("parameters") or {}
            if not isinstance(parameters, dict):
                raise cfg.ParamsError(f"deployments.{name}.parameters: expected a mapping like "
                                  f"{{samples_per_task: 8}}, got {parameters!r}")
            for key in parameters:
                if key not in RUN_OVERRIDES:
                    raise cfg.ParamsError(f"deployments.{name}.parameters.{key}: unknown run "
                                      f"parameter; valid: {', '.join(RUN_OVERRIDES)}")


SECTIONS: dict[str, type] = {**cfg.SECTIONS, "promotion": Promotion, "deployments": Deployments,
                             "pull": Pull}


def load_all(path: str | Path = "params.yaml") -> dict:
    """Every section of params.yaml, the flow's included, checked."""
    from stages.generation.tool_parsers import PARSERS

    configs = cfg.load_all(path, SECTIONS)
    try:
        configs["rollout"].check_tool_parser(PARSERS)
    except cfg.ParamsError as err:
        raise cfg.ParamsError(f"{path}: {err}") from None
    return configs


REFERENCE_HEAD = """# params.yaml reference

Every section and key of `params.yaml`: its type, default, bounds and what it does. Generated from
the declarations in `stages/config.py` and `flows/project/params.py` by `offseason check
--explain > docs/params.md`; `tests/stages/test_config.py` fails when the two differ, so edit the
declarations, not this file. Rules that tie settings together (a server command or URLs, not
both) and the names a setting may take are in each class's `__post_init__`; `offseason check`
applies them all.

Keys under `runtime.<section>` say where or how fast work runs, not what it computes: no DVC stage
lists them as params, so changing one reruns nothing.
"""


def reference() -> str:
    """docs/params.md (and `offseason check --explain`): every section, the flow's included,
    then `environments:` and the runtime-only sections, each key with its type, default, bounds
    and description, from the declarations.
    """
    lines = [REFERENCE_HEAD.rstrip()]

    def table(name: str, cls: type, keys: list[str]):
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        lines.extend(["", f"## `{name}:`", "", doc, "",
                      "| key | type | default | bounds | description |", "|---|---|---|---|---|"])
        subsections = []
        for key in keys:
            field = cls.__pydantic_fields__[key]
            default = field.get_default(call_default_factory=True)
            if dataclasses.is_dataclass(default):  # train.sft: a table of its own, below
                subsections.append((f"{name}.{key}", type(default)))
                continue
            kind = field.annotation
            row = (f"`{key}`", str(kind) if typing.get_args(kind) else kind.__name__,
                   f"`{json.dumps(default)}`", cfg.bounds(field), field.description)
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
        for sub, sub_cls in subsections:
            table(sub, sub_cls, [f.name for f in dataclasses.fields(sub_cls)])

    for name, cls in {**SECTIONS, "environments.<name>": cfg.EnvironmentSpec}.items():
        runtime = cfg.RUNTIME.get(name, ())
        table(name, cls, [f.name for f in dataclasses.fields(cls) if f.name not in runtime])
        if runtime:
            table(f"runtime.{name}", cls, list(runtime))
    table("runtime.collect", cfg.Collect, list(cfg.RUNTIME["collect"]))
    table("runtime.sandbox", cfg.Sandbox, list(cfg.RUNTIME["sandbox"]))
    table("runtime.mcp", cfg.Mcp, list(cfg.RUNTIME["mcp"]))
    table("runtime.fleet", cfg.Fleet, list(cfg.RUNTIME["fleet"]))
    table("runtime.mlflow", cfg.Mlflow, list(cfg.RUNTIME["mlflow"]))
    table("runtime.dvc", cfg.Dvc, list(cfg.RUNTIME["dvc"]))
    return "\n".join(lines) + "\n"


def plain(section) -> dict:
    """A loaded section as plain data (for MLflow params and `offseason check`): a dataclass's
    fields, or, for `environments:`, each environment's.
    """
    if dataclasses.is_dataclass(section):
        return dataclasses.asdict(section)
    return {name: dataclasses.asdict(spec) for name, spec in section.items()}
