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

from flows import params as settings
from stages import config as cfg
from stages import io


def from_parameters(params: Path, **values) -> dict[str, object]:
    """Flow parameters (None = keep params.yaml's value) -> {"section.key": value}. `epochs`
    belongs to the run's algorithm (`train.<algorithm>.epochs`): the one this run sets, else the
    one `params` (params.yaml) names.
    """
    unknown = set(values) - set(settings.RUN_OVERRIDES)
    if unknown:
        raise cfg.ParamsError(f"unknown run parameter(s) {sorted(unknown)}; valid: "
                              f"{', '.join(settings.RUN_OVERRIDES)}")
    chosen = {k: v for k, v in values.items() if v is not None}
    algorithm = chosen.get("algorithm")
    if algorithm is None and any("{algorithm}" in settings.RUN_OVERRIDES[k] for k in chosen):
        algorithm = cfg.load("train", params).algorithm  # read only when a key needs it
    return {settings.RUN_OVERRIDES[k].format(algorithm=algorithm): v for k, v in chosen.items()}


def rewrite(text: str, overrides: dict[str, object]) -> str:
    """params.yaml text with each dotted key (`section.key`, `section.sub.key`) set to its value,
    everything else untouched; a missing key (or sub-section) is added at the top of its parent.
    """
    lines = text.splitlines(keepends=True)
    for dotted, value in overrides.items():
        rendered = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
        rendered = rendered.strip()
        start, end, depth = -1, len(lines), 0  # the block the next key is looked up in
        parts = dotted.split(".")
        for depth, key in enumerate(parts):
            indent = "  " * depth
            found = next((i for i in range(start + 1, end)
                          if re.match(rf"{indent}{re.escape(key)}:(\s|$)", lines[i])), None)
            if found is None:
                if depth == 0:
                    raise cfg.ParamsError(f"params.yaml: no section '{key}:' to override "
                                          f"{dotted} in; add the section")
                new = [f"{'  ' * d}{k}:\n" for d, k in enumerate(parts[depth:-1], depth)]
                new.append(f"{'  ' * (len(parts) - 1)}{parts[-1]}: {rendered}\n")
                lines[start + 1:start + 1] = new
                break
            if depth == len(parts) - 1:
                match = re.match(rf"(\s*{re.escape(key)}:\s*)([^#\n]*?)(\s*#.*)?(\n?)$",
                                 lines[found])
                lines[found] = f"{match.group(1)}{rendered}{match.group(3) or ''}{match.group(4)}"
                break
            start = found
            end = next((i for i in range(found + 1, end) if lines[i].strip()
                        and len(lines[i]) - len(lines[i].lstrip()) <= len(indent)
                        and not lines[i].lstrip().startswith("#")), end)
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
        settings.load_all(path)  # a bad value fails now, naming the key, before any stage runs
        yield
    finally:
        io.write_text(path, original)
