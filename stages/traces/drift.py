"""Drift of a cycle's traffic against the previous cycle's: what changed in what users send.

A profile summarizes the valid traces of one cycle: the task mix (the environment's `task_kind`
of each task), messages and tool calls per trace, the tool names called, and the feedback and
error rates. `compare` reports, against the previous profile: the task mix's total variation
distance (0 = the same mix, 1 = nothing in common), the relative change of the per-trace counts,
tool names never seen before, and the change of the rates. The validate stage keeps one profile
per cycle in `data/profiles/` and can stop the cycle on large drift (`validate.max_drift`).
"""

from __future__ import annotations

import json
from collections import Counter


class Profile:
    """Counts over a set of traces, summed up as a drift profile."""

    def __init__(self):
        """An empty profile."""
        self.traces = 0
        self.kinds: Counter = Counter()
        self.tools: Counter = Counter()
        self.messages = self.tool_calls = self.with_feedback = self.thumbs_up = self.errors = 0

    def add(self, n_messages: int, tool_names: list[str], feedback: dict, kind: str | None
            ) -> None:
        """Count one trace."""
        self.traces += 1
        self.kinds[kind or "none"] += 1
        self.messages += n_messages
        self.tool_calls += len(tool_names)
        self.tools.update(tool_names)
        thumbs = feedback.get("thumbs_up")
        self.with_feedback += isinstance(thumbs, bool)
        self.thumbs_up += thumbs is True
        self.errors += bool(feedback.get("error"))

    def summary(self) -> dict:
        """The profile: rates and means over the traces counted."""
        n = max(1, self.traces)
        return {"traces": self.traces,
                "task_mix": {k: round(v / n, 4) for k, v in sorted(self.kinds.items())},
                "tools": sorted(self.tools), "messages_per_trace": round(self.messages / n, 3),
                "tool_calls_per_trace": round(self.tool_calls / n, 3),
                "feedback_rate": round(self.with_feedback / n, 4),
                "thumbs_up_rate": round(self.thumbs_up / max(1, self.with_feedback), 4),
                "error_rate": round(self.errors / n, 4)}


def compare(now: dict, before: dict | None) -> dict:
    """The drift of `now` against `before`; the first cycle has nothing to drift from."""
    if not before or not before.get("traces"):
        return {"baseline": True, "task_mix_distance": 0.0, "new_tools": []}
    kinds = set(now["task_mix"]) | set(before["task_mix"])
    distance = 0.5 * sum(abs(now["task_mix"].get(k, 0) - before["task_mix"].get(k, 0))
                         for k in kinds)

    def relative(key: str) -> float:
        return round((now[key] - before[key]) / before[key], 4) if before[key] else 0.0

    return {"baseline": False, "task_mix_distance": round(distance, 4),
            "new_tools": sorted(set(now["tools"]) - set(before["tools"])),
            "messages_per_trace_change": relative("messages_per_trace"),
            "tool_calls_per_trace_change": relative("tool_calls_per_trace"),
            "thumbs_up_rate_change": round(now["thumbs_up_rate"] - before["thumbs_up_rate"], 4),
            "error_rate_change": round(now["error_rate"] - before["error_rate"], 4)}


def dumps(profile: dict) -> str:
    """A profile as indented JSON with sorted keys."""
    return json.dumps(profile, indent=2, sort_keys=True) + "\n"
