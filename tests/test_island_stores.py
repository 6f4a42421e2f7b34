"""Each island with its own S3 store and credentials: two real SeaweedFS servers, learners as OS processes.

The run's store (and the east island's) is the session's server; the west island's is a second
server with other credentials, which the west learner's process gets from WEST_AWS_* variables.
Only what a partner reads crosses between the stores.
"""

import os
import signal
import threading
import time

import pytest

from eval.report import fault_report, store_bytes
from infra import layout
from infra.seaweed import seaweed_server
from infra.spec import parse_spec
from infra.store import ObjectStore, StoreError, run_store
from infra.stores import RunStores, check_stores_reachable
from training.consolidate import consolidate
from training.data.shards import prepare_dataset
from training.learner.ledger import read_summaries
from training.stages import train_learners
from tests.corpora import corpus_folder


@pytest.fixture(scope="module")
def west_server(tmp_path_factory):
    with seaweed_server(tmp_path_factory.mktemp("seaweed-west"), buckets=("west",)) as server:
        yield server


@pytest.fixture
def two_sites(make_two_sites):
    return make_two_sites()


@pytest.fixture
def make_two_sites(s3_env, west_server, monkeypatch, tmp_path):
    monkeypatch.setenv("WEST_AWS_ACCESS_KEY_ID", west_server.access_key)
    monkeypatch.setenv("WEST_AWS_SECRET_ACCESS_KEY", west_server.secret_key)
    for i in range(6):
        (corpus_folder(tmp_path) / f"doc{i}.txt").write_text(f"document {i} " * 400)

    def make(**sync):
        return prepare_two_sites(west_server, tmp_path, sync)

    return make


def prepare_two_sites(west_server, tmp_path, sync: dict):
    spec = parse_spec({
        "name": "sites",
        "islands": [{"name": "east", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2},
                    {"name": "west", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 3,
                     "store": {"url": f"s3://west/{tmp_path.name}", "endpoint_url": west_server.endpoint_url,
                               "credentials_env": "WEST"}}],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus_folder(tmp_path) / "doc*.txt")],
                              "eval_fraction": 0.2}]},
        "training": {"warmup_steps": 1},
        "sync": {"mode": "butterfly", "rounds": 4, "partner_timeout_s": 60, **sync},
        "store": {"url": f"s3://archipelago/sites/{tmp_path.name}"},
        "unauthenticated": True,  # what is tested here is where objects go and which keys reach them
    })
    run = run_store(spec.store, "r")
    run.put_json(layout.SPEC, spec.model_dump(mode="json"))
    return spec, run


def test_each_island_keeps_its_state_in_its_own_store_and_only_exchanges_cross(two_sites, tmp_path):
    spec, run = two_sites
    check_stores_reachable(spec)
    manifest = prepare_dataset(spec, run)
    west = RunStores(spec, run).island("west")
    assert west.url.startswith("s3://west/") and manifest["shards"][1]["store"] == west.url
    assert manifest["shards"][0]["store"] == run.url

    train_learners(spec, "r", relay=lambda line: None)
    consensus = consolidate(spec, run)
    assert consensus["learners_without_final_checkpoint"] == []

    # The west learner's objects are in the west store only; the east learner's in the run's store only.
    assert west.list(layout.learner_prefix(1)) and not run.list(layout.learner_prefix(1))
    assert run.list(layout.learner_prefix(0)) and not west.list(layout.learner_prefix(0))
    assert west.exists(layout.shard(1)) and not run.exists(layout.shard(1))
    assert run.is_committed(layout.CONSOLIDATED) and not west.list("models")

    east_summary, west_summary = read_summaries(spec, run)
    assert east_summary.missed_exchanges == [] and west_summary.missed_exchanges == []
    assert (east_summary.store_url, west_summary.store_url) == (run.url, west.url)
    # What each learner read from the other's store is what the other wrote there.
    assert east_summary.stores[west.url]["read"] == west_summary.stores[west.url]["written"] > 0
    assert west_summary.stores[run.url]["read"] == east_summary.stores[run.url]["written"] > 0
    assert set(east_summary.stores) == set(west_summary.stores) == {run.url, west.url}
    per_store = store_bytes([east_summary, west_summary])
    assert per_store[west.url]["checkpoints_written"] == west_summary.checkpoint_bytes > 0
    assert per_store[run.url]["messages_read"] == west_summary.stores[run.url]["read"]


def test_an_island_store_uses_its_own_credentials_and_names_what_is_missing(two_sites, monkeypatch):
    spec, run = two_sites
    west_spec = spec.islands[1].store
    # The run's credentials (AWS_*) are not the west site's: without WEST_* the west store refuses them.
    refused = ObjectStore(west_spec.url, west_spec.endpoint_url)
    with pytest.raises(StoreError):
        refused.check_reachable()
    monkeypatch.delenv("WEST_AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StoreError, match="WEST_AWS_SECRET_ACCESS_KEY not set") as err:
        check_stores_reachable(spec)
    assert "s3cr" not in str(err.value) and spec.islands[1].store.credentials_env == "WEST"


def test_a_store_that_goes_away_costs_exchanges_not_the_run(make_two_sites, west_server, tmp_path):
    """The west site's store stops answering for a stretch: east's learner records missed exchanges
    and goes on; west's learner waits for its own store (retrying a request that times out); the
    run finishes with every round of both learners, and the report counts the outage."""
    spec, run = make_two_sites(rounds=10, partner_timeout_s=2)
    prepare_dataset(spec, run)
    west = RunStores(spec, run).island("west")
    trained: dict = {}
    training = threading.Thread(target=lambda: trained.update(
        learners=train_learners(spec, "r", relay=lambda line: None), consensus=consolidate(spec, run)))
    training.start()
    deadline = time.monotonic() + 120
    while max(layout.checkpoint_rounds(west.list(layout.learner_prefix(1))), default=-1) < 2:
        assert time.monotonic() < deadline and training.is_alive(), "the west learner never checkpointed round 2"
        time.sleep(0.05)
    os.killpg(west_server.pid, signal.SIGSTOP)  # unreachable: connections open, nothing answers
    try:
        time.sleep(20)
    finally:
        os.killpg(west_server.pid, signal.SIGCONT)
    training.join(timeout=300)
    assert [learner["finished"] for learner in trained["learners"]] == [True, True]
    consensus = trained["consensus"]
    assert consensus["learners_without_final_checkpoint"] == [] and consensus["learners_with_corrupt_final_checkpoint"] == []
    east_summary, west_summary = read_summaries(spec, run)
    assert len(east_summary.rounds) == len(west_summary.rounds) == 10
    missed = [m for m in east_summary.missed_exchanges if m["peer"] == 1]
    assert missed and all(m["reason"] == "deadline" or m["reason"].startswith("unreachable") for m in missed)
    # West's own requests waited for its store (a request that timed out was retried): nothing it
    # wrote was lost, and every message east did receive from it verified.
    assert west_summary.missed_exchanges == [] or all(m["peer"] == 0 for m in west_summary.missed_exchanges)
    assert east_summary.corrupt_reads_detected == 0
    faults = fault_report(spec, [east_summary, west_summary], run.list("faults"))
    assert faults["missed_exchanges"] >= len(missed)
    assert faults["store_retries"] == east_summary.store["retries"] + west_summary.store["retries"]
