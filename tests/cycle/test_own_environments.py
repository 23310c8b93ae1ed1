"""Your own environments, end to end through the stages as DVC runs them: an `environments:`
section with the support example and a second module of the user's, a Hugging Face chat model
(tiny Qwen2, built offline), rollouts through its chat template with native tool calls, rewards
from the modules, and each training algorithm on the exact ids of the rollouts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from chat_model import build
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages import reward, rollout, train
from stages.envs import contract
from stages.generation import chat

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# a second environment of the user's: no tools, a reward from the final answer alone
GREETER = '''
TOOLS = []
VERSION = "greeter@1"

def reward(task, messages):
    final = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
    return float(task["name"].lower() in final.lower())
'''


@pytest.fixture(scope="module")
def champion(chat_champion_once, tmp_path_factory) -> Path:
    """The session's tiny Qwen2 chat model after a few seconds of SFT on the support example's
    gold conversations (conftest: some of its rollouts call the tool and some get it right): this
    module's own copy.
    """
    return Path(shutil.copytree(chat_champion_once, tmp_path_factory.mktemp("champion") / "model"))


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch) -> Path:
    """A project folder with params.yaml naming two environments of the user's."""
    shutil.copytree(REPO / "examples", tmp_path / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "greeter.py").write_text(GREETER)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "greeter.jsonl").write_text("".join(
        json.dumps({"task_id": f"g{i}", "name": name,
                    "messages": [{"role": "user", "content": f"Say hello to {name}."}]}) + "\n"
        for i, name in enumerate(["Ada", "Grace", "Alan", "Edsger"])))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["rollout"].update({"samples_per_task": 4, "max_new_tokens": 64, "max_tasks": 9})
    params["train"]["min_examples"] = 1
    params["gate"]["primary"] = "support"
    params["environments"] = {
        "support": {"module": "examples.support.support_env",
                    "tasks": "examples/support/tasks.jsonl",
                    "benchmark": "examples/support/benchmark.jsonl", "weight": 2.0},
        "greeter": {"module": "my_envs.greeter", "tasks": "data/greeter.jsonl"},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_openai_backend_plays_the_same_chat_episodes_through_a_server(workspace, champion):
    """rollout.backend: openai on the environments path: the stage starts a server on the
    champion (serve_tiny, asked as vLLM is: token ids in, token ids out), renders and parses
    every turn here, and stores the same conversations, ids, masks and turns as in-process.
    """
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["rollout"].update({"temperature": 0.0, "samples_per_task": 1, "max_tasks": 6})
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    args = ["data/validated.parquet", str(champion), "data/local.parquet", "metrics/local.json"]
    rollout.main(args)
    params["rollout"]["backend"] = "openai"
    params.setdefault("runtime", {}).setdefault("rollout", {})["server_command"] = (
        f"{sys.executable} -m stages.generation.serve_tiny {{model}} --port {{port}} --threads 1")
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rollout.main(["data/validated.parquet", str(champion), "data/served.parquet",
                  "metrics/served.json"])
    local = pq.read_table(workspace / "data/local.parquet").to_pylist()
    served = pq.read_table(workspace / "data/served.parquet").to_pylist()
    metrics = json.loads((workspace / "metrics/served.json").read_text())
    assert metrics["backend"] == "openai" and metrics["episodes"] == len(local) == 6
    assert sum(r["tool_calls"] for r in served) > 0, "some episodes call lookup_order"
    # one request per model turn: each assistant message the episodes hold
    assert metrics["requests"] == sum(
        [m["role"] for m in json.loads(r["completion"])].count("assistant") for r in served)
    keys = ("task_id", "messages", "token_ids", "model_mask", "turns", "finish", "tool_calls",
            "tool_errors", "error")
    for a, b in zip(local, served):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}
        assert torch.allclose(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]),
                              atol=1e-4)

    # the same through /chat/completions, as a vLLM user serves it: messages and tools= sent,
    # tool_calls read back by the server's --tool-call-parser, its rendering checked against ours
    params["runtime"]["rollout"].update(api="chat", server_command=(
        params["runtime"]["rollout"]["server_command"]
        + " --enable-auto-tool-choice --tool-call-parser hermes"))
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rollout.main(["data/validated.parquet", str(champion), "data/chat.parquet",
                  "metrics/chat.json"])
    chatted = pq.read_table(workspace / "data/chat.parquet").to_pylist()
    assert json.loads((workspace / "metrics/chat.json").read_text())["runtime"]["api"] == "chat"
    for a, b in zip(local, chatted):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}
        assert torch.allclose(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]),
                              atol=1e-4)


def serving(folder: Path, tool_parser: str | None):
    """serve_tiny on `folder` in a thread of this process; yields its base URL."""
    import contextlib
    import threading

    from stages.generation import serve_tiny

    @contextlib.contextmanager
    def running():
        server = serve_tiny.make_server(folder, threads=1, tool_parser=tool_parser)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/v1"
        finally:
            server.shutdown()
            server.server_close()
    return running()


def test_the_chat_endpoint_refuses_a_rendering_or_parsing_that_is_not_ours(champion, tmp_path):
    """api: chat trusts nothing: a server whose chat template differs (one character in the
    system turn) fails naming the first differing token; one started without a tool parser
    fails with the server's own advice; neither yields episodes.
    """
    from stages.generation import openai_backend

    tok = AutoTokenizer.from_pretrained(champion)
    model = AutoModelForCausalLM.from_pretrained(champion)
    support = contract.load("support", "examples.support.support_env", REPO)
    tasks = contract.load_tasks(REPO / "examples/support/tasks.jsonl", support)[:2]
    ends = chat.end_ids(model, tok)

    def play(url):
        return openai_backend.chat_rollout(
            tok, support, tasks, [1, 2], urls=[url], parser="hermes", max_turns=2,
            context=model.config.max_position_embeddings, ends=ends, temperature=0.0,
            api="chat", retries=0, progress=False)

    with serving(champion, "hermes") as url:  # the champion's own: the same as ours
        episodes, _ = play(url)
        assert len(episodes) == 2 and all(e.token_ids for e in episodes)
        assert sum(e.tool_calls for e in episodes) > 0  # the server's tool_calls were compared
    other = tmp_path / "other-template"
    shutil.copytree(champion, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ", 1)
        (other / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        jinja = (other / "chat_template.jinja").read_text()
        (other / "chat_template.jinja").write_text(jinja.replace("<|im_start|>", "<|im_start|> ", 1))
    assert AutoTokenizer.from_pretrained(other).chat_template != tok.chat_template
    with serving(other, "hermes") as url:
        with pytest.raises(openai_backend.ServerError, match="rendered the conversation to "
                           "other token ids than the episode's own, from token"):
            play(url)
    with serving(champion, None) as url:
        with pytest.raises(openai_backend.ServerError,
                           match="--enable-auto-tool-choice and --tool-call-parser"):
            play(url)


def test_rollout_reward_and_training_on_a_chat_model_in_two_own_environments(workspace, champion):
    rollout.main(["data/validated.parquet", str(champion), "data/rollouts.parquet",
                  "metrics/rollout.json"])
    metrics = json.loads((workspace / "metrics/rollout.json").read_text())
    # max_tasks 9 shared 2:1 by weight: 6 support tasks, 3 greeter tasks, 4 samples each
    assert metrics["environments"]["support"]["tasks"] == 6
    assert metrics["environments"]["greeter"]["tasks"] == 3
    assert metrics["episodes"] == 36 and metrics["tool_parser"] == "hermes"
    assert metrics["template"] == "prefix-preserving" and metrics["errors"] == 0
    assert metrics["environments"]["support"]["tool_use_rate"] > 0.25
    import hashlib
    assert metrics["environments"]["greeter"]["source_sha256"] == hashlib.sha256(
        (workspace / "my_envs" / "greeter.py").read_bytes()).hexdigest()
    rows = pq.read_table(workspace / "data/rollouts.parquet").to_pylist()
    support = [r for r in rows if r["environment"] == "support"]
    called = [r for r in support if r["tool_calls"]]
    assert called, "the trained champion calls lookup_order in some episodes"
    for row in called:  # stored as a conversation: the tool's answer follows the call
        roles = [m["role"] for m in json.loads(row["messages"])]
        assert roles[:4] == ["system", "user", "assistant", "tool"]

    reward.main(["data/rollouts.parquet", "data/rewards.parquet", "metrics/reward.json"])
    scored = json.loads((workspace / "metrics/reward.json").read_text())
    assert scored["episodes"] == 36 and scored["errors"] == 0 and scored["tasks_set_aside"] == 0
    assert set(scored["components"]) == {"called_tool", "answer", "reward"}
    assert scored["environments"]["support"]["verifier"] == "support/support@1"
    assert scored["environments"]["greeter"]["verifier"] == "greeter/greeter@1"
    table = pq.read_table(workspace / "data/rewards.parquet").to_pylist()
    for row in table:
        if row["environment"] == "support":
            assert row["reward"] == (row["score_called_tool"] + row["score_answer"]) / 2
            assert row["correct"] == float(row["score_called_tool"] == row["score_answer"] == 1)
    assert 0 < sum(r["correct"] for r in table if r["environment"] == "support") < len(support)

    # SFT trains on the rollouts' own ids, unchanged: the ids generated are the ids trained on
    examples = train.examples_from(workspace / "data/rewards.parquet")
    assert examples
    by_completion = {(r["task_id"], r["completion"]): r for r in table}
    from stages.training.batches import collate
    for example in examples:
        row = by_completion[(example["task_id"], example["completion"])]
        assert (example["token_ids"], example["model_mask"]) == (row["token_ids"],
                                                                 row["model_mask"])
        batch = collate([example], pad=0)  # trained on as they are: nothing added
        assert batch["input_ids"][0].tolist() == row["token_ids"]
    for algorithm in ("sft", "dpo", "grpo"):
        params = yaml.safe_load((workspace / "params.yaml").read_text())
        params["train"]["algorithm"] = algorithm
        (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        train.main(["data/rewards.parquet", str(champion), f"models/{algorithm}",
                    f"data/replay-{algorithm}", f"models/{algorithm}.ckpt",
                    f"metrics/train-{algorithm}.json", f"metrics/steps-{algorithm}.csv"])
        result = json.loads((workspace / f"metrics/train-{algorithm}.json").read_text())
        assert result["trained"] and result["steps"] > 0, result
        shares = result["examples_by_environment"]  # by weight: test_examples_are_shared...
        assert "support" in shares and set(shares) <= {"support", "greeter"}
        assert sum(shares.values()) == result["examples"]
        before = AutoModelForCausalLM.from_pretrained(champion).state_dict()
        after = AutoModelForCausalLM.from_pretrained(workspace / f"models/{algorithm}")
        assert any(not torch.equal(before[k], v) for k, v in after.state_dict().items())


def test_the_benchmark_stages_count_and_keep_the_held_out_judges_judgments(workspace, champion):
    """A benchmark the judge grades: champion_scores pays the held-out judge for each of its
    tasks and says so in its metrics, which the cost ledger prices; its judgments are kept
    under DVC; the gate of a candidate that answers as the champion did reads those and pays
    for none (before, both stages judged in memory and reported nothing: the ledger missed the
    held-out judge, and a promotion paid twice for the same answers).
    """
    from judge_server import Scripted

    from flows.orchestration import cost
    from stages import champion_scores, gate
    from stages import config as cfg
    from stages.envs import judge

    server = Scripted([{"reasoning": "fair", "score": 0.5}])
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["judge"] = {"model": "judge-7b", "rubric": "examples/judged/rubric.md",
                       "benchmark_model": "judge-70b"}
    params.setdefault("runtime", {})["judge"] = {"url": server.url}
    params["gate"]["primary"] = "judged"
    params["environments"] = {  # one benchmark, the judged one: two tasks
        "judged": {"module": "examples.judged.judged_env", "tasks": "examples/judged/tasks.jsonl",
                   "benchmark": "data/judged-benchmark.jsonl"}}
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (workspace / "data/judged-benchmark.jsonl").write_text("".join(
        json.dumps({"task_id": f"b{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
        for i, q in enumerate(["What is 20+22?", "What is 9*9?"])))
    judgments = ["--judgments", "data/champion_judgments", "--judged-before", "data/gate_judgments"]
    try:
        champion_scores.main([str(champion), "data/champion_scores.parquet",
                              "data/forgetting.jsonl", "metrics/champion_scores.json",
                              *judgments])
        scored = json.loads((workspace / "metrics/champion_scores.json").read_text())
        [held_out] = scored["judges"]
        assert held_out["judge"].startswith("judge-70b/rubric-")
        assert held_out["requests"] == len(server.requests) == 2 and held_out["cache_hits"] == 0
        assert held_out["tokens"] > 0
        assert cost.stage_row(scored, 0, cfg.Cost())["judge_tokens"] == held_out["tokens"]
        kept = [line for f in (workspace / "data/champion_judgments").glob("*.jsonl")
                for line in f.read_text().splitlines()]
        assert len(kept) == 2

        gate.main([str(champion), "data/champion_scores.parquet", "data/forgetting.jsonl",
                   "data/rewards.parquet", "data/replay", "data/gate.parquet", "metrics/gate.json",
                   "--judgments", "data/gate_judgments", "--judged-before",
                   "data/champion_judgments"])
        verdict = json.loads((workspace / "metrics/gate.json").read_text())
        [again] = verdict["judges"]
        assert again["requests"] == 0 and again["cache_hits"] == 2 and len(server.requests) == 2
        assert (workspace / "data/gate_judgments").is_dir()  # an output, judged or not
        assert not list((workspace / "data/gate_judgments").iterdir())  # nothing new bought
        assert sorted(line for f in (workspace / "data/champion_judgments").glob("*.jsonl")
                      for line in f.read_text().splitlines()) == sorted(kept)  # read, not written
        assert verdict["suites"]["judged"]["items"] == 2
    finally:
        server.close()
        judge.use_cache(None)
        judge._HELD_OUT[0] = False


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "offseason"), "check"], cwd=root, capture_output=True,
                          text=True)


def test_check_imports_each_environment_and_counts_its_tasks(workspace):
    result = check(workspace)
    assert result.returncode == 0, result.stderr
    assert "environment 'support': examples.support.support_env" in result.stdout
    assert "tools: lookup_order; 12 tasks, 8 benchmark tasks" in result.stdout
    assert "environment 'greeter': my_envs.greeter" in result.stdout
    assert "tools: none; 4 tasks" in result.stdout


@pytest.mark.parametrize("change, message", [
    (lambda p: p["environments"]["greeter"].update(module="my_envs.absent"),
     "environment 'greeter' (module 'my_envs.absent'): no module 'my_envs.absent' in the project "
     "folder"),
    (lambda p: p["environments"]["greeter"].update(wieght=1),
     "unknown key 'environments.greeter.wieght' (did you mean 'environments.greeter.weight'?)"),
    (lambda p: p["environments"]["greeter"].update(weight=0),
     "environments.greeter.weight: must be > 0"),
    (lambda p: p["gate"].update(primary="greeter"),
     "gate.primary: 'greeter' is not one of your environments with a benchmark (support); name "
     "the one that must improve"),
    (lambda p: p["rollout"].update(tool_parser="qwen"),
     "rollout.tool_parser: unknown parser 'qwen'; use auto (from the chat template) or one of "
     "hermes, llama3_json, mistral"),
])
def test_check_refuses_a_bad_environment_entry_naming_it(workspace, change, message):
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    change(params)
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = check(workspace)
    assert result.returncode == 2
    assert message in result.stderr
    # the error is what a user sees: not below a print of every setting (170 lines)
    assert result.stdout == "" and result.stderr.count("params.yaml:") <= 1, result


def test_check_starts_an_environments_mcp_servers_and_checks_allow(workspace):
    (workspace / "tools").mkdir()
    shutil.copy(REPO / "tests/fixtures/mcp/shop_server.py", workspace / "tools/shop.py")
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["environments"]["greeter"]["mcp"] = {"shop": {"allow": ["lookup_order"]}}
    params.setdefault("runtime", {}).setdefault("mcp", {})["servers"] = {
        "shop": {"command": "python tools/shop.py"}}
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = check(workspace)
    assert result.returncode == 0, result.stderr
    assert "tools: lookup_order (MCP); 4 tasks" in result.stdout
    # shown where each is written: what the server is in the environment, where it runs in runtime
    shown = yaml.safe_load(result.stdout[:result.stdout.index("\nenvironment '")])
    assert shown["environments"]["greeter"]["mcp"] == {"shop": {"allow": ["lookup_order"],
                                                                "version": ""}}
    assert shown["runtime"]["mcp"]["servers"] == {"shop": {"command": "python tools/shop.py"}}
    # a name the server lacks was "params.yaml is valid" until a stage started the server
    params["environments"]["greeter"]["mcp"]["shop"]["allow"] = ["lookup_ordr"]
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = check(workspace)
    assert result.returncode == 2 and "allow names ['lookup_ordr'], which the server does not " \
        "offer" in result.stderr and "fix environments.greeter.mcp (what each server is) or " \
        "runtime.mcp.servers (where it runs) in params.yaml" in result.stderr
    # a script that is not there: said, not the SDK's "Connection closed"
    params["environments"]["greeter"]["mcp"]["shop"] = {}
    params["runtime"]["mcp"]["servers"]["shop"] = {"command": "python tools/shopp.py"}
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = check(workspace)
    assert result.returncode == 2 and "tools/shopp.py is not a file in" in result.stderr


def test_a_task_file_without_messages_fails_check_naming_the_line(workspace):
    with (workspace / "data/greeter.jsonl").open("a") as lines:
        lines.write(json.dumps({"task_id": "g9", "name": "Barbara"}) + "\n")
    result = check(workspace)
    assert result.returncode == 2
    assert "data/greeter.jsonl:5: task 'g9' has no 'messages'" in result.stderr


def support_trace(order_id: str, status: str, thumbs_up: bool) -> dict:
    """A production trace of the support agent, as OpenAI chat logs hold it: a tool call, its
    result and the answer.
    """
    call = {"id": "call_a", "type": "function",
            "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order_id})}}
    return {"messages": [
        {"role": "system", "content": "You are the support agent of an online shop."},
        {"role": "user", "content": f"Where is my order {order_id}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_a", "content": json.dumps({"status": status})},
        {"role": "assistant", "content": f"Your order {order_id} is {status}."}],
        "tools": json.loads(json.dumps(contract.load(
            "support", "examples.support.support_env", REPO).tools)),
        "feedback": {"thumbs_up": thumbs_up}}


def test_a_whole_cycle_with_a_chat_model_in_own_environments(tmp_path, champion):
    """init with the chat model, production traces with tool calls in the inbox, one cycle, with
    no network (its own network namespace, loopback only, where it can be made: the offline
    cycle): the traces become tasks of the support environment, every environment's benchmark is
    gated; a trace no environment of the user's claims becomes a replayed task, and the
    examples' judged environment (examples/judged) has its tasks judged, both by a local LLM
    judge the reward stage starts itself (`runtime.judge.server_command`: tests/judge_server.py,
    scripted), its judgments kept under DVC.
    """
    from conftest import TINY, cli_env, make_project, netns_available, offseason

    # one answer for both kinds of question: a score (pointwise, replay) and scores for the two
    # samples of a task (relative, the judged environment's reward_group)
    fair = {"reasoning": "a fair answer", "score": 0.5}
    script, asked = tmp_path / "judge-script.json", tmp_path / "judge-requests.jsonl"
    script.write_text(json.dumps([{**fair, "scores": [{"id": i, **fair} for i in (1, 2)]}]))
    overrides = {**TINY, "base": {"model": str(champion)},
                 "judge": {"model": "judge-7b", "rubric": "examples/judged/rubric.md"},
                 "runtime": {"judge": {"server_command": f"{sys.executable} "
                                       f"{REPO / 'tests/judge_server.py'} --port {{port}} "
                                       f"--script {script} --requests {asked}",
                                       "request_timeout": 10.0, "server_timeout": 120.0}},
                 # cooler than the default 1.0: the tiny champion then gets some tasks right
                 "rollout": {**TINY["rollout"], "max_new_tokens": 64, "temperature": 0.5},
                 "gate": {**TINY["gate"], "primary": "support"},
                 "environments": {
                     "support": {"module": "examples.support.support_env",
                                 "tasks": "examples/support/tasks.jsonl",
                                 "benchmark": "examples/support/benchmark.jsonl"},
                     "greeter": {"module": "my_envs.greeter", "tasks": "data/greeter.jsonl",
                                 "benchmark": "data/greeter.jsonl", "max_regression": 0.5},
                     # a built-in environment on the same contract, beside the user's own
                     "code": {"module": "stages.envs.coding", "tasks": "data/tasks/code.jsonl",
                              "benchmark": "data/benchmarks/code.jsonl", "weight": 0.5,
                              "max_regression": 0.5},
                     # no verifier: the judge grades it by the examples' rubric
                     "judged": {"module": "examples.judged.judged_env",
                                "tasks": "examples/judged/tasks.jsonl", "weight": 0.5},
                     # last: it claims any trace with a request and an answer
                     "replay": {"module": "stages.envs.replay", "weight": 0.5}}}
    root = make_project(tmp_path / "project", overrides)
    shutil.copytree(REPO / "examples", root / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "my_envs").mkdir()
    (root / "my_envs" / "greeter.py").write_text(GREETER)
    (root / "data" / "greeter.jsonl").write_text("".join(
        json.dumps({"task_id": f"g{i}", "name": name,
                    "messages": [{"role": "user", "content": f"Say hello to {name}."}]}) + "\n"
        for i, name in enumerate(["Ada", "Grace"])))
    # the user's module and task file, never committed: init commits what it read, and says so
    # (a generation run on files git never held could not be traced back or verified)
    said = offseason(root, "init").stdout
    assert "init: committed with gen-0, which read them" in said, said
    assert "my_envs/greeter.py" in said and "data/greeter.jsonl" in said, said
    assert not git_status(root, "my_envs", "examples", "data/greeter.jsonl")
    init = json.loads((root / "metrics/init.json").read_text())
    assert init["source"] == "import" and init["template"] == "prefix-preserving"
    assert set(init["benchmarks"]) == {"support", "greeter", "code"}
    assert init["benchmark_items"] == 8
    inbox = root / "data" / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    traces = [support_trace(order, status, up) for order, status, up in
              [("A1001", "delivered", True), ("A1004", "out for delivery", True),
               ("A1007", "returned", False), ("A1010", "out for delivery", True)]]
    traces.append({"messages": [{"role": "user", "content": "What is 2+2?"},
                                {"role": "assistant", "content": "4"}]})  # replay's task
    (inbox / "support-day-1.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["validate"]["min_valid_fraction"] = 0.5
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # the offline cycle: Prefect's embedded server, in a network namespace with only loopback
    env = {**cli_env(root, shared_prefect=False), "PREFECT_HOME": str(tmp_path / "prefect")}
    command = f"{BIN / 'offseason'} run"
    offline = netns_available()
    argv = ["unshare", "-n", "sh", "-c", f"ip link set lo up && {command}"] if offline else \
        ["sh", "-c", command]
    cycle = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    output = cycle.stdout + cycle.stderr
    assert cycle.returncode == 0, output[-4000:]
    # the reward stage started the judge's server, used it and stopped it
    assert "judge: starting the server" in output and "judge: server stopped" in output
    validate = json.loads((root / "metrics/validate.json").read_text())
    assert validate["accepted"] == 5 and validate["quarantined"] == 0
    assert validate["profile"]["task_mix"] == {"support": 0.8, "replay": 0.2}
    rolled = json.loads((root / "metrics/rollout.json").read_text())
    assert rolled["environments"]["support"]["trace_tasks"] == 4
    assert rolled["environments"]["replay"]["trace_tasks"] == 1
    assert rolled["environments"]["support"]["tasks"] == 16  # 4 from traces + 12 from its file
    assert rolled["environments"]["code"]["tasks"] == 20  # its task file; no trace is a code task
    rewarded = json.loads((root / "metrics/reward.json").read_text())
    assert rewarded["errors"] == 0  # every code episode verified in the sandbox
    # the replayed task's episodes were judged, once each, the judged environment's tasks once
    # per task (its samples together), and the judgments are kept
    replayed = rewarded["environments"]["replay"]["episodes"]
    assert replayed == TINY["rollout"]["samples_per_task"]
    judged_tasks = rolled["environments"]["judged"]["tasks"]
    assert judged_tasks == 6  # examples/judged/tasks.jsonl
    requests = [json.loads(line) for line in asked.read_text().splitlines()]
    assert sum(j["requests"] for j in rewarded["judges"]) == len(requests) == \
        replayed + judged_tasks
    assert all(j["judge"].startswith("judge-7b/rubric-") for j in rewarded["judges"])
    # the rubric is the examples' file, read from the project
    assert all("Grade the assistant's final answer" in json.dumps(r) for r in requests)
    rows = pq.read_table(root / "data/rewards.parquet").to_pylist()
    for name, episodes in (("replay", replayed), ("judged", 2 * judged_tasks)):
        mine = [r for r in rows if r["environment"] == name]
        assert [json.loads(r["judgment"])["reasoning"] for r in mine] == \
            ["a fair answer"] * episodes, name
        assert [r["score_judge"] for r in mine] == [0.5] * episodes, name
    kept = sum(len(f.read_text().splitlines()) for f in (root / "data/judgments").glob("*.jsonl"))
    assert kept == len(requests)
    trained = json.loads((root / "metrics/train.json").read_text())
    assert trained["trained"] and trained["examples"] > 0, trained
    # the three thumbs-up traces, whose answers the reward agrees with, are trained on as they are
    assert trained["traces_thumbs_up"] == 3 and trained["trace_examples"] == 3
    verdict = json.loads((root / "metrics/gate.json").read_text())
    assert verdict["primary"] == "support"
    assert set(verdict["suites"]) == {"support", "greeter", "code"}
    assert verdict["suites"]["code"]["role"] == "guard" and verdict["suites"]["code"]["items"] == 10
    assert verdict["suites"]["support"]["role"] == "primary"
    assert verdict["suites"]["greeter"]["role"] == "guard"
    assert verdict["suites"]["greeter"]["threshold"] == 0.5
    assert verdict["suites"]["support"]["items"] == 8
    # the greeter's tasks are its benchmark too (one file for both, on purpose): caught
    assert verdict["contamination"]["items"] == ["greeter/g0", "greeter/g1"]
    assert not verdict["passed"]
    log = subprocess.run(["git", "log", "--format=%s", "-1"], cwd=root, capture_output=True,
                         text=True).stdout
    assert log.startswith("gen-1")

    # the user's module is among the stages' deps through data/environments.json (committed with
    # the cycle): editing its reward makes DVC see every stage that runs it as changed
    note = json.loads(subprocess.run(["git", "show", "gen-1:data/environments.json"], cwd=root,
                                     capture_output=True, text=True, check=True).stdout)
    assert note["greeter"]["source"] == "my_envs/greeter.py" and note["greeter"]["files"] == 1
    (root / "my_envs" / "greeter.py").write_text(GREETER.replace("greeter@1", "greeter@2"))
    subprocess.run([sys.executable, "-c", "from pathlib import Path; from flows.project.workspace import "
                    "note_environments; note_environments(Path('.'))"], cwd=root, check=True)
    status = json.loads(subprocess.run([str(BIN / "dvc"), "status", "--json"], cwd=root,
                                       capture_output=True, text=True, check=True).stdout)
    changed = {stage for stage, entries in status.items() for entry in entries
               if isinstance(entry, dict)
               and "data/environments.json" in entry.get("changed deps", {})}
    assert changed == {"validate", "rollout", "reward", "train", "champion_scores", "gate"}
    # and the next cycle's commit would hold the edited module (it reads it)
    from flows.project.workspace import cycle_inputs, uncommitted
    assert uncommitted(root, cycle_inputs(root)) == ["data/environments.json", "my_envs/greeter.py"]
    # its estimate, with no trace waiting, prices those stages at the last cycle's units (it
    # said every stage was reused, $0, and then the cycle ran six)
    guess = json.loads(offseason(root, "estimate", "--json").stdout)
    assert guess["reasons"] == ["an environment's module changed (data/environments.json)"]
    assert [name for name, row in guess["stages"].items() if not row.get("reused")] == \
        ["validate", "rollout", "reward", "train", "champion_scores", "gate"]
    assert guess["drivers"]["episodes"] == rolled["episodes"] and guess["total"]["cpu_seconds"][1]


def git_status(root: Path, *paths: str) -> str:
    """What git does not hold as it is under `paths` (porcelain: new and changed files)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *paths],
                          cwd=root, capture_output=True, text=True, check=True).stdout


def test_a_thumbs_up_trace_is_trained_on_as_it_is_with_its_tool_calls(tmp_path, champion):
    import pyarrow as pa

    from stages import config as cfg
    from stages.envs.contract import Router

    support = contract.load("support", "examples.support.support_env", REPO)
    router = Router({"support": support})
    good = support_trace("A1001", "delivered", True)
    wrong = support_trace("A1002", "lost", True)  # the reward says otherwise: not trained on
    rows = [{"trace_id": trace_id, "messages": json.dumps(t["messages"]), "thumbs_up": True,
             "question": router.task_of(t["messages"], t["tools"])}
            for trace_id, t in (("a", good), ("b", wrong))]
    validated = tmp_path / "validated.parquet"
    pq.write_table(pa.Table.from_pylist(rows), validated)
    specs = {"support": cfg.EnvironmentSpec(module="examples.support.support_env")}
    tok = AutoTokenizer.from_pretrained(champion)
    examples, counts = train.trace_conversations(validated, specs, REPO, tok)
    assert counts == {"trace_examples": 1, "traces_thumbs_up": 2, "traces_reward_disagrees": 1,
                      "traces_unusable": 0}
    (example,) = examples
    trained = [tok.decode([t for t, m in zip(example["token_ids"], example["model_mask"]) if m])]
    assert trained == ['<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A1001"}}'
                       '\n</tool_call><|im_end|>Your order A1001 is delivered.<|im_end|>']
    shown = tok.decode(example["token_ids"])
    assert '<tool_response>\n{"status": "delivered"}\n</tool_response>' in shown
    assert example["task_id"] == "support:trace:a"
    # a conversation longer than the model's positions is counted, not trained on (it crashed
    # the training: an IndexError in the position embedding)
    examples, counts = train.trace_conversations(validated, specs, REPO, tok,
                                                 context=10)
    assert examples == [] and counts["traces_unusable"] == 2 and counts["traces_reward_disagrees"] == 0


def test_thumbs_on_traces_become_dpo_pairs_against_their_tasks_rollouts(tmp_path, champion):
    import pyarrow as pa

    from stages import config as cfg
    from stages.envs.contract import Router
    from stages.training import dpo

    support = contract.load("support", "examples.support.support_env", REPO)
    router = Router({"support": support})
    traces = {"up": support_trace("A1001", "delivered", True),  # the reward agrees: chosen
              "down": support_trace("A1004", "lost", False),  # the reward agrees: rejected
              "up-wrong": support_trace("A1002", "lost", True),  # the reward says no: unused
              "down-right": support_trace("A1007", "returned", False)}  # full marks: unused
    validated = tmp_path / "validated.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"trace_id": trace_id, "messages": json.dumps(t["messages"]),
         "thumbs_up": t["feedback"]["thumbs_up"],
         "question": router.task_of(t["messages"], t["tools"])}
        for trace_id, t in traces.items()]), validated)
    tok, ends = train.chat_tokenizer(champion)
    template = chat.Template.of(tok, list(support.tools), ends)

    def rollout(trace_id, answer, correct):
        """A scored rollout of the trace's task: the same prompt, the model's own answer."""
        messages = traces[trace_id]["messages"][:2] + [{"role": "assistant", "content": answer}]
        ids, mask = chat.encode(template, messages)
        return {"task_id": f"support:trace:{trace_id}", "completion": json.dumps(messages[2:]),
                "correct": correct, "reward": correct, "token_ids": ids, "model_mask": mask}

    rows = [rollout("up", "Your order A1001 is lost.", 0.0),
            rollout("down", "Your order A1004 is out for delivery.", 1.0),
            rollout("up-wrong", "I do not know.", 0.0),
            rollout("down-right", "Your order A1007 is returned.", 1.0)]
    specs = {"support": cfg.EnvironmentSpec(module="examples.support.support_env")}
    items = train.encoded_traces(validated, specs, REPO, tok, ends, thumbs=(True, False))
    pairs, counts = dpo.feedback_pairs(rows, items)
    assert counts == {"feedback_traces": 4, "thumbs_up_verifier_wrong": 1,
                      "thumbs_down_verifier_correct": 1, "feedback_unusable": 0,
                      "feedback_without_partner": 0}
    down, up = pairs
    assert (down["task_id"], up["task_id"]) == ("support:trace:down", "support:trace:up")

    def said(ids, mask):
        return tok.decode([t for t, m in zip(ids, mask) if m])

    # thumbs up: the trace's own turns, tool call included, over the rollout that got it wrong
    assert "lookup_order" in said(up["chosen_ids"], up["chosen_mask"])
    assert "A1001 is delivered" in said(up["chosen_ids"], up["chosen_mask"])
    assert "A1001 is lost" in said(up["rejected_ids"], up["rejected_mask"])
    # thumbs down: a rollout with full marks over the trace's answer
    assert "A1004 is out for delivery" in said(down["chosen_ids"], down["chosen_mask"])
    assert "A1004 is lost" in said(down["rejected_ids"], down["rejected_mask"])
    assert up["prompt_ids"] == rows[0]["token_ids"][:len(up["prompt_ids"])]
    assert tok.decode(up["prompt_ids"]).endswith("<|im_start|>assistant\n")
    # a pair the rollouts already gave is not added twice
    again, _ = dpo.feedback_pairs(rows, items, {(p["task_id"], p["completion"]) for p in pairs})
    assert again == []


def test_init_refuses_a_model_without_a_chat_template_saying_what_to_do(tmp_path):
    from conftest import TINY, make_project, offseason

    folder = build(tmp_path / "base")
    for leftover in folder.glob("chat_template.*"):
        leftover.unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    root = make_project(tmp_path / "project", {**TINY, "base": {"model": str(folder)},
                                               "gate": {**TINY["gate"], "primary": "support"},
                                               "environments": {"support": {
                                                   "module": "examples.support.support_env",
                                                   "tasks": "examples/support/tasks.jsonl",
                                                   "benchmark": "examples/support/benchmark.jsonl"}}})
    shutil.copytree(REPO / "examples", root / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    result = offseason(root, "init", check=False)
    assert result.returncode == 2, result.stderr
    assert "has no chat template: add one to its tokenizer_config.json" in result.stderr
    assert not (root / "models" / "champion.dvc").exists()


def test_examples_are_shared_among_environments_by_weight():
    from stages import config as cfg

    specs = {"a": cfg.EnvironmentSpec(module="x", weight=3.0),
             "b": cfg.EnvironmentSpec(module="y", weight=1.0)}
    examples = [{"task_id": f"a:{i}"} for i in range(4)] + [{"task_id": f"b:{i}"} for i in range(12)]
    where = {e["task_id"]: e["task_id"][0] for e in examples}
    kept, counts = train.by_weight(examples, where, specs, seed=0)
    assert counts == {"a": 12, "b": 4} and len(kept) == 16
    assert [e["task_id"] for e in kept[:12]] == [f"a:{i % 4}" for i in range(12)]  # repeated
    assert len({e["task_id"] for e in kept[12:]}) == 4  # a seeded sample of b's twelve
    assert train.by_weight(examples, where, specs, seed=0) == (kept, counts)  # deterministic


def test_replayed_rows_are_trained_on_as_they_are(tmp_path):
    rows = [{"task_id": "support:t1", "completion": "[]", "token_ids": [5, 6, 7],
             "model_mask": [0, 1, 1], "logprobs": [0.0, -0.5, -0.1], "correct": 1.0,
             "reward": 1.0, "environment": "support"}]
    train.store_and_replay(rows, tmp_path, "sft", 1.0, 0, [])
    replayed, available = train.store_and_replay([], tmp_path, "sft", 1.0, 0, [])
    assert available == 1 and replayed[0]["token_ids"] == [5, 6, 7]
    from stages.training.batches import collate
    batch = collate(replayed, pad=0)  # as they are: no <bos>, no extra <eos>
    assert batch["input_ids"].tolist() == [[5, 6, 7]]  # nothing added, not even padding
    assert batch["labels"].tolist() == [[-100, 6, 7]]


def test_a_tokenizer_without_pad_token_pads_with_eos_and_shards_hash(tmp_path):
    from stages import tinylm
    from stages.training import trainers

    tok = AutoTokenizer.from_pretrained(build(tmp_path / "m", "llama"))
    tok.pad_token = None
    assert trainers.pad_id(tok) == tok.eos_token_id
    for i in range(2):
        (tmp_path / "sharded").mkdir(exist_ok=True)
        (tmp_path / "sharded" / f"model-0000{i + 1}-of-00002.safetensors").write_bytes(bytes([i]) * 8)
    first = tinylm.weights_digest(tmp_path / "sharded")
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").write_bytes(b"\x07" * 8)
    assert tinylm.weights_digest(tmp_path / "sharded") != first
    import hashlib
    assert tinylm.weights_digest(tmp_path / "m") == hashlib.sha256(
        (tmp_path / "m" / "model.safetensors").read_bytes()).hexdigest()


def test_switching_the_algorithm_neither_stores_nor_replays_the_same_rollouts_again(tmp_path):
    """SFT then DPO on the same rollouts (only train.algorithm changed): DPO stored them again as
    a second part and replayed its own cycle's rollouts as earlier cycles' data."""
    def row(i, reward):
        return {"task_id": f"support:t{i}", "completion": f"answer {i}", "token_ids": [5, 6, 7 + i],
                "model_mask": [0, 1, 1], "logprobs": [0.0, -0.5, -0.1], "correct": reward,
                "reward": reward, "environment": "support"}
    rows = [row(i, float(i % 2)) for i in range(6)]
    traced = [{**row(9, 1.0), "task_id": "trace:x"}]
    train.store_and_replay(rows, tmp_path, "sft", 1.0, 0, [], traced)
    assert len(list(tmp_path.glob("part-*.parquet"))) == 1
    replayed, available = train.store_and_replay(rows, tmp_path, "dpo", 1.0, 0, [])
    assert (replayed, available) == ([], 0)
    assert len(list(tmp_path.glob("part-*.parquet"))) == 1
    # the next cycle's rollouts are new: stored, and the first cycle's are earlier data
    later = [{**r, "completion": r["completion"] + "!"} for r in rows]
    _, available = train.store_and_replay(later, tmp_path, "sft", 1.0, 0, [])
    assert available > 0 and len(list(tmp_path.glob("part-*.parquet"))) == 2
