"""A learner's store stays bounded: checkpoints every few rounds, the newest few kept, messages retired
once no one can read them, and restarts still find what they need (local store and S3)."""

import pytest
import torch

from infra import layout
from infra.store import ObjectStore
from tests.learners import run_both
from training.learner import Learner
from training.params import flat_parameters
from training.retention import Retention
from training.schedule import curve_rounds


def commit_round(store: ObjectStore, learner: int, t: int, checkpoint: bool = True) -> None:
    store.commit_tensors(layout.message(learner, t), {"delta": torch.zeros(2)}, {"round": t})
    if checkpoint:
        store.commit_tensors(layout.checkpoint(learner, t), {"weights": torch.zeros(2)}, {"round": t})


def rounds_of(store: ObjectStore, learner: int) -> tuple[list[int], list[int]]:
    keys = store.list(layout.learner_prefix(learner))
    return sorted(layout.checkpoint_rounds(keys)), sorted(t for t, _ in layout.committed_messages(keys))


def test_retention_keeps_the_newest_checkpoints_and_messages_a_reader_may_still_need(store):
    for t in range(6):
        commit_round(store, 0, t)
    for t in range(3):  # the other learner is behind: its newest checkpoint is round 2
        commit_round(store, 1, t)
    retention = Retention(lambda learner: store, 0, 2, keep=2, pinned={1})
    removed = retention.after_checkpoint()
    checkpoints, messages = rounds_of(store, 0)
    assert checkpoints == [1, 4, 5]  # the newest two, and the curve's round 1
    assert messages == [0, 1, 2, 3, 4, 5]  # learner 1 may resume from round 2 and read from there on
    assert removed == 3 * 2  # each retired checkpoint is its commit and its tensors
    assert not store.is_committed(layout.checkpoint(0, 3))
    assert not [k for k in store.list(layout.learner_prefix(0)) if "round-00000/check" in k]
    # Once learner 1 has checkpointed our oldest kept round, our messages before it go, commit first.
    for t in range(3, 5):
        commit_round(store, 1, t)
    assert retention.after_checkpoint() == 4 * 2
    assert rounds_of(store, 0) == ([1, 4, 5], [4, 5])
    assert not [k for k in store.list(layout.learner_prefix(0)) if "round-00000" in k]
    # Ahead of us and already past that round, learner 1 still counts as having reached it.
    for t in range(5, 9):
        commit_round(store, 1, t)
    Retention(lambda learner: store, 1, 2, keep=2, pinned=set()).after_checkpoint()
    assert rounds_of(store, 1)[0] == [7, 8]
    for t in range(6, 8):
        commit_round(store, 0, t)
    assert Retention(lambda learner: store, 0, 2, keep=2, pinned=set()).after_checkpoint() > 0
    assert rounds_of(store, 0) == ([6, 7], [6, 7])


def test_keeping_everything_retires_nothing(store):
    for t in range(4):
        commit_round(store, 0, t)
    assert Retention(lambda learner: store, 0, 1, keep=None, pinned=set()).after_checkpoint() == 0
    assert rounds_of(store, 0) == ([0, 1, 2, 3], [0, 1, 2, 3])


@pytest.mark.parametrize("every", [1, 3])
def test_a_run_leaves_a_bounded_footprint_and_a_restart_resumes_from_its_newest_checkpoint(two_learner_run, every):
    rounds = 10
    spec, store = two_learner_run("retention", layers=1, inner_steps=2, rounds=rounds, checkpoint_every=every,
                                  keep_checkpoints=2)
    learners = [Learner(spec, store, i) for i in range(2)]
    for learner in learners:
        learner.resume()  # records its first life, so that the restart below is a second one
    run_both(learners)
    assert all(learner.ledger.missed_exchanges == [] for learner in learners)
    due = [t for t in range(rounds) if (t + 1) % every == 0 or t == rounds - 1 or t in curve_rounds(rounds)]
    pinned = set(curve_rounds(rounds))
    for i in range(2):
        checkpoints, messages = rounds_of(store, i)
        assert checkpoints == sorted(set(due[-2:]) | pinned)
        assert messages == list(range(due[-2], rounds))  # both learners' newest checkpoints are the last two due
    restarted = Learner(spec, store, 0)
    restarted.resume()
    assert restarted.start_round == rounds and torch.equal(flat_parameters(restarted.model),
                                                           flat_parameters(learners[0].model))
    assert learners[0].ledger.objects_retired > 0


def test_a_window_end_checkpoints_the_last_round_it_finished_whatever_the_cadence(two_learner_run):
    spec, store = two_learner_run("cadence", layers=1, inner_steps=2, rounds=12, checkpoint_every=5,
                                  partner_timeout_s=0.2)
    learner = Learner(spec, store, 0)
    learner.resume()
    for t in range(3):
        learner.run_round(t)
    learner._window_closed(3, "now")
    assert rounds_of(store, 0)[0] == [2]  # round 2 is not due every 5 rounds, nor a curve round of 12
    again = Learner(spec, store, 0)
    again.resume()
    assert again.start_round == 3
