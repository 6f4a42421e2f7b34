"""The inner optimizer every arm shares (learners, standard training, the benchmarks' loops):
AdamW with one set of betas, gradients clipped to one norm, the learning rate set per step."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from training.model.params import unflatten_into

BETAS = (0.9, 0.95)
CLIP_NORM = 1.0


def inner_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS)


def forward_precision(device: torch.device, precision: str) -> AbstractContextManager:
    """Where a forward and backward pass runs in bf16: autocast keeps the weights fp32 and casts per
    operation, so losses and reductions stay fp32 and what a learner sends is unchanged in kind."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> torch.Tensor:
    """Clip the gradients backward left in `model` and step at `lr`. Returns the gradients' norm before
    clipping, as a tensor on the model's device (reading it is left to the caller: it waits for the device)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
    # Sharded (FSDP2) gradients give each process its shards' part of the norm: the whole is one scalar's
    # all-reduce, which every process of the learner makes here.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Average the gradients over a learner's data-parallel process group, in one all-reduce."""
    params = list(model.parameters())
    for p in params:
        if p.grad is None:  # an expert no token was routed to on this rank
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world
    unflatten_into(flat, [p.grad for p in params])
