"""Stage results, run leases and run ids: what a writer of the store or a second lifecycle could do.

Real Prefect API (the `prefect_api` harness), learners as real processes, a local store.
"""

import json
import os
import pathlib
import threading
import time
import uuid

import pytest

from infra import layout
from infra.lease import LeaseHeld, LeaseLost, RunLease, held_lease, this_process
from infra.spec import parse_spec
from infra.store import ObjectStore, run_store
from tests.corpora import corpus_folder


def tiny_spec(root: pathlib.Path, name: str = "sec"):
    corpus = corpus_folder(root)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 300)
    return parse_spec({
        "name": name,
        "islands": [{"name": island, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2}
                    for island in ("a", "b")],
        "model": {"layers": 2, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.2}]},
        "sync": {"mode": "butterfly", "rounds": 2, "warmup_steps": 1, "partner_timeout_s": 60},
        "store": {"url": str(root / "store")},
    })


def result_files(spec) -> dict[pathlib.Path, object]:
    """Every file Prefect keeps under <store>/prefect-results, parsed as plain JSON."""
    folder = pathlib.Path(spec.store.url) / "prefect-results"
    return {path: json.loads(path.read_bytes()) for path in sorted(folder.rglob("*")) if path.is_file()}


def stage_records(spec) -> dict[pathlib.Path, dict]:
    """The whole records (metadata and result) among them: one per stage run."""
    return {path: r for path, r in result_files(spec).items() if isinstance(r, dict) and "metadata" in r}


def resume(spec, run_id):
    from flows.lifecycle import run_lifecycle, stage_states

    state = run_lifecycle(spec, run_id, return_state=True)
    return state.result(), stage_states(state.state_details.flow_run_id)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, prefect_api):
    """One small lifecycle, run to the end: (spec, run id, report, the lifecycle's flow run id)."""
    from flows.lifecycle import run_lifecycle
    from tasks.setup import new_run_id

    spec = tiny_spec(tmp_path_factory.mktemp("results"))
    run_id = new_run_id(spec)
    state = run_lifecycle(spec, run_id, return_state=True)
    return spec, run_id, state.result(), state.state_details.flow_run_id


def test_every_result_record_in_the_store_is_plain_json(finished_run):
    """Every file under <store>/prefect-results is JSON: each stage's record names the plain JSON
    serializer (never cloudpickle, never Prefect's class-building JSON decoder), and the flow's
    own result, a bare file whose metadata the API keeps, is the report, recorded as plain JSON."""
    from prefect.client.orchestration import get_client

    spec, run_id, report, flow_run_id = finished_run
    found, stages = result_files(spec), stage_records(spec)
    assert len(stages) == 10  # every stage and each learner
    for path, record in stages.items():
        assert record["metadata"]["serializer"] == {
            "type": "json", "jsonlib": "json", "object_encoder": "prefect.serializers.prefect_json_object_encoder",
            "object_decoder": None, "dumps_kwargs": {}, "loads_kwargs": {}}, path
        json.loads(record["result"])
    assert [r for path, r in found.items() if path not in stages] == [report]
    with get_client(sync_client=True) as client:
        flow_state = client.read_flow_run(flow_run_id).state
    assert flow_state.data.serializer.model_dump(mode="json") == record["metadata"]["serializer"]
    assert flow_state.result() == report  # read back through the API's metadata and the store's block


class _TouchOnUnpickle:
    """Unpickling this object creates a file: the stand-in for arbitrary code."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def pickle_record(marker: pathlib.Path) -> bytes:
    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
    from prefect.serializers import PickleSerializer

    return ResultRecord(metadata=ResultRecordMetadata(storage_key=None, serializer=PickleSerializer()),
                        result=_TouchOnUnpickle(marker)).serialize()


def test_a_planted_pickle_record_is_refused_and_its_stage_recomputed(finished_run, tmp_path):
    """An attacker with write access to the store replaces the result record of `start-run`
    (its key is computable from the stage's inputs and source) with a cloudpickle record whose
    unpickling runs code. The resume refuses the record, runs `start-run` again and overwrites the
    record with plain JSON; nothing is unpickled and every other stage is still reused."""
    from prefect._internal.result_records import ResultRecord

    from tasks.results import LocalJsonResults, UntrustedResultRecord

    spec, run_id, report, _ = finished_run
    # The planted record is a live exploit for Prefect's own decoding...
    probe = tmp_path / "probe"
    ResultRecord.deserialize(pickle_record(probe))
    assert probe.exists()
    # ...planted under the exact key `start-run` looks up: the record whose result is the run id.
    target = next(path for path, record in stage_records(spec).items() if json.loads(record["result"]) == run_id)
    marker = tmp_path / "code-ran"
    target.unlink()
    target.write_bytes(pickle_record(marker))

    with pytest.raises(UntrustedResultRecord, match=r"names serializer .*'pickle'.*refused"):
        LocalJsonResults(basepath=str(target.parent)).read_path(target.name)
    resumed, states = resume(spec, run_id)

    assert not marker.exists()
    assert states.pop("start-run") == "Completed"
    assert set(states.values()) == {"Cached"} and len(states) == 9  # 7 other stages and 2 learners
    assert resumed == report
    assert json.loads(target.read_bytes())["metadata"]["serializer"]["type"] == "json"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_result_storage_refuses_anything_but_plain_json_on_every_read_path(where, request, tmp_path, prefect_api):
    """The storage blocks themselves, local and S3, sync and async reads: a cloudpickle record, a
    record naming Prefect's class-building JSON decoder and bytes that are not JSON are refused
    without being decoded; a plain JSON record reads back."""
    import asyncio

    from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
    from prefect.serializers import JSONSerializer

    from infra.store_spec import StoreSpec
    from tasks.results import RESULT_SERIALIZER, UntrustedResultRecord, result_storage

    if where == "s3":
        request.getfixturevalue("s3_env")
    url = f"s3://archipelago/results-{uuid.uuid4().hex[:8]}" if where == "s3" else str(tmp_path / "store")
    block = result_storage(StoreSpec(url=url))
    marker = tmp_path / "code-ran"
    planted = {
        "pickle": pickle_record(marker),
        "class-building JSON": ResultRecord(metadata=ResultRecordMetadata(storage_key=None, serializer=JSONSerializer()),
                                            result={"x": 1}).serialize(),
        "not JSON": b"\x80\x04 not json",
    }
    for name, content in planted.items():
        block.write_path(name.replace(" ", "-"), content)
        with pytest.raises(UntrustedResultRecord, match="refused"):
            block.read_path(name.replace(" ", "-"))
        with pytest.raises(UntrustedResultRecord, match="refused"):
            asyncio.run(block.aread_path(name.replace(" ", "-")))
    assert not marker.exists()
    honest = ResultRecord(metadata=ResultRecordMetadata(storage_key=None, serializer=RESULT_SERIALIZER),
                          result={"x": 1}).serialize()
    block.write_path("honest", honest)
    assert block.read_path("honest") == honest


def test_a_second_lifecycle_is_refused_while_the_run_is_held_and_accepted_once_the_holder_expired(
        finished_run, capsys):
    """`archipelago resume` of a run another lifecycle is driving: refused, naming that lifecycle
    (host, pid, flow run, since, expiry). A holder that died stops renewing: once its lease has
    expired, the same resume is accepted."""
    from flows.cli import main

    spec, run_id, _, _ = finished_run
    store = run_store(spec.store, run_id)
    command = ["resume", run_id, "--store", spec.store.url]

    RunLease.acquire(store, run_id, this_process(**{"flow run": "dead-one"}), ttl_s=0.5)
    time.sleep(0.6)  # it never renews nor releases: its process is gone
    assert main(command) == 0
    assert "reused from an earlier attempt" in capsys.readouterr().out

    holder = RunLease.acquire(store, run_id, this_process(**{"flow run": "live-one"}))
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"run {run_id} is being driven by another lifecycle" in err
    assert "flow run live-one" in err and f"pid {os.getpid()}" in err
    assert "since " in err and "expires at " in err
    holder.release()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_concurrent_claims_of_a_free_run_have_exactly_one_winner(where, request, tmp_path):
    """Eight lifecycles take the same free run at the same instant: the claim object is created at
    most once (a hard link, or an S3 PUT with If-None-Match), so one holds the lease and the other
    seven are refused, each naming the winner."""
    if where == "s3":
        request.getfixturevalue("s3_env")
    root = f"s3://archipelago/race-{uuid.uuid4().hex[:8]}" if where == "s3" else str(tmp_path)
    store = ObjectStore(root).child("runs/race")
    outcomes = []

    def claim(n):
        try:
            outcomes.append(RunLease.acquire(store, "race", {"claimant": str(n)}))
        except LeaseHeld as err:
            outcomes.append(err)

    all_at_once(claim, 8)
    winners = [o for o in outcomes if isinstance(o, RunLease)]
    assert len(winners) == 1 and winners[0].term == 0
    winner = store.get_json("lease/000000/claim.json")["holder"]["claimant"]
    assert all(f"claimant {winner}" in str(o) for o in outcomes if isinstance(o, LeaseHeld))


def test_renewals_keep_a_lease_alive_past_its_lifetime_and_a_taken_lease_is_lost(tmp_path):
    """A holder whose renewals land keeps the run past the first expiry; a holder that stalls
    past its expiry finds the run taken over when it next renews."""
    store = ObjectStore(str(tmp_path)).child("runs/renewed")
    with held_lease(store, "renewed", {"who": "first"}, ttl_s=0.6, renew_every_s=0.1):
        time.sleep(1.0)
        with pytest.raises(LeaseHeld, match="who first"):
            RunLease.acquire(store, "renewed", {"who": "second"})
    assert store.exists("lease/000000/released.json")

    stalled = RunLease.acquire(store, "renewed", {"who": "stalled"}, ttl_s=0.2)
    time.sleep(0.3)
    RunLease.acquire(store, "renewed", {"who": "taker"})
    with pytest.raises(LeaseLost, match="taken by .*taker"):
        stalled.renew()


def test_a_run_started_as_a_flow_run_is_named_by_its_flow_run_id(prefect_api, tmp_path):
    """Run ids of runs started from the UI do not repeat: `<spec name>-<flow run id>` (a random
    UUID that the flow run keeps through a Retry), where a two-word flow run name repeated in
    about 1 run in 100 and handed the new run an old run's results. Here the run stops at its
    island segments (no deployments exist), after the run id has named the run's folder."""
    from flows.deployments import archipelago
    from tasks.setup import flow_run_run_id, new_run_id

    spec = tiny_spec(tmp_path, name="ui")
    state = archipelago(spec, return_state=True)

    assert state.is_failed()
    flow_run_id = state.state_details.flow_run_id
    assert {key.split("/")[1] for key in ObjectStore(spec.store.url).list("runs")} == {f"ui-{flow_run_id.hex}"}
    assert run_store(spec.store, f"ui-{flow_run_id.hex}").exists(layout.SPEC)
    assert flow_run_run_id(spec, flow_run_id) == f"ui-{flow_run_id.hex}" != flow_run_run_id(spec, uuid.uuid4())
    assert len(new_run_id(spec).rsplit("-", 1)[1]) == 16  # 64 random bits


def test_flows_starting_together_all_save_their_result_storage(prefect_api, tmp_path):
    """Blocks of a type the API has never seen, saved by several threads at once (as islands'
    segments starting at one window start save their result storage): every save succeeds."""
    from tasks.results import LocalJsonResults, save_block

    fresh_type = type("FreshResults", (LocalJsonResults,), {"_block_type_name": f"Race {uuid.uuid4().hex[:8]}"})
    failures: list[BaseException] = []

    def save(n: int) -> None:
        try:
            save_block(fresh_type(basepath=str(tmp_path / str(n))), f"race-{n}")
        except BaseException as err:
            failures.append(err)

    all_at_once(save, 6)
    assert failures == []
    assert fresh_type.load("race-5").basepath == str(tmp_path / "5")


def all_at_once(call, n: int) -> None:
    """`call(0)` to `call(n - 1)`, each on its own thread, released together."""
    start = threading.Barrier(n)

    def released(k: int) -> None:
        start.wait()
        call(k)

    threads = [threading.Thread(target=released, args=(k,)) for k in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
