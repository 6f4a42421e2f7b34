"""Starting learners as OS processes, one per learner or a torchrun group per learner.

Learners get the store's address and the run id on the command line and credentials through
the inherited environment, never as arguments (arguments show up in `ps` and in logs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LearnerProcess:
    learner: int
    processes: int
    threads: int

    def command(self, store_url: str, endpoint_url: str | None, run_id: str) -> list[str]:
        launcher = [sys.executable, "-m", "training.learner"]
        if self.processes > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={self.processes}", "-m", "training.learner"]
        args = ["--store", store_url, "--run-id", run_id, "--learner", str(self.learner),
                "--threads", str(self.threads)]
        if endpoint_url:
            args += ["--endpoint-url", endpoint_url]
        return launcher + args


class LearnerFailed(RuntimeError):
    pass


def run_learners(learners: list[LearnerProcess], store_url: str, endpoint_url: str | None, run_id: str,
                 on_line: Callable[[int, str], None]) -> None:
    """Run learners concurrently until all exit; relay their output lines; raise if any failed."""
    procs, readers, tails = {}, [], {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(max(l.threads for l in learners))}
    for learner in learners:
        proc = subprocess.Popen(learner.command(store_url, endpoint_url, run_id), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        procs[learner.learner] = proc
        tails[learner.learner] = deque(maxlen=30)
        reader = threading.Thread(target=_relay, args=(learner.learner, proc, tails[learner.learner], on_line),
                                  daemon=True)
        reader.start()
        readers.append(reader)
    codes = {index: proc.wait() for index, proc in procs.items()}
    for reader in readers:
        reader.join()
    failed = {index: code for index, code in codes.items() if code != 0}
    if failed:
        details = "\n".join(f"learner {i} exited with {code}:\n" + "\n".join(tails[i]) for i, code in failed.items())
        raise LearnerFailed(f"{len(failed)} learner(s) failed\n{details}")


def _relay(index: int, proc: subprocess.Popen, tail: deque, on_line: Callable[[int, str], None]) -> None:
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        on_line(index, line)
