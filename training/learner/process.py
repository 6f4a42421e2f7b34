"""A learner's OS process: `python -m training.learner.process --store URL --run-id RUN --spec-sha256 HASH
--learner I`, started by `infra.launch` (under `torchrun` when the learner has several
processes). It reads the run's spec from the run's store and refuses it unless it hashes to
what the control plane passed, arms its watchdog (infra/watchdog.py), opens that store and its
island's own (if it has one) with the spec's retry policy and any injected store faults, joins the
process group, and runs the learner.

The exit status tells the launcher how the segment ended: 0 when the learner finished its
rounds, `WINDOW_CLOSED` when it stopped at its capacity window's end; `watchdog.STALLED` when it
made no progress for too long; `lease.SUPERSEDED` when a newer lease term than the one it was
started under (`--lease-term`) holds the run.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime

import torch
import torch.distributed as dist

from infra import layout, watchdog
from infra.authority import Authority
from infra.lease import LeaseFence
from infra.launch import WINDOW_CLOSED
from infra.retry import RetryPolicy
from infra.spec import RunSpec, spec_sha256
from infra.store import ObjectStore
from infra.stores import RunStores
from training.learner.faults import store_faults
from training.learner.loop import Learner
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one Archipelago learner.")
    parser.add_argument("--store", required=True, help="store root URL (credentials from the environment)")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--credentials-env", default=None,
                        help="prefix of the run store's credential variables (store.credentials_env)")
    parser.add_argument("--run-id", required=True, help="run id")
    parser.add_argument("--spec-sha256", required=True,
                        help="sha256 of the run's spec as the control plane knows it; spec.json must match")
    parser.add_argument("--learner", type=int, required=True, help="global learner index")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--until", type=datetime.fromisoformat, default=None,
                        help="end of the island's capacity window (ISO 8601 with offset): stop cleanly before it")
    parser.add_argument("--lease-term", type=int, default=None,
                        help="the run's lease term of the lifecycle that started it: stop once a newer one holds the run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    raw_spec = (ObjectStore(args.store, args.endpoint_url, credentials_env=args.credentials_env)
                .child(f"runs/{args.run_id}").get_json(layout.SPEC))
    if spec_sha256(raw_spec) != args.spec_sha256:
        sys.exit(f"learner {args.learner}: the spec.json of run {args.run_id} is not the spec the control plane "
                 f"started this learner with (sha256 {spec_sha256(raw_spec)[:16]}, expected "
                 f"{args.spec_sha256[:16]}): someone else wrote it; refusing to train on it")
    spec = RunSpec.model_validate(raw_spec)
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
        learner = Learner(spec, RunStores(spec, store, faults, reader=island),
                          args.learner, rank, world)
        learner.resume()
        finished = learner.run(args.until)
    finally:
        if world > 1:
            dist.destroy_process_group()
    # torchrun reports any non-zero exit as a failure: a group's pause shows as its missing summary instead.
    return 0 if finished or world > 1 else WINDOW_CLOSED


if __name__ == "__main__":
    sys.exit(main())

