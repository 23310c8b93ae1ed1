"""Optional notifications: a JSON POST to a webhook when a cycle promotes, rejects, waits or fails.

Off unless `OFFSEASON_WEBHOOK_URL` is set (a secret, so from the environment only, never from
params.yaml). The body is one JSON object:

    {"event": "promoted" | "rejected" | "waiting-approval" | "failed", "generation": 3,
     "message": "...", "workspace": "/path/to/repo", "at": "2026-12-02T16:20:00+00:00", ...}

plus whatever the caller adds (model version, scores, run ids). Slack-style incoming webhooks read
the `text` field, which repeats the message. A notification never fails a cycle: each attempt has
a timeout (`OFFSEASON_WEBHOOK_TIMEOUT`, default 5 s), three attempts with `stages.http`'s retry
policy (a 429, a 5xx or no answer retried after a short back-off, Retry-After honoured; another
4xx not), then a warning in the log.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import urllib.parse

import httpx

from stages import http

EVENTS = ("promoted", "rejected", "waiting-approval", "failed")
log = logging.getLogger("offseason.notify")


def send(event: str, message: str, *, attempts: int = 3, **fields) -> bool:
    """POST the event to the webhook; returns whether it was delivered. Never raises."""
    url = os.environ.get("OFFSEASON_WEBHOOK_URL", "").strip()
    if not url:
        return False
    if event not in EVENTS:
        raise ValueError(f"unknown notification event {event!r}; one of {EVENTS}")
    body = {"event": event, "message": message, "text": f"offseason: {message}",
            "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **fields}
    timeout = float(os.environ.get("OFFSEASON_WEBHOOK_TIMEOUT", "5"))
    try:
        with http.client([url], timeout=timeout, concurrency=1) as client:
            for attempt in http.retrying(attempts - 1):
                with attempt:
                    http.checked(client.post(url, content=json.dumps(body, default=str), headers={
                        "Content-Type": "application/json", "User-Agent": "offseason"}))
                    return True
    except http.Failed as err:  # the status only: a body may echo what the URL holds
        error = f"HTTP {err.status}"
    except (httpx.HTTPError, httpx.InvalidURL) as err:  # refused, timed out, bad URL
        error = http.describe(err)
    # the URL may hold a token: name the host only
    host = urllib.parse.urlparse(url).netloc or "?"
    log.warning("notification %r to the webhook at %s not delivered (%s); the cycle goes on",
                event, host, error)
    return False


def cycle_failed(root, err: BaseException) -> bool:
    """The `failed` notification of a cycle in `root` that raised `err`."""
    return send("failed", f"cycle in {root} failed: {type(err).__name__}: {err}",
                workspace=str(root))
