"""A run's stages as plain functions, in the lifecycle's order. The Prefect tasks (`tasks/`) wrap
them and add logging, progress artifacts, retries and caching; the benchmarks call them directly.

start (`new_run_id`, `start_run`) -> data (`training.data.shards.prepare_dataset`) -> learners
(`train_learner`, or `train_learners` for all of them at once) -> consolidation
(`training.consolidate.consolidate`) -> standard training (`training.baseline.train_baseline`) ->
evaluation (`eval.evaluate`) -> report (`eval.report`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from infra import layout
from infra.authority import foreign_signing_keys
from infra.launch import LearnerFailed, LearnerProcess, run_learner, threads_per_process
from infra.spec import RunSpec, spec_sha256
from infra.store import ObjectStore
from infra.stores import RunStores, check_stores_reachable, foreign_writer_credentials, open_run
from training.data.corpora import data_root
from training.learner.ledger import finished
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
                  until: datetime | None = None, lease_term: int | None = None) -> dict:
    """One learner as its own OS process (a torchrun group if it has several), its output lines handed
    to `relay`. It resumes from the newest checkpoint it can trust; with `until` (the end of its
    island's capacity window) it stops cleanly before a round that would not finish in time.
    Raises `LearnerFailed` if it dies; `finished` says whether it trained every round."""
    island = spec.learners[learner].island
    run_learner(LearnerProcess(learner, island.processes_per_learner, threads_per_process(spec), until,
                               spec_sha256=spec_sha256(spec), lease_term=lease_term),
                spec.store.url, spec.store.endpoint_url, run_id, relay, spec.store.credentials_env,
                foreign_signing_keys(spec, island.name) + foreign_writer_credentials(spec, island.name))
    return {"learner": learner, "island": island.name,
            "finished": finished(RunStores(spec, open_run(spec, run_id, writer=None)), spec, learner)}


def train_learners(spec: RunSpec, run_id: str, relay: Callable[[str], None], restarts: int = 0,
                   on_restart: Callable[[int, str], None] = lambda learner, reason: None) -> list[dict]:
    """Every learner of the run at once, each started again up to `restarts` times after it dies (as
    the lifecycle's task retries it); `on_restart(learner, reason)` hears of each restart."""
    def train(learner: int) -> dict:
        for _ in range(restarts):
            try:
                return train_learner(spec, run_id, learner, relay)
            except LearnerFailed as err:
                on_restart(learner, str(err).splitlines()[0])
                time.sleep(1)
        return train_learner(spec, run_id, learner, relay)

    with ThreadPoolExecutor(len(spec.learners)) as pool:
        return list(pool.map(train, [slot.index for slot in spec.learners]))
