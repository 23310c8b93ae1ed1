"""Faults: a cycle SIGKILLed in every stage (each rerun redoing only the unfinished stage), two
cycles at once, a full disk during a stage write.

    pytest -q tests/cycle/test_faults.py
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    BIN,
    cli_env,
    hold_cycle_lock,
    kill_and_reap,
    make_project,
    offseason,
    stage_process,
)

STAGES = ["ingest", "validate", "rollout", "reward", "train", "champion_scores", "gate"]


def outs(root) -> dict[str, str]:
    """The hash of every data and model output in dvc.lock, GE's Data Docs included. Not compared:
    the metrics files (rollout and train time themselves; ingest's, validate's and gate's are
    compared below as JSON).
    """
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {o["path"]: o["md5"] for stage in STAGES for o in lock[stage]["outs"]
            if not o["path"].startswith("metrics/")}


def newest(root: Path, stage: str) -> int:
    """The newest modification time (ns) among a stage's outputs in dvc.yaml, or -1 when none
    exists yet: a stage DVC skips leaves them alone, a stage that runs rewrites them.
    """
    outs = yaml.safe_load((root / "dvc.yaml").read_text())["stages"][stage].get("outs", [])
    times = [-1]
    for out in outs:
        path = root / (out if isinstance(out, str) else next(iter(out)))
        if path.exists():
            times += [p.stat().st_mtime_ns for p in [path, *(path.rglob("*") if path.is_dir()
                                                            else [])]]
    return max(times)


@pytest.mark.slow
def test_killed_in_each_stage_then_rerun_gives_the_uninterrupted_outputs(tmp_path, simulated):
    reference = simulated
    killed = tmp_path / "killed"
    shutil.copytree(reference, killed, symlinks=True)
    for name in ("mlflow.db", "mlartifacts"):  # its own MLflow: only git, DVC and data copied
        shutil.rmtree(killed / name, ignore_errors=True) if (killed / name).is_dir() else \
            (killed / name).unlink(missing_ok=True)
    done = offseason(reference, "run")
    # the same project: its erasure salt (made by its first ingest, kept out of git) copied, or
    # the two indexes in data/traces would hash the same people differently
    (killed / ".offseason").mkdir(exist_ok=True)
    shutil.copy(reference / ".offseason" / "erasure.salt", killed / ".offseason" / "erasure.salt")
    # the model stages were forked from the session's warm server (flows/orchestration/forkserver.py), and
    # what they wrote is what the killed runs below must reproduce
    assert "starts cold" not in done.stdout + done.stderr, done.stderr[-3000:]

    for i, stage in enumerate(STAGES):
        stamps = {s: newest(killed, s) for s in STAGES}
        with open(tmp_path / f"run-{stage}.log", "w") as out:
            proc = subprocess.Popen([str(BIN / "offseason"), "run"], cwd=killed,
                                    env=cli_env(killed), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        pid = stage_process(killed, stage, proc)
        time.sleep(0.3)  # into the stage's work, not only its start
        if stage == "ingest":  # a second cycle meanwhile is refused, naming this one
            # the stage held until the flow (it starts after the stages) has noted its runs
            os.kill(pid, signal.SIGSTOP)
            lock = killed / ".offseason/cycle.lock"
            deadline = time.time() + 300
            while "mlflow_run_id" not in lock.read_text() and time.time() < deadline:
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGSTOP)  # a stopped holder still holds the lock
            second = offseason(killed, "run", check=False)
            held = json.loads(lock.read_text())
            assert second.returncode == 2, second.stderr[-2000:]
            assert f"pid {proc.pid}" in second.stderr
            assert f"started {held['started']}" in second.stderr
            assert f"Prefect flow run {held['flow_run']}" in second.stderr
            assert f"MLflow run {held['mlflow_run_id']}" in second.stderr
        if stage == "rollout":  # `offseason run` alone, as `kill -9 <its pid>` does: its DVC
            # session and the stage run on; the next run stops them (DVC found its files "busy")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            # held where it is (rollout can end within a second, and its session with it)
            os.kill(pid, signal.SIGSTOP)
            left_running = pid
        else:
            kill_and_reap(proc)
        assert "gen-1" not in subprocess.run(["git", "tag"], cwd=killed, capture_output=True,
                                             text=True).stdout
        if stage == "reward":
            said = (tmp_path / "run-reward.log").read_text()
            assert "offseason: stopped what the killed cycle left running: the DVC session and " \
                   "its stage (pid" in said, said[-3000:]
            assert not Path(f"/proc/{left_running}").exists()
        if i:  # this run redid only what the last one left unfinished: the stage killed then
            for done in STAGES[:i - 1]:
                assert newest(killed, done) == stamps[done], f"{done} reran before {stage}"
            assert newest(killed, STAGES[i - 1]) > stamps[STAGES[i - 1]], STAGES[i - 1]
    final = offseason(killed, "run")
    assert "cleared a stale cycle lock: offseason run (pid" in final.stderr
    assert "gen-1: candidate" in final.stdout
    log = final.stdout + final.stderr  # and says so, stage by stage
    for stage in STAGES[:-1]:
        assert f"Running stage '{stage}'" not in log and f"{stage}: up to date, skipped" in log
    assert "Running stage 'gate'" in log

    # the same outputs, hash for hash, as the cycle that was never interrupted
    assert outs(killed) == outs(reference)
    assert {"data/traces", "data/ingested.parquet", "data/validated.parquet",
            "data/rollouts.parquet", "data/rewards.parquet", "models/candidate",
            "data/gate.parquet", "data/docs"} <= set(outs(reference))
    # no trace lost or counted twice
    for name in ("ingest", "validate", "gate"):  # what they counted; not what they used
        assert {**json.loads((killed / f"metrics/{name}.json").read_text()), "resources": 0} == \
            {**json.loads((reference / f"metrics/{name}.json").read_text()), "resources": 0}, name
    assert not list((killed / "data").rglob(".*.tmp*"))  # nothing half-written left behind
    # the ledger prices what every attempt of the cycle ran, as the uninterrupted cycle's does
    # (the last attempt alone ran the gate: the other stages were "reused", $0 and no traces)
    stages = json.loads((killed / "metrics/cost.json").read_text())["stages"]
    assert set(stages) == set(STAGES) and not [s for s in stages if stages[s].get("reused")]
    # the killed attempts' MLflow runs were ended by the runs after them (they showed as
    # running forever); the one that finished is FINISHED
    import mlflow
    client = mlflow.MlflowClient(f"sqlite:///{killed / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("offseason").experiment_id],
                              "attributes.run_name = 'gen-1'")
    assert sorted(r.info.status for r in runs) == ["FINISHED"] + ["KILLED"] * (len(runs) - 1)
    assert len(runs) > 1


def test_the_remains_of_a_killed_writer_are_removed_by_the_next_write(tmp_path):
    import pyarrow as pa

    from stages import io
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "rows.parquet"
    stale = tmp_path / f".rows.parquet.tmp-{dead.pid}"  # what a SIGKILL mid-write leaves
    live = tmp_path / f".rows.parquet.tmp-{os.getppid()}"  # a writer still running: kept
    other = tmp_path / f".other.parquet.tmp-{dead.pid}"  # another file's: not this write's to clear
    for path in (stale, live, other):
        path.write_bytes(b"PAR1 half")
    io.write_parquet(target, pa.table({"x": [1]}))
    assert target.exists() and not stale.exists()
    assert live.exists() and other.exists()


def test_a_killed_holder_of_the_lock_is_detected_and_cleared(tmp_path):
    root = make_project(tmp_path / "p")
    holder = hold_cycle_lock(root)
    refused = offseason(root, "run", check=False)
    assert refused.returncode == 2
    assert f"another cycle is running in {root}: offseason run (pid {holder.pid}, started" in \
        refused.stderr
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    again = offseason(root, "run", check=False)  # gets past the lock, stops at "no champion"
    assert "cleared a stale cycle lock: offseason run (pid" in again.stderr
    assert "offseason init" in again.stderr and "another cycle" not in again.stderr


FULL_DISK = r"""
import json, os, sys
from pathlib import Path
from stages import config as cfg, ingest
inbox, out = Path(sys.argv[1]), Path(sys.argv[2])
args = (cfg.Ingest(), inbox, out / "traces", out / "ingested.parquet", out / "quarantine.jsonl")
first = ingest.run(*args)
before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
(inbox / "b.jsonl").write_bytes((inbox / "a.jsonl").read_bytes().replace(b'"id": "', b'"id": "b')
                                .replace(b"What is", b"Compute"))  # new traces, not duplicates
filler = out / "filler"
try:  # fill the disk to the last block
    with filler.open("wb") as handle:
        while True:
            handle.write(b"x" * 4096)
            handle.flush()
except OSError:
    pass
filler.write_bytes(filler.read_bytes()[: -16 * 1024])  # room for a little, not for the outputs
try:
    ingest.run(*args)
    error = None
except OSError as err:
    error = str(err)
after = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()
         and p.name != "filler"}
filler.unlink()
third = ingest.run(*args)
def whole(name, data):
    import pyarrow as pa, pyarrow.parquet as pq
    try:
        if name.endswith(".parquet"):  # in this thread: see flows.audit.lineage.read_parquet
            pq.read_table(pa.BufferReader(data), use_threads=False, pre_buffer=False)
        elif name.endswith(".jsonl"):
            [json.loads(x) for x in data.decode().split("\n") if x.strip()]
        else:
            json.loads(data)
        return True
    except Exception:
        return False
print(json.dumps({"error": error, "first": first["accepted"], "third": third["accepted"],
                  "total": third["total_traces"],
                  "changed": sorted(k for k in after if before.get(k) != after[k]),
                  "not_whole": sorted(k for k in after if not whole(k, after[k])),
                  "tmp": sorted(k for k in after if ".tmp" in k)}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare for a private tmpfs")
def test_a_full_disk_during_ingest_leaves_no_partial_output(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    lines = [json.dumps({"id": f"t{i}", "messages": [
        {"role": "user", "content": f"What is {i}+{i}? " + random.Random(i).randbytes(400).hex()},
        {"role": "assistant", "content": f"answer:{2 * i}"}]}) for i in range(300)]
    (inbox / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    # a private mount namespace: the small tmpfs is gone when the command ends
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size=4m tmpfs "{out}" && exec "{sys.executable}" -c "$0" "$1" "$2"',
         FULL_DISK, str(inbox), str(out)],
        capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["error"] and "No space left on device" in report["error"], report
    # what the failed run left: every file whole (the old one, or a new one renamed into place
    # complete), no temporary file, and the manifest, which says what is ingested, untouched
    assert report["not_whole"] == [] and report["tmp"] == [], report
    assert "traces/manifest.json" not in report["changed"], report
    # and with space again, the run completes with every trace of both files
    assert report["first"] == report["third"] == 300 and report["total"] == 600


@pytest.mark.slow
def test_mlflow_server_lost_mid_cycle_fails_naming_it_and_promotes_nothing(tmp_path):
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
         "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--default-artifact-root", (tmp_path / "artifacts").as_uri()],
        # as `offseason ui` starts it: without MLflow's job runner (nine huey processes of
        # about 240 MB each, polling), which offseason never uses
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the MLflow server did not start")
        root = make_project(tmp_path / "p")
        # MLflow's client retries with exponential backoff; fewer, shorter tries in a test
        env = {**cli_env(root), "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
        for command in ("init", "simulate"):
            done = subprocess.run([str(BIN / "offseason"), command], cwd=root, env=env,
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
        champion = (root / "models/champion.dvc").read_text()
        proc = subprocess.Popen([str(BIN / "offseason"), "run"], cwd=root, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        output = []
        for line in proc.stdout:
            output.append(line)
            if "Running stage 'rollout'" in line and server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)  # the server is gone mid-cycle
        proc.wait()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    text = "".join(output)
    assert proc.returncode == 2, text[-3000:]
    assert f"MLflow at {uri} did not answer" in text and "run `offseason run` again" in text
    assert "Traceback" not in text.split(f"MLflow at {uri}")[-1]
    tags = subprocess.run(["git", "tag"], cwd=root, capture_output=True, text=True).stdout.split()
    assert tags == ["gen-0"]  # no cycle committed
    assert (root / "models/champion.dvc").read_text() == champion  # no champion replaced
    assert json.loads((root / "metrics/promotion.json").read_text())["generation"] == 0


@pytest.mark.slow
def test_a_corrupted_champion_in_the_dvc_cache_is_found_before_anything_trains(simulated):
    root = simulated
    folder = yaml.safe_load((root / "models/champion.dvc").read_text())["outs"][0]["md5"]
    cache = root / ".dvc/cache/files/md5"
    files = json.loads((cache / folder[:2] / folder[2:]).read_text())
    weights = next(f["md5"] for f in files if f["relpath"] == "model.safetensors")
    cached = cache / weights[:2] / weights[2:]
    os.chmod(cached, 0o644)
    data = bytearray(cached.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped weight byte: same size, still loads
    cached.write_bytes(bytes(data))
    # what a user's `dvc checkout` (say, going back to gen-0) does with it: the corrupt bytes,
    # without a word
    shutil.rmtree(root / "models/champion")
    subprocess.run([str(BIN / "dvc"), "checkout", "-q", "models/champion"], cwd=root, check=True)
    assert (root / "models/champion/model.safetensors").read_bytes() == bytes(data)

    result = offseason(root, "run", check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the champion does not match models/champion.dvc" in result.stderr
    assert f"models/champion/model.safetensors (md5 {weights}" in result.stderr
    assert f"altered in the cache ({cached})" in result.stderr
    assert "altered in the workspace" in result.stderr
    assert "dvc pull models/champion" in result.stderr and "offseason rollback" in result.stderr
    # nothing trained on it: no stage ran, no candidate, no tag
    assert "Running stage" not in result.stdout + result.stderr
    assert not (root / "models/candidate").exists()
    tags = subprocess.run(["git", "tag"], cwd=root, capture_output=True, text=True).stdout
    assert tags.split() == ["gen-0"]

    verify = offseason(root, "lineage", "--verify", "gen-0", check=False)
    assert verify.returncode == 1
    assert f"models/champion/model.safetensors ({weights})" in verify.stdout
    assert "altered in the cache" in verify.stdout

    # the repair the message gives: the remote's good copy replaces both
    subprocess.run(f"rm -rf models/champion && {BIN / 'dvc'} pull -q models/champion",
                   shell=True, cwd=root, check=True)
    assert "all hashes resolve and match" in offseason(root, "lineage", "--verify",
                                                       "gen-0").stdout
