"""The house's shape, from the source alone: no import circles, stages/ free of Prefect and flows/,
and dvc.yaml's deps covering every module each stage imports (a missing one is a lineage hole:
editing it would not rerun the stage).

Imports are read with `ast`, function-level ones included (the stages import heavy libraries
lazily); a module loaded by name at run time (`importlib.import_module`) is not seen, so the
folder that holds such modules must be a dep as a whole (train: stages/training).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO

ROOTS = ("flows", "stages")


def modules() -> dict[str, Path]:
    found = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (a package's __init__ counts as imported with it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                out.add(candidate)
                # importing a.b.c runs a/__init__ and a/b/__init__ first
                parent = candidate.rpartition(".")[0]
                while parent:
                    if parent in known:
                        out.add(parent)
                    parent = parent.rpartition(".")[0]
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_circles(graph):
    in_a_circle = sorted(m for m in graph if any(m in closure(graph, n) for n in graph[m]))
    assert in_a_circle == []


def test_stages_import_neither_prefect_nor_flows():
    offenders = []
    for path in (REPO / "stages").rglob("*.py"):
        text = path.read_text()
        if re.search(r"^\s*(from|import) (prefect|flows)\b", text, re.M):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_every_module_a_stage_imports_is_a_dep(graph):
    known = modules()
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    missing = {}
    for name, stage in stages.items():
        module = re.search(r"python -m ([\w.]+)", stage["cmd"]).group(1)
        deps = [str(d) if isinstance(d, str) else next(iter(d)) for d in stage["deps"]]
        for needed in sorted(closure(graph, module)):
            path = known[needed].relative_to(REPO).as_posix()
            if path == "stages/__init__.py":  # a docstring: what changes it cannot change a result
                continue
            if not any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps):
                missing.setdefault(name, []).append(path)
    assert missing == {}, f"dvc.yaml deps miss modules their stage imports: {missing}"


def test_the_test_sees_a_lineage_hole(graph):
    # the check above is not vacuous: gate imports the environment contract (and through it the
    # sandbox) and the generation loop
    assert {"stages.envs.contract", "stages.envs.sandbox", "stages.generation.episode"} <= \
        closure(graph, "stages.champion_scores")


@pytest.mark.xdist_group("canary")
def test_xdist_groups_are_applied(request):
    """Under `--dist loadgroup` a grouped test's id carries its group: without it each worker
    builds the lineage and security projects again (pytest 9.2 with pytest-xdist 3.8 loses the
    group; constraints.txt pins pytest). Nothing to check in one process.
    """
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@canary"), (
        f"{request.node.nodeid}: xdist's group is lost; install the pytest and pytest-xdist "
        f"versions in constraints.txt")
