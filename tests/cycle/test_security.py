"""Nothing leaves the machine, no secret is recorded, every server listens on loopback only;
and what a fresh clone's first cycle leaves behind.

One whole cycle (init, simulate, run; the TINY config) runs in a network namespace of its own
(`unshare -n`: only a loopback interface, no route anywhere), with an API key in the environment
and secrets in a trace. Before `run`, the traces come in by the two other ways than files:
`offseason collect` receives an agent on the real `openai` client, instrumented by OpenTelemetry's
GenAI instrumentation and by OpenInference's, each exporting over OTLP/HTTP protobuf and JSON
(tests/openai_agent.py, against a scripted OpenAI-compatible server); and params.yaml's `pull:`
makes the cycle pull from a scripted Langfuse server first (tests/trace_services.py). While it
runs, every listening socket in that namespace is recorded (all of them are offseason's or
the tests' scripted servers': the namespace is new). Then every MLflow param, tag, metric name
and artifact, the Prefect database (flow run logs included) and every DVC output and cache
object are searched for the secrets.
"""

import gzip
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import BIN, REPO, TINY, cli_env, make_project, netns_available
from openai_agent import TRAFFIC
from trace_services import LF_NEW, LF_OLD, Service, after, iso, langfuse_data

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("security")]

ENV_SECRET = "sk-test-" + "Zq8Wm2Rt" * 4  # what a user has exported for another tool
TRACE_SECRETS = ["sk-proj-" + "Hf3kLp9QxT" * 3, "ghp_" + "Yb7Nc2Vd4Fg6Hj8Kl0Mn" * 2,
                 "AKIA" + "QWERTYUIOP123456", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ0ZXN0dXNlciJ9."
                 "c2lnbmF0dXJlc2lnbmF0dXJl"]
STAGES = ["ingest", "validate", "rollout", "reward", "train", "champion_scores", "gate"]
BEARER = "Tk9TZWNyZXRGb3JZb3U5ODc2NTQzMjE"
# what tests/trace_services.py's scripted Langfuse server takes
LANGFUSE_KEYS = {"LANGFUSE_PUBLIC_KEY": "pk-lf-test", "LANGFUSE_SECRET_KEY": "sk-lf-test"}


NETNS = netns_available()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listeners(pid: int) -> set[str]:
    """Listening TCP addresses in the network namespace of `pid`, once it has one of its own.

    Until `unshare` has made its namespace (just after the fork) and again once it has exited,
    /proc/<pid>/net shows this machine's namespace, whose listeners are not offseason's (CI's
    host has its own servers): those moments are skipped.
    """
    found: set[str] = set()

    def own_namespace() -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        except OSError:
            return False

    if not own_namespace():
        return found
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            # each 32-bit word is in the kernel's (little-endian) byte order
            if name == "tcp":
                address = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:
                address = socket.inet_ntop(socket.AF_INET6, b"".join(
                    raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.add(f"{address}:{int(port, 16)}")
    # read again after: it may have exited (and /proc shown the machine's namespace) meanwhile
    return found if own_namespace() else set()


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    # every cycle pulls from Langfuse first; `offseason collect` writes a trace as soon as it ended
    root = make_project(tmp / "project", {**TINY, "pull": {"service": "langfuse"},
                                          "runtime": {"collect": {"file_seconds": 0.0}}})
    langfuse_port, collect_port = free_port(), free_port()
    env = {**cli_env(root, shared_prefect=False), "PREFECT_HOME": str(tmp / "prefect"), "OPENAI_API_KEY": ENV_SECRET,
           "ANTHROPIC_API_KEY": ENV_SECRET, "HF_TOKEN": ENV_SECRET, **LANGFUSE_KEYS,
           "LANGFUSE_HOST": f"http://127.0.0.1:{langfuse_port}"}
    trace = {"id": "leaky-1", "messages": [
        {"role": "user", "content": f"What is 12+30? (my key is {TRACE_SECRETS[0]}, use "
                                    f"Authorization: Bearer {BEARER})"},
        {"role": "assistant", "content": f"answer:42 (also {TRACE_SECRETS[1]})"}],
        "feedback": {"thumbs_up": True, "comment": f"aws {TRACE_SECRETS[2]} jwt {TRACE_SECRETS[3]}"}}
    tests, started = REPO / "tests", tmp / "langfuse.out"
    # the scripted Langfuse server starts first (listening while init runs), and is stopped when
    # the script ends, however it ends
    script = (f"{sys.executable} {tests / 'trace_services.py'} {langfuse_port} > {started} & "
              f"service=$!; trap 'kill $service' EXIT; set -e; "
              f"{BIN / 'offseason'} init; {BIN / 'offseason'} simulate; "
              f"printf '%s\\n' '{json.dumps(trace)}' >> data/inbox/traffic-000.jsonl; "
              # the instrumented agents' traces, through `offseason collect` into data/inbox/
              f"{sys.executable} {tests / 'openai_agent.py'} traffic {root} {collect_port}; "
              f"grep -q listening {started}; {BIN / 'offseason'} run")
    command = ["unshare", "-n", "sh", "-c", f"ip link set lo up && {script}"] if NETNS else \
        ["sh", "-c", script]
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: set[str] = set()
    output = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        if NETNS:
            seen |= listeners(proc.pid)
        time.sleep(0.1)
    reader.join(timeout=10)
    return {"root": root, "prefect": tmp / "prefect", "rc": proc.returncode, "env": env,
            "output": "".join(output), "listeners": seen}


@pytest.mark.skipif(not NETNS, reason="needs root and unshare for a network namespace")
def test_a_whole_cycle_runs_with_no_network(cycle):
    assert cycle["rc"] == 0, cycle["output"][-4000:]
    assert "gen-1: candidate" in cycle["output"]
    tags = subprocess.run(["git", "tag"], cwd=cycle["root"], capture_output=True,
                          text=True).stdout.split()
    assert tags == ["gen-0", "gen-1"]


@pytest.mark.skipif(not NETNS, reason="needs root and unshare for a network namespace")
def test_every_server_listens_on_loopback_only(cycle):
    # Prefect's temporary API server is started for every flow run (and for `offseason init`'s
    # MLflow there is no server at all); none may listen beyond the machine
    assert cycle["listeners"], "no listening socket seen: was Prefect's server not started?"
    for address in cycle["listeners"]:
        host = address.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", "::1"), cycle["listeners"]


def texts_of(path: Path):
    """Every piece of text in a file, whatever its kind: Parquet cells, SQLite rows, gzip, raw."""
    data = path.read_bytes()
    if data[:4] == b"PAR1":
        table = pq.read_table(path)
        yield "\n".join(map(str, table.to_pylist()))
        yield "\n".join(table.column_names)
    elif data[:16] == b"SQLite format 3\x00":
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        for (table,) in db.execute("select name from sqlite_master where type='table'"):
            for row in db.execute(f'select * from "{table}"'):
                yield "\n".join(map(str, row))
        db.close()
    elif data[:2] == b"\x1f\x8b":
        yield gzip.decompress(data).decode("utf-8", "replace")
    else:
        yield data.decode("utf-8", "replace")


def test_no_secret_reaches_mlflow_prefect_or_dvc_outputs(cycle):
    assert cycle["rc"] == 0, cycle["output"][-4000:]
    root = cycle["root"]
    inbox = {p.read_bytes() for p in (root / "data/inbox").iterdir()}
    assert any(TRACE_SECRETS[0].encode() in raw for raw in inbox)  # the input really had them
    places = [root / "mlflow.db", root / "mlartifacts", root / "data", root / "models",
              root / "metrics", root / ".dvc" / "cache", root / ".dvcstore", root / "dvc.lock",
              cycle["prefect"]]
    files = [p for place in places for p in ([place] if place.is_file() else place.rglob("*"))
             if p.is_file()]
    searched, leaks = 0, []
    for path in files:
        if path.is_relative_to(root / "data/inbox") or path.read_bytes() in inbox:
            continue  # the raw input itself, and DVC's copies of it (the inbox snapshot)
        if path.suffix in (".lock",) and path.name != "dvc.lock":
            continue
        searched += 1
        for text in texts_of(path):
            for secret in [ENV_SECRET, BEARER, *TRACE_SECRETS, LANGFUSE_KEYS["LANGFUSE_SECRET_KEY"]]:
                if secret in text:
                    leaks.append(f"{path.relative_to(path.anchor)}: {secret[:12]}...")
    assert not leaks, leaks
    # the search did look where it should: MLflow params, Prefect's flow run logs, the traces
    mlflow_text = "\n".join(texts_of(root / "mlflow.db"))
    assert "train.sft.lr" in mlflow_text and "offseason.stage" in mlflow_text
    prefect_dbs = list(cycle["prefect"].rglob("*.db"))
    assert prefect_dbs
    db = sqlite3.connect(prefect_dbs[0])
    logs = [row[0] for row in db.execute("select message from log")]
    db.close()
    assert any("ingest |" in message for message in logs)
    assert any("<SECRET_" in text for text in texts_of(root / "data/ingested.parquet"))
    assert searched > 50


def calculator_turn(question: str) -> list[dict]:
    """The messages of tests/openai_agent.py's turn for "What is A+B?", as ingest writes them."""
    a, b = question.removeprefix("What is ").removesuffix("?").split("+")
    call = {"id": "call_1", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": f"{a}+{b}"})}}
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": str(int(a) + int(b))},
            {"role": "assistant", "content": f"{a}+{b} is {int(a) + int(b)}."}]


def test_the_cycle_ingested_the_collected_and_the_pulled_traces(cycle):
    """The agents' traces that `offseason collect` received (each instrumentation, each
    encoding) and the traces the cycle pulled from Langfuse are ingested by that cycle, exactly
    those conversations, tool calls included, beside the demo's traffic.
    """
    assert cycle["rc"] == 0, cycle["output"][-4000:]
    root = cycle["root"]
    assert "pull: 2 new trace(s) from langfuse" in cycle["output"]
    rows = pq.read_table(root / "data/ingested.parquet").to_pylist()
    collected = {r["user_text"]: r for r in rows if r["format"] in ("otel-genai", "openinference")}
    assert {q: collected[q]["format"] for q in collected} == {
        q: "otel-genai" if how == "genai" else "openinference" for q, how, _ in TRAFFIC}
    for question, row in collected.items():
        assert json.loads(row["messages"]) == calculator_turn(question), question
        assert row["n_tool_calls"] == 1 and row["model"] == "tiny"
    pulled = {r["trace_id"]: r for r in rows if r["format"] == "langfuse"}
    assert set(pulled) == {LF_NEW, LF_OLD}
    messages = json.loads(pulled[LF_NEW]["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"] == {
        "name": "lookup_order", "arguments": '{"order_id": "A1043"}'}
    assert messages[-1]["content"] == "It shipped with UPS."
    assert sum(r["format"] == "openai-chat" for r in rows) == 50  # the demo's day, and the leak
    ingest = json.loads((root / "metrics/ingest.json").read_text())
    assert {f: c["accepted"] for f, c in ingest["per_format"].items()} == {
        "openai-chat": 50, "otel-genai": 2, "openinference": 2, "langfuse": 2}
    # collect's files and pull's, in the inbox the cycle snapshotted
    names = {p.name.split("-")[0] for p in (root / "data/inbox").glob("*.jsonl")}
    assert names == {"langfuse", "otlp", "traffic"}


def git(root, *args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def mlflow_client(root):
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    return mlflow.MlflowClient()


def test_a_fresh_clones_first_cycle_is_committed_tracked_and_counted(cycle):
    """What a fresh clone's first cycle leaves (this module's cycle is one: `offseason init`,
    `simulate` and `run` in Prefect's embedded mode, no server started by hand), checked here
    rather than in a whole cycle of its own. Last in the module: it runs the CLI again.
    """
    assert cycle["rc"] == 0, cycle["output"][-4000:]
    project = cycle["root"]

    def offseason(root, *args, env=None):
        result = subprocess.run([str(BIN / "offseason"), *args], cwd=root,
                                env=env or cycle["env"], capture_output=True, text=True)
        assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
        return result

    assert "generation 0 is the champion" in cycle["output"]
    assert (project / "models/champion.dvc").exists()
    assert (project / "models/champion/model.safetensors").exists()
    assert git(project, "tag", "--list", "gen-0") == "gen-0"
    # the simulated day: its traces plus a duplicate, a cut line and small talk; and the leaky
    # trace this module adds
    lines = (project / "data/inbox/traffic-000.jsonl").read_text().splitlines()
    assert len(lines) == 48 + 3 + 1
    assert any("jane.doe@example.com" in line for line in lines)
    assert "gen-1: candidate" in cycle["output"]

    # the gate verdict, committed and tagged
    assert "gen-1" in git(project, "tag", "--list").split()
    verdict = json.loads(git(project, "show", "gen-1:metrics/gate.json"))
    assert isinstance(verdict["passed"], bool)
    assert 0 <= verdict["candidate_score"] <= 1 and 0 <= verdict["champion_score"] <= 1
    assert verdict["interval"][0] <= verdict["difference"] <= verdict["interval"][1]
    assert git(project, "status", "--porcelain", "--", "dvc.lock", "metrics") == ""

    # ingest and validate counted every line: the day's 52, the 4 collected, the 2 pulled
    ingest = json.loads((project / "metrics/ingest.json").read_text())
    assert (ingest["rows_read"], ingest["duplicates"], ingest["quarantined"]) == (58, 1, 1)
    assert ingest["accepted"] == 56 and ingest["pii_redactions"]["email"] == 1
    validate = json.loads((project / "metrics/validate.json").read_text())
    # quarantined: the small talk, and the two pulled support questions no environment claims
    assert validate["rows_read"] == 56 and validate["quarantined"] == 3, validate
    traces = (project / "data/ingested.parquet").read_bytes()
    assert b"jane.doe@example.com" not in traces

    # dvc.lock has every stage with hashed deps and outs
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert set(STAGES) <= set(lock)
    assert all(out["md5"] for stage in STAGES for out in lock[stage]["outs"])
    champion_dep = next(d for d in lock["rollout"]["deps"] if d["path"] == "models/champion")
    assert champion_dep["md5"]

    # MLflow: one run per cycle, a child per stage with DVC hashes, a new model version, the alias
    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("offseason")
    runs = client.search_runs([experiment.experiment_id], "tags.`offseason.generation` = '1'")
    assert len(runs) == 1
    parent = runs[0]
    assert parent.data.tags["offseason.git_tag"] == "gen-1"
    assert parent.data.tags["offseason.git_commit"] == git(project, "rev-parse", "gen-1")
    assert parent.data.params["train.sft.lr"] == "0.001"
    children = client.search_runs([experiment.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.tags["offseason.stage"] for c in children) == sorted(STAGES)
    ingest_run = next(c for c in children if c.data.tags["offseason.stage"] == "ingest")
    assert ingest_run.data.metrics["accepted"] == 56
    assert ingest_run.data.tags["dvc.out.data/ingested.parquet"] == next(
        o["md5"] for o in lock["ingest"]["outs"] if o["path"] == "data/ingested.parquet")
    train_run = next(c for c in children if c.data.tags["offseason.stage"] == "train")
    train_metrics = json.loads((project / "metrics/train.json").read_text())
    # the settings a stage's metrics echo are params of its run, not single-bar metric charts
    assert "lora_r" not in train_run.data.metrics and "deepspeed" not in train_run.data.metrics
    assert train_run.data.params["train.lora_r"] == "0"
    # the runtime settings rollout ran with and the gate's level and thresholds too (issue 53.6)
    runs = {c.data.tags["offseason.stage"]: c for c in children}
    rollout_run, gate_run = runs["rollout"], runs["gate"]
    assert not [k for k in rollout_run.data.metrics if k.startswith("runtime.")]
    assert "episodes" in rollout_run.data.metrics
    timeout = json.loads((project / "metrics/rollout.json").read_text())["runtime"][
        "request_timeout"]
    assert float(rollout_run.data.params["runtime.request_timeout"]) == timeout
    assert "alpha" not in gate_run.data.metrics and not [
        k for k in gate_run.data.metrics if k.endswith(".threshold")]
    assert "passed" in gate_run.data.metrics
    # the UI opens it as model training, not GenAI (issue 53.4)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    if train_metrics["trained"]:  # the per-step curve, with its step numbers
        losses = client.get_metric_history(train_run.info.run_id, "step.loss")
        assert sorted(m.step for m in losses) == list(range(1, train_metrics["steps"] + 1))
    versions = client.search_model_versions("name = 'offseason-agent'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    new = next(v for v in versions if str(v.version) == "2")
    assert new.run_id == parent.info.run_id and new.tags["generation"] == "1"
    # no Python spellings in what the MLflow UI shows (issue 53.5)
    assert new.tags["passed"] in ("true", "false")
    shown = [*parent.data.tags.values(), *(v for m in versions for v in m.tags.values())]
    assert not [v for v in shown if v in ("True", "False", "None") or ": null" in v
                or "'" in v and v.startswith("{")], shown
    champion = client.get_model_version_by_alias("offseason-agent", "champion")
    assert str(champion.version) == ("2" if verdict["passed"] else "1")
    promotion = json.loads((project / "metrics/promotion.json").read_text())
    assert promotion["promoted"] == verdict["passed"]

    # history shows both generations and marks the champion
    rows = json.loads(offseason(project, "history", "--json", "--plot", "h.png").stdout)
    assert (project / "h.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["tag"] for r in rows] == ["gen-0", "gen-1"]
    assert [r["champion"] for r in rows] == ([False, True] if verdict["passed"] else [True, False])
    # what the cycle cost: every stage ran and used CPU; its rollout's tokens counted exactly
    spent = json.loads((project / "metrics/cost.json").read_text())
    assert set(spent["stages"]) == set(STAGES)
    assert all(spent["stages"][s]["cpu_seconds"] > 0 for s in STAGES)
    rollout_metrics = json.loads((project / "metrics/rollout.json").read_text())
    assert spent["total"]["generated_tokens"] == rollout_metrics["generated_tokens"] > 0
    assert spent["total"]["usd"] == pytest.approx(
        spent["total"]["cpu_seconds"] / 3600 * spent["prices"]["cpu_hour_usd"], abs=1e-5)
    assert rows[1]["cost_usd"] == spent["total"]["usd"] and rows[0]["cost_usd"] is None
    # its gain per dollar, in the ledger and on the cycle's MLflow run
    gain = 100 * (verdict["candidate_score"] - verdict["champion_score"])
    assert spent["gain"]["points"] == pytest.approx(gain, abs=1e-3)
    assert spent["gain"]["points_per_usd"] == pytest.approx(gain / spent["total"]["usd"], rel=1e-2)
    assert spent["gain"]["cumulative_usd"] == spent["total"]["usd"]  # the first priced cycle
    assert parent.data.metrics["cost.cumulative_usd"] == pytest.approx(spent["total"]["usd"])
    assert "points_per_usd" in rows[1]
    assert "cost $" in offseason(project, "history").stdout

    # nothing changed: nothing reruns, and it says so; nor does a change of where work runs
    # (runtime:, which no stage lists as a DVC param)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["runtime"] = {"reward": {"workers": 1}, "rollout": {
        "concurrency": 7, "request_timeout": 30.0, "retries": 2, "server_timeout": 60.0,
        "api_key_env": "MY_KEY", "urls": "http://127.0.0.1:9/v1"},
        "judge": {"url": "http://127.0.0.1:9/v1", "request_timeout": 5.0, "retries": 1,
                  "api_key_env": "JUDGE_KEY"}}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # it pulls first (params.yaml's `pull:`), from the scripted Langfuse server, here outside
    # the namespace: the traces it took last time are there still, and remembered
    # (the newer trace started two minutes ago again, so that it is inside the pull's window
    # however long the first cycle took)
    new = langfuse_data(datetime.now(timezone.utc) - timedelta(minutes=2))
    server = ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Service.calls = []
    try:
        again = offseason(project, "run", env={
            **cycle["env"], "LANGFUSE_HOST": f"http://127.0.0.1:{server.server_address[1]}"})
    finally:
        server.shutdown()
        server.server_close()
    # the server offered the newer of the two again (the window opens before gen-1): not written
    asked = [c[2] for c in Service.calls if c[1] == "/api/public/v2/observations"]
    assert asked and after(iso(new), asked[0].get("fromStartTime")), asked
    assert "no new traces" in again.stderr, again.stderr[-3000:]
    assert "nothing changed since gen-1" in again.stdout and "no stage reran" in again.stdout
    assert git(project, "tag", "--list").split() == ["gen-0", "gen-1"]
    dvc_status = subprocess.run([str(BIN / "dvc"), "status", "--json"], cwd=project,
                                capture_output=True, text=True, check=True).stdout
    assert json.loads(dvc_status) == {}, dvc_status  # every stage up to date

    # `dvc repro` alone agrees that the cycle is complete
    status = subprocess.run([str(BIN / "dvc"), "status", "rollout", "reward", "ingest",
                             "validate"], cwd=project, capture_output=True, text=True)
    assert status.returncode == 0
