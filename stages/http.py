"""One client layer and one retry policy for every remote call over HTTP.

Used by the rollout's openai backend (`stages.generation.openai_backend`, async, OpenAI-compatible
servers), the LLM judge (`stages.envs.judge`, from the reward stage's threads) and the webhook
notifications (`flows.project.notify`). Reads and writes nothing.

Retried: connection failures, timeouts, 429 and 5xx (`Transient`); not retried: any other status
(`Rejected`). Waits are exponential with jitter, at least the server's `Retry-After`, capped at
MAX_WAIT_S; attempts are 1 + the caller's `retries` setting. `client` and `async_client` build
the httpx clients.

Details: docs/gpus.md, "One HTTP client and retry policy (stages/http.py)".
"""

from __future__ import annotations

import email.utils
import time
import urllib.parse

import httpx
import tenacity

MAX_WAIT_S = 30.0
# no answer, or an answer cut off: the server may be restarting or overloaded
NETWORK_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
# of those, the ones that say the server is gone rather than slow: refused, reset, cut off
# mid-answer (a timeout may be a long answer: the callers' stall watches judge those)
GONE = (httpx.NetworkError, httpx.RemoteProtocolError)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class Failed(Exception):
    """A request that got no usable answer: `status` (the HTTP status, None when none came),
    `message` (the server's own error message, or what went wrong) and `wait` (the seconds its
    Retry-After asked for, 0 when none).
    """

    def __init__(self, message: str, status: int | None = None, wait: float = 0.0):
        """The failure, as `describe` words it."""
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.message, self.status, self.wait = message, status, wait


class Transient(Failed):
    """A failure that may pass when the request is sent again (429, 5xx, or the caller's own)."""


class Rejected(Failed):
    """The server refused the request itself (a 4xx other than 429): never retried."""


def checked(response: httpx.Response) -> httpx.Response:
    """`response` when its status is 2xx; raises Transient (429, 5xx) or Rejected (the rest)."""
    status = response.status_code
    if 200 <= status < 300:
        return response
    if status == 429 or status >= 500:
        raise Transient(message_of(response), status, retry_after(response))
    raise Rejected(message_of(response), status)


def describe(err: BaseException) -> str:
    """A failure in one line: "HTTP 503: overloaded", "ConnectError: ...", the caller's message."""
    return str(err) if isinstance(err, Failed) else f"{type(err).__name__}: {err}"


def message_of(response: httpx.Response) -> str:
    """The error message of an answer: OpenAI's `{"error": {"message"}}`, else its text (500
    characters at most).
    """
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    text = error.get("message", error) if isinstance(error, dict) else error
    return str(text)[:500]


def retry_after(response: httpx.Response) -> float:
    """Seconds the answer's Retry-After asks to wait (seconds or an HTTP date); 0 when none."""
    value = response.headers.get("retry-after", "").strip()
    try:
        return max(0.0, float(value or 0))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return 0.0


class _Wait(tenacity.wait.wait_base):
    """Exponential with jitter, at least the server's Retry-After; at most MAX_WAIT_S."""

    def __init__(self, backoff: float):
        self.exponential = tenacity.wait_exponential_jitter(
            initial=backoff, jitter=backoff, max=MAX_WAIT_S)

    def __call__(self, state: tenacity.RetryCallState) -> float:
        err = state.outcome.exception()
        asked = err.wait if isinstance(err, Failed) else 0.0
        return min(MAX_WAIT_S, max(self.exponential(state), asked))


def _policy(retries: int, backoff: float, on_retry) -> dict:
    return {"stop": tenacity.stop_after_attempt(retries + 1), "wait": _Wait(backoff),
            "retry": tenacity.retry_if_exception_type((Transient, *NETWORK_ERRORS)),
            "before_sleep": on_retry, "reraise": True}


def retrying(retries: int, backoff: float = 0.5, on_retry=None) -> tenacity.Retrying:
    """The policy for a blocking call, used as `for attempt in ...: with attempt: ...`.
    `on_retry(state)` is called before each wait (to count retries); after the last attempt its
    error is raised as it is.
    """
    return tenacity.Retrying(**_policy(retries, backoff, on_retry))


def retrying_async(retries: int, backoff: float = 0.5, on_retry=None) -> tenacity.AsyncRetrying:
    """The same policy for a coroutine, used as `async for attempt in ...: with attempt: ...`."""
    return tenacity.AsyncRetrying(**_policy(retries, backoff, on_retry))


def _trust_env(urls: list[str]) -> bool:
    return not all(urllib.parse.urlsplit(u).hostname in LOOPBACK for u in urls)


def _options(urls: list[str], timeout: float, api_key: str | None, concurrency: int) -> dict:
    return {"timeout": timeout, "trust_env": _trust_env(urls),
            "headers": {"Authorization": f"Bearer {api_key}"} if api_key else {},
            "limits": httpx.Limits(max_connections=concurrency,
                                   max_keepalive_connections=concurrency)}


def client(urls: list[str], *, timeout: float, api_key: str | None = None,
           concurrency: int = 8) -> httpx.Client:
    """A blocking client of the servers at `urls`; `api_key` is sent as a Bearer token."""
    return httpx.Client(**_options(urls, timeout, api_key, concurrency))


def async_client(urls: list[str], *, timeout: float, api_key: str | None = None,
                 concurrency: int = 64) -> httpx.AsyncClient:
    """An async client of the servers at `urls`; `api_key` is sent as a Bearer token."""
    return httpx.AsyncClient(**_options(urls, timeout, api_key, concurrency))
