"""Replayed tools: every production trace becomes an environment, without writing one.

    environments:
      replay:
        module: stages.envs.replay
        weight: 1.0

Reads validated traces: `task_from_trace` makes each a task (its request, its tools, its recorded
tool calls with their results, production's answer); `call_tool` answers a call equal to a
recorded one with the recorded result, any other with a `ToolError`: no live system is touched.
The reward: the judge's score where params.yaml has a `judge:`, else whether the final answer
equals production's. Writes nothing.

    python -m stages.envs.replay data/inbox/traffic-000.jsonl     # the tasks the traces give

Details: docs/environments.md, "How replayed tools work (stages/envs/replay.py)".
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path

from stages.envs import judge  # held here: the reward stage scores replay in its own process
from stages.envs.contract import text_of
from stages.envs.errors import ToolError

VERSION = "replay@1"
TOOLS: list[dict] = []  # each task offers the tools its trace offered (the task's `tools`)
MAX_TURNS = 8


def _arguments(raw) -> object:
    """Tool-call arguments as a JSON value (logs hold them as a JSON string or an object)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw if raw is not None else {}


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def task_from_trace(messages: list[dict], tools: list[dict] | None = None) -> dict | None:
    """The task a trace gives: its opening messages, tools, recorded calls and final answer."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or not any(m.get("role") == "user" for m in messages[:first]):
        return None
    final = messages[-1] if messages[-1].get("role") == "assistant" else None
    if final is None or final.get("tool_calls") or not text_of(final.get("content")).strip():
        return None
    results = {m.get("tool_call_id"): text_of(m.get("content")) for m in messages[first:]
               if m.get("role") == "tool"}
    recorded, called = [], []
    for message in messages[first:]:
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            name = function.get("name")
            if not name or call.get("id") not in results:
                continue  # a call without its result cannot be replayed
            recorded.append({"name": name, "arguments": _arguments(function.get("arguments")),
                             "result": results[call["id"]]})
            called.append(name)
    offered = list(tools or [])
    names = {t.get("function", {}).get("name") for t in offered}
    for name in dict.fromkeys(called):  # the log kept no schema: any object of arguments
        if name not in names:
            offered.append({"type": "function", "function": {
                "name": name, "description": f"{name} (replayed from production)",
                "parameters": {"type": "object"}}})
    return {"messages": [dict(m) for m in messages[:first]], "tools": offered,
            "recorded": recorded, "reference": text_of(final["content"])}


def call_tool(task: dict, name: str, arguments: dict) -> str:
    """The recorded result of the same call (name and arguments); a ToolError otherwise."""
    wanted = _canonical(arguments)
    same = [r for r in task.get("recorded", [])
            if r["name"] == name and _canonical(r["arguments"]) == wanted]
    if not same:
        known = "; ".join(f"{r['name']}({_canonical(r['arguments'])})"
                          for r in task.get("recorded", [])) or "none"
        raise ToolError(f"no recorded result for {name}({wanted}): this environment replays "
                        f"production's tool calls, and those were: {known}")
    # the task is shared by every sample of it and stays as it is: a call repeated in
    # production gets its first result each time
    return same[0]["result"]


_SPACE = re.compile(r"\s+")


def _normal(text: str) -> str:
    return _SPACE.sub(" ", text).strip().lower()


def _judged(params: Path) -> bool:
    """Whether params.yaml names a judge (`judge.model`), read once per file and version."""
    try:
        stamp = params.stat().st_mtime_ns
    except OSError:
        return False
    return _judge_named(params, stamp)


@functools.lru_cache(maxsize=8)
def _judge_named(params: Path, stamp: int) -> bool:
    from stages import config as cfg

    try:
        return bool(cfg.load("judge", params).model)
    except cfg.ParamsError:
        return False


def reward(task: dict, messages: list[dict]) -> float | dict | None:
    """The judge's score when one is configured, else whether the final answer is production's."""
    last = messages[-1] if messages else {}
    answer = text_of(last.get("content")) if last.get("role") == "assistant" else ""
    if _judged(Path("params.yaml").resolve()):
        shown = messages + [{"role": "user", "content": "(For the grader only: production "
                                                        "answered this request with: "
                                                        f"{task.get('reference', '')})"}]
        return judge.score(task, shown)
    if not task.get("reference"):
        return None
    return float(_normal(answer) == _normal(task["reference"]))


def main(argv: list[str] | None = None) -> None:
    """Print the tasks a file of OpenAI chat traces gives (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", type=Path, help="JSON lines, each {messages, tools?}")
    args = parser.parse_args(argv)
    for line in args.traces.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            task = task_from_trace(row.get("messages") or [], row.get("tools"))
            print(json.dumps(task) if task else "null")


if __name__ == "__main__":
    main()
