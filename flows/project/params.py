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
from dataclasses import dataclass
from pathlib import Path

from stages import config as cfg

SERVICES = ("langfuse", "langsmith")  # what `offseason pull` reads (flows/intake/pull.py)


@dataclass(frozen=True)
class Pull:
    """`pull:`: the tracing service a cycle pulls from first (`offseason pull`). Optional."""

    service: str = ""  # langfuse | langsmith; "" = no pull before a cycle
    project: str = ""  # LangSmith's project name ("" = LANGSMITH_PROJECT, else "default")
    limit: int = 0  # at most this many new traces a pull; 0 = every one in the window

    def __post_init__(self):
        """Refuse an unknown service and a negative limit."""
        if self.service not in ("", *SERVICES):
            raise cfg.ParamsError(f"pull.service: {self.service!r} is not a service offseason "
                                  f"pulls from; one of {', '.join(SERVICES)} (or '' for none)")
        if self.limit < 0:
            raise cfg.ParamsError(f"pull.limit: must be >= 0 (0: no limit), got {self.limit}")


@dataclass(frozen=True)
class Promotion:
    """What happens after the gate passed: a person's approval, if the team asks for it."""

    require_approval: bool = False  # wait for `offseason approve RUN_ID` (or the Prefect UI form)
    approval_timeout: int = 86400  # seconds to wait; then nothing is promoted and the run ends

    def __post_init__(self):
        """Refuse an approval timeout that is not positive."""
        if self.approval_timeout <= 0:
            raise cfg.ParamsError(f"promotion.approval_timeout: must be > 0 seconds, got "
                                  f"{self.approval_timeout}")


# Flow parameters of a cycle (`offseason serve` deployments, the Prefect UI's Run form) and the
# params.yaml key each one overrides for that run.
RUN_OVERRIDES = {
    "algorithm": "train.algorithm",
    "samples_per_task": "rollout.samples_per_task",
    "epochs": "train.{algorithm}.epochs",  # the run's algorithm
    "require_approval": "promotion.require_approval",
}
DEPLOYMENT_KEYS = ("cron", "parameters", "description")


@dataclass(frozen=True)
class Deployments:
    """`offseason serve`: when cycles run by themselves, and with which run parameters.

    Each deployment is `{cron: "<5-field cron>", parameters: {name: value}, description: "..."}`;
    `manual` has no cron (it runs from the Prefect UI's Run button or `prefect deployment run`),
    and an empty cron turns a scheduled one off. Parameter names are those of RUN_OVERRIDES.
    """

    timezone: str = "UTC"  # the cron schedules' time zone (an IANA name)
    nightly: dict = dataclasses.field(default_factory=lambda: {"cron": "0 2 * * *"})
    weekly: dict = dataclasses.field(
        default_factory=lambda: {"cron": "0 4 * * 6", "parameters": {"samples_per_task": 8}})
    manual: dict = dataclasses.field(default_factory=dict)

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


def plain(section) -> dict:
    """A loaded section as plain data (for MLflow params and `offseason check`): a dataclass's
    fields, or, for `environments:`, each environment's.
    """
    if dataclasses.is_dataclass(section):
        return dataclasses.asdict(section)
    return {name: dataclasses.asdict(spec) for name, spec in section.items()}
