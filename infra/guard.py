"""Processes that never outlive the process that started them.

`python -m infra.guard MODULE ARGS...` runs MODULE as `python -m` would, after asking the kernel
to SIGKILL it when its parent dies (PR_SET_PDEATHSIG): a parent killed with SIGKILL runs no cleanup
of its own. The starter puts its pid in the child's environment (`PARENT_PID`), so a child whose
parent died before it could ask exits instead. The kernel sends the signal when the *thread* that
started the child ends, so start a guarded process from a thread that lives as long as it should.

Learners start through `infra.launch`, which guards them the same way and adds what torchrun and
srun need; the temporary Prefect server of `archipelago run` starts through this module, which
imports nothing beyond the standard library (torch would add seconds to the server's start).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
# The pid a guarded process must find as its parent; each guarded process sets it to its own for its children.
PARENT_PID = "ARCHIPELAGO_PARENT_PID"
# The parent a learner that srun started finds on its node: the step's Slurm daemon, which ends the
# step's processes with the step. srun hands its tasks this name as PARENT_PID.
SLURM_STEP_DAEMON = "slurmstepd"


def guarded_module(module: str) -> list[str]:
    """The command line that starts `module` as a guarded process (its arguments follow)."""
    return [sys.executable, "-m", "infra.guard", module]


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies; exit now if it already has.

    The parent may die between its fork and this call, leaving us reparented: the launcher's pid
    it left in the environment tells. Linux only: elsewhere the starter relies on ending the
    process group it started."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    expected, parent = os.environ[PARENT_PID], os.getppid()
    if expected == SLURM_STEP_DAEMON:  # started by srun on a Slurm node
        if _command_name(parent) != SLURM_STEP_DAEMON:
            sys.exit(f"process {os.getpid()}: told srun started it, but its parent {parent} is not "
                     f"{SLURM_STEP_DAEMON}; not starting")
    elif parent != int(expected):
        sys.exit(f"process {os.getpid()}: its parent is {parent}, not the launcher {expected} "
                 "(the launcher died, or a wrapper forked instead of exec'ing); not starting")
    os.environ[PARENT_PID] = str(os.getpid())


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def run_module(argv: list[str]) -> None:
    """Run module `argv[0]` with arguments `argv[1:]`, as `python -m` would."""
    sys.argv = argv  # run_module replaces argv[0] with the module's path, as `python -m` does
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    die_with_parent()
    run_module(sys.argv[1:])
