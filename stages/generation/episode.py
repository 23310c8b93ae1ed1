"""What every backend's episodes share: `turn_index` numbers the turns of an episode's tokens;
`Progress` reports episodes done. Imported by the chat path and the OpenAI-compatible backend
alike, so it needs neither torch nor a server.
"""

from __future__ import annotations

import sys
import time

PROGRESS_EVERY_S = 10.0


def turn_index(prompt_len: int, mask: list[int], closes: list[int]) -> list[int]:
    """Per token: 0 for the prompt; model turn k (from 1) and the tool result answering it: k."""
    turns, closed, pending = [0] * prompt_len, 0, iter(closes)
    following = next(pending, None)
    for i, chosen in enumerate(mask):
        turns.append(closed + 1 if chosen else closed)
        if i == following:
            closed += 1
            following = next(pending, None)
    return turns


class Progress:
    """Episodes done: a line on stderr every PROGRESS_EVERY_S (the Prefect log shows those) and a
    tqdm bar when stderr is a terminal.
    """

    def __init__(self, total: int, label: str, enabled: bool):
        """A progress report over `total` items (a bar on a terminal)."""
        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self.started = self.last = time.time()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="ep", file=sys.stderr, leave=False)

    def update(self, done: int) -> None:
        """Report `done` items finished so far."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done
        now = time.time()
        if now - self.last >= PROGRESS_EVERY_S or done == self.total:
            self.last = now
            rate = done / max(now - self.started, 1e-9)
            print(f"{self.label}: {done}/{self.total} episodes ({rate:.1f}/s)", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        """Close the progress bar, if any."""
        if self.bar is not None:
            self.bar.close()
