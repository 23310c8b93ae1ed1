"""Approval through real Prefect flow runs, the promotion transaction, its log, and rollback."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import BIN, REPO, cli_env, make_project, offseason, shared_prefect_api

pytestmark = pytest.mark.slow

FLOW = '''
import json, sys
from pathlib import Path
from prefect import flow
from flows.orchestration.promotion import await_approval
from flows.project import params as settings
from stages import config as cfg

VERDICT = {"passed": True, "candidate_score": 0.6, "champion_score": 0.4, "difference": 0.2,
           "interval": [0.1, 0.3], "confidence": 0.9, "primary": "arith", "failures": []}

@flow(name="approval-check", flow_run_name="gen-" + sys.argv[1])
def check(timeout: int):
    return await_approval(Path("."), int(sys.argv[1]), VERDICT,
                          settings.Promotion(require_approval=True, approval_timeout=timeout))

if __name__ == "__main__":
    print("DECISION " + json.dumps(check(int(sys.argv[2]))), flush=True)
'''


@pytest.fixture
def prefect_api():
    """A real Prefect server on 127.0.0.1, shared by the flow runs and the CLI as a team would
    share one (`offseason ui`): the test session's (conftest.shared_prefect_api). The embedded
    default works too, each process opening the same database in PREFECT_HOME through a temporary
    server, but every command then pays for starting one, which makes a test of three decisions
    slow. No other test leaves a run waiting for a decision on it (`pending` lists them all).
    """
    return {"PREFECT_API_URL": shared_prefect_api()}


def cli(root, api, *args, check=True):
    result = subprocess.run([str(BIN / "offseason"), *args], cwd=root, capture_output=True,
                            text=True, env={**cli_env(root), **api})
    if check and result.returncode != 0:
        raise AssertionError(f"offseason {' '.join(args)}: {result.stdout}\n{result.stderr}")
    return result


def start_flow(root, api, generation, timeout):
    env = {**cli_env(root), **api, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(root / "flowcheck.py"), str(generation),
                             str(timeout)], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def decision(proc):
    out, _ = proc.communicate(timeout=300)
    line = next((line for line in out.splitlines() if line.startswith("DECISION ")), None)
    assert line, out[-3000:]
    return json.loads(line[len("DECISION "):]), out


def test_approve_reject_and_timeout_through_prefect(tmp_path, prefect_api):
    root = make_project(tmp_path / "p")
    (root / "flowcheck.py").write_text(FLOW)
    approve, reject = start_flow(root, prefect_api, 1, 600), start_flow(root, prefect_api, 2, 600)
    timeout = start_flow(root, prefect_api, 3, 4)
    waiting = {}
    deadline = time.time() + 240
    while len(waiting) < 2 and time.time() < deadline:
        listing = cli(root, prefect_api, "pending").stdout
        waiting = {line.split()[1]: line.split()[0] for line in listing.splitlines()
                   if line[:1].strip() and len(line.split()) > 2 and line.split()[1] in
                   ("gen-1", "gen-2")}
    assert set(waiting) == {"gen-1", "gen-2"}, listing
    assert "gen-1: arith: candidate 0.600 vs champion 0.400" in listing  # the gate summary
    cli(root, prefect_api, "approve", waiting["gen-1"], "--reason", "clearly better",
        "--approver", "alice")
    out = cli(root, prefect_api, "reject", waiting["gen-2"], "--reason", "wait for the audit")
    assert "rejected" in out.stdout
    approved, _ = decision(approve)
    assert (approved["decision"], approved["approver"], approved["reason"]) == \
        ("approved", "alice", "clearly better")
    rejected, _ = decision(reject)
    assert rejected["decision"] == "rejected" and rejected["reason"] == "wait for the audit"
    timed_out, log = decision(timeout)
    assert timed_out["decision"] == "timeout" and "approval_timeout=4s" in timed_out["reason"]
    assert "Finished in state Completed" in log  # the run goes on, it is not failed
    again = cli(root, prefect_api, "approve", waiting["gen-1"], "--reason", "twice", check=False)
    assert again.returncode == 2 and "is not waiting for a decision" in again.stderr


def test_a_run_waiting_for_approval_holds_the_workspace_until_its_timeout(tmp_path):
    import datetime as dt
    from types import SimpleNamespace

    from flows.orchestration.promotion import WAITING, clear_waiting, note_waiting, waiting_refusal

    assert waiting_refusal(tmp_path, "any") is None  # nothing waits
    run = SimpleNamespace(id="1f0e-run", name="brave-otter")
    note_waiting(tmp_path, 3, run, timeout=3600)
    refusal = waiting_refusal(tmp_path, "another-run")
    assert "gen-3 (flow run brave-otter, 1f0e-run) waits for approval until" in refusal
    assert "`offseason approve 1f0e-run --reason ...`" in refusal
    assert waiting_refusal(tmp_path, "1f0e-run") is None  # its own resume goes on
    assert (tmp_path / WAITING).exists()
    clear_waiting(tmp_path)
    assert waiting_refusal(tmp_path, "another-run") is None

    # past its timeout the Prefect server fails the waiting run: the note no longer holds anything
    note_waiting(tmp_path, 3, run, timeout=3600)
    note = json.loads((tmp_path / WAITING).read_text())
    note["until"] = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)).isoformat()
    (tmp_path / WAITING).write_text(json.dumps(note))
    assert waiting_refusal(tmp_path, "another-run") is None
    assert not (tmp_path / WAITING).exists()
    (tmp_path / WAITING).write_text("{not json")  # a torn note cannot hold the workspace either
    assert waiting_refusal(tmp_path, "another-run") is None


def weights(root, folder="models/champion"):
    return hashlib.sha256((root / folder / "model.safetensors").read_bytes()).hexdigest()


def git(root, *args, check=True):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=check).stdout.strip()


PASSED = {"passed": True, "candidate_score": 0.5, "champion_score": 0.1, "difference": 0.4,
          "interval": [0.3, 0.5], "confidence": 0.9, "primary": "arith", "failures": [],
          "reason": "lower bound +0.300 > 0.0; every guard held"}


def test_interrupted_promotion_is_undone_and_rollback_restores_the_weights(initialised,
                                                                          monkeypatch, chromium):
    import mlflow
    import torch

    from flows.orchestration import promotion
    from flows.project import tracking
    from stages import tinylm

    root = initialised
    gen0 = weights(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    run_id = client.create_run(tracking.experiment(root), run_name="gen-1").info.run_id
    # a real, different candidate: the champion with its weights moved a little
    model, tokenizer = tinylm.load(root / "models/champion")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    tinylm.save(model, tokenizer, root / "models/candidate")
    candidate = weights(root, "models/candidate")
    not_required = {"decision": "not-required", "approver": None, "reason": "-"}
    name = "offseason-agent"
    committed = {p: git(root, "show", f"HEAD:{p}") for p in ("models/champion.dvc",
                                                               "promotions.jsonl",
                                                               "metrics/promotion.json")}

    def consistent():
        assert weights(root) == gen0
        assert {p: (root / p).read_text().strip() for p in committed} == committed
        assert git(root, "status", "--porcelain", "--", *committed) == ""
        assert "gen-1" not in git(root, "tag", "--list").split()
        assert not (root / "models/champion.prev").exists()
        assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
        assert [str(v.version) for v in client.search_model_versions(f"name = '{name}'")] == ["1"]
        assert promotion.recover(root, name) == []  # the next cycle finds nothing to repair

    # 1. git refuses the commit (a real failure: a pre-commit hook), after the weights moved
    hook = root / ".git/hooks/pre-commit"
    hook.write_text("#!/bin/sh\necho 'commits are frozen' >&2\nexit 1\n")
    hook.chmod(0o755)
    with pytest.raises(Exception, match="commits are frozen"):
        promotion.promote(root, 1, PASSED, not_required, run_id, name)
    consistent()
    hook.unlink()
    # 2. the MLflow step fails after the commit and tag: both are taken back
    monkeypatch.setenv("OFFSEASON_FAIL_AT", "promote:mlflow")
    with pytest.raises(promotion.PromotionFailed, match="promote:mlflow"):
        promotion.promote(root, 1, PASSED, not_required, run_id, name)
    consistent()
    monkeypatch.delenv("OFFSEASON_FAIL_AT")

    # 3. killed right after registering (no undo ran): the next cycle ends the killed run as
    # KILLED, and recover() deletes the version it left, tagged passed, for a gen-1 never made
    killed = client.create_run(tracking.experiment(root), run_name="gen-1").info.run_id
    left = tracking.register(root / "models/candidate", killed, name,
                             {"generation": 1, "passed": True, "candidate_score": 0.5})
    client.set_terminated(killed, status="KILLED")
    assert promotion.recover(root, name) == [
        f"deleted MLflow model version {left} of {name!r}: registered for gen-1 by a promotion "
        f"that was killed, never committed"]
    consistent()

    # the next attempt goes through: every record agrees
    record = promotion.promote(root, 1, PASSED, not_required, run_id, name)
    assert record["promoted"] and weights(root) == candidate
    assert git(root, "rev-parse", "gen-1") == git(root, "rev-parse", "HEAD") == record["commit"]
    assert git(root, "status", "--porcelain", "--", *committed) == ""
    version = record["model_version"]
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(version)
    tags = client.get_model_version(name, version).tags
    assert tags["gate_summary"].startswith("arith: candidate 0.500 vs champion 0.100")
    assert any(k.startswith("alias.") and json.loads(v)["action"] == "promote"
               for k, v in tags.items())
    log = [json.loads(line) for line in (root / "promotions.jsonl").read_text().splitlines()]
    assert [e["action"] for e in log] == ["init", "promote"]

    # a process that died mid-promotion (weights swapped, alias moved): recover() repairs it
    (root / "models/champion").rename(root / "models/champion.prev")
    subprocess.run(["cp", "-r", str(root / "models/candidate"), str(root / "models/champion")],
                   check=True)
    (root / "models/champion.dvc").write_text("outs:\n- path: champion\n")
    tracking.set_champion(name, "1")
    assert len(promotion.recover(root, name)) == 3
    assert weights(root) == candidate
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(version)

    # rollback: the weights come back from the DVC remote (the local cache is gone)
    shutil.rmtree(root / ".dvc/cache")
    # ... but not altered ones: `dvc pull` would check them out as they are
    folder = git(root, "show", "gen-0:models/champion.dvc").split("md5: ")[1].split()[0]
    store = root / ".dvcstore/files/md5"
    files = json.loads((store / folder[:2] / folder[2:]).read_text())
    part = next(f["md5"] for f in files if f["relpath"] == "model.safetensors")
    remote = store / part[:2] / part[2:]
    good = remote.read_bytes()
    os.chmod(remote, 0o644)
    remote.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    refused = offseason(root, "rollback", "--reason", "x", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "the champion of gen-0 does not match models/champion.dvc at gen-0" in refused.stderr
    assert f"models/champion/model.safetensors (md5 {part}" in refused.stderr
    assert f"altered in the remote local ({remote})" in refused.stderr
    assert weights(root) == candidate
    assert [json.loads(line)["action"] for line in
            (root / "promotions.jsonl").read_text().splitlines()] == ["init", "promote"]
    remote.write_bytes(good)
    # what a cycle that ended early left staged (DVC stages its lock and inbox pointer) stays out
    # of the rollback's commit, which holds only its own files (it committed everything staged)
    params = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(params + "# staged by someone else\n")
    git(root, "add", "params.yaml")
    out = offseason(root, "rollback", "--reason", "answers got worse in production",
                    "--approver", "bob")
    assert "params.yaml" not in git(root, "show", "--name-only", "--format=", "HEAD").split()
    assert git(root, "diff", "--cached", "--name-only") == "params.yaml"
    git(root, "reset", "-q", "params.yaml")
    (root / "params.yaml").write_text(params)
    assert "gen-0 is the champion again" in out.stdout
    assert weights(root) == gen0
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    last = json.loads((root / "promotions.jsonl").read_text().splitlines()[-1])
    assert (last["action"], last["generation"], last["from_generation"], last["approver"]) == \
        ("rollback", 0, 1, "bob")
    assert last["reason"] == "answers got worse in production"
    assert git(root, "status", "--porcelain", "--", *committed) == ""
    assert client.get_model_version(name, "1").tags["approver"] == "bob"
    # the generation rolled back from says so (it said only "promoted to champion")
    from flows.audit import lineage

    text = lineage.text(lineage.lineage(root, "gen-1", with_mlflow=False, with_traces=False))
    assert "rolled back    from it to gen-0 at " in text and \
        "by bob: answers got worse in production" in text, text
    rows = json.loads(offseason(root, "history", "--json").stdout)
    assert [r["champion"] for r in rows] == [True, False]
    # the rollback is on the record in history, its JSON and the report (issue 53.1)
    back = rows[1]["rollbacks"][0]
    assert (back["from"], back["to"], back["approver"], back["reason"]) == \
        ("gen-1", "gen-0", "bob", "answers got worse in production")
    assert rows[0]["rollbacks"] == []
    table = offseason(root, "history").stdout
    assert "champion gen-1 -> gen-0 (model version 1) by bob: answers got worse in production" \
        in table, table
    from flows.audit.report import champion_after

    assert champion_after(rows) == [rows[0]["score"], rows[0]["score"]]  # the line drops back
    offseason(root, "report")
    page = (root / "reports" / "index.html").read_text()
    assert 'class="rollback"' in page and "champion gen-1 &rarr; gen-0" in page
    from browser import Browser  # the row as a person reads it, in headless Chromium

    with Browser(chromium) as browser:
        browser.open((root / "reports" / "index.html").as_uri())
        browser.wait_for("document.querySelector('tr.rollback')")
        shown = browser.eval("[...document.querySelectorAll('tr.rollback')].map(r => r.innerText)")
    assert len(shown) == 1 and "champion gen-1 \u2192 gen-0" in shown[0] and "by bob" in shown[0] \
        and "answers got worse in production" in shown[0], shown
    offseason(root, "rollback", "--to", "gen-1", "--reason", "the fix is out")
    assert weights(root) == candidate
    assert str(client.get_model_version_by_alias(name, "champion").version) == str(version)
    wrong = offseason(root, "rollback", "--to", "gen-7", "--reason", "x", check=False)
    assert wrong.returncode == 2 and "no generation gen-7: the tags are gen-0, gen-1" in \
        wrong.stderr
    # the log's versions are numbers, a rollback's as a promotion's (a rollback wrote strings)
    assert {type(json.loads(line)["model_version"]) for line in
            (root / "promotions.jsonl").read_text().splitlines()} == {int}


def test_the_approval_form_has_no_default_decision_and_requires_a_reason():
    """An untouched form rejected without a word ("approve" started off, the reason could be
    empty) while the CLI requires --reason (issue 53.3)."""
    import pydantic

    from flows.orchestration.promotion import form

    schema = form(1, "arith +5 points").model_json_schema()
    assert {"decision", "reason"} <= set(schema["required"])
    assert "default" not in schema["properties"]["decision"]
    assert schema["properties"]["decision"]["enum"] == ["approve", "reject"]
    assert schema["properties"]["reason"]["minLength"] == 1
    for bad in ({"reason": "fine"}, {"decision": "approve"}, {"decision": "approve", "reason": " "}):
        with pytest.raises(pydantic.ValidationError):
            form(1, "x")(**bad)
    answer = form(1, "x")(decision="reject", reason="worse on code")
    assert answer.decision == "reject" and answer.approver == ""


def test_pending_knows_without_prefect_whether_anything_waits(tmp_path):
    """`offseason pending` without a Prefect server reads the workspace's own record first and
    starts Prefect's temporary server only when a cycle waits there (issue 53.9: 14-23 s to say
    none)."""
    from types import SimpleNamespace

    from flows.orchestration.promotion import awaits_decision, clear_waiting, note_waiting
    from flows.project.workspace import cycle_lock, note_cycle

    assert awaits_decision(tmp_path) is False  # nothing ever ran
    with cycle_lock(tmp_path, "offseason run"):
        assert awaits_decision(tmp_path) is False  # a cycle runs, and waits for nobody
        note_cycle(tmp_path, awaiting="gen-2", awaiting_run="1f0e-run")
        assert awaits_decision(tmp_path) is True  # paused for a decision (`offseason run`)
        note_cycle(tmp_path, awaiting="", awaiting_run="")
        assert awaits_decision(tmp_path) is False
    assert awaits_decision(tmp_path) is False  # the lock is free again
    note_waiting(tmp_path, 3, SimpleNamespace(id="2a-run", name="gen-3"), timeout=3600)
    assert awaits_decision(tmp_path) is True  # a served run suspended for a decision
    clear_waiting(tmp_path)
    assert awaits_decision(tmp_path) is False
    # the CLI as a fresh clone runs it: no server set, Prefect's home in the project
    env = {**cli_env(tmp_path, shared_prefect=False), "PREFECT_HOME": str(tmp_path / "home")}
    out = subprocess.run([str(BIN / "offseason"), "pending"], cwd=make_project(tmp_path / "p"),
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "no cycle is waiting" in out.stdout, out.stderr
    assert not (tmp_path / "home").exists(), "Prefect (and its temporary server) was started"
