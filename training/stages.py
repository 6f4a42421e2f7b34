"""A run's stages as plain functions, in the lifecycle's order. The Prefect tasks (`tasks/`) wrap
them and add logging, progress artifacts, retries and caching; the benchmarks call them directly.

start (`new_run_id`, `start_run`) -> data (`training.data.shards.prepare_dataset`) -> learners
(`train_learner`, or `train_learners` for all of them at once; `train_learner_node` for one node of
a learner that spans several) -> consolidation
(`training.consolidate.consolidate`) -> standard training (`training.baseline.train_baseline`) ->
evaluation (`eval.evaluate`) -> report (`eval.report`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from infra import layout
from infra.authority import foreign_signing_keys
from infra.launch import LearnerProcess, srun_wrapper, threads_per_process
from infra.rendezvous import RendezvousTimeout, announced, await_endpoint, publish
from infra.spec import RunSpec, spec_sha256
from infra.store import ObjectStore
from infra.stores import RunStores, check_stores_reachable, foreign_writer_credentials, open_run
from infra.supervision import LearnerFailed, LearnerNodes, LearnersStopped, run_learner
from training.data.corpora import data_root
from training.learner.ledger import finished
from training.learner.state import Lives
from training.model.registry import commit_initial_weights


def new_run_id(spec: RunSpec, label: str | None = None) -> str:
    """A fresh run id: the spec's name (and `label`, a benchmark's arm), a readable start time, and 64
    random bits so that two runs never share one (a shared id would hand the second run the first's results)."""
    return "-".join([spec.name, *([label] if label else []), time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(8)])


def start_run(spec: RunSpec, run_id: str) -> ObjectStore:
    """Check every store answers, and publish the spec the learners will read (and with `model.init_from`
    the weights they start from); returns the run's store."""
    check_stores_reachable(spec)
    store = open_run(spec, run_id)
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    if spec.model.init_from is not None:
        commit_initial_weights(spec, store, data_root(spec))
    return store


def train_learner(spec: RunSpec, run_id: str, learner: int, relay: Callable[[str], None],
                  until: datetime | None = None, lease_term: int | None = None,
                  node_wrappers: Sequence[tuple[str, ...]] = ()) -> dict:
    """One learner as its own OS process (a torchrun group if it has several), its output lines handed
    to `relay`. It resumes from the newest checkpoint it can trust; with `until` (the end of its
    island's capacity window) it stops cleanly before a round that would not finish in time.
    Raises `LearnerFailed` if it dies; `finished` says whether it trained every round.

    A learner on several nodes runs every node from this process, node k under `node_wrappers[k]` (a
    command prefix that execs it on that node's host or network namespace, e.g. `ip netns exec NS`;
    none: all on this host). Once a node fails, the others' processes are ended at once
    (`LearnerNodes`), and the learner fails when every node has ended, so it restarts as a whole.
    Under `pool.launcher: srun` (and no `node_wrappers`) one srun starts a task on each node, which
    starts that node with `train_learner_node` (training/node.py); srun ends them all once one fails."""
    island = spec.learners[learner].island
    nodes = island.nodes_per_learner
    if node_wrappers and len(node_wrappers) != nodes:
        raise ValueError(f"learner {learner}: {len(node_wrappers)} node wrappers for its {nodes} nodes")
    if island.pool.launcher == "srun" and not node_wrappers:
        train_learner_node(spec, run_id, learner, 0 if nodes == 1 else None, relay, until, lease_term,
                           srun_wrapper(island))
    elif nodes == 1:
        train_learner_node(spec, run_id, learner, 0, relay, until, lease_term, node_wrappers[0] if node_wrappers else ())
    else:
        wrappers = list(node_wrappers) or [()] * nodes
        learner_nodes = LearnerNodes()
        node_zero_ended = threading.Event()

        def node(k: int) -> None:
            try:
                train_learner_node(spec, run_id, learner, k, relay, until, lease_term, wrappers[k],
                                   give_up=lambda: node_zero_ended.is_set() or learner_nodes.failure is not None,
                                   nodes=learner_nodes)
            except BaseException:
                learner_nodes.fail(f"node {k} failed")
                raise
            finally:
                if k == 0:
                    node_zero_ended.set()

        with ThreadPoolExecutor(nodes) as pool:
            ended = [pool.submit(node, k) for k in range(nodes)]
        errors = [(k, f.exception()) for k, f in enumerate(ended) if f.exception() is not None]
        for _, error in errors:
            if not isinstance(error, LearnerFailed) or isinstance(error, LearnersStopped):
                raise error
        if errors:
            raise LearnerFailed(f"learner {learner}: node{'s' if len(errors) > 1 else ''} "
                                f"{', '.join(str(k) for k, _ in errors)} of {nodes} failed\n"
                                + "\n".join(str(error) for _, error in errors))
    return {"learner": learner, "island": island.name,
            "finished": finished(RunStores(spec, open_run(spec, run_id, writer=None)), spec, learner)}


def train_learner_node(spec: RunSpec, run_id: str, learner: int, node: int | None, relay: Callable[[str], None],
                       until: datetime | None = None, lease_term: int | None = None, wrapper: tuple[str, ...] = (),
                       give_up: Callable[[], bool] = lambda: False, nodes: LearnerNodes | None = None) -> None:
    """Node `node` of a learner, on the host (or under the `wrapper`) this is called for; node 0 of a
    learner on one node is the whole learner. Where an island's learners span hosts, each host's
    segment starts its own node with this. Node 0 publishes its rendezvous address for the life it
    starts in the island's store; every other node waits for it (`infra.rendezvous`; `give_up()`
    ends the wait early, once node 0 is known to have ended) and joins it. `node` None: every node,
    each the task that `wrapper` (srun) starts on its host, which calls this for its own node.
    `nodes`: the learner's nodes this process runs, which end this one once another fails."""
    island = spec.learners[learner].island

    def process(rendezvous: str | None = None) -> LearnerProcess:
        return LearnerProcess(
            learner, island.processes_per_node, threads_per_process(spec), until, wrapper,
            spec_sha256=spec_sha256(spec), lease_term=lease_term, nodes=island.nodes_per_learner, node=node,
            interface=island.network_interface if island.nodes_per_learner > 1 else None, rendezvous=rendezvous)

    launch = dict(store_url=spec.store.url, endpoint_url=spec.store.endpoint_url, run_id=run_id, on_line=relay,
                  credentials_env=spec.store.credentials_env,
                  withheld_env=foreign_signing_keys(spec, island.name) + foreign_writer_credentials(spec, island.name),
                  nodes=nodes)
    if island.nodes_per_learner == 1 or node is None:
        run_learner(process(), **launch)
        return
    # Node 0 signs its rendezvous records as its island, like its learner's lives; the others only read.
    stores = RunStores(spec, open_run(spec, run_id, writer=island.name if node == 0 else None), reader=island.name)
    life = len(Lives(stores.learner, spec.sync.rounds).of(learner))
    if node == 0:
        def publish_rendezvous(line: str) -> None:
            endpoint = announced(line)
            number = publish(stores.learner(learner), learner, life, endpoint)
            relay(f"learner {learner}: node 0 published its rendezvous of life {number} at {endpoint}")

        run_learner(process(), **launch, on_rendezvous=publish_rendezvous)
        return
    try:
        number, endpoint = await_endpoint(stores.learner(learner), learner, life, wrapper, give_up=give_up)
    except RendezvousTimeout as err:
        raise LearnerFailed(f"learner {learner} node {node}: {err}") from None
    relay(f"learner {learner}: node {node} joins the rendezvous of life {number} at {endpoint}")
    run_learner(process(str(endpoint)), **launch)


def train_learners(spec: RunSpec, run_id: str, relay: Callable[[str], None], restarts: int = 0,
                   on_restart: Callable[[int, str], None] = lambda learner, reason: None,
                   node_wrappers: Mapping[str, Sequence[tuple[str, ...]]] = {}) -> list[dict]:
    """Every learner of the run at once, each started again up to `restarts` times after it dies (as
    the lifecycle's task retries it); `on_restart(learner, reason)` hears of each restart.
    `node_wrappers[island]`: where each node of that island's learners starts (see `train_learner`)."""
    def train(learner: int) -> dict:
        wrappers = node_wrappers.get(spec.learners[learner].island.name, ())
        for _ in range(restarts):
            try:
                return train_learner(spec, run_id, learner, relay, node_wrappers=wrappers)
            except LearnerFailed as err:
                on_restart(learner, str(err).splitlines()[0])
                time.sleep(1)
        return train_learner(spec, run_id, learner, relay, node_wrappers=wrappers)

    with ThreadPoolExecutor(len(spec.learners)) as pool:
        return list(pool.map(train, [slot.index for slot in spec.learners]))
