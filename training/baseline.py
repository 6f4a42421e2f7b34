"""Standard training: the baseline every islands run is measured against.

Synchronous data parallelism with a gradient all-reduce after every step computes exactly the
gradient of the global batch; we run it as one optimizer over that global batch (the sum of the
learners' batches), drawn from the same shards. Equal compute is exact: each shard contributes
precisely the rows its learner trained on, spread evenly over the baseline's steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eval.curve import snapshot_steps
from infra import layout
from infra.spec import RunSpec
from training.data import WindowSampler, read_stream
from training.learner import build_model, flat_parameters, learning_rate


def rows_at_step(step: int, steps: int, rows: int) -> int:
    """Rows a shard contributes at `step` when `rows` are spread evenly over `steps` steps."""
    return (step + 1) * rows // steps - step * rows // steps


def train_baseline(spec: RunSpec, store, progress: Callable[[dict], None] = lambda _: None) -> dict:
    manifest = store.get_json(layout.DATA_MANIFEST)
    slots = spec.learners
    planned_rows = [slot.rows_per_round * spec.sync.rounds for slot in slots]
    global_batch = sum(slot.island.batch_size for slot in slots)
    steps = -(-sum(planned_rows) // global_batch)
    samplers = [WindowSampler(read_stream(store, manifest["shards"][slot.index]), slot.island.seq_len,
                              seed=spec.seed * 7919 + slot.index + 1_000_003) for slot in slots]
    model = build_model(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sync.inner_lr,
                                  weight_decay=spec.sync.weight_decay, betas=(0.9, 0.95))
    tokens, started = 0, time.monotonic()
    snapshots = set(snapshot_steps(spec.sync.rounds, steps))
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, spec.sync.inner_lr, spec.sync.warmup_steps)
        optimizer.zero_grad(set_to_none=True)
        step_tokens = [rows_at_step(step, steps, rows) * slot.island.seq_len for rows, slot in zip(planned_rows, slots)]
        total = sum(step_tokens)
        loss_sum = 0.0
        for sampler, rows, slot, n in zip(samplers, planned_rows, slots, step_tokens):
            if n == 0:
                continue
            inputs, targets = sampler.batch(rows_at_step(step, steps, rows))
            loss = model.loss(inputs, targets) * (n / total)  # token-weighted, as one global batch
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tokens += total
        if step in snapshots and step != steps - 1:
            store.commit_tensors(layout.baseline_snapshot(step), {"weights": flat_parameters(model)},
                                 {"tokens": tokens, "step": step})
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.monotonic() - started
            progress({"step": step + 1, "steps": steps, "loss": round(loss_sum, 4),
                      "tokens_per_s": round(tokens / elapsed), "eta_s": round(elapsed / (step + 1) * (steps - step - 1), 1)})
    weights = flat_parameters(model)
    store.commit_tensors(layout.BASELINE, {"weights": weights},
                         {"tokens": tokens, "steps": steps, "global_batch": global_batch,
                          "seconds": time.monotonic() - started})
    return {"tokens": tokens, "steps": steps, "global_batch": global_batch}
