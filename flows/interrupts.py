"""What SIGINT (Ctrl-C) and SIGTERM do to `archipelago run` and `resume`.

The first signal raises KeyboardInterrupt in the main thread, where the lifecycle flow runs: the
lifecycle stops the run's learners and releases the run's lease as it unwinds (flows/lifecycle.py),
the command stops its temporary Prefect server and prints how to resume. Inside a flow run Prefect
takes SIGTERM first (its `TerminationSignal`, which the lifecycle treats alike) and sends it again
once the flow has ended, to this handler. A second signal while that happens forces: every child
process's group is killed at once and the command exits.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

from infra.supervision import kill_children

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: signal.Signals) -> int:
    """A shell's status for a command that a signal ended: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


@contextmanager
def interruptible(forced_message: str):
    """SIGINT and SIGTERM handled as above for the body; yields the list of signals received, in
    order. `forced_message` goes to stderr on a forced exit. In a thread other than the main one
    (where Python cannot handle signals) it changes nothing."""
    received: list[signal.Signals] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame) -> None:
        received.append(signal.Signals(signum))
        if len(received) == 1:
            raise KeyboardInterrupt
        kill_children()
        os.write(2, f"\n{received[-1].name} again: forced exit. {forced_message}\n".encode())
        os._exit(exit_status(received[-1]))

    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield received
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
