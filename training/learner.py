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
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from infra import layout
from infra.faults import StoreFaults
from infra.retry import RetryPolicy
from infra.spec import CorruptObject, KillLearner, LearnerSlot, RunSpec, StoreErrors
from infra.store import IntegrityError, ObjectExists, ObjectStore
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
    missed_exchanges: list[dict] = field(default_factory=list)
    corrupt_reads: int = 0


def emit(event: str, **fields) -> None:
    """One JSON line of progress on stdout; the island's Prefect task relays it to the run's logs."""
    print(json.dumps({"event": event, **fields}), flush=True)


def partner_wait_s(sync, round_compute_s: float) -> float | None:
    """With `sync.partner_wait_rounds`, how long after its inner steps a learner waits for all of this
    round's peers together; None: each peer gets `sync.partner_timeout_s`."""
    if sync.partner_wait_rounds is None:
        return None
    return min(sync.partner_timeout_s, sync.partner_wait_rounds * round_compute_s)


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
        self.outer = OuterOptimizer.from_spec(spec.sync.outer, [p.shape for p in self.model.parameters()])
        manifest = store.get_json(layout.DATA_MANIFEST)
        shard = read_stream(store, manifest["shards"][index])
        self.sampler = WindowSampler(shard, self.slot.island.seq_len, seed=spec.seed)
        self.rows = self.slot.island.batch_size // world
        self.traffic = Traffic()
        self.start_round = 0
        self.sync_deadline: float | None = None
        self.rejoined_from: dict | None = None

    # -- state ------------------------------------------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest state this learner can trust, if this is a restart.

        A learner's first life starts from the run's initial weights, however late it starts:
        its peers' progress is no reason to skip its own share of the compute. On a restart, its
        own newest checkpoint, unless a peer has committed one at least two rounds newer: then the
        peer's, and the learner rejoins at the round its peers are in. Replaying the missed rounds
        from its own older state would keep it behind, and every partner would wait out a
        deadline for it each round; a peer's checkpoint is that peer's consensus state after the
        same rounds. Only checkpoints whose checksums verify are used; a corrupt one falls back to
        the next newest. Rank 0 decides and tells the other ranks, so a torchrun group never
        splits between two states.
        """
        chosen = self._choose_resume_point() if self.rank == 0 else None
        source = torch.tensor(chosen[:2] if chosen else (-1, -1), device=self.device)
        if self.world > 1:
            dist.broadcast(source, src=0)
        learner, t = source.tolist()
        if t < 0:
            return
        tensors, meta = chosen[2:] if chosen else self.store.read_committed(layout.checkpoint(learner, t))[:2]
        self._load_state(tensors, meta)
        self.start_round = t + 1
        self.rejoined_from = {"learner": learner, "round": t}
        emit("resumed", learner=self.slot.index, from_learner=learner, round=t)

    def _choose_resume_point(self) -> tuple[int, int, dict, dict] | None:
        started = layout.learner_started(self.slot.index)
        if not self.store.exists(started):
            self.store.put_json(started, {"learner": self.slot.index})
            return None
        own = self._checkpoint_rounds(self.slot.index)
        newest_own = max(own, default=-1)
        # A peer one round ahead is ordinary skew between learners, not a reason to leave our own state.
        fresher = [(t, peer) for peer in range(len(self.spec.learners)) if peer != self.slot.index
                   for t in self._checkpoint_rounds(peer) if t > newest_own + 1]
        candidates = sorted(fresher + [(t, self.slot.index) for t in own],
                            key=lambda c: (c[0], c[1] == self.slot.index), reverse=True)
        for t, learner in candidates:
            try:
                tensors, meta, _ = self.store.read_committed(layout.checkpoint(learner, t))
            except IntegrityError as err:
                emit("corrupt_checkpoint", learner=self.slot.index, error=str(err))
                continue
            self.traffic = self._own_traffic(own)
            return learner, t, tensors, meta
        return None

    def _own_traffic(self, own_rounds: list[int]) -> Traffic:
        """The counters of this learner's earlier lives, from its newest checkpoint that verifies."""
        for t in sorted(own_rounds, reverse=True):
            try:
                return Traffic(**self.store.get_json(f"{layout.checkpoint(self.slot.index, t)}.json")["traffic"])
            except IntegrityError:
                continue
        return Traffic()

    def _checkpoint_rounds(self, learner: int) -> list[int]:
        return [int(key.split("/round-")[1].split("/")[0]) for key in self.store.list(layout.learner_prefix(learner))
                if key.endswith("/checkpoint.json")]

    def _state(self) -> tuple[dict[str, torch.Tensor], dict]:
        outer_tensors, outer_scalars = self.outer.state()
        tensors = {"weights": flat_parameters(self.model).cpu(), **outer_tensors}
        for i, p in enumerate(self.model.parameters()):
            for name, value in self.inner.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"inner.{i}.{name}"] = value.cpu()
        first = self.inner.state.get(next(self.model.parameters()), {})
        # The traffic counters ride along, so a restarted learner's report still counts its earlier life.
        return tensors, {"inner_step": int(first.get("step", 0)), "outer": outer_scalars,
                         "traffic": asdict(self.traffic)}

    def _load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        load_flat_parameters(self.model, tensors["weights"].to(self.device))
        self.outer.load_state(tensors, meta.get("outer", {}))
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
            if h == island.inner_steps // 2:
                self._maybe_die(round_index)
        return sum(losses) / len(losses)

    def _maybe_die(self, round_index: int) -> None:
        """Fault injection: die by SIGKILL mid-round, once (a marker in the store remembers it)."""
        if self.rank != 0 or not self.spec.fault_at(KillLearner, self.slot.index, round_index):
            return
        marker = f"faults/killed-learner-{self.slot.index:03d}-round-{round_index:05d}.json"
        if not self.store.exists(marker):
            self.store.put_json(marker, {"learner": self.slot.index, "round": round_index})
            emit("fault", learner=self.slot.index, kind="kill_learner", round=round_index)
            os.kill(os.getpid(), signal.SIGKILL)

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
        """Send this round's message, mix with the peers that answered in time, return the next anchor.

        A peer that misses the deadline, or whose message is corrupt, is left out of this round's
        mix and recorded; the learner never blocks past `sync.partner_timeout_s` on anyone.
        """
        me = self.slot.index
        tokens = self.slot.tokens_per_round()
        butterfly = self.spec.sync.mode == "butterfly"
        anchor, delta = self._publish(round_index, anchor, delta, tokens, butterfly)
        if butterfly:
            partner = butterfly_partner(me, round_index, len(self.spec.learners))
            received = self._receive(partner, round_index) if partner is not None else None
            if received is None:
                return self.outer.step(anchor, delta)
            theirs, meta = received
            mixed_anchor, mixed_delta = mix_pair(anchor, delta, tokens, theirs["anchor"], theirs["delta"],
                                                 meta["tokens"], me, partner)
            return self.outer.step(mixed_anchor, mixed_delta)
        deltas, weights = [], []
        for peer in range(len(self.spec.learners)):
            received = ({"delta": delta}, {"tokens": tokens}) if peer == me else self._receive(peer, round_index)
            if received is not None:
                deltas.append(received[0]["delta"])
                weights.append(received[1]["tokens"])
        return self.outer.step(anchor, weighted_mean(deltas, weights))

    def _publish(self, round_index: int, anchor: torch.Tensor, delta: torch.Tensor, tokens: int,
                 butterfly: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit this round's message. If a previous life of this learner already sent one for the
        round, peers may have mixed with it: keep to what was sent."""
        key = layout.message(self.slot.index, round_index)
        if self.spec.fault_at(CorruptObject, self.slot.index, round_index):
            self.store.corrupt_next_write()
            emit("fault", learner=self.slot.index, kind="corrupt_object", round=round_index)
        payload = {"anchor": anchor, "delta": delta} if butterfly else {"delta": delta}
        try:
            self.traffic.written += self.store.commit_tensors(
                key, payload, {"learner": self.slot.index, "round": round_index, "tokens": tokens})
        except ObjectExists:
            sent, _, _ = self.store.read_committed(key)
            return sent.get("anchor", anchor), sent["delta"]
        return anchor, delta

    def _receive(self, peer: int, round_index: int) -> tuple[dict[str, torch.Tensor], dict] | None:
        key = layout.message(peer, round_index)
        timeout = (self.spec.sync.partner_timeout_s if self.sync_deadline is None
                   else max(0.0, self.sync_deadline - time.monotonic()))
        if not self.store.wait_for(f"{key}.json", timeout):
            return self._missed(peer, round_index, "deadline")
        try:
            tensors, meta, nbytes = self.store.read_committed(key)
        except IntegrityError as err:
            self.traffic.corrupt_reads += 1
            return self._missed(peer, round_index, f"corrupt: {err}")
        if self.spec.learners[peer].island.name == self.slot.island.name:
            self.traffic.read_intra += nbytes
        else:
            self.traffic.read_inter += nbytes
        return tensors, meta

    def _missed(self, peer: int, round_index: int, reason: str) -> None:
        self.traffic.missed_exchanges.append({"round": round_index, "peer": peer, "reason": reason})
        emit("missed_exchange", learner=self.slot.index, peer=peer, round=round_index, reason=reason)
        return None

    def run(self) -> None:
        started = time.monotonic()
        for t in range(self.start_round, self.spec.sync.rounds):
            loss = self.run_round(t)
            if self.rank == 0:
                done = t + 1 - self.start_round
                elapsed = time.monotonic() - started
                emit("round", learner=self.slot.index, island=self.slot.island.name, round=t,
                     rounds=self.spec.sync.rounds, loss=round(loss, 4),
                     tokens_per_s=round(done * self.slot.tokens_per_round() / elapsed),
                     eta_s=round((self.spec.sync.rounds - t - 1) * elapsed / done, 1))
        if self.rank == 0:
            self._write_summary()

    def run_round(self, t: int) -> float:
        """Inner steps, exchange, outer step, checkpoint. Returns the mean inner loss."""
        round_started = time.monotonic()
        anchor = flat_parameters(self.model)
        loss = self.inner_steps(t)
        computed = time.monotonic()
        wait = partner_wait_s(self.spec.sync, computed - round_started)
        self.sync_deadline = None if wait is None else computed + wait
        delta = anchor - flat_parameters(self.model)
        if self.rank == 0:
            next_anchor = self.synchronise(t, anchor.cpu(), delta.cpu()).to(self.device)
        else:
            next_anchor = torch.empty_like(anchor)
        if self.world > 1:
            dist.broadcast(next_anchor, src=0)
        load_flat_parameters(self.model, next_anchor)
        synced = time.monotonic()
        self.traffic.seconds_computing += computed - round_started
        self.traffic.seconds_syncing += synced - computed
        self.traffic.rounds.append({"round": t, "loss": loss, "compute_s": computed - round_started,
                                    "sync_s": synced - computed})
        if self.rank == 0:
            tensors, meta = self._state()
            self.traffic.checkpoint += self.store.commit_tensors(
                layout.checkpoint(self.slot.index, t), tensors, {**meta, "round": t})
        return loss

    def _write_summary(self) -> None:
        key = layout.learner_summary(self.slot.index)
        summary = {"learner": self.slot.index, "island": self.slot.island.name, "processes": self.world,
                   # Rounds this learner completed in all its lives; rounds skipped by rejoining are not compute.
                   "tokens": self.slot.tokens_per_round() * len(self.traffic.rounds),
                   "bytes_written": self.traffic.written, "bytes_read_intra": self.traffic.read_intra,
                   "bytes_read_inter": self.traffic.read_inter, "checkpoint_bytes": self.traffic.checkpoint,
                   "seconds_computing": self.traffic.seconds_computing,
                   "seconds_syncing": self.traffic.seconds_syncing, "rounds": self.traffic.rounds,
                   "rejoined_from": self.rejoined_from, "missed_exchanges": self.traffic.missed_exchanges,
                   "corrupt_reads_detected": self.traffic.corrupt_reads, "store": dict(self.store.stats),
                   "store_faults_injected": dict(getattr(self.store.fs, "counts", {}))}
        if not self.store.exists(key):
            self.store.put_json(key, summary)
        emit("done", learner=self.slot.index)


def store_faults(spec: RunSpec, learner: int) -> StoreFaults | None:
    """The run's injected store faults, seeded per learner so each sees its own sequence."""
    errors = spec.faults_of(StoreErrors)
    if not errors:
        return None
    e = errors[0]
    return StoreFaults(e.rate, tuple(e.kinds), slow_seconds=e.slow_seconds, seed=spec.seed * 1000 + learner)


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
    spec = RunSpec.model_validate(
        ObjectStore(args.store, args.endpoint_url).child(f"runs/{args.run_id}").get_json(layout.SPEC))
    store = ObjectStore(args.store, args.endpoint_url,
                        RetryPolicy(attempts=spec.store.retry_attempts, budget_s=spec.store.retry_budget_s),
                        store_faults(spec, args.learner)).child(f"runs/{args.run_id}")
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
