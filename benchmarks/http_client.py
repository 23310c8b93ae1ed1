"""Chat completions per second through offseason's HTTP client layer, a bare httpx client and the
official `openai` SDK, against one local OpenAI-compatible server.

The server (its own process, loopback, uvicorn on uvloop and httptools, as vLLM's API server runs)
answers every `POST /v1/chat/completions` with the same vLLM-style answer (a 48-token completion
with its `token_ids`, its per-token `logprobs` and the 200 `prompt_token_ids` of the request), at
once or after `--latency` seconds. The same N requests, `--concurrency` in flight, go through:

- (a) a bare `httpx.AsyncClient` loop (a semaphore, `post`, `.json()`): the baseline;
- (b) the SDK's `AsyncOpenAI.chat.completions.create`, vLLM's fields in `extra_body`, reading the
  ids and log-probs the rollout needs from the typed answer;
- (c) `stages.generation.openai_backend.Client.request`: the rollout's client, on `stages.http`'s
  client and retry policy (least-loaded URL, retries armed).

The three alternate for `--rounds` rounds, each round in another order (so none gets the warmer
machine); the best round of each is kept, for its requests per second and, apart, for the CPU time
the client process spent per request (steadier than a rate on a shared host).

    .venv/bin/python benchmarks/http_client.py --requests 2000 --concurrency 32
    .venv/bin/python benchmarks/http_client.py --requests 1000 --concurrency 32 --latency 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.generation import openai_backend  # noqa: E402

TOKENS = 48
PROMPT = list(range(1000, 1200))
ANSWER = json.dumps({
    "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "m",
    "prompt_token_ids": PROMPT,
    "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None,
                 "token_ids": list(range(2000, 2000 + TOKENS)),
                 "message": {"role": "assistant", "content": "word " * TOKENS,
                             "tool_calls": []},
                 "logprobs": {"content": [{"token": "word", "logprob": -0.25,
                                           "bytes": [119, 111, 114, 100], "top_logprobs": []}
                                          for _ in range(TOKENS)]}}],
    "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": TOKENS,
              "total_tokens": len(PROMPT) + TOKENS}}).encode()
MESSAGES = [{"role": "system", "content": "You are a careful assistant with a calculator tool."},
            {"role": "user", "content": "What is 12*34? Use the tool, then answer in a sentence."}]
SAMPLING = {"model": "m", "max_tokens": TOKENS, "temperature": 1.0, "top_p": 1.0, "n": 1,
            "seed": 7, "logprobs": True}
VLLM = {"return_token_ids": True, "stop_token_ids": [2, 3]}  # vLLM's own fields


def serve(port: int, latency: float) -> None:
    """Serve the canned answer on loopback until killed."""
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if latency:
            await asyncio.sleep(latency)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(ANSWER)).encode())]})
        await send({"type": "http.response.body", "body": ANSWER})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False)


async def bare(url: str, n: int, concurrency: int) -> float:
    """(a) A bare httpx.AsyncClient loop; requests per second."""
    import httpx

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=httpx.Limits(
            max_connections=concurrency, max_keepalive_connections=concurrency)) as client:
        async def one():
            async with limit:
                response = await client.post(f"{url}/chat/completions",
                                             json={**SAMPLING, **VLLM, "messages": MESSAGES})
            response.raise_for_status()
            choice = response.json()["choices"][0]
            return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]

        return await _timed(one, n)


async def sdk(url: str, n: int, concurrency: int) -> float:
    """(b) The openai SDK's AsyncOpenAI, vLLM's fields in extra_body; requests per second."""
    import httpx
    import openai

    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url, api_key="none", timeout=60, max_retries=5,
                                  http_client=httpx.AsyncClient(trust_env=False, limits=httpx.Limits(
                                      max_connections=concurrency,
                                      max_keepalive_connections=concurrency))) as client:
        async def one():
            async with limit:
                answer = await client.chat.completions.create(
                    messages=MESSAGES, extra_body=VLLM, **SAMPLING)
            choice = answer.choices[0]
            return choice.token_ids, [c.logprob for c in choice.logprobs.content]

        return await _timed(one, n)


async def layer(url: str, n: int, concurrency: int) -> float:
    """(c) The rollout's client on stages.http; requests per second."""
    client = openai_backend.Client([url], concurrency=concurrency, timeout=60, retries=5,
                                   backoff=0.5, api_key=None)

    async def one():
        choice = (await client.request("POST", "/chat/completions",
                                       {**SAMPLING, **VLLM, "messages": MESSAGES}))["choices"][0]
        return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]

    try:
        return await _timed(one, n)
    finally:
        await client.close()


async def _timed(one, n: int) -> float:
    started = time.perf_counter()
    done = await asyncio.gather(*(one() for _ in range(n)))
    assert all(len(ids) == len(lps) == TOKENS for ids, lps in done)
    return n / (time.perf_counter() - started)


def _wait_up(url: str) -> None:
    import httpx

    deadline = time.time() + 20
    while True:
        try:
            httpx.post(f"{url}/chat/completions", json={}, timeout=1, trust_env=False)
            return
        except httpx.HTTPError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def main() -> None:
    """Run the comparison and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per client per round")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--latency", type=float, default=0.0,
                        help="seconds the server takes per answer (a real model: 0.05 to 5)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best kept")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = multiprocessing.Process(target=serve, args=(port, args.latency), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}/v1"
    clients = {"(a) bare `httpx.AsyncClient` loop (baseline)": bare,
               "(b) `openai.AsyncOpenAI` (SDK), vLLM's fields in `extra_body`": sdk,
               "(c) `openai_backend.Client` on `stages.http`": layer}
    best, cpu = dict.fromkeys(clients, 0.0), dict.fromkeys(clients, float("inf"))
    names = list(clients)
    try:
        _wait_up(url)
        for run in clients.values():  # warm up: imports, connections, the server's first answers
            asyncio.run(run(url, args.concurrency * 2, args.concurrency))
        for turn in range(args.rounds):
            for name in names[turn % 3:] + names[:turn % 3]:
                started = time.process_time()
                rate = asyncio.run(clients[name](url, args.requests, args.concurrency))
                best[name] = max(best[name], rate)
                cpu[name] = min(cpu[name], (time.process_time() - started) / args.requests)
    finally:
        server.terminate()
    rate0, cpu0 = best[names[0]], cpu[names[0]]
    print(f"{args.requests} requests, {args.concurrency} in flight, server latency "
          f"{args.latency * 1000:g} ms, best of {args.rounds} rounds\n")
    print("| client | requests/s | vs bare | client CPU per request | vs bare |\n"
          "|---|---|---|---|---|")
    for name in names:
        print(f"| {name} | {best[name]:.0f} | {best[name] / rate0:.2f} | "
              f"{cpu[name] * 1000:.2f} ms | {cpu[name] / cpu0:.2f} |")


if __name__ == "__main__":
    main()
