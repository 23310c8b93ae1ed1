"""Run-scoped params: a cycle's flow parameters written into params.yaml for that one run.

DVC stages read only `params.yaml` (`dvc repro` has no per-run values), so a run started with
`samples_per_task=8` from the Prefect UI writes that value into `params.yaml` before the stages
run, and the cycle's commit records it: `params.yaml` and `dvc.lock` at the tag hold the values the
stages really used (so `git checkout gen-N && dvc status` is clean), and the promotion record lists
the overrides. When the cycle ends (done, failed or stopped early) the file goes back to exactly
the text it had, comments included: overrides never become the standing config.

Only the value of each overridden key is rewritten, in place, so comments survive in the commit too.
A consequence worth knowing: the next cycle without overrides sees params that differ from the last
cycle's, and runs even with no new traces (its stages then run with the standing values).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import yaml

from stages import config as cfg
from stages import io


def from_parameters(**values) -> dict[str, object]:
    """Flow parameters (None = keep params.yaml's value) -> {"section.key": value}."""
    unknown = set(values) - set(cfg.RUN_OVERRIDES)
    if unknown:
        raise cfg.ParamsError(f"unknown run parameter(s) {sorted(unknown)}; valid: "
                              f"{', '.join(cfg.RUN_OVERRIDES)}")
    return {cfg.RUN_OVERRIDES[k]: v for k, v in values.items() if v is not None}


def rewrite(text: str, overrides: dict[str, object]) -> str:
    """params.yaml text with each `section.key` set to its value, everything else untouched."""
    lines = text.splitlines(keepends=True)
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        rendered = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
        rendered = rendered.strip()
        start = next((i for i, line in enumerate(lines) if re.match(rf"{section}:(\s|$)", line)),
                     None)
        if start is None:
            raise cfg.ParamsError(f"params.yaml: no section '{section}:' to override "
                                  f"{dotted} in; add the section")
        end = next((i for i in range(start + 1, len(lines))
                    if lines[i].strip() and not lines[i][0].isspace()), len(lines))
        for i in range(start + 1, end):
            match = re.match(rf"(\s+{re.escape(key)}:\s*)([^#\n]*?)(\s*#.*)?(\n?)$", lines[i])
            if match:
                lines[i] = f"{match.group(1)}{rendered}{match.group(3) or ''}{match.group(4)}"
                break
        else:
            lines.insert(start + 1, f"  {key}: {rendered}\n")
    return "".join(lines)


@contextmanager
def applied(root: Path, overrides: dict[str, object]):
    """params.yaml with the overrides for the duration of the block, checked, then restored."""
    path = root / "params.yaml"
    if not overrides:
        yield
        return
    original = path.read_text()
    io.write_text(path, rewrite(original, overrides))
    try:
        cfg.load_all(path)  # a bad value fails now, naming the key, before any stage runs
        yield
    finally:
        io.write_text(path, original)
