"""An order-status support agent: an example of a user's own environment (see README.md).

The agent answers "where is my order?" by calling `lookup_order` and telling the customer the
order's status. Its reward has two components, each 1.0 or 0.0:
- `called_tool`: an assistant message called lookup_order with the task's `order_id`;
- `answer`: the final assistant message contains the task's `expected_status` (a whole phrase,
  any case; "not found" for an order that does not exist).
A task without `order_id` or `expected_status` cannot be judged (None).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from stages.envs.errors import ToolError

VERSION = "support@1"  # recorded with every score: change it when reward() changes
MAX_TURNS = 3  # tool calls per episode

ORDERS = json.loads(Path(__file__).with_name("orders.json").read_text(encoding="utf-8"))
ORDER_ID = re.compile(r"\b[A-Z]\d{4}\b")

TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "The status, estimated delivery date and items of a customer's order.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "e.g. A1002",
                                        "minLength": 1}},
            "required": ["order_id"],
            "additionalProperties": False,
        },
    },
}]


def call_tool(task: dict, name: str, arguments: dict) -> str:
    """The result of one tool call (its arguments already match the tool's schema)."""
    order_id = arguments["order_id"].strip().upper()
    order = ORDERS.get(order_id)
    if order is None:  # the agent's mistake or the customer's: it should say so, not crash
        raise ToolError(f"no order {order_id!r}; order ids look like A1002")
    return json.dumps({"order_id": order_id, **order})


def _text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _called(messages: list[dict], order_id: str) -> bool:
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for tool_call in message.get("tool_calls") or ():
            function = tool_call.get("function") or {}
            if function.get("name") != "lookup_order":
                continue
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except json.JSONDecodeError:
                continue
            if isinstance(arguments, dict) and \
                    str(arguments.get("order_id", "")).strip().upper() == order_id:
                return True
    return False


def reward(task: dict, messages: list[dict]) -> dict[str, float] | None:
    """{"called_tool": 1.0 or 0.0, "answer": 1.0 or 0.0}; None when the task lacks its fields."""
    order_id, expected = task.get("order_id"), task.get("expected_status")
    if not order_id or not expected:
        return None
    assistant = [m for m in messages if m.get("role") == "assistant"]
    final = _text(assistant[-1]) if assistant else ""
    said = re.search(rf"\b{re.escape(expected)}\b", final, re.IGNORECASE) is not None
    return {"called_tool": float(_called(messages, order_id.upper())), "answer": float(said)}


def gold(task: dict) -> list[dict]:
    """The ideal turns: look the order up, then tell the customer its status."""
    order_id = task["order_id"]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order_id})}}
    try:
        result = call_tool(task, "lookup_order", {"order_id": order_id})
    except ToolError as err:
        result = f"Error: {err}"
        answer = (f"I'm sorry, order {order_id} was not found. Could you check the order id? "
                  f"It looks like A1002.")
    else:
        order = json.loads(result)
        eta = f", expected {order['eta']}" if order["eta"] else ""
        answer = f"Your order {order_id} ({', '.join(order['items'])}) is {order['status']}{eta}."
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result},
            {"role": "assistant", "content": answer}]


def task_from_trace(messages: list[dict], tools: list[dict] | None) -> dict | None:
    """The task behind a production trace: its system and first user turn, with the order id the
    user named; None when the trace is another agent's or names no order.
    """
    if tools is not None and "lookup_order" not in {
            (t.get("function") or {}).get("name") for t in tools if isinstance(t, dict)}:
        return None
    user = next((m for m in messages if m.get("role") == "user"), None)
    found = ORDER_ID.search(_text(user)) if user else None
    if found is None:
        return None
    order = ORDERS.get(found.group())
    turns = [m for m in messages if m.get("role") == "system"][:1] + [user]
    return {"messages": [{"role": m["role"], "content": _text(m)} for m in turns],
            "order_id": found.group(),
            "expected_status": order["status"] if order else "not found"}
