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
from infra.authority import CONTROL, generate_keypair
from infra.lease import LeaseHeld, LeaseLost, RunLease, held_lease, this_process
from infra.spec import parse_spec
from infra.store import ObjectStore, run_store
from tests.corpora import corpus_folder


def tiny_spec(root: pathlib.Path, name: str = "sec", signing: dict | None = None):
    """`signing`: each writer's (CONTROL, "a", "b") spec section, for a run with keys."""
    corpus = corpus_folder(root)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 300)
    return parse_spec({
        "name": name,
        "islands": [{"name": island, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2,
                     **({"signing": signing[island]} if signing else {})} for island in ("a", "b")],
        "model": {"layers": 2, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.2}]},
        "training": {"warmup_steps": 1},
        "sync": {"mode": "butterfly", "rounds": 2, "partner_timeout_s": 60},
        "store": {"url": str(root / "store")},
        **({"signing": signing[CONTROL]} if signing else {}),
    })


def result_files(spec) -> dict[pathlib.Path, object]:
    """Every file Prefect keeps under <store>/prefect-results, parsed as plain JSON."""
    folder = pathlib.Path(spec.store.url) / "prefect-results"
    return {path: json.loads(path.read_bytes()) for path in sorted(folder.rglob("*")) if path.is_file()}


def stage_records(spec) -> dict[pathlib.Path, dict]:
    """The whole records (metadata and result) among them: one per stage run."""
    return {path: r for path, r in result_files(spec).items() if isinstance(r, dict) and "metadata" in r}


def resume(spec, run_id):
    from flows.lifecycle import run_lifecycle

    state = run_lifecycle(spec, run_id, return_state=True)
    return state.result(), final_stage_states(state.state_details.flow_run_id, stages=10)


def final_stage_states(flow_run_id, stages: int) -> dict[str, str]:
    """`stage_states` once all `stages` task runs are recorded in a final state: the API records them
    from events, a moment after they ran (on a loaded machine one was seen missing)."""
    from flows.lifecycle import stage_states

    deadline = time.monotonic() + 30
    while True:
        states = stage_states(flow_run_id)
        if len(states) == stages and set(states.values()) <= {"Completed", "Cached", "Failed"} \
                or time.monotonic() > deadline:
            return states
        time.sleep(0.2)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, prefect_api):
    """One small lifecycle, run to the end: (spec, run id, report, the lifecycle's flow run id)."""
    from flows.lifecycle import run_lifecycle
    from training.stages import new_run_id

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
    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.serializers import PickleSerializer

    return ResultRecord(metadata=ResultRecordMetadata(storage_key=None, serializer=PickleSerializer()),
                        result=_TouchOnUnpickle(marker)).serialize()


def test_a_planted_pickle_record_is_refused_and_its_stage_recomputed(finished_run, tmp_path):
    """An attacker with write access to the store replaces the result record of `start-run`
    (its key is computable from the stage's inputs and source) with a cloudpickle record whose
    unpickling runs code. The resume refuses the record, runs `start-run` again and overwrites the
    record with plain JSON; nothing is unpickled and every other stage is still reused."""
    from prefect.results import ResultRecord

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

    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.serializers import JSONSerializer

    from infra.spec.store import StoreSpec
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


@pytest.fixture(scope="module")
def signing_keys():
    """A key pair for the control plane and each island, the private keys in this process's environment
    (as on a single host): each writer's spec section."""
    sections = {}
    with pytest.MonkeyPatch.context() as patch:
        for writer in (CONTROL, "a", "b"):
            private, public = generate_keypair()
            variable = f"TEST_RESULTS_KEY_{writer.upper()}"
            patch.setenv(variable, private)
            sections[writer] = {"public_key": public, "private_key_env": variable}
        yield sections


@pytest.fixture(scope="module")
def signed_finished_run(tmp_path_factory, prefect_api, signing_keys):
    """`finished_run` of a spec with keys."""
    from flows.lifecycle import run_lifecycle
    from training.stages import new_run_id

    spec = tiny_spec(tmp_path_factory.mktemp("signed-results"), name="signed", signing=signing_keys)
    run_id = new_run_id(spec)
    state = run_lifecycle(spec, run_id, return_state=True)
    return spec, run_id, state.result(), state.state_details.flow_run_id


def signed_records(spec, writer: str) -> dict[pathlib.Path, dict]:
    """Every record under <store>/prefect-results, verified as `writer` signed it and parsed."""
    from tasks.results import RecordSigning

    signing, folder = RecordSigning.of(spec, writer), pathlib.Path(spec.store.url) / "prefect-results"
    return {path: json.loads(signing.verified(str(path.relative_to(folder)), path.read_bytes()))
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_in_a_signed_run_every_result_record_is_signed_by_the_control_plane(signed_finished_run, monkeypatch):
    """Each stage's record and the flow's result are stored signed by the control plane, over their
    path and bytes, around the same plain JSON record as in a run without keys. The flow's result reads
    back through the API, whose copy of the storage block has the public key and the private key's
    variable name and nothing else: it verifies with the private key gone from the environment."""
    from prefect.client.orchestration import get_client

    spec, run_id, report, flow_run_id = signed_finished_run
    assert all(set(document) == {"record", "signature"} and document["signature"]["by"] == CONTROL
               for document in result_files(spec).values())
    records = signed_records(spec, CONTROL)
    stages = [record for record in records.values() if isinstance(record, dict) and "metadata" in record]
    assert len(stages) == 10 and all(record["metadata"]["serializer"]["type"] == "json" for record in stages)
    assert [record for record in records.values() if record not in stages] == [report]

    private_key = os.environ[spec.signing.private_key_env]
    monkeypatch.delenv(spec.signing.private_key_env)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).state.result() == report
        documents = json.dumps([d.data for d in client.read_block_documents(include_secrets=True)])
    assert spec.signing.private_key_env in documents and spec.signing.public_key in documents
    assert private_key not in documents


def test_a_forged_or_island_signed_record_is_refused_and_its_stage_recomputed(signed_finished_run):
    """Whoever can write the store plants plain JSON records under the keys two stages look up: an
    unsigned `evaluate` record with flattering bpb numbers, and a `start-run` record validly signed by
    island a's key, which may sign only a's own records. The resume refuses both (counted as refused
    stage results), runs both stages again and reports the numbers it computed."""
    from infra.store import refused_in_process
    from tasks.results import REFUSED_KIND, RecordSigning

    spec, run_id, report, _ = signed_finished_run
    records = signed_records(spec, CONTROL)
    results = {path: json.loads(record["result"]) for path, record in records.items() if "metadata" in record}
    evaluate = next(path for path, result in results.items()
                    if isinstance(result, dict) and result.get("text", {}).get("islands", {}).get("bpb")
                    == report["evals"]["text"]["islands_bpb"])
    forged = results[evaluate]
    forged["text"]["islands"]["bpb"] = 0.01
    evaluate.write_text(json.dumps({**records[evaluate], "result": json.dumps(forged)}))
    start_run = next(path for path, result in results.items() if result == run_id)
    forged_record = json.dumps({**records[start_run], "result": json.dumps("another-run")}).encode()
    start_run.write_bytes(RecordSigning.of(spec, "a").sign(start_run.name, forged_record))
    refused_before = refused_in_process().get(REFUSED_KIND, 0)

    resumed, states = resume(spec, run_id)

    assert (states.pop("evaluate"), states.pop("start-run")) == ("Completed", "Completed")
    assert set(states.values()) == {"Cached"} and len(states) == 8
    assert resumed == report and resumed["evals"]["text"]["islands_bpb"] != 0.01
    assert refused_in_process()[REFUSED_KIND] - refused_before == 2
    assert json.loads(signed_records(spec, CONTROL)[start_run]["result"]) == run_id  # rewritten, signed


def test_an_islands_segment_reads_back_only_records_its_island_signed(signed_finished_run):
    """Island a's segment (the flow its deployment runs, called here in this process) looks its learner
    up under the key the lifecycle's learner stage wrote: it refuses the control plane's record and runs
    the learner again (finished, it only checks so); the record it writes is signed by island a, and
    the next segment comes back Cached. (Last of the signed run's tests: a resume of the lifecycle would
    now refuse island a's record in turn.)"""
    from flows.deployments import segment
    from infra.store import refused_in_process
    from tasks.results import REFUSED_KIND, RecordSigning

    spec, run_id, _, _ = signed_finished_run
    refused_before = refused_in_process().get(REFUSED_KIND, 0)
    states = []
    for _ in range(2):
        state = segment(spec, run_id, "a", return_state=True)
        assert state.result()["finished"]
        states.append(final_stage_states(state.state_details.flow_run_id, stages=1))
    assert states == [{"train-a-learner-0": "Completed"}, {"train-a-learner-0": "Cached"}]
    assert refused_in_process()[REFUSED_KIND] - refused_before == 1  # the lifecycle's record of learner 0
    folder = pathlib.Path(spec.store.url) / "prefect-results"
    [by_a] = [path for path in folder.iterdir() if json.loads(path.read_bytes())["signature"]["by"] == "a"]
    record = json.loads(RecordSigning.of(spec, "a").verified(by_a.name, by_a.read_bytes()))
    assert json.loads(record["result"]) == {"learner": 0, "island": "a", "finished": True}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_each_writer_reads_back_only_the_records_it_signed(where, request, tmp_path, prefect_api, signing_keys):
    """The storage blocks of the control plane and of each island's segments, in one store: each has its
    own block document and reads back only records its own writer signed under the path read, on the
    sync and async read paths; a record moved to another path, or signed by another writer, is refused."""
    import asyncio

    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    from tasks.results import RESULT_SERIALIZER, RecordSigning, UntrustedResultRecord, result_storage

    if where == "s3":
        request.getfixturevalue("s3_env")
    spec = tiny_spec(tmp_path, signing=signing_keys)
    store = spec.store.model_copy(update={"url": f"s3://archipelago/signed-{uuid.uuid4().hex[:8]}"}) \
        if where == "s3" else spec.store
    blocks = {writer: result_storage(store, RecordSigning.of(spec, writer)) for writer in (CONTROL, "a", "b")}
    assert len({block._block_document_id for block in blocks.values()}) == 3
    record = ResultRecord(metadata=ResultRecordMetadata(storage_key=None, serializer=RESULT_SERIALIZER),
                          result={"bpb": 1.5}).serialize()
    for writer, block in blocks.items():
        block.write_path(f"by-{writer}", record)
    for reader, block in blocks.items():
        for writer in blocks:
            if writer == reader:
                assert block.read_path(f"by-{writer}") == asyncio.run(block.aread_path(f"by-{writer}")) == record
            else:
                with pytest.raises(UntrustedResultRecord, match=f"only records signed by {reader} are read back"):
                    block.read_path(f"by-{writer}")
                with pytest.raises(UntrustedResultRecord, match="signed by a writer that may not write it"):
                    asyncio.run(block.aread_path(f"by-{writer}"))
    storage = LocalFileSystem if where == "local" else RemoteFileSystem  # reads and writes bytes as they are
    storage.write_path(blocks["a"], "moved", storage.read_path(blocks["a"], "by-a", _sync=True), _sync=True)
    with pytest.raises(UntrustedResultRecord, match="its signature does not verify"):
        blocks["a"].read_path("moved")


def test_a_second_lifecycle_is_refused_while_the_run_is_held_and_accepted_once_the_holder_expired(
        finished_run, capsys):
    """`archipelago resume` of a run another lifecycle is driving: refused, naming that lifecycle
    (host, pid, flow run, since, expiry). A holder that died stops renewing: once its lease has
    expired, the same resume is accepted."""
    from flows.cli import main

    spec, run_id, _, _ = finished_run
    store = run_store(spec.store, run_id)
    command = ["resume", run_id, "--store", spec.store.url, "--unauthenticated"]  # a run without keys

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
    from tasks.setup import flow_run_run_id
    from training.stages import new_run_id

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
