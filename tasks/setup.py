"""Starting a run as Prefect tasks: run ids, and the start stage (`training.stages.start_run`)."""

from __future__ import annotations

from uuid import UUID

from prefect import get_run_logger

from infra.spec import RunSpec
from tasks.stage import stage
from training import stages


def flow_run_run_id(spec: RunSpec, flow_run_id: UUID | str) -> str:
    """The run id of a run started as a flow run (from the UI): the flow run's id, a random UUID
    that a Retry of the flow run keeps, so the retried run continues the same run."""
    return f"{spec.name}-{UUID(str(flow_run_id)).hex}"


@stage("start-run")
def start_run(spec: RunSpec, run_id: str) -> str:
    stages.start_run(spec, run_id)
    get_run_logger().info("run %s: %d learners on %d islands, store %s", run_id, len(spec.learners),
                          len(spec.islands), spec.store.url)
    return run_id
