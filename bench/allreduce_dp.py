"""Standard training as it would really run across islands: one gloo process per island, a gradient
all-reduce over the inter-island link after every step.

Each rank trains on its own island's shards with `training.baseline`'s plan and samplers (each
shard's rows weighted by their share of the whole global batch), so the summed gradient is exactly
the standard baseline's and both see the same tokens. Run by `bench/shaped_link.py`, one process
per island network namespace:

    MASTER_ADDR=... MASTER_PORT=... RANK=r WORLD_SIZE=2 GLOO_SOCKET_IFNAME=veth \\
        python -m bench.allreduce_dp --store URL --run-id RUN --island NAME [--max-steps N]

`--max-steps` stops after N steps (a measured subset, for links too slow to run them all); the
summary says how many of the plan's steps ran. Credentials come from the environment. Rank 0
commits the final weights as the run's baseline model. Progress and the summary are JSON lines.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from infra import layout
from infra.spec import RunSpec
from infra.store import ObjectStore
from training.baseline import BaselinePlan, accumulate_gradients, baseline_lr, baseline_optimizer, shard_samplers
from training.learner.events import emit
from training.model.inner import optimizer_step
from training.model.gpt import build_model
from training.model.params import flat_parameters, unflatten_into
from training.model.schedule import learning_rate


def all_reduce_gradients(model: torch.nn.Module) -> int:
    """Sum the ranks' gradients in one flat fp32 buffer; returns the buffer's bytes."""
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    unflatten_into(flat, [p.grad for p in params])
    return flat.numel() * flat.element_size()


def train(spec: RunSpec, store: ObjectStore, island: str, max_steps: int | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = BaselinePlan.of(spec)
    mine = [slot.index for slot in plan.slots if slot.island.name == island]
    if not mine:
        raise SystemExit(f"--island {island!r}: no such island in the run's spec")
    samplers = shard_samplers(spec, store, mine)
    model = build_model(spec)
    optimizer = baseline_optimizer(spec, model)
    steps = plan.steps if max_steps is None else min(max_steps, plan.steps)
    computing = communicating = 0.0
    gradient_bytes = tokens = 0
    dist.barrier()  # both ranks have their data: from here on the link carries only gradients
    if rank == 0:
        emit("started", steps=steps)
    started = time.monotonic()
    for step in range(steps):
        t0 = time.monotonic()
        optimizer.zero_grad(set_to_none=True)
        loss, total = accumulate_gradients(model, plan, samplers, step)
        t1 = time.monotonic()
        gradient_bytes = all_reduce_gradients(model)
        t2 = time.monotonic()
        optimizer_step(model, optimizer, learning_rate(step, plan.steps, baseline_lr(spec), spec.sync.warmup_steps))
        computing += (t1 - t0) + (time.monotonic() - t2)
        communicating += t2 - t1
        tokens += total
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            elapsed = time.monotonic() - started
            emit("step", step=step + 1, steps=steps, loss_part=round(loss, 4),
                 tokens_per_s=round(tokens / elapsed), eta_s=round(elapsed / (step + 1) * (steps - step - 1), 1))
    wall = time.monotonic() - started
    if rank == 0:
        store.commit_tensors(layout.BASELINE, {"weights": flat_parameters(model)},
                             {"tokens": tokens, "steps": steps, "global_batch": plan.global_batch,
                              "seconds": wall, "transport": f"gloo all-reduce over {world} islands"})
    return {"rank": rank, "island": island, "learners": mine, "steps_run": steps, "steps_planned": plan.steps,
            "global_tokens": tokens, "gradient_bytes_per_step": gradient_bytes, "seconds_wall": wall,
            "seconds_computing": computing, "seconds_communicating": communicating}


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
