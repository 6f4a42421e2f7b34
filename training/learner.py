"""One learner: a model replica that trains on its shard and talks to other learners only
through the object store.

Run as its own OS process: `python -m training.learner --store URL --run-id RUN --learner I`,
or under `torchrun` when the learner is data-parallel over several processes. Rank 0 owns all
store traffic; the other ranks only compute, and receive each round's new weights by broadcast.

A round: take H AdamW steps from the anchor θ to x, send the round's fragment's (θ, Δ = θ − x)
(see `training.fragments`; one fragment is the whole model), receive what the round's peers
sent, mix (see `training.mixing`), take an outer step on the fragment, checkpoint. Sending and
receiving run on the learner's transport thread (`infra.transport`); the mix is applied
`sync.transport.tau` inner steps later, keeping the local progress made meanwhile:
x_f <- θ'_f + (x_f(now) − x_f(sent)). With tau 0 the learner waits for it at once. Messages may
be compressed with error feedback (`training.compression`).

The checkpoint of round t is the learner's whole state, so a restarted learner resumes from its
newest checkpoint. An exchange still in flight when the checkpoint is written is part of that
state: the checkpoint holds the anchors, weights and error-feedback residual the message was
encoded from, none of them yet touched by its mix. A learner that dies with an exchange in flight
restarts it from the checkpoint: it re-encodes the same message (re-sending identical bytes is a
no-op for write-once objects; if a dead life committed a different message, that one is what
peers saw and is what the learner mixes with and charges its residual against), fetches the
partner's message again, and applies the mix at the same point, so the mix is applied exactly
once. A learner that rejoins from a peer's checkpoint drops the peer's in-flight exchange and
starts with an empty residual: both belong to the peer.

With `sync.transport.checkpoint_in_background` the checkpoint is a copy of that state written by
the transport thread, after the exchanges queued before it, while the next round computes; a
learner finishes one before it starts the next and before it exits or pauses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from functools import partial

import torch
import torch.distributed as dist

from infra import layout
from infra.faults import StoreFaults
from infra.launch import WINDOW_CLOSED
from infra.retry import RetryPolicy
from infra.spec import CloseWindow, CorruptObject, KillLearner, LearnerSlot, RunSpec, StoreErrors
from infra.store import IntegrityError, ObjectExists, ObjectStore
from infra.transport import MalformedMessage, Transport
from training.compression import Codec, ErrorFeedback, decode_field
from training.data import WindowSampler, read_stream
from training.fragments import FragmentLayout, exchange_count, fragment_of_round
from training.messages import ExpectedMessage, MessageRejected, accept_message
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


class LearnerDiverged(RuntimeError):
    """The learner's own training produced non-finite values; a message of them would poison every peer."""


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
    seconds_blocked: float = 0.0
    exchanges: list[dict] = field(default_factory=list)
    links: dict = field(default_factory=dict)


@dataclass
class Exchange:
    """A fragment's exchange in flight: sent at the end of `round`, applied `tau` steps later."""

    round: int
    fragment: int
    sent_weights: torch.Tensor | None = None  # the fragment's weights when it was sent (rank 0)
    result: Future | None = None  # the transport job's ExchangeResult (rank 0)


@dataclass
class ExchangeResult:
    sent: dict[str, torch.Tensor]  # what peers see of our message, decoded
    exact: dict[str, torch.Tensor]  # what our message was encoded from
    residual: dict[str, torch.Tensor]  # error-feedback residual slices after this message
    received: list[tuple[int, dict[str, torch.Tensor], dict]]
    bytes_sent: int
    bytes_received: int


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
        transport = spec.sync.transport
        self.fragments = FragmentLayout.build(self.model, transport.fragments, transport.layout)
        shapes = {name: p.shape for name, p in self.model.named_parameters()}
        # Shampoo preconditions each weight matrix: every fragment's optimizer sees its parameters' shapes.
        self.outers = [OuterOptimizer.from_spec(spec.sync.outer, [shapes[name] for name in names])
                       for names in self.fragments.names]
        # Where each fragment last synchronised; with one fragment and tau 0, the round's start weights.
        self.anchors = flat_parameters(self.model).cpu()
        self.codec = Codec(transport.compression, transport.scale_chunk, transport.topk)
        # Butterfly partners average anchors too; all-reduce peers share pseudo-gradients only.
        self._message_fields = ("anchor", "delta") if spec.sync.mode == "butterfly" else ("delta",)
        # Compressed anchors travel as their difference from the run's initial weights, which every
        # learner rebuilds from the seed: quantisation then spends its levels on what training changed.
        self.initial = self.anchors.clone()
        self.feedback = ErrorFeedback(self.codec, self.anchors.numel(), ("anchor", "delta"), transport.error_feedback)
        self.transport = Transport(store, transport.chunk_bytes,
                                   {"inter": transport.bandwidth.inter_island, "intra": transport.bandwidth.intra_island})
        self.pending: Exchange | None = None
        self._checkpoint_in_flight: Future | None = None
        self._sync_seconds = 0.0
        manifest = store.get_json(layout.DATA_MANIFEST)
        shard = read_stream(store, manifest["shards"][index])
        self.sampler = WindowSampler(shard, self.slot.island.seq_len, seed=spec.seed)
        self.rows = self.slot.island.batch_size // world
        self.traffic = Traffic()
        self.start_round = 0
        self.sync_deadline: float | None = None
        self.rejoined_from: dict | None = None
        self.life = 0  # this process's life among the learner's lives (restarts, window resumes)
        self._life_records: dict[str, dict] = {}

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
        if t >= 0:
            tensors, meta = chosen[2:] if chosen else self.store.read_committed(layout.checkpoint(learner, t))[:2]
            self._resume_from(learner, t, tensors, meta)
        if self.rank == 0:
            self._record_life()

    def _resume_from(self, learner: int, t: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._load_state(tensors, meta)
        if learner != self.slot.index:
            self.feedback.reset()
        elif meta.get("pending") is not None:
            self.pending = Exchange(meta["pending"]["round"], meta["pending"]["fragment"])
            if self.rank == 0:
                self.pending = self._start_exchange(self.pending.round, self.anchors.clone(), flat_parameters(self.model).cpu())
        self.start_round = t + 1
        self.rejoined_from = {"learner": learner, "round": t}
        emit("resumed", learner=self.slot.index, from_learner=learner, round=t)

    def _choose_resume_point(self) -> tuple[int, int, dict, dict] | None:
        self.life = len(self._lives())
        if self.life == 0:
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
            self.transport.load_report(self.traffic.links)
            return learner, t, tensors, meta
        return None

    # -- liveness -----------------------------------------------------------------------------------

    def _record_life(self) -> None:
        """Tell the partners that this life has begun, and which of this learner's messages will never
        come: a learner that rejoins from a peer's checkpoint skips the rounds between its own newest
        checkpoint and that one, and a partner waiting for one of them stops at once."""
        skipped: list[int] = []
        if self.rejoined_from is not None and self.rejoined_from["learner"] != self.slot.index:
            skipped = list(range(max(self._checkpoint_rounds(self.slot.index), default=-1) + 1, self.start_round))
        self.store.put_json(layout.learner_life(self.slot.index, self.life), {
            "learner": self.slot.index, "life": self.life, "start_round": self.start_round,
            "resumed_from": self.rejoined_from, "skipped_rounds": skipped, "host": socket.gethostname(),
            "pid": os.getpid(), "started_at": datetime.now(timezone.utc).isoformat()})
        if skipped:
            emit("skipping_rounds", learner=self.slot.index, first=skipped[0], last=skipped[-1])

    def _lives(self, learner: int | None = None) -> list[dict]:
        """The lives a learner has recorded, oldest first, each with whether it ended at a window's end."""
        learner = self.slot.index if learner is None else learner
        keys = self.store.list(layout.liveness_prefix(learner))
        paused = {key.replace("/paused-", "/life-") for key in keys if "/paused-" in key}
        return [{**self._life_record(key), "paused": key in paused} for key in keys if "/life-" in key]

    def _life_record(self, key: str) -> dict:
        """Life records are write-once, so each is read once."""
        if key not in self._life_records:
            self._life_records[key] = self.store.get_json(key)
        return self._life_records[key]

    def _skipped_by(self, peer: int, round_index: int) -> bool:
        return any(round_index in life["skipped_rounds"] for life in self._lives(peer))

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
        outer_tensors, outer_scalars = self._outer_state()
        tensors = {"weights": flat_parameters(self.model).cpu(), **outer_tensors, **self.feedback.state_tensors()}
        if self.fragments.count > 1 or self.pending is not None:
            tensors["anchors"] = self.anchors.clone()
        for i, p in enumerate(self.model.parameters()):
            for name, value in self.inner.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"inner.{i}.{name}"] = value.cpu()
        first = self.inner.state.get(next(self.model.parameters()), {})
        # The traffic counters ride along, so a restarted learner's report still counts its earlier life.
        self.traffic.links = self.transport.report()
        pending = None if self.pending is None else {"round": self.pending.round, "fragment": self.pending.fragment}
        return tensors, {"inner_step": int(first.get("step", 0)), "outer": outer_scalars,
                         "traffic": asdict(self.traffic), "pending": pending}

    def _outer_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        if len(self.outers) == 1:
            return self.outers[0].state()
        tensors, scalars = {}, {}
        for f, outer in enumerate(self.outers):
            fragment_tensors, scalars[f"fragment-{f}"] = outer.state()
            tensors.update({f"fragment-{f}.{k}": v for k, v in fragment_tensors.items()})
        return tensors, scalars

    def _load_outer_state(self, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        if len(self.outers) == 1:
            self.outers[0].load_state(tensors, scalars)
            return
        for f, outer in enumerate(self.outers):
            prefix = f"fragment-{f}."
            outer.load_state({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                             scalars.get(f"fragment-{f}", {}))

    def _load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        load_flat_parameters(self.model, tensors["weights"].to(self.device))
        self.anchors = tensors.get("anchors", tensors["weights"]).float().cpu().clone()
        self._load_outer_state(tensors, meta.get("outer", {}))
        self.feedback.load_state_tensors(tensors)
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
            if self.pending is not None and h + 1 == self.spec.sync.transport.tau:
                self._apply_pending()
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

    # -- exchanges ------------------------------------------------------------------------------

    def _peers(self, round_index: int) -> list[int]:
        """Whose messages this round's mix takes, inter-island peers first (they are the slow ones)."""
        me, n = self.slot.index, len(self.spec.learners)
        if self.spec.sync.mode == "butterfly":
            partner = butterfly_partner(me, exchange_count(round_index, self.fragments.count), n)
            return [] if partner is None else [partner]
        return sorted((p for p in range(n) if p != me), key=lambda p: self._link(p) != "inter")

    def _link(self, peer: int) -> str:
        return "intra" if self.spec.learners[peer].island.name == self.slot.island.name else "inter"

    def _message_key(self, learner: int, round_index: int) -> str:
        fragment = fragment_of_round(round_index, self.fragments.count) if self.fragments.count > 1 else None
        return layout.message(learner, round_index, fragment)

    def _start_exchange(self, round_index: int, anchors: torch.Tensor, weights: torch.Tensor) -> Exchange:
        """Queue this round's fragment's exchange on the transport thread; the learner goes on computing."""
        fragment = fragment_of_round(round_index, self.fragments.count)
        index = self.fragments.indices[fragment]
        anchor, sent_weights = anchors[index], weights[index]
        peers = self._peers(round_index)
        link = "inter" if any(self._link(p) == "inter" for p in peers) else "intra"
        future = self.transport.submit(link, self._exchange, round_index, anchor, anchor - sent_weights, peers)
        return Exchange(round_index, fragment, sent_weights, future)

    def _exchange(self, round_index: int, anchor: torch.Tensor, delta: torch.Tensor, peers: list[int]) -> ExchangeResult:
        """On the transport thread: send our message, then fetch each peer's (or note it missed)."""
        tokens = self.slot.tokens_per_round()
        sent_anchor, sent_delta, residual, bytes_sent = self._publish(
            round_index, anchor, delta, tokens)
        received, before = [], self.traffic.read_intra + self.traffic.read_inter
        for peer in peers:
            message = self._receive(peer, round_index)
            if message is not None:
                received.append((peer, *message))
        return ExchangeResult({"anchor": sent_anchor, "delta": sent_delta}, {"anchor": anchor, "delta": delta},
                              residual, received, bytes_sent,
                              self.traffic.read_intra + self.traffic.read_inter - before)

    def _apply_pending(self) -> None:
        """Wait for the exchange in flight (if it is not done yet), mix, take the fragment's outer
        step, and move the fragment to the new anchor plus the local progress made since it was sent."""
        exchange, self.pending = self.pending, None
        index = self.fragments.indices[exchange.fragment]
        began = time.monotonic()
        if self.rank == 0:
            result: ExchangeResult = exchange.result.result()
            self.traffic.seconds_blocked += time.monotonic() - began
            anchor = self._mix(exchange, result)
            weights = flat_parameters(self.model).cpu()
            weights[index] = anchor + (weights[index] - exchange.sent_weights)
            self.anchors[index] = anchor
            self.feedback.commit(index, result.residual)
            self.traffic.written += result.bytes_sent
            self.traffic.exchanges.append({
                "round": exchange.round, "fragment": exchange.fragment, "bytes_sent": result.bytes_sent,
                "bytes_received": result.bytes_received, "peers": [peer for peer, _, _ in result.received]})
            fragment_weights = weights[index].to(self.device)
        else:
            fragment_weights = torch.empty(int(index.numel()), device=self.device)
        if self.world > 1:
            dist.broadcast(fragment_weights, src=0)
        weights = flat_parameters(self.model)
        weights[index.to(self.device)] = fragment_weights
        load_flat_parameters(self.model, weights)
        self._sync_seconds += time.monotonic() - began

    def _mix(self, exchange: Exchange, result: ExchangeResult) -> torch.Tensor:
        """The fragment's next anchor from our message (as peers see it, or exact) and theirs."""
        outer, me = self.outers[exchange.fragment], self.slot.index
        own = result.exact if self.spec.sync.transport.mix_own_exact and not self.codec.lossless else result.sent
        anchor, delta, tokens = own["anchor"], own["delta"], self.slot.tokens_per_round()
        if self.spec.sync.mode == "butterfly":
            if not result.received:
                return outer.step(anchor, delta)
            partner, theirs, _ = result.received[0]
            return outer.step(*mix_pair(anchor, delta, tokens, theirs["anchor"], theirs["delta"],
                                        self._planned_tokens(partner), me, partner))
        # Every learner sums in learner order, so all that heard the same peers agree bitwise.
        messages = sorted([(me, delta, tokens)] + [(p, m["delta"], self._planned_tokens(p))
                                                   for p, m, _ in result.received],
                          key=lambda item: item[0])
        return outer.step(anchor, weighted_mean([m[1] for m in messages], [m[2] for m in messages]))

    def _publish(self, round_index: int, anchor: torch.Tensor, delta: torch.Tensor,
                 tokens: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
        """Commit this round's message; returns the anchor and delta as peers will decode them, the
        error-feedback residual after it, and bytes written. If a previous life of this learner
        already sent one for the round, peers may have mixed with it: keep to what was sent."""
        key = self._message_key(self.slot.index, round_index)
        if self.spec.fault_at(CorruptObject, self.slot.index, round_index):
            self.store.corrupt_next_write()
            emit("fault", learner=self.slot.index, kind="corrupt_object", round=round_index)
        fragment = fragment_of_round(round_index, self.fragments.count)
        index = self.fragments.indices[fragment]
        fields = {"anchor": anchor, "delta": delta}
        fields = {name: fields[name] for name in self._message_fields}
        if not self.codec.lossless:
            fields = {name: value - self.initial[index] if name == "anchor" else value for name, value in fields.items()}
        payload, decoded, residual = (dict(fields), dict(fields), {}) if self.codec.lossless else \
            self.feedback.encode(fields, index, sparsify={"anchor": False})
        meta = {"learner": self.slot.index, "round": round_index, "tokens": tokens, "fragment": fragment,
                "anchor_from_initial": not self.codec.lossless}
        peers = self._peers(round_index)
        link = "inter" if any(self._link(p) == "inter" for p in peers) else "intra"
        nbytes = 0
        try:
            nbytes = self.transport.put_message(key, payload, meta, link)
        except ObjectExists:
            expected = self._expected(self.slot.index, round_index)
            try:
                sent, sent_meta, _ = self.transport.get_message(key, link, expected.max_bytes)
                decoded = accept_message(sent, sent_meta, expected, self.codec)
                residual = self.feedback.residual_after(fields, index, decoded)
            except (IntegrityError, MalformedMessage, MessageRejected) as err:
                # Someone else wrote our key first: peers refuse it as we do, so none of this
                # round's values reached them; mix with our own and keep the residual as it was.
                emit("own_message_refused", learner=self.slot.index, round=round_index, reason=str(err))
                decoded, residual = dict(fields), {}
        if not self.codec.lossless and "anchor" in decoded:
            decoded["anchor"] = decoded["anchor"] + self.initial[index]
        return decoded.get("anchor", anchor), decoded["delta"], residual, nbytes

    def _expected(self, learner: int, round_index: int) -> ExpectedMessage:
        """What learner `learner`'s message of a round must be, by this learner's own plan."""
        fragment = fragment_of_round(round_index, self.fragments.count)
        return ExpectedMessage(learner=learner, round=round_index, fragment=fragment,
                               tokens=self._planned_tokens(learner), numel=int(self.fragments.indices[fragment].numel()),
                               fields=self._message_fields, anchor_from_initial=not self.codec.lossless)

    def _planned_tokens(self, learner: int) -> int:
        """The tokens a learner's pseudo-gradient is weighed by: the spec's plan, never its message."""
        return self.spec.learners[learner].tokens_per_round()

    def _receive(self, peer: int, round_index: int) -> tuple[dict[str, torch.Tensor], dict] | None:
        key = self._message_key(peer, round_index)
        timeout = (self.spec.sync.partner_timeout_s if self.sync_deadline is None
                   else max(0.0, self.sync_deadline - time.monotonic()))
        skipped = partial(self._skipped_by, peer, round_index)
        if not self.store.wait_for(f"{key}.json", timeout, give_up=skipped):
            return self._missed(peer, round_index, "skipped by the peer's restart" if skipped() else "deadline")
        link = self._link(peer)
        expected = self._expected(peer, round_index)
        try:
            payload, meta, nbytes = self.transport.get_message(key, link, expected.max_bytes)
        except IntegrityError as err:
            self.traffic.corrupt_reads += 1
            return self._missed(peer, round_index, f"corrupt: {err}")
        except MalformedMessage as err:
            return self._missed(peer, round_index, f"refused: {err}")
        if link == "intra":
            self.traffic.read_intra += nbytes
        else:
            self.traffic.read_inter += nbytes
        try:
            message = accept_message(payload, meta, expected, self.codec)
        except MessageRejected as err:
            return self._missed(peer, round_index, f"refused: {err}")
        if expected.anchor_from_initial and "anchor" in message:
            message["anchor"] = message["anchor"] + self.initial[self.fragments.indices[expected.fragment]]
        return message, meta

    def _missed(self, peer: int, round_index: int, reason: str) -> None:
        self.traffic.missed_exchanges.append({"round": round_index, "peer": peer, "reason": reason})
        emit("missed_exchange", learner=self.slot.index, peer=peer, round=round_index, reason=reason)
        return None

    def run(self, until: datetime | None = None,
            clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> bool:
        """Train the remaining rounds; with `until` (a capacity window's end), stop before a round
        that would not finish in time. Returns False when the window closed first: every finished
        round is checkpointed, and the next segment resumes from the newest checkpoint."""
        started = time.monotonic()
        round_seconds = 0.0
        for t in range(self.start_round, self.spec.sync.rounds):
            if until is not None and not self._round_fits(until, clock, round_seconds):
                self._window_closed(t, until.isoformat())
                return False
            round_started = time.monotonic()
            loss = self.run_round(t)
            round_seconds = time.monotonic() - round_started
            if self.rank == 0:
                done = t + 1 - self.start_round
                elapsed = time.monotonic() - started
                emit("round", learner=self.slot.index, island=self.slot.island.name, round=t,
                     rounds=self.spec.sync.rounds, loss=round(loss, 4),
                     tokens_per_s=round(done * self.slot.tokens_per_round() / elapsed),
                     eta_s=round((self.spec.sync.rounds - t - 1) * elapsed / done, 1))
            if self._window_cut_short(t):
                self._window_closed(t + 1, "now (fault 'close_window')")
                return False
        self.finish_checkpoint()
        if self.rank == 0:
            self._write_summary()
        return True

    def _window_closed(self, next_round: int, until: str) -> None:
        self.finish_checkpoint()
        if self.rank == 0:
            self.store.put_json(layout.learner_paused(self.slot.index, self.life),
                                {"learner": self.slot.index, "life": self.life, "next_round": next_round})
            emit("window_closed", learner=self.slot.index, island=self.slot.island.name, next_round=next_round,
                 rounds=self.spec.sync.rounds, until=until)

    def _window_cut_short(self, round_index: int) -> bool:
        """Fault injection: the capacity window ends right after this round, once (a marker remembers it)."""
        if not self.spec.faults_of(CloseWindow):
            return False
        cut = torch.tensor(0, device=self.device)
        if self.rank == 0 and self.spec.fault_at(CloseWindow, self.slot.index, round_index):
            marker = f"faults/closed-window-{self.slot.index:03d}-round-{round_index:05d}.json"
            if not self.store.exists(marker):
                self.store.put_json(marker, {"learner": self.slot.index, "round": round_index})
                cut.fill_(1)
        if self.world > 1:
            dist.broadcast(cut, src=0)
        return bool(cut.item())

    def _round_fits(self, until: datetime, clock: Callable[[], datetime], round_seconds: float) -> bool:
        """Whether one more round (as long as the last one) ends before `until`; rank 0 decides for its group."""
        fits = torch.tensor(int(clock() + timedelta(seconds=round_seconds) < until) if self.rank == 0 else 0,
                            device=self.device)
        if self.world > 1:
            dist.broadcast(fits, src=0)
        return bool(fits.item())

    def run_round(self, t: int) -> float:
        """Inner steps (applying the previous exchange tau steps in), send this round's fragment,
        checkpoint. Returns the mean inner loss."""
        round_started = time.monotonic()
        self._sync_seconds = 0.0
        loss = self.inner_steps(t)
        if self.pending is not None:  # tau equals this island's inner steps
            self._apply_pending()
        sending = time.monotonic()
        wait = partner_wait_s(self.spec.sync, sending - round_started - self._sync_seconds)
        self.sync_deadline = None if wait is None else sending + wait
        if self.rank == 0:
            weights = flat_parameters(self.model).cpu()
            if not math.isfinite(loss) or not bool(torch.isfinite(weights).all()):
                raise LearnerDiverged(f"learner {self.slot.index} round {t}: its inner loss ({loss}) or weights are "
                                      "not finite; stopping instead of sending them to its peers")
            self.pending = self._start_exchange(t, self.anchors, weights)
        else:
            self.pending = Exchange(t, fragment_of_round(t, self.fragments.count))
        self._sync_seconds += time.monotonic() - sending
        # The last round's mix is waited for: the final checkpoints are what consolidation averages.
        if self.spec.sync.transport.tau == 0 or t == self.spec.sync.rounds - 1:
            self._apply_pending()
        # Syncing is what the learner spent not computing: queueing the send and applying mixes,
        # including any wait for a message still on the link.
        sync_s = self._sync_seconds
        compute_s = time.monotonic() - round_started - sync_s
        self.traffic.seconds_computing += compute_s
        self.traffic.seconds_syncing += sync_s
        self.traffic.rounds.append({"round": t, "loss": loss, "compute_s": compute_s, "sync_s": sync_s,
                                    "fragment": fragment_of_round(t, self.fragments.count)})
        if self.rank == 0:
            self._checkpoint(t)
        return loss

    def _checkpoint(self, t: int) -> None:
        tensors, meta = self._state()
        key, meta = layout.checkpoint(self.slot.index, t), {**meta, "round": t}
        if not self.spec.sync.transport.checkpoint_in_background:
            self.traffic.checkpoint += self.store.commit_tensors(key, tensors, meta)
            return
        self.finish_checkpoint()  # at most one in flight
        # Training goes on changing the state while the write runs: the checkpoint gets its own copy.
        copies = {name: tensor.clone() for name, tensor in tensors.items()}
        self._checkpoint_in_flight = self.transport.submit("checkpoint", self.store.commit_tensors, key, copies, meta)

    def finish_checkpoint(self) -> None:
        """Wait for a checkpoint still being written in the background; its errors surface here."""
        if self._checkpoint_in_flight is not None:
            written, self._checkpoint_in_flight = self._checkpoint_in_flight, None
            self.traffic.checkpoint += written.result()

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
                   "seconds_blocked": self.traffic.seconds_blocked, "exchanges": self.traffic.exchanges,
                   "links": self.transport.report(), "fragment_sizes": self.fragments.sizes,
                   "store_faults_injected": dict(getattr(self.store.fs, "counts", {})),
                   "lives": self._lives()}
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
    parser.add_argument("--until", type=datetime.fromisoformat, default=None,
                        help="end of the island's capacity window (ISO 8601 with offset): stop cleanly before it")
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
        finished = learner.run(args.until)
    finally:
        if world > 1:
            dist.destroy_process_group()
    # torchrun reports any non-zero exit as a failure: a group's pause shows as its missing summary instead.
    return 0 if finished or world > 1 else WINDOW_CLOSED


if __name__ == "__main__":
    sys.exit(main())
