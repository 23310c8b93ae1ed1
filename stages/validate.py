r"""Validate: Great Expectations checks on the ingested traces; failing traces go to quarantine.

Reads `data/ingested.parquet`, flattened into three tables (traces, messages, tool calls) for GE.
A trace that fails an expectation, or that no `environments:` module claims a task in
(`task_from_trace`), goes to `data/quarantine/validate.jsonl`; the rest go to
`data/validated.parquet` with their task. Writes `metrics/validate.json` (counts, the traffic
profile and its drift, profiles kept in `data/profiles/`), GE's Data Docs (`data/docs/index.html`)
and, with `validate.holdout_fraction` > 0, held-out tasks to `--holdout`. Fails only below
`validate.min_valid_fraction`.

    python -m stages.validate data/ingested.parquet data/validated.parquet \
        data/quarantine/validate.jsonl data/profiles data/docs metrics/validate.json \
        --holdout data/holdout

Details: docs/traces.md, "How the validate stage works (stages/validate.py)".
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from stages import config as cfg
from stages import datadocs, erasure, io
from stages.envs import contract
from stages.traces import drift

BATCH = 100_000  # traces checked at a time
EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
ROLES = ["system", "user", "assistant", "tool", "developer"]


class ValidationFailed(RuntimeError):
    """Too few valid traces to go on; the message says how many and where the reasons are."""


def flatten(traces: pd.DataFrame, router: contract.Router
            ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """One row per trace (`question`: its task, `Router.task_of`), per message and per tool call,
    each keyed by the trace's row number.
    """
    per_trace, per_message, per_call = [], [], []
    # the columns it reads as lists (`itertuples` made a Python value of every cell, of every column)
    columns = (traces[name].tolist() for name in ("trace_id", "n_messages", "user_text", "messages",
                                                  "tools"))
    for row, (trace_id, n_messages, user_text, messages, tools) in enumerate(zip(*columns)):
        messages = json.loads(messages)
        per_trace.append({"row": row, "trace_id": trace_id, "n_messages": n_messages,
                          "user_text": user_text,
                          "question": router.task_of(messages, json.loads(tools or "[]"))})
        for index, message in enumerate(messages):
            per_message.append({"row": row, "index": index, "role": message.get("role")})
            for call in message.get("tool_calls") or []:
                arguments = call["function"].get("arguments")
                per_call.append({"row": row, "name": call["function"]["name"],
                                 "arguments": arguments if isinstance(arguments, str)
                                 else json.dumps(arguments)})
    frames = (pd.DataFrame(per_trace, columns=["row", "trace_id", "n_messages", "user_text",
                                               "question"]),
              pd.DataFrame(per_message, columns=["row", "index", "role"]),
              pd.DataFrame(per_call, columns=["row", "name", "arguments"]))
    return frames


def suites() -> dict[str, list]:
    """The expectation suites, by table."""
    import great_expectations as gx

    e = gx.expectations
    return {
        "traces": [
            e.ExpectColumnValuesToNotBeNull(column="trace_id"),
            e.ExpectColumnValuesToNotBeNull(column="user_text"),
            # a question and at least one answer
            e.ExpectColumnValuesToBeBetween(column="n_messages", min_value=2),
            # the environment must be able to derive a task it can verify
            e.ExpectColumnValuesToNotBeNull(column="question"),
        ],
        "messages": [e.ExpectColumnValuesToBeInSet(column="role", value_set=ROLES)],
        "tool_calls": [e.ExpectColumnValuesToBeJsonParseable(column="arguments")],
    }


def meanings(router: contract.Router) -> dict[str, str]:
    """What each expectation's failure means for a trace, in words, with what to change: added
    to the expectation's name in a quarantine reason (the name finds it in the Data Docs).
    """
    claim = (f"no environment's task_from_trace claimed it (environments: "
             f"{', '.join(router.envs)}, asked in that order); give the one it belongs to a "
             f"task_from_trace that finds its task, or list stages.envs.replay last to "
             f"replay any trace with a request and an answer")
    return {
        "traces: expect_column_values_to_not_be_null(trace_id)": "the trace has no id",
        "traces: expect_column_values_to_not_be_null(user_text)":
            "no user turn with text, so no task (for a Responses API object, log the "
            "request's input beside it)",
        "traces: expect_column_values_to_be_between(n_messages)":
            "fewer than two messages: a request and at least one answer are needed",
        "traces: expect_column_values_to_not_be_null(question)": claim,
        "messages: expect_column_values_to_be_in_set(role)":
            f"a message's role is none of {', '.join(sorted(ROLES))}",
        "tool_calls: expect_column_values_to_be_json_parseable(arguments)":
            "a tool call's arguments are not JSON",
    }


_STAMP = re.compile(r"\d{8}T\d{6}\.\d{6}Z")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def settle_docs(docs: Path) -> None:
    """Make the same input render byte-identical Data Docs, so DVC sees an unchanged output.

    GE stamps each page with the wall-clock time it rendered (the logo's cache-buster, the
    validation time) and gives its collapsible blocks random uuid4 ids. The times become the run
    id's fixed time (when a cycle ran is in its git commit and MLflow run), and each uuid a uuid5 of
    the page and its order of appearance, so ids that link to each other still match.
    """
    fixed = EPOCH.strftime("%Y%m%dT%H%M%S.%fZ")
    for page in docs.rglob("*.html"):
        where = page.relative_to(docs).as_posix()
        order: dict[str, int] = {}  # each uuid's place among the page's distinct ones

        def stable(match: re.Match) -> str:
            n = order.setdefault(match.group(0), len(order))
            return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{where}#{n}"))

        page.write_text(_STAMP.sub(fixed, _UUID.sub(stable, page.read_text())))


class Checker:
    """The GE context, suites and checkpoints, built once and run on batch after batch.

    Each run also renders GE's Data Docs (HTML: the suites and every batch's results) into
    `docs`. Run ids carry a fixed time; `settle_docs` fixes the rest of what varies from run to
    run, so the same input renders the same pages.
    """

    def __init__(self, docs: Path):
        """Build the context, suites and checkpoints, with data docs in `docs`."""
        with io.heavy_imports():  # Great Expectations: 3 s of imports, a fifth of it collecting
            import great_expectations as gx
            from great_expectations.data_context.types.base import ProgressBarsConfig

        context = gx.get_context(mode="ephemeral")
        # the stage logs its own summary; per-metric bars would flood the Prefect log
        context.variables.progress_bars = ProgressBarsConfig(globally=False,
                                                             metric_calculations=False)
        context.add_data_docs_site("offseason", {
            "class_name": "SiteBuilder",
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend",
                              "base_directory": str(docs.resolve())}})
        source = context.data_sources.add_pandas("ingested")
        self.checkpoints = {}
        for name, expectations in suites().items():
            definition = source.add_dataframe_asset(name) \
                .add_batch_definition_whole_dataframe(name)
            suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
            validation = context.validation_definitions.add(
                gx.ValidationDefinition(name=name, data=definition, suite=suite))
            # no UpdateDataDocsAction: it renders the suite's pages and the index again after
            # each suite of each batch; `render_docs` renders every page once, at the end
            self.checkpoints[name] = context.checkpoints.add(gx.Checkpoint(
                name=name, validation_definitions=[validation],
                result_format={"result_format": "COMPLETE",
                               "unexpected_index_column_names": ["row"]}))
        self.context = context
        self.results: list = []  # the identifiers of the stored validation results
        self.batches = 0

    def check(self, frames: dict[str, pd.DataFrame],
              run_time: dt.datetime = EPOCH) -> dict[int, list[str]]:
        """Run the suites; returns {trace row: [failed expectation, ...]}. `run_time`: the time
        the Data Docs show for this batch (the newest trace's: the same input, the same pages).
        """
        from great_expectations.core.run_identifier import RunIdentifier

        self.batches += 1
        run_id = RunIdentifier(run_name=f"batch-{self.batches}", run_time=run_time)
        failures: dict[int, list[str]] = {}
        for name, checkpoint in self.checkpoints.items():
            frame = frames[name]
            if frame.empty:
                continue
            run = checkpoint.run(batch_parameters={"dataframe": frame}, run_id=run_id)
            self.results += run.run_results
            for key, result in run.run_results.items():
                # GE's pages read the asset's name from the batch spec, which an in-memory
                # dataframe's lacks: every page said "Data asset: None" (issue 53.7)
                result.meta.setdefault("batch_spec", {})["data_asset_name"] = name
                self.context.validation_results_store.set(key, result)
            for result in run.run_results.values():
                for outcome in result.results:
                    if outcome.success:
                        continue
                    config = outcome.expectation_config
                    if outcome.exception_info and outcome.exception_info.get("raised_exception"):
                        raise RuntimeError(
                            f"Great Expectations could not run {config.type} on {name}: "
                            f"{outcome.exception_info['exception_message']}")
                    label = f"{name}: {config.type}({config.kwargs.get('column')})"
                    for item in outcome.result.get("unexpected_index_list") or []:
                        failures.setdefault(int(item["row"]), []).append(label)
        return failures

    def render_docs(self) -> None:
        """Render the Data Docs site: each suite's page, each stored result's, the index."""
        from great_expectations.data_context.types.resource_identifiers import (
            ExpectationSuiteIdentifier,
        )

        suites = [ExpectationSuiteIdentifier(name=name) for name in self.checkpoints]
        self.context.build_data_docs(site_names=["offseason"],
                                     resource_identifiers=[*self.results, *suites])


def newest(traces: pd.DataFrame) -> dt.datetime:
    """The newest `created_at` of a batch of traces (UTC), or EPOCH where none has one: the
    batch's time in the Data Docs, which showed every validation at 2000-01-01 (a fixed time
    kept the pages reproducible; a time read from the input keeps them so, and says when).
    """
    if "created_at" not in traces:
        return EPOCH
    times = pd.to_datetime(traces["created_at"], utc=True, errors="coerce", format="ISO8601")
    return times.max().to_pydatetime() if times.notna().any() else EPOCH


def _empty_counts() -> dict:
    return {"rows_read": 0, "accepted": 0, "quarantined": 0, "duplicates": 0}


def held_out(seed: int, trace_id: str, fraction: float) -> bool:
    """Whether a trace is held out: a hash of the seed and its id below `fraction`."""
    digest = hashlib.sha256(f"{seed}/holdout/{trace_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2 ** 64


def add_to_pool(holdout: Path, tasks: list[dict]) -> int:
    """Append held-out tasks to `holdout/<environment>.jsonl`, each once (a rerun of a cycle adds
    nothing twice); returns how many were new.
    """
    added = 0
    by_env: dict[str, list[dict]] = {}
    for task in tasks:
        by_env.setdefault(task.pop("environment"), []).append(task)
    holdout.mkdir(parents=True, exist_ok=True)
    for name, new in sorted(by_env.items()):
        path = holdout / f"{name}.jsonl"
        have = io.read_jsonl(path) if path.exists() else []
        seen = {t["task_id"] for t in have}
        fresh = [t for t in new if t["task_id"] not in seen]
        if fresh:
            io.write_jsonl(path, have + fresh)
            added += len(fresh)
    return added


def run(base: cfg.Base, config: cfg.Validate, ingested: Path, validated: Path,
        quarantine: Path, profiles: Path, docs: Path, specs: dict, root: Path | None = None,
        holdout: Path | None = None, tombstones: erasure.Tombstones | None = None) -> dict:
    """Split the ingested traces into valid and quarantined; returns the stage metrics.

    Reads and checks `BATCH` traces at a time, so memory does not grow with their number. A
    trace's task is the one the first of the `environments:` (`specs`, the modules under `root`)
    finds in it (`task_from_trace`; `contract.Router`), its question that task as JSON; a trace
    none of them claims is quarantined. `holdout`: the pool of held-out tasks
    (`validate.holdout_fraction`).
    """
    if config.holdout_fraction and holdout is None:
        raise cfg.ParamsError("validate.holdout_fraction is set but the validate stage in "
                              "dvc.yaml has no `--holdout data/holdout`; add it (and "
                              "`data/holdout: {persist: true}` to its outs)")
    router = contract.Router({name: contract.load(name, spec.module, root or Path.cwd())
                              for name, spec in specs.items()})
    source = pq.ParquetFile(ingested)
    docs_tmp = docs.with_name(f".{docs.name}.tmp")
    shutil.rmtree(docs_tmp, ignore_errors=True)
    docs_tmp.mkdir(parents=True)
    checker = Checker(docs_tmp) if source.metadata.num_rows else None
    schema = source.schema_arrow.append(pa.field("question", pa.string()))
    tmp = validated.with_name(f".{validated.name}.tmp")
    writer = pq.ParquetWriter(tmp, schema)
    quarantined, failed, per_format, profile = [], {}, {}, drift.Profile()
    unknown: dict[str, dict[str, int]] = {}  # environment -> tool it lacks -> calls of it
    meaning = meanings(router)
    pool: list[dict] = []
    for table in source.iter_batches(batch_size=BATCH):
        if tombstones:  # erased since ingest (`offseason erase`): in no later file
            table = tombstones.keep_table(pa.Table.from_batches([table]))
            if not table.num_rows:
                continue
        traces = table.to_pandas()
        per_trace, per_message, per_call = flatten(traces, router)
        failures = checker.check({"traces": per_trace, "messages": per_message,
                                  "tool_calls": per_call}, newest(traces))
        for labels in failures.values():
            for label in labels:
                failed[label] = failed.get(label, 0) + 1
        bad = sorted(failures)
        quarantined += [{"trace_id": traces.trace_id.iloc[r],
                         "source_file": traces.source_file.iloc[r],
                         "source_line": int(traces.source_line.iloc[r]),
                         "format": traces.format.iloc[r], "stage": "validate",
                         # what it means first, the expectation's name after (it finds the
                         # check in the Data Docs)
                         "reason": "; ".join(f"{meaning[label]} (Data Docs: {label})"
                                             if label in meaning else label
                                             for label in failures[r])}
                        for r in bad]
        bad_formats = traces.format.iloc[bad].value_counts().to_dict() if bad else {}
        for fmt, n in traces.format.value_counts().items():
            counts = per_format.setdefault(fmt, _empty_counts())
            counts["rows_read"] += int(n)
            counts["quarantined"] += int(bad_formats.get(fmt, 0))
            counts["accepted"] += int(n - bad_formats.get(fmt, 0))
        good = traces.drop(index=bad).reset_index(drop=True)
        tasks = per_trace.drop(index=bad).reset_index(drop=True)
        questions = tasks.question
        good["question"] = questions.astype("string")
        # from the flattened tables: the messages were parsed once already
        # (a loop: pandas' groupby-apply called Python once a trace, a fifth of the stage)
        tools_of: dict[int, list[str]] = {}
        for r, name in zip(per_call["row"].tolist(), per_call["name"].tolist()):
            tools_of.setdefault(r, []).append(name)
        kept = [r for r in range(len(traces)) if r not in failures]
        for r, n_messages, feedback, question in zip(
                kept, good.n_messages.tolist(), good.feedback.tolist(), questions.tolist()):
            profile.add(n_messages, tools_of.get(r, []), json.loads(feedback),
                        router.task_kind(question))
            offered_unknown(router, question, tools_of.get(r, []), unknown)
        if config.holdout_fraction:  # kept from training: the benchmarks' future items
            out = [i for i, (trace_id, question) in enumerate(zip(good.trace_id, questions))
                   if question is not None and not pd.isna(question)
                   and held_out(base.seed, trace_id, config.holdout_fraction)]
            pool += [{"task_id": f"trace:{good.trace_id.iloc[i]}",
                      **json.loads(questions.iloc[i])} for i in out]
            good = good.drop(index=out).reset_index(drop=True)
        writer.write_table(pa.Table.from_pandas(good, schema=schema, preserve_index=False))
    writer.close()
    os.replace(tmp, validated)
    if checker is not None:
        checker.render_docs()
    settle_docs(docs_tmp)
    if checker is not None:
        datadocs.localize(docs_tmp)  # nothing fetched from outside when they are opened
    io.replace_dir(docs_tmp, docs)
    io.write_jsonl(quarantine, quarantined)
    total = source.metadata.num_rows
    accepted = total - len(quarantined)
    valid_fraction = accepted / total if total else 1.0
    summary = profile.summary()
    changes = drift.compare(summary, save_profile(profiles, ingested, summary))
    if holdout is not None:
        holdout.mkdir(parents=True, exist_ok=True)  # the DVC output exists, held out or not
    added = add_to_pool(holdout, pool) if pool else 0
    metrics = {"rows_read": total, "accepted": accepted, "quarantined": len(quarantined),
               "duplicates": 0, "held_out": len(pool), "held_out_new": added,
               "valid_fraction": round(valid_fraction, 4),
               "per_format": per_format, "failed_expectations": failed,
               "profile": summary, "drift": changes,
               **({"unknown_tools": unknown} if unknown else {})}
    if valid_fraction < config.min_valid_fraction:
        raise ValidationFailed(
            f"only {accepted} of {total} traces passed validation ({valid_fraction:.1%}), below "
            f"validate.min_valid_fraction={config.min_valid_fraction}; the reasons are in "
            f"{quarantine}. Fix the source or lower the threshold in params.yaml"
        )
    if changes["task_mix_distance"] > config.max_drift:
        raise ValidationFailed(
            f"the task mix moved {changes['task_mix_distance']:.2f} (total variation) from the "
            f"previous cycle's, above validate.max_drift={config.max_drift}: "
            f"{summary['task_mix']} now. Check the traffic before training on it, or raise "
            f"validate.max_drift in params.yaml"
        )
    return metrics


def offered_unknown(router, question: str, called: list[str], unknown: dict) -> None:
    """Count the tools a trace called that its task does not offer (its environment's TOOLS, or
    the task's own `tools`): its rollouts cannot call them, so what production did is not what
    the environment can replay. Accepted all the same (the task may still be learned); the
    stage says which, so an environment can be given the tool.
    """
    task = json.loads(question)
    env = router.envs[task["environment"]]
    offered = {tool.get("function", tool).get("name") for tool in env.tools_of(task)}
    for name in called:
        if name not in offered:
            tools = unknown.setdefault(task["environment"], {})
            tools[name] = tools.get(name, 0) + 1


def save_profile(profiles: Path, ingested: Path, summary: dict) -> dict | None:
    """Keep this cycle's profile; returns the previous cycle's. Keyed by the input's hash, so a
    rerun of the same cycle replaces its own profile instead of comparing against it.
    """
    profiles.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(ingested.read_bytes()).hexdigest()[:16]
    index_path = profiles / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else []
    index = [k for k in index if k != key]
    before = json.loads((profiles / f"{index[-1]}.json").read_text()) if index else None
    io.write_text(profiles / f"{key}.json", drift.dumps(summary))
    io.write_json(index_path, index + [key])
    return before


def parser() -> argparse.ArgumentParser:
    """The stage's command line, as dvc.yaml writes it (the CLI reads the holdout's path with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("ingested", "validated", "quarantine", "profiles", "docs", "metrics"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--holdout", type=Path,
                        help="data/holdout: the pool of held-out tasks, one JSONL per environment "
                             "(validate.holdout_fraction)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Validate the ingested traces (the DVC stage's command line)."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    args = parser().parse_args(argv)
    try:
        metrics = run(cfg.load("base", args.params), cfg.load("validate", args.params),
                      args.ingested, args.validated, args.quarantine, args.profiles, args.docs,
                      cfg.environments(args.params), Path(args.params).resolve().parent,
                      args.holdout, erasure.Tombstones())
    except ValidationFailed as err:
        print(f"validate: error: {err}", file=sys.stderr)
        sys.exit(1)
    io.write_metrics(args.metrics, metrics)
    print(f"validate: {metrics['accepted']} of {metrics['rows_read']} traces valid, "
          f"{metrics['quarantined']} quarantined"
          + (f", {metrics['held_out']} held out for the benchmarks" if metrics["held_out"] else ""),
          file=sys.stderr)
    for name, tools in (metrics.get("unknown_tools") or {}).items():
        print(f"validate: warning: traces of environment {name!r} call tools it does not offer: "
              + ", ".join(f"{tool} ({n} calls)" for tool, n in sorted(tools.items()))
              + "; its rollouts cannot call them: add them to its TOOLS and call_tool, or check "
              "which environment's task_from_trace should claim those traces", file=sys.stderr)


if __name__ == "__main__":
    with io.explained("validate"):
        main()
    io.exit_soon()
