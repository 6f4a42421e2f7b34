"""Where a run's objects live: the run's store for the control plane, and one per island that has its own.

The run's store (`store` in the spec) holds what the control plane writes and reads: the spec, the
data manifest and held-out sets, fault markers, the consolidated and standard models, the report
and Prefect's results. An island with a store of its own (`islands[].store`: a bucket near its
accelerators, opened with its own credentials) holds its learners' shards, checkpoints, messages,
lives and summaries under the same run prefix; a partner on another island reads a message from
there, so only what partners read crosses the link. An island without one uses the run's store.
"""

from __future__ import annotations

from infra.authority import CONTROL, Authority
from infra.faults import StoreFaults
from infra.s3 import CREDENTIAL_VARIABLES
from infra.spec import RunSpec
from infra.store import ObjectStore, run_store


class RunStores:
    def __init__(self, spec: RunSpec, run: ObjectStore, faults: StoreFaults | None = None, reader: str | None = None):
        """`run`: the run's own prefix in the run's store; `faults` are injected on the islands' stores too.
        `reader`: the island of the learner that reads through these stores. Another island's store
        then gives up within `sync.partner_timeout_s` (its retry budget, and so its socket timeouts):
        a site that has gone away costs the reader exchanges, not its round."""
        self.spec, self.run, self.faults, self.reader = spec, run, faults, reader
        self._islands: dict[str, ObjectStore] = {}

    def island(self, name: str) -> ObjectStore:
        island = next(i for i in self.spec.islands if i.name == name)
        if island.store is None:
            return self.run
        if name not in self._islands:
            store_spec = island.store
            if self.reader is not None and name != self.reader:
                # Another island's store is only read, with its read-only key where it has one.
                store_spec = store_spec.model_copy(update={
                    "retry_budget_s": min(store_spec.retry_budget_s, self.spec.sync.partner_timeout_s),
                    "credentials_env": store_spec.read_credentials_env or store_spec.credentials_env})
            self._islands[name] = ObjectStore.from_spec(store_spec, self.faults, self.run.authority).child(self.run.prefix)
        return self._islands[name]

    def learner(self, index: int) -> ObjectStore:
        """The store holding learner `index`'s objects: its island's."""
        return self.island(self.spec.learners[index].island.name)


def open_run(spec: RunSpec, run_id: str, writer: str | None = CONTROL) -> ObjectStore:
    """The run's store as `writer` signs and checks it (infra/authority.py): CONTROL for the control
    plane, an island's name for its learners, None for a process that only reads."""
    return run_store(spec.store, run_id, Authority.of(spec, writer))


def island_credential_prefixes(spec: RunSpec, island: str) -> set[str | None]:
    """The credentials_env prefixes a learner of `island` opens stores with (None: the standard AWS variables):
    the run's store's, its own island's store's, and the read-only key (else the writer's) of every other
    island's store."""
    mine = next(i for i in spec.islands if i.name == island)
    return {spec.store.credentials_env, mine.store.credentials_env if mine.store else None,
            *(i.store.read_credentials_env or i.store.credentials_env
              for i in spec.islands if i.store and i.name != island)}


def foreign_writer_credentials(spec: RunSpec, island: str) -> list[str]:
    """The environment variables of other islands' writer keys, which a learner of `island` must not inherit
    where one environment holds several (a single-host run): it reads those stores with their read-only keys
    (with the writer's, of an island that has none)."""
    needed = island_credential_prefixes(spec, island)
    foreign = {i.store.credentials_env for i in spec.islands if i.store and i.name != island} - needed - {None}
    return sorted(f"{prefix}_{variable}" for prefix in foreign for variable in CREDENTIAL_VARIABLES)


def check_stores_reachable(spec: RunSpec) -> None:
    """Fail before any work when the run's store or an island's own store cannot be written."""
    for store_spec in [spec.store, *(island.store for island in spec.islands if island.store is not None)]:
        ObjectStore.from_spec(store_spec).check_reachable()
