"""One learner: a model replica that trains on its shard and talks to other learners only
through the object store.

Each learner is its own OS process (`training.learner.process`), or a `torchrun` group of processes
that share its model as its island's parallelism says (`training.model.parallel`: data parallel, or
sharded with FSDP2). Rank 0 owns all store traffic; the other ranks only compute, take part in
gathering what rank 0 sends and checkpoints, and receive each round's new weights from rank 0.

A round: H AdamW steps from the anchor, each a plain step (forward, backward, optimizer step) followed
by the hooks after a step; then this round's fragment goes to the exchange (`training.learner.sync`),
which sends and receives on the transport thread while the next round computes and is applied from
its hook `sync.transport.tau` inner steps later (at once with tau 0). Injected faults attach from
outside (`training.learner.faults.LearnerFaults.attach`). Then a checkpoint of the whole state (`training.learner.state`), an exchange in flight included, so a
restarted learner resumes from it and applies that exchange exactly once; after the rounds the bpb
curve scores, the weights alone as well, which outlive the round's checkpoint. A learner stops
before a round that would not end inside its capacity window; the next window's segment resumes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from infra import layout, watchdog
from infra.spec import LearnerSlot, RunSpec
from infra.store import ObjectStore, StoreError
from infra.stores import RunStores
from training.exchange.transport import Transport
from infra.spec.windows import round_fits
from training.data.streams import WindowSampler, read_stream
from training.events import emit
from training.model.inner import forward_precision, inner_optimizer, optimizer_step
from training.learner.ledger import Ledger, LearnerSummary, StepValues, peak_memory_bytes, step_stride, write_summary
from training.model.registry import initial_model
from training.model.parallel import LearnerParallelism
from training.model.params import flat_parameters
from training.learner.retention import Retention
from training.model.schedule import curve_rounds, learning_rate
from training.learner.state import Checkpointer, LearnerState, Lives, choose_resume_point, own_ledger
from training.exchange.exchanger import Exchanger
from training.learner.sync import LearnerDiverged, RoundSync

__all__ = ["Learner", "LearnerDiverged"]


class Learner:
    def __init__(self, spec: RunSpec, stores: RunStores | ObjectStore, index: int, rank: int = 0, world: int = 1):
        """`stores`: where the run's objects live (a plain store: the run's, for every island)."""
        self.stores = stores if isinstance(stores, RunStores) else RunStores(spec, stores)
        self.spec, self.store, self.rank, self.world = spec, self.stores.learner(index), rank, world
        self.slot: LearnerSlot = spec.learners[index]
        self.device = torch.device(self.slot.island.device if self.slot.island.device == "cpu"
                                   else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        island = self.slot.island
        self.parallel = LearnerParallelism(island.parallelism, rank, world, self.device, island.fsdp_mixed_precision,
                                           island.activation_checkpointing)
        self.model = initial_model(spec, self.stores.run)
        initial = flat_parameters(self.model)
        self.parallel.place(self.model)
        self.inner = inner_optimizer(self.model.parameters(), spec.training.lr, spec.training.weight_decay)
        self.transport = Transport.of(self.store, spec.sync.transport, read_from=self.stores.learner)
        self.lives = Lives(self.stores.learner, spec.sync.rounds)
        self.exchanger = Exchanger(spec, self.slot, self.transport, self.model, initial, skipped=self.lives.skipped_by)
        parameters = dict(self.model.named_parameters())
        self.ledger = Ledger()
        self.sync = RoundSync(self.exchanger, self.parallel,
                              [[parameters[name] for name in names] for names in self.exchanger.layout.names],
                              self.ledger, spec.sync, lead=rank == 0)
        # Called after every inner optimizer step with (round, steps done in it): the exchange's, and
        # whatever attaches from outside (injected faults).
        self.after_step = [self.sync.after_step]
        # Whether a capacity window ends right after a round, as an injected fault says on rank 0 (None:
        # none does, and the group need not agree on it each round).
        self.window_ends_after: Callable[[int], bool] | None = None
        self.step_stride = step_stride(self.slot.island.inner_steps * spec.sync.rounds)
        self.state = LearnerState(self.model, self.inner, self.exchanger, self.ledger, self.transport, self.parallel)
        # The bpb curve scores the learners' weights after these rounds once training is over.
        self.curve_rounds = set(curve_rounds(spec.sync.rounds, spec.evaluation.curve_points))
        self.checkpoints = Checkpointer(self.store, self.transport, self.ledger,
                                        spec.sync.transport.checkpoint_in_background,
                                        Retention(self.stores.learner, index, len(spec.learners), spec.training.keep_checkpoints))
        self.checkpointed = -1  # the newest round this life has checkpointed
        shard = read_stream(self.store, self.stores.run.get_json(layout.DATA_MANIFEST)["shards"][index])
        self.sampler = WindowSampler(shard, self.slot.island.seq_len, seed=spec.seed)
        # Every rank draws the learner's whole batch and trains on its share of the rows: the learner
        # trains on the same rows however many processes it has.
        self.my_rows = slice(rank * self.slot.island.batch_size // world, (rank + 1) * self.slot.island.batch_size // world)
        self.start_round, self.rejoined_from = 0, None
        self.life = 0  # this process's life among the learner's lives (restarts, window resumes)

    # -- resuming -----------------------------------------------------------------------------------

    def resume(self) -> None:
        """Continue from the newest state this learner can trust, if this is a restart.

        A learner's first life starts from the run's initial weights, however late it starts: its
        peers' progress is no reason to skip its own share of the compute. A later life resumes
        where `training.learner.state.choose_resume_point` says. Rank 0 decides and tells the other ranks,
        so a torchrun group never splits between two states.
        """
        point = None
        if self.rank == 0:
            self.life = len(self.lives.of(self.slot.index))
            rounds = self.spec.sync.rounds
            point = None if not self.life else choose_resume_point(
                self.stores.learner, self.slot.index, len(self.spec.learners), rounds,
                lambda tensors, meta: self.state.check(tensors, meta, rounds))
        learner, t = self._from_rank0((point.learner, point.round) if point else (-1, -1))
        if t >= 0:
            tensors, meta = (point.tensors, point.meta) if point else \
                self.stores.learner(learner).read_committed(layout.checkpoint(learner, t))[:2]
            self._resume_from(learner, t, tensors, meta)
        if self.rank == 0:
            self.life = self.lives.record(self.slot.index, self.life, self.start_round, self.rejoined_from)

    def _resume_from(self, learner: int, t: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """A learner that rejoins from a peer's checkpoint drops the peer's exchange in flight and
        starts with an empty residual: both belong to the peer. Its own exchange in flight is sent
        again from the checkpoint's state (the same bytes: write-once makes the re-send a no-op)
        and applied at the same point, so its mix is applied exactly once."""
        self.state.load_state_dict(tensors, meta)
        if self.rank == 0:
            self.ledger.load_state_dict(own_ledger(self.store, self.slot.index, self.spec.sync.rounds).state_dict())
            self.transport.load_report(self.ledger.links, self.ledger.stores)
        if learner != self.slot.index:
            self.exchanger.feedback.reset()
        else:
            self.sync.resume(meta.get("pending"))
        self.start_round = t + 1
        self.rejoined_from = {"learner": learner, "round": t}
        emit("resumed", learner=self.slot.index, from_learner=learner, round=t)

    # -- rounds -------------------------------------------------------------------------------------

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
            round_started, booked = time.monotonic(), self.ledger.mark()
            loss = self.run_round(t)
            round_seconds = time.monotonic() - round_started
            if self.rank == 0:
                done, elapsed = t + 1 - self.start_round, time.monotonic() - started
                # The ledger entries of the round go along only for a tracker (the relay's only use of them).
                tracked = {"booked": self.ledger.booked_since(booked)} if self.spec.tracking.backend != "none" else {}
                emit("round", learner=self.slot.index, island=self.slot.island.name, round=t,
                     rounds=self.spec.sync.rounds, loss=round(loss, 4),
                     tokens_per_s=round(done * self.slot.tokens_per_round() / elapsed),
                     eta_s=round((self.spec.sync.rounds - t - 1) * elapsed / done, 1), **tracked)
            if self._window_cut_short(t):
                self._window_closed(t + 1, "now (fault 'close_window')")
                return False
        self.checkpoints.finish()
        if self.rank == 0:
            self._write_summary()
        return True

    def run_round(self, t: int) -> float:
        """Inner steps, the round's end to the exchange, checkpoint. Returns the mean inner loss."""
        round_started = time.monotonic()
        self.sync.begin_round()
        loss, steps = self.inner_steps(t)
        self.sync.end_round(t, loss, round_started, last=t == self.spec.sync.rounds - 1)
        # Syncing is what the learner spent not computing: queueing the send and applying mixes,
        # including any wait for a message still on the link.
        self.ledger.book_round(t, self.exchanger.fragment_of(t).number, loss,
                               time.monotonic() - round_started - self.sync.seconds, self.sync.seconds, steps)
        # One copy of the whole model (on rank 0), for the rounds that keep it.
        keeps = t in self.curve_rounds or self._checkpoint_due(t)
        weights = self.parallel.gather(list(self.model.parameters())) if keeps else None
        # Before the checkpoint: a learner resumed from that checkpoint never comes back to this round.
        if self.rank == 0 and t in self.curve_rounds:
            self.checkpoints.write_curve_weights(layout.curve_weights(self.slot.index, t), weights, {"round": t})
        if self._checkpoint_due(t):
            checkpointing = time.monotonic()
            self._checkpoint(t, weights)
            self.ledger.book_checkpoint(time.monotonic() - checkpointing)
        return loss

    def _checkpoint_due(self, t: int) -> bool:
        return (t + 1) % self.spec.training.checkpoint_every == 0 or t == self.spec.sync.rounds - 1

    def _checkpoint(self, t: int, weights: torch.Tensor | None) -> None:
        """Every rank calls it (a sharded learner gathers its optimizer state); rank 0 writes it.
        `weights`: the model's flat parameters as `parallel.gather` gave them."""
        state = self.state.state_dict(self.sync.pending, weights)
        if self.rank == 0:
            tensors, meta = state
            self.checkpoints.write(t, tensors, {**meta, "round": t})
        self.checkpointed = t

    def inner_steps(self, round_index: int) -> tuple[float, StepValues]:
        """The round's inner steps: their mean loss, and the values of those the ledger keeps."""
        island = self.slot.island
        total = island.inner_steps * self.spec.sync.rounds
        # Reseeded per round, so a resumed learner draws the windows it would have drawn anyway; every
        # rank draws the same ones (the learner's batch) whatever its number.
        self.sampler.generator.manual_seed(hash((self.spec.seed, self.slot.index, 0, round_index)) & 0x7FFF_FFFF_FFFF_FFFF)
        losses, kept = [], StepValues()
        for h in range(island.inner_steps):
            step = round_index * island.inner_steps + h
            lr = learning_rate(step, total, self.spec.training.lr, self.spec.training.warmup_steps)
            inputs, targets = (rows[self.my_rows] for rows in self.sampler.batch(island.batch_size))
            with forward_precision(self.device, island.precision):
                loss = self.model.loss(inputs.to(self.device), targets.to(self.device))
            self.inner.zero_grad(set_to_none=False)
            loss.backward()
            self.parallel.sync_gradients(self.model)
            grad_norm = optimizer_step(self.model, self.inner, lr)
            losses.append(loss.item())
            if (step + 1) % self.step_stride == 0:
                kept.keep(step, losses[-1], lr, grad_norm, peak_memory_bytes(self.device))
            watchdog.progress()
            for hook in self.after_step:
                hook(round_index, h + 1)
        return sum(losses) / len(losses), kept

    def _write_summary(self) -> None:
        summary = LearnerSummary.of(
            self.ledger, self.slot.tokens_per_round(), learner=self.slot.index, island=self.slot.island.name,
            processes=self.world, rejoined_from=self.rejoined_from, lives=self.lives.of(self.slot.index),
            links=self.transport.report(), stores=dict(self.transport.by_store), store_url=self.store.url,
            fragment_sizes=self.exchanger.layout.sizes, store=dict(self.store.stats),
            store_faults_injected=dict(getattr(self.store.fs, "counts", {})),
            final_checkpoint=self._final_checkpoint(), influence=self.exchanger.applied_influence.report())
        write_summary(self.store, self.spec, summary)
        emit("done", learner=self.slot.index)

    def _final_checkpoint(self) -> dict | None:
        """The final round's checkpoint as this learner committed it (its commit, read back verified), or
        None where something else took that key first (`CheckpointWriter` skipped it)."""
        key = layout.checkpoint(self.slot.index, self.spec.sync.rounds - 1)
        try:
            return {"key": key, "sha256": self.store.get_json(f"{key}.json")["tensors"]["sha256"]}
        except (StoreError, KeyError, TypeError):
            return None

    # -- capacity windows -----------------------------------------------------------------------------

    def _round_fits(self, until: datetime, clock: Callable[[], datetime], round_seconds: float) -> bool:
        """Whether one more round (as long as the last one) ends before `until`; rank 0 decides for its group."""
        fits = self.rank == 0 and round_fits((until - clock()).total_seconds(), round_seconds)
        return bool(self._from_rank0((int(fits),))[0])

    def _window_cut_short(self, round_index: int) -> bool:
        """Fault injection: the capacity window ends right after this round; rank 0 decides for its group."""
        if self.window_ends_after is None:
            return False
        return bool(self._from_rank0((int(self.window_ends_after(round_index)),))[0])

    def _window_closed(self, next_round: int, until: str) -> None:
        """The next window resumes from the last round this one finished: it is checkpointed, whatever
        `checkpoint_every` says."""
        last = next_round - 1
        if last >= self.start_round and last != self.checkpointed:
            self._checkpoint(last, self.parallel.gather(list(self.model.parameters())))
        self.checkpoints.finish()
        if self.rank == 0:
            self.lives.record_pause(self.slot.index, self.life, next_round)
            emit("window_closed", learner=self.slot.index, island=self.slot.island.name, next_round=next_round,
                 rounds=self.spec.sync.rounds, until=until)

    def _from_rank0(self, values: tuple[int, ...]) -> list[int]:
        """Rank 0's values on every rank: what rank 0 decides, its whole group does."""
        agreed = torch.tensor(values, device=self.device)
        if self.world > 1:
            dist.broadcast(agreed, src=0)
        return agreed.tolist()

