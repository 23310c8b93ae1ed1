"""The openai generation backend: chat episodes from OpenAI-compatible completion servers.

Any server with the completions API works (vLLM, SGLang, TGI, `stages.generation.serve_tiny`):
`chat_rollout` plays token in, token out over `/completions`, one request per model turn, the
conversation rendered here by `stages.generation.chat`; with `runtime.rollout.api: chat` each turn
is a `/chat/completions` request whose rendering and tool calls are checked against ours. Requests
are async on `stages.http`'s client and retry policy, to the least-loaded URL; a URL that dies
(refused, cut off) or, among several, answers nothing for `stall_seconds` is left out for
DOWN_SECONDS and its requests in flight go to the others. `serve(command,
...)` starts a server (`runtime.rollout.server_command`) and always stops it. Reads an API key
from the named environment variable (never logged); writes no file.

Details: docs/gpus.md, "How the openai backend works (stages/generation/openai_backend.py)".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stages import http
from stages.generation.episode import Progress
from stages.servers import ServerError, serve

# a URL found dead is left out this long, then tried again (a server restarted comes back)
DOWN_SECONDS = 30.0


@dataclass
class Stats:
    """What a rollout's requests did: answered, retried, and per URL."""

    requests: int = 0  # completion requests answered
    retries: int = 0
    by_url: dict[str, int] = field(default_factory=dict)  # successful requests per URL
    # what the servers say they processed (their `usage`): what a billing server charges for,
    # every turn's prompt included (a multi-turn episode sends its conversation each turn)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lost: dict[str, str] = field(default_factory=dict)  # URLs left out mid-run, and why


class Pool:
    """The URLs and their requests in flight: the next request goes to the least loaded of
    those not left out (`leave_out`: a server that died or stalled mid-run).
    """

    def __init__(self, urls: list[str]):
        """A pool of the server URLs, none in flight, none left out."""
        self.urls = [u.rstrip("/") for u in urls]
        self.inflight = dict.fromkeys(self.urls, 0)
        self.turn = 0
        self.out_until = dict.fromkeys(self.urls, 0.0)  # monotonic time a URL is left out until

    def leave_out(self, url: str, seconds: float = DOWN_SECONDS) -> None:
        """No new request goes to `url` for `seconds` while another URL is in."""
        self.out_until[url] = time.monotonic() + seconds

    def acquire(self, avoid: str | None = None) -> str:
        """The least-loaded URL, ties in turn, of those not left out (all of them when every one
        is: the request is tried and fails as it would); not `avoid` (the one that just failed)
        if possible.
        """
        n = len(self.urls)
        order = [self.urls[(self.turn + k) % n] for k in range(n)]
        now = time.monotonic()
        order = [u for u in order if self.out_until[u] <= now] or order
        order = [u for u in order if u != avoid] or order
        url = min(order, key=self.inflight.__getitem__)
        self.turn = (self.urls.index(url) + 1) % n
        self.inflight[url] += 1
        return url

    def release(self, url: str) -> None:
        """Mark a request to `url` finished."""
        self.inflight[url] -= 1


def split_urls(text: str) -> list[str]:
    """The URLs of a comma- or whitespace-separated list."""
    return [u for u in text.replace(",", " ").split() if u]


class Client:
    """An async client of OpenAI-compatible completion servers, with `stages.http`'s retries."""

    def __init__(self, urls: list[str], *, concurrency: int, timeout: float, retries: int,
                 backoff: float, api_key: str | None, stall: float | None = None):
        """A client of `urls` with at most `concurrency` requests in flight; `stall`: among
        several URLs, one that answers nothing for that long while another answers is left out
        and its requests go elsewhere (one URL alone: `_watched` fails the stage instead).
        """
        self.pool = Pool(urls)
        self.stall = stall if stall and len(self.pool.urls) > 1 else None
        self.answered = dict.fromkeys(self.pool.urls, time.monotonic())  # per URL, the last answer
        self.limit = asyncio.Semaphore(concurrency)
        self.http = http.async_client(self.pool.urls, timeout=timeout, api_key=api_key,
                                      concurrency=concurrency)
        self.retries, self.backoff = retries, backoff
        self.stats = Stats(by_url=dict.fromkeys(self.pool.urls, 0))
        self.progress = time.monotonic()  # when a request last finished (the stall watch's)

    async def request(self, method: str, path: str, payload: dict | None = None,
                      url: str | None = None) -> dict:
        """JSON of a successful answer; retries what may pass, raises ServerError otherwise."""
        tried: list[str] = []
        try:
            async for attempt in http.retrying_async(self.retries, self.backoff, self._retried):
                with attempt:
                    return await self._once(method, path, payload, url, tried)
        except http.Rejected as err:
            raise ServerError(f"{method} {tried[-1]}{path} answered HTTP {err.status} (a request "
                              f"error; not retried): {err.message}") from None
        except (http.Transient, *http.NETWORK_ERRORS) as err:
            servers = ", ".join(dict.fromkeys(tried))
            raise ServerError(
                f"{method} {tried[-1]}{path} failed after {len(tried)} attempts (servers tried: "
                f"{servers}); last error: {http.describe(err)}. Check that the server is up and "
                f"healthy (runtime.rollout.urls or runtime.rollout.server_command in "
                f"params.yaml)") from None

    async def _once(self, method: str, path: str, payload: dict | None, url: str | None,
                    tried: list[str]) -> dict:
        """One attempt, on `url` or the least-loaded URL (not the one that just failed)."""
        async with self.limit:
            base = url or self.pool.acquire(avoid=tried[-1] if tried else None)
            tried.append(base)
            try:
                response = http.checked(await self._sent(method, base, path, payload))
            except http.GONE as err:
                self._lose(base, f"{type(err).__name__}: {err}".rstrip(": "))
                raise
            finally:
                if url is None:
                    self.pool.release(base)
        answer = response.json()
        self.progress = self.answered[base] = time.monotonic()
        if method == "POST":  # completions; not the GET /models lookup
            self.stats.requests += 1
            self.stats.by_url[base] = self.stats.by_url.get(base, 0) + 1
            usage = answer.get("usage") or {} if isinstance(answer, dict) else {}
            self.stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        return answer

    async def _sent(self, method: str, base: str, path: str, payload: dict | None):
        """The answer to one request; with a stall bound among several URLs, a Transient error
        once `base` has answered nothing (this request included) for `stall` seconds while
        another URL did: the request goes to another URL, and `base` is left out.
        """
        sent = self.http.request(method, base + path, json=payload)
        if not self.stall:
            return await sent
        task, since = asyncio.ensure_future(sent), time.monotonic()
        while True:
            done, _ = await asyncio.wait({task}, timeout=min(1.0, self.stall / 4))
            if done:
                return task.result()
            now = time.monotonic()
            quiet = now - max(self.answered[base], since)
            others = any(now - self.answered[u] < quiet for u in self.pool.urls if u != base)
            if quiet > self.stall and others:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                why = (f"answered nothing for {quiet:.0f} s while the others answered "
                       f"(runtime.rollout.stall_seconds={self.stall:g})")
                self._lose(base, why)
                raise http.Transient(why)

    def _lose(self, url: str, why: str) -> None:
        """Leave `url` out (a server gone or stalled); said once per URL on stderr."""
        self.pool.leave_out(url)
        if url not in self.stats.lost:
            self.stats.lost[url] = why
            others = [u for u in self.pool.urls if u != url]
            if others:
                print(f"rollout: {url} left out for {DOWN_SECONDS:g} s ({why}); its requests go "
                      f"to {', '.join(others)}", file=sys.stderr, flush=True)

    def _retried(self, state) -> None:
        self.stats.retries += 1

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self.http.aclose()


def _token_ids(tokens: list[str]) -> list[int] | None:
    """Ids from the "token_id:N" strings of vLLM's `return_tokens_as_token_ids`; None otherwise."""
    ids = []
    for token in tokens:
        if not token.startswith("token_id:"):
            return None
        ids.append(int(token.removeprefix("token_id:")))
    return ids


async def _watched(work, client: Client, stall: float | None):
    """`work`'s result, unless no request finishes for `stall` seconds: then it is cancelled
    and ServerError names the servers (runtime.rollout.stall_seconds). A server that stops
    answering mid-run otherwise holds the stage for every request's timeout times its attempts.
    """
    task = asyncio.ensure_future(work)
    if not stall:
        return await task
    client.progress = time.monotonic()
    while True:
        done, _ = await asyncio.wait({task}, timeout=min(1.0, stall / 4))
        if done:
            return task.result()
        quiet = time.monotonic() - client.progress
        if quiet > stall:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ServerError(
                f"no answer from {', '.join(client.pool.urls)} for {quiet:.0f} s (no request "
                f"finished; runtime.rollout.stall_seconds={stall:g}): the server is up but "
                f"wedged, or overloaded. Restart it (or raise stall_seconds for a server that is "
                f"slow, not stuck) and run the stage again")


async def _all_or_none(coroutines: list) -> list:
    """Every episode's result, in order; when one fails the others are cancelled (no request is
    left running behind the error) and the error is raised.
    """
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _chat_turn(client: Client, play, index: int, so_far: list[int],
                     payload: dict) -> tuple[list[int], list[float], str]:
    """One model turn through `/chat/completions`: (the ids the model chose, their log-probs,
    the finish reason), after checking the server rendered `so_far` and parses calls as we do.
    """
    import json

    from stages.generation import tool_parsers

    template = play.templates[index]
    payload = {**payload, "messages": play.as_written(index), "logprobs": True,
               "return_token_ids": True}
    if template.tools:
        payload.update(tools=template.tools, tool_choice="auto")
    answer = await client.request("POST", "/chat/completions", payload)
    choice = answer["choices"][0]
    rendered, got = answer.get("prompt_token_ids"), choice.get("token_ids")
    if rendered is None or got is None:
        raise ServerError("the server sent no token ids for a chat completion: "
                          "runtime.rollout.api: chat needs vLLM's `return_token_ids` (vLLM 0.10.2 "
                          "or later); use api: completions with older servers")
    task = play.tasks[index]["task_id"]
    if rendered != so_far:
        at = next((i for i, (a, b) in enumerate(zip(rendered, so_far)) if a != b),
                  min(len(rendered), len(so_far)))
        tokenizer = template.tokenizer
        raise ServerError(
            f"task {task}: the server rendered the conversation to other token ids than the "
            f"episode's own, from token {at} ({tokenizer.decode(so_far[at:at + 12])!r} here, "
            f"{tokenizer.decode(rendered[at:at + 12])!r} there): its chat template differs from "
            f"the champion's, or re-renders earlier turns, or the model's own tokens do not "
            f"re-tokenize to themselves; training on that rendering would train on tokens the "
            f"model never chose. Serve the champion's own template, or use "
            f"runtime.rollout.api: completions (token ids in and out)")
    lps = [float(c["logprob"]) for c in (choice.get("logprobs") or {}).get("content") or []]
    if len(lps) != len(got):
        raise ServerError(f"task {task}: the server sent {len(lps)} log-probs for "
                          f"{len(got)} tokens; ask it for `logprobs` on every token")
    served = []
    for call in choice["message"].get("tool_calls") or []:
        try:
            served.append((call["function"]["name"],
                           json.loads(call["function"]["arguments"] or "{}")))
        except json.JSONDecodeError:
            # the server's parser passed on arguments that are not JSON (vLLM's Mistral parser
            # on a call the model left unclosed): its reading of this turn cannot be compared;
            # the ids are the model's, and `play.on_turn_end` reads them with rollout.tool_parser
            # (a malformed call answered as a tool error, as any the model makes)
            play.episodes[index].bad_arguments += 1
            served = None
            break
    if served:
        text = template.strip_end(template.tokenizer.decode(got, skip_special_tokens=False))
        ours = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in tool_parsers.parse(play.parser, text).tool_calls]
        if served != ours:
            raise ServerError(f"task {task}: the server read the tool calls {served} where "
                              f"rollout.tool_parser ({play.parser}) reads {ours}: start the "
                              f"server with --tool-call-parser {play.parser}")
    return got, lps, choice.get("finish_reason") or ""


async def _chat_episode(client: Client, model: str, play, index: int, prompt: list[int], *,
                        sampling: dict, max_new_tokens: int, context: int, ends: tuple[int, ...],
                        eos: int, seed: int, api: str = "completions"):
    """One chat episode (`stages.generation.chat`), one `/completions` request per model turn:
    the conversation so far goes as token ids, the turn comes back as token ids and is parsed,
    answered and extended with the template's ids here, exactly as the transformers backend does.
    """
    from stages.generation import chat

    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    closes: list[int] = []
    finish = "length"
    for turn in range(1 << 16):
        budget = min(max_new_tokens, context - len(prompt) - len(ids))
        if budget <= 0:
            break
        common = {"model": model, "max_tokens": budget, "stop_token_ids": list(ends), "n": 1,
                  "seed": (seed * 1_000_003 + turn) % 2 ** 31, **sampling}
        if api == "chat":
            got, lps, finish_reason = await _chat_turn(client, play, index, prompt + ids, common)
            stopped = finish_reason in ("stop", "tool_calls")
            choice = {}
        else:
            payload = {**common, "prompt": prompt + ids, "logprobs": 1,
                       "return_tokens_as_token_ids": True}
            choice = (await client.request("POST", "/completions", payload))["choices"][0]
            lps = [float(lp) for lp in (choice.get("logprobs") or {}).get("token_logprobs") or []]
            got = _token_ids((choice.get("logprobs") or {}).get("tokens") or [])
            if got is None or len(got) != len(lps):
                raise ServerError("the server sent no token ids for a completion: the chat path "
                                  "trains on the ids the model produced, so it needs vLLM's "
                                  "`return_tokens_as_token_ids` with `logprobs` (vLLM and "
                                  "stages.generation.serve_tiny have it)")
            stopped = choice.get("finish_reason") == "stop"
        if stopped and (not got or got[-1] not in ends):
            # a server that leaves out the end token it stopped on: the model did choose it (its
            # log-prob is unknown here, recorded as 0)
            reason = choice.get("stop_reason")
            got, lps = got + [reason if reason in ends else eos], lps + [0.0]
        ids += got
        mask += [1] * len(got)
        logprobs += lps
        if not stopped:  # cut off mid-turn
            break
        answer = play.on_turn_end(index, got)
        if answer is None or isinstance(answer, str):
            finish = answer or "eos"
            break
        if len(prompt) + len(ids) + len(answer) >= context:  # no room left for the next turn
            break
        closes.append(len(ids) - 1)
        ids += answer
        mask += [0] * len(answer)
        logprobs += [0.0] * len(answer)
    return chat.settle(play, index, prompt, ids, mask, logprobs, finish, closes)


async def _chat(play, prompts: list[list[int] | None], seeds: list[int], *, urls: list[str], model: str,
                sampling: dict, max_new_tokens: int, context: int, ends: tuple[int, ...],
                eos: int, concurrency: int, timeout: float, retries: int, backoff: float,
                api_key: str | None, progress: bool, api: str = "completions",
                stall: float | None = None):
    client = Client(urls, concurrency=concurrency, timeout=timeout, retries=retries,
                    backoff=backoff, api_key=api_key, stall=stall)
    bar = Progress(len(prompts), "rollout (openai)", progress)
    try:
        if not model:
            model = (await client.request("GET", "/models", url=client.pool.urls[0]))["data"][0]["id"]
        done = 0

        async def one(index: int):
            nonlocal done
            if prompts[index] is None:  # not playable: ended by `play.prompts`, said there
                return play.episodes[index]
            episode = await _chat_episode(
                client, model, play, index, prompts[index], sampling=sampling,
                max_new_tokens=max_new_tokens, context=context, ends=ends, eos=eos,
                seed=seeds[index], api=api)
            done += 1
            bar.update(done)
            return episode

        episodes = await _watched(_all_or_none([one(i) for i in range(len(prompts))]), client,
                                  stall)
    finally:
        bar.close()
        await client.close()
    return list(episodes), client.stats


def chat_rollout(tokenizer, env, tasks: list[dict], seeds: list[int], *, urls: list[str],
                 parser: str, max_turns: int, context: int, ends: tuple[int, ...],
                 template=None, model: str = "", temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, max_new_tokens: int = 48, concurrency: int = 64,
                 timeout: float = 60.0, retries: int = 5, backoff: float = 0.5,
                 api_key: str | None = None, progress: bool = True, api: str = "completions",
                 stall: float | None = None):
    """One chat episode per task (`stages.generation.chat.ChatEpisode`), from the servers at `urls`;
    and the stats. The same episodes as `chat.rollout` gives in this process: the prompt and every
    tool result are rendered here with `tokenizer`'s chat template (the served model's), the
    model's tokens are the ids the server chose (vLLM's `return_tokens_as_token_ids`), its tool
    calls are parsed here by `parser`; nothing is re-tokenized. `seeds`: one per episode (each
    turn's request gets its own from it); `context`: the model's context length;
    `ends`: the ids that end a turn (sent as vLLM's `stop_token_ids`); `api`: "completions"
    (token ids in and out) or "chat" (`/chat/completions`, checked against ours; module docstring);
    `stall`: seconds without any request finishing before it fails (`_watched`).
    """
    from stages.generation import chat, tool_parsers

    if parser not in tool_parsers.PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}: one of "
                         f"{', '.join(tool_parsers.PARSERS)}")
    if not urls:
        raise ValueError("no server URL given (runtime.rollout.urls, or runtime.rollout.server_command)")
    template = template or chat.Template.of(tokenizer, list(env.tools), ends)
    play = chat._Play(template, env, tasks, parser, max_turns)
    prompts = play.prompts(context)  # None: a task that cannot be played, its episode ended
    sampling = {"temperature": temperature, "top_p": top_p}
    if top_k:
        sampling["top_k"] = top_k
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else ends[0]
    episodes, stats = asyncio.run(_chat(
        play, prompts, seeds, urls=urls, model=model, sampling=sampling,
        max_new_tokens=max_new_tokens, context=context, ends=ends, eos=eos,
        concurrency=concurrency, timeout=timeout, retries=retries, backoff=backoff,
        api_key=api_key, progress=progress, api=api, stall=stall))
    return chat.episodes_checked(episodes), stats


def servers(config, champion: Path, stack: contextlib.ExitStack) -> list[str]:
    """The base URLs to send a rollout's requests to: `runtime.rollout.urls`, each probed first
    (`GET {url}/models` within `stages.remote`'s deadline: a server that is down or never answers
    fails the stage in seconds, naming it, instead of after every request's retries), or one
    server started with `runtime.rollout.server_command` on `champion`, stopped when `stack` closes.
    """
    from stages import remote

    if config.url_list:
        for url in config.url_list:
            remote.probe(f"{url.rstrip('/')}/models", setting="runtime.rollout.urls", value=url,
                         fix="start that server, fix the URL (a base URL ending in /v1), or set "
                             "runtime.rollout.server_command to let the stage start one")
        return config.url_list
    return [stack.enter_context(serve(config.server_command, champion,
                                      timeout=config.server_timeout))]


def api_key_from(variable: str) -> str | None:
    """The API key from the environment variable `variable` (never from params, never logged)."""
    return os.environ.get(variable) or None
