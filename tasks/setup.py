"""Starting a run: check the store, allocate a run id, publish the spec learners will read."""

from __future__ import annotations

import secrets
import time

from prefect import get_run_logger

from infra import layout
from infra.spec import RunSpec
from infra.store import ObjectStore, run_store
from tasks.stage import stage


def new_run_id(spec: RunSpec) -> str:
    return f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


@stage("start-run")
def start_run(spec: RunSpec, run_id: str) -> str:
    ObjectStore.from_spec(spec.store).check_reachable()
    store = run_store(spec.store, run_id)
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    get_run_logger().info("run %s: %d learners on %d islands, store %s", run_id, len(spec.learners),
                          len(spec.islands), spec.store.url)
    return run_id
