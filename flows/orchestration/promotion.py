"""After the gate: a person's approval, an all-or-nothing promotion, its history, and rollback.

Approval (`promotion.require_approval` in params.yaml): a cycle whose candidate passed the gate
waits for a decision. Outside a deployment the flow run pauses (the process waits); inside a served
deployment it suspends (the worker is freed, and on resume the flow runs again from the top: DVC
skips the finished stages and the stored decision is read back). The Prefect UI shows the form
(approve yes/no, reason, approver); `offseason approve|reject RUN_ID --reason ...` send the same
input from a terminal. No decision within `promotion.approval_timeout` seconds: nothing is
promoted, the champion stays and the cycle ends saying so (paused) or, suspended, the Prefect
server fails the run ("The flow was paused and never resumed": no process of ours is left to
notice; its log says which timeout it waited under). While a suspended run waits, no other cycle
starts in the workspace (`.offseason/awaiting-approval.json` names it until its timeout): a schedule
firing meanwhile would build the same generation from the same traces. The paused flow and the terminal talk
through Prefect's database in `PREFECT_HOME` (each process's temporary local server opens the same
one) or through the server `PREFECT_API_URL` names.

Promotion is one transaction over four things: `models/champion` with its `.dvc` file (pushed to
the DVC remote), the append-only log `promotions.jsonl` with `metrics/promotion.json`, the git
commit and tag `gen-N`, and the MLflow alias `champion` with the model version's tags. Each step
that ran is undone, in reverse order, when a later one fails, and `recover()` (run before every
cycle) puts back the committed state if a process died mid-way. Git is the record: the last line of
`promotions.jsonl` at HEAD names the champion; MLflow keeps no alias history of its own, so every
alias change also leaves tags on the model version (`alias.<time>` with the event, plus
`approver`, `approval_reason`, `gate_summary` and `champion_since`).

    offseason pending | approve RUN_ID --reason ... | reject RUN_ID --reason ...
    offseason rollback [--to gen-N] --reason ...
"""

from __future__ import annotations

import datetime as dt
import functools
import getpass
import json
import os
import shutil
import subprocess
from pathlib import Path

from flows.audit import lineage
from flows.project import params as settings

# Prefect and MLflow (flows.project.tracking) are imported where they are used: `offseason run` repairs
# files with recover_files() before either is loaded, and `approve` and `pending` skip MLflow
from flows.project.workspace import (
    ENVIRONMENT_SOURCES,
    WorkspaceError,
    cycle_inputs,
    dvc,
    generations,
    git,
    inputs_fingerprint,
    note_cycle,
    read_at,
    uncommitted,
)
from stages import io

LOG = "promotions.jsonl"
GATE_ARTIFACT = "gate-summary"


@functools.cache
def approval_form() -> type:
    """The decision on a candidate that passed the gate (a Prefect RunInput)."""
    from typing import Literal

    from prefect.input import RunInput
    from pydantic import Field

    # no default decision and a reason required, as on the CLI: an untouched form that said
    # "approve: off" rejected the candidate without a word (issue 53.3)
    class ApprovalForm(RunInput):
        """The decision on a candidate that passed the gate."""

        decision: Literal["approve", "reject"] = Field(
            description="approve: promote the candidate; reject: the champion stays")
        reason: str = Field(min_length=1, pattern=r"\S",
                            description="why, for the record (required, as on the CLI)")
        approver: str = Field("", description="who decides (empty: the user the flow runs as)")

    return ApprovalForm


class PromotionFailed(RuntimeError):
    """A promotion step failed; the steps before it were undone."""


def now() -> str:
    """The time now in UTC, ISO 8601 to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def who() -> str:
    """The user running the promotion, or `unknown`."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        return "unknown"


def gate_summary(verdict: dict) -> str:
    """The verdict in one line: primary suite, interval, guards per environment."""
    failed = verdict.get("failures") or []
    guards = verdict.get("guards") or {}
    environments = {where: [name for name, per in guards.items() if not per[where]["passed"]]
                    for per in guards.values() for where in per}
    return (f"{verdict.get('primary', 'primary')}: candidate {verdict['candidate_score']:.3f} vs "
            f"champion {verdict['champion_score']:.3f}, difference {verdict['difference']:+.3f} "
            f"in {verdict['interval']} ({lineage.how(verdict)}); "
            f"{'passed' if verdict['passed'] else 'failed'}"
            + (f" ({'; '.join(failed)})" if failed else "")
            + ("; guards per environment: " + "; ".join(
                f"{where} {'failed ' + ', '.join(bad) if bad else 'held'}"
                for where, bad in environments.items()) if environments else "")
            # the decision's design (gate.design): its power and the items each suite needs
            + (f"; {verdict['design']['summary']}" if verdict.get("design") else ""))


def fault(step: str) -> None:
    """Tests interrupt a promotion between steps: OFFSEASON_FAIL_AT=promote:<step>."""
    if os.environ.get("OFFSEASON_FAIL_AT") == f"promote:{step}":
        raise PromotionFailed(f"fault injected at promote:{step} (OFFSEASON_FAIL_AT)")


# --- approval ------------------------------------------------------------------------------


def answered(flow_run_id, key: str) -> bool:
    """Whether a suspension with this key was already resumed with the form's answer."""
    from prefect.input.actions import read_flow_run_input
    from prefect.input.run_input import keyset_from_paused_state
    from prefect.states import Suspended

    keyset = keyset_from_paused_state(Suspended(pause_key=key))
    return read_flow_run_input(keyset["response"], flow_run_id=flow_run_id) is not None


WAITING = Path(".offseason") / "awaiting-approval.json"


def note_waiting(root: Path, generation: int, flow_run, timeout: int) -> None:
    """A served run suspends for approval: no other cycle may start until it is answered."""
    until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=timeout)
    (root / WAITING).parent.mkdir(exist_ok=True)
    io.write_json(root / WAITING, {"generation": generation, "flow_run_id": str(flow_run.id),
                                   "flow_run": flow_run.name,
                                   "until": until.isoformat(timespec="seconds")})


def waiting_refusal(root: Path, flow_run_id: str | None) -> str | None:
    """Why a cycle may not start now (another run waits for approval), or None.

    The run that waits may start again (that is its resume); a wait past its timeout is over
    (the Prefect server fails that run) and its note is removed.
    """
    path = root / WAITING
    try:
        note = json.loads(path.read_text())
        until = dt.datetime.fromisoformat(note["until"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        path.unlink(missing_ok=True)  # unreadable: it cannot hold the workspace
        return None
    if note["flow_run_id"] == flow_run_id:
        return None
    if until <= dt.datetime.now(dt.timezone.utc):
        path.unlink(missing_ok=True)
        return None
    run = note["flow_run_id"]
    return (f"gen-{note['generation']} (flow run {note['flow_run']}, {run}) waits for approval "
            f"until {note['until']}; a cycle now would build the same generation from the same "
            f"traces. Decide first: `offseason approve {run} --reason ...` or `offseason reject "
            f"{run} --reason ...` (or the Prefect UI), then run again")


def awaits_decision(root: Path) -> bool:
    """Whether this workspace records a cycle waiting for a decision, read without Prefect: a
    served run's note (`WAITING`, not past its time) or a cycle that holds the lock while it
    waits (`note_cycle(awaiting=...)`). `offseason pending` asks Prefect only then: without a
    server, asking starts Prefect's temporary one (15-20 s) to answer "none" (issue 53.9).
    """
    from flows.project.workspace import lock_holder

    if waiting_refusal(root, None) is not None:
        return True
    held = lock_holder(root)
    if held is None:  # no cycle runs
        return False
    return not held or bool(held.get("awaiting"))  # {}: its holder is writing it; ask Prefect


def clear_waiting(root: Path) -> None:
    """The awaited decision is in (or the cycle ended otherwise): the workspace is free."""
    (root / WAITING).unlink(missing_ok=True)


def form(generation: int, summary: str) -> type:
    """The form the Prefect UI shows, with the gate summary as its description."""
    return approval_form().with_initial_data(
        description=f"**gen-{generation} passed the gate.** {summary}\n\nPromote it?",
        approver="")


def ask(generation: int, summary: str, flow_run, config: settings.Promotion, key: str) -> None:
    """Tell everyone a decision is wanted: the gate summary artifact, a notification, the log."""
    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    from flows.project import notify

    create_markdown_artifact(f"gen-{generation}: {summary}", key=GATE_ARTIFACT,
                             description=f"gen-{generation} waiting for approval")
    notify.send("waiting-approval", f"gen-{generation} passed the gate and waits for approval: "
                f"{summary}", generation=generation, run_id=str(flow_run.id))
    get_run_logger().info(
        "gen-%d passed the gate and waits for approval (promotion.approval_timeout=%ds): "
        "`offseason approve %s --reason ...` or `offseason reject %s --reason ...`, or the "
        "Prefect UI", generation, config.approval_timeout, flow_run.id, flow_run.id)


def await_approval(root: Path, generation: int, verdict: dict, config: settings.Promotion) -> dict:
    """Wait for a person's decision when params ask for one; returns the decision."""
    if not verdict["passed"]:
        return {"decision": "not-needed", "approver": None, "reason": "the gate failed"}
    if not config.require_approval:
        return {"decision": "not-required", "approver": None,
                "reason": "promotion.require_approval is false"}
    from prefect import get_run_logger
    from prefect.context import get_run_context
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run, suspend_flow_run

    logger = get_run_logger()
    summary = gate_summary(verdict)
    flow_run = get_run_context().flow_run
    key = f"approval-gen-{generation}"
    served = flow_run.deployment_id is not None
    if served and answered(flow_run.id, key):
        # the rerun of a resumed suspension: the decision is in, nobody is to be asked again
        # (suspend_flow_run below returns it at once)
        logger.info("gen-%d: the run was resumed with a decision; reading it", generation)
    else:
        ask(generation, summary, flow_run, config, key)
    try:
        if served:  # free the worker; the run is rescheduled and rerun on resume
            note_waiting(root, generation, flow_run, config.approval_timeout)
            answer = suspend_flow_run(wait_for_input=form(generation, summary),
                                      timeout=config.approval_timeout, key=key)
        else:
            # a second `offseason run` or a rollback meanwhile is told what to do (the lock)
            note_cycle(root, awaiting=f"gen-{generation}", awaiting_run=str(flow_run.id))
            try:
                answer = pause_flow_run(wait_for_input=form(generation, summary),
                                        timeout=config.approval_timeout, poll_interval=2,
                                        key=key)
            finally:
                note_cycle(root, awaiting="", awaiting_run="")
    except FlowPauseTimeout:
        # the run goes on (nothing promoted, the cycle committed as such): take it out of Paused,
        # or Prefect fails it at the end for never having been resumed
        from prefect.client.orchestration import get_client
        from prefect.states import Running

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Running(), force=True)
        logger.warning("gen-%d: no decision within promotion.approval_timeout=%ds; nothing is "
                       "promoted", generation, config.approval_timeout)
        return {"decision": "timeout", "approver": None,
                "reason": f"no decision within promotion.approval_timeout="
                          f"{config.approval_timeout}s: the champion stays"}
    decision = {"decision": "approved" if answer.decision == "approve" else "rejected",
                "approver": answer.approver or "unknown", "reason": answer.reason.strip(),
                "at": now()}
    logger.info("gen-%d %s by %s: %s", generation, decision["decision"], decision["approver"],
                decision["reason"])
    return decision


# --- the transaction -----------------------------------------------------------------------


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def _restore(path: Path, content: bytes | None) -> None:
    if content is None:
        path.unlink(missing_ok=True)
    else:
        path.write_bytes(content)


def show(root: Path, ref: str, path: str) -> bytes | None:
    """A file's bytes as committed at `ref`, or None."""
    out = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=root, capture_output=True)
    return out.stdout if out.returncode == 0 else None


def log_entries(root: Path) -> list[dict]:
    """The promotion log: one line per decision and alias change, oldest first."""
    path = root / LOG
    return io.read_jsonl(path) if path.exists() else []


def append_log(root: Path, entry: dict) -> None:
    """Append one entry to the promotion log."""
    path = root / LOG
    io.write_text(path, (path.read_text() if path.exists() else "")
                  + json.dumps(entry, sort_keys=True) + "\n")


def tag_alias_change(model_name: str, version: str, entry: dict) -> list[str]:
    """Record an alias change on the model version; returns the tag keys set."""
    from mlflow import MlflowClient

    from flows.project import tracking

    client = MlflowClient()
    stamp = entry["at"].replace(":", "").replace("+0000", "Z")
    tags = {f"alias.{stamp}": json.dumps({k: entry[k] for k in
                                          ("action", "generation", "approver", "reason",
                                           "approval_reason") if entry.get(k) is not None}),
            # no one approved (none was asked): "none", as a word, not Python's "None"
            "champion_since": entry["at"], "approver": tracking.tag_text(entry.get("approver") or None),
            # the approver's words on a promotion; a rollback's or init's reason otherwise
            "approval_reason": str(entry.get("approval_reason", entry.get("reason"))),
            "gate_summary": str(entry.get("gate_summary"))[:4000]}
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, value)
    return list(tags)


class Transaction:
    """Steps with their undo actions; a failure undoes what ran, in reverse order."""

    def __init__(self):
        """An empty transaction: nothing to undo yet."""
        self.undo: list[tuple[str, callable]] = []

    def __enter__(self):
        """Start the transaction."""
        return self

    def done(self, step: str, undo) -> None:
        """Record a finished step and how to undo it."""
        self.undo.append((step, undo))

    def __exit__(self, kind, err, tb):
        """On an error, undo the finished steps in reverse order, then let it raise."""
        if err is None:
            return False
        problems = []
        for step, undo in reversed(self.undo):
            try:
                undo()
            except Exception as undo_err:  # keep undoing the rest; report what could not be
                problems.append(f"undo of {step} failed: {undo_err}")
        if problems:
            raise PromotionFailed(f"promotion failed ({err}) and could not be fully undone: "
                                  + "; ".join(problems) + "; run `offseason run` again: it "
                                  "restores the committed state first") from err
        return False


def swap_champion(root: Path, source: Path, tx: Transaction) -> None:
    """models/champion becomes a copy of `source`, added to DVC (promote() pushes it)."""
    champion, backup = root / "models" / "champion", root / "models" / "champion.prev"
    pointer = root / "models" / "champion.dvc"
    before = _read(pointer)
    tmp = root / "models" / "champion.next"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(backup, ignore_errors=True)
    shutil.copytree(source, tmp)
    champion.rename(backup)

    def undo():
        shutil.rmtree(tmp, ignore_errors=True)
        if backup.exists():
            shutil.rmtree(champion, ignore_errors=True)
            backup.rename(champion)
        _restore(pointer, before)
        git(root, "reset", "--quiet", "--", "models/champion.dvc", check=False)  # autostage

    tx.done("weights", undo)
    tmp.rename(champion)
    dvc(root, "add", "--quiet", "models/champion")
    fault("weights")


def write_records(root: Path, record: dict, entry: dict | None, tx: Transaction) -> None:
    """Write the promotion record and log entry, undoable in `tx`."""
    log, metrics = root / LOG, root / "metrics" / "promotion.json"
    before = (_read(log), _read(metrics))
    tx.done("log", lambda: (_restore(log, before[0]), _restore(metrics, before[1])))
    if entry is not None:
        append_log(root, entry)
    io.write_json(metrics, record)
    fault("log")


CYCLE_PATHS = ["dvc.lock", "dvc.yaml", "params.yaml", "metrics", "data/inbox.dvc", LOG,
               str(ENVIRONMENT_SOURCES),
               "models/champion.dvc", "data/.gitignore", "models/.gitignore",
               "data/quarantine/.gitignore"]


def commit(root: Path, message: str, tag: str | None, tx: Transaction,
           paths: list[str] = CYCLE_PATHS) -> str:
    """Commit the cycle's paths (and tag it), undoable in `tx`; returns the commit. Only those
    paths: what else is staged (a cycle that ended early leaves DVC's staged lock and inbox
    pointer) stays staged, out of a rollback's commit.
    """
    head = git(root, "rev-parse", "HEAD")
    existing = [p for p in paths if (root / p).exists()]
    git(root, "add", "--", *existing)

    def undo():
        if tag:
            git(root, "tag", "-d", tag, check=False)
        if git(root, "rev-parse", "HEAD") != head:
            git(root, "reset", "--soft", head)
        git(root, "reset", "--quiet", check=False)  # unstage; the files stay as they were

    tx.done("git", undo)
    fault("git")
    git(root, "commit", "--quiet", "--allow-empty", "-m", message, "--", *existing)
    if tag:
        git(root, "tag", tag)
    return git(root, "rev-parse", "HEAD")


def move_alias(model_name: str, version: str, entry: dict, tx: Transaction) -> None:
    """Move the champion alias in the MLflow registry, undoable in `tx`."""
    from mlflow import MlflowClient

    from flows.project import tracking

    client = MlflowClient()
    previous = tracking.champion_version(model_name)
    old_tags = client.get_model_version(model_name, version).tags
    keys: list[str] = []

    def undo():
        for key in keys:  # the version's tags as they were (a rolled-back-to one had some)
            if key in old_tags:
                client.set_model_version_tag(model_name, version, key, old_tags[key])
            else:
                client.delete_model_version_tag(model_name, version, key)
        if previous is None:
            client.delete_registered_model_alias(model_name, tracking.ALIAS)
        else:
            tracking.set_champion(model_name, previous)

    tx.done("mlflow", undo)
    fault("mlflow")
    tracking.set_champion(model_name, version)
    keys.extend(tag_alias_change(model_name, version, entry))


def promote(root: Path, generation: int, verdict: dict, decision: dict, run_id: str,
            model_name: str, changes: dict | None = None) -> dict:
    """Register the candidate, and on a pass (approved where required) make it the champion.

    Always commits and tags the cycle gen-N; returns the promotion record with the commit.
    `changes`: this run's overrides of params.yaml (deployment parameters), kept in the record.
    """
    promoted = verdict["passed"] and decision["decision"] in ("approved", "not-required")
    if verdict["passed"] and not promoted:
        reason = f"passed the gate but {decision['decision']}: {decision['reason']}"
    else:
        reason = verdict["reason"]
    with Transaction() as tx:
        version = register(root, generation, verdict, run_id, model_name, tx)
        record, entry, message = _records(root, generation, verdict, decision, version, promoted,
                                          reason, model_name)
        if changes:  # the values this run used instead of the standing params.yaml
            record["overrides"] = changes
        # what the cycle read that git did not hold yet (a new environment module, a task
        # file): committed with it, so gen-N traces back to the files it ran on
        inputs = cycle_inputs(root)
        if (fresh := uncommitted(root, inputs)):
            record["committed_inputs"] = fresh
        if promoted:
            swap_champion(root, root / "models" / "candidate", tx)
        # the cycle's outputs and a new champion (a rollback pulls it from there); additive: the
        # remote keeps every version the tags name
        dvc(root, "push", "--quiet")
        write_records(root, record, entry, tx)
        record["commit"] = commit(root, message, f"gen-{generation}", tx,
                                  [*CYCLE_PATHS, *inputs])
        if promoted:
            move_alias(model_name, version, entry, tx)
    shutil.rmtree(root / "models" / "champion.prev", ignore_errors=True)
    clear_waiting(root)  # the decision, if one was awaited, is in the record
    record["message"] = message
    return record


def register(root: Path, generation: int, verdict: dict, run_id: str, model_name: str,
             tx: Transaction) -> str:
    """The candidate as a new MLflow model version (deleted again if the promotion fails)."""
    from mlflow import MlflowClient

    from flows.project import tracking

    version = tracking.register(root / "models" / "candidate", run_id, model_name, {
        "generation": generation, "passed": verdict["passed"],
        "candidate_score": verdict["candidate_score"]})
    tx.done("register", lambda: MlflowClient().delete_model_version(model_name, version))
    fault("register")
    return version


def _records(root: Path, generation: int, verdict: dict, decision: dict, version: str,
             promoted: bool, reason: str, model_name: str) -> tuple[dict, dict, str]:
    from flows.project import tracking

    record = {"generation": generation, "model_version": version, "promoted": promoted,
              "reason": reason, "candidate_score": verdict["candidate_score"],
              "champion_score": verdict["champion_score"], "decision": decision,
              "inputs": inputs_fingerprint(root), "at": now(),
              "champion_version": version if promoted else tracking.champion_version(model_name)}
    entry = {"action": "promote" if promoted else "hold", "generation": generation,
             "model_version": version, "champion_version": record["champion_version"],
             "champion_generation": generation if promoted else champion_generation(root),
             "approver": decision.get("approver"), "reason": reason,
             "decision": decision["decision"], "gate_summary": gate_summary(verdict),
             "at": record["at"]}
    if decision["decision"] in ("approved", "rejected"):  # a person's words, kept beside the gate's
        entry["approval_reason"] = decision["reason"]
    message = (f"gen-{generation}: candidate {verdict['candidate_score']:.3f} vs champion "
               f"{verdict['champion_score']:.3f} -> "
               f"{'promoted' if promoted else 'not promoted'} (model version {version}; {reason})")
    return record, entry, message


def champion_generation(root: Path) -> int:
    """The generation whose weights are the champion, from the log (0 before any promotion)."""
    changes = [e for e in log_entries(root) if e["action"] in ("init", "promote", "rollback")]
    return changes[-1]["champion_generation"] if changes else 0


def recover(root: Path, model_name: str) -> list[str]:
    """Put back the committed state a process that died mid-promotion left; returns what it did."""
    return recover_files(root) + recover_alias(root, model_name)


def recover_files(root: Path) -> list[str]:
    """The files part of recover(): the champion's weights and pointer, and the log, as committed.
    Run before any stage reads the champion; needs neither MLflow nor Prefect.
    """
    did = []
    backup = root / "models" / "champion.prev"
    if backup.exists():  # the old champion, moved aside by an unfinished promotion
        shutil.rmtree(root / "models" / "champion", ignore_errors=True)
        backup.rename(root / "models" / "champion")
        did.append("restored models/champion from models/champion.prev")
    for path in ("models/champion.dvc", LOG):
        committed = show(root, "HEAD", path)
        if committed is not None and _read(root / path) != committed:
            (root / path).write_bytes(committed)
            did.append(f"restored {path} as committed")
    if did:
        dvc(root, "checkout", "--quiet", "models/champion")
    return did


def recover_alias(root: Path, model_name: str) -> list[str]:
    """The MLflow part of recover(): the alias back on the version the log names."""
    from flows.project import tracking

    did = []
    entries = log_entries(root)
    version = entries[-1]["champion_version"] if entries else None
    if version is not None and str(tracking.champion_version(model_name)) != str(version):
        if tracking.version_exists(model_name, str(version)):
            tracking.set_champion(model_name, str(version))
            did.append(f"moved the MLflow alias back to version {version}, as the log says")
        else:  # a fresh or replaced MLflow store: nothing to move, the next promotion registers
            did.append(f"MLflow has no version {version} of {model_name!r} (a new tracking "
                       f"store?): the alias was left alone")
    return did + forget_uncommitted_versions(root, model_name, version)


def forget_uncommitted_versions(root: Path, model_name: str, champion: str | None) -> list[str]:
    """Delete the model versions a killed promotion registered: tagged with a generation that
    has no gen-N tag, by a cycle run that ended KILLED (the next cycle ends it so). The
    promotion's own undo deletes them when it fails; a kill left them in the registry, tagged
    `passed`, beside the version the rerun registered for the same candidate.
    """
    from mlflow import MlflowClient

    client, tagged, did = MlflowClient(), set(generations(root)), []
    for found in client.search_model_versions(f"name = '{model_name}'"):
        generation = str((found.tags or {}).get("generation", ""))
        if not generation.isdigit() or int(generation) in tagged or \
                str(found.version) == str(champion) or not found.run_id:
            continue
        try:
            killed = client.get_run(found.run_id).info.status == "KILLED"
        except Exception:  # noqa: BLE001 (a run deleted, another store): not ours to judge
            continue
        if killed:
            client.delete_model_version(model_name, found.version)
            did.append(f"deleted MLflow model version {found.version} of {model_name!r}: "
                       f"registered for gen-{generation} by a promotion that was killed, never "
                       f"committed")
    return did


# --- rollback ------------------------------------------------------------------------------


def rollback(root: Path, model_name: str, reason: str, approver: str,
             to: int | None = None) -> dict:
    """An earlier generation becomes the champion again: weights from DVC, alias, log, commit."""
    changes = [e for e in log_entries(root) if e["action"] in ("init", "promote", "rollback")]
    current = changes[-1]["champion_generation"] if changes else None
    if to is None:  # the champion before the current one
        earlier = [e["champion_generation"] for e in changes
                   if e["champion_generation"] != current]
        if not earlier:
            raise WorkspaceError("no earlier champion to roll back to (promotions.jsonl has "
                                 "none); `offseason history` lists the generations")
        to = earlier[-1]
    tag = f"gen-{to}"
    known = generations(root)
    if to not in known:
        raise WorkspaceError(f"no generation {tag}: the tags are "
                             f"{', '.join(f'gen-{g}' for g in known) or 'none yet'}")
    if to == current:
        raise WorkspaceError(f"{tag} is the champion already")
    record = read_at(root, tag, "metrics/promotion.json")
    pointer = show(root, tag, "models/champion.dvc")
    if record is None or pointer is None or not record.get("promoted"):
        raise WorkspaceError(f"{tag} was never a champion (no promoted record at git tag {tag}); "
                             f"`offseason history` shows which generations were")
    from flows.audit.lineage import check_champion

    check_champion(root, tag)  # `dvc pull` would check out an altered cache object as it is
    version = str(record["champion_version"])  # MLflow's calls take it as a string
    number = int(version) if version.isdigit() else version  # the log's, as a promotion's
    entry = {"action": "rollback", "generation": to, "model_version": number,
             "champion_version": number, "champion_generation": to, "approver": approver,
             "reason": reason, "decision": "rollback", "from_generation": current,
             "gate_summary": f"rollback from gen-{current} to {tag}", "at": now()}
    path = root / "models" / "champion.dvc"
    before = _read(path)
    with Transaction() as tx:
        tx.done("weights", lambda: (_restore(path, before),
                                    dvc(root, "checkout", "--quiet", "--force", "models/champion")))
        path.write_bytes(pointer)
        # from the local cache, or the DVC remote when this clone has never seen these weights
        dvc(root, "pull", "--quiet", "--force", "models/champion")
        log, metrics = root / LOG, root / "metrics" / "promotion.json"
        saved = (_read(log), _read(metrics))
        tx.done("log", lambda: (_restore(log, saved[0]), _restore(metrics, saved[1])))
        append_log(root, entry)
        # the last cycle's record, with the champion it now has: the inputs stay the last
        # cycle's, so a rollback alone does not start a cycle on the same traces
        last = json.loads(saved[1]) if saved[1] else {}
        io.write_json(metrics, {**last, "champion_version": number, "rollback": entry})
        commit_hash = commit(root, f"rollback: champion is {tag} again (model version {version}; "
                                   f"{reason}; by {approver})", None, tx,
                             [LOG, "models/champion.dvc", "metrics/promotion.json"])
        move_alias(model_name, version, entry, tx)
    return {**entry, "commit": commit_hash}
