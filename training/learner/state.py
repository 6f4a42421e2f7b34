"""A learner's checkpointable state, its lives, and where a restarted learner resumes from.

The checkpoint of round t is the learner's whole state: weights, the inner optimizer's moments,
the exchanger's anchors, outer optimizers and error-feedback residual, the ledger, and the
exchange still in flight (see `training.learner.loop`). Each part has its own state_dict; this module
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
from infra.store import IntegrityError, ObjectExists, ObjectMissing, ObjectStore, StoreError
from training.events import emit
from training.learner.ledger import Ledger
from training.exchange.messages import short
from training.exchange.outer import StateRejected
from training.model.parallel import LearnerParallelism
from training.learner.retention import Retention, checkpoint_rounds
from training.exchange.exchanger import Exchanger
from training.exchange.plan import Exchange


class RecordRejected(ValueError):
    """A life or pause record that is not what its learner writes; says which record and why."""


class CheckpointRejected(ValueError):
    """A checkpoint that is not a state of this learner's model and optimizers; says which part."""


# A checkpoint's weights may lie this many times the initial weights' norm from them: training moves
# weights by a fraction of their norm, a planted checkpoint by whatever it likes.
MAX_WEIGHT_GROWTH = 100.0


class LearnerState:
    """The state in the checkpoint's one layout whatever the learner's parallelism: the weights and the
    inner optimizer's moments whole, as one process would hold them (`training.model.parallel`)."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, exchanger: Exchanger,
                 ledger: Ledger, transport, parallel: LearnerParallelism):
        self.model, self.inner, self.exchanger = model, inner, exchanger
        self.ledger, self.transport, self.parallel = ledger, transport, parallel

    def check(self, tensors: dict[str, torch.Tensor], meta: dict, rounds: int) -> None:
        """Raise CheckpointRejected unless a checkpoint (this learner's or a peer's) is a state this
        learner can take: the tensors its own state has, with their dtypes and shapes, finite, weights
        within bounds of the initial ones, outer state that fits its optimizers, sane scalars."""
        initial = self.exchanger.initial
        params = list(self.model.parameters())
        allowed = {"weights": initial, "anchors": initial,
                   **{f"inner.{i}.{name}": p for i, p in enumerate(params) for name in ("exp_avg", "exp_avg_sq")},
                   **self.exchanger.feedback.state_tensors()}
        for name, value in tensors.items():
            if name.startswith("outer.") or name.startswith("fragment-"):
                continue  # the outer optimizers' own check, below
            if name.startswith("influence."):
                self._check_influence(name, value)
                continue
            want = allowed.get(name)
            if want is None:
                raise CheckpointRejected(f"checkpoint holds an unknown tensor {short(name)}")
            if value.dtype != torch.float32 or value.shape != want.shape:
                raise CheckpointRejected(f"checkpoint tensor {name!r} is {value.dtype} {tuple(value.shape)}, "
                                         f"expected float32 {tuple(want.shape)}")
            if not bool(torch.isfinite(value).all()):
                raise CheckpointRejected(f"checkpoint tensor {name!r} holds non-finite values")
        for name in ("weights", "anchors"):
            if name in tensors and float((tensors[name] - initial).norm()) > MAX_WEIGHT_GROWTH * float(initial.norm()):
                raise CheckpointRejected(f"checkpoint tensor {name!r} lies implausibly far from the initial weights")
        if "weights" not in tensors:
            raise CheckpointRejected("checkpoint holds no weights")
        if any(bool((value < 0).any()) for name, value in tensors.items() if name.endswith(".exp_avg_sq")):
            raise CheckpointRejected("checkpoint holds negative second moments")
        step, pending = meta.get("inner_step"), meta.get("pending")
        if type(step) is not int or step < 0:
            raise CheckpointRejected("checkpoint's inner_step is not a count")
        if pending is not None and not (isinstance(pending, dict) and set(pending) == {"round", "fragment"}
                                        and type(pending["round"]) is int and 0 <= pending["round"] < rounds
                                        and type(pending["fragment"]) is int
                                        and 0 <= pending["fragment"] < len(self.exchanger.fragments)):
            raise CheckpointRejected("checkpoint's exchange in flight names no round and fragment of this run")
        self.exchanger.check_state(tensors, meta.get("outer", {}))

    def _check_influence(self, name: str, value: torch.Tensor) -> None:
        """A pair's agreed anchor (`training.exchange.influence`): of a fragment of this run, its size, finite."""
        parts = name.split(".")
        fragments = self.exchanger.fragments
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]) or int(parts[2]) >= len(fragments):
            raise CheckpointRejected(f"checkpoint holds an unknown tensor {short(name)}")
        want = fragments[int(parts[2])].index.shape
        if value.dtype != torch.float32 or value.shape != want or not bool(torch.isfinite(value).all()):
            raise CheckpointRejected(f"checkpoint tensor {name!r} is no finite float32 anchor of its fragment")

    def state_dict(self, pending: Exchange | None,
                   weights: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The state as tensors that training never changes afterwards (copies, or the exchanger's
        snapshots), so a checkpoint can be written from them while training goes on. `weights`: a copy
        of the model's flat parameters (`parallel.gather`'s). Every rank of the learner calls it (a
        sharded learner gathers its optimizer state); rank 0 gets the state, the others None."""
        moments = {f"inner.{i}.{name}": self.parallel.full_copy(value)
                   for i, p in enumerate(self.model.parameters())
                   for name, value in self.inner.state.get(p, {}).items() if torch.is_tensor(value) and value.dim() > 0}
        if self.parallel.rank != 0:
            return None
        exchanger_tensors, outer_scalars = self.exchanger.state_dict()
        influence_tensors, influence = self.exchanger.applied_influence.state_dict()
        tensors = {"weights": weights, **exchanger_tensors, **influence_tensors}
        # With one fragment and nothing in flight, the anchor is the weights the round ended on.
        if len(self.exchanger.fragments) > 1 or pending is not None:
            tensors["anchors"] = self.exchanger.anchors()
        tensors.update(moments)
        first = self.inner.state.get(next(self.model.parameters()), {})
        self.ledger.links, self.ledger.stores = self.transport.report(), self.transport.by_store
        in_flight = None if pending is None else {"round": pending.round, "fragment": pending.fragment}
        return tensors, {"inner_step": int(first.get("step", 0)), "outer": outer_scalars,
                         "traffic": self.ledger.state_dict(), "pending": in_flight, "influence": influence}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Weights, inner moments and the exchanger's state; the ledger is the learner's own (see
        `own_ledger`), since the checkpoint may be a peer's."""
        self.parallel.load(tensors["weights"], list(self.model.parameters()))
        self.exchanger.load_anchors(tensors.get("anchors", tensors["weights"]))
        self.exchanger.load_state_dict(tensors, meta.get("outer", {}))
        self.exchanger.load_influence(tensors, meta.get("influence"))
        for i, p in enumerate(self.model.parameters()):
            if f"inner.{i}.exp_avg" in tensors:
                self.inner.state[p] = {"step": torch.tensor(float(meta["inner_step"])),
                                       "exp_avg": self.parallel.local(tensors[f"inner.{i}.exp_avg"], p),
                                       "exp_avg_sq": self.parallel.local(tensors[f"inner.{i}.exp_avg_sq"], p)}


class Checkpointer:
    """Commits a learner's checkpoints, in the foreground or, with
    `sync.transport.checkpoint_in_background`, on the transport thread while the next round
    computes. At most one is in flight; `finish` waits for it, and its errors surface there. Once a
    checkpoint is committed, `retention` retires what it makes unneeded (on the calling thread, the
    only one that writes the ledger)."""

    def __init__(self, store: ObjectStore, transport, ledger: Ledger, background: bool, retention: Retention):
        self.store, self.transport, self.ledger, self.background = store, transport, ledger, background
        self.retention = retention
        self._in_flight: tuple[int, Future] | None = None  # (round, its commit on the transport thread)

    def write(self, round_index: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Commit the checkpoint of round `round_index`. `tensors` must not change after this call
        (`LearnerState.state_dict`'s never do): in the background they are written while training goes on."""
        key = layout.checkpoint(self.retention.learner, round_index)
        if not self.background:
            self._committed(round_index, self._commit(key, tensors, meta))
            return
        self.finish()
        self._in_flight = (round_index, self.transport.submit("checkpoint", self._commit, key, tensors, meta))

    def _commit(self, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> int:
        """Commit a checkpoint; one whose key something else took first is skipped (it costs a
        checkpoint, never the run: a restart resumes from an older one)."""
        try:
            return self.store.commit_tensors(key, tensors, meta)
        except ObjectExists:
            self.store.refused(key)
            emit("checkpoint_key_taken", key=key)
            return 0

    def write_curve_weights(self, key: str, weights: torch.Tensor, meta: dict) -> None:
        """Commit the weights alone of a round the bpb curve scores (`layout.curve_weights`), in the
        foreground: a few per run, and small. A round replayed after a restart may mix other messages
        and end on other weights; the first commit stands (objects are written once), and the replay
        writes none."""
        if not self.store.is_committed(key):
            self.ledger.checkpoint_bytes += self.store.commit_tensors(key, {"weights": weights}, meta)

    def finish(self) -> None:
        if self._in_flight is not None:
            (round_index, written), self._in_flight = self._in_flight, None
            self._committed(round_index, written.result())

    def _committed(self, round_index: int, nbytes: int) -> None:
        self.ledger.checkpoint_bytes += nbytes
        self.ledger.objects_retired += self.retention.after_checkpoint(round_index, written=nbytes > 0)


class Lives:
    """The lives of a run's learners, as each records them when it starts (and when it pauses at
    its capacity window's end). Records are write-once, so each is read once."""

    def __init__(self, store_of: Callable[[int], ObjectStore], rounds: int):
        """`store_of(i)`: the store holding learner i's objects (see infra/stores.py); `rounds`: the run's."""
        self.store_of, self.rounds = store_of, rounds
        self._records: dict[str, dict | None] = {}

    def of(self, learner: int) -> list[dict]:
        """A learner's lives, oldest first, each with whether it ended at a window's end. A record that
        does not verify or does not fit its schema is no life: a planted one changes nothing."""
        keys = self.store_of(learner).list(layout.liveness_prefix(learner))
        paused = {key.replace("/paused-", "/life-") for key in keys
                  if "/paused-" in key and self._record(learner, key) is not None}
        lives = [(key, self._record(learner, key)) for key in keys if "/life-" in key]
        return [{**record, "paused": key in paused} for key, record in lives if record is not None]

    def skipped_by(self, peer: int, round_index: int) -> bool:
        """Whether a restart of `peer` skipped the round: its message of that round never comes. A
        peer whose records are out of reach is waited for until the deadline, as if it had not."""
        try:
            return any(round_index in life["skipped_rounds"] for life in self.of(peer))
        except StoreError:
            return False

    def record(self, learner: int, life: int, start_round: int, resumed_from: dict | None) -> int:
        """Record that a life has begun, with the rounds whose messages will never come: a learner
        that rejoins from a peer's checkpoint skips the rounds between its own newest checkpoint
        and that one, and a partner waiting for one of them stops at once. Returns the life's number:
        `life`, or the first one past it whose key the store does not list, if something that is not a
        life of ours sits under its key (however many keys are squatted, one listing finds a free one)."""
        skipped: list[int] = []
        store = self.store_of(learner)
        if resumed_from is not None and resumed_from["learner"] != learner:
            skipped = list(range(max(checkpoint_rounds(store, learner, self.rounds), default=-1) + 1, start_round))
        number = life
        while True:
            try:
                store.put_json(layout.learner_life(learner, number), {
                    "learner": learner, "life": number, "start_round": start_round, "resumed_from": resumed_from,
                    "skipped_rounds": skipped, "host": socket.gethostname()[:255], "pid": os.getpid(),
                    "started_at": datetime.now(timezone.utc).isoformat()})
                break
            except ObjectExists:
                emit("life_key_taken", learner=learner, life=number)
                listed = set(store.list(layout.liveness_prefix(learner)))
                number += 1
                while layout.learner_life(learner, number) in listed:
                    number += 1
        if skipped:
            emit("skipping_rounds", learner=learner, first=skipped[0], last=skipped[-1])
        return number

    def record_pause(self, learner: int, life: int, next_round: int) -> None:
        self.store_of(learner).put_json(layout.learner_paused(learner, life),
                                        {"learner": learner, "life": life, "next_round": next_round})

    def _record(self, learner: int, key: str) -> dict | None:
        """A life or pause record that verifies and fits its schema; None (and counted as refused) for anything else."""
        if key not in self._records:
            store = self.store_of(learner)
            try:
                record = store.get_json(key, max_bytes=RECORD_MAX_BYTES)
                self._records[key] = _checked_record(record, learner, key, self.rounds)
            except IntegrityError:
                self._records[key] = None
            except RecordRejected:
                store.refused(key)
                self._records[key] = None
        return self._records[key]


RECORD_MAX_BYTES = 1 << 20  # a life lists the rounds it skips: a few bytes per round of the run


def _checked_record(record: dict, learner: int, key: str, rounds: int) -> dict:
    """A life or pause record as its learner writes it (`Lives.record`, `Lives.record_pause`), or
    RecordRejected: its learner and life those of its key, its rounds within the run."""
    def count(value, upper: int) -> bool:
        return type(value) is int and 0 <= value <= upper

    life = int(key.rsplit("-", 1)[1].removesuffix(".json"))
    if record.get("learner") != learner or record.get("life") != life:
        raise RecordRejected(f"record {key} is not learner {learner}'s life {life}")
    if "/paused-" in key:
        if not count(record.get("next_round"), rounds):
            raise RecordRejected(f"record {key}: next_round is not a round of the run")
        return record
    skipped, resumed = record.get("skipped_rounds"), record.get("resumed_from")
    if not count(record.get("start_round"), rounds) or not isinstance(skipped, list) or len(skipped) > rounds \
            or not all(count(t, rounds - 1) for t in skipped):
        raise RecordRejected(f"record {key}: its rounds are not rounds of the run")
    if resumed is not None and not (isinstance(resumed, dict) and count(resumed.get("learner"), 1 << 20)
                                    and count(resumed.get("round"), rounds - 1)):
        raise RecordRejected(f"record {key}: resumed_from names no checkpoint of the run")
    return record


@dataclass
class ResumePoint:
    learner: int  # whose checkpoint: this learner's own, or a peer's it rejoins from
    round: int
    tensors: dict[str, torch.Tensor]
    meta: dict


def choose_resume_point(store_of: Callable[[int], ObjectStore], me: int, learners: int, rounds: int,
                        check: Callable[[dict, dict], None] = lambda tensors, meta: None) -> ResumePoint | None:
    """The newest state a restarted learner can trust: its own newest checkpoint, unless a peer has
    committed one at least two rounds newer; then the peer's, and the learner rejoins at the round
    its peers are in. Replaying the missed rounds from its own older state would keep it behind,
    and every partner would wait out a deadline for it each round; a peer's checkpoint is that
    peer's consensus state after the same rounds. Only checkpoints whose checksums (and signatures)
    verify and that `check(tensors, meta)` accepts are used; any other falls back to the next newest.
    `store_of(i)`: the store holding learner i's objects; `rounds`: the run's (a checkpoint of a later
    round is no checkpoint of this run)."""
    own = checkpoint_rounds(store_of(me), me, rounds)
    newest_own = max(own, default=-1)
    # A peer one round ahead is ordinary skew between learners, not a reason to leave our own state.
    fresher = [(t, peer) for peer in range(learners) if peer != me
               for t in checkpoint_rounds(store_of(peer), peer, rounds) if t > newest_own + 1]
    candidates = sorted(fresher + [(t, me) for t in own], key=lambda c: (c[0], c[1] == me), reverse=True)
    for t, learner in candidates:
        store = store_of(learner)
        try:
            tensors, meta, _ = store.read_committed(layout.checkpoint(learner, t))
            check(tensors, meta)
        except IntegrityError as err:
            emit("corrupt_checkpoint", learner=me, error=str(err))
            continue
        except ObjectMissing:  # retired by its learner after we listed it: a newer one exists
            continue
        except (CheckpointRejected, StateRejected) as err:
            store.refused(layout.checkpoint(learner, t))
            emit("refused_checkpoint", learner=me, error=str(err))
            continue
        return ResumePoint(learner, t, tensors, meta)
    return None


def own_ledger(store: ObjectStore, learner: int, rounds: int) -> Ledger:
    """The ledger of a learner's earlier lives, from its newest checkpoint that reads."""
    for t in sorted(checkpoint_rounds(store, learner, rounds), reverse=True):
        try:
            return Ledger(**store.get_json(f"{layout.checkpoint(learner, t)}.json")["traffic"])
        except (IntegrityError, KeyError, TypeError):
            continue
    return Ledger()
