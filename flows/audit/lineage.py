"""Lineage audits: from a model back to the traces it learned from, and from a trace to the models.

Everything is read from what each cycle committed and tagged (`gen-N`): `dvc.lock` (every stage's
deps and outs with their DVC hashes), the `.dvc` pointer files (the inbox snapshot, the champion),
`metrics/*.json` (the verdict, the promotion record) and, through the hashes, the DVC cache
(`.dvc/cache`) or the DVC remote (`.dvcstore/` by default): the training examples of
`data/replay/` (their `task_id` names the trace: `trace_id_of`), the traces of `data/traces/` (trace id -> inbox
file). MLflow adds the run and the model version when its database is there.

    offseason lineage gen-3                 # the chain, as text (--json for scripts)
    offseason lineage 4                     # the same, by MLflow model version
    offseason lineage --verify gen-3        # every recorded hash still resolves and matches
    offseason lineage --trace TRACE_ID      # every generation that learned from this trace

A generation "learned from" a trace directly when the trace is in the training data it was trained
on (`data/replay/` as committed at its tag: this cycle's examples and the replayed earlier ones;
with `train.replay_fraction` below 1 only a sample of the replayed ones was used, so this is the
conservative answer a deletion request needs), and by inheritance when the champion it started from
learned from it.

`check_champion` uses verify's per-file checks on `models/champion` alone: every cycle runs it
before its first stage, and `offseason rollback` before it restores a generation's champion.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from flows.project.workspace import DVC_ADDED, WorkspaceError, generations, git, read_at, run


def how(gate: dict) -> str:
    """How a verdict was reached, in a few words: its test and error rate (a verdict from before
    `gate.alpha` names its two-sided bootstrap confidence instead).
    """
    if gate.get("alpha") is not None:
        return f"{gate.get('test') or 'paired bootstrap'}, alpha {gate['alpha']}"
    return f"{gate.get('confidence')} paired bootstrap"


class LineageError(WorkspaceError):
    """The generation or model version asked about does not exist; the message says which do."""


def show(root: Path, ref: str, path: str) -> bytes | None:
    """A file's bytes at a git ref, or None when the ref does not have it."""
    out = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=root, capture_output=True)
    return out.stdout if out.returncode == 0 else None


def yaml_at(root: Path, ref: str, path: str) -> dict:
    """A YAML file at a git ref as a dict ({} when missing or empty)."""
    data = show(root, ref, path)
    return (yaml.safe_load(data) or {}) if data else {}


# --- the DVC object store: cache and remote --------------------------------------------------

def stores(root: Path) -> dict[str, Path]:
    """Where DVC keeps objects: the cache and every remote that is a local folder."""
    from flows.project.workspace import dvc_remotes

    found = {"cache": root / ".dvc" / "cache"}
    for name, settings in dvc_remotes(root)[1].items():
        url = settings.get("url", "")
        if url and "://" not in url:  # a local folder, relative to .dvc/
            found[f"remote {name}"] = (root / ".dvc" / url).resolve()
    return found


def object_path(store: Path, md5: str) -> Path:
    """Where a DVC store keeps the object with this md5."""
    return store / "files" / "md5" / md5[:2] / md5[2:]


def md5_of(data: bytes) -> str:
    """The md5 hex digest of the bytes, as DVC names objects."""
    return hashlib.md5(data).hexdigest()


def read_object(root: Path, md5: str) -> bytes | None:
    """An object's bytes from the first store that has an intact copy."""
    for store in stores(root).values():
        path = object_path(store, md5)
        if path.is_file():
            data = path.read_bytes()
            if md5_of(data) == md5.removesuffix(".dir"):
                return data
    return None


def manifest(root: Path, md5: str) -> list[dict]:
    """The files of a DVC-tracked folder: [{"relpath", "md5"}, ...]."""
    data = read_object(root, md5)
    if data is None:
        raise LineageError(f"the folder manifest {md5} is in neither the DVC cache nor the "
                           f"remote; run `dvc fetch` or `offseason lineage --verify`")
    return json.loads(data)


def stored_object(root: Path, md5: str) -> bytes:
    """The bytes of the object with this md5; LineageError when it is nowhere to be read."""
    data = read_object(root, md5)
    if data is None:
        raise LineageError(f"object {md5} is in neither the DVC cache nor the remote; run "
                           f"`dvc fetch` or `offseason lineage --verify`")
    return data


def parquet_column(root: Path, md5: str, columns: list[str]) -> list[dict]:
    """The rows (only `columns`) of the parquet object with this md5."""
    return read_parquet(stored_object(root, md5), columns).to_pylist()


def read_parquet(data: bytes, columns: list[str] | None):
    """A Parquet file's columns (None: all) from bytes in memory, read in this thread alone.

    Not `pq.read_table`: it reads through Arrow's dataset scanner, whose pool thread (started
    even with `use_threads=False`) can drop its last reference to these Python bytes after the
    table is returned; when the interpreter was exiting by then, that thread, waiting for the
    GIL, was ended by Python inside a C++ destructor: SIGABRT, "terminate called without an
    active exception", after the command had printed its answer (1 run in 150 of `lineage
    --trace` on a busy machine). `ParquetFile.read` without pre-buffering starts no thread.
    """
    return pq.ParquetFile(pa.BufferReader(data), pre_buffer=False).read(columns=columns,
                                                                        use_threads=False)


# --- what a generation recorded -------------------------------------------------------------

def resolve(root: Path, ref: str) -> int:
    """`gen-N`, `N` as a generation when prefixed, or an MLflow model version -> the generation."""
    known = generations(root)
    if ref.startswith("gen-") and ref[4:].isdigit():
        generation = int(ref[4:])
        if generation not in known:
            raise LineageError(f"no generation {ref}: the tags are "
                               f"{', '.join(f'gen-{g}' for g in known) or 'none yet'}")
        return generation
    version = ref.removeprefix("v")
    if version.isdigit():
        for generation in known:
            record = read_at(root, f"gen-{generation}", "metrics/promotion.json") or {}
            if str(record.get("model_version")) == version:
                return generation
        raise LineageError(f"no generation has MLflow model version {version}; `offseason "
                           f"history` lists the versions")
    raise LineageError(f"{ref!r} is neither a generation (gen-N) nor a model version (a number)")


def pointer_hash(root: Path, ref: str, path: str) -> str | None:
    """The md5 a `.dvc` pointer file records at a git ref, or None."""
    outs = yaml_at(root, ref, path).get("outs") or []
    return outs[0].get("md5") if outs else None


def stage_files(root: Path, tag: str) -> dict[str, dict]:
    """Each stage of dvc.lock at the tag: its deps, outs (path, md5, kind) and params."""
    lock = yaml_at(root, tag, "dvc.lock").get("stages", {})
    stages = {}
    for name, entry in lock.items():
        stages[name] = {
            "cmd": entry.get("cmd"),
            "params": entry.get("params", {}),
            "deps": [{"path": d["path"], "md5": d.get("md5")} for d in entry.get("deps", [])],
            "outs": [{"path": o["path"], "md5": o.get("md5")} for o in entry.get("outs", [])],
        }
    return stages


def out_hash(stages: dict, path: str) -> str | None:
    """The md5 a stage records for an out at `path`, or None when no stage has it."""
    for stage in stages.values():
        for out in stage["outs"]:
            if out["path"] == path:
                return out["md5"]
    return None


def trace_id_of(row: dict) -> str | None:
    """The trace behind a training example: on the tag path its `task_id` is the trace id; on the
    chat path (an `environment` column) it is `<environment>:trace:<trace id>` for a task from a
    trace and `<environment>:<task id>` for a task of the environment's task file (no trace).
    """
    if not row.get("environment"):
        return row["task_id"]
    _, marker, trace_id = row["task_id"].partition(":trace:")
    return trace_id if marker else None


def training_trace_ids(root: Path, replay_md5: str, cache: dict) -> set[str]:
    """The trace ids of the training examples in a `data/replay/` folder version."""
    ids = set()
    erased = erased_objects(root)  # deleted by a deletion request: their rows are nowhere now
    for entry in manifest(root, replay_md5):
        if entry["md5"] in erased:
            continue
        if entry["md5"] not in cache:
            data = stored_object(root, entry["md5"])
            names = pq.read_schema(pa.BufferReader(data)).names
            columns = ["task_id"] + (["environment"] if "environment" in names else [])
            cache[entry["md5"]] = {trace_id_of(r) for r in read_parquet(data, columns).to_pylist()
                                   } - {None}
        ids |= cache[entry["md5"]]
    return ids


def inbox_files_of(root: Path, traces_md5: str | None, ids: set[str]) -> dict[str, int]:
    """Which inbox file each trace came from (data/traces/ keeps source_file): file -> count."""
    counts: dict[str, int] = {}
    if not traces_md5 or not ids:
        return counts
    for entry in manifest(root, traces_md5):
        if not entry["relpath"].endswith(".parquet") or \
                entry["relpath"].startswith(("duplicates-", "index-")) or \
                entry["md5"] in erased_objects(root):  # the accepted traces' parts only
            continue
        for row in parquet_column(root, entry["md5"], ["trace_id", "source_file"]):
            if row["trace_id"] in ids:
                counts[row["source_file"]] = counts.get(row["source_file"], 0) + 1
    return dict(sorted(counts.items()))


def champion_generation(root: Path, champion_md5: str | None, before: int) -> int | None:
    """The earlier generation that made these weights: the first whose champion has this hash."""
    for generation in [g for g in generations(root) if g < before]:
        if pointer_hash(root, f"gen-{generation}", "models/champion.dvc") == champion_md5:
            return generation
    return None


def approver_of(record: dict) -> str | None:
    """Who approved a promotion: the decision flows/orchestration/promotion.py writes into the record."""
    return (record.get("decision") or {}).get("approver")


def mlflow_info(root: Path, generation: int, version) -> dict:
    """The cycle's MLflow run and the model version, when MLflow's database is there."""
    import os

    if not os.environ.get("MLFLOW_TRACKING_URI") and not (root / "mlflow.db").exists():
        return {}
    from flows.project.workspace import configure_env

    configure_env(root)
    from stages import io

    with io.heavy_imports():
        import mlflow

        from flows.project import tracking

    client = mlflow.MlflowClient()
    found = tracking.find_experiment()
    if found is None:
        return {}
    runs = client.search_runs([found.experiment_id],
                              f"tags.`offseason.generation` = '{generation}'",
                              order_by=["attribute.start_time DESC"])
    runs = [r for r in runs if "mlflow.parentRunId" not in r.data.tags] or runs
    info = {}
    if runs:
        chosen = next((r for r in runs if r.data.tags.get("offseason.git_tag")), runs[0])
        info = {"run_id": chosen.info.run_id, "run_status": chosen.info.status,
                "experiment_id": found.experiment_id}
    if version is not None:
        try:
            mv = client.get_model_version(_registered_name(root), str(version))
            info.update({"model_name": mv.name, "model_source": mv.source,
                         "model_run_id": mv.run_id, "model_tags": dict(mv.tags)})
        except mlflow.exceptions.MlflowException:
            pass
    return info


def _registered_name(root: Path) -> str:
    params = yaml.safe_load((root / "params.yaml").read_text()) or {}
    return (params.get("base") or {}).get("registered_model", "offseason-agent")


def _log(root: Path) -> list[dict]:
    """promotions.jsonl as it is now (a rollback is in no cycle's tag of its generation)."""
    path = root / "promotions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def lineage(root: Path, ref: str, *, with_mlflow: bool = True, with_traces: bool = True) -> dict:
    """The whole chain of one generation, as a JSON-able dict."""
    generation = resolve(root, ref)
    tag = f"gen-{generation}"
    record = read_at(root, tag, "metrics/promotion.json") or {}
    stages = stage_files(root, tag)
    commit = git(root, "rev-parse", f"{tag}^{{commit}}")
    out = {
        "generation": generation, "tag": tag, "git_commit": commit,
        "committed": git(root, "log", "-1", "--format=%cI", tag),
        "message": git(root, "log", "-1", "--format=%s", tag),
        "model_version": record.get("model_version"), "promoted": record.get("promoted"),
        "champion_version": record.get("champion_version"),
        "approver": approver_of(record), "approval_reason": (record.get("decision") or {}).get("reason"),
        "overrides": record.get("overrides") or {},
        "inbox": {"path": "data/inbox", "md5": pointer_hash(root, tag, "data/inbox.dvc")},
        "champion": {"path": "models/champion", "md5": pointer_hash(root, tag,
                                                                    "models/champion.dvc")},
        "stages": stages,
        # what the promotion log says happened to it since: champion again, or rolled back from
        "rollbacks": [{k: e.get(k) for k in ("action", "generation", "from_generation", "at",
                                             "approver", "reason")}
                      for e in _log(root) if e.get("action") == "rollback"
                      and generation in (e.get("generation"), e.get("from_generation"))],
    }
    if generation == 0:
        out["gate"] = None
        out["started_from"] = None
        out["init"] = read_at(root, tag, "metrics/init.json")
        out["training_traces"] = []
        out["inbox_files"] = {}
    else:
        gate = read_at(root, tag, "metrics/gate.json") or {}
        out["gate"] = {k: gate.get(k) for k in ("passed", "candidate_score", "champion_score",
                                                "difference", "interval", "alpha", "test",
                                                "confidence", "rule",
                                                "reason")}
        start_md5 = next((d["md5"] for d in stages.get("train", {}).get("deps", [])
                          if d["path"] == "models/champion"), None)
        parent = champion_generation(root, start_md5, generation)
        parent_record = read_at(root, f"gen-{parent}", "metrics/promotion.json") or {} \
            if parent is not None else {}
        out["started_from"] = {"md5": start_md5, "generation": parent,
                               "tag": None if parent is None else f"gen-{parent}",
                               "model_version": parent_record.get("champion_version")}
        replay = out_hash(stages, "data/replay") if with_traces else None
        ids = training_trace_ids(root, replay, {}) if replay else set()
        out["training_traces"] = sorted(ids)
        out["inbox_files"] = inbox_files_of(root, out_hash(stages, "data/traces"), ids)
    if with_mlflow:
        out["mlflow"] = mlflow_info(root, generation, record.get("model_version"))
    return out


def text(chain: dict) -> str:
    """The chain for a person to read."""
    message = chain["message"]  # a cycle's commit message begins with its tag already
    lines = [message if message.startswith(f"{chain['tag']}:") else f"{chain['tag']}: {message}",
             f"  git commit     {chain['git_commit']} ({chain['committed']})",
             f"  model version  {chain['model_version']}"
             f"{' (promoted to champion)' if chain['promoted'] else ' (not promoted)'}"]
    for back in chain.get("rollbacks") or []:  # since then, by `offseason rollback`
        away = back["from_generation"] == chain["generation"]
        where = f"from it to gen-{back['generation']}" if away else \
            f"to it from gen-{back['from_generation']}"
        lines.append(f"  rolled back    {where} at {back['at']} by {back['approver']}: "
                     f"{back['reason']}")
    ml = chain.get("mlflow") or {}
    if ml.get("run_id"):
        lines.append(f"  MLflow run     {ml['run_id']} ({ml.get('run_status')})")
    if chain["started_from"]:
        start = chain["started_from"]
        lines.append(f"  started from   {start['tag'] or 'an unknown champion'} (model version "
                     f"{start['model_version']}, md5 {start['md5']})")
    if chain["gate"]:
        gate = chain["gate"]
        interval = gate.get("interval") or [None, None]
        lines.append(f"  gate           {'pass' if gate['passed'] else 'fail'}: candidate "
                     f"{gate['candidate_score']} vs champion {gate['champion_score']}, "
                     f"difference {gate['difference']} in [{interval[0]}, {interval[1]}] "
                     f"({how(gate)}): {gate['reason']}")
    lines.append(f"  approver       {chain['approver'] or '-'}"
                 f"{': ' + chain['approval_reason'] if chain.get('approval_reason') else ''}")
    if chain["overrides"]:
        lines.append(f"  run overrides  {json.dumps(chain['overrides'])}")
    if chain["inbox"].get("md5"):  # generation 0 read no inbox
        lines.append(f"  inbox snapshot {chain['inbox']['md5']}")
    if chain["inbox_files"]:
        lines.append(f"  learned from   {len(chain['training_traces'])} traces, from these inbox "
                     f"files:")
        lines += [f"                   {name}: {count} traces"
                  for name, count in chain["inbox_files"].items()]
        shown = chain["training_traces"][:5]
        lines.append(f"                 trace ids: {', '.join(shown)}"
                     f"{', ...' if len(chain['training_traces']) > 5 else ''} (--json lists all)")
    lines.append("  stages (dvc.lock at the tag):" if chain["stages"] else
                 "  stages         none: `offseason init` made it, no cycle")
    for name, stage in chain["stages"].items():
        lines.append(f"    {name}")
        for kind in ("deps", "outs"):
            for item in stage[kind]:
                lines.append(f"      {kind[:-1]:<4} {item['path']:<34} {item['md5']}")
    lines.append(f"  champion after {chain['champion']['md5']}")
    return "\n".join(lines)


# --- verify ---------------------------------------------------------------------------------

def _check_object(root: Path, md5: str) -> tuple[str, list[str]]:
    """"ok", "altered" or "missing" for one object, and where each copy stands."""
    notes, good, bad = [], False, False
    for name, store in stores(root).items():
        path = object_path(store, md5)
        if not path.is_file():
            continue
        if md5_of(path.read_bytes()) == md5.removesuffix(".dir"):
            good = True
        else:
            bad = True
            notes.append(f"altered in the {name} ({path})")
    if bad:
        return "altered", notes
    if not good and md5 in erased_objects(root):  # deleted on purpose, by a deletion request
        return "erased", [f"erased by {erased_objects(root)[md5]['erasure']} (data/tombstones.jsonl)"]
    return ("ok" if good else "missing"), notes


def erased_objects(root: Path) -> dict[str, dict]:
    """The DVC objects `offseason erase` deleted, by md5 (their tombstones)."""
    path = root / "data" / "tombstones.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    return {r["object"]: r for r in rows if r.get("object")}


def _check_files(root: Path, path: str, md5: str, workspace: bool = False) -> list[dict]:
    """The files of a folder version (`md5` ends in .dir) whose objects are altered or missing;
    with `workspace`, also those whose copy in the working tree differs or is missing.
    """
    problems = []
    for file in manifest(root, md5):
        status, notes = _check_object(root, file["md5"])
        local = root / path / file["relpath"]
        if workspace and not local.is_file():
            notes.append(f"missing in the workspace ({local})")
            status = "missing" if status == "ok" else status
        elif workspace and md5_of(local.read_bytes()) != file["md5"]:
            notes.append(f"altered in the workspace ({local})")
            status = "altered"
        if status != "ok":
            problems.append({"path": f"{path}/{file['relpath']}", "md5": file["md5"],
                             "status": status, "notes": notes})
    return problems


def _dir_hash_of_files(files: list[tuple[str, bytes]]) -> str:
    """DVC's hash of a folder: md5 of its sorted manifest, serialized the way dvc-data does."""
    entries = sorted(({"md5": md5_of(data), "relpath": rel} for rel, data in files),
                     key=lambda e: e["relpath"])
    return md5_of(json.dumps(entries, sort_keys=True).encode()) + ".dir"


def _check_git(root: Path, tag: str, path: str, md5: str) -> tuple[str, list[str]]:
    """A dep that lives in git (code, benchmarks): its content at the tag must hash the same."""
    if md5.endswith(".dir"):
        names = run(["git", "ls-tree", "-r", "--name-only", tag, "--", path], root,
                    check=False).stdout.split()
        files = [(n[len(path) + 1:], show(root, tag, n) or b"") for n in names]
        ok = names and _dir_hash_of_files(files) == md5
    else:
        data = show(root, tag, path)
        if data is None:
            return "missing", [f"not in git at {tag}"]
        ok = md5_of(data) == md5
    return ("ok", []) if ok else ("altered", [f"its content in git at {tag} hashes differently"])


def verify(root: Path, ref: str) -> dict:
    """Check every hash a generation recorded; returns the findings (`ok` is the verdict)."""
    chain = lineage(root, ref, with_mlflow=False, with_traces=False)  # reads no object yet
    tag = chain["tag"]
    # what git holds at the tag (code, benchmarks, `cache: false` metrics) is checked in git;
    # everything else must be in the DVC cache or the remote
    in_git = set(run(["git", "ls-tree", "-r", "--name-only", tag], root).stdout.split())
    tracked = {p for s in chain["stages"].values() for kind in ("deps", "outs") for p in
               (i["path"] for i in s[kind])
               if p not in in_git and not any(g.startswith(p + "/") for g in in_git)}
    tracked |= set(DVC_ADDED)
    items: dict[tuple[str, str], str] = {}  # (path, md5) -> who recorded it
    for name, stage in chain["stages"].items():
        for kind in ("deps", "outs"):
            for item in stage[kind]:
                if item["md5"]:
                    items.setdefault((item["path"], item["md5"]), f"{name} {kind[:-1]}")
    for key in ("inbox", "champion"):
        if chain[key]["md5"]:
            items.setdefault((chain[key]["path"], chain[key]["md5"]), f"{key} pointer (.dvc)")
    # the tag checked out: its outputs' and pointers' copies in the workspace are checked too
    # (the files one would deploy; a dep's hash may be an older version of the same path)
    here = run(["git", "rev-parse", "HEAD"], root).stdout.strip() == \
        run(["git", "rev-parse", f"{tag}^{{commit}}"], root).stdout.strip()
    current = {(item["path"], item["md5"]) for stage in chain["stages"].values()
               for item in stage["outs"]} | {(chain[key]["path"], chain[key]["md5"])
                                             for key in ("inbox", "champion")}
    results = []
    for (path, md5), who in sorted(items.items()):
        if path not in tracked:
            status, notes = _check_git(root, tag, path, md5)
            results.append({"path": path, "md5": md5, "recorded_by": who, "where": "git",
                            "status": status, "notes": notes})
            continue
        status, notes = _check_object(root, md5)
        entry = {"path": path, "md5": md5, "recorded_by": who, "where": "dvc", "status": status,
                 "notes": notes, "files": []}
        in_workspace = here and (path, md5) in current
        if md5.endswith(".dir") and status == "ok":
            entry["files"] = _check_files(root, path, md5, workspace=in_workspace)
            real = [f for f in entry["files"] if f["status"] != "erased"]
            if real:
                entry["status"] = "altered" if any(f["status"] == "altered"
                                                   for f in real) else "missing"
            elif entry["files"]:
                entry["status"] = "erased"
        elif in_workspace and status == "ok":
            local = root / path
            if not local.is_file() or md5_of(local.read_bytes()) != md5:
                entry["status"] = "altered" if local.is_file() else "missing"
                entry["notes"].append(f"{entry['status']} in the workspace ({local})")
        results.append(entry)
    problems = [r for r in results if r["status"] not in ("ok", "erased")]
    absent = {name: str(store) for name, store in stores(root).items()
              if name != "cache" and not store.is_dir()}
    return {"generation": chain["generation"], "tag": tag, "ok": not problems,
            "checked": len(results), "problems": problems, "results": results,
            "workspace_checked": here, "absent_remotes": absent}


def verify_text(report: dict) -> str:
    """The verify report as text, one problem (and its notes) a line."""
    lines = [f"{report['tag']}: {report['checked']} recorded hashes checked against git, the DVC "
             f"cache and the remote"]
    for result in report["results"]:  # gone by a deletion request: known, not a problem
        if result["status"] == "erased" or any(f["status"] == "erased"
                                               for f in result.get("files") or []):
            files = [f for f in result.get("files") or [] if f["status"] == "erased"] or [result]
            lines += [f"  ERASED   {f['path']} ({f['md5']}): {'; '.join(f['notes'])}"
                      for f in files]
    for problem in report["problems"]:
        lines.append(f"  {problem['status'].upper():<8} {problem['path']} ({problem['md5']}, "
                     f"recorded by {problem['recorded_by']})")
        lines += [f"           {note}" for note in problem["notes"]]
        for file in problem.get("files", []):
            lines.append(f"    {file['status']:<8} {file['path']} ({file['md5']})"
                         + "".join(f"; {n}" for n in file["notes"]))
    for name, folder in (report.get("absent_remotes") or {}).items():
        lines.append(f"the DVC {name} is a folder this machine does not have ({folder}): point "
                     f"it at the project's remote, `dvc remote modify --local {name.split()[-1]} "
                     f"url /path/to/the/remote`, then `dvc fetch`")
    if report["ok"]:
        lines.append("all hashes resolve and match" + (
            ", the workspace's copies of its outputs too" if report.get("workspace_checked")
            else ""))
        return "\n".join(lines)
    notes = " ".join(n for p in report["problems"] for n in
                     p["notes"] + [x for f in p.get("files", []) for x in f["notes"]])
    todo = []
    if "in the workspace" in notes:
        todo.append("`dvc checkout --force <path>` puts the recorded copy back in the workspace")
    if "in the remote" in notes:
        todo.append("a remote's altered copy is replaced by deleting it (its path is named "
                    "above) and pushing a good one: `dvc push` where the cache holds it intact "
                    "(DVC skips a file the remote already has by its name, altered or not; "
                    "`dvc fetch` and `dvc pull` never rewrite a remote), or restore the remote "
                    "from a backup")
    if "in the cache" in notes or "missing" in {p["status"] for p in report["problems"]}:
        todo.append("the cache's are restored from the remote (`dvc fetch`; `dvc pull` also "
                    "restores the workspace)")
    lines.append(f"{len(report['problems'])} problem(s): " + "; ".join(
        todo or ["restore the named files from a good copy"])
        + "; with no good copy left, treat this generation as unverifiable")
    return "\n".join(lines)


# --- the champion, before it is used or restored -------------------------------------------

CHAMPION = "models/champion"


def check_champion(root: Path, ref: str | None = None) -> None:
    """Raise LineageError naming each champion file that does not match `models/champion.dvc`.

    `dvc checkout` (and the one `promotion.recover` does) copies whatever bytes the cache holds
    without checking them, and DVC then trusts that copy, so an altered cache object silently
    becomes the champion that rollout starts from and train fine-tunes. This hashes every file of the
    folder's manifest (a few MB for the demo) in the DVC cache and the local remote, and, for
    the pointer in the working tree (`ref` None: before a cycle), the workspace copy too. With
    `ref` (a tag: before a rollback restores it) only the stored objects are checked: the
    workspace copy is about to be replaced. An object absent from the cache but intact in the
    remote is fine (`dvc pull` fetches it); one absent from both is reported missing.
    """
    pointer = f"{CHAMPION}.dvc"
    where = f"{pointer} at {ref}" if ref else pointer
    if ref:
        md5 = pointer_hash(root, ref, pointer)
    else:
        outs = (yaml.safe_load((root / pointer).read_text()) or {}).get("outs") or [{}]
        md5 = outs[0].get("md5")
    if not md5:
        raise LineageError(f"{where} records no md5 for {CHAMPION}; restore it from git "
                           f"(`git checkout -- {pointer}`) or run `offseason rollback`")
    status, notes = _check_object(root, md5)
    problems = [{"path": f"{CHAMPION} (its file list)", "md5": md5, "status": status,
                 "notes": notes}] if status != "ok" else \
        _check_files(root, CHAMPION, md5, workspace=ref is None)
    if not problems:
        return
    lines = [f"  {p['path']} (md5 {p['md5']} in {where}): {p['status']}"
             + "".join(f"; {n}" for n in p["notes"] or ["in neither the DVC cache nor the "
                                                        "remote"]) for p in problems]
    if ref:
        raise LineageError(
            f"the champion of {ref} does not match {where} (found before restoring it; nothing "
            f"was changed):\n" + "\n".join(lines) + "\n"
            "Roll back to another generation (`offseason rollback --to gen-N`; `offseason "
            "lineage --verify gen-N` checks one first), or put good copies of the named files "
            "back into the DVC remote and delete the altered cache files.")
    raise LineageError(
        f"the champion does not match {where} (the cycle stopped before any stage used it):\n"
        + "\n".join(lines) + "\n"
        f"To repair: `rm -rf {CHAMPION} && dvc pull {CHAMPION}` (`dvc pull` replaces an "
        f"altered cache copy with the remote's; `dvc checkout --force` alone is not enough: "
        f"DVC trusts a copy it checked out itself). Remote copy altered or missing too, but "
        f"the workspace intact: delete each altered cache file named above, then `dvc commit "
        f"--force {pointer}`. No good copy left: `offseason rollback` to an earlier champion. "
        f"`offseason lineage --verify gen-N` checks every hash a generation recorded.")


# --- trace ----------------------------------------------------------------------------------

def trace(root: Path, trace_id: str, champion_tags: set[str]) -> dict:
    """Every generation that learned from a trace, directly or through its starting champion."""
    cache: dict = {}
    direct, inherited = [], []
    affected: set[int] = set()
    for generation in generations(root):
        tag = f"gen-{generation}"
        if generation == 0:
            continue
        stages = stage_files(root, tag)
        replay = out_hash(stages, "data/replay")
        start_md5 = next((d["md5"] for d in stages.get("train", {}).get("deps", [])
                          if d["path"] == "models/champion"), None)
        parent = champion_generation(root, start_md5, generation)
        # a cycle whose train stage trained nothing (no example, no reward spread) made no new
        # weights: its generation is its starting champion's, learned from the trace or not
        trained = (read_at(root, tag, "metrics/train.json") or {}).get("trained", True)
        if trained and replay and trace_id in training_trace_ids(root, replay, cache):
            direct.append(tag)
            affected.add(generation)
        elif parent in affected:
            inherited.append(tag)
            affected.add(generation)
    tags = [f"gen-{g}" for g in sorted(affected)]
    files = {}
    if direct:
        first = stage_files(root, direct[0])
        files = inbox_files_of(root, out_hash(first, "data/traces"), {trace_id})
    found = {"trace_id": trace_id, "generations": tags, "direct": direct, "inherited": inherited,
             "inbox_files": sorted(files), "current_champion": sorted(champion_tags & set(tags)),
             "champion_affected": bool(champion_tags & set(tags))}
    if not direct:
        found["read"] = read_as(root, trace_id)
        found["quarantined"] = quarantined_as(root, trace_id)
        repeats = (found["read"] or {}).get("duplicate_of")
        if repeats and repeats != trace_id:  # its content was learned, if at all, as that trace's
            same = trace(root, repeats, champion_tags)
            found.update({k: same[k] for k in ("generations", "direct", "inherited",
                                               "current_champion", "champion_affected")},
                         duplicate_of=repeats, inbox_files=[found["read"]["source_file"]])
    return found


QUARANTINES = ("data/quarantine/ingest.jsonl", "data/quarantine/validate.jsonl")


def quarantined_as(root: Path, trace_id: str) -> dict | None:
    """Where a cycle quarantined a trace id: {tag, stage, source_file, source_line, reason} from
    the quarantine files each generation's dvc.lock records (the folder holds only the last
    cycle's), or None. Ingest's rows name the trace where the record had an id.
    """
    looked = set()
    # an id that held personal data is stored as `<file>:<line>` by ingest, and a quarantine row
    # of a record without an id names none: either is found by its file and line
    at_file, colon, at_line = trace_id.rpartition(":")
    for generation in generations(root):
        if generation == 0:
            continue
        tag = f"gen-{generation}"
        stages = stage_files(root, tag)
        for path in QUARANTINES:
            md5 = out_hash(stages, path)
            if not md5 or md5 in looked:
                continue
            looked.add(md5)
            data = read_object(root, md5)
            for line in (data or b"").decode(errors="replace").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if str(row.get("trace_id")) == trace_id or (colon and (
                        row.get("source_file"), str(row.get("source_line"))) == (at_file, at_line)):
                    return {"tag": tag, **{k: row.get(k) for k in (
                        "stage", "source_file", "source_line", "reason")}}
    return None


def read_as(root: Path, trace_id: str) -> dict | None:
    """How the ingest stage took a trace id, from the newest generation's `data/traces/` (it keeps
    every cycle's): {source_file, source_line?, duplicate_of?} (`duplicate_of`: the id of the
    trace it repeats, ingested instead), or None when no row with this id was accepted or counted
    as a duplicate (quarantined, or never in the inbox).
    """
    tags = [f"gen-{g}" for g in generations(root) if g]
    folder = out_hash(stage_files(root, tags[-1]), "data/traces") if tags else None
    if not folder:
        return None
    entries = [e for e in manifest(root, folder) if e["relpath"].endswith(".parquet")
               and not e["relpath"].startswith("index-")  # erasure's index: no trace's own row
               and e["md5"] not in erased_objects(root)]
    # the accepted parts first: an id accepted once and repeated later is the accepted trace
    for entry in sorted(entries, key=lambda e: e["relpath"].startswith("duplicates-")):
        repeats = entry["relpath"].startswith("duplicates-")
        columns = ["trace_id", "source_file", *(["source_line", "duplicate_of"] if repeats
                                                else [])]
        for row in parquet_column(root, entry["md5"], columns):
            if row["trace_id"] == trace_id:
                return {k: v for k, v in row.items() if k != "trace_id"}
    return None


def trace_text(found: dict) -> str:
    """Where a trace went, as text: the generations that learned from it."""
    read = found.get("read")
    head = f"trace {found['trace_id']}"
    if found.get("duplicate_of"):
        head += (f" (inbox file {read['source_file']} line {read['source_line']}): a duplicate "
                 f"of trace {found['duplicate_of']}, the same conversation, which ingest kept "
                 f"instead; what learned from that one learned from this")
        if not found["generations"]:
            return f"{head}; no generation learned from it"
    elif not found["generations"] and found.get("quarantined"):
        q = found["quarantined"]
        return (f"{head}: quarantined by the {q['stage']} stage of the cycle that made "
                f"{q['tag']} ({q['source_file']} line {q['source_line']}): {q['reason']}; no "
                f"generation learned from it")
    elif not found["generations"]:
        if "read" in found and read is None:
            from stages.traces.schema import id_holds_pii

            if id_holds_pii(found["trace_id"]):
                # ingest keeps no id that holds personal data: the trace is under its file:line
                return (f"{head}: this id holds personal data, which ingest does not keep: a "
                        f"trace that carried it is kept under its inbox file and line; look it "
                        f"up by those (offseason lineage --trace <file>:<line>), found where the "
                        f"inbox keeps traces as they came: `grep -n -F '{found['trace_id']}' "
                        f"data/inbox/*`")
            return (f"{head}: no cycle accepted, quarantined or counted as a duplicate a trace "
                    f"with this id (it never reached the inbox, or its record carried no id); "
                    f"no generation learned from it")
        where = f" (inbox file {read['source_file']})" if read else ""
        return f"{head}{where}: read, but no generation learned from it"
    else:
        head += f" (inbox file: {', '.join(found['inbox_files']) or '?'})"
    lines = [head,
             f"  its training data held it: {', '.join(found['direct']) or 'none'}",
             f"  it started from a champion whose training data held it: "
             f"{', '.join(found['inherited']) or 'none'}",
             "  (an upper bound: the trace's rollouts or rating were in what the train stage read, "
             "whether or not an example came of them)"]
    if found["champion_affected"]:
        lines.append(f"  the current champion ({', '.join(found['current_champion'])}) is among "
                     f"them: a deletion request means training a new champion without this trace")
    else:
        lines.append("  the current champion is not among them")
    return "\n".join(lines)
