"""A run's learners as replicas in one process: the cheap path for sweeps.

`train_replicas` trains every learner of a run as one replica of a single vmapped model (torch.func).
Each replica draws its learner's rows from its learner's shard round by round, as the learner's
process would (`WindowSampler.start_round`), and steps AdamW with its gradients clipped by their own
norm (`replicas_step`). Each round its fragment goes through its learner's real `Exchanger` over an
in-memory channel (`MemoryChannel`): the messages, mixing, compression and outer steps are the
learner path's own, applied `tau` inner steps later as the learner applies them.

What it leaves out is what a sweep does not measure: processes, stores for messages and checkpoints,
capacity windows, faults and timing. On 2 CPU cores it is several times faster than the learner
processes: a small model's step costs mostly per-operation overhead, which one vmapped step pays once
for every replica. A benchmark that uses it shows one arm matching the learner path
(`bench.size_scaling --check-path`).

The replicas share one shape, so every island has the same rows per step, sequence length, inner
steps and arithmetic (CPU, fp32, one process per learner), and the model is the built-in dense byte
GPT: an MoE routes tokens by their values, which vmap cannot batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from infra import layout
from infra.spec import RunSpec
from infra.stores import RunStores
from training.data.streams import WindowSampler, read_stream
from training.exchange.channel import MemoryChannel
from training.exchange.exchanger import Exchange, Exchanger
from training.model.inner import inner_optimizer, replicas_step
from training.model.params import flat_parameters
from training.model.registry import initial_model
from training.model.schedule import learning_rate


class NotReplicable(ValueError):
    """A run the replica path cannot train as its learners would be trained; says what differs."""


def check_replicable(spec: RunSpec) -> None:
    shapes = {(i.batch_size, i.seq_len, i.inner_steps) for i in spec.islands}
    if len(shapes) > 1:
        raise NotReplicable(f"islands differ in (batch_size, seq_len, inner_steps): {sorted(shapes)}; "
                            "the replica path trains every learner in one batched step")
    for island in spec.islands:
        if (island.device, island.precision, island.processes_per_learner) != ("cpu", "fp32", 1):
            raise NotReplicable(f"island {island.name}: the replica path runs one fp32 CPU process per learner, not "
                                f"{island.device}, {island.precision}, {island.processes_per_learner} processes")
    if spec.model.kind != "byte_gpt" or spec.model.moe is not None:
        raise NotReplicable("the replica path trains the built-in dense byte GPT only (an MoE's routing "
                            "depends on token values, which vmap cannot batch)")
    if spec.faults:
        raise NotReplicable("faults are injected into learner processes; the replica path has none")


class _Loss(torch.nn.Module):
    """The model's training loss as a module's forward, for `functional_call`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(inputs, targets)


class Replicas:
    """Every learner's parameters, stacked along a new first dimension, with their inner optimizer."""

    def __init__(self, spec: RunSpec, model: torch.nn.Module):
        self.learners = len(spec.learners)
        self.model = model
        self.stacked = {name: p.detach().unsqueeze(0).repeat(self.learners, *[1] * p.dim()).requires_grad_()
                        for name, p in model.named_parameters()}
        self.optimizer = inner_optimizer(self.stacked.values(), spec.training.lr, spec.training.weight_decay)
        wrapped = _Loss(model)
        self._losses = vmap(lambda params, inputs, targets: functional_call(
            wrapped, {f"model.{name}": p for name, p in params.items()}, (inputs, targets)))

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, lr: float) -> torch.Tensor:
        """One inner step of every replica on its rows (`inputs[m]`); returns each replica's loss."""
        self.optimizer.zero_grad(set_to_none=False)
        # Attention as plain matrix products, which vmap batches; the fused CPU kernel it has no rule for
        # would run once per replica.
        with sdpa_kernel(SDPBackend.MATH):
            losses = self._losses(self.stacked, inputs, targets)
        losses.sum().backward()
        replicas_step(list(self.stacked.values()), self.optimizer, lr)
        return losses.detach()

    def read(self, learner: int, names: tuple[str, ...]) -> torch.Tensor:
        """A copy of one replica's parameters `names`, as one vector in their order."""
        return torch.cat([self.stacked[name][learner].detach().reshape(-1) for name in names])

    @torch.no_grad()
    def write(self, learner: int, names: tuple[str, ...], flat: torch.Tensor) -> None:
        sizes = [self.stacked[name][learner].numel() for name in names]
        for name, values in zip(names, flat.split(sizes)):
            self.stacked[name][learner].copy_(values.view_as(self.stacked[name][learner]))


def train_replicas(spec: RunSpec, stores: RunStores, progress: Callable[[dict], None] | None = None
                   ) -> list[torch.Tensor]:
    """Train the run's learners as replicas; returns each learner's final flat weights. `progress` gets
    each round's {round, rounds, loss (mean over replicas)}."""
    check_replicable(spec)
    model = initial_model(spec, stores.run)
    initial = flat_parameters(model)
    channel = MemoryChannel(len(spec.learners))
    exchangers = [Exchanger(spec, slot, channel, model, initial) for slot in spec.learners]
    names = exchangers[0].layout.names
    replicas = Replicas(spec, model)
    shards = stores.run.get_json(layout.DATA_MANIFEST)["shards"]
    island = spec.islands[0]
    samplers = [WindowSampler(read_stream(stores.learner(slot.index), shards[slot.index]), island.seq_len, seed=spec.seed)
                for slot in spec.learners]
    rounds, steps = spec.sync.rounds, island.inner_steps
    pending: list[Exchange] = []

    def apply() -> None:
        nonlocal pending
        for learner, (exchanger, exchange) in enumerate(zip(exchangers, pending)):
            fragment = names[exchange.fragment]
            weights, _ = exchanger.apply(exchange, replicas.read(learner, fragment))
            replicas.write(learner, fragment, weights)
        pending = []

    try:
        for t in range(rounds):
            for slot, sampler in zip(spec.learners, samplers):
                sampler.start_round(spec.seed, slot.index, t)
            losses = []
            for h in range(steps):
                rows = [sampler.batch(island.batch_size) for sampler in samplers]
                loss = replicas.step(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                                     learning_rate(t * steps + h, steps * rounds, spec.training.lr, spec.training.warmup_steps))
                losses.append(loss)
                if pending and exchangers[0].due(h + 1):
                    apply()
            if pending:  # tau equals the inner steps
                apply()
            mean_loss = torch.stack(losses).mean().item()
            if not math.isfinite(mean_loss):
                raise FloatingPointError(f"round {t}: the replicas' inner loss is {mean_loss}")
            fragment = exchangers[0].fragment_of(t).number
            pending = [exchanger.start(t, replicas.read(learner, names[fragment]))
                       for learner, exchanger in enumerate(exchangers)]
            if exchangers[0].due(0) or t == rounds - 1:
                apply()
            if progress:
                progress({"round": t, "rounds": rounds, "loss": mean_loss})
    finally:
        channel.close()
    return [replicas.read(learner, tuple(replicas.stacked)) for learner in range(len(spec.learners))]
