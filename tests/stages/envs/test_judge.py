"""The LLM judge against a scripted OpenAI-compatible server on loopback (real HTTP).

The server answers each request from a script: a JSON judgment, malformed JSON, a refusal, an HTTP
500, or nothing in time. Pointwise and relative judgments, the cache (a rerun pays nothing), the
failures (counted with their cause, never a zero) and the budget (stops the stage).

    pytest -q tests/stages/envs/test_judge.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
import yaml
from judge_server import Scripted

from stages import reward
from stages.envs import judge

RUBRIC = "1 when the answer is correct and polite, 0 when it is wrong."


@pytest.fixture
def server():
    made = []

    def start(*script, **options):
        made.append(Scripted(script, **options))
        return made[-1]

    yield start
    for s in made:
        s.close()


def make(srv, tmp_path=None, **kw) -> judge.Judge:
    return judge.Judge(url=srv.url, model="judge-7b",
                       cache_dir=tmp_path / "judgments" if tmp_path else None,
                       **{"rubric": RUBRIC, "request_timeout": 1.0, "retries": 2, **kw})


TASK = {"task_id": "t1", "messages": [{"role": "user", "content": "What is 2+2?"}]}
SAID = TASK["messages"] + [{"role": "assistant", "content": "4, happy to help."}]


def test_pointwise_judgment_with_its_reasoning_and_a_cache(server, tmp_path):
    srv = server({"reasoning": "correct and polite", "score": 0.9})
    j = make(srv, tmp_path, api_key="sk-test")
    scores = j.score(TASK, SAID)
    assert scores == {"judge": 0.9}
    assert scores.judgment == {"judge": j.identity, "reasoning": "correct and polite"}
    sent = srv.requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["auth"] == "Bearer sk-test"
    assert sent["body"]["model"] == "judge-7b" and RUBRIC in sent["body"]["messages"][0]["content"]
    assert sent["body"]["response_format"]["json_schema"]["schema"] == judge.POINTWISE
    assert "4, happy to help." in sent["body"]["messages"][1]["content"]
    # the same judgment again: from the cache, in this process and in a new one (a rerun)
    assert j.score(TASK, SAID) == {"judge": 0.9} and len(srv.requests) == 1 and j.hits == 1
    again = make(srv, tmp_path)
    assert again.score(TASK, SAID).judgment["reasoning"] == "correct and polite"
    assert len(srv.requests) == 1 and again.calls == 0
    # a changed rubric or another answer is a new judgment
    make(srv, tmp_path, rubric=RUBRIC + " Be strict.").score(TASK, SAID)
    assert len(srv.requests) == 2
    # the tokens as the server's `usage` reported them, prompt and completion apart
    assert j.metrics() == {"judge": j.identity, "requests": 1, "tokens": 100, "prompt_tokens": 90,
                           "completion_tokens": 10, "cache_hits": 1, "failures": {}}


@pytest.mark.parametrize("script, kind, requests", [
    (["malformed"], "unparseable", 3),  # retried, then an error
    (["refusal"], "refused", 1),  # a refusal is final
    (["slow"], "timeout", 3),
    (["500"], "http", 3),
    ([{"reasoning": "?", "score": 7}], "unparseable", 1),  # out of [0, 1]
])
def test_a_judge_that_fails_is_an_error_with_its_cause_never_a_zero(server, script, kind,
                                                                     requests):
    srv = server(*script)
    j = make(srv, retries=2, request_timeout=0.5)
    with pytest.raises(judge.JudgeError) as err:
        j.score(TASK, SAID)
    assert err.value.kind == kind and "judge-7b" in str(err.value), str(err.value)
    assert len(srv.requests) == requests and j.failures == {kind: 1}


def test_retries_get_past_a_bad_answer(server):
    srv = server("malformed", "500", {"reasoning": "fine", "score": 1})
    assert make(srv, retries=2).score(TASK, SAID) == {"judge": 1.0}
    assert len(srv.requests) == 3


def test_the_budget_stops_the_work(server, tmp_path):
    srv = server({"reasoning": "ok", "score": 0.5})
    j = make(srv, tmp_path, max_calls=2)
    for n in range(2):
        j.score(TASK, SAID + [{"role": "user", "content": f"again {n}"}])
    j.score(TASK, SAID + [{"role": "user", "content": "again 0"}])  # cached: free
    with pytest.raises(judge.JudgeBudget, match="judge.max_calls=2"):
        j.score(TASK, SAID + [{"role": "user", "content": "again 9"}])
    costly = make(server({"reasoning": "ok", "score": 0.5}), tmp_path, max_cost=100)
    costly.score(TASK, SAID + [{"role": "user", "content": "new"}])  # 100 tokens, kept
    assert costly.tokens == 100
    rerun = make(srv, tmp_path)  # the judgment paid before the budget ran out is cached: free
    rerun.score(TASK, SAID + [{"role": "user", "content": "new"}])
    assert rerun.calls == 0 and rerun.hits == 1
    with pytest.raises(judge.JudgeBudget, match="judge.max_cost=100 tokens"):
        costly.score(TASK, SAID + [{"role": "user", "content": "more"}])


def test_relative_judgment_scores_every_sample_of_a_task_together(server):
    srv = server({"scores": [{"id": 2, "reasoning": "best", "score": 1.0},
                             {"id": 1, "reasoning": "rude", "score": 0.2},
                             {"id": 3, "reasoning": "wrong", "score": 0.0}]})
    episodes = [TASK["messages"] + [{"role": "assistant", "content": a}]
                for a in ("4. Obviously.", "4, happy to help.", "5")]
    ranked = make(srv).rank(TASK, episodes)
    assert [s["judge"] for s in ranked] == [0.2, 1.0, 0.0]
    assert ranked[1].judgment["reasoning"] == "best" and len(srv.requests) == 1
    assert all(f"Response {i}" in srv.requests[0]["body"]["messages"][1]["content"]
               for i in (1, 2, 3))
    short = server({"scores": [{"id": 1, "reasoning": "x", "score": 1.0}]})
    with pytest.raises(judge.JudgeError, match=r"no score for responses \[2, 3\]"):
        make(short).rank(TASK, episodes)


ENV = '''
from stages.envs import judge

TOOLS = []


def reward(task, messages):
    return judge.score(task, messages)
'''

GROUP_ENV = ENV + '''

def reward_group(task, episodes):
    return judge.rank(task, episodes)
'''


def judged_project(tmp_path, url, module=ENV, concurrency=8, runtime=None, **judge_params):
    # a module name of its own per test: contract.load imports it by name (sys.modules)
    name = f"judged_env_{'group' if 'reward_group' in module else 'one'}"
    (tmp_path / f"{name}.py").write_text(module)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "judge": {"model": "judge-7b", "rubric": "rubric.md", **judge_params},
        "runtime": {"judge": {"url": url, "request_timeout": 10.0, "retries": 1,
                              "concurrency": concurrency, **(runtime or {})}}}))
    (tmp_path / "rubric.md").write_text(RUBRIC)
    from stages import config as cfg

    return {"help": cfg.EnvironmentSpec(module=name)}


def rollouts(answers) -> pa.Table:
    return pa.Table.from_pylist([
        {"task_id": "t1", "environment": "help", "task": json.dumps(TASK), "sample": i,
         "messages": json.dumps(TASK["messages"] + [{"role": "assistant", "content": a}]),
         "error": None} for i, a in enumerate(answers)])


@pytest.fixture
def fresh_judges(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    judge.use_cache(tmp_path / "data" / "judgments")
    yield
    judge.use_cache(None)


def test_the_reward_stage_keeps_the_judgment_and_counts_failures(server, tmp_path,
                                                                  fresh_judges):
    # the judgments are asked concurrently: the judge refuses the one that says "5", whenever
    # it comes
    srv = server({"reasoning": "good", "score": 0.75}, by_content={"### assistant\\n5": "refusal"})
    specs = judged_project(tmp_path, srv.url)
    out, metrics = reward.score(specs, rollouts(["4", "5", "four"]), tmp_path)
    rows = out.to_pylist()
    assert [r["score_judge"] for r in rows] == [0.75, None, 0.75]
    assert rows[1]["reward"] is None and "refused to judge" in rows[1]["error"]  # not a zero
    assert json.loads(rows[0]["judgment"])["reasoning"] == "good"
    assert json.loads(rows[0]["judgment"])["judge"].startswith("judge-7b/rubric-")
    assert metrics["errors"] == 1 and metrics["judges"][0]["failures"] == {"refused": 1}
    assert metrics["judges"][0]["requests"] == 3
    # a rerun (the stage killed and resumed, or reproduced): the paid judgments are not asked again
    judge.use_cache(tmp_path / "data" / "judgments")
    out2, metrics2 = reward.score(specs, rollouts(["4", "four"]), tmp_path)
    assert metrics2["judges"][0]["requests"] == 0 and metrics2["judges"][0]["cache_hits"] == 2


def test_a_spent_budget_stops_the_reward_stage(server, tmp_path, fresh_judges):
    srv = server({"reasoning": "good", "score": 0.75})
    specs = judged_project(tmp_path, srv.url, max_calls=1)
    with pytest.raises(judge.JudgeBudget, match="judge.max_calls=1"):
        reward.score(specs, rollouts(["4", "5"]), tmp_path)


def test_judgments_are_asked_concurrently_within_the_budget(server, tmp_path, fresh_judges):
    """The reward stage asks a judged environment's judgments `runtime.judge.concurrency` at a
    time, and concurrency never spends more of the budget than asking one at a time would: no
    request beyond judge.max_calls, and none once the tokens spent plus those of every request in
    flight (each as large as the largest so far) would pass judge.max_cost."""
    answers = [str(n) for n in range(12)]
    srv = server({"reasoning": "good", "score": 0.75}, delay=0.2)
    specs = judged_project(tmp_path, srv.url, concurrency=4)
    out, metrics = reward.score(specs, rollouts(answers), tmp_path)
    assert out.column("score_judge").to_pylist() == [0.75] * 12
    assert metrics["judges"][0]["requests"] == len(srv.requests) == 12
    assert 1 < srv.most_in_flight <= 4  # concurrent, and never more than asked for
    # judge.max_calls: exactly that many requests reach the server, then the stage stops
    judge.use_cache(None)
    counted = server({"reasoning": "good", "score": 0.75}, delay=0.2)
    specs = judged_project(tmp_path, counted.url, concurrency=8, max_calls=3)
    with pytest.raises(judge.JudgeBudget, match="judge.max_calls=3"):
        reward.score(specs, rollouts(answers), tmp_path)
    assert len(counted.requests) == 3
    # judge.max_cost, 100 tokens a request: one at a time it sends three (0, 100, 200 < 250)
    judge.use_cache(None)
    costly = server({"reasoning": "good", "score": 0.75}, delay=0.2)
    specs = judged_project(tmp_path, costly.url, concurrency=8, max_cost=250)
    with pytest.raises(judge.JudgeBudget, match="judge.max_cost=250 tokens"):
        reward.score(specs, rollouts(answers), tmp_path)
    assert len(costly.requests) == 3 and judge.used()[0].tokens == 300


def test_a_judge_called_in_a_worker_process_is_refused_saying_what_to_do(server, tmp_path,
                                                                       fresh_judges):
    # a module that imports the judge only inside its reward: the stage cannot see it calls the
    # judge, so it scores it in worker processes, where each would have a budget of its own
    lazy = ("TOOLS = []\n\n\ndef reward(task, messages):\n    from stages.envs import judge\n"
            "    return judge.score(task, messages)\n")
    srv = server({"reasoning": "good", "score": 0.75})
    specs = judged_project(tmp_path, srv.url, module=lazy)
    from stages import config as cfg

    with pytest.raises(reward.VerifierBroken, match="called the judge in a worker process.*"
                                                    "import the judge at the top"):
        reward.score(specs, rollouts(["4", "5"]), tmp_path, cfg.Reward(workers=2))
    assert srv.requests == []


def test_reward_group_judges_the_samples_of_a_task_together(server, tmp_path, fresh_judges):
    srv = server({"scores": [{"id": 1, "reasoning": "a", "score": 0.25},
                             {"id": 2, "reasoning": "b", "score": 1.0}]})
    specs = judged_project(tmp_path, srv.url, module=GROUP_ENV)
    out, _ = reward.score(specs, rollouts(["five", "4"]), tmp_path)
    assert out.column("reward").to_pylist() == [0.25, 1.0] and len(srv.requests) == 1


def test_no_judge_configured_says_what_to_set(tmp_path, fresh_judges):
    (tmp_path / "params.yaml").write_text("judge: {}\n")
    from stages import config as cfg

    with pytest.raises(cfg.ParamsError, match="judge.model and runtime.judge.url"):
        judge.project(tmp_path / "params.yaml")


@pytest.mark.parametrize("fault", ["refused", "black hole"])
def test_a_judge_that_is_down_stops_the_stage_in_seconds(fault, tmp_path, fresh_judges,
                                                        monkeypatch):
    """Probed once before the first judgment: not request_timeout x retries per episode."""
    import socket

    from stages.remote import RemoteDown

    monkeypatch.setenv("OFFSEASON_PROBE_TIMEOUT", "1")
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        if fault == "black hole":
            hole.listen(8)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}/v1"
        if fault == "refused":
            hole.close()
        specs = judged_project(tmp_path, url)
        started = time.monotonic()
        with pytest.raises(RemoteDown, match=r"runtime.judge.url='http://127.0.0.1:\d+/v1'"):
            reward.score(specs, rollouts(["4", "5", "6"]), tmp_path)
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("runtime", [
    {"concurrency": 2, "stall_seconds": 1.0},
    # requests that time out one at a time, each before the bound: their silences add up
    {"concurrency": 1, "request_timeout": 0.4, "stall_seconds": 1.0}])
def test_a_judge_that_stalls_mid_stage_fails_it_in_the_stall_bound_keeping_its_judgments(
        server, tmp_path, fresh_judges, runtime):
    """A server that answers 3 judgments and then nothing (up, never replying): the stage fails
    once no answer came for runtime.judge.stall_seconds, naming the server and what it judged,
    where each episode waited request_timeout x attempts (10 s x 2 here); the 3 judgments paid
    for are in the cache, and the rerun asks a healthy server only the rest."""
    ok = {"reasoning": "good", "score": 0.75}
    answers = [str(n) for n in range(10)]
    wedged = server(ok, ok, ok, "stall")
    specs = judged_project(tmp_path, wedged.url, runtime=runtime)
    started = time.monotonic()
    with pytest.raises(judge.JudgeStalled) as err:
        reward.score(specs, rollouts(answers), tmp_path)
    took = time.monotonic() - started
    assert took < 8, took  # not even one request_timeout (10 s)
    message = str(err.value)
    assert f"judge 'judge-7b' at {wedged.url}: no answer for" in message, message
    assert "runtime.judge.stall_seconds=1" in message and "answered 3 requests" in message
    assert "data/judgments/" in message
    judge.use_cache(tmp_path / "data" / "judgments")  # the stage rerun: a fresh judge
    healthy = server(ok)
    specs = judged_project(tmp_path, healthy.url, concurrency=2, runtime={"stall_seconds": 1.0})
    out, metrics = reward.score(specs, rollouts(answers), tmp_path)
    assert out.column("score_judge").to_pylist() == [0.75] * 10
    assert metrics["judges"][0]["cache_hits"] == 3 and len(healthy.requests) == 7

def test_the_benchmark_stages_use_the_held_out_judge(server, tmp_path, fresh_judges):
    srv = server({"reasoning": "ok", "score": 1.0})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "judge": {"model": "judge-7b", "rubric": "train rubric",
                  "benchmark_model": "judge-70b", "benchmark_rubric": "held-out rubric"},
        "runtime": {"judge": {"url": srv.url}}}))
    assert judge.project().model == "judge-7b" and judge.project().rubric == "train rubric"
    judge.for_benchmarks()
    try:
        held = judge.project()
        held.score(TASK, SAID)
        assert held.model == "judge-70b" and held.rubric == "held-out rubric"
        assert srv.requests[0]["body"]["model"] == "judge-70b"
        assert "held-out rubric" in srv.requests[0]["body"]["messages"][0]["content"]
    finally:
        judge._HELD_OUT[0] = False


JUDGE_SERVER = Path(__file__).parents[2] / "judge_server.py"


def test_the_reward_stage_starts_the_judges_server_command_and_stops_it(tmp_path, fresh_judges,
                                                                         capsys):
    """runtime.judge.server_command: the stage starts the server on a free loopback port, waits
    for its GET /health, judges through it and stops it when it ends, as the rollout stage
    does with its own server_command.
    """
    import pyarrow.parquet as pq

    judged_project(tmp_path, "")
    (tmp_path / "script.json").write_text(json.dumps([{"reasoning": "served", "score": 0.25}]))
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["runtime"]["judge"] = {"server_command": f"{sys.executable} {JUDGE_SERVER} --port "
                                                    f"{{port}} --script script.json",
                                  "server_timeout": 60.0}
    params.update({"base": {}, "reward": {},
                   "environments": {"help": {"module": "judged_env_one"}}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    pq.write_table(rollouts(["4", "5"]), tmp_path / "rollouts.parquet")
    reward.main(["rollouts.parquet", "rewards.parquet", "reward.json",
                 "--judgments", "data/judgments"])
    rows = pq.read_table(tmp_path / "rewards.parquet").to_pylist()
    assert [r["score_judge"] for r in rows] == [0.25, 0.25]
    assert json.loads(rows[0]["judgment"])["reasoning"] == "served"
    said = capsys.readouterr().err
    url = said.split("judge: server up at ")[1].split()[0]
    assert url.startswith("http://127.0.0.1:") and "judge: server stopped" in said
    with pytest.raises(httpx.ConnectError):  # stopped with the stage
        httpx.get(f"{url}/health", timeout=2)
    ran = json.loads((tmp_path / "reward.json").read_text())["runtime"]["judge"]
    assert ran["server_command"].endswith("--script script.json") and ran["url"] == ""

    # a command that dies before it is healthy stops the stage, naming the setting, at once
    params["runtime"]["judge"]["server_command"] = f"{sys.executable} -c 'raise SystemExit(3)' " \
                                                   f"{{port}}"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "data" / "judgments").mkdir(exist_ok=True)
    for shard in (tmp_path / "data" / "judgments").iterdir():
        shard.unlink()  # no cached judgment: the judge is asked
    started = time.monotonic()
    with pytest.raises(SystemExit):
        reward.main(["rollouts.parquet", "rewards.parquet", "reward.json",
                     "--judgments", "data/judgments"])
    assert time.monotonic() - started < 30
    assert "runtime.judge.server_command exited with code 3 before it was healthy" in \
        capsys.readouterr().err


def test_judge_server_command_settings_are_checked(tmp_path):
    from stages import config as cfg

    path = tmp_path / "params.yaml"
    for runtime, message in [({"server_command": "serve", "url": "http://h/v1"}, "both set"),
                             ({"server_command": "serve --port 8000"}, "must contain {port}")]:
        path.write_text(yaml.safe_dump({"judge": {"model": "m"}, "runtime": {"judge": runtime}}))
        with pytest.raises(cfg.ParamsError, match=message):
            cfg.load("judge", path)
