"""What starts a learner process: its command line, one process per learner or a torchrun group per
learner (or per node of a learner on several), and the guarded entry point every learner process
starts through. Running them, and ending them, is infra/supervision.py's.

Learners get the store's address and the run id on the command line and credentials through
the inherited environment, never as arguments (arguments show up in `ps` and in logs).

Every learner process, torchrun's workers included, starts through this module's `main`, which
has the kernel kill it when its parent dies (`infra.guard`: a parent killed with SIGKILL runs no
cleanup of its own), so a learner never outlives the process that started it.

Nothing a torchrun group opens listens beyond loopback, or beyond the island's
`network_interface` for a learner that spans several nodes: its rendezvous store is bound to
127.0.0.1 or that interface's address (`infra.rendezvous.BoundRendezvous`; torchrun's own
rendezvous binds it to every interface) and gloo and NCCL are told to use `lo` or that interface
(`infra.supervision.communicating_on`). The store is unauthenticated; it carries no pickles under
the static rendezvous. Node 0 of a learner on several nodes announces the store's address on its
output; its launcher publishes it for the other nodes (infra/rendezvous.py). Each node's launcher
guards its own processes, and srun ends the other tasks of its step once one fails
(`--kill-on-bad-exit`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from datetime import datetime

from infra import layout
from infra.guard import PARENT_PID, SLURM_STEP_DAEMON, die_with_parent, run_module
from infra.rendezvous import BOUND_RENDEZVOUS, register_bound_rendezvous
from infra.spec import RunSpec, spec_sha256
from infra.spec.island import IslandSpec
from infra.store import ObjectStore

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
        register_bound_rendezvous()
    run_module(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
