"""A peer's message is checked before it is mixed: what an attacker with write access to a store
(or a diverged learner) puts under a learner's message key is a missed exchange, never a mix.

Each test plants a message where learner 1's message of a round belongs, before learner 1 writes
its own (objects are write-once, so the planted one is what every reader finds).
"""

import math

import pytest
import torch

from eval.bpb import bits_per_byte
from infra import layout
from infra.store import ObjectStore
from training.exchange.compression import Codec
from training.data.streams import read_stream
from training.learner.loop import Learner, LearnerDiverged
from training.model.params import flat_parameters, load_flat_parameters

from tests.test_streaming import run_both


@pytest.fixture
def run(two_learner_run):
    def make(run_id="r", **transport):
        return two_learner_run("poison", layers=1, inner_steps=2, run_id=run_id, rounds=4, partner_timeout_s=5,
                               transport=transport)

    return make


def honest_message(learner: Learner, round_index: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The payload and metadata learner `learner` would send in a round (from its current weights)."""
    weights = flat_parameters(learner.model)
    fragment = 0
    fields = {"anchor": weights, "delta": torch.full_like(weights, 1e-3)}
    exchanger = learner.exchanger
    if exchanger.codec.lossless:
        payload = fields
    else:
        payload, _, _ = exchanger.feedback.encode(
            {"anchor": weights - exchanger.initial, "delta": fields["delta"]},
            exchanger.fragments[fragment].index, sparsify={"anchor": False})
    meta = {"learner": learner.slot.index, "round": round_index, "tokens": learner.slot.tokens_per_round(),
            "fragment": fragment, "anchor_from_initial": not exchanger.codec.lossless}
    return payload, meta


def plant(store: ObjectStore, round_index: int, payload: dict, meta: dict) -> None:
    store.commit_tensors(layout.message(1, round_index), payload, meta)


def nan_delta(p, m):
    p["delta"] = p["delta"].clone()
    p["delta"][3] = float("nan")


def inf_anchor(p, m):
    p["anchor"] = p["anchor"].clone()
    p["anchor"][0] = float("inf")


def one_element(p, m):
    p["delta"] = torch.tensor([1e6])  # would broadcast over the whole fragment


def float64(p, m):
    p["delta"] = p["delta"].double()


def extra_tensor(p, m):
    p["delta.extra"] = torch.zeros(4)


def missing_anchor(p, m):
    del p["anchor"]


def other_learner(p, m):
    m["learner"] = 0


def other_round(p, m):
    m["round"] = 7


def huge_tokens(p, m):
    m["tokens"] = 10 ** 12  # would make this message the whole mix


def zero_tokens(p, m):
    m["tokens"] = 0


def fragment_as_index(p, m):
    m["fragment"] = 5


POISONS = [nan_delta, inf_anchor, one_element, float64, extra_tensor, missing_anchor, other_learner,
           other_round, huge_tokens, zero_tokens, fragment_as_index]


@pytest.mark.parametrize("poison", POISONS, ids=[p.__name__ for p in POISONS])
def test_a_poisoned_or_malformed_message_is_a_missed_exchange(run, poison):
    spec, store = run()
    receiver, sender = Learner(spec, store, 0), Learner(spec, store, 1)
    payload, meta = honest_message(sender, 0)
    poison(payload, meta)
    plant(store, 0, payload, meta)
    receipt = receiver.exchanger.receive(1, 0)
    assert receipt.message is None and receipt.peer == 1 and receipt.reason.startswith("refused:")


def test_an_honest_message_is_accepted_and_its_tokens_come_from_the_plan(run):
    spec, store = run()
    receiver, sender = Learner(spec, store, 0), Learner(spec, store, 1)
    payload, meta = honest_message(sender, 0)
    plant(store, 0, payload, meta)
    receipt = receiver.exchanger.receive(1, 0)
    assert torch.equal(receipt.message.fields["delta"], payload["delta"]) and receipt.reason is None
    assert receipt.message.tokens == spec.learners[1].tokens_per_round()


def corrupt_count(p, m):
    p["delta.count"] = torch.tensor([3, 256], dtype=torch.int64)


def index_out_of_range(p, m):
    p["delta.index"] = p["delta.index"].clone()
    p["delta.index"][-1] = 10 ** 7


def negative_scale(p, m):
    p["delta.scale"] = -p["delta.scale"].abs() - 1


def nan_scale(p, m):
    p["anchor.scale"] = p["anchor.scale"].clone()
    p["anchor.scale"][0] = float("nan")


COMPRESSED_POISONS = [corrupt_count, index_out_of_range, negative_scale, nan_scale]


@pytest.mark.parametrize("poison", COMPRESSED_POISONS, ids=[p.__name__ for p in COMPRESSED_POISONS])
def test_a_malformed_compressed_message_is_a_missed_exchange(run, poison):
    spec, store = run(compression="int8", topk=0.5)
    receiver, sender = Learner(spec, store, 0), Learner(spec, store, 1)
    payload, meta = honest_message(sender, 0)
    poison(payload, meta)
    plant(store, 0, payload, meta)
    receipt = receiver.exchanger.receive(1, 0)
    assert receipt.message is None and receipt.reason.startswith("refused:")


def test_a_commit_pointing_outside_its_message_is_never_read(run):
    spec, store = run()
    receiver = Learner(spec, store, 0)
    ref = store.put_tensors("elsewhere.safetensors", {"delta": torch.zeros(3)})
    store.put_json(f"{layout.message(1, 0)}.json", {"tensors": ref.to_json(), "learner": 1, "round": 0})
    receipt = receiver.exchanger.receive(1, 0)
    assert receipt.message is None and "outside the message" in receipt.reason


def train_pair(spec, store) -> list[Learner]:
    learners = [Learner(spec, store, i) for i in range(2)]
    run_both(learners)
    return learners


def test_a_run_with_poisoned_messages_trains_as_if_they_were_missing(run):
    """NaN, Inf and one-element messages planted under learner 1's keys of three rounds: learner 0
    refuses each, learner 1 finds its own key taken and mixes with its own values; every weight
    stays finite and the bpb stays within 2% of a clean run's (two rounds of four without
    an exchange), where mixing them unchecked gives NaN."""
    clean_spec, clean_store = run(run_id="clean")
    clean = train_pair(clean_spec, clean_store)
    spec, store = run(run_id="poisoned")
    template = Learner(spec, store, 1)
    for round_index, poison in zip((0, 1, 2), (nan_delta, inf_anchor, one_element)):
        payload, meta = honest_message(template, round_index)
        poison(payload, meta)
        plant(store, round_index, payload, meta)
    poisoned = train_pair(spec, store)
    assert [m["round"] for m in poisoned[0].ledger.missed_exchanges] == [0, 1, 2]
    # The trackers' per-exchange counts (eval/tracking.py): each of them missed, and refused on arrival.
    assert [(e["missed"], e["refused"]) for e in poisoned[0].ledger.exchanges] == [(1, 1)] * 3 + [(0, 0)]
    heldout = read_stream(store, store.get_json(layout.DATA_MANIFEST)["heldout"]["text"])
    for learner, reference in zip(poisoned, clean):
        assert bool(torch.isfinite(flat_parameters(learner.model)).all())
        got = bits_per_byte(learner.model, heldout, 16)["bpb"]
        want = bits_per_byte(reference.model, heldout, 16)["bpb"]
        assert math.isfinite(got) and abs(got / want - 1) < 0.02


def test_a_learner_whose_own_weights_are_not_finite_stops_instead_of_sending(run):
    spec, store = run()
    learner = Learner(spec, store, 0)
    weights = flat_parameters(learner.model)
    weights[0] = float("nan")
    load_flat_parameters(learner.model, weights)
    with pytest.raises(LearnerDiverged, match="learner 0 round 1:"):  # rounds numbered from 1, as in logs
        learner.run_round(0)
    assert not store.exists(f"{layout.message(0, 0)}.json")


def test_the_expected_layout_is_the_codecs_own(run):
    """Every scheme the run can use round-trips through the check unchanged."""
    for scheme, topk in (("none", 1.0), ("int8", 1.0), ("int4", 0.25), ("none", 0.5)):
        spec, store = run(run_id=f"{scheme}-{topk}", compression=scheme, topk=topk)
        receiver, sender = Learner(spec, store, 0), Learner(spec, store, 1)
        assert receiver.exchanger.codec == Codec(scheme, receiver.exchanger.codec.scale_chunk, topk)
        payload, meta = honest_message(sender, 0)
        plant(store, 0, payload, meta)
        assert receiver.exchanger.receive(1, 0).message is not None, (scheme, topk)
