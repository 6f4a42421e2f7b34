"""What a learner keeps in its store: its newest checkpoints, the weights the bpb curve scores, and
the messages a peer may still read.

Every round adds a message, and every `training.checkpoint_every` rounds a checkpoint; kept for good,
they would grow with every round the run lasts. After each checkpoint it commits, a learner retires

  * its checkpoints older than the newest `training.keep_checkpoints` committed ones, those of the
    rounds the bpb curve scores included: the curve reads the weights-only objects of those rounds
    (`layout.curve_weights`), which are never retired: the curve is scored once training is over,
    and they are `evaluation.curve_points` per learner however many rounds the run lasts;
  * its messages of rounds before its own oldest kept checkpoint, once every other learner has
    checkpointed that round or a later one. A restarted learner resumes from its newest checkpoint
    (or, if that one does not verify, an older kept one) and reads only messages of that round and
    later; and a learner that replays rounds from its own checkpoint sends their messages again,
    which write-once allows only while the first copy is still there.

Only the learner that wrote an object retires it, so a learner needs write access to its own
objects alone; and it counts only checkpoints it could have written (rounds up to the one it just
committed) whose commits verify (signed by its island in a signed run), so that commits planted under
its prefix, at later rounds or at the keys it was about to write, cannot push its real ones out. Each
round's commit is read once per process: a planted one costs one read.
"""

from __future__ import annotations

from collections.abc import Callable

from infra import layout
from infra.store import IntegrityError, ObjectMissing, ObjectStore, StoreError


class Retention:
    def __init__(self, store_of: Callable[[int], ObjectStore], learner: int, learners: int, keep: int | None):
        """`store_of(i)`: the store holding learner i's objects (see infra/stores.py)."""
        self.store_of, self.learner, self.learners, self.keep = store_of, learner, learners, keep
        self._verifies: dict[int, bool] = {}  # round: whether its checkpoint's commit verifies

    def after_checkpoint(self, newest: int | None = None, written: bool = False) -> int:
        """Retire what no one will read again, now that the checkpoint of round `newest` is committed
        (`written`: by this call's learner, so it needs no reading back); returns the objects removed."""
        if self.keep is None:
            return 0
        if written:
            self._verifies[newest] = True
        store = self.store_of(self.learner)
        mine = store.list(layout.learner_prefix(self.learner))
        rounds = sorted(t for t in layout.checkpoint_rounds(mine) if newest is None or t <= newest)
        kept = [t for t in reversed(rounds) if self._verified(store, t)][:self.keep]
        removed = sum(store.retire(layout.checkpoint(self.learner, t), mine) for t in rounds if t < min(kept, default=-1))
        # Messages before our oldest kept checkpoint go once every other learner has reached it.
        floor = min(kept, default=-1)
        if not all(self._reached(peer, floor) for peer in range(self.learners) if peer != self.learner):
            return removed
        return removed + sum(store.retire(key, mine)
                             for t, key in layout.committed_messages(mine) if t < floor)

    def _verified(self, store: ObjectStore, round_index: int) -> bool:
        if round_index not in self._verifies:
            try:
                store.get_json(f"{layout.checkpoint(self.learner, round_index)}.json")
                self._verifies[round_index] = True
            except (IntegrityError, ObjectMissing):
                self._verifies[round_index] = False
        return self._verifies[round_index]

    def _reached(self, peer: int, round_index: int) -> bool:
        """Whether a peer has committed a checkpoint of `round_index` or later. Learners checkpoint the
        same rounds, so one request for that round's commit mostly answers it (a listing of the
        peer's objects costs far more across a link); a peer out of reach has not, for now."""
        if round_index < 0:
            return False
        try:
            store = self.store_of(peer)
            return store.is_committed(layout.checkpoint(peer, round_index)) or \
                max(checkpoint_rounds(store, peer), default=-1) >= round_index
        except StoreError:
            return False


def checkpoint_rounds(store: ObjectStore, learner: int, rounds: int | None = None) -> list[int]:
    """The rounds of a learner's committed checkpoints still in its store; with `rounds` (the run's),
    only those of rounds the run has."""
    return [t for t in layout.checkpoint_rounds(store.list(layout.learner_prefix(learner)))
            if rounds is None or t < rounds]
