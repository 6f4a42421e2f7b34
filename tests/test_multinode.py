"""A learner across hosts: node 0 publishes its rendezvous address for each life, the other nodes
check it and join it, and a learner whose node dies restarts as a whole. The drill makes each node
a network namespace joined to the other by a veth pair; the rest checks the rendezvous records,
a node that fails at its start, the node launcher srun starts on each node (two local processes on
loopback) and how a node shares its host's cores."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import time

import pytest

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.netns import Sampling, remove_namespaces, run_checked
from infra import layout
from infra.authority import Authority, Signer
from infra.launch import (GUARDED, NODE_LAUNCHER_MODULE, PARENT_PID, SLURM_NODE_ID, LearnerProcess, slurm_node_rank,
                          threads_per_process)
from infra.rendezvous import (Endpoint, RendezvousRejected, RendezvousTimeout, announced, announcement,
                              await_endpoint, checked_endpoint, publish)
from infra.spec import RunSpec, parse_spec, spec_sha256
from infra.store import ObjectStore
from infra.stores import RunStores
from infra.supervision import LearnerFailed
from training.data.shards import prepare_dataset
from training.learner.ledger import finished, read_summary
from training.learner.state import Lives
from training.stages import new_run_id, start_run, train_learner, train_learners
from training.node import main as start_node
from tests.corpora import corpus_folder

FABRIC = "fab0"  # the island's network interface: one name on every node, as on a real cluster
ADDRESSES = ("10.77.9.1", "10.77.9.2")  # only inside the test's own namespaces, which have no other routes


def test_a_rendezvous_address_is_an_ip_address_and_a_port():
    assert checked_endpoint("10.77.9.1", 29400) == Endpoint("10.77.9.1", 29400)
    assert str(checked_endpoint("fd00::1", 80)) == "[fd00::1]:80"
    for address, port, why in [("node0.example", 1, "not an IP"), ("0.0.0.0", 1, "not one address"),
                               ("224.0.0.1", 1, "not one address"), ("10.77.9.01", 1, "not an IP"),
                               ("10.77.9.1", 0, "not a TCP port"), ("10.77.9.1", 65536, "not a TCP port"),
                               ("10.77.9.1", "80", "not a TCP port"), ("10.77.9.1", True, "not a TCP port"),
                               (["10.77.9.1"], 1, "not an IP")]:
        with pytest.raises(RendezvousRejected, match=why):
            checked_endpoint(address, port)
    assert announced(announcement(Endpoint("10.77.9.1", 41000))) == Endpoint("10.77.9.1", 41000)
    with pytest.raises(RendezvousRejected, match="not a rendezvous announcement"):
        announced("archipelago-rendezvous 10.77.9.1 41000; rm -rf /")


def test_node_zero_publishes_once_per_life_and_the_others_join_the_one_that_answers(tmp_path):
    store = ObjectStore(str(tmp_path / "store")).child("runs/r")
    with socket.create_server(("127.0.0.1", 0)) as listening:
        live = Endpoint("127.0.0.1", listening.getsockname()[1])
        with socket.create_server(("127.0.0.1", 0)) as closed:
            dead = Endpoint("127.0.0.1", closed.getsockname()[1])
        # A start of life 2 published, then died before its learner recorded the life.
        assert publish(store, 3, 2, dead) == 2
        assert publish(store, 3, 2, live) == 3  # the next start: the next free number, life 2's record untouched
        assert store.get_json(layout.rendezvous(3, 2))["port"] == dead.port
        assert await_endpoint(store, 3, 2, timeout_s=10) == (3, live)
        assert await_endpoint(store, 3, 0, timeout_s=10) == (3, live)  # the newest, not an older life's
    with pytest.raises(RendezvousTimeout, match=r"learner 3: .* life 4 or later within 1 s .*rendezvous-004"):
        await_endpoint(store, 3, 4, timeout_s=1)
    with pytest.raises(RendezvousTimeout, match="before it ended"):
        await_endpoint(store, 3, 4, timeout_s=60, give_up=lambda: True)


def test_a_record_that_is_no_rendezvous_of_its_key_is_passed_over(tmp_path):
    store = ObjectStore(str(tmp_path / "store")).child("runs/r")
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        store.put_json(layout.rendezvous(0, 0), {"learner": 0, "life": 0, "address": "127.0.0.1", "port": port})
        store.put_json(layout.rendezvous(0, 1), {"learner": 0, "life": 0, "address": "127.0.0.1", "port": port})
        store.put_json(layout.rendezvous(0, 2), {"learner": 0, "life": 2, "address": "localhost", "port": port})
        store.put_json(f"{layout.liveness_prefix(0)}/rendezvous-latest.json", {"port": port})  # no life's key
        assert await_endpoint(store, 0, 0, timeout_s=5) == (0, Endpoint("127.0.0.1", port))
    assert store.stats["refused"] == {"rendezvous": 2}


def test_a_rendezvous_signed_by_another_island_is_passed_over(tmp_path):
    """Learner 0 is island a's: a record of its rendezvous that island b signed names no address to join."""
    keys = {island: Ed25519PrivateKey.generate() for island in ("a", "b")}
    public = {island: key.public_key() for island, key in keys.items()}

    def store_of(writer: str | None) -> ObjectStore:
        signer = Signer(writer, keys[writer]) if writer else None
        return ObjectStore(str(tmp_path / "store"), authority=Authority(public, ("a", "b"), signer)).child("runs/r")

    reader = store_of(None)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        endpoint = Endpoint("127.0.0.1", listening.getsockname()[1])
        assert publish(store_of("b"), 0, 0, endpoint) == 0  # island b signs what only island a may write
        with pytest.raises(RendezvousTimeout):
            await_endpoint(reader, 0, 0, timeout_s=0.5)
        assert reader.stats["refused"] == {"rendezvous": 1}
        assert publish(store_of("a"), 0, 0, endpoint) == 1
        assert await_endpoint(reader, 0, 0, timeout_s=5) == (1, endpoint)


def test_each_node_runs_torchrun_with_its_rank_and_processes():
    common = dict(spec_sha256="0" * 64, nodes=2, interface=FABRIC)
    first = LearnerProcess(0, 4, 1, **common).command("/s", None, "r")
    other = LearnerProcess(0, 4, 1, **common, node=1, rendezvous="10.77.9.1:41000").command("/s", None, "r")
    assert "--nnodes=2" in first and "--nproc-per-node=4" in first and f"--rdzv-conf=rank=0,interface={FABRIC}" in first
    assert "--rdzv-endpoint=127.0.0.1:0" in first  # node 0 binds on its interface's address, not this
    assert f"--rdzv-conf=rank=1,interface={FABRIC}" in other and "--rdzv-endpoint=10.77.9.1:41000" in other
    with pytest.raises(ValueError, match="need the network interface"):
        LearnerProcess(0, 1, 1, spec_sha256="0" * 64, nodes=2)
    with pytest.raises(ValueError, match="every other node joins node 0's"):
        LearnerProcess(0, 1, 1, **common, node=1)
    with pytest.raises(ValueError, match="node 2 is not one of its 2 nodes"):
        LearnerProcess(0, 1, 1, **common, node=2, rendezvous="10.77.9.1:41000")


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair named FABRIC at each end, and nothing else; torn down after."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ss") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, ss)")
    tag = secrets.token_hex(3)
    namespaces = [f"arch-{tag}-node{k}" for k in range(2)]
    made = subprocess.run(["ip", "netns", "add", namespaces[0]], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
    try:
        run_checked(["ip", "netns", "add", namespaces[1]])
        run_checked(["ip", "link", "add", FABRIC, "netns", namespaces[0], "type", "veth",
                     "peer", "name", FABRIC, "netns", namespaces[1]])
        for namespace, address in zip(namespaces, ADDRESSES):
            run_checked(["ip", "-n", namespace, "addr", "add", f"{address}/30", "dev", FABRIC])
            run_checked(["ip", "-n", namespace, "link", "set", FABRIC, "up"])
            # Loopback up: a socket bound to it would work, and so would show in the check.
            run_checked(["ip", "-n", namespace, "link", "set", "lo", "up"])
        yield namespaces
    finally:
        remove_namespaces(namespaces)


class Listening(Sampling):
    """Every listening socket's local address in each namespace, sampled with `ss` while the learners run."""

    def __init__(self, namespaces: list[str]):
        super().__init__(every_s=0.3)
        self.namespaces = namespaces
        self.seen: dict[str, set[tuple[str, int]]] = {namespace: set() for namespace in namespaces}

    def sample(self) -> None:
        for namespace in self.namespaces:
            rows = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-H", "-l", "-n", "-t", "-u"],
                                  capture_output=True, text=True).stdout.splitlines()
            for row in rows:  # Netid State Recv-Q Send-Q Local:Port Peer:Port
                host, _, port = row.split()[4].rpartition(":")
                self.seen[namespace].add((host.strip("[]").split("%")[0], int(port)))


@pytest.mark.integration
def test_a_learner_on_two_nodes_trains_with_another_island_and_restarts_whole_when_a_node_dies(tmp_path, two_hosts):
    corpus = corpus_folder(tmp_path)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} about islands and nodes " * 200)
    spec = parse_spec({
        "name": "nodes",
        "islands": [
            {"name": "spanning", "learners": 1, "batch_size": 4, "seq_len": 32, "inner_steps": 4,
             "processes_per_learner": 2, "nodes_per_learner": 2, "network_interface": FABRIC},
            {"name": "single", "learners": 1, "batch_size": 4, "seq_len": 32, "inner_steps": 4},
        ],
        "model": {"layers": 1, "width": 32, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.2}]},
        "training": {"warmup_steps": 1},
        "sync": {"rounds": 4, "partner_timeout_s": 60},
        # Node 0's process (rank 0) dies mid-round 2; node 1 is left to notice by itself.
        "faults": [{"kind": "kill_learner", "learner": 0, "round": 2}],
        "store": {"url": str(tmp_path / "store")},
    })
    run_id = new_run_id(spec)
    store = start_run(spec, run_id)
    prepare_dataset(spec, store)
    lines, restarts = [], []
    with Listening(two_hosts) as listening:
        results = train_learners(spec, run_id, lines.append, restarts=2,
                                 on_restart=lambda learner, reason: restarts.append((learner, reason)),
                                 node_wrappers={"spanning": [("ip", "netns", "exec", ns) for ns in two_hosts]})
    assert all(result["finished"] for result in results), lines[-30:]

    # Node 0's death ended node 1 too (its collective failed): the learner restarted once, as a whole.
    assert restarts == [(0, "learner 0: nodes 0, 1 of 2 failed")], restarts
    lives = Lives(lambda i: store, spec.sync.rounds).of(0)
    assert [life["resumed_from"] for life in lives] == [None, {"learner": 0, "round": 1}]

    # One rendezvous record per life, each written once: what node 0 announced, on its fabric address.
    published = [re.search(r"life (\d+) at (\S+)", line).groups() for line in lines
                 if "node 0 published its rendezvous" in line]
    keys = [key for key in store.list(layout.liveness_prefix(0)) if "/rendezvous-" in key]
    assert keys == [layout.rendezvous(0, 0), layout.rendezvous(0, 1)]
    assert published == [(str(n), f"{ADDRESSES[0]}:{store.get_json(layout.rendezvous(0, n))['port']}")
                         for n in (0, 1)]
    assert sum("joins the rendezvous" in line for line in lines) == 2

    # Both learners exchanged across islands in every round, the restart's replay included.
    for learner in (0, 1):
        summary = read_summary(store, spec, learner)
        assert summary.bytes_read_inter > 0 and not summary.missed_exchanges, summary.missed_exchanges

    # Nothing listened anywhere but on each node's fabric address: not on loopback, not on every interface.
    for namespace, address in zip(two_hosts, ADDRESSES):
        hosts = {host for host, _ in listening.seen[namespace]}
        assert hosts == {address}, (namespace, listening.seen[namespace])
    assert len(listening.seen[two_hosts[0]]) >= 2  # node 0: the rendezvous store and gloo's listener


def loopback_learner(tmp_path, **island) -> RunSpec:
    """A run of one learner on 2 nodes, 1 process each, whose nodes meet on loopback: two local
    processes stand in for two hosts."""
    corpus = corpus_folder(tmp_path)
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i} about nodes on one host " * 100)
    return parse_spec({
        "name": "loopback",
        "islands": [{"name": "spanning", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2,
                     "processes_per_learner": 2, "nodes_per_learner": 2, "network_interface": "lo", **island}],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.25}]},
        "training": {"warmup_steps": 1},
        "sync": {"rounds": 1},
        "store": {"url": str(tmp_path / "store")},
    })


@pytest.mark.integration
def test_a_node_that_fails_at_its_start_ends_its_learner_at_once(tmp_path):
    """Node 1's learner process exits before it joins, while node 0's torchrun waits at its rendezvous
    (for up to RENDEZVOUS_TIMEOUT_S): the launcher ends node 0 at once, and the learner fails whole."""
    spec = loopback_learner(tmp_path)
    run_id = new_run_id(spec)
    start_run(spec, run_id)
    # Runs the rendezvous check as given; refuses the node's torchrun, as a host that cannot start it would.
    failing_host = ("sh", "-c", 'case " $* " in *" torch.distributed.run "*) echo "node 1: no torchrun here"; '
                                'exit 3;; esac; exec "$@"', "failing-host")
    lines = []
    started = time.monotonic()
    with pytest.raises(LearnerFailed, match="learner 0: nodes 0, 1 of 2 failed") as failure:
        train_learner(spec, run_id, 0, lines.append, node_wrappers=[(), failing_host])
    elapsed = time.monotonic() - started
    assert any("node 0 published its rendezvous of life 0" in line for line in lines), lines
    assert "learner 0 node 1 failed (exit status 3)" in str(failure.value)
    assert "node 1: no torchrun here" in str(failure.value)
    assert elapsed < 60, f"the learner took {elapsed:.0f} s to end after its node 1 failed"


@pytest.mark.integration
def test_the_node_launcher_takes_its_node_rank_from_slurm(tmp_path, monkeypatch):
    """What srun starts on each node of a learner (one task per node): two of them, told their node by
    SLURM_NODEID, form the learner and train it; one told a node the learner does not have refuses."""
    spec = loopback_learner(tmp_path)
    run_id = new_run_id(spec)
    store = start_run(spec, run_id)
    prepare_dataset(spec, store)
    command = [*GUARDED, NODE_LAUNCHER_MODULE, "--store", spec.store.url, "--run-id", run_id,
               "--spec-sha256", spec_sha256(spec), "--learner", "0"]

    monkeypatch.setenv(SLURM_NODE_ID, "2")
    with pytest.raises(SystemExit, match=re.escape(
            "learner 0 of island spanning: SLURM_NODEID 2 is not one of the learner's 2 nodes (0 to 1)")):
        start_node(command[len(GUARDED) + 1:])

    def node_launcher(node_id: str) -> subprocess.Popen:
        env = {**os.environ, SLURM_NODE_ID: node_id, PARENT_PID: str(os.getpid())}
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    launchers = [node_launcher("1"), node_launcher("0")]
    try:
        outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert "learner 0: node 1 joins the rendezvous of life 0 at 127.0.0.1:" in outputs[0], outputs[0]
    assert "learner 0: node 0 published its rendezvous of life 0 at 127.0.0.1:" in outputs[1], outputs[1]
    assert finished(RunStores(spec, store), spec, 0)


def test_a_node_rank_from_slurm_is_a_node_of_the_learner(monkeypatch):
    monkeypatch.setenv(SLURM_NODE_ID, "3")
    assert slurm_node_rank(4) == 3
    for value, problem in [("4", "SLURM_NODEID 4 is not one of the learner's 4 nodes (0 to 3)"),
                           ("-1", "SLURM_NODEID '-1' is not a node number"), ("", "'' is not a node number"),
                           ("1 ", "'1 ' is not a node number"), ("\u0662", "is not a node number")]:
        monkeypatch.setenv(SLURM_NODE_ID, value)
        with pytest.raises(ValueError, match=re.escape(problem)):
            slurm_node_rank(4)
    monkeypatch.delenv(SLURM_NODE_ID)
    with pytest.raises(ValueError, match="SLURM_NODEID is not set"):
        slurm_node_rank(4)


def test_a_learner_process_shares_only_its_own_hosts_cores(monkeypatch, tmp_path):
    """On each host run 4 learner processes: 2 of the spanning learner's 4 (its node's) and the other
    island's 2 learners of 1 process."""
    raw = loopback_learner(tmp_path, processes_per_learner=4, batch_size=4).model_dump(mode="json")
    raw["islands"].append({"name": "single", "learners": 2, "batch_size": 2, "seq_len": 16, "inner_steps": 2})
    spec = parse_spec(raw)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert threads_per_process(spec) == 4
