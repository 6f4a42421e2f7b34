"""A learner's OS process: `python -m training.learner.process --store URL --run-id RUN --spec-sha256 HASH
--learner I`, started by `infra.launch` (under `torchrun` when the learner has several
processes). It reads the run's spec from the run's store and refuses it unless it hashes to
what the control plane passed, arms its watchdog (infra/watchdog.py), opens that store and its
island's own (if it has one) with the spec's retry policy and any injected store faults, joins the
process group, and runs the learner.

The exit status tells the launcher how the segment ended: 0 when the learner finished its
rounds, `WINDOW_CLOSED` when it stopped at its capacity window's end; `watchdog.STALLED` when it
made no progress for too long; `lease.SUPERSEDED` when a newer lease term than the one it was
started under (`--lease-term`) holds the run; `MISCONFIGURED` when it cannot start as the spec asks
on this host (an island of device cuda on a host without one).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from infra import watchdog
from infra.authority import Authority
from infra.lease import LeaseFence
from infra.launch import MISCONFIGURED, WINDOW_CLOSED, learner_arguments, started_spec
from infra.retry import RetryPolicy
from infra.store import ObjectStore
from infra.stores import RunStores
from training.learner.faults import LearnerFaults, store_faults
from training.learner.loop import Learner
def main(argv: list[str] | None = None) -> int:
    parser = learner_arguments("Run one Archipelago learner.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    spec = started_spec(args)
    slot = spec.learners[args.learner]
    if slot.island.device == "cuda" and not torch.cuda.is_available():
        print(f"learner {args.learner}: island {slot.island.name} has device cuda, and torch finds no CUDA device "
              "on this host", flush=True)
        return MISCONFIGURED
    watchdog.arm(spec.learner_stall_limit_s, f"learner {args.learner} (rank {rank})")
    faults = store_faults(spec, args.learner)
    island = spec.learners[args.learner].island.name
    store = ObjectStore(args.store, args.endpoint_url,
                        RetryPolicy(attempts=spec.store.retry_attempts, budget_s=spec.store.retry_budget_s),
                        faults, spec.store.credentials_env, Authority.of(spec, island)).child(f"runs/{args.run_id}")
    if args.lease_term is not None and rank == 0:  # the group's other ranks end with it
        # Without injected faults: the fence's reads are no part of a drill's store traffic.
        LeaseFence(ObjectStore(args.store, args.endpoint_url, store.retry, credentials_env=spec.store.credentials_env,
                               authority=Authority.of(spec, None)).child(f"runs/{args.run_id}"),
                   args.lease_term, f"learner {args.learner}").start()
    if world > 1:
        dist.init_process_group("nccl" if spec.learners[args.learner].island.device == "cuda" else "gloo")
    try:
        stores = RunStores(spec, store, faults, reader=island)
        learner = Learner(spec, stores, args.learner, rank, world)
        LearnerFaults(spec, stores, args.learner).attach(learner)
        learner.resume()
        finished = learner.run(args.until)
    finally:
        if world > 1:
            dist.destroy_process_group()
    # torchrun reports any non-zero exit as a failure: a group's pause shows as its missing summary instead.
    return 0 if finished or world > 1 else WINDOW_CLOSED


if __name__ == "__main__":
    sys.exit(main())

