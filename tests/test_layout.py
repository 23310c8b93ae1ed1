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


# docs/layout.md (flows/__init__.py points there): what each folder of flows/ may import of flows/, every import read
FLOWS_MAY_IMPORT = {"project": set(), "intake": {"project"},
                    "audit": {"project", "intake"},
                    "orchestration": {"project", "intake", "audit"},
                    "cli": {"project", "intake", "audit", "orchestration"}}


def flows_folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "flows" and len(parts) > 1 else None


def test_flows_folders_import_what_their_rule_allows(graph):
    assert {flows_folder(m) for m in graph if m.startswith("flows.")} == set(FLOWS_MAY_IMPORT)
    broken = sorted(
        f"{module} imports {target}" for module, targets in graph.items()
        if (kind := flows_folder(module)) for target in targets
        if (other := flows_folder(target)) and other != kind
        and other not in FLOWS_MAY_IMPORT[kind])
    assert broken == [], "imports against flows/' rules (docs/layout.md)"


def test_the_flows_rule_sees_a_function_level_import(graph):
    # the check above is not vacuous: pipeline imports promotion and lineage inside a function
    assert {"flows.orchestration.promotion", "flows.audit.lineage"} <= \
        graph["flows.orchestration.pipeline"]


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


def test_the_cycle_order_is_dvc_yamls():
    """The stage order is written once (stages/config.py's CYCLE), as dvc.yaml runs them."""
    from stages import config as cfg

    stages = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    assert list(cfg.CYCLE) == stages
    typed_out = [str(path.relative_to(REPO)) for root in ROOTS for path in (REPO / root).rglob("*.py")
                 if '"validate", "rollout", "reward"' in path.read_text()
                 and path.name != "config.py"]
    assert typed_out == [], "the stage order typed out again: import stages.config.CYCLE"


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_project_import_names_something_that_exists():
    """`from flows import collect` after collect moved to flows/intake/ failed only when the
    command ran (an import inside a function); every import of the project's own modules, in
    the code, the tests and the benchmarks, is checked here from the source."""
    known = modules()
    missing = []
    for path in [*(REPO / "flows").rglob("*.py"), *(REPO / "stages").rglob("*.py"),
                 *(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                    node.module.split(".")[0] in ROOTS:
                if node.module not in known:
                    missing.append(f"{path.relative_to(REPO)}: {node.module}")
                    continue
                defined = top_level_names(known[node.module])
                missing += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" not in known and a.name not in defined]
            elif isinstance(node, ast.Import):
                missing += [f"{path.relative_to(REPO)}: {a.name}" for a in node.names
                            if a.name.split(".")[0] in ROOTS and a.name not in known]
    assert missing == []


# docs/layout.md (stages/__init__.py points there): what each room of stages/ may import of stages/ outside itself, every
# import read; a package's __init__ (a docstring, no imports) is not counted
STAGES_MAY_IMPORT = {
    "envs": {"envs.judge": {"config", "remote", "http", "servers"}, "envs.replay": {"config"},
             "envs.mcp_tools": {"remote"}},
    "generation": {"*": {"tinylm", "envs.contract", "remote", "http", "servers"}},
    "training": {"*": {"tinylm", "io", "envs.contract", "generation.chat"}},
    "traces": {"*": set()},
    "config": {"*": {"envs.sandbox", "envs.mcp_tools"}},
    "io": {"*": {"config", "envs.contract", "envs.errors", "modelfiles"}},
    "tinylm": {"*": {"modelfiles"}},
    "modelfiles": {"*": set()},
    "remote": {"*": set()},
    "http": {"*": set()},
    "servers": {"*": set()},
    "weights": {"*": {"http"}},
    "live_gate": {"*": {"config", "envs.contract"}},
    "erasure": {"*": set()},
}
FOLDERS = ("envs", "generation", "training", "traces")


def room(module: str) -> str:
    """`stages.envs.judge` -> `envs`, `stages.io` -> `io`."""
    return module.split(".")[1]


def test_stages_rooms_import_what_their_rule_allows(graph):
    packages = {m for m, path in modules().items() if path.name == "__init__.py"}
    broken = []
    for module, targets in graph.items():
        if not module.startswith("stages.") or module in packages or \
                room(module) not in STAGES_MAY_IMPORT:
            continue
        rules = STAGES_MAY_IMPORT[room(module)]
        allowed = rules.get(module.removeprefix("stages."), rules.get("*", set()))
        for target in targets - packages:
            if not target.startswith("stages.") or room(target) == room(module):
                continue
            if target.removeprefix("stages.") not in allowed:
                broken.append(f"{module} imports {target}")
    assert sorted(broken) == [], "imports against stages/' rules (docs/layout.md)"


def test_every_room_of_stages_has_a_rule():
    rooms = {path.stem if path.is_file() else path.name for path in (REPO / "stages").iterdir()
             if (path.suffix == ".py" and path.stem != "__init__") or path.name in FOLDERS}
    stage_modules = set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]) | {
        "init", "simulate", "datadocs", "budget"}
    assert rooms - stage_modules - set(STAGES_MAY_IMPORT) == set()


def test_every_stage_declares_its_numbers_as_its_dvc_metric():
    """Each stage's whole record (metrics/<stage>.json) is a plain output; its numbers alone
    (stages/io.py numbers_path) are the DVC metric, so `dvc metrics diff` compares numbers."""
    from stages import io

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, spec in stages.items():
        outs = [next(iter(e)) if isinstance(e, dict) else e for e in spec.get("outs") or []]
        metrics = [next(iter(e)) for e in spec.get("metrics") or []]
        record = f"metrics/{name}.json"
        assert record in outs, (name, outs)
        assert metrics == [str(io.numbers_path(record))], (name, metrics)
