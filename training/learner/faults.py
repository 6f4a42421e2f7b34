"""The faults a run spec injects into a learner (`faults:` in the spec): a SIGKILL mid-round, a
corrupt message, a capacity window that closes early, a flaky store. Each strikes once: a
marker in the store remembers it, so the restarted learner trains on."""

from __future__ import annotations

import os
import signal

from infra import layout
from infra.faults import StoreFaults
from infra.spec.faults import CloseWindow, CorruptObject, KillLearner, StoreErrors
from infra.spec import RunSpec
from infra.stores import RunStores
from training.events import emit


def store_faults(spec: RunSpec, learner: int) -> StoreFaults | None:
    """The run's injected store faults, seeded per learner so each sees its own sequence."""
    errors = spec.faults_of(StoreErrors)
    if not errors:
        return None
    e = errors[0]
    return StoreFaults(e.rate, tuple(e.kinds), slow_seconds=e.slow_seconds, seed=spec.seed * 1000 + learner)


class LearnerFaults:
    def __init__(self, spec: RunSpec, stores: RunStores, learner: int):
        """Markers go to the run's store (the report counts them there); a corrupt message to the learner's own."""
        self.spec, self.stores, self.learner = spec, stores, learner

    def attach(self, learner) -> None:
        """Arm the spec's faults on a `training.learner.loop.Learner`, from outside its loop: a kill halfway
        through a round's inner steps as a hook after a step, a corrupt message just before it is
        written, a capacity window that ends after a round. Rank 0 alone strikes; its group follows."""
        lead = learner.rank == 0
        if self.spec.faults_of(CloseWindow):  # every rank of the group asks, and hears rank 0's answer
            learner.window_ends_after = self.window_closes_after if lead else lambda round_index: False
        if not lead:
            return
        learner.exchanger.before_publish = self.maybe_corrupt
        if self.spec.faults_of(KillLearner):
            halfway = self.spec.learners[self.learner].island.inner_steps // 2 + 1
            learner.after_step.append(lambda round_index, steps_done: steps_done == halfway and
                                      self.maybe_die(round_index))

    def window_closes_after(self, round_index: int) -> bool:
        return self.spec.fault_at(CloseWindow, self.learner, round_index) is not None and \
            self._strike_once(layout.CLOSED_WINDOW, round_index)

    def maybe_die(self, round_index: int) -> None:
        if self.spec.fault_at(KillLearner, self.learner, round_index) and \
                self._strike_once(layout.KILLED_LEARNER, round_index):
            emit("fault", learner=self.learner, kind="kill_learner", round=round_index)
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_corrupt(self, round_index: int) -> None:
        """The round's message is written corrupt (called on the transport thread just before the write)."""
        if self.spec.fault_at(CorruptObject, self.learner, round_index):
            self.stores.learner(self.learner).corrupt_next_write()
            emit("fault", learner=self.learner, kind="corrupt_object", round=round_index)

    def _strike_once(self, kind: str, round_index: int) -> bool:
        marker = layout.fault_marker(kind, self.learner, round_index)
        if self.stores.run.exists(marker):
            return False
        self.stores.run.put_json(marker, {"learner": self.learner, "round": round_index})
        return True
