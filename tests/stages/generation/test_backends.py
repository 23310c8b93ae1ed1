"""Generation backends: the transformers loop's sampling, turn limit and stop strings, and the
openai backend against a real HTTP server (stages.generation.serve_tiny) serving the same model:
the demo's chat model playing the arithmetic environment, token ids in and out."""

import json
import os
import random
import re
import socket
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from stages import config as cfg
from stages import rollout, servers, tinylm
from stages.envs import arith, contract
from stages.generation import chat, openai_backend, serve_tiny, transformers_backend
from stages.training import warmstart

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("backends")

QUESTIONS = ["12*34", "5+6", "300-7", "8*9", "41+17", "7*66", "90-45", "3*3"]
ENV = contract.load("arith", "stages.envs.arith")
SPECS = {"arith": cfg.EnvironmentSpec(module="stages.envs.arith")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A very small chat model that has seen tool demonstrations (so it calls the tool), saved."""
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    template = chat.Template.of(tokenizer, list(arith.TOOLS), chat.end_ids(model, tokenizer))
    warmstart.train(model, warmstart.demonstrations(template, arith, random.Random(0), 1.0, 32),
                    steps=60, lr=1e-2, tokenizer=tokenizer, seed=0)
    model.eval()
    folder = tmp_path_factory.mktemp("model") / "champion"
    tinylm.save(model, tokenizer, folder)
    return model, tokenizer, folder


class Counting(serve_tiny.Handler):
    """The real server, counting the completion requests it got and the keys they carried."""

    def do_POST(self):  # noqa: N802
        raw = self.body()  # read first: the connection is kept alive for the next request
        type(self).posts += 1
        type(self).keys.add(self.headers.get("Authorization"))
        if not self.fail():
            self.complete(raw)

    def fail(self) -> bool:
        return False


def handler(fail=None):
    """A fresh handler class (own counters); `fail(self, n) -> bool` answers request n itself."""
    attrs = {"posts": 0, "keys": set()}
    if fail is not None:
        attrs["fail"] = lambda self: fail(self, type(self).posts)
    return type("Handler", (Counting,), attrs)


class Served:
    def __init__(self, folder, handler_class):
        self.server = serve_tiny.make_server(folder, handler=handler_class, name="tiny")
        self.handler = self.server.RequestHandlerClass  # where the counters are kept
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve(trained):
    servers = []

    def start(handler_class=None):
        servers.append(Served(trained[2], handler_class or handler()))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def tasks(n=2):
    return [{"task_id": f"t{i}", **arith.chat_task(q)} for i, q in enumerate(QUESTIONS)] * n


def run_transformers(trained, **kwargs):
    model, tokenizer, _ = trained
    options = {"temperature": 0.0, "max_new_tokens": 40, "max_turns": 4, "parser": "hermes",
               **kwargs}
    played, seed = options.pop("tasks", tasks()), options.pop("seed", 0)
    return chat.rollout(model, tokenizer, ENV, played, generator=[
        torch.Generator().manual_seed(seed * 1000 + i) for i in range(len(played))], **options)


def run_openai(trained, urls, **kwargs):
    model, tokenizer, _ = trained
    options = {"temperature": 0.0, "max_new_tokens": 40, "max_turns": 4, "parser": "hermes",
               "progress": False, "backoff": 0.01, "concurrency": 8,
               "context": model.config.max_position_embeddings, **kwargs}
    played, seed = options.pop("tasks", tasks()), options.pop("seed", 0)
    return openai_backend.chat_rollout(tokenizer, ENV, played, [seed * 1000 + i for i in
                                                                range(len(played))],
                                       urls=urls, ends=chat.end_ids(model, tokenizer), **options)


def test_top_k_one_and_tiny_top_p_are_greedy(trained):
    greedy = [e.token_ids for e in run_transformers(trained)]
    assert [e.token_ids for e in run_transformers(trained, temperature=1.0, top_k=1)] == greedy
    assert [e.token_ids for e in run_transformers(trained, temperature=1.0, top_p=1e-6)] == greedy
    sampled = [e.token_ids for e in run_transformers(trained, temperature=1.5, seed=1)]
    assert sampled != greedy


def test_turn_index_and_turn_limit(trained):
    episodes = run_transformers(trained, temperature=1.0, seed=2, tasks=tasks(4))
    assert any(e.tool_calls for e in episodes)
    for episode in episodes:
        assert len(episode.turns) == len(episode.token_ids) == len(episode.model_mask)
        start = episode.model_mask.index(1)
        assert episode.turns[:start] == [0] * start  # the prompt
        # each model turn is numbered, and the tool's answer belongs to the turn it answers
        model_turns = sum(m["role"] == "assistant" for m in episode.messages)
        assert max(episode.turns) == model_turns
        chosen = {t for t, m in zip(episode.turns, episode.model_mask) if m}
        assert chosen == set(range(1, model_turns + 1))
    greedy = run_transformers(trained, tasks=tasks(1))
    assert any(e.tool_calls for e in greedy)
    limited = run_transformers(trained, tasks=tasks(1), max_turns=0)
    for before, after in zip(greedy, limited):
        if before.tool_calls:  # the same first turn, then the call is refused: finish "turns"
            assert after.finish == "turns" and after.tool_calls == 0
            assert after.messages[-1]["tool_calls"] and after.messages == before.messages[:2]
    assert all(e.finish in ("eos", "length", "turns") for e in limited)


def test_stop_strings_end_a_completion(trained):
    # what serve_tiny does with an OpenAI request's `stop`: a single token ("<tool_call>") or text
    # a token only ends with ("}", the last character of the call's '"}}')
    model, tokenizer, _ = trained
    template = chat.Template.of(tokenizer, list(ENV.tools), chat.end_ids(model, tokenizer))
    prefixes = [template.prompt(task["messages"]) for task in tasks(1)]
    plain = transformers_backend.generate_ids(model, tokenizer, prefixes, temperature=0.0,
                                              max_new_tokens=40, generator=torch.Generator())
    called = [i for i, row in enumerate(plain) if '"}}' in tokenizer.decode(row.token_ids)]
    assert called and all(row.finish == "eos" and row.stop is None for row in plain)
    for stop, ends in (("<tool_call>", "<tool_call>"), ("}", '"}}')):
        rows = transformers_backend.generate_ids(model, tokenizer, prefixes, temperature=0.0,
                                                 max_new_tokens=40, generator=torch.Generator(),
                                                 stop=(stop,))
        for i in called:
            text = tokenizer.decode(rows[i].token_ids, skip_special_tokens=True)
            assert rows[i].finish == "stop" and rows[i].stop == stop
            assert text.endswith(ends) and text.count(ends) == 1
            assert tokenizer.decode(plain[i].token_ids).startswith(
                tokenizer.decode(rows[i].token_ids))  # the same tokens, up to the stop


def test_openai_backend_matches_transformers_multi_turn(trained, serve):
    server = serve()
    local = run_transformers(trained)
    remote, stats = run_openai(trained, [server.url])
    assert any(e.tool_calls for e in remote), "the episodes must exercise tool calls"
    for a, b in zip(local, remote):
        assert (b.messages, b.token_ids, b.model_mask, b.finish, b.tool_calls, b.turns) == \
            (a.messages, a.token_ids, a.model_mask, a.finish, a.tool_calls, a.turns)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    for episode in remote:  # each call answered by the calculator
        for call, reply in zip(episode.messages, episode.messages[1:]):
            if call.get("tool_calls"):
                arguments = json.loads(call["tool_calls"][0]["function"]["arguments"])
                assert reply["content"] == arith.call_tool({}, "calculator", arguments)
    # one request per model turn: each assistant message the episodes hold
    turns = sum(m["role"] == "assistant" for e in remote for m in e.messages)
    assert stats.requests == server.handler.posts == turns
    assert stats.retries == 0


def test_openai_backend_sampling_is_seeded(trained, serve):
    server = serve()
    first, _ = run_openai(trained, [server.url], temperature=1.0, seed=3)
    again, _ = run_openai(trained, [server.url], temperature=1.0, seed=3, concurrency=3)
    other, _ = run_openai(trained, [server.url], temperature=1.0, seed=4)
    assert [e.token_ids for e in first] == [e.token_ids for e in again]
    assert [e.token_ids for e in first] != [e.token_ids for e in other]


def test_retries_500_and_429_then_succeeds(trained, serve, monkeypatch):
    def fail(self, n):
        if n <= 3:
            self.error(500, "warming up", "server_error")
        elif n == 4:
            self.reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"})
        return n <= 4

    flaky = serve(handler(fail))
    monkeypatch.setenv("OFFSEASON_TEST_KEY", "sk-test-123")
    episodes, stats = run_openai(trained, [flaky.url], concurrency=1,
                                 api_key=openai_backend.api_key_from("OFFSEASON_TEST_KEY"))
    clean, _ = run_openai(trained, [serve().url])
    assert stats.retries == 4
    assert flaky.handler.posts == stats.requests + 4
    assert [e.token_ids for e in episodes] == [e.token_ids for e in clean]
    assert flaky.handler.keys == {"Bearer sk-test-123"}


def test_timeout_is_retried(trained, serve):
    def slow(self, n):
        if n == 1:
            time.sleep(1.5)
        return False

    server = serve(handler(slow))
    episodes, stats = run_openai(trained, [server.url], timeout=0.5, tasks=tasks(1)[:2])
    assert stats.retries >= 1 and len(episodes) == 2


def test_bad_request_fails_at_once_with_the_servers_message(trained, serve):
    server = serve()
    with pytest.raises(openai_backend.ServerError) as err:  # a context the model does not have
        run_openai(trained, [server.url], context=1000, max_new_tokens=200, concurrency=1,
                   retries=5)
    assert "HTTP 400" in str(err.value) and "maximum context length" in str(err.value)
    assert server.url in str(err.value)
    assert server.handler.posts == 1  # not retried


def test_the_server_keeps_the_end_token_it_stopped_on_as_vllm_does(trained, serve):
    import httpx

    model, tokenizer, _ = trained
    server = serve()
    template = chat.Template.of(tokenizer, list(ENV.tools), chat.end_ids(model, tokenizer))
    body = {"prompt": template.prompt(arith.chat_task("5+6")["messages"]), "max_tokens": 40,
            "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True}

    def complete(**extra):
        choice = httpx.post(f"{server.url}/completions", json={**body, **extra}).json()
        choice = choice["choices"][0]
        return choice, [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]

    plain, ids = complete()
    assert len(ids) == len(plain["logprobs"]["token_logprobs"]) > 1
    if plain["finish_reason"] == "stop":  # the eos is the last id; its text is not written
        assert ids[-1] == tokenizer.eos_token_id and plain["stop_reason"] is None
    # a stop token of the request's own ends the completion on it, and is named by its id
    stopped, first = complete(stop_token_ids=[ids[0]])
    assert first == ids[:1] and stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == ids[0]


def test_server_that_never_recovers_names_the_url(trained, serve):
    def down(self, n):
        self.error(503, "overloaded", "server_error")
        return True

    server = serve(handler(down))
    with pytest.raises(openai_backend.ServerError, match="after 3 attempts") as err:
        run_openai(trained, [server.url], retries=2, concurrency=1, tasks=tasks(1)[:1])
    assert server.url in str(err.value) and "HTTP 503" in str(err.value)
    assert "overloaded" in str(err.value)


def test_several_urls_share_the_work_and_a_failing_one_is_routed_around(trained, serve):
    a, b = serve(), serve()
    episodes, stats = run_openai(trained, [a.url, b.url], concurrency=8)
    assert a.handler.posts > 0 and b.handler.posts > 0
    assert stats.by_url == {a.url: a.handler.posts, b.url: b.handler.posts}

    def down(self, n):
        self.error(502, "bad gateway", "server_error")
        return True

    broken, good = serve(handler(down)), serve()
    again, stats = run_openai(trained, [broken.url, good.url], concurrency=4)
    assert [e.token_ids for e in again] == [e.token_ids for e in episodes]
    assert stats.retries == broken.handler.posts > 0 and stats.by_url[broken.url] == 0


def test_a_server_that_dies_mid_run_loses_only_its_requests_in_flight(trained, serve, capsys):
    """One of two servers shuts down after answering 10 requests (its port closed, its open
    connections cut): its requests in flight go to the other, and no new request is sent to it
    (before: each later request tried the dead URL first, the least loaded, then retried)."""
    dead, cut = threading.Event(), []

    def die(handler_self, n):
        if n == 11 and not dead.is_set():
            dead.set()
            server = doomed[0].server
            threading.Thread(target=lambda: (server.shutdown(), server.server_close())).start()
        if dead.is_set():  # gone: no answer on any connection, kept-alive ones included
            cut.append(n)
            handler_self.close_connection = True
            handler_self.connection.shutdown(socket.SHUT_RDWR)
            return True
        return False

    reference, _ = run_openai(trained, [serve().url], tasks=tasks(3))
    doomed = [serve(handler(die))]
    a, b = doomed[0], serve()
    episodes, stats = run_openai(trained, [a.url, b.url], tasks=tasks(3), concurrency=8)
    assert [e.token_ids for e in episodes] == [e.token_ids for e in reference]
    assert dead.is_set() and stats.by_url[a.url] == a.handler.posts - len(cut) >= 10
    # at most the requests in flight when it died (concurrency 8) were sent to it in vain
    assert 1 <= len(cut) <= stats.retries <= 8, (len(cut), stats.retries)
    assert list(stats.lost) == [a.url]
    assert f"rollout: {a.url} left out" in capsys.readouterr().err


def test_a_server_that_wedges_among_several_is_left_out_within_the_stall_bound(trained, serve):
    """One of two servers stops answering after 10 requests (up, accepting, never replying):
    with stall_seconds its requests go to the other once it has been silent that long, and the
    run finishes (before: each waited request_timeout, 120 s, and the run with it)."""
    release = threading.Event()

    def wedge(handler_self, n):
        if n > 10:
            release.wait(120)
            return True
        return False

    reference, _ = run_openai(trained, [serve().url], tasks=tasks(3))
    a, b = serve(handler(wedge)), serve()
    began = time.monotonic()
    try:
        episodes, stats = run_openai(trained, [a.url, b.url], tasks=tasks(3), concurrency=8,
                                     stall=2.0, timeout=120.0)
    finally:
        release.set()
    assert time.monotonic() - began < 60  # the bound (2 s) with a loaded machine's slack
    assert [e.token_ids for e in episodes] == [e.token_ids for e in reference]
    assert list(stats.lost) == [a.url] and "answered nothing" in stats.lost[a.url]
    assert stats.by_url[a.url] == 10


def _validated(path: Path) -> Path:
    """Validated traces, each routed to the arith environment's task of its question."""
    rows = [{"trace_id": f"t{i}",
             "question": json.dumps({**arith.chat_task(q), "environment": "arith"})}
            for i, q in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _servers_of(folder: Path) -> list[int]:
    """Processes whose command line names `folder` (the model the stage served)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(folder) in cmdline and "serve_tiny" in cmdline:
                found.append(int(proc.name))
    return found


def test_rollout_stage_starts_and_stops_the_server(trained, tmp_path):
    folder = trained[2]
    validated = _validated(tmp_path / "validated.parquet")
    command = f"{sys.executable} -m stages.generation.serve_tiny {{model}} --port {{port}} --threads 1"
    config = cfg.Rollout(backend="openai", server_command=command, samples_per_task=2,
                         temperature=0.0, max_new_tokens=40, max_turns=4)
    base = cfg.Base()
    metrics = rollout.run(base, config, SPECS, folder, tmp_path / "rollouts.parquet",
                          validated=validated)
    assert _servers_of(folder) == []
    table = pq.read_table(tmp_path / "rollouts.parquet").to_pylist()
    local = rollout.run(base, cfg.Rollout(samples_per_task=2, temperature=0.0, max_new_tokens=40,
                                          max_turns=4),
                        SPECS, folder, tmp_path / "local.parquet", validated=validated)
    expected = pq.read_table(tmp_path / "local.parquet").to_pylist()
    assert [r["messages"] for r in table] == [r["messages"] for r in expected]
    assert [r["token_ids"] for r in table] == [r["token_ids"] for r in expected]
    assert metrics["episodes"] == 16 and metrics["backend"] == "openai"
    assert metrics["generated_tokens"] == local["generated_tokens"]
    assert metrics["requests"] >= 16 and metrics["retries"] == 0

    # the chat endpoint, asked with tools, of a server started without a tool parser: 400
    failing = cfg.Rollout(backend="openai", server_command=command, api="chat")
    with pytest.raises(openai_backend.ServerError, match="HTTP 400"):
        rollout.run(base, failing, SPECS, folder, tmp_path / "never.parquet", validated=validated)
    assert _servers_of(folder) == [] and not (tmp_path / "never.parquet").exists()


def test_a_server_command_that_dies_is_reported_with_its_output(tmp_path):
    command = f"{sys.executable} -c \"print('no GPU found'); raise SystemExit(3)\" {{port}}"
    with pytest.raises(openai_backend.ServerError, match="exited with code 3") as err:
        with servers.serve(command, tmp_path, timeout=60):
            pass
    assert "no GPU found" in str(err.value)
    log = Path(re.search(r"its last output \((\S+)\)", str(err.value))[1])
    assert log.exists()  # kept: the error names it
    log.unlink()


HEALTHY = (f"{sys.executable} -c \"import http.server as h\n"
           "class H(h.BaseHTTPRequestHandler):\n"
           "    def do_GET(self): self.send_response(200); self.end_headers()\n"
           "    def log_message(self, *a): pass\n"
           "print('serving', flush=True); h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\"")


def test_a_server_s_log_is_removed_when_all_went_well_and_kept_when_not(tmp_path, capsys):
    with servers.serve(HEALTHY, tmp_path, timeout=60) as url:
        assert url.endswith("/v1")
    said = capsys.readouterr().err
    log = Path(re.search(r"\(log: (\S+)\)", said)[1])
    assert not log.exists() and "server stopped\n" in said
    with pytest.raises(RuntimeError, match="the rollout failed"):
        with servers.serve(HEALTHY, tmp_path, timeout=60):
            raise RuntimeError("the rollout failed")
    said = capsys.readouterr().err
    log = Path(re.search(r"\(log: (\S+)\)", said)[1])
    assert f"server stopped; its log: {log}" in said
    assert "serving" in log.read_text()
    log.unlink()


@pytest.mark.parametrize("values, key", [
    ({"backend": "openai"}, "rollout.urls"),
    ({"backend": "vllm"}, "rollout.backend"),
    ({"backend": "openai", "server_command": "vllm serve {model}"}, "{port}"),
    ({"backend": "openai", "urls": "localhost:8000"}, "rollout.urls"),
    ({"top_p": 0.0}, "rollout.top_p"),
    ({"max_turns": -1}, "rollout.max_turns"),
    ({"concurrency": 0}, "rollout.concurrency"),
    ({"urls": "http://a/v1", "server_command": "x {port}"}, "both set"),
])
def test_rollout_params_are_checked(values, key):
    with pytest.raises(cfg.ParamsError, match=key.replace("{", r"\{").replace("}", r"\}")
                       .replace(".", r"\.")):
        cfg.Rollout(**values)


def test_api_key_only_from_the_environment(monkeypatch):
    monkeypatch.delenv("OFFSEASON_NO_SUCH_KEY", raising=False)
    assert openai_backend.api_key_from("OFFSEASON_NO_SUCH_KEY") is None
    monkeypatch.setenv("OFFSEASON_NO_SUCH_KEY", "k")
    assert openai_backend.api_key_from("OFFSEASON_NO_SUCH_KEY") == "k"
    assert os.environ["OFFSEASON_NO_SUCH_KEY"] == "k"


def test_progress_lines_on_stderr(trained, serve, capsys):
    run_openai(trained, [serve().url], progress=True, tasks=tasks(1))
    assert "rollout (openai): 8/8 episodes" in capsys.readouterr().err


def test_a_served_rollout_meets_the_budget_per_batch_on_the_servers_usage(trained, tmp_path):
    """The served backend is the one that bills per token: its batches are checked against the
    budget like the others, on the tokens the server says it processed (every turn's prompt
    resent), and a stop keeps the finished episodes for the rerun."""
    from stages import budget as budgets

    folder = trained[2]
    validated = _validated(tmp_path / "validated.parquet")
    command = f"{sys.executable} -m stages.generation.serve_tiny {{model}} --port {{port}} --threads 1"
    config = cfg.Rollout(backend="openai", server_command=command, samples_per_task=2,
                         temperature=0.0, max_new_tokens=40, max_turns=4, batch_size=4)
    whole = rollout.run(cfg.Base(), config, SPECS, folder, tmp_path / "whole.parquet",
                        validated=validated)
    usage = whole["served_usage"]
    # the server's count: each turn's request carries the conversation so far
    assert usage["completion_tokens"] == whole["generated_tokens"]
    assert usage["prompt_tokens"] > whole["prompt_tokens"]
    assert budgets.served_tokens(whole) == usage["prompt_tokens"] + usage["completion_tokens"]
    # a dollar a served token, the CPU free: the first batch's tokens spend the budget
    prices = cfg.Cost(cpu_hour_usd=0.0, rollout_usd_per_million_tokens=1e6)
    meter = budgets.Meter("rollout", cfg.Budget(max_usd=10.0), prices)
    with pytest.raises(budgets.BudgetSpent, match=r"done: 4 of 16 episodes") as err:
        rollout.run(cfg.Base(), config, SPECS, folder, tmp_path / "stopped.parquet",
                    validated=validated, meter=meter)
    assert "budget.max_usd=10 reached" in str(err.value)
    assert len(pq.read_table(tmp_path / "stopped.parquet.partial")) == 4
    again = rollout.run(cfg.Base(), config, SPECS, folder, tmp_path / "stopped.parquet",
                        validated=validated)
    assert again["resumed_episodes"] == 4
    assert pq.read_table(tmp_path / "stopped.parquet").column("token_ids").to_pylist() == \
        pq.read_table(tmp_path / "whole.parquet").column("token_ids").to_pylist()


def test_a_server_that_wedges_mid_run_fails_the_stage_within_its_stall_bound(serve, trained,
                                                                                tmp_path):
    """A server that stops answering after a few requests (up, accepting connections, never
    replying) held the stage for request_timeout x attempts (12 minutes at the defaults); with
    runtime.rollout.stall_seconds the stage fails within it, naming the server."""
    release = threading.Event()

    def wedge(server, n):  # from the 6th request on: hold the request until the test ends
        if n > 5:
            release.wait(60)
            return True
        return False

    served = serve(handler(wedge))
    config = cfg.Rollout(backend="openai", urls=served.url, samples_per_task=2,
                         max_new_tokens=40, stall_seconds=2.0, request_timeout=120.0)
    try:  # the watch's own error, not the request's timeout (120 s) after its retries
        with pytest.raises(openai_backend.ServerError, match=r"no answer from "
                           + re.escape(served.url) + r" for \d+ s .*stall_seconds=2"):
            rollout.run(cfg.Base(), config, SPECS, trained[2], tmp_path / "r.parquet",
                        validated=_validated(tmp_path / "validated.parquet"))
    finally:
        release.set()
    assert not (tmp_path / "r.parquet").exists()
