"""Standard training as it would really run across islands: one gloo process per island, a gradient
all-reduce over the inter-island link after every step.

Each rank trains on its own island's shards with `training.baseline`'s plan and samplers (each
shard's rows weighted by their share of the whole global batch), so the summed gradient is exactly
the standard baseline's and both see the same tokens. Run by `benchmarks/shaped_link.py`, one process
per island network namespace:

    MASTER_ADDR=... MASTER_PORT=... RANK=r WORLD_SIZE=2 GLOO_SOCKET_IFNAME=veth \\
        python -m benchmarks.allreduce_dp --store URL --run-id RUN --island NAME [--max-steps N]

`--max-steps` stops after N steps (a measured subset, for links too slow to run them all); the
summary says how many of the plan's steps ran. Credentials come from the environment. Rank 0
commits the final weights as the run's baseline model. Progress and the summary are JSON lines.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from infra import layout
from infra.spec import RunSpec
from infra.store import ObjectStore
from training.baseline import DataParallelRank, all_reduce_gradients, train_baseline
from training.events import emit


def train(spec: RunSpec, store: ObjectStore, island: str, max_steps: int | None) -> dict:
    rank = dist.get_rank()
    mine = [slot.index for slot in spec.learners if slot.island.name == island]
    if not mine:
        raise SystemExit(f"--island {island!r}: no such island in the run's spec")
    dist.barrier()  # both ranks have their data: from here on the link carries only gradients
    if rank == 0:
        emit("started")
    result = train_baseline(spec, store, lambda p: emit("step", **p) if rank == 0 else None,
                            DataParallelRank(mine, all_reduce_gradients, commits=rank == 0), max_steps)
    return {"rank": rank, "island": island, "learners": mine, "steps_run": result["steps"],
            "steps_planned": result["steps_planned"], "global_tokens": result["tokens"],
            "gradient_bytes_per_step": result["gradient_bytes_per_step"], "seconds_wall": result["seconds_wall"],
            "seconds_computing": result["seconds_wall"] - result["seconds_summing"],
            "seconds_communicating": result["seconds_summing"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One island's rank of per-step all-reduce data parallelism.")
    parser.add_argument("--store", required=True, help="store root URL (credentials from the environment)")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--island", required=True, help="the island whose shards this rank trains on")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (a measured subset)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    store = ObjectStore(args.store, args.endpoint_url).child(f"runs/{args.run_id}")
    spec = RunSpec.model_validate(store.get_json(layout.SPEC))
    dist.init_process_group("gloo", timeout=timedelta(seconds=1800))
    try:
        emit("summary", **train(spec, store, args.island, args.max_steps))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
