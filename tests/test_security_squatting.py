"""Squatting in a signed run: a store writer (with no key, or with another island's) plants objects at
the names a learner or the lifecycle will write next, or large documents where they read. Each record
counts only what verifies, a writer still finds a name to write, and the work a planted object costs
is bounded."""

import json
import tracemalloc

import pytest
import torch

from infra import layout
from infra.authority import CONTROL, Authority
from infra.lease import LeaseHeld, RunLease, claim_key, released_key, renewal_key
from infra.objects import canonical_json, sha256
from infra.store import ObjectExists, ObjectStore, Unauthenticated
from infra.stores import RunStores
from training.learner.ledger import Ledger, finished, read_summaries
from training.learner.retention import Retention
from training.learner.state import Checkpointer, Lives, choose_resume_point
from tests.learners import run_both
from tests.test_security_authority import learner, signed_run  # noqa: F401 - the fixture


def unsigned(spec) -> ObjectStore:
    """A store writer without keys: the run's prefix as anyone who can write the bucket sees it."""
    return ObjectStore(spec.store.url).child("runs/r")


def test_junk_at_the_next_checkpoint_keys_retires_no_real_checkpoint(signed_run):
    spec, store_of = signed_run
    store = store_of("a")  # learner 0's island
    checkpointer = Checkpointer(store, None, Ledger(), background=False,
                                retention=Retention(lambda learner: store, 0, 1, keep=2))
    for t in (0, 1):
        checkpointer.write(t, {"weights": torch.full((2,), float(t))}, {"round": t})
    for t in (2, 3):  # the squatter takes the keys of the next two checkpoints
        unsigned(spec).commit_tensors(layout.checkpoint(0, t), {"weights": torch.zeros(2)}, {"round": t})
        checkpointer.write(t, {"weights": torch.ones(2)}, {"round": t})
    assert all(store.is_committed(layout.checkpoint(0, t)) for t in (0, 1))
    point = choose_resume_point(lambda learner: store, 0, 1, spec.sync.rounds + 10)
    assert point is not None and point.round == 1


def test_a_planted_large_commit_is_refused_before_its_body_is_parsed(signed_run):
    spec, store_of = signed_run
    key = f"{layout.checkpoint(0, 0)}.json"
    body = {"traffic": [{"round": i, "bytes": i} for i in range(300_000)]}  # ~15 MB, parsed: 6x that
    digest = sha256(canonical_json(body))
    forged = {"body": body, "sha256": digest, "signature": {"by": "a", "ed25519": "A" * 86 + "=="}}
    planted = json.dumps(forged, sort_keys=True, indent=1).encode()
    unsigned(spec).put_bytes(key, planted)
    reader = store_of("b")
    tracemalloc.start()
    with pytest.raises(Unauthenticated):
        reader.get_json(key)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(planted) > 14_000_000
    assert peak < 2 * len(planted)  # the read, never a parse (parsing it peaks past 6x its size)
    assert reader.stats["refused"] == {"checkpoint": 1}


def test_junk_lives_keep_no_learner_from_starting(signed_run):
    spec, store_of = signed_run
    for life in range(20):  # without a key, and with island a's key for island b's learner
        writer = unsigned(spec) if life % 2 else store_of("a")
        writer.put_json(layout.learner_life(1, life), {"learner": 1, "life": life, "start_round": 0,
                                                        "skipped_rounds": []})
    one = learner(spec, store_of, 1)
    one.resume()
    assert one.start_round == 0 and one.life == 20
    assert [life["life"] for life in Lives(RunStores(spec, store_of("a")).learner, spec.sync.rounds).of(1)] == [20]


def test_junk_summaries_keep_no_learner_from_finishing(signed_run):
    spec, store_of = signed_run
    for slot in range(6):
        writer = unsigned(spec) if slot % 2 else store_of("a")
        writer.put_json(layout.learner_summary(1, slot), {"learner": 1, "island": "b"})
    learners = [learner(spec, store_of, i) for i in range(2)]
    for one in learners:
        one.resume()
    run_both(learners)
    assert finished(RunStores(spec, store_of(CONTROL)), spec, 1)
    assert [s.learner for s in read_summaries(spec, store_of(CONTROL))] == [0, 1]
    assert store_of(CONTROL).exists(layout.learner_summary(1, 6))  # past every squatted slot


class CountingFileSystem:
    """The store's filesystem, counting the calls made through it (each a request, a listing a page or more)."""

    def __init__(self, fs):
        self.fs, self.calls = fs, 0

    def __getattr__(self, name):
        attribute = getattr(self.fs, name)
        if not callable(attribute):
            return attribute

        def counted(*args, **kwargs):
            self.calls += 1
            return attribute(*args, **kwargs)
        return counted


@pytest.fixture(params=["local", "s3"])
def lease_store(request, signed_run, tmp_path):
    """`of(writer)`: the run's prefix in a local folder or on SeaweedFS, as `writer` signs (None: no key),
    its calls counted in `of.fs`."""
    spec, _ = signed_run
    if request.param == "local":
        url = str(tmp_path / "leases")
    else:
        request.getfixturevalue("s3_env")
        url = f"s3://archipelago/test_security_squatting/{tmp_path.name}"

    def of(writer):
        root = ObjectStore(url, authority=None if writer is None else Authority.of(spec, writer))
        root.fs = root._shared.fs = CountingFileSystem(root.fs)
        return root.child("runs/r")
    return of


def test_a_planted_release_frees_no_live_run(lease_store):
    holder = RunLease.acquire(lease_store(CONTROL), "r", {"who": "us"})
    lease_store(None).put_bytes(released_key(holder.term), b"")  # empty and unsigned
    with pytest.raises(LeaseHeld):
        RunLease.acquire(lease_store(CONTROL), "r", {"who": "second"})
    with pytest.raises(ObjectExists):  # the squatted key costs the release: the lease expires instead
        holder.release()


def test_junk_renewals_block_no_renewal_and_expire_no_live_lease(lease_store):
    holder = RunLease.acquire(lease_store(CONTROL), "r", {"who": "us"})
    for number in (1, 2, 999999):  # the next renewal keys, and one far past them
        lease_store("a").put_json(renewal_key(holder.term, number), {"expires_at": "2000-01-01T00:00:00+00:00"})
    holder.renew()
    assert holder.renewals == 1000000
    with pytest.raises(LeaseHeld):
        RunLease.acquire(lease_store(CONTROL), "r", {"who": "second"})
    holder.renew()
    assert holder.renewals == 1000001


def test_junk_claims_cost_a_renewal_one_read_each_once(lease_store):
    store = lease_store(CONTROL)
    holder = RunLease.acquire(store, "r", {"who": "us"})
    junk, claims = lease_store(None), 2000
    for term in range(holder.term + 1, holder.term + 1 + claims):
        junk.put_bytes(claim_key(term), b"{}")
    counter = store._shared.fs
    before = counter.calls
    holder.renew()  # reads each planted claim once
    first = counter.calls - before
    before = counter.calls
    holder.renew()
    second = counter.calls - before
    assert first <= claims + 4 and second <= 4, (first, second)
    assert store.stats["refused"]["lease"] == claims


def test_a_deleted_manifest_is_written_again_by_a_resumed_prepare_data(signed_run, prefect_api, tmp_path):
    from prefect import flow

    from tasks.data import data_in_store, prepare_data_once

    spec, store_of = signed_run
    spec = spec.model_copy(update={"store": spec.store.model_copy(update={"url": str(tmp_path / "fresh")})})

    @flow
    def lifecycle_data():
        return prepare_data_once(spec, "r")

    lifecycle_data()
    store = ObjectStore(spec.store.url).child("runs/r")
    assert data_in_store(spec, "r")
    for path in (tmp_path / "fresh" / "runs" / "r" / "data").rglob("manifest.json"):
        path.unlink()  # a deletion in the store: the stage's result record still says it ran
    assert not data_in_store(spec, "r")
    lifecycle_data()
    assert data_in_store(spec, "r") and store.exists(layout.DATA_MANIFEST)
