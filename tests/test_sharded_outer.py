"""sync.shard_outer_step: learners that share an anchor (an island in hierarchical mode, the run in
allreduce) each take the outer step of their own shard of every fragment, keep only that shard's outer
state, and share the shard of the new anchor: the anchors are bit for bit those of every learner taking
the whole step, and a restarted learner continues exactly."""

from __future__ import annotations

import pytest
import torch

from infra.spec import parse_spec
from tests.learners import assert_restart_continues_exactly
from tests.test_hierarchical import NESTEROV, SHAMPOO, Group, spec_of
from training.exchange.fragments import whole_parameter_shards
from training.planning.host_memory import exchange_state
from training.planning.memory import model_sizes
from training.planning.planner import fragment_sizes, plan_run


def sharded(spec, on: bool):
    raw = spec.model_dump(mode="json")
    raw["sync"]["shard_outer_step"] = on
    return parse_spec(raw)


def test_shards_are_runs_of_whole_parameters_near_equal_in_elements():
    assert whole_parameter_shards([10, 10, 10, 10], 2) == [(0, 20), (20, 40)]
    assert whole_parameter_shards([30, 5, 5, 5, 5], 2) == [(0, 30), (30, 50)]
    assert whole_parameter_shards([7], 3) == [(0, 0), (0, 7), (7, 7)]  # fewer parameters than shards
    cuts = whole_parameter_shards([3, 1, 4, 1, 5, 9, 2, 6], 4)
    assert cuts[0][0] == 0 and cuts[-1][1] == 31 and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))


def run_both(tmp_path, base, rounds=6):
    """The same run with the outer step sharded and whole: each's group of exchangers, and their results."""
    runs = {}
    for on in (False, True):
        spec = sharded(base, on)
        group = Group(spec, tmp_path / f"sharded-{on}")
        assert all(x.mode.sharded == on for x in group.exchangers)
        results = []
        for t in range(rounds):
            group.train(t)
            results.append(group.exchange(t))
            assert all(r.missed == [] for r in results[-1].values())
        runs[on] = group, results
    return runs


@pytest.mark.parametrize("outer", [SHAMPOO, NESTEROV], ids=["shampoo", "nesterov"])
@pytest.mark.parametrize("mode,compression", [("hierarchical", "int8"), ("allreduce", "none")])
def test_the_sharded_step_is_bit_for_bit_the_whole_one(tmp_path, outer, mode, compression):
    # Hierarchical: exact inside the islands, int8 crossings; 2 fragments, every other exchange crossing.
    base = spec_of(tmp_path, outer=outer, fragments=2, compression=compression, mode=mode)
    groups = run_both(tmp_path, base)
    runs = {on: group for on, (group, _) in groups.items()}
    for i in range(len(base.learners)):
        assert torch.equal(runs[True].weights[i], runs[False].weights[i]), f"learner {i}"
        assert torch.equal(runs[True].exchangers[i].anchors(), runs[False].exchangers[i].anchors())
    # Each learner keeps its shard's outer state only: together, a group's shards hold what each
    # learner held whole.
    state = {on: [sum(v.numel() for k, v in runs[on].exchangers[i].state_dict()[0].items() if not k.startswith("residual"))
                  for i in range(len(base.learners))] for on in (False, True)}
    groups = [[0, 1], [2, 3]] if mode == "hierarchical" else [[0, 1, 2, 3]]
    for members in groups:
        assert sum(state[True][i] for i in members) == state[False][members[0]]
        assert all(state[True][i] < state[False][i] for i in members)


def test_an_allreduce_learner_reads_twice_its_share_of_the_model_as_a_ring_does(tmp_path):
    # Four learners share one anchor: each reads the others' pseudo-gradients on its quarter and their
    # quarters of the new anchor, 2 (N-1)/N model sizes a round, where the whole step reads N-1 of them.
    # int8 messages are quantised per shard: close to the whole step's, not bit for bit.
    base = spec_of(tmp_path, outer=NESTEROV, compression="int8", mode="allreduce")
    model_bytes = 4 * sum(fragment_sizes(base))
    groups = run_both(tmp_path, base, rounds=4)
    for on, bound in ((True, 2 * 3 / 4 * model_bytes * 1.05), (False, 3 * model_bytes)):
        _, results = groups[on]
        per_round = [sum(r.bytes_read.values()) for round_results in results for r in round_results.values()]
        assert max(per_round) <= bound, (on, max(per_round), bound)
    (sharded_group, _), (whole_group, _) = groups[True], groups[False]
    for i in range(4):
        gap = float((sharded_group.weights[i] - whole_group.weights[i]).norm())
        assert gap <= 0.05 * float((whole_group.weights[i] - whole_group.initial).norm())


def test_a_restarted_learner_of_a_sharded_step_continues_exactly(two_learner_run):
    spec, store = two_learner_run("sharded", layers=1, inner_steps=2, rounds=4, partner_timeout_s=0.3,
                                  mode="hierarchical", inter_island_every=3, outer=SHAMPOO,
                                  island={"learners": 2})
    assert spec.sync.shard_outer_step
    assert_restart_continues_exactly(spec, store)


def test_the_plan_counts_the_shards_bytes_and_the_memory_plan_the_shard_s_state(tmp_path):
    spec = spec_of(tmp_path, outer=SHAMPOO, fragments=2, compression="int8")
    whole = sharded(spec, False)
    sizes = model_sizes(spec)
    shared, alone = exchange_state(spec, sizes), exchange_state(whole, sizes)
    for part in ("outer parameters", "outer state", "outer state snapshot"):
        assert shared[part] == alone[part] // 2  # two learners per island
    assert shared["anchors"] == alone["anchors"]
    # Sharding changes what travels inside the islands, not the crossings.
    planned, planned_whole = plan_run(spec, {"island-0": 0.1, "island-1": 0.1}, 1e9), \
        plan_run(whole, {"island-0": 0.1, "island-1": 0.1}, 1e9)
    assert planned["exchange_bytes"]["inter"] == planned_whole["exchange_bytes"]["inter"]


def test_a_sharded_step_s_miss_leaves_the_peer_out_and_its_shard_where_it_was(tmp_path):
    """Learner 3's restart skipped the round (no crossing): learner 2, its island partner, steps its own
    shard along its own pseudo-gradient alone and keeps the anchor where it was on learner 3's shard;
    both misses are recorded, the second as a stepped shard's."""
    spec = spec_of(tmp_path, every=2)
    group = Group(spec, tmp_path, learners=[0, 1, 2], skipped=lambda peer, round_index: peer == 3)
    group.train(0)
    results = group.exchange(0)
    reason = "skipped by the peer's restart"
    assert results[0].missed == results[1].missed == []
    assert results[2].missed == [{"round": 0, "peer": 3, "reason": reason},
                                 {"round": 0, "peer": 3, "reason": reason, "stepped": True}]
    mode, index = group.exchangers[2].mode, group.exchangers[2].fragment_of(0).index
    start, end = mode.outer_span(0, 3)
    assert torch.equal(group.exchangers[2].anchors()[index[start:end]], group.initial[index[start:end]])
    low, high = mode.outer_span(0, 2)
    # Plain averaging (lr 1, no momentum) of one: learner 2's own weights on its shard.
    torch.testing.assert_close(group.weights[2][index[low:high]], group.exchangers[2].anchors()[index[low:high]])
    assert not torch.equal(group.initial[index[low:high]], group.weights[2][index[low:high]])
