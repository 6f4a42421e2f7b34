"""Data preparation as a Prefect task."""

from __future__ import annotations

from prefect import get_run_logger

from infra import layout
from infra.objects import ObjectRef
from infra.spec import RunSpec
from infra.store import StoreError
from infra.stores import RunStores, open_run
from tasks.stage import stage
from training.data.shards import prepare_dataset


@stage("prepare-data")
def prepare_data(spec: RunSpec, run_id: str) -> dict:
    manifest = prepare_dataset(spec, open_run(spec, run_id))
    logger = get_run_logger()
    for shard in manifest["shards"]:
        logger.info("learner %d (%s): %d documents, %s bytes for %s planned tokens", shard["learner"],
                    shard["island"], shard["documents"], f"{shard['bytes']:,}", f"{shard['planned_tokens']:,}")
    for name, held in manifest["heldout"].items():
        logger.info("held-out %s: %d documents, %s bytes", name, held["documents"], f"{held['bytes']:,}")
    return {"shards": len(manifest["shards"]), "heldout": {k: v["bytes"] for k, v in manifest["heldout"].items()}}


def data_in_store(spec: RunSpec, run_id: str) -> bool:
    """Whether the data `prepare_data` wrote is all there: its manifest verifies and every object it names
    exists. A stage comes back Cached from its result record alone, so a deleted manifest or shard would
    never be written again."""
    run = open_run(spec, run_id)
    try:
        manifest = run.get_json(layout.DATA_MANIFEST)
        stores = RunStores(spec, run)
        named = [(stores.learner(shard["learner"]), shard["object"]) for shard in manifest["shards"]]
        named += [(run, entry["object"]) for side in ("heldout", "validation") for entry in manifest[side].values()]
        return all(store.exists(ObjectRef.from_json(ref).key) for store, ref in named)
    except (StoreError, KeyError, TypeError, ValueError, IndexError):
        return False


def prepare_data_once(spec: RunSpec, run_id: str) -> dict:
    """The prepare-data stage: cached on a resume, and run again where what it wrote is not all there."""
    return prepare_data.with_options(refresh_cache=not data_in_store(spec, run_id))(spec, run_id)
