"""Outer optimizers: they turn a mixed pseudo-gradient into the next round's anchor.

They work on one flat vector of the model's parameters, which is what learners exchange. Their
state is a handful of tensors so it checkpoints as safetensors next to the weights.
"""

from __future__ import annotations

import torch


class OuterOptimizer:
    """DiLoCo's outer step: SGD with Nesterov momentum on pseudo-gradients (lr 0.7, momentum 0.9)."""

    def __init__(self, size: int, lr: float, momentum: float):
        self.weights = torch.nn.Parameter(torch.zeros(size))
        self.optimizer = torch.optim.SGD([self.weights], lr=lr, momentum=momentum, nesterov=momentum > 0)

    @classmethod
    def from_spec(cls, outer_spec, size: int) -> "OuterOptimizer":
        return cls(size, lr=outer_spec.lr, momentum=outer_spec.momentum)

    @torch.no_grad()
    def step(self, anchor: torch.Tensor, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """Next anchor: one optimizer step from `anchor` with `pseudo_gradient` as the gradient."""
        self.weights.copy_(anchor)
        self.weights.grad = pseudo_gradient.clone()
        self.optimizer.step()
        self.weights.grad = None
        return self.weights.detach().clone()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        state = self.optimizer.state.get(self.weights, {})
        buffer = state.get("momentum_buffer")
        return {} if buffer is None else {"outer.momentum": buffer.clone()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if "outer.momentum" in tensors:
            self.optimizer.state[self.weights]["momentum_buffer"] = tensors["outer.momentum"].clone()
