"""sync.mode hierarchical: an exact mean inside each island and the island's outer step every round,
and in every inter_island_every-th exchange of a fragment a crossing that gives every learner the
islands' mean anchor. Exchangers on the real transport and a local store, four learners in one process
(each transport on its own thread); learner processes for the run at the end."""

from __future__ import annotations

import pytest
import torch

from infra import layout
from infra.spec import SpecError, parse_spec
from infra.store import ObjectStore
from tests.learners import assert_restart_continues_exactly
from training.exchange.exchanger import Exchanger
from training.exchange.modes import sync_mode
from training.exchange.mixing import mean_over_islands, slice_bounds
from training.exchange.transport import Transport
from training.learner.ledger import read_summaries
from training.model.params import flat_parameters
from training.model.registry import build_model
from training.planning.host_memory import checkpoint_staging, exchange_state
from training.planning.memory import model_sizes
from training.planning.planner import fragment_sizes, message_bytes, plan_run, replay
from training.stages import train_learners

PLAIN_MEAN = {"name": "nesterov", "lr": 1.0, "momentum": 0.0}  # an outer step to the mixed weights
NESTEROV = {"name": "nesterov", "lr": 0.7, "momentum": 0.9}
SHAMPOO = {"name": "shampoo", "lr": 0.7, "momentum": 0.5, "shampoo": {"start_preconditioning_step": 1}}


def spec_of(tmp_path, outer=PLAIN_MEAN, every=2, fragments=1, compression="none", mode="hierarchical", timeout=10,
            learners=(2, 2), shard=True):
    """Two islands (of two learners each unless `learners` says otherwise) whose rounds weigh differently
    (batch 2 and 4); `shard`: sync.shard_outer_step."""
    return parse_spec({
        "name": "hierarchical",
        "islands": [{"name": f"island-{i}", "learners": n, "batch_size": 2 * (i + 1), "seq_len": 8, "inner_steps": 2}
                    for i, n in enumerate(learners)],
        "model": {"layers": 2, "width": 8, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": ["unused/*.txt"]}]},
        "sync": {"mode": mode, "rounds": 4, "partner_timeout_s": timeout, "outer": outer, "shard_outer_step": shard,
                 **({"inter_island_every": every} if mode != "allreduce" else {}),
                 "transport": {"fragments": fragments, "compression": compression}},
        "store": {"url": str(tmp_path / "store")},
    })


class Group:
    """Every learner's exchanger, each with its own transport on one local store, and its weights."""

    def __init__(self, spec, tmp_path, learners=None, skipped=lambda peer, round_index: False):
        model = build_model(spec)
        self.initial = flat_parameters(model)
        store = ObjectStore(str(tmp_path / "store"))
        self.transports = [Transport(store) for _ in spec.learners]
        self.exchangers = [Exchanger(spec, slot, transport, model, self.initial, skipped=skipped)
                           for slot, transport in zip(spec.learners, self.transports)]
        self.weights = [self.initial.clone() for _ in spec.learners]
        self.learners = range(len(spec.learners)) if learners is None else learners

    def train(self, round_index: int) -> None:
        """Local progress: each learner's own drift."""
        for i in self.learners:
            drift = torch.randn(self.initial.shape, generator=torch.Generator().manual_seed(100 * round_index + i))
            self.weights[i] = self.weights[i] + 0.01 * drift

    def exchange(self, round_index: int) -> dict:
        """Every learner's exchange of the round (tau 0: applied at once); returns their results."""
        index = self.exchangers[0].fragment_of(round_index).index
        sent = {i: self.exchangers[i].start(round_index, self.weights[i][index].clone()) for i in self.learners}
        results = {}
        for i in self.learners:
            new, results[i] = self.exchangers[i].apply(sent[i], self.weights[i][index].clone())
            self.weights[i] = self.weights[i].clone()
            self.weights[i][index] = new
        return results

    def outer_state(self, i: int) -> dict[str, torch.Tensor]:
        tensors, _ = self.exchangers[i].state_dict()
        return {k: v for k, v in tensors.items() if not k.startswith("residual.")}


def token_weighted(weights, tokens):
    return sum(t * w for t, w in zip(tokens, weights)) / sum(tokens)


def assert_same(tensors):
    assert all(torch.equal(tensors[0], t) for t in tensors[1:])


def assert_same_state(states):
    assert all(s.keys() == states[0].keys() and all(torch.equal(s[k], states[0][k]) for k in s) for s in states[1:])


@pytest.mark.parametrize("compression", ["none", "int4"])  # messages inside an island go exact either way
def test_a_round_that_does_not_cross_moves_each_island_to_its_exact_mean(tmp_path, compression):
    spec = spec_of(tmp_path, compression=compression)
    group = Group(spec, tmp_path)
    tokens = [slot.tokens_per_round() for slot in spec.learners]
    assert tokens[0] != tokens[2]
    for t in range(3):  # rounds 0 and 2 stay inside the islands, round 1 crosses (inter_island_every 2)
        group.train(t)
        before = [group.weights[i].clone() for i in range(4)]
        results = group.exchange(t)
        assert all(r.missed == [] for r in results.values())
        if t == 1:
            assert_same(group.weights)
            assert_same([x.anchors() for x in group.exchangers])
            continue
        for island in ((0, 1), (2, 3)):  # lr 1, no momentum: the island's step lands on its mean
            assert_same([group.weights[i] for i in island])
            want = token_weighted([before[i] for i in island], [tokens[i] for i in island])
            torch.testing.assert_close(group.weights[island[0]], want, rtol=0, atol=1e-6)
        assert not torch.allclose(group.weights[0], group.weights[2])
        assert all(r.bytes_read["inter"] == 0 for r in results.values())


def test_each_island_takes_its_outer_step_every_round(tmp_path):
    """Nesterov's first step from θ along the island's mean Δ: θ − lr (1 + momentum) Δ."""
    spec = spec_of(tmp_path, outer=NESTEROV)
    group = Group(spec, tmp_path)
    tokens = [slot.tokens_per_round() for slot in spec.learners]
    group.train(0)
    before = [group.weights[i].clone() for i in range(4)]
    group.exchange(0)
    for island in ((0, 1), (2, 3)):
        delta = group.initial - token_weighted([before[i] for i in island], [tokens[i] for i in island])
        want = group.initial - NESTEROV["lr"] * (1 + NESTEROV["momentum"]) * delta
        for i in island:
            torch.testing.assert_close(group.exchangers[i].anchors(), want, rtol=0, atol=1e-6)
            torch.testing.assert_close(group.weights[i], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("learners", [(2, 2), (1, 3)])  # islands that slice the fragment alike, and not
def test_a_crossing_gives_every_learner_the_islands_token_weighted_mean(tmp_path, learners):
    spec = spec_of(tmp_path, every=1, fragments=2, learners=learners)
    group = Group(spec, tmp_path)
    tokens = [slot.tokens_per_round() for slot in spec.learners]
    read = [{"inter": 0, "intra": 0} for _ in spec.learners]
    for t in range(spec.sync.rounds):  # every round crosses
        group.train(t)
        before = [w.clone() for w in group.weights]
        for i, result in group.exchange(t).items():
            assert result.missed == []
            read[i] = {link: read[i][link] + result.bytes_read[link] for link in read[i]}
        index = group.exchangers[0].fragment_of(t).index
        # lr 1, no momentum: each island's step lands on its token-weighted mean, and the islands' mean
        # by tokens is the mean over all learners.
        want = token_weighted([b[index] for b in before], tokens)
        torch.testing.assert_close(group.weights[0][index], want, rtol=0, atol=1e-6)
        assert_same([w[index] for w in group.weights])
        assert_same([x.fragment_of(t).anchor for x in group.exchangers])
    assert [plan.bytes_read for plan in replay(spec, {"island-0": 0.1, "island-1": 0.1}, 1e9)] == read


@pytest.mark.parametrize("outer, compression", [(SHAMPOO, "none"), (NESTEROV, "int4")])
def test_an_island_s_learners_share_anchor_and_outer_state_and_a_crossing_gives_all_one_anchor(
        tmp_path, outer, compression):
    # The whole step on every learner (tests/test_sharded_outer.py: the sharded one gives the same anchors).
    spec = spec_of(tmp_path, outer=outer, every=2, fragments=2, compression=compression, shard=False)
    group = Group(spec, tmp_path)
    for t in range(4):  # fragment 0 crosses in round 2, fragment 1 in round 3
        group.train(t)
        group.exchange(t)
        for island in ((0, 1), (2, 3)):
            assert_same([group.exchangers[i].anchors() for i in island])
            assert_same_state([group.outer_state(i) for i in island])
        fragment = group.exchangers[0].fragment_of(t).number
        anchors = [x.fragments[fragment].anchor for x in group.exchangers]
        assert all(torch.equal(anchors[0], a) for a in anchors) == (t >= 2)
    assert any(k.startswith("fragment-0.outer.") for k in group.outer_state(0)), "the outer optimizers have stepped"
    if outer is NESTEROV:  # each island's outer state is its own: a crossing moves only the anchors
        momentum = "fragment-0.outer.0.momentum_buffer"
        assert not torch.equal(group.outer_state(0)[momentum], group.outer_state(2)[momentum])
    if compression != "none":  # each learner's residual of its own slice of its island's anchor
        residuals = [x.feedback.residual["crossing.anchor"] for x in group.exchangers]
        assert all(bool(r.any()) for r in residuals) and not torch.equal(residuals[0], residuals[1])


def test_a_crossing_takes_islands_that_trained_far_apart_since_the_last(tmp_path):
    """Islands that each moved far from the start, in different directions, lie much further apart than
    one round's step: their slices are bounded by how far the receiver's island has come, and mixed."""
    spec = spec_of(tmp_path, every=2)
    group = Group(spec, tmp_path)
    for island in ((0, 1), (2, 3)):
        away = torch.randn(group.initial.shape, generator=torch.Generator().manual_seed(island[0]))
        for i in island:
            group.weights[i] = group.weights[i] + away
    group.exchange(0)
    group.train(1)
    results = group.exchange(1)  # crosses, with a step of 0.01 per element against islands ~1.4 apart
    assert all(r.missed == [] for r in results.values())
    assert_same([x.anchors() for x in group.exchangers])


def test_inter_island_bytes_flow_only_in_crossings_and_are_the_planned_bytes(tmp_path):
    spec = spec_of(tmp_path, every=2, fragments=2, compression="int8")
    group = Group(spec, tmp_path)
    counted = [{"inter": 0, "intra": 0, "written": 0} for _ in range(4)]
    for t in range(spec.sync.rounds):  # fragment 0 crosses in round 2, fragment 1 in round 3
        group.train(t)
        for i, result in group.exchange(t).items():
            assert (result.bytes_read["inter"] > 0) == (t >= 2)
            counted[i]["inter"] += result.bytes_read["inter"]
            counted[i]["intra"] += result.bytes_read["intra"]
            counted[i]["written"] += result.bytes_sent
    plans = replay(spec, {"island-0": 0.1, "island-1": 0.2}, 1e9)
    for plan, count, transport in zip(plans, counted, group.transports):
        assert plan.bytes_read == {"inter": count["inter"], "intra": count["intra"]}
        assert plan.bytes_written == count["written"]
        assert plan.requests == sum(c.requests for c in transport.counters.values())
    # A crossing brings each learner, from the other island, the slice of the fragment's anchor it
    # carries, half the anchor in islands of two learners: a quarter of what a butterfly pair's message
    # (anchor and pseudo-gradient) brings, with a commit each (fragment 0's and 1's).
    butterfly = spec_of(tmp_path, mode="butterfly", fragments=2, compression="int8")
    pair_messages = sum(message_bytes(butterfly, n) for n in fragment_sizes(butterfly))
    assert pair_messages / 4 <= plans[0].bytes_read["inter"] <= pair_messages / 4 + 2048


def test_a_miss_leaves_the_peer_out_and_is_recorded(tmp_path):
    """Learner 3's restart skipped the round: its island partner's mean is its own and keeps its island's
    own second slice, and learner 1, who carries island 0's second slice, leaves island 1 out of that
    slice's mean; learners 0 and 1 still agree, and the first slice is both islands' mean everywhere.
    (The whole step on every learner: tests/test_sharded_outer.py has a sharded step's misses.)"""
    spec = spec_of(tmp_path, every=1, shard=False)
    group = Group(spec, tmp_path, learners=[0, 1, 2], skipped=lambda peer, round_index: peer == 3)
    group.train(0)
    results = group.exchange(0)
    reason = "skipped by the peer's restart"
    assert results[0].missed == []  # it reads only learner 2's slice across the islands, and 1's mix
    assert results[1].missed == [{"round": 0, "peer": 3, "reason": reason, "crossing": True}]
    assert results[2].missed == [{"round": 0, "peer": 3, "reason": reason},
                                 {"round": 0, "peer": 3, "reason": reason, "crossing": True, "mixed": True}]
    anchors = [x.anchors() for x in group.exchangers]
    assert torch.equal(group.weights[0], group.weights[1]) and torch.equal(anchors[0], anchors[1])
    index = group.exchangers[0].fragment_of(0).index
    _, half = group.exchangers[0].mode.slices[0][0]
    assert torch.equal(anchors[0][index[:half]], anchors[2][index[:half]])
    assert not torch.equal(anchors[0][index[half:]], anchors[2][index[half:]])
    assert all(bool(torch.isfinite(w).all()) for w in group.weights[:3])


def test_slices_are_tensor_split_s_and_the_crossing_mean_handles_other_slicings_and_misses():
    for numel, parts in [(10, 3), (7, 7), (1000, 8), (5, 2)]:
        cut = torch.arange(numel).tensor_split(parts)
        assert [slice_bounds(numel, parts, j) for j in range(parts)] == \
            [(int(c[0]), int(c[-1]) + 1) for c in cut]
    anchors = [torch.randn(10), torch.randn(10)]
    islands = [(100, list(anchors[0].tensor_split(2))), (300, list(anchors[1].tensor_split(3)))]
    torch.testing.assert_close(mean_over_islands(10, islands), 0.25 * anchors[0] + 0.75 * anchors[1])
    for span in [(0, 5), (3, 8)]:  # one learner's slice of either island, across the other's cuts
        torch.testing.assert_close(mean_over_islands(10, islands, span), mean_over_islands(10, islands)[slice(*span)])
    islands[1][1][1] = None  # island 1's second slice (elements 4 to 6) did not arrive
    anchor = mean_over_islands(10, islands)
    torch.testing.assert_close(anchor[4:7], anchors[0][4:7])
    torch.testing.assert_close(anchor[7:], 0.25 * anchors[0][7:] + 0.75 * anchors[1][7:])


def test_the_spec_takes_inter_island_every_and_refuses_a_fragment_too_small_to_slice(tmp_path):
    spec = spec_of(tmp_path, every=3)
    assert spec.sync.mode == "hierarchical" and spec.sync.inter_island_every == 3
    with pytest.raises(ValueError, match="fragment 0 has 1 parameters, fewer than island island-0's 2 learners"):
        sync_mode(spec, [[1], [100]])
    raw = spec.model_dump(mode="json")
    raw["sync"]["mode"] = "allreduce"
    with pytest.raises(SpecError, match="inter_island_every"):
        parse_spec(raw)


def test_the_memory_plan_counts_the_crossing_s_residual(tmp_path):
    spec = spec_of(tmp_path, compression="int4")
    sizes = model_sizes(spec)
    vector = 4 * sum(fragment_sizes(spec))
    # The crossing's anchor; a round's message goes exact.
    assert exchange_state(spec, sizes)["error-feedback residual"] == vector
    assert checkpoint_staging(spec, sizes) == 3 * vector + vector


def test_a_restarted_learner_continues_exactly(two_learner_run):
    # Round 2 crosses (inter_island_every 3): rounds 0 and 1 end on each island's own anchor.
    spec, store = two_learner_run("hierarchical", layers=1, inner_steps=2, rounds=4, partner_timeout_s=0.3,
                                  mode="hierarchical", inter_island_every=3, outer=SHAMPOO)
    assert_restart_continues_exactly(spec, store)


@pytest.mark.integration
def test_learner_processes_train_a_hierarchical_run_with_no_miss_and_the_planned_bytes(two_learner_run):
    spec, store = two_learner_run("hierarchical", layers=2, inner_steps=2, island={"learners": 2}, rounds=4,
                                  partner_timeout_s=60, mode="hierarchical", inter_island_every=2,
                                  transport={"fragments": 2, "compression": "int8"})
    assert all(learner["finished"] for learner in train_learners(spec, "r", relay=lambda line: None))
    summaries = read_summaries(spec, store)
    assert [s.missed_exchanges for s in summaries] == [[]] * 4
    planned = plan_run(spec, {"a": 0.01, "b": 0.01}, 1e18)["exchange_bytes"]
    assert sum(s.bytes_read_inter for s in summaries) == planned["inter"] > 0
    assert sum(s.bytes_read_intra for s in summaries) == planned["intra"] > 0
    # The last round of each fragment crossed: every learner ends on the same anchors.
    anchors = [store.read_committed(layout.checkpoint(i, 3))[0]["anchors"] for i in range(4)]
    assert_same(anchors)
