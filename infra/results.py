"""Where Prefect keeps stage results: next to the run's data, in the same store.

Persisted results plus a cache key made of a stage's inputs (which include the run id) make
every completed stage of a run reusable: retrying a failed flow run, or resuming the run with a
new flow run, re-executes only the stages that did not complete.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.filesystems import LocalFileSystem, RemoteFileSystem

STAGE_CACHE = INPUTS + TASK_SOURCE


def result_storage(store_spec):
    """A Prefect filesystem block under `<store>/prefect-results`, saved so flows can reference it.

    The block holds a path and an endpoint, never credentials: S3 keys stay in the environment.
    """
    if store_spec.url.startswith("s3://"):
        settings = {"endpoint_url": store_spec.endpoint_url} if store_spec.endpoint_url else {}
        block = RemoteFileSystem(basepath=f"{store_spec.url.rstrip('/')}/prefect-results", settings=settings)
    else:
        block = LocalFileSystem(
            basepath=str(Path(store_spec.url.removeprefix("file://")).resolve() / "prefect-results"))
    block.save(f"archipelago-results-{hashlib.sha256(block.basepath.encode()).hexdigest()[:16]}", overwrite=True)
    return block
