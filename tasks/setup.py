"""Starting a run: check the store, allocate a run id, publish the spec learners will read."""

from __future__ import annotations

import secrets
import time
from uuid import UUID

from prefect import get_run_logger

from infra import layout
from infra.spec import RunSpec
from infra.stores import check_stores_reachable, open_run
from tasks.stage import stage


def new_run_id(spec: RunSpec) -> str:
    """A fresh run id: readable start time, and 64 random bits so that two runs never share one
    (a shared id would hand the second run the first one's results)."""
    return f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(8)}"


def flow_run_run_id(spec: RunSpec, flow_run_id: UUID | str) -> str:
    """The run id of a run started as a flow run (from the UI): the flow run's id, a random UUID
    that a Retry of the flow run keeps, so the retried run continues the same run."""
    return f"{spec.name}-{UUID(str(flow_run_id)).hex}"


@stage("start-run")
def start_run(spec: RunSpec, run_id: str) -> str:
    check_stores_reachable(spec)
    store = open_run(spec, run_id)
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    get_run_logger().info("run %s: %d learners on %d islands, store %s", run_id, len(spec.learners),
                          len(spec.islands), spec.store.url)
    return run_id
