"""One learner: a model replica that trains on its shard and talks to other learners only
through the object store.

Run as its own OS process: `python -m training.learner --store URL --run-id RUN --learner I`,
or under `torchrun` when the learner is data-parallel over several processes. Rank 0 owns all
store traffic; the other ranks only compute, and receive each round's new weights by broadcast.

A round: remember the anchor θ, take H AdamW steps to x, send (θ, Δ = θ − x), receive what
the round's peers sent, mix (see `training.mixing`), take an outer step, checkpoint. The
checkpoint of round t is the learner's whole state, so a restarted learner resumes from its
newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from infra import layout
from infra.spec import LearnerSlot, RunSpec
from infra.store import ObjectStore
from training.data import WindowSampler, read_stream
from training.mixing import butterfly_partner, mix_pair, weighted_mean
from training.model import ByteGPT, GPTConfig
from training.outer import OuterOptimizer


def build_model(spec: RunSpec) -> ByteGPT:
    """The run's initial model: every learner and the baseline start from these same weights."""
    torch.manual_seed(spec.seed)
    return ByteGPT(GPTConfig.from_spec(spec.model, spec.max_seq_len))


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """A copy of the parameters as one vector (never a view: a view would let training edit the anchor)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


@torch.no_grad()
def unflatten_into(vector: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for target in targets:
        target.copy_(vector[offset:offset + target.numel()].view_as(target))
        offset += target.numel()


def load_flat_parameters(model: torch.nn.Module, vector: torch.Tensor) -> None:
    unflatten_into(vector, list(model.parameters()))


def learning_rate(step: int, total_steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak: the same shape for every arm."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class Traffic:
    """Bytes this learner moved through the store, by link class."""

    written: int = 0
    read_intra: int = 0
    read_inter: int = 0
    checkpoint: int = 0
    seconds_computing: float = 0.0
    seconds_syncing: float = 0.0
    rounds: list[dict] = field(default_factory=list)


def emit(event: str, **fields) -> None:
    """One JSON line of progress on stdout; the island's Prefect task relays it to the run's logs."""
    print(json.dumps({"event": event, **fields}), flush=True)


class Learner:
    def __init__(self, spec: RunSpec, store: ObjectStore, index: int, rank: int = 0, world: int = 1):
        self.spec, self.store = spec, store
        self.slot: LearnerSlot = spec.learners[index]
        self.rank, self.world = rank, world
        self.device = torch.device(self.slot.island.device if self.slot.island.device == "cpu"
                                   else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        self.model = build_model(spec).to(self.device)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=spec.sync.inner_lr,
                                       weight_decay=spec.sync.weight_decay, betas=(0.9, 0.95))
        self.outer = OuterOptimizer.from_spec(spec.sync.outer, flat_parameters(self.model).numel())
        manifest = store.get_json(layout.DATA_MANIFEST)
        shard = read_stream(store, manifest["shards"][index])
        self.sampler = WindowSampler(shard, self.slot.island.seq_len, seed=spec.seed)
        self.rows = self.slot.island.batch_size // world
        self.traffic = Traffic()
        self.start_round = 0

    # -- state ------------------------------------------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest checkpoint this learner committed, if any."""
        for t in reversed(range(self.spec.sync.rounds)):
            key = layout.checkpoint(self.slot.index, t)
            if self.store.is_committed(key):
                tensors, meta, _ = self.store.read_committed(key)
                self._load_state(tensors, meta)
                self.start_round = t + 1
                emit("resumed", learner=self.slot.index, round=t)
                return

    def _state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {"weights": flat_parameters(self.model).cpu(), **self.outer.state_tensors()}
        for i, p in enumerate(self.model.parameters()):
            for name, value in self.inner.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"inner.{i}.{name}"] = value.cpu()
        first = self.inner.state.get(next(self.model.parameters()), {})
        return tensors, {"inner_step": int(first.get("step", 0))}

    def _load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        load_flat_parameters(self.model, tensors["weights"].to(self.device))
        self.outer.load_state_tensors(tensors)
        for i, p in enumerate(self.model.parameters()):
            if f"inner.{i}.exp_avg" in tensors:
                self.inner.state[p] = {"step": torch.tensor(float(meta["inner_step"])),
                                       "exp_avg": tensors[f"inner.{i}.exp_avg"].to(self.device),
                                       "exp_avg_sq": tensors[f"inner.{i}.exp_avg_sq"].to(self.device)}

    # -- one round ----------------------------------------------------------------------------------

    def inner_steps(self, round_index: int) -> float:
        island = self.slot.island
        total = island.inner_steps * self.spec.sync.rounds
        # Reseeded per round, so a resumed learner draws the windows it would have drawn anyway.
        self.sampler.generator.manual_seed(hash((self.spec.seed, self.slot.index, self.rank, round_index)) & 0x7FFF_FFFF_FFFF_FFFF)
        losses = []
        for h in range(island.inner_steps):
            step = round_index * island.inner_steps + h
            for group in self.inner.param_groups:
                group["lr"] = learning_rate(step, total, self.spec.sync.inner_lr, self.spec.sync.warmup_steps)
            inputs, targets = self.sampler.batch(self.rows)
            loss = self.model.loss(inputs.to(self.device), targets.to(self.device))
            self.inner.zero_grad(set_to_none=False)
            loss.backward()
            if self.world > 1:
                self._average_gradients()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.inner.step()
            losses.append(loss.item())
        return sum(losses) / len(losses)

    def _average_gradients(self) -> None:
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:  # an expert no token was routed to on this rank
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= self.world
        unflatten_into(flat, [p.grad for p in params])

    def synchronise(self, round_index: int, anchor: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Send this round's message, mix with the round's peers, return the next anchor (rank 0 only)."""
        me = self.slot.index
        tokens = self.slot.tokens_per_round()
        butterfly = self.spec.sync.mode == "butterfly"
        payload = {"anchor": anchor, "delta": delta} if butterfly else {"delta": delta}
        self.traffic.written += self.store.commit_tensors(
            layout.message(me, round_index), payload, {"learner": me, "round": round_index, "tokens": tokens})
        if butterfly:
            partner = butterfly_partner(me, round_index, len(self.spec.learners))
            if partner is None:
                return self.outer.step(anchor, delta)
            theirs, meta = self._receive(partner, round_index)
            mixed_anchor, mixed_delta = mix_pair(anchor, delta, tokens, theirs["anchor"], theirs["delta"],
                                                 meta["tokens"], me, partner)
            return self.outer.step(mixed_anchor, mixed_delta)
        deltas, weights = [], []
        for peer in range(len(self.spec.learners)):
            if peer == me:
                deltas.append(delta)
                weights.append(tokens)
            else:
                theirs, meta = self._receive(peer, round_index)
                deltas.append(theirs["delta"])
                weights.append(meta["tokens"])
        return self.outer.step(anchor, weighted_mean(deltas, weights))

    def _receive(self, peer: int, round_index: int) -> tuple[dict[str, torch.Tensor], dict]:
        key = layout.message(peer, round_index)
        if not self.store.wait_for(f"{key}.json", self.spec.sync.partner_timeout_s):
            raise TimeoutError(f"learner {self.slot.index}: no message from learner {peer} for round "
                               f"{round_index} within {self.spec.sync.partner_timeout_s}s ({key})")
        tensors, meta, nbytes = self.store.read_committed(key)
        if self.spec.learners[peer].island.name == self.slot.island.name:
            self.traffic.read_intra += nbytes
        else:
            self.traffic.read_inter += nbytes
        return tensors, meta

    def run(self) -> None:
        rounds = self.spec.sync.rounds
        started = time.monotonic()
        for t in range(self.start_round, rounds):
            round_started = time.monotonic()
            anchor = flat_parameters(self.model)
            loss = self.inner_steps(t)
            computed = time.monotonic()
            delta = anchor - flat_parameters(self.model)
            if self.rank == 0:
                next_anchor = self.synchronise(t, anchor.cpu(), delta.cpu()).to(self.device)
            else:
                next_anchor = torch.empty_like(anchor)
            if self.world > 1:
                dist.broadcast(next_anchor, src=0)
            load_flat_parameters(self.model, next_anchor)
            synced = time.monotonic()
            if self.rank == 0:
                tensors, meta = self._state()
                self.traffic.checkpoint += self.store.commit_tensors(
                    layout.checkpoint(self.slot.index, t), tensors, {**meta, "round": t})
            self.traffic.seconds_computing += computed - round_started
            self.traffic.seconds_syncing += synced - computed
            self.traffic.rounds.append({"round": t, "loss": loss, "compute_s": computed - round_started,
                                        "sync_s": synced - computed})
            done = t + 1 - self.start_round
            rate = done * self.slot.tokens_per_round() / (time.monotonic() - started)
            eta = (rounds - t - 1) * (time.monotonic() - started) / done
            if self.rank == 0:
                emit("round", learner=self.slot.index, island=self.slot.island.name, round=t, rounds=rounds,
                     loss=round(loss, 4), tokens_per_s=round(rate), eta_s=round(eta, 1))
        if self.rank == 0:
            self._write_summary()

    def _write_summary(self) -> None:
        key = layout.learner_summary(self.slot.index)
        summary = {"learner": self.slot.index, "island": self.slot.island.name, "processes": self.world,
                   "tokens": self.slot.tokens_per_round() * self.spec.sync.rounds,
                   "bytes_written": self.traffic.written, "bytes_read_intra": self.traffic.read_intra,
                   "bytes_read_inter": self.traffic.read_inter, "checkpoint_bytes": self.traffic.checkpoint,
                   "seconds_computing": self.traffic.seconds_computing,
                   "seconds_syncing": self.traffic.seconds_syncing, "rounds": self.traffic.rounds,
                   "resumed_from_round": self.start_round}
        if not self.store.exists(key):
            self.store.put_json(key, summary)
        emit("done", learner=self.slot.index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one Archipelago learner.")
    parser.add_argument("--store", required=True, help="store root URL (credentials from the environment)")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--run-id", required=True, help="run id")
    parser.add_argument("--learner", type=int, required=True, help="global learner index")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    store = ObjectStore(args.store, args.endpoint_url).child(f"runs/{args.run_id}")
    spec = RunSpec.model_validate(store.get_json(layout.SPEC))
    if world > 1:
        dist.init_process_group("nccl" if spec.learners[args.learner].island.device == "cuda" else "gloo")
    try:
        learner = Learner(spec, store, args.learner, rank, world)
        learner.resume()
        learner.run()
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
