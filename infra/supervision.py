"""Running learner processes: relaying their output, ending their process groups, and stopping a
run's learners for good.

A learner never outlives the process that started it, so a retry never runs a second copy beside
a stray first one: `run_learner` starts it (the command line `infra.launch.LearnerProcess` builds)
in its own process group and ends that group however it returns (the learner's exit, an error
relaying its output, an interrupt). A process that launches several nodes of a learner ends the
others' groups as soon as one node fails (`LearnerNodes`), so the learner fails, and restarts, as
a whole.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from infra.guard import PARENT_PID
from infra.launch import MISCONFIGURED, WINDOW_CLOSED, LearnerProcess
from infra.rendezvous import ANNOUNCEMENT
from infra.spec.tracking import TRACKER_CREDENTIALS

# How long a learner's group gets to exit on SIGTERM (torchrun stops its workers) before SIGKILL.
TERMINATE_GRACE_S = 5.0
# Learners never talk to the control plane's API nor to an experiment tracker (their output is relayed by
# the task that runs them), so they do not inherit what opens either.
PREFECT_CREDENTIALS = ("PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_KEY")


class LearnerFailed(RuntimeError):
    pass


class LearnerMisconfigured(LearnerFailed):
    """A learner that exited with `MISCONFIGURED`: its host or the spec must change before it can run."""


class LearnersStopped(LearnerFailed):
    """The run's learners in this process were stopped by `stop_learners` (its lease could not be kept)."""


# The learner processes this process runs, by run id, and the runs whose learners were stopped for
# good, with why: a retry of a stopped learner must not start a copy beside the run's next holder.
_running: dict[str, set[subprocess.Popen]] = {}
_stopped: dict[str, str] = {}
_running_lock = threading.Lock()


def stop_learners(run_id: str, reason: str) -> int:
    """End the process group of every learner of `run_id` this process runs, and refuse to start
    more of them; returns how many were running."""
    with _running_lock:
        _stopped[run_id] = reason
        running = list(_running.get(run_id, ()))
    for proc in running:
        end_group(proc)
    return len(running)


def stopped_because(run_id: str) -> str | None:
    """Why `stop_learners` stopped the run's learners in this process, or None."""
    return _stopped.get(run_id)


def stop_learners_on_sigterm(run_id: str) -> None:
    """On SIGTERM (a worker cancelling this process's flow run), end the run's learners at once, then
    do what the signal did before. Otherwise the relay threads keep the process, and so its learners,
    alive until the worker's SIGKILL (30 s later in Prefect 3.9). Main thread only, as Python's
    signal handlers are; the learners are ended from a thread of their own, so the handler never
    waits on a lock the interrupted code holds."""
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame) -> None:
        threading.Thread(target=stop_learners, args=(run_id, "this process was told to stop (SIGTERM)")).start()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def _tracked(run_id: str, start: Callable[[], subprocess.Popen]):
    """A learner process `start`ed unless its run was stopped, known to `stop_learners` while it runs."""
    with _running_lock:
        if run_id in _stopped:
            raise LearnersStopped(f"run {run_id}: not starting a learner: {_stopped[run_id]}")
        proc = start()
        _running.setdefault(run_id, set()).add(proc)
    try:
        yield proc
    finally:
        with _running_lock:
            _running[run_id].discard(proc)


class LearnerNodes:
    """The nodes of one learner that this process runs, each from a thread of its own: once one fails,
    `fail` ends the process groups of the others at once and none starts after. Otherwise a node that
    died before joining would leave node 0's rendezvous store waiting out its timeout
    (infra.rendezvous.RENDEZVOUS_TIMEOUT_S) before the learner could restart."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.failure: str | None = None

    def fail(self, reason: str) -> None:
        """Record the learner's first failure and end every node's processes that still run."""
        with self._lock:
            self.failure = self.failure or reason
            running = list(self._running)
        for proc in running:
            end_group(proc)

    @contextlib.contextmanager
    def member(self, proc: subprocess.Popen):
        """`proc`, a node's process group, ended by `fail` while it runs; LearnerFailed if a node already
        failed (the caller ends the group)."""
        with self._lock:
            if self.failure is not None:
                raise LearnerFailed(f"not joining the learner's other nodes: {self.failure}")
            self._running.add(proc)
        try:
            yield
        finally:
            with self._lock:
                self._running.discard(proc)


def communicating_on(interface: str | None) -> dict[str, str]:
    """The environment that keeps gloo's and NCCL's sockets on one network interface (`lo` without one)."""
    name = interface or "lo"
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}  # NCCL's `=`: that name exactly


def run_learner(learner: LearnerProcess, store_url: str, endpoint_url: str | None, run_id: str,
                on_line: Callable[[str], None], credentials_env: str | None = None,
                withheld_env: Iterable[str] = (), on_rendezvous: Callable[[str], None] | None = None,
                nodes: LearnerNodes | None = None) -> None:
    """Run one learner (one node of it) until it exits, relaying its output lines; raise with its last
    lines if it failed. A learner that stopped at its capacity window's end exits cleanly too; the
    caller tells a pause from the end by the learner's summary, which only a learner that trained
    every round writes. Whatever ends this call, the learner's process group is ended with it.
    `withheld_env`: variables of this environment the learner must not inherit (other writers' keys).
    `on_rendezvous`: told the first line node 0's torchrun announces its rendezvous address with.
    `nodes`: the learner's nodes this process runs, which end this one's group once one of them fails."""
    withheld = set(withheld_env) | set(PREFECT_CREDENTIALS) | set(TRACKER_CREDENTIALS)
    env = {**{name: value for name, value in os.environ.items() if name not in withheld},
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(learner.threads),
           PARENT_PID: str(os.getpid()), **communicating_on(learner.interface)}
    tail: deque[str] = deque(maxlen=30)
    with _tracked(run_id, lambda: subprocess.Popen(
            learner.command(store_url, endpoint_url, run_id, credentials_env), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)) as proc, proc:
        try:
            with nodes.member(proc) if nodes is not None else contextlib.nullcontext():
                for line in proc.stdout:
                    tail.append(line.rstrip("\n"))
                    if on_rendezvous is not None and tail[-1].startswith(ANNOUNCEMENT):
                        publish, on_rendezvous = on_rendezvous, None
                        publish(tail[-1])
                    if run_id not in _stopped:  # a stopped learner's dying words (torchrun's traceback) are noise
                        on_line(tail[-1])
                proc.wait()
        finally:
            end_group(proc)
    code = proc.returncode
    if run_id in _stopped:
        raise LearnersStopped(f"learner {learner.learner} of run {run_id} stopped: {_stopped[run_id]}")
    if code not in (0, WINDOW_CLOSED):
        cause = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        who = (f"learner {learner.learner}'s {learner.nodes} nodes" if learner.node is None else
               f"learner {learner.learner}" + (f" node {learner.node}" if learner.nodes > 1 else ""))
        if code == MISCONFIGURED:
            raise LearnerMisconfigured(f"{who} cannot start: {tail[-1] if tail else 'no output'}")
        raise LearnerFailed(f"{who} failed ({cause}); its last output:\n" + "\n".join(tail))


def yield_cpu_to_learners() -> None:
    """Give this process's session the lowest CPU priority. A process that only starts learners and
    relays their output (an island's segment) should, where it shares cores with them, take only what
    they leave. Linux shares CPU between sessions (autogroups) before processes, so the session's
    priority is the one that counts; learners start sessions of their own at normal priority.
    Without autogroups (another OS, a kernel without them) this does nothing."""
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("19")


def end_group(proc: subprocess.Popen) -> None:
    """End the process group `proc` leads: SIGTERM while its leader runs, then SIGKILL for whatever is left."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def kill_children() -> None:
    """SIGKILL every child of this process now, without waiting: those that lead a process group of
    their own (learners, a server) with their whole group. For a process about to exit at once, such as
    on a second Ctrl-C; it takes no lock, so a signal handler may call it."""
    own_group = os.getpgrp()
    for child in psutil.Process().children():
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(child.pid) == own_group:
                os.kill(child.pid, signal.SIGKILL)
            else:
                _signal_group(os.getpgid(child.pid), signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is already empty
        pass
