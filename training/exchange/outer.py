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
dotted path) plus JSON scalars (step counters), never pickled, and restores exactly. A restore
fills the slots of a freshly built optimizer of the configured kind, and only those: a saved path
names one of them, or the whole state is refused (`StateRejected`); the paths are never walked as
attribute names, and each value must have its slot's type, shape and dtype and be finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from training.exchange.messages import short


class StateRejected(ValueError):
    """Saved optimizer state that does not fit the optimizer the spec builds; says which entry."""


TENSOR_PREFIX = "outer."
MAX_OUTER_STEPS = 10**9  # a step count beyond any run: a larger one is not a count


class OuterOptimizer:
    """A torch optimizer over parameter-shaped copies of the anchor, behind a flat interface."""

    def __init__(self, shapes: list[torch.Size], build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 materialise_state: Callable[[torch.optim.Optimizer], None]):
        """`materialise_state` makes the optimizer build its per-parameter state (to be overwritten by a restore)."""
        self.params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        self.sizes = [p.numel() for p in self.params]
        # A learner whose shard of a fragment's outer step holds no parameter (fewer than its group) steps nothing.
        self.optimizer = build(self.params) if self.params else None
        self._materialise_state = materialise_state

    @classmethod
    def from_spec(cls, outer_spec, shapes: list[torch.Size]) -> "OuterOptimizer":
        if outer_spec.name == "nesterov":
            return cls(shapes, lambda params: torch.optim.SGD(
                params, lr=outer_spec.lr, momentum=outer_spec.momentum, nesterov=outer_spec.momentum > 0),
                materialise_state=_zero_gradient_step)
        # pytorch-optimizer (and the transformers it imports) only where Shampoo is the outer optimizer:
        # a learner process of any other run starts a second sooner without it.
        from training.exchange.shampoo import build_shampoo, init_shampoo_state

        return cls(shapes, lambda params: build_shampoo(params, outer_spec), materialise_state=init_shampoo_state)

    def materialise_state(self) -> None:
        """Build the optimizer's per-parameter state as its first step does: to be overwritten by a
        restore, or counted (`training.planning.memory`, on the meta device)."""
        if self.optimizer is not None:
            self._materialise_state(self.optimizer)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.view_as(p) for part, p in zip(flat.split(self.sizes), self.params)]

    @torch.no_grad()
    def step(self, anchor: torch.Tensor, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """Next anchor: one optimizer step from `anchor` with `pseudo_gradient` as the gradient."""
        if self.optimizer is None:
            return anchor.clone()
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
        if self.optimizer is None:
            return tensors, scalars
        for i, p in enumerate(self.params):
            for path, slot in _slots(self.optimizer.state.get(p, {})):
                value = slot.template
                if torch.is_tensor(value):
                    tensors[f"{TENSOR_PREFIX}{i}.{path}"] = value.detach().clone().contiguous()
                else:
                    scalars["params"][f"{i}.{path}"] = value
        for group in self.optimizer.param_groups:
            scalars["groups"].append({k: v for k, v in group.items() if k == "step"})
        return tensors, scalars

    def load_state(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """Restore `state()`'s output into this optimizer, or raise StateRejected and change nothing
        that the next restore would not overwrite."""
        ours = {k[len(TENSOR_PREFIX):]: v for k, v in tensors.items() if k.startswith(TENSOR_PREFIX)}
        params = scalars.get("params", {}) if isinstance(scalars, dict) else None
        groups = scalars.get("groups", []) if isinstance(scalars, dict) else None
        if self.optimizer is None and (ours or params or groups):
            raise StateRejected("outer optimizer state: this learner's shard of the fragment has no parameters")
        if self.optimizer is None:
            return
        if not isinstance(params, dict) or not isinstance(groups, list) or len(groups) > len(self.optimizer.param_groups):
            raise StateRejected("outer optimizer state: scalars are not {params: {...}, groups: [...]}")
        for saved in groups:
            if not isinstance(saved, dict) or set(saved) - {"step"} or \
                    not all(type(v) is int and 0 <= v <= MAX_OUTER_STEPS for v in saved.values()):
                raise StateRejected("outer optimizer state: a param group may only restore its step count")
        if not ours and not params and not any(groups):
            # A checkpoint from before the fragment's first outer step (its first exchange not yet applied):
            # the fresh optimizer is that state, which built state is not.
            return
        self.materialise_state()
        slots = {f"{i}.{path}": slot for i, p in enumerate(self.params)
                 for path, slot in _slots(self.optimizer.state.get(p, {}))}
        updates = [(slots.get(key), key, value) for key, value in list(ours.items()) + list(params.items())]
        for slot, key, value in updates:
            if slot is None:
                raise StateRejected(f"outer optimizer state: {short(key)} is not an entry of a "
                                    f"{type(self.optimizer).__name__}'s state")
            slot.check(key, value)
        for slot, _, value in updates:
            slot.assign(value)
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update(saved)


def _zero_gradient_step(optimizer: torch.optim.Optimizer) -> None:
    """Let torch's SGD build its momentum buffers: a step on zero gradients (it moves nothing), to be overwritten."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


class _Slot:
    """One leaf of a freshly built optimizer's state: where it sits and what it holds now."""

    def __init__(self, container, key, template):
        self.container, self.key, self.template = container, key, template

    def check(self, name: str, value) -> None:
        want = self.template
        if torch.is_tensor(want):
            if not torch.is_tensor(value) or value.dtype != want.dtype or value.shape != want.shape:
                raise StateRejected(f"outer optimizer state: {short(name)} must be {want.dtype} {tuple(want.shape)}")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise StateRejected(f"outer optimizer state: {short(name)} holds non-finite values")
        elif type(value) is not type(want) or (isinstance(value, float) and not math.isfinite(value)):
            raise StateRejected(f"outer optimizer state: {short(name)} must be a finite {type(want).__name__}")

    def assign(self, value) -> None:
        value = value.clone() if torch.is_tensor(value) else value
        if isinstance(self.container, (dict, list)):
            self.container[self.key] = value
        else:  # a library state object: the attribute name comes from its own fresh instance, never from data
            setattr(self.container, self.key, value)


def _slots(value, path: str = "") -> Iterator[tuple[str, _Slot]]:
    """(dotted path, slot) for every tensor or number in a state entry: dicts, lists of tensors and the
    library's state objects (their tensor attributes, and lists of them). `state` saves what it finds
    here in the live optimizer, and `load_state` restores only into what it finds in a fresh one."""
    join = (lambda key: f"{path}.{key}") if path else str
    if isinstance(value, dict):
        for key, item in value.items():
            if torch.is_tensor(item) or isinstance(item, (int, float, bool)):
                yield join(key), _Slot(value, key, item)
            else:
                yield from _slots(item, join(key))
    elif isinstance(value, list):
        for j, item in enumerate(value):
            if torch.is_tensor(item):
                yield join(j), _Slot(value, j, item)
    elif hasattr(value, "__dict__"):
        for key, item in vars(value).items():
            if torch.is_tensor(item):
                yield join(key), _Slot(value, key, item)
            elif isinstance(item, list) and item and all(torch.is_tensor(t) for t in item):
                yield from _slots(item, join(key))
