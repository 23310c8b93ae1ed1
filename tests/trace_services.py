"""A scripted Langfuse and LangSmith server on loopback, for `offseason pull` and the vendors' own
SDKs: tests/flows/intake/test_pull.py serves it from a thread, tests/cycle/test_security.py's cycle as a process.

    python tests/trace_services.py PORT      # until SIGTERM; prints "listening"

The server answers the endpoints the SDKs call, in the shapes their generated types declare (the
SDK parses each response into those types, so a wrong shape fails here). Where each shape comes
from (the installed wheels of the pinned versions, constraints.txt):
- Langfuse, langfuse==5.2.0 (github.com/langfuse/langfuse-python, Fern-generated from Langfuse's
  OpenAPI spec): `GET /api/public/v2/observations` (query `isRootObservation`, `fromStartTime`,
  `traceId`, `fields`, `limit`, `cursor`; langfuse/api/observations/raw_client.py) answers
  `ObservationsV2Response` `{data: [ObservationV2], meta: {cursor}}`
  (langfuse/api/observations/types/observations_v2response.py, commons/types/observation_v2.py:
  `input`/`output` as JSON text, per the endpoint's docstring); `GET /api/public/v3/scores`
  (`traceId`, `fields`; scores/raw_client.py) answers `GetScoresV3Response` `{data: [ScoreV3],
  meta: {limit, cursor}}` (scores/types/score_v3.py: polymorphic `value`, `subject` discriminated
  by `kind`). Basic auth with public:secret key; 401 otherwise.
- LangSmith, langsmith==0.15.1 (github.com/langchain-ai/langsmith-sdk, python/langsmith):
  `GET /sessions?name=` answers a list of `TracerSessionResult` (client.py `read_project`,
  schemas.py), `POST /runs/query` answers `{runs: [Run], cursors: {next}}` (client.py
  `list_runs`, `_get_cursor_paginated_list`; schemas.py `RunBase`/`Run`). Key in `x-api-key`.

The deletes `offseason erase --upstream` sends (flows/orchestration/upstream.py):
- Langfuse: `DELETE /api/public/traces` with `{traceIds: [...]}` (trace/raw_client.py
  `delete_multiple`) and `DELETE /api/public/traces/{traceId}` (`delete`) answer
  `DeleteTraceResponse` `{message}` (trace/types/delete_trace_response.py).
- LangSmith: `POST /runs/delete` with `{trace_ids: [...], session_id: <project id>}` (the
  documented `/api/v1/runs/delete`, under the SDK client's api_url as its `/runs/query` is; sent
  through `Client.request_with_retries`, which reads only the status; LangSmith documents no
  answer body, so this server's 202 `{}` is a choice no test relies on beyond "2xx"); 404 for a
  project this server does not have.
Both vendors delete asynchronously, and so does this server: a trace asked to be deleted
(`Service.deleting`) is still answered by the next read that finds it, and gone
(`Service.gone`) from every read after that; so `offseason erase --status` first says pending,
then confirmed. Tests reset both sets.
"""

from __future__ import annotations

import base64
import json
import sys
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

NOW = datetime.now(timezone.utc)
OLD = NOW - timedelta(days=30)  # before the last cycle
NEW = NOW - timedelta(minutes=2)  # after it
LAST_CYCLE = (NOW - timedelta(hours=1)).replace(microsecond=0)  # git keeps whole seconds
PROJECT = "7a1c3e5f-0b2d-4f6a-8c9e-1d3f5b7a9c0e"
SYSTEM = "You are the ShopCo support assistant. Look orders up before answering."


def iso(when: datetime, plus: float = 0.0) -> str:
    return (when + timedelta(seconds=plus)).isoformat().replace("+00:00", "Z")


# --- Langfuse: a trace with a tool call, scores from a user; another from a month ago ---------

def lf_trace(trace_id: str, start: datetime, order: str, answer: str) -> tuple[list, list]:
    call = {"id": f"call_{trace_id[:4]}", "type": "function",
            "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order})}}
    tools = [{"type": "function", "function": {
        "name": "lookup_order", "description": "Look an order up.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}]
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Where is my order #{order}?"}]
    second = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"],
                       "content": '{"status": "shipped", "carrier": "UPS"}'}]

    def obs(id_, type_, name, plus, parent=None, **more):
        return {"id": id_, "traceId": trace_id, "startTime": iso(start, plus),
                "endTime": iso(start, plus + 1), "projectId": PROJECT,
                "parentObservationId": parent, "type": type_, "name": name, "level": "DEFAULT",
                "sessionId": f"chat-{order}", "userId": "u-17", "traceName": "support-agent",
                "isRootObservation": parent is None, **more}

    root = f"{trace_id[:8]}-root"
    observations = [
        obs(root, "AGENT", "support-agent", 0),
        obs(f"{trace_id[:8]}-g1", "GENERATION", "OpenAI-generation", 0.1, root,
            model="gpt-4o-mini-2024-07-18",
            input=json.dumps({"messages": first, "tools": tools}),
            output=json.dumps({"role": "assistant", "content": None, "tool_calls": [call]}),
            usageDetails={"input": 96, "output": 19, "total": 115}),
        obs(f"{trace_id[:8]}-t1", "TOOL", "lookup_order", 1.2, root,
            input=json.dumps({"order_id": order}), output='{"status": "shipped"}'),
        obs(f"{trace_id[:8]}-g2", "GENERATION", "OpenAI-generation", 1.5, root,
            model="gpt-4o-mini-2024-07-18", input=json.dumps({"messages": second, "tools": tools}),
            output=json.dumps({"role": "assistant", "content": answer}),
            usageDetails={"input": 151, "output": 21, "total": 172}),
    ]

    def score(id_, name, data_type, value, subject):
        return {"id": id_, "projectId": PROJECT, "name": name, "source": "API",
                "timestamp": iso(start, 60), "environment": "default",
                "createdAt": iso(start, 60), "updatedAt": iso(start, 60), "dataType": data_type,
                "value": value, "comment": None, "subject": subject}

    scores = [score(f"s1-{trace_id[:8]}", "user-feedback", "BOOLEAN", True,
                    {"kind": "trace", "id": trace_id}),
              score(f"s2-{trace_id[:8]}", "helpfulness", "NUMERIC", 0.9,
                    {"kind": "observation", "id": f"{trace_id[:8]}-g2", "traceId": trace_id})]
    return observations, scores


LF_NEW, LF_OLD = "c2a1e0d4-5b6f-4e3a-9d2c-7f8e1a0b3c4d", "7d9e3b1f-2a4c-4f6e-8b0d-1c3e5a7f9b2d"
LF_OBS: list[dict] = []
LF_SCORES: list[dict] = []


def langfuse_data(new: datetime) -> datetime:
    """(Re)build the Langfuse server's traces in place, the newer one started at `new`; returns
    `new`. A test that pulls again later moves it on, so that the newer trace is inside the pull's
    window however long after this module was imported that pull runs.
    """
    LF_OBS.clear()
    LF_SCORES.clear()
    for trace_id, start, order, answer in ((LF_NEW, new, "A1043", "It shipped with UPS."),
                                           (LF_OLD, OLD, "B2200", "It is on its way.")):
        observations, scores = lf_trace(trace_id, start, order, answer)
        LF_OBS.extend(observations)
        LF_SCORES.extend(scores)
    return new


langfuse_data(NEW)

# --- LangSmith: a root chain run, two llm runs (the OpenAI wrapper's shape), a tool run --------

LS_NEW, LS_OLD = "1f0c8a52-4b7e-4c1d-9a3e-2b6d5f8e7a10", "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
LS_SESSION = "0d8e7f6a-5b4c-4d3e-9f2a-1b0c9d8e7f6a"
TENANT = "e1f2a3b4-c5d6-4e7f-8a9b-0c1d2e3f4a5b"


def ls_trace(trace_id: str, start: datetime, query: str) -> list[dict]:
    call = {"id": f"call_{trace_id[:4]}", "type": "function",
            "function": {"name": "search_docs", "arguments": json.dumps({"query": query})}}
    first = [{"role": "system", "content": "You are the Acme docs assistant."},
             {"role": "user", "content": f"How do I {query}?"}]
    second = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "content": "Settings > Keys."}]
    tools = [{"type": "function", "function": {"name": "search_docs", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}}]
    stamp = start.strftime("%Y%m%dT%H%M%S%fZ")

    def run(id_, run_type, name, plus, parent, inputs, outputs, **more):
        order = f"{stamp}{trace_id}" + ("" if parent is None else f".{stamp}{id_}")
        return {"id": id_, "trace_id": trace_id, "parent_run_id": parent, "run_type": run_type,
                "name": name, "start_time": iso(start, plus), "end_time": iso(start, plus + 1),
                "dotted_order": order, "status": "success", "error": None, "inputs": inputs,
                "outputs": outputs, "extra": {"metadata": {"thread_id": "th-55"}}, "tags": [],
                "session_id": LS_SESSION, "events": [], **more}

    def response(message, prompt, completion):
        return {"id": "chatcmpl-1", "model": "gpt-4o-mini-2024-07-18", "choices": [
            {"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}

    base = trace_id[:-4]
    return [
        run(trace_id, "chain", "agent", 0, None, {"question": f"How do I {query}?"},
            {"answer": "Use Settings > Keys."},
            feedback_stats={"user_score": {"n": 1, "avg": 1.0, "values": {}},
                            "correctness": {"n": 1, "avg": 0.8, "values": {}}}),
        run(base + "0001", "llm", "ChatOpenAI", 0.1, trace_id, {"messages": first, "tools": tools},
            response({"role": "assistant", "content": None, "tool_calls": [call]}, 142, 17)),
        run(base + "0002", "tool", "search_docs", 1.0, trace_id, {"query": query},
            {"output": "Settings > Keys."}),
        run(base + "0003", "llm", "ChatOpenAI", 1.5, trace_id, {"messages": second, "tools": tools},
            response({"role": "assistant", "content": "Use Settings > Keys."}, 201, 31)),
    ]


LS_RUNS = ls_trace(LS_NEW, NEW, "rotate an API key") + ls_trace(LS_OLD, OLD, "delete a project")


# --- the scripted server ------------------------------------------------------------------------

def after(start: str, since: str | None) -> bool:
    """A start time at or after the filter's (none: everything)."""
    def parse(text):
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        return when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    return since is None or parse(start) >= parse(since)


def set_langfuse(monkeypatch, url, secret="sk-lf-test"):
    """The environment `offseason pull` (and erase --upstream) reads for Langfuse at `url`."""
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", secret)
    monkeypatch.setenv("LANGFUSE_HOST", url)


def set_langsmith(monkeypatch, url, key="lsv2_pt_test"):
    """The same for LangSmith at `url`."""
    monkeypatch.setenv("LANGSMITH_API_KEY", key)
    monkeypatch.setenv("LANGSMITH_ENDPOINT", url)


class Service(BaseHTTPRequestHandler):
    """Langfuse's and LangSmith's public API, as far as the SDKs call it."""

    calls: list = []  # (method, path) of every request, for the tests to read
    deleting: set = set()  # trace ids asked to be deleted, still answered by the next read
    gone: set = set()  # trace ids deleted: no read answers them

    @classmethod
    def settle(cls, traces: set) -> None:
        """A read answered these traces: those being deleted are gone from the next one."""
        cls.gone |= cls.deleting & traces
        cls.deleting -= traces

    def log_message(self, *args):
        pass

    def answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        Service.calls.append(("GET", url.path, query))
        if url.path.startswith("/api/public/"):
            expected = "Basic " + base64.b64encode(b"pk-lf-test:sk-lf-test").decode()
            if self.headers.get("Authorization") != expected:
                return self.answer(401, {"message": "Invalid credentials. Confirm that you've "
                                         "configured the correct host."})
            if url.path == "/api/public/v2/observations":
                found = [o for o in LF_OBS if o["traceId"] not in Service.gone
                         and query.get("traceId") in (None, o["traceId"])
                         and (query.get("isRootObservation") != "true" or o["isRootObservation"])
                         and after(o["startTime"], query.get("fromStartTime"))]
                found.sort(key=lambda o: o["startTime"], reverse=True)  # newest first
                Service.settle({o["traceId"] for o in found})
                return self.page(found, query, {})
            if url.path == "/api/public/v3/scores":
                found = [s for s in LF_SCORES if query.get("traceId") in (
                    s["subject"]["id"], s["subject"].get("traceId"))
                    and query.get("traceId") not in Service.gone]
                return self.page(found, query, {"limit": int(query.get("limit", 50))})
        if url.path == "/sessions":
            if self.headers.get("x-api-key") != "lsv2_pt_test":
                return self.answer(401, {"detail": "Invalid token"})
            if query.get("name") != "support-bot":
                return self.answer(200, [])
            return self.answer(200, [{"id": LS_SESSION, "name": "support-bot",
                                      "tenant_id": TENANT, "start_time": iso(OLD, -86400),
                                      "reference_dataset_id": None}])
        return self.answer(404, {"detail": "Not Found"})

    def page(self, items: list, query: dict, meta: dict) -> None:
        """One page of a cursor-paginated list: the cursor is the next item's index."""
        start, size = int(query.get("cursor") or 0), int(query.get("limit", 50))
        rest = start + size < len(items)
        self.answer(200, {"data": items[start:start + size],
                          "meta": {**meta, "cursor": str(start + size) if rest else None}})

    def do_POST(self):
        url = urlparse(self.path)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        Service.calls.append(("POST", url.path, body))
        if url.path == "/runs/query":
            if self.headers.get("x-api-key") != "lsv2_pt_test":
                return self.answer(401, {"detail": "Invalid token"})
            runs = [r for r in LS_RUNS if r["trace_id"] not in Service.gone
                    and body.get("session") == [LS_SESSION]
                    and body.get("trace") in (None, r["trace_id"])
                    and (not body.get("is_root") or r["parent_run_id"] is None)
                    and after(r["start_time"], body.get("start_time"))]
            runs.sort(key=lambda r: r["start_time"], reverse=True)
            Service.settle({r["trace_id"] for r in runs})
            if body.get("select"):
                runs = [{k: r[k] for k in body["select"] if k in r} for r in runs]
            return self.answer(200, {"runs": runs, "cursors": {"next": None}})
        if url.path == "/runs/delete":
            if self.headers.get("x-api-key") != "lsv2_pt_test":
                return self.answer(401, {"detail": "Invalid token"})
            if body.get("session_id") != LS_SESSION:
                return self.answer(404, {"detail": "Session not found"})
            if not isinstance(body.get("trace_ids"), list) or len(body["trace_ids"]) > 1000:
                return self.answer(422, {"detail": "trace_ids: a list of at most 1000 ids"})
            Service.deleting |= {str(t) for t in body["trace_ids"]} - Service.gone
            return self.answer(202, {})
        return self.answer(404, {"detail": "Not Found"})

    def do_DELETE(self):
        url = urlparse(self.path)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        Service.calls.append(("DELETE", url.path, body))
        expected = "Basic " + base64.b64encode(b"pk-lf-test:sk-lf-test").decode()
        if self.headers.get("Authorization") != expected:
            return self.answer(401, {"message": "Invalid credentials. Confirm that you've "
                                     "configured the correct host."})
        if url.path == "/api/public/traces":
            if not isinstance(body.get("traceIds"), list):
                return self.answer(400, {"message": "traceIds: an array of trace ids"})
            Service.deleting |= {str(t) for t in body["traceIds"]} - Service.gone
            return self.answer(200, {"message": "Traces deleted"})
        if url.path.startswith("/api/public/traces/"):
            Service.deleting |= {url.path.rsplit("/", 1)[1]} - Service.gone
            return self.answer(200, {"message": "Trace deleted"})
        return self.answer(404, {"message": "Not Found"})


def serve(port: int) -> None:
    """Answer on 127.0.0.1:`port` until the process is stopped."""
    server = ThreadingHTTPServer(("127.0.0.1", port), Service)
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
