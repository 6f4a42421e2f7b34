"""Learners with fragments, overlapped exchanges and compressed messages (local store, in-process).

With tau > 0 a learner does not wait for its partner at the end of a round, so two learners can
be stepped round by round in one process: each round's exchange completes on the transport
thread and is applied tau inner steps into the next round.
"""

import pytest
import torch

from infra import layout
from tests.learners import run_both
from training.learner.loop import Learner
from training.model.params import flat_parameters


@pytest.fixture
def run(two_learner_run):
    def make(partner_timeout_s=30, outer=None, run_id="r", keep_checkpoints=2, **transport):
        return two_learner_run("streaming", layers=2, inner_steps=3, run_id=run_id, rounds=6,
                               partner_timeout_s=partner_timeout_s, training={"keep_checkpoints": keep_checkpoints},
                               **({"outer": outer} if outer else {}),
                               transport={"fragments": 2, "tau": 1, "compression": "int8", **transport})

    return make


def step_both(learners, rounds):
    for t in rounds:
        for learner in learners:
            learner.run_round(t)


def test_each_round_sends_one_fragment_as_its_own_object_and_mixes_it(run):
    spec, store = run()
    learners = [Learner(spec, store, i) for i in range(2)]
    for learner in learners:
        learner.resume()
    step_both(learners, range(3))
    keys = store.list(layout.round_prefix(0, 1))
    assert f"{layout.message(0, 1, fragment=1)}.json" in keys and f"{layout.message(0, 1)}.json" not in keys
    sizes = learners[0].exchanger.layout.sizes
    sent = {e["fragment"]: e["bytes_sent"] for e in learners[0].ledger.exchanges}
    # int8 values plus a scale per 256: each message is about a byte per value of its fragment (anchor + delta).
    for fragment, nbytes in sent.items():
        assert 2 * sizes[fragment] < nbytes < 2.2 * sizes[fragment] + 2000
    # Both fragments have been mixed once (rounds 0 and 1): partners agree on every anchor, while
    # their weights hold their own progress since, and round 2's exchange is still in flight.
    assert torch.equal(learners[0].exchanger.anchors(), learners[1].exchanger.anchors())
    assert not torch.equal(flat_parameters(learners[0].model), flat_parameters(learners[1].model))
    assert learners[0].sync.pending.round == 2
    index = learners[0].exchanger.fragments[0].index
    residual = learners[0].exchanger.feedback.residual["delta"]
    assert torch.count_nonzero(residual[index]) > 0


def test_a_checkpoint_written_with_an_exchange_in_flight_records_it(run):
    spec, store = run()
    learners = [Learner(spec, store, i) for i in range(2)]
    step_both(learners, range(2))
    tensors, meta, _ = store.read_committed(layout.checkpoint(0, 1))
    assert meta["pending"] == {"round": 1, "fragment": 1}
    assert {"weights", "anchors", "residual.anchor", "residual.delta"} <= set(tensors)


@pytest.mark.parametrize("outer", [None, {"name": "shampoo", "lr": 1.0, "momentum": 0.5,
                                         "shampoo": {"start_preconditioning_step": 1}}])
def test_a_learner_killed_with_an_exchange_in_flight_applies_it_exactly_once(run, monkeypatch, outer):
    spec, store = run(outer=outer)  # Shampoo: one optimizer per fragment, over that fragment's matrices
    learners = [Learner(spec, store, i) for i in range(2)]
    for learner in learners:
        learner.resume()
    step_both(learners, range(2))  # each checkpoint of round 1 holds round 1's exchange in flight
    restarted = Learner(spec, store, 0)
    restarted.resume()
    assert restarted.start_round == 2 and restarted.sync.pending.round == 1
    # The learner that never died serves as the reference; only the restarted one may write round 2's checkpoint.
    monkeypatch.setattr(learners[0].checkpoints, "write", lambda key, tensors, meta: None)
    for learner in (learners[0], restarted, learners[1]):
        learner.run_round(2)
    # The restarted learner re-sent the same bytes (write-once: no second object) and landed on
    # exactly the state of the learner that never died: mix applied once, residual kept.
    assert torch.equal(flat_parameters(restarted.model), flat_parameters(learners[0].model))
    assert torch.equal(restarted.exchanger.anchors(), learners[0].exchanger.anchors())
    assert torch.equal(restarted.exchanger.feedback.residual["delta"], learners[0].exchanger.feedback.residual["delta"])
    assert len([k for k in store.list(layout.round_prefix(0, 1)) if "/message" in k]) == 2


def test_a_learner_that_rejoins_from_a_peer_drops_its_exchange_and_residual(run):
    spec, store = run(partner_timeout_s=0.3)
    first, peer = Learner(spec, store, 0), Learner(spec, store, 1)
    first.resume()
    peer.resume()
    step_both([first, peer], range(1))
    step_both([peer], range(1, 3))  # learner 0 is gone; the peer runs on, missing deadlines
    late = Learner(spec, store, 0)
    late.resume()
    assert late.rejoined_from == {"learner": 1, "round": 2}
    assert late.sync.pending is None
    assert all(torch.count_nonzero(r) == 0 for r in late.exchanger.feedback.residual.values())


@pytest.mark.parametrize("compression,own_exact", [("none", False), ("int4", False), ("int4", True)])
def test_learners_stay_together_with_each_setting(run, compression, own_exact):
    spec, store = run(compression=compression, tau=3, mix_own_exact=own_exact)
    learners = [Learner(spec, store, i) for i in range(2)]
    run_both(learners)
    assert all(learner.ledger.missed_exchanges == [] for learner in learners)
    a, b = (flat_parameters(learner.model) for learner in learners)
    # The last round exchanges fragment 1 and waits for it; fragment 0 trained one round apart.
    index = learners[0].exchanger.fragments[1].index
    # Mixing the decoded messages on both sides, partners agree bitwise; mixing their own exact
    # state, they differ by the quantisation error.
    assert torch.equal(a[index], b[index]) != own_exact
    assert (a - b).norm() / a.norm() < 0.05


def test_checkpoints_written_in_the_background_hold_the_state_at_the_end_of_their_round(run):
    checkpoints = {}
    for background in (False, True):
        spec, store = run(run_id=f"background-{background}", checkpoint_in_background=background,
                          keep_checkpoints=None)
        learners = [Learner(spec, store, i) for i in range(2)]
        run_both(learners)
        assert all(learner.ledger.missed_exchanges == [] for learner in learners)
        assert all(store.exists(layout.learner_summary(i)) for i in range(2))
        checkpoints[background] = {(i, t): store.read_committed(layout.checkpoint(i, t))[0]
                                   for i in range(2) for t in range(spec.sync.rounds)}
    # Training went on while each was written: a checkpoint sharing tensors with the live state
    # would hold a later state than the one written in line.
    for key, inline in checkpoints[False].items():
        written = checkpoints[True][key]
        assert written.keys() == inline.keys()
        for name in inline:
            torch.testing.assert_close(written[name], inline[name], rtol=1e-5, atol=0, msg=f"{key} {name}")
