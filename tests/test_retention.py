"""A learner's store stays bounded: checkpoints every few rounds, the newest few kept, messages retired
once no one can read them, the bpb curve's rounds kept as weights alone, and restarts still find what
they need (local store and S3)."""

import pytest
import torch

from eval.curve import evaluate_curve, islands_heldout_curve
from eval.evaluate import score_sets
from infra import layout
from infra.derived import commit_derived
from infra.store import ObjectStore
from tests.learners import run_both
from training.learner.loop import Learner
from training.learner.ledger import Ledger
from training.exchange.mixing import weighted_mean
from training.model.params import flat_parameters, load_flat_parameters
from training.model.registry import build_model
from training.learner.retention import Retention
from training.model.schedule import curve_rounds
from training.learner.state import Checkpointer


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
    retention = Retention(lambda learner: store, 0, 2, keep=2)
    removed = retention.after_checkpoint()
    checkpoints, messages = rounds_of(store, 0)
    assert checkpoints == [4, 5]  # the newest two
    assert messages == [0, 1, 2, 3, 4, 5]  # learner 1 may resume from round 2 and read from there on
    assert removed == 4 * 2  # each retired checkpoint is its commit and its tensors
    assert not store.is_committed(layout.checkpoint(0, 3))
    assert not [k for k in store.list(layout.learner_prefix(0)) if "round-00000/check" in k]
    # Once learner 1 has checkpointed our oldest kept round, our messages before it go, commit first.
    for t in range(3, 5):
        commit_round(store, 1, t)
    assert retention.after_checkpoint() == 4 * 2
    assert rounds_of(store, 0) == ([4, 5], [4, 5])
    assert not [k for k in store.list(layout.learner_prefix(0)) if "round-00000" in k]
    # Ahead of us and already past that round, learner 1 still counts as having reached it.
    for t in range(5, 9):
        commit_round(store, 1, t)
    Retention(lambda learner: store, 1, 2, keep=2).after_checkpoint()
    assert rounds_of(store, 1)[0] == [7, 8]
    for t in range(6, 8):
        commit_round(store, 0, t)
    assert Retention(lambda learner: store, 0, 2, keep=2).after_checkpoint() > 0
    assert rounds_of(store, 0) == ([6, 7], [6, 7])


def test_keeping_everything_retires_nothing(store):
    for t in range(4):
        commit_round(store, 0, t)
    assert Retention(lambda learner: store, 0, 1, keep=None).after_checkpoint() == 0
    assert rounds_of(store, 0) == ([0, 1, 2, 3], [0, 1, 2, 3])


@pytest.mark.parametrize("every", [1, 3])
def test_a_run_leaves_a_bounded_footprint_and_a_restart_resumes_from_its_newest_checkpoint(two_learner_run, every):
    rounds = 10
    spec, store = two_learner_run("retention", layers=1, inner_steps=2, rounds=rounds,
                                  training={"checkpoint_every": every, "keep_checkpoints": 2})
    learners = [Learner(spec, store, i) for i in range(2)]
    for learner in learners:
        learner.resume()  # records its first life, so that the restart below is a second one
    run_both(learners)
    assert all(learner.ledger.missed_exchanges == [] for learner in learners)
    due = [t for t in range(rounds) if (t + 1) % every == 0 or t == rounds - 1]
    for i in range(2):
        checkpoints, messages = rounds_of(store, i)
        assert checkpoints == due[-2:]  # a curve round's checkpoint is retired like any other
        assert messages == list(range(due[-2], rounds))  # both learners' newest checkpoints are the last two due
        # The curve's rounds keep the weights alone, committed and verified like every object.
        for t in curve_rounds(rounds, spec.evaluation.curve_points):
            tensors, meta, _ = store.read_committed(layout.curve_weights(i, t))
            assert set(tensors) == {"weights"} and meta["round"] == t
        final, _, checkpoint_bytes = store.read_committed(layout.checkpoint(i, rounds - 1))
        curve, _, curve_bytes = store.read_committed(layout.curve_weights(i, rounds - 1))
        assert torch.equal(curve["weights"], final["weights"]) and curve_bytes < checkpoint_bytes / 2
    # The islands' points of the bpb curve are scored from those objects; the curve also scores the
    # standard arm, for which any stored model will do here.
    commit_derived(store, layout.BASELINE, {"weights": flat_parameters(learners[0].model)}, {"tokens": 1})
    points = evaluate_curve(spec, store)
    # Scored on every held-out byte, the islands' last point is the final model's score.
    heldout = islands_heldout_curve(spec, store)
    assert [p["round"] for p in heldout] == curve_rounds(rounds, spec.evaluation.curve_points)
    mean = build_model(spec)
    load_flat_parameters(mean, weighted_mean([flat_parameters(learner.model) for learner in learners],
                                             [spec.learners[i].tokens_per_round() for i in range(2)]))
    final = score_sets(spec, store, mean, store.get_json(layout.DATA_MANIFEST)["heldout"])
    assert heldout[-1]["bpb"] == {name: result["bpb"] for name, result in final.items()}
    assert sorted({p["tokens"] for p in points if p["arm"] == "islands"}) == \
        [spec.learners[0].tokens_per_round() * 2 * (t + 1) for t in curve_rounds(rounds, spec.evaluation.curve_points)]
    restarted = Learner(spec, store, 0)
    restarted.resume()
    assert restarted.start_round == rounds and torch.equal(flat_parameters(restarted.model),
                                                           flat_parameters(learners[0].model))
    assert learners[0].ledger.objects_retired > 0


def test_a_replayed_curve_round_keeps_the_weights_first_committed(store):
    checkpoints = Checkpointer(store, None, Ledger(), False, Retention(lambda learner: store, 0, 1, keep=2))
    key = layout.curve_weights(0, 3)
    checkpoints.write_curve_weights(key, torch.zeros(4), {"round": 3})
    written = checkpoints.ledger.checkpoint_bytes
    # A restart from an older checkpoint replays the round, and may mix other messages into other weights.
    checkpoints.write_curve_weights(key, torch.ones(4), {"round": 3})
    assert torch.equal(store.read_committed(key)[0]["weights"], torch.zeros(4))
    assert checkpoints.ledger.checkpoint_bytes == written > 0


def test_a_window_end_checkpoints_the_last_round_it_finished_whatever_the_cadence(two_learner_run):
    spec, store = two_learner_run("cadence", layers=1, inner_steps=2, rounds=12, training={"checkpoint_every": 5},
                                  partner_timeout_s=0.2)
    learner = Learner(spec, store, 0)
    learner.resume()
    for t in range(3):
        learner.run_round(t)
    learner._window_closed(3, "now")
    assert rounds_of(store, 0)[0] == [2]  # round 2 is not due every 5 rounds (a curve round of 12 needs none)
    again = Learner(spec, store, 0)
    again.resume()
    assert again.start_round == 3
