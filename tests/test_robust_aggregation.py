"""A compromised island's own objects, signed with its own valid key, do not take the run: final states
that are not finite or lie far from the others are left out of the consolidated model, and a peer's
messages inside every fixed bound are clipped to what the pair agreed and to the peer's recent steps."""

import threading

import pytest
import torch

from infra import layout
from infra.authority import CONTROL
from training.consolidate import consolidate
from training.learner.loop import Learner
from training.learner.ledger import LearnerSummary, write_summary
from training.model.params import flat_parameters
from training.model.registry import build_model, load_model
from tests.learners import run_both
from tests.test_security_authority import signed_run  # noqa: F401 - the fixture


def commit_final(spec, store, learner: int, weights: torch.Tensor, round_index: int | None = None) -> None:
    """What a learner's island writes at the end, signed with that island's key: a checkpoint of
    `weights` and a summary that names it."""
    key = layout.checkpoint(learner, spec.sync.rounds - 1 if round_index is None else round_index)
    store.commit_tensors(key, {"weights": weights}, {"round": spec.sync.rounds - 1})
    sha = store.get_json(f"{key}.json")["tensors"]["sha256"]
    write_summary(store, spec, LearnerSummary(learner=learner, island=spec.learners[learner].island.name,
                                              final_checkpoint={"key": key, "sha256": sha}))


@pytest.mark.parametrize("planted", [float("nan"), 1e30], ids=["nan", "1e30"])
def test_a_final_state_signed_by_its_own_island_that_is_not_finite_or_huge_is_dropped_and_named(
        signed_run, planted, caplog):  # noqa: F811
    """Before, consolidation took the plain mean: a NaN model, or one of 5e29."""
    spec, store_of = signed_run
    honest = flat_parameters(build_model(spec)) + 0.01
    commit_final(spec, store_of("a"), 0, honest)
    commit_final(spec, store_of("b"), 1, torch.full_like(honest, planted))

    consensus = consolidate(spec, store_of(CONTROL))

    assert list(consensus["learners_dropped"]) == ["1"] and list(consensus["per_learner"]) == ["0"]
    model = flat_parameters(load_model(spec, store_of(CONTROL), layout.CONSOLIDATED)[0])
    assert bool(torch.isfinite(model).all()) and torch.equal(model, honest)
    assert "consolidation leaves out learner 1" in caplog.text


def test_consolidation_reads_the_checkpoint_the_summary_names(signed_run):  # noqa: F811
    """The final round's key holds other weights than the checkpoint learner 1's summary names (an
    earlier round's): the named one is averaged."""
    spec, store_of = signed_run
    base = flat_parameters(build_model(spec))
    commit_final(spec, store_of("a"), 0, base)
    commit_final(spec, store_of("b"), 1, base + 0.02, round_index=spec.sync.rounds - 2)
    store_of("b").commit_tensors(layout.checkpoint(1, spec.sync.rounds - 1), {"weights": base + 5.0}, {})

    consolidate(spec, store_of(CONTROL))

    model = flat_parameters(load_model(spec, store_of(CONTROL), layout.CONSOLIDATED)[0])
    assert torch.allclose(model, base + 0.01)


def final_losses(spec, store, attacker: int | None) -> list[Learner]:
    """Train every learner of the run, one of them (`attacker`) sending, each round, an anchor 1.45 times
    and a pseudo-gradient -9.5 times its honest ones: inside every fixed bound of `check_bounds`."""
    learners = [Learner(spec, store, i) for i in range(len(spec.learners))]
    if attacker is not None:
        exchanger = learners[attacker].exchanger
        honest_publish = exchanger.publish
        exchanger.publish = lambda round_index, anchor, delta: honest_publish(round_index, 1.45 * anchor, -9.5 * delta)
    run_both(learners)
    return learners


def test_a_partner_that_pulls_inside_every_fixed_bound_each_round_is_clipped(two_learner_run):
    """Unclipped, the honest partner's loss went from 5.4 to 55 in 8 rounds (2.3 with an honest one);
    with the pair's bounds it stays near where it began (5.5), and every one of the attacker's messages
    is booked as clipped in the partner's record."""
    honest = final_losses(*two_learner_run("honest", layers=1, inner_steps=4, run_id="honest", rounds=8,
                                           partner_timeout_s=5), attacker=None)
    attacked = final_losses(*two_learner_run("attacked", layers=1, inner_steps=4, run_id="attacked", rounds=8,
                                             partner_timeout_s=5), attacker=1)
    honest_loss, attacked_loss = honest[0].ledger.rounds[-1]["loss"], attacked[0].ledger.rounds[-1]["loss"]
    assert attacked_loss < 3 * honest_loss and attacked_loss < attacked[0].ledger.rounds[0]["loss"] + 1
    record = attacked[0].exchanger.applied_influence.report()["1"]
    assert record["clipped"] == record["mixed"] == 8 and record["smallest_factor"] < 0.5
    assert honest[0].exchanger.applied_influence.report()["1"]["clipped"] == 0  # honest partners mix untouched


@pytest.mark.parametrize("mode", ["allreduce", "hierarchical"])
def test_one_bad_member_of_a_mean_is_clipped_to_the_median_members(two_learner_run, mode):
    """Two islands of two learners; learner 3 sends -9.5 times its pseudo-gradient and steps its shard
    of the sharded outer step from 1.45 times the anchor, every round. Measured final losses: allreduce
    2.42-2.46 honest, 2.64-2.78 attacked (51-55 unclipped); hierarchical 2.39-2.44 honest, 3.13-3.49
    attacked (17-17.5 unclipped)."""
    settings = dict(layers=1, inner_steps=4, island={"learners": 2}, rounds=8, partner_timeout_s=5, mode=mode)
    honest = final_losses(*two_learner_run("honest", run_id="honest", **settings), attacker=None)
    attacked = final_losses(*two_learner_run("attacked", run_id="attacked", **settings), attacker=3)
    honest_loss = max(learner.ledger.rounds[-1]["loss"] for learner in honest)
    for learner in attacked[:3]:
        assert learner.ledger.rounds[-1]["loss"] < 1.6 * honest_loss
    assert attacked[2].exchanger.applied_influence.report()["3"]["clipped"] > 0
    if mode == "allreduce":
        anchors = [learner.exchanger.anchors() for learner in attacked[:3]]
        assert all(torch.equal(anchors[0], other) for other in anchors[1:])  # the honest members still agree


def test_a_restart_beside_a_clipped_partner_continues_exactly(two_learner_run):
    """The pair's records (agreed anchor, recent step, clip counts) travel in the checkpoint: learner 0
    restarted after round 1 clips round 2's message as the uninterrupted run did, bit for bit."""
    def pair(run_id):
        spec, store = two_learner_run("restart", layers=1, inner_steps=2, run_id=run_id, rounds=3,
                                      partner_timeout_s=5, training={"checkpoint_every": 1})
        learners = [Learner(spec, store, i) for i in range(2)]
        for learner in learners:
            learner.resume()
        honest_publish = learners[1].exchanger.publish
        learners[1].exchanger.publish = lambda t, anchor, delta: honest_publish(t, 1.45 * anchor, -9.5 * delta)
        return spec, store, learners

    _, _, straight = pair("straight")
    run_both(straight)
    spec, store, interrupted = pair("interrupted")
    rounds = lambda learner, ts: threading.Thread(target=lambda: [learner.run_round(t) for t in ts])  # noqa: E731
    threads = [rounds(learner, range(2)) for learner in interrupted]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    again = Learner(spec, store, 0)
    again.resume()
    threads = [rounds(again, [2]), rounds(interrupted[1], [2])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(flat_parameters(again.model), flat_parameters(straight[0].model))
    assert again.exchanger.applied_influence.report() == straight[0].exchanger.applied_influence.report()
    assert again.exchanger.applied_influence.report()["1"]["clipped"] == 3
