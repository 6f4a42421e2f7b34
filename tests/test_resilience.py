"""Learners survive peers that vanish, corrupt objects and damaged checkpoints (local store, in-process)."""

import time

import pytest
import torch

from eval.report import fault_report
from infra import layout
from infra.spec import parse_spec
from infra.store import ObjectStore
from training.data.shards import prepare_dataset
from training.learner.loop import Learner
from training.learner.ledger import read_summaries
from training.model.params import flat_parameters
from tests.corpora import corpus_folder
from tests.learners import assert_restart_continues_exactly


@pytest.fixture
def run(two_learner_run):
    def make(**sync):
        return two_learner_run("resilience", layers=1, inner_steps=2, **{"rounds": 4, "partner_timeout_s": 0.3, **sync})

    return make


def test_a_learner_whose_partner_is_gone_goes_on_and_records_it(run):
    spec, store = run()
    learner = Learner(spec, store, 0)
    learner.run()  # learner 1 never starts: every exchange misses its deadline
    assert [m["round"] for m in learner.ledger.missed_exchanges] == [0, 1, 2, 3]
    assert all(m["reason"] == "deadline" for m in learner.ledger.missed_exchanges)
    assert store.is_committed(layout.checkpoint(0, 3))


def test_a_corrupt_message_is_detected_and_never_mixed_in(run):
    spec, store = run()
    sender = Learner(spec, store, 1)
    sender.store.corrupt_next_write()
    anchor = flat_parameters(sender.model)
    sender.exchanger.publish(0, anchor, torch.ones_like(anchor))
    receipt = Learner(spec, store, 0).exchanger.receive(1, 0)
    assert receipt.message is None and receipt.corrupt and receipt.reason.startswith("corrupt")


def test_restart_resumes_from_own_checkpoint_and_skips_uncommitted_or_corrupt_ones(run):
    spec, store = run()
    first = Learner(spec, store, 0)
    first.resume()
    for t in range(2):
        first.run_round(t)
    # A checkpoint whose JSON manifest never landed does not exist.
    store.put_bytes(f"{layout.checkpoint(0, 2)}.safetensors", b"partial")
    again = Learner(spec, store, 0)
    again.resume()
    assert again.start_round == 2 and again.rejoined_from == {"learner": 0, "round": 1}
    assert torch.equal(flat_parameters(again.model), flat_parameters(first.model))
    assert again.ledger.bytes_written == first.ledger.bytes_written > 0  # counters survive the restart
    assert [r["round"] for r in again.ledger.rounds] == [0, 1]


def test_restart_rejoins_from_a_fresher_peer_checkpoint(run):
    spec, store = run()
    first_life = Learner(spec, store, 0)
    first_life.resume()
    first_life.run_round(0)
    peer = Learner(spec, store, 1)
    for t in range(3):
        peer.run_round(t)
    late = Learner(spec, store, 0)
    late.resume()
    assert late.start_round == 3 and late.rejoined_from == {"learner": 1, "round": 2}
    assert torch.equal(flat_parameters(late.model), flat_parameters(peer.model))
    assert [r["round"] for r in late.ledger.rounds] == [0]  # its own first life still counts


def test_a_late_first_start_trains_every_round_instead_of_taking_a_peer_state(run):
    spec, store = run()
    peer = Learner(spec, store, 1)
    for t in range(3):
        peer.run_round(t)
    late = Learner(spec, store, 0)
    late.resume()
    assert late.start_round == 0 and late.rejoined_from is None
    assert torch.equal(flat_parameters(late.model), flat_parameters(Learner(spec, store, 1).model))


def test_more_learners_than_documents_stops_before_training(tmp_path):
    corpus = corpus_folder(tmp_path)
    (corpus / "only.txt").write_text("one document " * 100)
    (corpus / "two.txt").write_text("two documents " * 100)
    (corpus / "three.txt").write_text("three documents " * 100)
    spec = parse_spec({
        "islands": [{"name": "a", "learners": 3, "batch_size": 2, "seq_len": 16, "inner_steps": 2}],
        "data": {"corpora": [{"name": "t", "source": "files", "paths": [str(corpus / "*.txt")]}]},
        "sync": {"rounds": 1}, "store": {"url": str(tmp_path / "store")}})
    with pytest.raises(ValueError, match="3 learners but only 2 training documents"):
        prepare_dataset(spec, ObjectStore(spec.store.url))


@pytest.mark.parametrize("outer", [{"name": "nesterov", "lr": 0.7, "momentum": 0.9},
                                   {"name": "shampoo", "lr": 0.7, "momentum": 0.9,
                                    "shampoo": {"graft": "sgd", "start_preconditioning_step": 2}}])
def test_a_restarted_learner_continues_exactly_with_its_outer_optimizer_state(run, outer):
    assert_restart_continues_exactly(*run(outer=outer))


def test_a_partner_stops_waiting_as_soon_as_a_restart_records_the_round_will_never_come(run):
    """Learner 0 dies at once, learner 1 trains on alone; learner 0's restart rejoins from learner 1's
    round-3 checkpoint and records rounds 0 to 3 as skipped: a partner waiting for one of those
    messages gives up within seconds instead of waiting out its 60 s timeout."""
    spec, store = run()
    dead = Learner(spec, store, 0)
    dead.resume()  # its first life, which dies before its first round
    alone = Learner(spec, store, 1)
    alone.resume()
    alone.run()
    restarted = Learner(spec, store, 0)
    restarted.resume()
    assert restarted.rejoined_from == {"learner": 1, "round": 3} and restarted.life == 1
    waiting = Learner(spec.model_copy(update={"sync": spec.sync.model_copy(update={"partner_timeout_s": 60})}),
                      store, 1)
    began = time.monotonic()
    receipt = waiting.exchanger.receive(0, 2)
    assert receipt.message is None and receipt.reason == "skipped by the peer's restart"
    assert time.monotonic() - began < 10
    (first, second) = restarted.lives.of(0)
    assert first["skipped_rounds"] == [] and second["skipped_rounds"] == [0, 1, 2, 3]


def test_the_fault_report_counts_a_restart_the_same_whether_injected_or_not(run):
    spec, store = run()
    Learner(spec, store, 0).resume()
    alone = Learner(spec, store, 1)
    alone.resume()
    alone.run()
    restarted = Learner(spec, store, 0)
    restarted.resume()
    restarted.run()
    summaries = read_summaries(spec, store)
    faults = fault_report(spec, summaries, store.list("faults"))
    assert faults["injected"] == {}
    assert faults["failures"] == {"restarts": 1, "rejoined_from_peer": 1, "rounds_skipped": 4,
                                  "tokens_skipped": 4 * spec.learners[0].tokens_per_round()}
    assert faults["recovered"] == 1
