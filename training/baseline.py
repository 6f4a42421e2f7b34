"""Standard training: the baseline every islands run is measured against.

Synchronous data parallelism with a gradient all-reduce after every step computes exactly the
gradient of the global batch; we run it as one optimizer over that global batch (the sum of the
learners' batches), drawn from the same shards. Equal compute is exact: each shard contributes
precisely the rows its learner trained on, spread evenly over the baseline's steps, and every step
holds the global batch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from infra import layout
from infra.derived import commit_derived
from infra.spec import RunSpec
from infra.stores import RunStores
from training.data.streams import WindowSampler, read_stream
from training.model.inner import inner_optimizer, optimizer_step
from training.model.registry import initial_model
from training.model.params import flat_parameters, unflatten_into
from training.model.schedule import learning_rate, snapshot_steps


@dataclass(frozen=True)
class BaselinePlan:
    """Which rows of each shard the baseline trains at each of its steps of one global batch."""

    slots: list
    planned_rows: list[int]
    global_batch: int
    steps: int

    @classmethod
    def of(cls, spec: RunSpec) -> "BaselinePlan":
        slots = spec.learners
        planned_rows = [slot.rows_per_round * spec.sync.rounds for slot in slots]
        global_batch = spec.baseline.global_batch or sum(slot.island.batch_size for slot in slots)
        return cls(slots, planned_rows, global_batch, -(-sum(planned_rows) // global_batch))

    @functools.cached_property
    def _rows_before(self) -> np.ndarray:
        """Rows of each shard (columns) taken before each step (rows; the last: after the last step).
        The shards' rows are interleaved, each shard's spread evenly along one sequence (its k-th row at
        (k + 1/2) / its rows of the way), and step s takes the sequence's rows s*B to (s+1)*B: every
        step holds the global batch B (the last what remains), drawn from the shards in proportion,
        however B compares with the number of shards."""
        shard = np.concatenate([np.full(rows, i) for i, rows in enumerate(self.planned_rows)])
        where = np.concatenate([(np.arange(rows) + 0.5) / rows for rows in self.planned_rows])
        sequence = shard[np.lexsort((shard, where))]
        ends = np.minimum(np.arange(self.steps + 1) * self.global_batch, len(sequence))
        # Per shard, how many of its places in the sequence lie before each step's end: memory in the
        # rows plus steps x shards, never rows x shards.
        return np.stack([np.searchsorted(np.flatnonzero(sequence == i), ends)
                         for i in range(len(self.planned_rows))], axis=1)

    def step_rows(self, step: int) -> list[int]:
        """Rows each shard contributes at `step`."""
        return (self._rows_before[step + 1] - self._rows_before[step]).tolist()

    def step_tokens(self, step: int) -> list[int]:
        return [rows * slot.island.seq_len for rows, slot in zip(self.step_rows(step), self.slots)]


def shard_samplers(spec: RunSpec, store, learners: list[int], reader: str | None = None) -> dict[int, WindowSampler]:
    """The baseline's window samplers over the given learners' shards (seeded apart from the learners').
    `store`: the run's; each shard lies in its learner's island's store, where data preparation put it.
    `reader`: the island training the baseline, which reads other islands' stores with their read-only keys."""
    manifest = store.get_json(layout.DATA_MANIFEST)
    stores = RunStores(spec, store, reader=reader)
    return {i: WindowSampler(read_stream(stores.island(spec.learners[i].island.name), manifest["shards"][i]),
                             spec.learners[i].island.seq_len,
                             seed=spec.seed * 7919 + i + 1_000_003) for i in learners}


def accumulate_gradients(model, plan: BaselinePlan, samplers: dict[int, WindowSampler], step: int,
                         device: torch.device = torch.device("cpu")) -> tuple[float, int]:
    """Backward the step's rows of the shards in `samplers`, each weighted by its share of the whole
    global batch; so gradients accumulated by several processes over disjoint shards sum to the
    global batch's gradient. Returns (this part's loss contribution, the global batch's tokens)."""
    rows, step_tokens = plan.step_rows(step), plan.step_tokens(step)
    total = sum(step_tokens)
    loss_sum = 0.0
    for index, sampler in samplers.items():
        n = step_tokens[index]
        if n == 0:
            continue
        inputs, targets = sampler.batch(rows[index])
        loss = model.loss(inputs.to(device), targets.to(device)) * (n / total)  # token-weighted, as one global batch
        loss.backward()
        loss_sum += loss.item()
    return loss_sum, total


def baseline_lr(spec: RunSpec) -> float:
    return spec.baseline.lr or spec.training.lr


def baseline_optimizer(spec: RunSpec, model) -> torch.optim.Optimizer:
    return inner_optimizer(model.parameters(), baseline_lr(spec), spec.training.weight_decay)


def all_reduce_gradients(model: torch.nn.Module) -> int:
    """Sum the gradients of a torch.distributed group's ranks in one flat fp32 buffer (one
    all-reduce a step); returns the buffer's bytes."""
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    unflatten_into(flat, [p.grad for p in params])
    return flat.numel() * flat.element_size()


@dataclass(frozen=True)
class DataParallelRank:
    """This process's part of standard training run as data parallelism over several processes (one
    per island, say): the learners whose shards it trains on, how the ranks' gradients are summed
    after each backward (returns the bytes summed), and whether it commits the model."""

    learners: list[int]
    sum_gradients: Callable[[torch.nn.Module], int]
    commits: bool


def train_baseline(spec: RunSpec, store, progress: Callable[[dict], None] = lambda _: None,
                   rank: DataParallelRank | None = None, max_steps: int | None = None, device: str = "cpu",
                   reader: str | None = None) -> dict:
    """Standard training on the run's shards on `device`, in this process or (with `rank`) as one rank of
    several. `max_steps` stops early, a measured subset of the plan's steps; only a whole single-process
    run commits the snapshots the bpb curve scores. `reader`: the island it trains on, if any."""
    plan = BaselinePlan.of(spec)
    steps, global_batch = plan.steps, plan.global_batch
    run_steps = steps if max_steps is None else min(max_steps, steps)
    samplers = shard_samplers(spec, store, rank.learners if rank else [slot.index for slot in plan.slots], reader)
    on = torch.device(device)
    model = initial_model(spec, store).to(on)
    optimizer = baseline_optimizer(spec, model)
    tokens, summing, gradient_bytes, started = 0, 0.0, 0, time.monotonic()
    snapshots = set(snapshot_steps(spec.sync.rounds, steps, spec.evaluation.curve_points)) \
        if rank is None and max_steps is None else set()
    for step in range(run_steps):
        optimizer.zero_grad(set_to_none=True)
        loss_sum, total = accumulate_gradients(model, plan, samplers, step, on)
        if rank is not None:
            began = time.monotonic()
            gradient_bytes = rank.sum_gradients(model)
            summing += time.monotonic() - began
        optimizer_step(model, optimizer, learning_rate(step, steps, baseline_lr(spec), spec.training.warmup_steps))
        tokens += total
        if step in snapshots and step != steps - 1:
            commit_derived(store, layout.baseline_snapshot(step), {"weights": flat_parameters(model).cpu()},
                           {"tokens": tokens, "step": step})
        if step % 25 == 0 or step == run_steps - 1:
            elapsed = time.monotonic() - started
            progress({"step": step + 1, "steps": run_steps, "loss": round(loss_sum, 4),
                      "tokens_per_s": round(tokens / elapsed),
                      "eta_s": round(elapsed / (step + 1) * (run_steps - step - 1), 1)})
    seconds = time.monotonic() - started
    result = {"tokens": tokens, "steps": run_steps, "steps_planned": steps, "global_batch": global_batch}
    if rank is None or rank.commits:
        commit_derived(store, layout.BASELINE, {"weights": flat_parameters(model).cpu()}, {**result, "seconds": seconds})
    if rank is not None:
        result.update(seconds_wall=seconds, seconds_summing=summing, gradient_bytes_per_step=gradient_bytes)
    return result
