"""Run-scoped params: a cycle's flow parameters written into params.yaml for that one run.

DVC stages read only `params.yaml` (`dvc repro` has no per-run values), so a run started with
`samples_per_task=8` from the Prefect UI writes that value into `params.yaml` before the stages
run, and the cycle's commit records it: `params.yaml` and `dvc.lock` at the tag hold the values the
stages really used (so `git checkout gen-N && dvc status` is clean), and the promotion record lists
the overrides. When the cycle ends (done, failed or stopped early) the file goes back to exactly
the text it had, comments included: overrides never become the standing config.

Only the value of each overridden key is rewritten, in place (a round trip through ruamel.yaml),
so comments survive in the commit too.
A consequence worth knowing: the next cycle without overrides sees params that differ from the last
cycle's, and runs even with no new traces (its stages then run with the standing values).
"""

from __future__ import annotations

import io as textio
import json
from contextlib import contextmanager
from pathlib import Path

from flows.project import params as settings
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


def _round_trip():
    """ruamel.yaml set to write params.yaml back as it was read: its comments, quotes, blank
    lines and two-space indent (an unchanged file comes back byte for byte).
    """
    from ruamel.yaml import YAML

    editor = YAML()
    editor.preserve_quotes = True
    editor.width = 4096  # never fold a long line
    editor.indent(mapping=2, sequence=4, offset=2)
    return editor


def rewrite(text: str, overrides: dict[str, object]) -> str:
    """params.yaml text with each dotted key (`section.key`, `section.sub.key`) set to its value,
    everything else untouched (a round trip through ruamel.yaml, as DVC edits its own files); a
    missing key (or sub-section) is added at the top of its parent.
    """
    from ruamel.yaml.comments import CommentedMap

    editor = _round_trip()
    document = editor.load(text)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if not isinstance(document, CommentedMap) or parts[0] not in document:
            raise cfg.ParamsError(f"params.yaml: no section '{parts[0]}:' to override "
                                  f"{dotted} in; add the section")
        node = document[parts[0]]
        for depth, key in enumerate(parts[1:-1], 1):
            if not isinstance(node, CommentedMap):
                raise cfg.ParamsError(f"params.yaml: {'.'.join(parts[:depth])} is not a "
                                      f"section, so {dotted} cannot be set")
            if key not in node:
                node.insert(0, key, CommentedMap())
            node = node[key]
        if not isinstance(node, CommentedMap):
            raise cfg.ParamsError(f"params.yaml: {'.'.join(parts[:-1])} is not a section, so "
                                  f"{dotted} cannot be set")
        if parts[-1] in node:
            node[parts[-1]] = value
        else:
            node.insert(0, parts[-1], value)
    out = textio.StringIO()
    editor.dump(document, out)
    return out.getvalue()


@contextmanager
def applied(root: Path, overrides: dict[str, object]):
    """params.yaml with the overrides for the duration of the block, checked, then restored."""
    path = root / "params.yaml"
    if not overrides:
        yield
        return
    from flows.project.workspace import git

    original = path.read_text()
    head = git(root, "rev-parse", "--verify", "--quiet", "HEAD", check=False)
    io.write_text(path, rewrite(original, overrides))
    try:
        settings.load_all(path)  # a bad value fails now, naming the key, before any stage runs
        yield
    finally:
        io.write_text(path, original)
        # The cycle's commit (gen-N) holds the run's values. Put back, the standing ones would
        # show as an edit of params.yaml in the work tree from then on (issue 53.9), and the next
        # commit would carry them unnamed: they are committed back at once, saying so.
        if git(root, "rev-parse", "--verify", "--quiet", "HEAD", check=False) != head and \
                git(root, "show", "HEAD:params.yaml", check=False) != original.strip():
            git(root, "commit", "--quiet", "-m", "params.yaml: the standing values again, after "
                f"the run's overrides ({', '.join(f'{k}={json.dumps(v)}' for k, v in overrides.items())})",
                "--", "params.yaml")
