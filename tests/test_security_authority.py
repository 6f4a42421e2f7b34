"""Attacks by whoever can write a store, each planted against the project's own code: signed objects,
strict records and restores, bounded reads, messages that cannot poison a mix."""

import json

import pytest
import torch

from infra import layout
from infra.authority import CONTROL, Authority, Unauthenticated, foreign_signing_keys, generate_keypair
from infra.derived import commit_derived, read_derived
from infra.objects import json_document
from infra.spec import parse_spec
from infra.spec.sync import OuterOptimizerSpec
from infra.store import IntegrityError, ObjectStore, ObjectTooLarge
from infra.stores import RunStores
from training.data.shards import prepare_dataset
from training.learner.loop import Learner
from training.learner.ledger import finished, read_summaries
from training.exchange.outer import OuterOptimizer, StateRejected
from training.exchange.plan import message_key
from training.model.params import flat_parameters
from training.learner.retention import Retention
from training.learner.state import CheckpointRejected, Lives
from tests.learners import run_both
from tests.corpora import corpus_folder


@pytest.fixture
def signed_run(tmp_path, monkeypatch):
    """A run of two one-learner islands with keys: the control plane's store and each island's, as
    each of them signs; learners in this process, as `training.learner.process` builds them."""
    corpus = corpus_folder(tmp_path)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 400)
    sections = {}
    for writer in (CONTROL, "a", "b"):
        private, public = generate_keypair()
        variable = f"TEST_SIGNING_KEY_{writer.upper()}"
        monkeypatch.setenv(variable, private)
        sections[writer] = {"public_key": public, "private_key_env": variable}
    spec = parse_spec({
        "name": "signed",
        "islands": [{"name": name, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2,
                     "signing": sections[name]} for name in ("a", "b")],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.2}]},
        "training": {"warmup_steps": 1},
        "sync": {"mode": "butterfly", "rounds": 3, "partner_timeout_s": 0.5},
        "store": {"url": str(tmp_path / "store")},
        "signing": sections[CONTROL],
    })

    def store_of(writer):
        return ObjectStore(spec.store.url, authority=Authority.of(spec, writer)).child("runs/r")

    control = store_of(CONTROL)
    control.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, control)
    return spec, store_of


def learner(spec, store_of, index):
    island = spec.learners[index].island.name
    return Learner(spec, RunStores(spec, store_of(island), reader=island), index)


def test_signed_objects_verify_and_planted_ones_are_refused(signed_run):
    spec, store_of = signed_run
    control, a, b = store_of(CONTROL), store_of("a"), store_of("b")
    assert a.get_json(layout.SPEC)["name"] == "signed"  # the control plane's spec verifies for an island
    unsigned = ObjectStore(spec.store.url).child("runs/r")
    attacks = {
        # no signature at all, under learner 1's (island b's) next life
        layout.learner_life(1, 0): lambda key: unsigned.put_json(key, {"learner": 1}),
        # island a's valid key, signing what only island b may write
        layout.checkpoint(1, 99) + ".json": lambda key: a.put_json(key, {"tensors": {}}),
        # island a forging a control-plane record
        "lease/000001/claim.json": lambda key: a.put_json(key, {"expires_at": "9999-01-01T00:00:00+00:00"}),
    }
    for key, plant in attacks.items():
        plant(key)
        with pytest.raises(Unauthenticated):
            b.get_json(key)
    # A valid document replayed under another name does not verify there.
    b.put_json(layout.learner_summary(1), {"learner": 1})
    replay = layout.learner_paused(1, 0)
    unsigned.put_bytes(replay, b.get_bytes(layout.learner_summary(1)))
    with pytest.raises(Unauthenticated):
        control.get_json(replay)
    assert b.stats["refused"] == {"life": 1, "checkpoint": 1, "lease": 1}
    assert control.stats["refused"] == {"pause": 1}


def test_reads_are_bounded_and_deep_json_is_refused_not_a_crash(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.put_bytes("big.json", b" " * 5_000_000)
    with pytest.raises(ObjectTooLarge):
        store.get_json("big.json", max_bytes=1000)
    store.put_bytes("deep.json", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(IntegrityError):
        store.get_json("deep.json")
    store.put_bytes("list.json", json_document({"sha256": "x"}).replace(b'"body"', b'"other"'))
    with pytest.raises(IntegrityError):
        store.get_json("list.json")


def test_outer_state_restores_only_into_the_slots_a_fresh_optimizer_has():
    shapes = [torch.Size([3, 2])]

    def nesterov():
        return OuterOptimizer.from_spec(OuterOptimizerSpec(name="nesterov", lr=0.7, momentum=0.9), shapes)

    trained = nesterov()
    trained.step(torch.zeros(6), torch.ones(6))
    tensors, scalars = trained.state()
    # The dotted path of a planted entry is never walked as attribute names.
    planted = {**tensors, "outer.0.momentum_buffer.__class__.__init__": torch.zeros(1)}
    with pytest.raises(StateRejected, match="not an entry"):
        nesterov().load_state(planted, scalars)
    with pytest.raises(StateRejected, match="only restore its step"):
        nesterov().load_state(tensors, {**scalars, "groups": [{"maximize": True}]})
    with pytest.raises(StateRejected, match="float32"):
        nesterov().load_state({"outer.0.momentum_buffer": torch.zeros(5)}, scalars)
    with pytest.raises(StateRejected, match="non-finite"):
        nesterov().load_state({"outer.0.momentum_buffer": torch.full((3, 2), float("inf"))}, scalars)
    restored = nesterov()
    restored.load_state(tensors, scalars)
    assert torch.equal(restored.step(torch.zeros(6), torch.ones(6)), trained.step(torch.zeros(6), torch.ones(6)))


@pytest.mark.parametrize("attack", ["huge_scale", "huge_values", "body_is_a_list", "key_not_a_string",
                                    "nested", "oversized_part"])
def test_a_valid_looking_or_malformed_message_costs_one_exchange(two_learner_run, attack):
    spec, store = two_learner_run("poison", layers=1, inner_steps=2, rounds=2, partner_timeout_s=0.5,
                                  transport={"compression": "int8"} if attack == "huge_scale" else {})
    sender, receiver = Learner(spec, store, 1), Learner(spec, store, 0)
    anchor = flat_parameters(sender.model)
    key = message_key(len(receiver.exchanger.fragments), 1, 0)
    if attack in ("huge_scale", "huge_values"):
        published = sender.exchanger.publish(0, anchor, torch.full_like(anchor, 1e-3))
        payload, meta, _ = receiver.transport.fetch(1, key, "inter", 1 << 30, 1.0, give_up=lambda: False)
        for name, value in payload.items():
            if attack == "huge_scale" and name.endswith(".scale"):
                payload[name] = torch.full_like(value, 3e38)
            elif attack == "huge_values" and value.is_floating_point():
                payload[name] = torch.full_like(value, 3e38)
        assert published.bytes_written
        forged = ObjectStore(spec.store.url).child("runs/r")
        key = key.replace("round-00000", "round-00001")
        meta["round"] = 1
        forged.commit_tensors(key, payload, meta)
        round_index = 1
    else:
        round_index = 0
        body = {"body_is_a_list": [1, 2], "key_not_a_string": {"tensors": {"key": 5, "sha256": 7, "nbytes": 1}},
                "nested": {"tensors": {"a": [[[[[[[1]]]]]]]}},
                "oversized_part": {"tensors": {"key": f"{key}.safetensors", "sha256": "0" * 64, "nbytes": 10}}}[attack]
        store.put_bytes(f"{key}.json", json.dumps({"sha256": "0", "body": body}).encode()
                        if attack == "body_is_a_list" else json_document(body))
        if attack == "oversized_part":
            store.put_bytes(f"{key}.safetensors", b"x" * 10_000_000)
    own = {"anchor": anchor, "delta": torch.full_like(anchor, 1e-3)}
    receipt = receiver.exchanger.receive(1, round_index, own=own)
    assert receipt.message is None and len(receipt.reason) < 400  # our words, never the object's
    assert receipt.bytes_read < 1_000_000


def test_a_message_planted_under_a_learners_own_key_is_not_adopted(two_learner_run):
    spec, store = two_learner_run("own", layers=1, inner_steps=2, rounds=2)
    me = Learner(spec, store, 0)
    anchor = flat_parameters(me.model)
    attacker = Learner(spec, store, 0)  # the same learner's encoder, values far from ours
    attacker.exchanger.publish(0, anchor, torch.full_like(anchor, 5.0))
    published = me.exchanger.publish(0, anchor, torch.full_like(anchor, 1e-3))
    assert torch.equal(published.sent["delta"], torch.full_like(anchor, 1e-3))


def test_planted_records_change_nothing(signed_run):
    spec, store_of = signed_run
    unsigned = ObjectStore(spec.store.url).child("runs/r")
    # A life that would force the resume path on a first start, a checkpoint of round 99999 that would
    # end the learner as finished, a summary that would mark it finished, a squatted life key.
    unsigned.put_json(layout.learner_life(0, 0), {"learner": 0, "life": 0, "start_round": 0, "skipped_rounds": []})
    unsigned.commit_tensors(layout.checkpoint(0, 99999), {"weights": torch.zeros(1)}, {})
    unsigned.put_json(layout.learner_summary(0), {"learner": 0})
    assert not finished(RunStores(spec, store_of(CONTROL)), spec, 0)
    one = learner(spec, store_of, 0)
    one.resume()
    assert one.start_round == 0 and one.life == 1  # life 0's key is taken: the next one is recorded
    lives = Lives(RunStores(spec, store_of("b")).learner, spec.sync.rounds)
    assert [life["life"] for life in lives.of(0)] == [1]


def test_a_peers_checkpoint_that_does_not_fit_is_refused(signed_run):
    spec, store_of = signed_run
    one = learner(spec, store_of, 0)
    weights = flat_parameters(one.model)
    good = {"weights": weights}
    one.state.check(good, {"inner_step": 0, "pending": None}, spec.sync.rounds)
    bad = [({"weights": weights[:-1]}, {"inner_step": 0}), ({"weights": weights * float("nan")}, {"inner_step": 0}),
           ({"weights": weights * 1e6}, {"inner_step": 0}), ({"weights": weights, "x": weights}, {"inner_step": 0}),
           (good, {"inner_step": "0"}), (good, {"inner_step": 0, "pending": {"round": 10**6, "fragment": 0}})]
    for tensors, meta in bad:
        with pytest.raises((CheckpointRejected, StateRejected)):
            one.state.check(tensors, meta, spec.sync.rounds)


def test_retention_keeps_real_checkpoints_beside_planted_later_ones(two_learner_run):
    spec, store = two_learner_run("keep", layers=1, inner_steps=2, rounds=4)
    for t in (0, 1, 7, 8):  # 7 and 8: planted, past the round the learner just committed
        store.commit_tensors(layout.checkpoint(0, t), {"weights": torch.zeros(1)}, {})
    Retention(lambda learner: store, 0, 1, keep=2).after_checkpoint(newest=1)
    assert store.is_committed(layout.checkpoint(0, 0)) and store.is_committed(layout.checkpoint(0, 1))


def test_a_planted_rewrite_of_a_model_falls_back_to_the_real_one(signed_run):
    spec, store_of = signed_run
    control = store_of(CONTROL)
    commit_derived(control, layout.CONSOLIDATED, {"weights": torch.ones(3)}, {"by": "control"})
    store_of("a").commit_tensors(layout.rewrite(layout.CONSOLIDATED, 3), {"weights": torch.zeros(3)}, {})
    tensors, meta, _ = read_derived(control, layout.CONSOLIDATED)
    assert torch.equal(tensors["weights"], torch.ones(3)) and meta["by"] == "control"


def test_a_learner_inherits_no_other_writers_key(signed_run):
    spec, _ = signed_run
    assert foreign_signing_keys(spec, "a") == ["TEST_SIGNING_KEY_B", "TEST_SIGNING_KEY_CONTROL"]


def test_a_signed_run_trains_and_its_exchanges_verify_beside_a_squatted_summary(signed_run):
    spec, store_of = signed_run
    store_of("a").put_json(layout.learner_summary(1), {"learner": 1, "island": "b"})  # a's key, b's learner
    learners = [learner(spec, store_of, i) for i in range(2)]
    for one in learners:
        one.resume()
    run_both(learners)
    for one in learners:
        assert one.ledger.missed_exchanges == [] and len(one.ledger.rounds) == spec.sync.rounds
    assert finished(RunStores(spec, store_of(CONTROL)), spec, 1)
    assert [s.learner for s in read_summaries(spec, store_of(CONTROL))] == [0, 1]
    assert store_of(CONTROL).exists(layout.learner_summary(1, 1))  # written past the squatted slot


def test_planted_lease_records_neither_block_nor_end_the_run(tmp_path, signed_run):
    from infra.lease import RunLease, claim_key

    store = ObjectStore(str(tmp_path / "leases")).child("runs/r")  # an unauthenticated run's lease
    store.put_json(claim_key(0), {"holder": {"who": "attacker"}, "claimed_at": "now",
                                  "expires_at": "9999-01-01T00:00:00+00:00"})
    store.put_json(claim_key(1), {"holder": {"who": "attacker"}, "claimed_at": "now",
                                  "expires_at": "2026-01-01T00:00:00"})  # naive: it raised TypeError
    lease = RunLease.acquire(store, "r", {"who": "us"})
    assert lease.term == 2 and store.stats["refused"] == {"lease": 2}
    store.put_bytes(claim_key(3), b"squatted")  # a claim of the next term that is no claim
    lease.renew()  # still ours
    # In a signed run, island a's key forges no lease of the control plane's.
    spec, store_of = signed_run
    store_of("a").put_json(claim_key(0), {"holder": {"who": "a"}, "claimed_at": "now",
                                          "expires_at": "2099-01-01T00:00:00+00:00"})
    assert RunLease.acquire(store_of(CONTROL), "r", {"who": "control"}).term == 1


def test_a_learner_started_under_a_lease_term_stops_once_a_newer_term_holds_the_run(signed_run):
    import time

    from infra.lease import SUPERSEDED, LeaseFence, RunLease, claim_key

    spec, store_of = signed_run
    control = store_of(CONTROL)
    first = RunLease.acquire(control, "r", {"who": "first lifecycle"})
    ended: list[int] = []
    LeaseFence(store_of("a"), first.term, "learner 0", every_s=0.05, end=ended.append).start()
    store_of("b").put_json(claim_key(first.term + 5), {"holder": {"who": "b"}, "claimed_at": "now",
                                                       "expires_at": "2099-01-01T00:00:00+00:00"})
    time.sleep(0.3)
    assert ended == []  # its own term, and a newer one that does not verify, change nothing
    first.release()
    second = RunLease.acquire(control, "r", {"who": "second lifecycle"})
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert second.term > first.term and ended == [SUPERSEDED]


def test_archipelago_keys_writes_private_keys_to_owner_only_files_and_prints_the_spec_sections(
        tmp_path, capsys, monkeypatch):
    import os
    import stat

    import yaml

    from flows.cli import main

    assert main(["keys", "east", "west", "--out", str(tmp_path / "keys")]) == 0
    printed = capsys.readouterr().out
    sections = yaml.safe_load(printed)
    files = {path.stem: path for path in (tmp_path / "keys").iterdir()}
    assert set(files) == {CONTROL, "east", "west"}
    for writer, path in files.items():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert path.read_text().strip() not in printed
        section = sections["signing"] if writer == CONTROL else \
            next(i["signing"] for i in sections["islands"] if i["name"] == writer)
        monkeypatch.setenv(section["private_key_env"], path.read_text().strip())
    spec = parse_spec({"name": "keys", "signing": sections["signing"],
                       "islands": [{"name": i["name"], "learners": 1, "batch_size": 1, "seq_len": 8,
                                    "inner_steps": 1, "signing": i["signing"]} for i in sections["islands"]],
                       "data": {"corpora": [{"name": "t", "source": "files", "paths": ["x/*.txt"]}]},
                       "sync": {"rounds": 2}})
    signed = Authority.of(spec, "east").sign("runs/r/learners/000/summary.json", "0" * 64)
    Authority.of(spec, None).verify("runs/r/learners/000/summary.json", "0" * 64, signed)
    assert main(["keys", "east", "--out", str(tmp_path / "keys")]) == 2  # never overwritten
