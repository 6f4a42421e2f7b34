"""How a learner's processes share its model (`islands[].parallelism`), and its state in the canonical
flat layout whatever the sharding.

`data_parallel`: every process holds the whole model; gradients are averaged after each backward
in one all-reduce. `fsdp`: torch's FSDP2 (`fully_shard`) shards each transformer block and then the
rest of the model over a one-dimensional device mesh of the learner's processes; parameters,
gradients and the inner AdamW's moments are DTensors of which a process holds one shard, and
backward reduce-scatters (averages) the gradients itself.

Two island options change how the model computes, not what it holds canonically:
`fsdp_mixed_precision` gives FSDP2 a `MixedPrecisionPolicy` that gathers each layer's parameters in
bf16 and reduce-scatters gradients in fp32 (the fp32 shards stay the weights the optimizer steps);
`activation_checkpointing` makes each transformer block keep only its input through the forward
pass and recompute its activations in backward (torch's composable `checkpoint`, which keeps the
parameters' names), under either parallelism.

Exchanges, checkpoints and the planner see neither kind of sharding: what leaves the model is
gathered into full tensors on rank 0 (`gather`, `full_copy`), and what enters it is split into every
rank's shards (`scatter` from rank 0's vector, `load` from a vector every rank holds). So islands of
different parallelism train together, and a checkpoint written under one resumes under the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from training.model.inner import average_gradients
from training.model.params import flat_of, unflatten_into


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks, each the outermost module whose parameters the model's
    `block_of` places in one block (the interface every model kind has)."""
    blocks, seen = [], set()
    for name, module in model.named_modules():
        block = model.block_of(f"{name}.") if name else None
        if block is not None and block not in seen:
            seen.add(block)
            blocks.append(module)
    return blocks


class LearnerParallelism:
    """One process's part of its learner: rank `rank` of `world`, on `device`. With one process
    both kinds are the plain model. `mixed_precision` (islands[].fsdp_mixed_precision) takes effect
    where FSDP2 shards; `activation_checkpointing` (islands[].activation_checkpointing) everywhere."""

    def __init__(self, parallelism: str, rank: int, world: int, device: torch.device,
                 mixed_precision: bool = False, activation_checkpointing: bool = False):
        self.rank, self.world, self.device = rank, world, device
        self.sharded = parallelism == "fsdp" and world > 1
        self.mixed_precision = mixed_precision and self.sharded
        self.activation_checkpointing = activation_checkpointing

    def place(self, model: torch.nn.Module) -> None:
        """Put `model` on this process's device: whole, or under fsdp sharded in place, only this
        process's shards moving to the device. Sharded parameters are DTensors: the inner optimizer is
        built after this."""
        if self.activation_checkpointing:
            for block in transformer_blocks(model):
                checkpoint(block)
        if not self.sharded:
            model.to(self.device)
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        mesh = init_device_mesh(self.device.type, (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.mixed_precision else MixedPrecisionPolicy()
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        # Training calls `loss`, which may run the model's inner modules without its own `forward`
        # (a transformers model's does): the root's parameters are gathered around it too.
        register_fsdp_forward_method(model, "loss")
        # A sparse MoE's expert that no token on this rank was routed to has no gradient here but may on
        # another rank: every rank reduce-scatters every parameter's gradient (zeros for unused ones),
        # as data parallelism averages zeros for them.
        model.set_reduce_scatter_unused_params(True)

    def sync_gradients(self, model: torch.nn.Module) -> None:
        """After backward: average the gradients over the learner's processes (fsdp did in backward)."""
        if self.world > 1 and not self.sharded:
            average_gradients(model, self.world)

    def full_copy(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A full (unsharded) copy of `tensor` on the CPU, on rank 0; None on the other ranks. Every rank
        calls it for a sharded tensor (the shards are all-gathered); a rank other than 0 of a data-parallel
        learner may skip it."""
        return self._full_on_cpu(tensor, copy=True)

    def gather(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """`tensors` as one flat vector in their order (the canonical layout) on the CPU, on rank 0; None
        on the other ranks. Called as `full_copy` is. Each full tensor reaches the CPU before the next is
        gathered, so a device holds one at a time; the vector is the one copy made."""
        if not self.sharded and self.rank != 0:
            return None
        pieces = [self._full_on_cpu(t, copy=False) for t in tensors]
        return flat_of(pieces) if self.rank == 0 else None

    def _full_on_cpu(self, tensor: torch.Tensor, copy: bool) -> torch.Tensor | None:
        """The full `tensor` on the CPU (a copy if `copy`, else possibly the tensor itself), on rank 0."""
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return full.detach().to("cpu", copy=copy) if self.rank == 0 else None

    @torch.no_grad()
    def scatter(self, vector: torch.Tensor | None, targets: Sequence[torch.Tensor]) -> None:
        """Rank 0's flat `vector` (None on the other ranks) into every rank's `targets`, each rank
        receiving only its shards under fsdp. Every rank calls it."""
        if self.world == 1:
            unflatten_into(vector.to(self.device), list(targets))
        elif not self.sharded:
            full = vector.to(self.device) if self.rank == 0 else \
                torch.empty(sum(t.numel() for t in targets), device=self.device)
            dist.broadcast(full, src=0)
            unflatten_into(full, list(targets))
        else:
            offset = 0
            for target in targets:
                piece = vector[offset:offset + target.numel()].view(target.shape).to(self.device) if self.rank == 0 \
                    else torch.empty(target.shape, device=self.device)
                target.copy_(distribute_tensor(piece, target.device_mesh, target.placements, src_data_rank=0))
                offset += target.numel()

    @torch.no_grad()
    def load(self, vector: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
        """A flat `vector` that every rank holds (a checkpoint's) into its `targets`, each rank taking its
        own shards without communicating."""
        offset = 0
        for target in targets:
            target.copy_(self.local(vector[offset:offset + target.numel()].view(target.shape), target))
            offset += target.numel()

    def local(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`full`, a whole tensor every rank holds, laid out as `like` is: this rank's shard of it
        where `like` is sharded, on the learner's device."""
        full = full.to(self.device)
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
        return full
