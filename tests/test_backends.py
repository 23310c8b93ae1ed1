"""Generation backends: the transformers loop's sampling, turn limit and tool-close detection, and
the openai backend against a real HTTP server (stages.generation.serve_tiny) serving the same model."""

import os
import random
import re
import sys
import threading
import time
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages import config as cfg
from stages import rollout, tinylm
from stages.envs import arith
from stages.generation import openai_backend, serve_tiny, transformers_backend
from stages.training import warmstart
from stages.training.warmstart import demonstrations

# one xdist worker runs this module: its module-scoped fixture is built once
pytestmark = pytest.mark.xdist_group("backends")

QUESTIONS = ["12*34", "5+6", "300-7", "8*9", "41+17", "7*66", "90-45", "3*3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A very small model that has seen tool demonstrations (so it calls the tool), saved."""
    tokenizer = tinylm.build_tokenizer(arith)
    model = tinylm.build_model(tokenizer, n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=0)
    warmstart.train(model, demonstrations(tokenizer, arith, random.Random(0), 1.0, 32), steps=60,
              lr=1e-2, tokenizer=tokenizer, seed=0)
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


def prompts(n=2):
    return [arith.prompt(q) for q in QUESTIONS] * n


def run_transformers(trained, **kwargs):
    model, tokenizer, _ = trained
    options = {"temperature": 0.0, "max_new_tokens": 40, "seed": 0, "batch_size": 64,
               "progress": False, "max_turns": 4, **kwargs}
    return transformers_backend.generate(model, tokenizer, arith, options.pop("prompts", prompts()), **options)


def run_openai(trained, urls, **kwargs):
    options = {"tokenizer": trained[1], "temperature": 0.0, "max_new_tokens": 40, "max_turns": 4,
               "progress": False, "backoff": 0.01, "concurrency": 8, **kwargs}
    return openai_backend.generate(options.pop("prompts", prompts()), arith, urls=urls, **options)


def test_top_k_one_and_tiny_top_p_are_greedy(trained):
    greedy = [e.completion for e in run_transformers(trained)]
    assert [e.completion for e in run_transformers(trained, temperature=1.0, top_k=1)] == greedy
    assert [e.completion for e in run_transformers(trained, temperature=1.0, top_p=1e-6)] == greedy
    sampled = [e.completion for e in run_transformers(trained, temperature=1.5, seed=1)]
    assert sampled != greedy


def test_turn_index_and_turn_limit(trained):
    tokenizer = trained[1]
    close = tokenizer.convert_tokens_to_ids("</calc>")
    episodes = run_transformers(trained, temperature=1.0, seed=2, prompts=prompts(4))
    with_tool = [e for e in episodes if e.tool_calls]
    assert with_tool
    for episode in episodes:
        assert len(episode.turns) == len(episode.token_ids) == len(episode.model_mask)
        prompt_len = len(tokenizer.encode(episode.prompt, add_special_tokens=False))
        assert episode.turns[:prompt_len] == [0] * prompt_len
        # each answered call closes a turn; its result belongs to it; the next model token opens
        # the next turn
        closes = [i for i, (t, m) in enumerate(zip(episode.token_ids, episode.model_mask))
                  if t == close and m]
        assert len(closes) >= episode.tool_calls
        for k, i in enumerate(closes[:episode.tool_calls]):
            assert episode.turns[i] == k + 1 and episode.turns[i + 1] == k + 1
        assert max(episode.turns) == episode.tool_calls + (1 if any(episode.model_mask) else 0)
    greedy = run_transformers(trained, prompts=prompts(1))
    assert any(e.tool_calls for e in greedy)
    limited = run_transformers(trained, prompts=prompts(1), max_turns=0)
    for before, after in zip(greedy, limited):
        if before.tool_calls:  # the same first turn, then the call is refused: finish "turns"
            assert after.finish == "turns" and after.tool_calls == 0
            assert after.completion.endswith("</calc>") and "<result>" not in after.completion
    assert all(e.finish in ("eos", "length", "turns") for e in limited)


def test_tool_close_found_in_text_when_it_is_not_one_token(trained):
    # "/calc>" is no token of the demo tokenizer; the decoded text ends with it after "</calc>"
    env = types.SimpleNamespace(TOOL_CLOSE="/calc>", on_tool_close=arith.on_tool_close,
                                MAX_TURNS=4)
    model, tokenizer, _ = trained
    assert transformers_backend.single_token(tokenizer, env.TOOL_CLOSE) is None
    fast = run_transformers(trained, temperature=1.0, seed=5)
    slow = transformers_backend.generate(model, tokenizer, env, prompts(), temperature=1.0, max_new_tokens=40,
                             seed=5, batch_size=64, progress=False)
    assert [e.completion for e in slow] == [e.completion for e in fast]
    assert [e.tool_calls for e in slow] == [e.tool_calls for e in fast]
    assert any(e.tool_calls for e in slow)


def test_stop_string_ends_the_episode(trained):
    episodes = run_transformers(trained, stop=("answer:",))
    stopped = [e for e in episodes if e.finish == "stop"]
    assert stopped
    for episode in stopped:
        assert episode.completion.endswith("answer:") and episode.completion.count("answer:") == 1


def test_openai_backend_matches_transformers_multi_turn(trained, serve):
    server = serve()
    local = run_transformers(trained)
    remote, stats = run_openai(trained, [server.url])
    assert any(e.tool_calls for e in remote), "the episodes must exercise tool calls"
    for a, b in zip(local, remote):
        assert (b.completion, b.token_ids, b.model_mask, b.finish, b.tool_calls, b.turns) == \
            (a.completion, a.token_ids, a.model_mask, a.finish, a.tool_calls, a.turns)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    for episode in remote:  # the environment's answer was injected after each answered call
        text, at = episode.completion, 0
        for _ in range(episode.tool_calls):
            at = text.index("</calc>", at) + len("</calc>")
            assert text[at:].startswith(arith.on_tool_close(text[:at]))
    # one request per model turn: one per answered call, plus the last unless the budget ran out
    calls, cut = sum(e.tool_calls for e in remote), sum(e.finish == "length" for e in remote)
    assert stats.requests == server.handler.posts
    assert len(remote) + calls - cut <= stats.requests <= len(remote) + calls
    assert stats.retries == 0


def test_openai_backend_sampling_is_seeded(trained, serve):
    server = serve()
    first, _ = run_openai(trained, [server.url], temperature=1.0, seed=3)
    again, _ = run_openai(trained, [server.url], temperature=1.0, seed=3, concurrency=3)
    other, _ = run_openai(trained, [server.url], temperature=1.0, seed=4)
    assert [e.completion for e in first] == [e.completion for e in again]
    assert [e.completion for e in first] != [e.completion for e in other]


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
    assert [e.completion for e in episodes] == [e.completion for e in clean]
    assert flaky.handler.keys == {"Bearer sk-test-123"}


def test_timeout_is_retried(trained, serve):
    def slow(self, n):
        if n == 1:
            time.sleep(1.5)
        return False

    server = serve(handler(slow))
    episodes, stats = run_openai(trained, [server.url], timeout=0.5, prompts=prompts(1)[:2])
    assert stats.retries >= 1 and len(episodes) == 2


def test_bad_request_fails_at_once_with_the_servers_message(trained, serve):
    server = serve()
    with pytest.raises(openai_backend.ServerError) as err:
        run_openai(trained, [server.url], max_new_tokens=200, concurrency=1, retries=5)
    assert "HTTP 400" in str(err.value) and "maximum context length" in str(err.value)
    assert server.url in str(err.value)
    assert server.handler.posts == 1  # not retried


def test_the_server_keeps_the_end_token_it_stopped_on_as_vllm_does(trained, serve):
    import httpx

    _, tokenizer, _ = trained
    server = serve()
    body = {"prompt": [tokenizer.bos_token_id] + tokenizer.encode(
        arith.prompt("5+6"), add_special_tokens=False), "max_tokens": 40, "temperature": 0.0,
        "logprobs": 1, "return_tokens_as_token_ids": True}

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
        run_openai(trained, [server.url], retries=2, concurrency=1, prompts=prompts(1)[:1])
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
    assert [e.completion for e in again] == [e.completion for e in episodes]
    assert stats.retries == broken.handler.posts > 0 and stats.by_url[broken.url] == 0


def _validated(path: Path) -> Path:
    rows = [{"trace_id": f"t{i}", "question": q, "answer": str(arith.gold_answer(q))}
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
    metrics = rollout.run(base, config, validated, folder, tmp_path / "rollouts.parquet")
    assert _servers_of(folder) == []
    table = pq.read_table(tmp_path / "rollouts.parquet").to_pylist()
    local = rollout.run(base, cfg.Rollout(samples_per_task=2, temperature=0.0, max_new_tokens=40,
                                          max_turns=4),
                        validated, folder, tmp_path / "local.parquet")
    expected = pq.read_table(tmp_path / "local.parquet").to_pylist()
    assert [r["completion"] for r in table] == [r["completion"] for r in expected]
    assert [r["token_ids"] for r in table] == [r["token_ids"] for r in expected]
    assert metrics["episodes"] == 16 and metrics["backend"] == "openai"
    assert metrics["generated_tokens"] == local["generated_tokens"]
    assert metrics["requests"] >= 16 and metrics["retries"] == 0

    failing = cfg.Rollout(backend="openai", server_command=command, max_new_tokens=200)
    with pytest.raises(openai_backend.ServerError, match="HTTP 400"):
        rollout.run(base, failing, validated, folder, tmp_path / "never.parquet")
    assert _servers_of(folder) == [] and not (tmp_path / "never.parquet").exists()


def test_a_server_command_that_dies_is_reported_with_its_output(tmp_path):
    command = f"{sys.executable} -c \"print('no GPU found'); raise SystemExit(3)\" {{port}}"
    with pytest.raises(openai_backend.ServerError, match="exited with code 3") as err:
        with openai_backend.serve(command, tmp_path, timeout=60):
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
    with openai_backend.serve(HEALTHY, tmp_path, timeout=60) as url:
        assert url.endswith("/v1")
    said = capsys.readouterr().err
    log = Path(re.search(r"\(log: (\S+)\)", said)[1])
    assert not log.exists() and "server stopped\n" in said
    with pytest.raises(RuntimeError, match="the rollout failed"):
        with openai_backend.serve(HEALTHY, tmp_path, timeout=60):
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


def test_progress_lines_on_stderr(trained, capsys):
    run_transformers(trained, progress=True, prompts=prompts(1))
    assert "generate: 8/8 episodes" in capsys.readouterr().err


def test_suite_tasks_join_the_trace_tasks(trained, tmp_path):
    _, _, folder = trained
    validated = _validated(tmp_path / "validated.parquet")
    suites = tmp_path / "tasks"
    suites.mkdir()
    (suites / "arith.jsonl").write_text(
        '{"task_id": "s2", "question": "2+2", "answer": "4"}\n'
        '{"task_id": "s1", "question": "9*9", "answer": 81}\n')
    config = cfg.Rollout(samples_per_task=1, temperature=0.0, max_new_tokens=40, suite_tasks=1)
    out = tmp_path / "rollouts.parquet"
    metrics = rollout.run(cfg.Base(), config, validated, folder, out, suites)
    rows = pq.read_table(out).to_pylist()
    assert metrics["tasks"] == len(QUESTIONS) + 1 and metrics["suite_tasks"] == 1
    assert [(r["trace_id"], r["question"], r["answer"]) for r in rows if
            r["trace_id"].startswith("suite:")] == [("suite:s1", "9*9", "81")]

    (suites / "arith.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"arith\.jsonl.*rollout\.suite_tasks"):
        rollout.run(cfg.Base(), config, validated, folder, out, suites)
