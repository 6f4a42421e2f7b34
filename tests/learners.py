"""Helpers for tests that run several learners in one process."""

import threading

import torch

from infra import layout
from infra.store import ObjectStore
from training.data.shards import prepare_dataset
from training.learner.loop import Learner
from training.model.params import flat_parameters


def run_both(learners) -> None:
    """Run every learner's rounds at once, each on its own thread, as separate processes would."""
    threads = [threading.Thread(target=learner.run) for learner in learners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def assert_restart_continues_exactly(spec, store) -> None:
    """Learner 0 trained 3 rounds straight (in a run of its own) and, in `store`'s run, 2 rounds, then a
    new life of it (a new process: every state from its checkpoint) trains the third: the weights agree."""
    uninterrupted = ObjectStore(spec.store.url).child("runs/uninterrupted")
    uninterrupted.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, uninterrupted)
    straight = Learner(spec, uninterrupted, 0)
    straight.resume()
    for t in range(3):
        straight.run_round(t)
    first = Learner(spec, store, 0)
    first.resume()
    for t in range(2):
        first.run_round(t)
    again = Learner(spec, store, 0)
    again.resume()
    again.run_round(2)
    assert torch.equal(flat_parameters(again.model), flat_parameters(straight.model))
