"""The exchanger on its own, against a fake channel: the exchange's logic without a store or a
learner process (the real transport and store are exercised by test_transport, test_resilience
and the lifecycle tests)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from infra.spec import parse_spec
from infra.store import ObjectExists
from training.model.registry import build_model
from training.model.params import flat_parameters
from training.exchange.channel import Channel, Message
from training.exchange.exchanger import Exchanger


class FakeChannel(Channel):
    """The messages of one run's learners held in memory; each job runs on a thread of its own, as
    each learner's exchange runs on its own transport thread."""

    def __init__(self):
        self.messages: dict[str, tuple[dict, dict]] = {}
        self.pool = ThreadPoolExecutor(8)

    def submit(self, link, job, *args) -> Future:
        return self.pool.submit(job, *args)

    def send(self, key, tensors, meta, link) -> int:
        if key in self.messages:
            raise ObjectExists(key)
        self.messages[key] = ({k: v.clone() for k, v in tensors.items()}, dict(meta))
        return sum(v.numel() * v.element_size() for v in tensors.values())

    def read_own(self, key, link, max_bytes) -> Message:
        tensors, meta = self.messages[key]
        return Message(dict(tensors), dict(meta), sum(v.numel() * v.element_size() for v in tensors.values()))

    def fetch(self, peer, key, link, max_bytes, timeout_s, give_up) -> Message | None:
        deadline = time.monotonic() + timeout_s
        while key not in self.messages and not give_up() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.read_own(key, link, max_bytes) if key in self.messages else None


def spec_of(mode: str = "butterfly", islands: int = 2, tau: int = 0, **outer):
    return parse_spec({
        "name": "sync",
        "islands": [{"name": f"island-{i}", "learners": 1, "batch_size": 2 * (i + 1), "seq_len": 8, "inner_steps": 2}
                    for i in range(islands)],
        "model": {"layers": 1, "width": 8, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": ["unused/*.txt"]}]},
        "sync": {"mode": mode, "rounds": 4, "partner_timeout_s": 5, "outer": {"name": "nesterov", "lr": 1.0,
                                                                               "momentum": 0.0, **outer},
                 "transport": {"tau": tau}},
    })


def exchangers(spec, transport, skipped=lambda peer, round_index: False):
    model = build_model(spec)
    initial = flat_parameters(model)
    return [Exchanger(spec, slot, transport, model, initial, skipped=skipped) for slot in spec.learners]


def moved(initial: torch.Tensor, seed: int) -> torch.Tensor:
    """Weights after some local training: the initial ones plus a learner's own drift."""
    return initial + 0.01 * torch.randn(initial.shape, generator=torch.Generator().manual_seed(seed))


def test_butterfly_partners_land_on_the_token_weighted_mean_and_agree_bitwise():
    spec, transport = spec_of(), FakeChannel()
    pair = exchangers(spec, transport)
    weights = [moved(pair[0].initial, seed) for seed in (1, 2)]
    sent = [x.start(0, w) for x, w in zip(pair, weights)]  # each publishes before the other receives
    new = [x.apply(e, w)[0] for x, e, w in zip(pair, sent, weights)]
    tokens = [slot.tokens_per_round() for slot in spec.learners]
    want = (tokens[0] * weights[0] + tokens[1] * weights[1]) / sum(tokens)
    assert torch.equal(new[0], new[1])
    assert torch.allclose(new[0], want, atol=1e-6)
    assert torch.equal(pair[0].anchors(), pair[1].anchors())


def test_progress_made_after_sending_is_kept_on_top_of_the_new_anchor():
    spec, transport = spec_of(tau=1), FakeChannel()
    pair = exchangers(spec, transport)
    weights = [moved(pair[0].initial, seed) for seed in (1, 2)]
    sent = [x.start(0, w) for x, w in zip(pair, weights)]
    later = weights[0] + 0.5
    new, _ = pair[0].apply(sent[0], later)
    assert torch.allclose(new, pair[0].anchors() + 0.5, atol=1e-6)


def test_the_outer_step_runs_in_the_exchange_and_the_state_to_checkpoint_is_the_one_before_it():
    """The job on the transport thread mixes and takes the outer step; until the learner applies the
    exchange, the state a checkpoint takes is the one before that step (a restart from that
    checkpoint re-runs the exchange, and must not step twice)."""
    spec = spec_of(tau=1, name="shampoo", shampoo={"start_preconditioning_step": 1})
    pair = exchangers(spec, FakeChannel())
    weights = [moved(pair[0].initial, seed) for seed in (1, 2)]
    before, _ = pair[0].state_dict()
    sent = [x.start(0, w) for x, w in zip(pair, weights)]
    result = sent[0].result.result()  # the job is done; the exchange is not applied yet
    assert result.anchor is not None and result.seconds["outer_step"] > 0
    assert pair[0].fragments[0].outer.optimizer.state, "the live optimizer has stepped"
    in_flight, _ = pair[0].state_dict()
    assert in_flight.keys() == before.keys() and all(torch.equal(in_flight[k], before[k]) for k in before)
    pair[0].apply(sent[0], weights[0])
    applied, _ = pair[0].state_dict()
    assert any(k.startswith("outer.") for k in applied) and set(applied) > set(before)
    assert torch.equal(pair[0].anchors(), result.anchor)


def test_an_exchange_is_due_tau_steps_after_it_was_sent():
    spec = spec_of(tau=1)
    (first, _) = exchangers(spec, FakeChannel())
    assert [first.due(steps) for steps in (0, 1, 2)] == [False, True, True]


@pytest.mark.parametrize("skipped, reason", [(False, "deadline"), (True, "skipped by the peer's restart")])
def test_a_peer_that_never_sends_is_a_missed_exchange_and_the_learner_keeps_its_own_step(skipped, reason):
    spec, transport = spec_of(), FakeChannel()
    alone, _ = exchangers(spec, transport, skipped=lambda peer, round_index: skipped)
    weights = moved(alone.initial, 1)
    new, result = alone.apply(alone.start(0, weights, deadline=time.monotonic() + 0.2), weights)
    assert result.received == [] and result.missed == [{"round": 0, "peer": 1, "reason": reason}]
    assert torch.allclose(new, weights, atol=1e-6)  # plain averaging of one: the learner's own weights


def test_a_poisoned_message_is_refused_before_it_is_mixed():
    spec, transport = spec_of(), FakeChannel()
    pair = exchangers(spec, transport)
    poisoned = moved(pair[1].initial, 2)
    poisoned[0] = float("nan")
    pair[1].start(0, poisoned)
    weights = moved(pair[0].initial, 1)
    new, result = pair[0].apply(pair[0].start(0, weights), weights)
    assert result.received == [] and result.missed[0]["reason"].startswith("refused:")
    assert bool(torch.isfinite(new).all())


@pytest.mark.parametrize("shard", [False, True])
def test_all_reduce_mixes_every_peer_and_sends_only_the_pseudo_gradient(shard):
    """Every learner takes the whole step from every peer's pseudo-gradient; or, sharded, each gets the
    others' on its own shard and shares its shard of the new anchor: the same new weights."""
    raw = spec_of("allreduce", islands=3).model_dump(mode="json")
    raw["sync"]["shard_outer_step"] = shard
    spec, transport = parse_spec(raw), FakeChannel()
    group = exchangers(spec, transport)
    weights = [moved(group[0].initial, seed) for seed in (1, 2, 3)]
    sent = [x.start(0, w) for x, w in zip(group, weights)]
    new = [x.apply(e, w)[0] for x, e, w in zip(group, sent, weights)]
    for key, (tensors, _) in transport.messages.items():
        assert set(tensors) == ({"anchor"} if key.endswith("message-stepped") else {"delta"}), key
    assert any(key.endswith("message-stepped") for key in transport.messages) == shard
    assert torch.equal(new[0], new[1]) and torch.equal(new[1], new[2])
    tokens = [slot.tokens_per_round() for slot in spec.learners]
    want = sum(t * w for t, w in zip(tokens, weights)) / sum(tokens)
    assert torch.allclose(new[0], want, atol=1e-6)


def test_a_resend_after_a_restart_keeps_to_the_message_peers_already_saw():
    """A dead life committed a message for the round; the new life's publish finds the key taken
    and mixes with what was sent, not with what it would send now."""
    spec, transport = spec_of(), FakeChannel()
    first_life, _ = exchangers(spec, transport)
    anchor = first_life.initial
    first_life.publish(0, anchor, torch.full_like(anchor, 1e-3))
    second_life, _ = exchangers(spec, transport)
    published = second_life.publish(0, anchor, torch.full_like(anchor, 5e-3))
    assert published.bytes_written == 0
    assert torch.equal(published.sent["delta"], torch.full_like(anchor, 1e-3))
