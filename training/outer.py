"""Outer optimizers: they turn a mixed pseudo-gradient into the next round's anchor.

Learners exchange one flat vector of the model's parameters, so the interface is flat: a flat
anchor and a flat mixed pseudo-gradient in, the next flat anchor out. Inside, the optimizer works
on parameter-shaped tensors (views of the model's shapes), because Shampoo preconditions each
weight matrix by its row and column statistics; for Nesterov the shapes make no difference.

Two optimizers, chosen by `sync.outer.name`:
- `nesterov`: DiLoCo's outer step, torch SGD with Nesterov momentum (DiLoCo: lr 0.7, momentum 0.9).
- `shampoo`: pytorch-optimizer's `ScalableShampoo` (Anil et al.'s scalable Shampoo, the
  algorithm Distributed Shampoo is built on), with layer-wise grafting: each parameter's step
  takes its direction from Shampoo and its norm from a simple optimizer on the same
  pseudo-gradient. SGD grafting is the default because on the outer loop SGD's step is the one
  we trust: with lr 1 and no momentum it is exactly "move to the mixed learners' weights", so a
  grafted Shampoo step moves as far as plain averaging would and only turns the direction.

State is saved as safetensors (every tensor reachable from the optimizer's state, under a
dotted path) plus JSON scalars (step counters), never pickled, and restores exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from pytorch_optimizer import ScalableShampoo
from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting

GRAFTS = {"sgd": LayerWiseGrafting.SGD, "adagrad": LayerWiseGrafting.ADAGRAD, "rmsprop": LayerWiseGrafting.RMSPROP}
TENSOR_PREFIX = "outer."


class OuterOptimizer:
    """A torch optimizer over parameter-shaped copies of the anchor, behind a flat interface."""

    def __init__(self, shapes: list[torch.Size], build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 materialise_state: Callable[[torch.optim.Optimizer], None] | None = None):
        self.params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        self.sizes = [p.numel() for p in self.params]
        self.optimizer = build(self.params)
        self._materialise_state = materialise_state

    @classmethod
    def from_spec(cls, outer_spec, shapes: list[torch.Size]) -> "OuterOptimizer":
        if outer_spec.name == "nesterov":
            return cls(shapes, lambda params: torch.optim.SGD(
                params, lr=outer_spec.lr, momentum=outer_spec.momentum, nesterov=outer_spec.momentum > 0))
        shampoo = outer_spec.shampoo
        return cls(shapes, lambda params: ScalableShampoo(
            params, lr=outer_spec.lr, betas=(outer_spec.momentum, shampoo.beta2),
            nesterov=outer_spec.momentum > 0, graft_type=GRAFTS[shampoo.graft],
            start_preconditioning_step=shampoo.start_preconditioning_step,
            preconditioning_compute_steps=shampoo.preconditioning_compute_steps,
            block_size=shampoo.block_size, matrix_eps=shampoo.matrix_eps,
            # Inverse roots by SVD: the library's default Schur-Newton iteration seeds a power
            # iteration from the global RNG, so learners with the same inputs and state (all of
            # them in allreduce mode; a restored learner and its uninterrupted self) would not
            # land on bit-identical anchors.
            use_svd=True),
            materialise_state=_init_pytorch_optimizer_state)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.view_as(p) for part, p in zip(flat.split(self.sizes), self.params)]

    @torch.no_grad()
    def step(self, anchor: torch.Tensor, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """Next anchor: one optimizer step from `anchor` with `pseudo_gradient` as the gradient."""
        for p, a, g in zip(self.params, self._views(anchor), self._views(pseudo_gradient)):
            p.copy_(a)
            p.grad = g.clone()  # optimizers may edit the gradient in place
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        return torch.cat([p.detach().reshape(-1) for p in self.params]).clone()

    # -- state ------------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors for safetensors, JSON scalars): everything the next step depends on."""
        tensors, scalars = {}, {"groups": [], "params": {}}
        for i, p in enumerate(self.params):
            for path, value in _walk(self.optimizer.state.get(p, {})):
                if torch.is_tensor(value):
                    tensors[f"{TENSOR_PREFIX}{i}.{path}"] = value.detach().clone().contiguous()
                else:
                    scalars["params"][f"{i}.{path}"] = value
        for group in self.optimizer.param_groups:
            scalars["groups"].append({k: v for k, v in group.items() if k == "step"})
        return tensors, scalars

    def load_state(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        ours = {k[len(TENSOR_PREFIX):]: v for k, v in tensors.items() if k.startswith(TENSOR_PREFIX)}
        if not ours and not scalars.get("groups"):
            return  # a checkpoint from before the first outer step
        if self._materialise_state is not None:
            self._materialise_state(self.optimizer)
        for key, value in list(ours.items()) + list(scalars.get("params", {}).items()):
            index, path = key.split(".", 1)
            _assign(self.optimizer.state[self.params[int(index)]], path.split("."), value)
        for group, saved in zip(self.optimizer.param_groups, scalars.get("groups", [])):
            group.update(saved)


def _init_pytorch_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Let the library build its per-parameter state objects (preconditioners, grafts), to be overwritten."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
        optimizer.init_group(group)
        for p in group["params"]:
            p.grad = None


def _walk(value, path: str = "") -> Iterator[tuple[str, object]]:
    """(dotted path, leaf) for every tensor or number in a state entry: dicts, lists and the
    library's state objects (their attributes)."""
    join = (lambda key: f"{path}.{key}") if path else str
    if torch.is_tensor(value) or isinstance(value, (int, float, bool)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, join(key))
    elif isinstance(value, (list, tuple)):
        for j, item in enumerate(value):
            if torch.is_tensor(item):
                yield join(j), item
    elif hasattr(value, "__dict__"):
        for key, item in vars(value).items():
            if torch.is_tensor(item) or (isinstance(item, list) and item and all(torch.is_tensor(t) for t in item)):
                yield from _walk(item, join(key))


def _assign(container, path: list[str], value) -> None:
    head, rest = path[0], path[1:]
    if isinstance(container, dict):
        if rest:
            _assign(container[head], rest, value)
        else:
            container[head] = value.clone() if torch.is_tensor(value) else value
    elif isinstance(container, list):
        if rest:
            _assign(container[int(head)], rest, value)
        else:
            container[int(head)] = value.clone()
    elif rest:
        _assign(getattr(container, head), rest, value)
    else:
        setattr(container, head, value.clone() if torch.is_tensor(value) else value)

