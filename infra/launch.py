"""Starting learners as OS processes, one per learner or a torchrun group per learner.

Learners get the store's address and the run id on the command line and credentials through
the inherited environment, never as arguments (arguments show up in `ps` and in logs).

A learner never outlives the process that started it, so a retry never runs a second copy beside
a stray first one: `run_learner` starts it in its own process group and ends that group however
it returns (the learner's exit, an error relaying its output, an interrupt), and every learner
process, torchrun's workers included, starts through this module's `main`, which has the kernel
kill it when its parent dies (`infra.guard`: a parent killed with SIGKILL runs no cleanup of its own).

Nothing a torchrun group opens listens beyond loopback, or beyond the island's
`network_interface` for a learner that spans several nodes: its rendezvous store is bound to
127.0.0.1 or that interface's address (torchrun's own rendezvous binds it to every interface) and
gloo and NCCL are told to use `lo` or that interface. The store is unauthenticated; it carries no
pickles under the static rendezvous. Node 0 of a learner on several nodes announces the store's
address on its output; its launcher publishes it for the other nodes (infra/rendezvous.py).
Each node's launcher guards its own processes. A process that launches several nodes of a learner
ends the others' groups as soon as one node fails (`LearnerNodes`), and srun ends the other tasks of
its step (`--kill-on-bad-exit`); otherwise the others' collectives fail (or their watchdog fires) and
they exit too. Either way the learner fails, and restarts, as a whole.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from infra import layout
from infra.guard import PARENT_PID, SLURM_STEP_DAEMON, die_with_parent, run_module
from infra.rendezvous import ANNOUNCEMENT, RENDEZVOUS_TIMEOUT_S, Endpoint, announcement
from infra.spec import IslandSpec, RunSpec, spec_sha256
from infra.store import ObjectStore
from infra.spec.tracking import TRACKER_CREDENTIALS

# Exit status of a learner that stopped at its capacity window's end: a pause, not a failure.
WINDOW_CLOSED = 75
# Exit status of a learner that cannot start as the spec asks on its host (sysexits' EX_CONFIG): a
# retry or a resume would meet the same error, so none is made or advised (`LearnerMisconfigured`).
MISCONFIGURED = 78

# Every learner process starts as `python -m infra.launch MODULE ARGS...` (see `main`).
GUARDED = [sys.executable, "-m", "infra.launch"]
TORCHRUN = "torch.distributed.run"
LEARNER_MODULE = "training.learner.process"
# Started by srun on each node of a learner that spans several: it starts that node (training/node.py).
NODE_LAUNCHER_MODULE = "training.node"
BOUND_RENDEZVOUS = "archipelago-bound"
# How long a learner's group gets to exit on SIGTERM (torchrun stops its workers) before SIGKILL.
TERMINATE_GRACE_S = 5.0
SRUN = "srun"
# The relative node id Slurm gives each task of a job: a node launcher's node rank.
SLURM_NODE_ID = "SLURM_NODEID"


@dataclass(frozen=True)
class LearnerProcess:
    learner: int
    processes: int
    threads: int
    until: datetime | None = None  # the end of the island's capacity window
    # Prepended to the command line, e.g. `ip netns exec NS` to run in an island's network namespace.
    # It must exec the command, not fork it: the learner checks that its parent is the launcher.
    wrapper: tuple[str, ...] = ()
    # The run's spec as the control plane knows it (infra.spec.spec_sha256): the learner refuses a
    # spec.json in the store that differs, whoever wrote it. A hash, not a secret.
    spec_sha256: str = field(kw_only=True)
    # The lease term of the lifecycle that starts it (infra.lease.LeaseFence): it stops once a newer one holds the run.
    lease_term: int | None = field(default=None, kw_only=True)
    # A learner on several nodes (islands[].nodes_per_learner): this is node `node` of `nodes`, and
    # `processes` are its own. They meet and talk on network `interface`, at node 0's address
    # `rendezvous` ("host:port"; on node 0 None: its torchrun binds it and announces it).
    # `node` None: every node at once, as the wrapper (srun) starts the node launcher on each of
    # them, which takes its node rank from Slurm and works out the rest on its host.
    nodes: int = field(default=1, kw_only=True)
    node: int | None = field(default=0, kw_only=True)
    interface: str | None = field(default=None, kw_only=True)
    rendezvous: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.node is None:
            if self.nodes == 1 or self.rendezvous is not None:
                raise ValueError(f"learner {self.learner}: node launchers start a learner on several nodes and "
                                 f"find node 0's rendezvous themselves (nodes {self.nodes}, "
                                 f"rendezvous {self.rendezvous!r})")
        elif not 0 <= self.node < self.nodes:
            raise ValueError(f"learner {self.learner}: node {self.node} is not one of its {self.nodes} nodes")
        elif (self.node > 0) != (self.rendezvous is not None):
            raise ValueError(f"learner {self.learner}: node 0 binds the rendezvous and every other node joins "
                             f"node 0's (node {self.node}, rendezvous {self.rendezvous!r})")
        if self.nodes > 1 and self.interface is None:
            raise ValueError(f"learner {self.learner}: its {self.nodes} nodes need the network interface they meet on")

    def command(self, store_url: str, endpoint_url: str | None, run_id: str,
                credentials_env: str | None = None) -> list[str]:
        launcher = [*GUARDED, LEARNER_MODULE]
        if self.node is None:
            launcher = [*GUARDED, NODE_LAUNCHER_MODULE]
        elif self.processes > 1 or self.nodes > 1:
            # torchrun hands its node rank only to its own static rendezvous; ours takes it as `rank`, as that does.
            conf = ",".join([f"rank={self.node}", *([f"interface={self.interface}"] if self.interface else [])])
            # Node 0 binds on its interface's address, or without one on loopback; the others join node 0's.
            endpoint = self.rendezvous or "127.0.0.1:0"
            launcher = [*GUARDED, TORCHRUN, f"--rdzv-backend={BOUND_RENDEZVOUS}", f"--rdzv-endpoint={endpoint}",
                        f"--rdzv-conf={conf}",
                        f"--nnodes={self.nodes}", f"--nproc-per-node={self.processes}", "-m", "infra.launch",
                        LEARNER_MODULE]
        args = ["--store", store_url, "--run-id", run_id, "--spec-sha256", self.spec_sha256,
                "--learner", str(self.learner)]
        if self.node is not None:  # a node launcher shares its own host's cores among its processes
            args += ["--threads", str(self.threads)]
        if endpoint_url:
            args += ["--endpoint-url", endpoint_url]
        if credentials_env:  # the name of the variables, never what they hold
            args += ["--credentials-env", credentials_env]
        if self.until:
            args += ["--until", self.until.isoformat()]
        if self.lease_term is not None:
            args += ["--lease-term", str(self.lease_term)]
        return [*self.wrapper, *launcher, *args]


def learner_arguments(description: str) -> argparse.ArgumentParser:
    """The parser of what `LearnerProcess.command` hands a learner process or a node launcher, but
    `--threads`, which only a learner process takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--store", required=True, help="store root URL (credentials from the environment)")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--credentials-env", default=None,
                        help="prefix of the run store's credential variables (store.credentials_env)")
    parser.add_argument("--run-id", required=True, help="run id")
    parser.add_argument("--spec-sha256", required=True,
                        help="sha256 of the run's spec as the control plane knows it; spec.json must match")
    parser.add_argument("--learner", type=int, required=True, help="global learner index")
    parser.add_argument("--until", type=datetime.fromisoformat, default=None,
                        help="end of the island's capacity window (ISO 8601 with offset): stop cleanly before it")
    parser.add_argument("--lease-term", type=int, default=None,
                        help="the run's lease term of the lifecycle that started it: stop once a newer one holds the run")
    return parser


def started_spec(args: argparse.Namespace) -> RunSpec:
    """The run's spec from its store, for a process started with `learner_arguments`; exits naming the
    learner unless it hashes to what the control plane passed (someone else wrote it) and has that learner."""
    raw_spec = (ObjectStore(args.store, args.endpoint_url, credentials_env=args.credentials_env)
                .child(f"runs/{args.run_id}").get_json(layout.SPEC))
    if spec_sha256(raw_spec) != args.spec_sha256:
        sys.exit(f"learner {args.learner}: the spec.json of run {args.run_id} is not the spec the control plane "
                 f"started this learner with (sha256 {spec_sha256(raw_spec)[:16]}, expected "
                 f"{args.spec_sha256[:16]}): someone else wrote it; refusing to train on it")
    spec = RunSpec.model_validate(raw_spec)
    if not 0 <= args.learner < len(spec.learners):
        sys.exit(f"learner {args.learner}: run {args.run_id} has learners 0 to {len(spec.learners) - 1}")
    return spec


def srun_wrapper(island: IslandSpec) -> tuple[str, ...]:
    """The `wrapper` that starts a learner of `island` as a Slurm job of its own, one task on each of its
    nodes holding that node's GPUs (`pool.launcher: srun`, from a worker on the login node, outside any
    allocation: the job's relative node ids are then the learner's node ranks). On one node the task is
    the learner's torchrun; on several, the node launcher (`LearnerProcess` with node None). srun runs in
    a guarded process, so it dies with the segment, and ends every task of its step once one fails; the
    environment, store keys included, reaches the nodes through Slurm, never the command line.
    Partition, account and time limit come from the worker's SLURM_* variables, as srun reads them."""
    gpus = [f"--gpus-per-node={island.processes_per_node}"] if island.device == "cuda" else []
    return (*GUARDED, SRUN, f"--nodes={island.nodes_per_learner}", "--ntasks-per-node=1", *gpus,
            f"--job-name=archipelago-{island.name}", "--kill-on-bad-exit=1",
            f"--export=ALL,{PARENT_PID}={SLURM_STEP_DAEMON}")


def slurm_node_rank(nodes: int) -> int:
    """The node rank of this task of a learner on `nodes` nodes that srun started, one task per node:
    Slurm's relative node id; ValueError naming the variable unless it is one of 0 to `nodes` - 1."""
    value = os.environ.get(SLURM_NODE_ID)
    if value is None:
        raise ValueError(f"{SLURM_NODE_ID} is not set: the node launcher runs as a task that srun starts "
                         "(islands[].pool.launcher srun)")
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{SLURM_NODE_ID} {value[:32]!r} is not a node number")
    if int(value) >= nodes:
        raise ValueError(f"{SLURM_NODE_ID} {int(value)} is not one of the learner's {nodes} nodes (0 to {nodes - 1}): "
                         f"srun must start it as a job of its own with --nodes={nodes}")
    return int(value)


def threads_per_process(spec: RunSpec) -> int:
    """Share the host's cores among every learner process running on it at once: all of each learner's
    processes, or for a learner that spans several hosts those of one node."""
    processes = sum(i.learners * i.processes_per_node for i in spec.islands)
    return max(1, (os.cpu_count() or 1) // processes)


def island_cores(n: int, islands: int) -> tuple[str, ...]:
    """A command prefix that keeps island `n`'s processes on cores of its own, as separate sites' would be
    when one machine stands in for all of them (the shaped-link bench, a profiling run); with fewer
    cores than islands, none."""
    cores = os.cpu_count() or 1
    if cores < islands:
        return ()
    share = cores // islands
    return ("taskset", "-c", ",".join(str(c) for c in range(n * share, (n + 1) * share)))


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


class BoundRendezvous(StaticTCPRendezvous):
    """torchrun's static rendezvous with its store listening on one address only (port 0: one the
    kernel picks): 127.0.0.1, or for a learner on several nodes node 0's address on their network
    interface, which node 0 announces on its output for its launcher to publish. torch binds a
    store server to every interface unless handed a bound socket. The other nodes join it."""

    def get_backend(self) -> str:
        return BOUND_RENDEZVOUS

    def next_rendezvous(self):
        if not self._store and self.rank == 0:
            family = socket.AF_INET6 if ":" in self.master_addr else socket.AF_INET
            listener = socket.create_server((self.master_addr, 0), family=family)
            self.master_port = listener.getsockname()[1]
            if self.world_size > 1:
                print(announcement(Endpoint(self.master_addr, self.master_port)), flush=True)
            self._store = TCPStore(self.master_addr, self.master_port, self.world_size, True, self.timeout,
                                   master_listen_fd=listener.detach())
        return super().next_rendezvous()


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` as this process sees it (its network namespace),
    else its IPv6 address that is not link-local."""
    addresses = psutil.net_if_addrs().get(name)
    if addresses is None:
        raise ValueError(f"network interface {name!r} does not exist here (there are "
                         f"{', '.join(sorted(psutil.net_if_addrs()))}): see islands[].network_interface")
    for family in (socket.AF_INET, socket.AF_INET6):
        for entry in addresses:
            if entry.family == family and not ipaddress.ip_address(entry.address.split("%")[0]).is_link_local:
                return entry.address
    raise ValueError(f"network interface {name!r} has no IP address to listen on")


def bound_rendezvous(params: RendezvousParameters) -> BoundRendezvous:
    rank, interface = params.get_as_int("rank", 0), params.get("interface")
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    if rank == 0 and interface:
        host = interface_address(interface)
    return BoundRendezvous(host, port, rank=rank, world_size=params.max_nodes, run_id=params.run_id,
                           timeout=RENDEZVOUS_TIMEOUT_S)


def main(argv: list[str]) -> None:
    """`python -m infra.launch MODULE ARGS...`: run MODULE as `python -m` would, as a process that
    dies with its parent; torchrun (MODULE torch.distributed.run) gets the bound rendezvous."""
    die_with_parent()
    module = argv[0]
    if module == SRUN:  # srun replaces this guarded process, and so dies with the launcher too
        if shutil.which(SRUN) is None:
            sys.exit("srun is not on this host's PATH: islands[].pool.launcher srun needs a worker where Slurm's "
                     "commands are")
        os.execvp(SRUN, argv)
    if module == TORCHRUN:
        rendezvous_handler_registry.register(BOUND_RENDEZVOUS, bound_rendezvous)
    run_module(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
