"""A learner process's watchdog: a process that makes no progress for too long ends itself.

Every store call and every wait for a partner has a deadline of its own, but a hang outside them (a
collective whose peer rank died, a driver that stopped answering, a bug) would hold the learner, and
its island's segment, forever. The watchdog turns such a hang into a failure with a clear message,
which the launcher reports (with the learner's last lines) and the segment's retry takes over from.

Progress is what the learner reports with `progress()`: an inner step, a chunk of a message or
checkpoint moved, a partner's message settled (received, refused or given up on). The limit (`RunSpec.learner_stall_limit_s`) is longer
than the longest stretch without one that the deadlines allow.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

# Exit status of a learner the watchdog ended: a failure, retried like any other.
STALLED = 86

_armed: "Watchdog | None" = None


class Watchdog:
    def __init__(self, limit_s: float, what: str, clock: Callable[[], float] = time.monotonic,
                 end: Callable[[int], None] = os._exit):
        """`what` names the process in the message; `end(status)` ends it (os._exit: a hung thread
        cannot stop the process from exiting, and no cleanup can hang it again)."""
        self.limit_s, self.what, self.clock, self.end = limit_s, what, clock, end
        self.last = clock()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def beat(self) -> None:
        self.last = self.clock()

    def _watch(self) -> None:
        while True:
            idle = self.clock() - self.last
            if idle >= self.limit_s:
                break
            time.sleep(self.limit_s - idle)
        message = (f"{self.what}: no progress for {idle:.1f}s (limit {self.limit_s:g}s, "
                   "RunSpec.learner_stall_limit_s); exiting so that its retry takes over")
        print(message, file=sys.stderr, flush=True)
        self.end(STALLED)


def arm(limit_s: float, what: str) -> Watchdog:
    """Start this process's watchdog; from now on `progress()` must come at least every `limit_s`."""
    global _armed
    _armed = Watchdog(limit_s, what).start()
    return _armed


def progress() -> None:
    """This process made progress. Nothing happens unless a watchdog is armed (a learner in a test's own
    process has none)."""
    if _armed is not None:
        _armed.beat()
