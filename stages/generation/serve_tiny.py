"""A small OpenAI-compatible completions server for a local model folder, on CPU.

Serves the demo model (or any Hugging Face causal LM folder) through the transformers backend's
core, so `rollout.backend: openai` can be tried without vLLM. Reads the model folder; writes
nothing. Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions`, with vLLM's fields (`return_tokens_as_token_ids`, `stop_token_ids`,
`return_token_ids`, ...) and its `--tool-call-parser`. Binds 127.0.0.1 by default; there is no
authentication.

    python -m stages.generation.serve_tiny models/champion --port 8000     # then runtime.rollout.urls: http://127.0.0.1:8000/v1

Details: docs/gpus.md, "The tiny completions server (stages/generation/serve_tiny.py)".
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from stages import tinylm
from stages.generation import chat, tool_parsers, transformers_backend

MAX_BATCH = 256


class BadRequest(ValueError):
    """A request the server refuses with 400; the message says why."""

    pass


def _number(body: dict, key: str, default, kind=float, low=None, high=None):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not isinstance(value, int)):
        raise BadRequest(f"'{key}' must be a{'n integer' if kind is int else ' number'}, "
                         f"got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"'{key}' must be between {low} and {high}, got {value!r}")
    return kind(value)


class Engine:
    """The model behind a lock-free queue: one worker thread generates batches of requests."""

    def __init__(self, folder: Path, name: str, threads: int = 0, tool_parser: str | None = None):
        """Load the model in `folder` and start the worker that runs requests; `tool_parser`:
        how /v1/chat/completions reads tool calls (vLLM's `--tool-call-parser`).
        """
        if tool_parser is not None and tool_parser not in tool_parsers.PARSERS:
            raise ValueError(f"--tool-call-parser {tool_parser!r}: one of "
                             f"{', '.join(tool_parsers.PARSERS)}")
        self.tool_parser = tool_parser
        tinylm.set_threads(threads)
        self.model, self.tokenizer = tinylm.load(folder)
        self.name = name
        self.context = self.model.config.max_position_embeddings
        self.end_ids = chat.end_ids(self.model, self.tokenizer)  # vLLM stops on these too
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()

    def parse(self, body: dict) -> dict:
        """A completions request checked; BadRequest names the field."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in prompt):
            ids = prompt
            if any(not 0 <= t < self.model.config.vocab_size for t in ids):
                raise BadRequest("'prompt' has a token id outside the vocabulary")
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)")
        if not ids:
            raise BadRequest("'prompt' is empty")
        if body.get("n", 1) != 1:
            raise BadRequest("'n' must be 1")
        max_tokens = _number(body, "max_tokens", 16, int, 1)
        if len(ids) + max_tokens > self.context:
            raise BadRequest(
                f"This model's maximum context length is {self.context} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of strings")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise BadRequest(f"'seed' must be an integer, got {seed!r}")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool)
                and 0 <= t < self.model.config.vocab_size for t in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of token ids in the vocabulary")
        logprobs = body.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
            raise BadRequest(f"'logprobs' must be a non-negative integer, got {logprobs!r}")
        return {
            "ids": ids, "max_tokens": max_tokens, "stop": tuple(stop), "seed": seed,
            "ends": tuple(sorted(set(self.end_ids) | set(stop_ids))),
            "temperature": _number(body, "temperature", 1.0, float, 0.0, 100.0),
            "top_p": _number(body, "top_p", 1.0, float, 0.0, 1.0),
            "top_k": _number(body, "top_k", 0, int, -1),
            "logprobs": logprobs, "echo_stop": bool(body.get("include_stop_str_in_output")),
            "as_ids": bool(body.get("return_tokens_as_token_ids")),
        }

    def parse_chat(self, body: dict) -> dict:
        """A chat completions request rendered to a completions one, as vLLM renders it."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of message objects")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("'tools' must be a list of tool objects")
        choice = body.get("tool_choice", "auto" if tools else "none")
        if tools and choice == "auto" and self.tool_parser is None:
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and '
                             '--tool-call-parser to be set')
        # as vLLM does: the JSON-string arguments of earlier calls go to the template as objects
        rendered = chat._for_template(messages)
        try:
            text = self.tokenizer.apply_chat_template(rendered, tools=tools or None,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as err:  # noqa: BLE001 - the template's own complaint, as a 400
            raise BadRequest(f"the chat template could not render the messages: {err}") from None
        completion = {**body, "prompt": self.tokenizer.encode(text, add_special_tokens=False),
                      "max_tokens": body.get("max_completion_tokens", body.get("max_tokens", 16)),
                      "logprobs": 1 if body.get("logprobs") else None}
        request = self.parse(completion)
        request["chat"] = {"tools": bool(tools) and choice != "none",
                           "token_ids": bool(body.get("return_token_ids"))}
        return request

    def submit(self, request: dict) -> dict:
        """Queue a parsed request and wait for its response."""
        future: Future = Future()
        self.jobs.put((request, future))
        return future.result()

    def _work(self) -> None:
        while True:
            batch = [self.jobs.get()]
            time.sleep(0.002)  # let the requests sent together arrive
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            groups: dict[tuple, list] = {}
            for request, future in batch:
                key = (request["temperature"], request["top_p"], max(request["top_k"], 0),
                       request["stop"], request["ends"])
                groups.setdefault(key, []).append((request, future))
            for (temperature, top_p, top_k, stop, ends), jobs in groups.items():
                try:
                    # one turn each: an end token closes it and is kept, as vLLM keeps it
                    rows = transformers_backend.generate_ids(
                        self.model, self.tokenizer, [r["ids"] for r, _ in jobs],
                        temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                        on_turn_end=lambda row, ids: None, end_ids=ends,
                        max_new_tokens=[r["max_tokens"] for r, _ in jobs],
                        generator=[torch.Generator().manual_seed(
                            r["seed"] if r["seed"] is not None else int(time.time_ns() % 2**62))
                            for r, _ in jobs])
                except Exception as err:  # noqa: BLE001 - answered as a 500, the server goes on
                    for _, future in jobs:
                        future.set_exception(err)
                    continue
                for (request, future), row in zip(jobs, rows):
                    future.set_result(self._answer(request, row))

    def _answer(self, request: dict, row: transformers_backend.Row) -> dict:
        if "chat" in request:
            return self._answer_chat(request, row)
        tokenizer = self.tokenizer
        text = tokenizer.decode(row.token_ids, skip_special_tokens=True)
        if row.stop is not None and not request["echo_stop"]:
            text = text.removesuffix(row.stop)
        reason = row.stop
        if row.finish == "eos" and row.token_ids and row.token_ids[-1] != tokenizer.eos_token_id:
            reason = row.token_ids[-1]  # a stop token other than eos: vLLM names its id
        choice = {"index": 0, "text": text,
                  "finish_reason": "length" if row.finish == "length" else "stop",
                  "stop_reason": reason, "logprobs": None}
        if request["logprobs"] is not None:
            pieces = [tokenizer.decode([t]) for t in row.token_ids]
            tokens = [f"token_id:{t}" for t in row.token_ids] if request["as_ids"] else pieces
            offsets, at = [], 0
            for piece in pieces:
                offsets.append(at)
                at += len(piece)
            choice["logprobs"] = {
                "tokens": tokens, "token_logprobs": row.logprobs, "text_offset": offsets,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, row.logprobs)],
            }
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": len(request["ids"]),
                          "completion_tokens": len(row.token_ids),
                          "total_tokens": len(request["ids"]) + len(row.token_ids)}}


    def _answer_chat(self, request: dict, row: transformers_backend.Row) -> dict:
        tokenizer = self.tokenizer
        text = tokenizer.decode(row.token_ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": text, "tool_calls": []}
        finish = "length" if row.finish == "length" else "stop"
        if request["chat"]["tools"]:
            parsed = tool_parsers.parse(self.tool_parser, text)
            if parsed.tool_calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": parsed.tool_calls}
                finish = "tool_calls"
        reason = None
        if row.finish == "eos" and row.token_ids and row.token_ids[-1] != tokenizer.eos_token_id:
            reason = row.token_ids[-1]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                  "stop_reason": reason}
        if request["logprobs"] is not None:
            choice["logprobs"] = {"content": [
                {"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(row.token_ids, row.logprobs)]}
        answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                  "created": int(time.time()), "model": self.name, "choices": [choice],
                  "usage": {"prompt_tokens": len(request["ids"]),
                            "completion_tokens": len(row.token_ids),
                            "total_tokens": len(request["ids"]) + len(row.token_ids)}}
        if request["chat"]["token_ids"]:
            choice["token_ids"] = list(row.token_ids)
            answer["prompt_token_ids"] = list(request["ids"])
        return answer


class Handler(BaseHTTPRequestHandler):
    """The HTTP handler: /health, /v1/models and /v1/completions."""

    engine: Engine  # set on the subclass make_server builds
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - quiet; errors are answered, not printed
        """Print nothing per request."""
        pass

    def reply(self, status: int, body: dict, headers: dict | None = None) -> None:
        """Send a JSON response."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        """Send an OpenAI-style error response."""
        self.reply(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self):  # noqa: N802 - http.server's name
        """Answer /health and /v1/models."""
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [
                {"id": self.engine.name, "object": "model", "owned_by": "offseason",
                 "max_model_len": self.engine.context}]})
        else:
            self.error(404, f"no route {self.path}")

    def do_POST(self):  # noqa: N802
        """Answer a completion request."""
        self.complete(self.body())

    def body(self) -> bytes:
        """The request body."""
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def complete(self, raw: bytes) -> None:
        """Answer /v1/completions or /v1/chat/completions with the engine's completion, or an
        error.
        """
        parse = {"/v1/completions": self.engine.parse,
                 "/v1/chat/completions": self.engine.parse_chat}.get(self.path)
        if parse is None:
            self.error(404, f"no route {self.path}; this server has /v1/completions and "
                            f"/v1/chat/completions")
            return
        try:
            request = parse(json.loads(raw or b"null"))
        except (BadRequest, json.JSONDecodeError) as err:
            self.error(400, str(err))
            return
        try:
            answer = self.engine.submit(request)
        except Exception as err:  # noqa: BLE001
            self.error(500, f"generation failed: {type(err).__name__}: {err}", "server_error")
            return
        self.reply(200, answer)


class Server(ThreadingHTTPServer):
    """A threaded HTTP server that queues many connections at once."""

    daemon_threads = True
    request_queue_size = 1024  # the default 5 refuses connections when many requests arrive at once


def make_server(folder: Path, host: str = "127.0.0.1", port: int = 0, name: str = "",
                handler: type[Handler] = Handler, threads: int = 0,
                tool_parser: str | None = None) -> Server:
    """A server bound to host:port (0 = a free port; see `.server_address`), not yet serving."""
    engine = Engine(Path(folder), name or str(folder), threads, tool_parser)
    bound = type("BoundHandler", (handler,), {"engine": engine})
    return Server((host, port), bound)


def main(argv: list[str] | None = None) -> None:
    """Serve a model folder over HTTP until interrupted (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a Hugging Face model folder, e.g. models/champion")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="", help="the model's name in requests (default: the folder)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    parser.add_argument("--tool-call-parser", choices=sorted(tool_parsers.PARSERS), default=None,
                        help="how /v1/chat/completions reads tool calls, as vLLM's option "
                             "(with --enable-auto-tool-choice there)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command line; --tool-call-parser enables it")
    args = parser.parse_args(argv)
    server = make_server(args.model, args.host, args.port, args.name, threads=args.threads,
                         tool_parser=args.tool_call_parser)
    host, port = server.server_address[:2]
    print(f"serve_tiny: {args.model} at http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
