"""New weights into running model servers, verified: the one way weights reach a server.

Used by on-policy training (`train.grpo.steps` > 1: after every step, the policy's new weights
reach the servers that generate the next step's episodes) and by the fleet (a promoted
generation reaching the servers that answer users). Reads a model folder; writes nothing but
what it sends.

A `Replica` is one server: its OpenAI-compatible base URL, its `kind` (`vllm`, `sglang`) and how
a push reaches it (`mode`):
- `reload`: full weights from a folder on the server's own disk, through the server's API.
  vLLM (0.32): POST /pause?mode=wait (requests in flight finish first, new ones wait: none
  fails), /collective_rpc `offseason_reload` {weights_path} (vLLM's `reload_weights`, with tied
  weights kept tied: `stages.generation.vllm_worker`, which the server must be started with:
  `--worker-extension-cls stages.generation.vllm_worker.WeightSync`, VLLM_SERVER_DEV_MODE=1),
  /reset_prefix_cache (cached prefixes hold the old weights' keys and values),
  /update_weight_version, /resume. The update is not transactional: a replica that fails
  mid-push is verified, not trusted.
  SGLang: POST /update_weights_from_disk {model_path, weight_version}.
- `lora`: an adapter folder loaded under a new name, `<model>@<version>` (vLLM's
  /v1/load_lora_adapter, the server started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); the
  earlier adapters stay loaded, so going back is a change of name, not a load.
A `local` replica is the model object in this process (the transformers backend): nothing moves.

`verify` checks a push the two ways a server can be wrong: the version it reports (vLLM's
GET /weight_info) is the one pushed, and each probe prompt, answered greedily by the server, is
token for token the answer the pushed weights give here (`greedy_ids`). Admin calls carry a
bearer token from the environment variable the replica names (never from params).

Details: docs/training.md, "Weights into running servers (stages/weights.py)".
"""

from __future__ import annotations

import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from stages import http

KINDS = ("vllm", "sglang")
MODES = ("reload", "lora")


class PushFailed(RuntimeError):
    """A push or its verification failed on one replica; the message names it and what to do."""

    def __init__(self, replica: Replica, message: str):
        """The failure `message` on `replica`."""
        super().__init__(f"{replica.url}: {message}")
        self.replica = replica


@dataclass
class Replica:
    """One model server: `url` its OpenAI-compatible base (ending in /v1), `kind` vllm or sglang,
    `mode` reload or lora, `model` the name it serves, `token_env` the environment variable that
    holds its admin token ('' = none).
    """

    url: str
    kind: str = "vllm"
    mode: str = "reload"
    model: str = "policy"
    token_env: str = ""

    def __post_init__(self):
        """Refuse a kind or mode no push is written for."""
        if self.kind not in KINDS:
            raise ValueError(f"{self.url}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.mode not in MODES:
            raise ValueError(f"{self.url}: mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "lora" and self.kind != "vllm":
            raise ValueError(f"{self.url}: mode lora is written for vLLM's runtime adapters only")

    @property
    def root(self) -> str:
        """The server's root URL (its admin routes are not under /v1)."""
        parts = urllib.parse.urlsplit(self.url.rstrip("/"))
        path = parts.path[:-3] if parts.path.endswith("/v1") else parts.path
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))

    def served_name(self, version: str) -> str:
        """The model name requests must use to get `version` (an adapter's own name for lora)."""
        return f"{self.model}@{version}" if self.mode == "lora" else self.model

    def client(self, timeout: float = 120.0) -> httpx.Client:
        """An HTTP client with the replica's admin token."""
        token = os.environ.get(self.token_env) if self.token_env else None
        return http.client([self.url], timeout=timeout, api_key=token)


@dataclass
class Pushed:
    """One replica's push: how long it took (seconds: the server's update, then verification)."""

    replica: Replica
    version: str
    update_seconds: float
    verify_seconds: float


def _post(client: httpx.Client, replica: Replica, path: str, what: str, **kwargs) -> dict:
    try:
        response = http.checked(client.post(f"{replica.root}{path}", **kwargs))
    except http.Failed as err:
        raise PushFailed(replica, f"{what} failed: {err}") from err
    except httpx.HTTPError as err:
        raise PushFailed(replica, f"{what}: no answer ({http.describe(err)}); is the server "
                                  f"up, and started with VLLM_SERVER_DEV_MODE=1 (its admin "
                                  f"routes)?") from err
    try:
        return response.json()
    except ValueError:
        return {}


def push(replica: Replica, folder: Path, version: str) -> float:
    """Put the weights of `folder` (a model folder for reload, an adapter folder for lora, on a
    disk the server reads) on `replica` as `version`; returns the seconds it took. Raises
    PushFailed naming the step that failed; the replica is then in an unknown state: verify it,
    or push its previous version again.
    """
    started = time.monotonic()
    path = str(Path(folder).resolve())
    with replica.client() as client:
        if replica.mode == "lora":
            _post(client, replica, "/v1/load_lora_adapter", "loading the adapter",
                  json={"lora_name": replica.served_name(version), "lora_path": path})
        elif replica.kind == "sglang":
            _post(client, replica, "/update_weights_from_disk", "the weight update",
                  json={"model_path": path, "weight_version": version})
        else:
            # a push killed between its pause and its resume left the server holding requests:
            # this one finishes it (resuming a server that is not paused changes nothing)
            _post(client, replica, "/resume", "resuming generation")
            # drain, not abort: requests in flight finish on the old weights; new ones wait
            _post(client, replica, "/pause", "pausing generation",
                  params={"mode": "wait"})
            try:
                said = _post(client, replica, "/collective_rpc", "reloading the weights",
                             json={"method": "offseason_reload", "kwargs": {"weights_path": path}})
                failed = [r for r in said.get("results", []) if not str(r).startswith("ok")]
                if failed or not said.get("results"):
                    raise PushFailed(replica, f"reloading the weights of {path}: "
                                              f"{failed[0] if failed else said}")
                _post(client, replica, "/reset_prefix_cache", "resetting the prefix cache")
                _post(client, replica, "/update_weight_version", "setting the weight version",
                      json={"new_version": version})
            finally:  # a failed update must not leave the replica refusing traffic
                _post(client, replica, "/resume", "resuming generation")
    return time.monotonic() - started


def paused(replica: Replica) -> bool | None:
    """Whether the server holds new requests (vLLM's GET /is_paused): a push cut off between
    its pause and its resume leaves it so; None where the server cannot say (SGLang, older
    vLLM). `push` resumes it first.
    """
    if replica.kind != "vllm":
        return None
    with replica.client(timeout=30.0) as client:
        try:
            return bool(http.checked(client.get(f"{replica.root}/is_paused")).json()
                        .get("is_paused"))
        except (http.Failed, httpx.HTTPError, ValueError):
            return None


def reported_version(replica: Replica) -> str | None:
    """The weight version the server says it serves (vLLM's /weight_info; SGLang's
    /get_weight_version); for lora, the pushed adapter's name among /v1/models, or None.
    """
    with replica.client(timeout=30.0) as client:
        try:
            if replica.mode == "lora":
                names = [m["id"] for m in http.checked(client.get(
                    f"{replica.url.rstrip('/')}/models")).json().get("data", [])]
                return ",".join(n.split("@", 1)[1] for n in names if "@" in n) or None
            path = "/weight_info" if replica.kind == "vllm" else "/get_weight_version"
            return http.checked(client.get(f"{replica.root}{path}")).json().get("weight_version")
        except (http.Failed, httpx.HTTPError, ValueError) as err:
            raise PushFailed(replica, f"asking its weight version: {err}") from err


def response_name(replica: Replica) -> str:
    """The model name the replica's answers carry (`model` in OpenAI responses and logs,
    `gen_ai.response.model` in OTel spans): vLLM answers every request with the first name it
    serves (`--served-model-name`, the first of GET /v1/models), whichever name the request
    used. A replica started with a name of its own first (`--served-model-name policy-a policy`)
    is told apart in the traces while agents keep calling `policy`.
    """
    with replica.client(timeout=30.0) as client:
        try:
            names = [m["id"] for m in http.checked(client.get(
                f"{replica.url.rstrip('/')}/models")).json().get("data", [])]
        except (http.Failed, httpx.HTTPError, KeyError, ValueError) as err:
            raise PushFailed(replica, f"asking the names it serves: {err}") from err
    if not names:
        raise PushFailed(replica, "serves no model (GET /v1/models lists none)")
    return names[0]


def served_greedy(replica: Replica, version: str, prompt: list[int], max_tokens: int
                  ) -> list[int]:
    """The token ids `replica` answers `prompt` (token ids) with, greedily (no end token)."""
    payload = {"model": replica.served_name(version), "prompt": prompt, "max_tokens": max_tokens,
               "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
               "skip_special_tokens": False}
    with replica.client() as client:
        try:
            choice = http.checked(client.post(f"{replica.url.rstrip('/')}/completions",
                                              json=payload)).json()["choices"][0]
        except (http.Failed, httpx.HTTPError, KeyError, ValueError) as err:
            raise PushFailed(replica, f"the probe request failed: {err}") from err
    ids = choice.get("token_ids")
    if ids is None:
        raise PushFailed(replica, "the server returns no token ids (vLLM 0.10.2 or later returns "
                                  "them with return_token_ids)")
    return list(ids)


def greedy_ids(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What `model` (a transformers causal LM, the weights being pushed) answers each prompt with,
    greedily, for exactly `max_tokens` tokens: what a verified server must answer.
    """
    import torch

    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=0)
            answers.append(out[0, len(prompt):].tolist())
    return answers


def verify(replica: Replica, version: str, prompts: list[list[int]],
           expected: list[list[int]]) -> float:
    """Check that `replica` serves `version`: the version it reports, and each probe prompt
    answered greedily token for token as `expected` (`greedy_ids` of the pushed weights).
    Returns the seconds it took; raises PushFailed naming the first difference.
    """
    started = time.monotonic()
    reported = reported_version(replica)
    if replica.mode == "lora":
        if version not in (reported or "").split(","):
            raise PushFailed(replica, f"adapter {replica.served_name(version)} is not among "
                                      f"the models it serves")
    elif reported != version:
        raise PushFailed(replica, f"reports weight version {reported!r}, not {version!r}: the "
                                  f"update did not take; push again or restart it")
    for n, (prompt, want) in enumerate(zip(prompts, expected)):
        got = served_greedy(replica, version, prompt, len(want))
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                      min(len(got), len(want)))
            raise PushFailed(replica, f"probe {n} answered differently from the pushed weights "
                                      f"from token {at} on (server {got[at:at + 5]}, expected "
                                      f"{want[at:at + 5]}): it is not serving them")
    return time.monotonic() - started


def push_verified(replicas: list[Replica], folder: Path, version: str, model,
                  prompts: list[list[int]], max_tokens: int = 8,
                  on_each: Callable[[Pushed], None] | None = None) -> list[Pushed]:
    """Push `folder` as `version` to every replica, one at a time, verifying each against
    `model` (the same weights, loaded here); the first failure stops the push, named, with the
    replicas already done listed in the error. `on_each(pushed)` is called as each replica is
    verified (the fleet records it at once: a push killed midway leaves its state true).
    """
    expected = greedy_ids(model, prompts, max_tokens)
    done = []
    for replica in replicas:
        try:
            seconds = push(replica, folder, version)
            done.append(Pushed(replica, version, seconds,
                               verify(replica, version, prompts, expected)))
            if on_each is not None:
                on_each(done[-1])
        except PushFailed as err:
            ok = ", ".join(p.replica.url for p in done) or "none"
            raise PushFailed(replica, f"{str(err).split(': ', 1)[1]} (version {version}; "
                                      f"replicas already on it: {ok})") from err
    return done
