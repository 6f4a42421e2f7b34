"""Starting learners as OS processes, one per learner or a torchrun group per learner.

Learners get the store's address and the run id on the command line and credentials through
the inherited environment, never as arguments (arguments show up in `ps` and in logs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

# Exit status of a learner that stopped at its capacity window's end: a pause, not a failure.
WINDOW_CLOSED = 75


@dataclass(frozen=True)
class LearnerProcess:
    learner: int
    processes: int
    threads: int
    until: datetime | None = None  # the end of the island's capacity window
    # Prepended to the command line, e.g. `ip netns exec NS` to run in an island's network namespace.
    wrapper: tuple[str, ...] = ()

    def command(self, store_url: str, endpoint_url: str | None, run_id: str) -> list[str]:
        launcher = [sys.executable, "-m", "training.learner"]
        if self.processes > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={self.processes}", "-m", "training.learner"]
        args = ["--store", store_url, "--run-id", run_id, "--learner", str(self.learner),
                "--threads", str(self.threads)]
        if endpoint_url:
            args += ["--endpoint-url", endpoint_url]
        if self.until:
            args += ["--until", self.until.isoformat()]
        return [*self.wrapper, *launcher, *args]


class LearnerFailed(RuntimeError):
    pass


def run_learner(learner: LearnerProcess, store_url: str, endpoint_url: str | None, run_id: str,
                on_line: Callable[[str], None]) -> None:
    """Run one learner until it exits, relaying its output lines; raise with its last lines if it failed.
    A learner that stopped at its capacity window's end exits cleanly too; the caller tells a pause
    from the end by the learner's summary, which only a learner that trained every round writes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(learner.threads)}
    proc = subprocess.Popen(learner.command(store_url, endpoint_url, run_id), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    tail: deque[str] = deque(maxlen=30)
    for line in proc.stdout:
        tail.append(line.rstrip("\n"))
        on_line(tail[-1])
    code = proc.wait()
    if code not in (0, WINDOW_CLOSED):
        cause = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        raise LearnerFailed(f"learner {learner.learner} failed ({cause}); its last output:\n" + "\n".join(tail))
