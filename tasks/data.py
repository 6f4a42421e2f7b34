"""Data preparation as a Prefect task."""

from __future__ import annotations

from prefect import get_run_logger

from infra.spec import RunSpec
from infra.stores import open_run
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
