"""A learner's checkpointable state, its lives, and where a restarted learner resumes from.

The checkpoint of round t is the learner's whole state: weights, the inner optimizer's moments,
the exchanger's anchors, outer optimizers and error-feedback residual, the ledger, and the
exchange still in flight (see `training.learner`). Each part has its own state_dict; this module
puts them together in the checkpoint's one layout and takes them apart again.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from infra import layout
from infra.store import IntegrityError, ObjectMissing, ObjectStore, StoreError
from training.events import emit
from training.ledger import Ledger
from training.params import flat_parameters, load_flat_parameters
from training.retention import Retention, checkpoint_rounds
from training.sync import Exchange, Exchanger


class LearnerState:
    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, exchanger: Exchanger,
                 ledger: Ledger, transport, device: torch.device):
        self.model, self.inner, self.exchanger = model, inner, exchanger
        self.ledger, self.transport, self.device = ledger, transport, device

    def state_dict(self, pending: Exchange | None) -> tuple[dict[str, torch.Tensor], dict]:
        exchanger_tensors, outer_scalars = self.exchanger.state_dict()
        tensors = {"weights": flat_parameters(self.model).cpu(), **exchanger_tensors}
        # With one fragment and nothing in flight, the anchor is the weights the round ended on.
        if len(self.exchanger.fragments) > 1 or pending is not None:
            tensors["anchors"] = self.exchanger.anchors()
        for i, p in enumerate(self.model.parameters()):
            for name, value in self.inner.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"inner.{i}.{name}"] = value.cpu()
        first = self.inner.state.get(next(self.model.parameters()), {})
        self.ledger.links, self.ledger.stores = self.transport.report(), self.transport.by_store
        in_flight = None if pending is None else {"round": pending.round, "fragment": pending.fragment}
        return tensors, {"inner_step": int(first.get("step", 0)), "outer": outer_scalars,
                         "traffic": self.ledger.state_dict(), "pending": in_flight}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Weights, inner moments and the exchanger's state; the ledger is the learner's own (see
        `own_ledger`), since the checkpoint may be a peer's."""
        load_flat_parameters(self.model, tensors["weights"].to(self.device))
        self.exchanger.load_anchors(tensors.get("anchors", tensors["weights"]))
        self.exchanger.load_state_dict(tensors, meta.get("outer", {}))
        for i, p in enumerate(self.model.parameters()):
            if f"inner.{i}.exp_avg" in tensors:
                self.inner.state[p] = {"step": torch.tensor(float(meta["inner_step"])),
                                       "exp_avg": tensors[f"inner.{i}.exp_avg"].to(self.device),
                                       "exp_avg_sq": tensors[f"inner.{i}.exp_avg_sq"].to(self.device)}


class Checkpointer:
    """Commits a learner's checkpoints, in the foreground or, with
    `sync.transport.checkpoint_in_background`, on the transport thread while the next round
    computes. At most one is in flight; `finish` waits for it, and its errors surface there. Once a
    checkpoint is committed, `retention` retires what it makes unneeded (on the calling thread, the
    only one that writes the ledger)."""

    def __init__(self, store: ObjectStore, transport, ledger: Ledger, background: bool, retention: Retention):
        self.store, self.transport, self.ledger, self.background = store, transport, ledger, background
        self.retention = retention
        self._in_flight: Future | None = None

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        if not self.background:
            self._committed(self.store.commit_tensors(key, tensors, meta))
            return
        self.finish()
        # Training goes on changing the state while the write runs: the checkpoint gets its own copy.
        copies = {name: tensor.clone() for name, tensor in tensors.items()}
        self._in_flight = self.transport.submit("checkpoint", self.store.commit_tensors, key, copies, meta)

    def write_curve_weights(self, key: str, weights: torch.Tensor, meta: dict) -> None:
        """Commit the weights alone of a round the bpb curve scores (`layout.curve_weights`), in the
        foreground: a few per run, and small. A round replayed after a restart may mix other messages
        and end on other weights; the first commit stands (objects are written once), and the replay
        writes none."""
        if not self.store.is_committed(key):
            self.ledger.checkpoint_bytes += self.store.commit_tensors(key, {"weights": weights}, meta)

    def finish(self) -> None:
        if self._in_flight is not None:
            written, self._in_flight = self._in_flight, None
            self._committed(written.result())

    def _committed(self, nbytes: int) -> None:
        self.ledger.checkpoint_bytes += nbytes
        self.ledger.objects_retired += self.retention.after_checkpoint()


class Lives:
    """The lives of a run's learners, as each records them when it starts (and when it pauses at
    its capacity window's end). Records are write-once, so each is read once."""

    def __init__(self, store_of: Callable[[int], ObjectStore]):
        """`store_of(i)`: the store holding learner i's objects (see infra/stores.py)."""
        self.store_of = store_of
        self._records: dict[str, dict] = {}

    def of(self, learner: int) -> list[dict]:
        """A learner's lives, oldest first, each with whether it ended at a window's end."""
        keys = self.store_of(learner).list(layout.liveness_prefix(learner))
        paused = {key.replace("/paused-", "/life-") for key in keys if "/paused-" in key}
        return [{**self._record(learner, key), "paused": key in paused} for key in keys if "/life-" in key]

    def skipped_by(self, peer: int, round_index: int) -> bool:
        """Whether a restart of `peer` skipped the round: its message of that round never comes. A
        peer whose records are out of reach is waited for until the deadline, as if it had not."""
        try:
            return any(round_index in life["skipped_rounds"] for life in self.of(peer))
        except StoreError:
            return False

    def record(self, learner: int, life: int, start_round: int, resumed_from: dict | None) -> None:
        """Record that a life has begun, with the rounds whose messages will never come: a learner
        that rejoins from a peer's checkpoint skips the rounds between its own newest checkpoint
        and that one, and a partner waiting for one of them stops at once."""
        skipped: list[int] = []
        if resumed_from is not None and resumed_from["learner"] != learner:
            skipped = list(range(max(checkpoint_rounds(self.store_of(learner), learner), default=-1) + 1, start_round))
        self.store_of(learner).put_json(layout.learner_life(learner, life), {
            "learner": learner, "life": life, "start_round": start_round, "resumed_from": resumed_from,
            "skipped_rounds": skipped, "host": socket.gethostname(), "pid": os.getpid(),
            "started_at": datetime.now(timezone.utc).isoformat()})
        if skipped:
            emit("skipping_rounds", learner=learner, first=skipped[0], last=skipped[-1])

    def record_pause(self, learner: int, life: int, next_round: int) -> None:
        self.store_of(learner).put_json(layout.learner_paused(learner, life),
                                        {"learner": learner, "life": life, "next_round": next_round})

    def _record(self, learner: int, key: str) -> dict:
        if key not in self._records:
            self._records[key] = self.store_of(learner).get_json(key)
        return self._records[key]


@dataclass
class ResumePoint:
    learner: int  # whose checkpoint: this learner's own, or a peer's it rejoins from
    round: int
    tensors: dict[str, torch.Tensor]
    meta: dict


def choose_resume_point(store_of: Callable[[int], ObjectStore], me: int, learners: int) -> ResumePoint | None:
    """The newest state a restarted learner can trust: its own newest checkpoint, unless a peer has
    committed one at least two rounds newer; then the peer's, and the learner rejoins at the round
    its peers are in. Replaying the missed rounds from its own older state would keep it behind,
    and every partner would wait out a deadline for it each round; a peer's checkpoint is that
    peer's consensus state after the same rounds. Only checkpoints whose checksums verify are used;
    a corrupt one falls back to the next newest. `store_of(i)`: the store holding learner i's objects."""
    own = checkpoint_rounds(store_of(me), me)
    newest_own = max(own, default=-1)
    # A peer one round ahead is ordinary skew between learners, not a reason to leave our own state.
    fresher = [(t, peer) for peer in range(learners) if peer != me
               for t in checkpoint_rounds(store_of(peer), peer) if t > newest_own + 1]
    candidates = sorted(fresher + [(t, me) for t in own], key=lambda c: (c[0], c[1] == me), reverse=True)
    for t, learner in candidates:
        try:
            tensors, meta, _ = store_of(learner).read_committed(layout.checkpoint(learner, t))
        except IntegrityError as err:
            emit("corrupt_checkpoint", learner=me, error=str(err))
            continue
        except ObjectMissing:  # retired by its learner after we listed it: a newer one exists
            continue
        return ResumePoint(learner, t, tensors, meta)
    return None


def own_ledger(store: ObjectStore, learner: int) -> Ledger:
    """The ledger of a learner's earlier lives, from its newest checkpoint that reads."""
    for t in sorted(checkpoint_rounds(store, learner), reverse=True):
        try:
            return Ledger(**store.get_json(f"{layout.checkpoint(learner, t)}.json")["traffic"])
        except IntegrityError:
            continue
    return Ledger()
