"""The model's parameters as one flat vector: how fragments, messages and checkpoints address them."""

from __future__ import annotations

import torch


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """A copy of the parameters as one vector (never a view: a view would let training edit the anchor)."""
    return flat_of(model.parameters())


def flat_of(tensors) -> torch.Tensor:
    """A copy of `tensors` as one vector, in their order (torch.cat always copies)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def unflatten_into(vector: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for target in targets:
        target.copy_(vector[offset:offset + target.numel()].view_as(target))
        offset += target.numel()


def load_flat_parameters(model: torch.nn.Module, vector: torch.Tensor) -> None:
    unflatten_into(vector, list(model.parameters()))
