"""The inner optimizer every arm shares (learners, standard training, the benchmarks' loops):
AdamW with one set of betas, gradients clipped to one norm, the learning rate set per step."""

from __future__ import annotations

from collections.abc import Iterable

import torch

BETAS = (0.9, 0.95)
CLIP_NORM = 1.0


def inner_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=BETAS)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Clip the gradients backward left in `model` and step at `lr`."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
