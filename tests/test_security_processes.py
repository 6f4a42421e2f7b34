"""Learner processes die with their launcher and listen on loopback only; a corrupt final
checkpoint or a damaged derived model does not fail its stage on every retry."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from training.model.registry import load_model
from infra import layout
from infra.launch import LearnerProcess
from infra.lease import LeaseLost, held_lease
from infra.spec import parse_spec, spec_sha256
from infra.store import IntegrityError, ObjectStore
from infra.supervision import LearnersStopped, run_learner, stop_learners
from tasks.training import learner_relay
from training.baseline import train_baseline
from training.consolidate import consolidate
from training.data.shards import prepare_dataset
from training.model.registry import build_model
from training.model.params import flat_parameters
from training.exchange.mixing import weighted_mean
from tests.corpora import corpus_folder

REPO = Path(__file__).resolve().parents[1]


def endless_learner_run(tmp_path: Path, processes: int, learners: int = 1,
                        run_id: str = "r") -> tuple[str, ObjectStore]:
    """A prepared run with more rounds than a test waits for; learner 0 has `processes` processes
    and, with a second learner that never starts, waits minutes for its partner in round 0.
    Returns the store's URL, which every process of learner 0 carries as `--store URL`, and the run's store."""
    corpus = corpus_folder(tmp_path)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 400)
    spec = parse_spec({
        "name": "processes",
        "islands": [{"name": "a", "learners": learners, "batch_size": 2, "seq_len": 16, "inner_steps": 2,
                     "processes_per_learner": processes}],
        "model": {"layers": 2, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.2}]},
        "training": {"warmup_steps": 1},
        "sync": {"rounds": 100_000, "partner_timeout_s": 300},
        "store": {"url": str(tmp_path / "store")},
    })
    store = ObjectStore(spec.store.url).child(f"runs/{run_id}")
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, store)
    return spec.store.url, store


def learner_pids(store_url: str) -> list[int]:
    """Live processes started with `--store store_url` (a zombie's command line reads empty)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if any(a == b"--store" and b == store_url.encode() for a, b in zip(argv, argv[1:])):
            pids.append(int(entry))
    return pids


def left_after(store_url: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (pids := learner_pids(store_url)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def listening_addresses(pids: list[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds open."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                host, port = local.split(":")
                raw = bytes.fromhex(host)  # 32-bit words in host (little-endian) order
                address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found.append((address, int(port, 16)))
    return found


def is_loopback(address) -> bool:
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


class StopLearner(Exception):
    pass


@pytest.mark.parametrize("processes", [1, 2])
def test_a_learner_dies_with_its_killed_launcher(tmp_path, processes):
    """Attack: SIGKILL the process that launched a learner (a crashed or killed flow/worker runs no
    cleanup) while the learner waits, silent, for its partner; before, the learner (and torchrun's
    workers) lived on beside the copy the retry starts."""
    store_url, store = endless_learner_run(tmp_path, processes, learners=2)
    expected = 1 if processes == 1 else 1 + processes  # torchrun and its workers
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from infra.launch import LearnerProcess; from infra.supervision import run_learner; "
         f"run_learner(LearnerProcess(0, {processes}, 1, spec_sha256=sys.argv[2]), sys.argv[1], None, 'r', print)",
         store_url, spec_sha256(store.get_json(layout.SPEC))], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (store.list(layout.learner_prefix(0)) and len(learner_pids(store_url)) == expected):
            assert launcher.poll() is None and time.monotonic() < deadline, "the learner never started training"
            time.sleep(0.2)
    finally:
        launcher.kill()
        launcher.wait()
    assert left_after(store_url, 5.0) == []


def test_a_relay_error_ends_the_learners_process_group(tmp_path):
    """Bad input: the relay of a torchrun learner's output fails; before, run_learner raised and
    left the learner running for Prefect's retry to start a second copy beside."""
    store_url, store = endless_learner_run(tmp_path, 2)
    started = []

    def broken_relay(line: str) -> None:
        if '"event": "round"' in line:
            started.extend(learner_pids(store_url))
            raise StopLearner

    with pytest.raises(StopLearner):
        run_learner(LearnerProcess(0, 2, 1, spec_sha256=spec_sha256(store.get_json(layout.SPEC))), store_url, None, "r",
                    broken_relay)
    assert len(started) == 3
    assert left_after(store_url, 5.0) == []


def test_a_lease_that_cannot_be_renewed_stops_the_runs_learners_before_it_expires(tmp_path, monkeypatch):
    """Bad input: renewing the lease fails with an error that is no StoreError (a full disk, a
    refused write); before, the renewal thread died silently, the learners trained on past the
    lease's expiry beside whatever lifecycle took the run next, and a retry started them again."""
    store_url, store = endless_learner_run(tmp_path, processes=1, learners=2, run_id="fenced")
    failures: list[BaseException] = []

    def learner() -> None:
        try:
            run_learner(LearnerProcess(0, 1, 1, spec_sha256=spec_sha256(store.get_json(layout.SPEC))), store_url, None,
                        "fenced", print)
        except BaseException as err:  # noqa: BLE001 - examined below
            failures.append(err)

    running = threading.Thread(target=learner)
    running.start()
    deadline = time.monotonic() + 120
    while not (store.list(layout.learner_prefix(0)) and learner_pids(store_url)):
        assert running.is_alive() and time.monotonic() < deadline, "the learner never started training"
        time.sleep(0.2)
    stopped_at = []
    warnings = []

    def stop(reason: str) -> None:
        stop_learners("fenced", reason)
        stopped_at.append(datetime.now(timezone.utc))

    claim_only = store.put_json

    def refuse_renewals(key, value):  # as an expired token or a full disk would, once the lease is taken
        if "/renewal-" in key:
            raise PermissionError(13, "Permission denied", key)
        return claim_only(key, value)

    monkeypatch.setattr(store, "put_json", refuse_renewals)
    with pytest.raises(LeaseLost, match="could not be renewed .*PermissionError"):
        with held_lease(store, "fenced", {"who": "test"}, warn=lambda *a: warnings.append(a[0] % a[1:]),
                        ttl_s=4.0, renew_every_s=0.5, stop_margin_s=1.5, on_lost=stop) as lease:
            running.join(30)
    assert not running.is_alive() and learner_pids(store_url) == []
    assert stopped_at and stopped_at[0] < lease.expires_at, (stopped_at, lease.expires_at)
    assert len(warnings) >= 2 and "stopping the run's work" in warnings[-1]
    (failure,) = failures
    assert isinstance(failure, LearnersStopped) and "could not be renewed" in str(failure)
    with pytest.raises(LearnersStopped):  # a retry of the learner does not start a second copy
        run_learner(LearnerProcess(0, 1, 1, spec_sha256=spec_sha256(store.get_json(layout.SPEC))), store_url, None,
                    "fenced", print)


def test_a_torchrun_learner_listens_on_loopback_only(tmp_path):
    """Attack surface: torchrun's rendezvous store (unauthenticated) and gloo's sockets; before,
    `--standalone` bound the store to every interface."""
    store_url, store = endless_learner_run(tmp_path, 2)
    listening = []

    def inspect_then_stop(line: str) -> None:
        if '"event": "round"' in line:  # the group has met and trained a round
            listening.extend(listening_addresses(learner_pids(store_url)))
            raise StopLearner

    with pytest.raises(StopLearner):
        run_learner(LearnerProcess(0, 2, 1, spec_sha256=spec_sha256(store.get_json(layout.SPEC))), store_url, None, "r",
                    inspect_then_stop)
    assert len(listening) >= 3  # the rendezvous store and each rank's gloo listener
    assert [(str(a), port) for a, port in listening if not is_loopback(a)] == []


def test_the_relay_logs_lines_that_are_not_events_as_text(caplog):
    """Bad input: a learner prints JSON that is no event object (`5`, `[1]`, a string); before, the
    relay's `.get` on it raised AttributeError and took the learner down."""
    relay = learner_relay(logging.getLogger("relay"), progress=None)  # no line here updates progress
    lines = ["5", "[1]", '"x"', "null", '{"no": "event"}', "a warning"]
    with caplog.at_level(logging.INFO, logger="relay"):
        for line in lines:
            relay(line)
        relay('{"event": "done", "learner": 0}')
    assert [r.getMessage() for r in caplog.records] == [*lines, "{'event': 'done', 'learner': 0}"]


@pytest.fixture
def final_round(two_learner_run):
    """A one-round run of two learners, and each learner's final weights (distinct, model-shaped)."""
    spec, store = two_learner_run("derived", layers=1, inner_steps=1, rounds=1)
    base = flat_parameters(build_model(spec))
    return spec, store, [base, base + 0.01]


def test_consolidation_leaves_out_a_corrupt_final_checkpoint_and_names_it(final_round):
    """Bad input: learner 1's final checkpoint was damaged on upload (its bytes no longer match the
    recorded sha256); before, consolidation raised IntegrityError on every retry."""
    spec, store, weights = final_round
    store.commit_tensors(layout.checkpoint(0, 0), {"weights": weights[0]}, {})
    store.corrupt_next_write()
    store.commit_tensors(layout.checkpoint(1, 0), {"weights": weights[1]}, {})

    consensus = consolidate(spec, store)

    assert consensus["learners_with_corrupt_final_checkpoint"] == [1]
    assert consensus["learners_without_final_checkpoint"] == [] and list(consensus["per_learner"]) == ["0"]
    assert torch.equal(flat_parameters(load_model(spec, store, layout.CONSOLIDATED)[0]), weights[0])


def test_a_consolidated_model_damaged_on_write_is_committed_again_under_a_new_key(final_round):
    """Bad input: the store damages the consolidated model as it is written; before, consolidation
    succeeded and every evaluation failed on it, and a rerun of consolidation met ObjectExists."""
    spec, store, weights = final_round
    for learner in (0, 1):
        store.commit_tensors(layout.checkpoint(learner, 0), {"weights": weights[learner]}, {})
    store.corrupt_next_write()

    consolidate(spec, store)
    consolidate(spec, store)  # a rerun of the stage finds the rewrite and adds nothing

    with pytest.raises(IntegrityError, match="models/consolidated.safetensors"):
        store.read_committed(layout.CONSOLIDATED)  # the damaged object is still there, never overwritten
    expected = weighted_mean(weights, [slot.tokens_per_round() for slot in spec.learners])
    assert torch.equal(flat_parameters(load_model(spec, store, layout.CONSOLIDATED)[0]), expected)
    assert store.list("rewrites") == ["rewrites/1/models/consolidated.json",
                                      "rewrites/1/models/consolidated.safetensors"]


def test_a_baseline_damaged_on_write_is_committed_again_under_a_new_key(final_round):
    """Bad input: the store damages the baseline model as it is written (one round: the final
    model is the baseline's only write); before, every evaluation failed on it."""
    spec, store, _ = final_round
    store.corrupt_next_write()

    result = train_baseline(spec, store)

    with pytest.raises(IntegrityError, match="models/baseline.safetensors"):
        store.read_committed(layout.BASELINE)
    model, meta = load_model(spec, store, layout.BASELINE)
    assert meta["tokens"] == result["tokens"] > 0 and meta["steps"] == result["steps"]
    assert store.is_committed(layout.rewrite(layout.BASELINE, 1))


def test_the_relay_reports_a_burst_of_rounds_at_its_first_and_last_round_only(prefect_api, caplog):
    """Rounds under a second apart would each be a log line and a progress update sent to the Prefect
    API, across the link from a remote island: the relay reports at most every PROGRESS_EVERY_S, and
    always the last round, which the progress artifact shows at 100%."""
    from prefect import flow
    from prefect.artifacts import Artifact, create_progress_artifact

    @flow
    def relay_rounds() -> float:
        progress = create_progress_artifact(0.0, key="progress-relay-burst")
        relay = learner_relay(logging.getLogger("relay"), progress)
        for r in range(20):
            relay(json.dumps({"event": "round", "round": r, "rounds": 20, "loss": 1.0, "tokens_per_s": 10,
                              "eta_s": 1.0}))
        return Artifact.get("progress-relay-burst").data

    with caplog.at_level(logging.INFO, logger="relay"):
        shown = relay_rounds()
    rounds = [r.getMessage().split()[1] for r in caplog.records if r.name == "relay"]
    assert rounds == ["1/20", "20/20"] and shown == 100.0


def test_a_learner_inherits_neither_the_control_planes_api_string_nor_withheld_keys(tmp_path, monkeypatch):
    """A learner runs where store writers' data is mixed in: it gets its own island's keys and nothing
    that opens the Prefect API (whoever holds that string can run code on every worker) or a tracker."""
    store_url, store = endless_learner_run(tmp_path, processes=1, run_id="env")
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "archipelago:secret")
    monkeypatch.setenv("WANDB_API_KEY", "the-island-workers-tracker-key")
    monkeypatch.setenv("OTHER_ISLAND_SIGNING_KEY", "not-for-this-learner")
    monkeypatch.setenv("OWN_ISLAND_SIGNING_KEY", "for-this-learner")
    seen: list[dict] = []

    def inspect_then_stop(line: str) -> None:
        if '"event": "round"' in line:
            for pid in learner_pids(store_url):
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                seen.append(dict(item.decode().split("=", 1) for item in raw if b"=" in item))
            raise StopLearner

    with pytest.raises(StopLearner):
        run_learner(LearnerProcess(0, 1, 1, spec_sha256=spec_sha256(store.get_json(layout.SPEC))), store_url, None,
                    "env", inspect_then_stop, withheld_env=["OTHER_ISLAND_SIGNING_KEY"])
    assert seen and all("PREFECT_API_AUTH_STRING" not in env and "OTHER_ISLAND_SIGNING_KEY" not in env
                        and "WANDB_API_KEY" not in env
                        and env.get("OWN_ISLAND_SIGNING_KEY") == "for-this-learner" for env in seen)


def test_a_learner_of_a_lifecycle_that_lost_the_run_does_not_train_beside_the_next_ones(tmp_path):
    """The lifecycle that started a learner lost the lease and another took the run (term 1): a retry of
    the old lifecycle's learner task, started under term 0, exits at once instead of training twice."""
    from infra.supervision import LearnerFailed
    from infra.lease import SUPERSEDED, RunLease

    store_url, store = endless_learner_run(tmp_path, processes=1, run_id="fenced-term")
    RunLease.acquire(store, "fenced-term", {"who": "old lifecycle"}).release()
    RunLease.acquire(store, "fenced-term", {"who": "new lifecycle"})
    with pytest.raises(LearnerFailed, match=f"exit status {SUPERSEDED}") as failed:
        run_learner(LearnerProcess(0, 1, 1, spec_sha256=spec_sha256(store.get_json(layout.SPEC)), lease_term=0),
                    store_url, None, "fenced-term", print)
    assert "term 1 now holds the run" in str(failed.value)
