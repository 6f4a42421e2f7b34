"""An island's training segments as runs of its own deployment, on its own work pool.

Each island is a separate place to run code, reached the way Prefect reaches infrastructure:
the lifecycle asks the island's `segment` deployment for a run per capacity window (scheduled at
the window's start), and the island's worker executes it. Whether the island's learners finished
is read from the store, the run's source of truth, not from the segment's return value.
"""

from __future__ import annotations

from datetime import datetime, timezone

from prefect import get_run_logger
from prefect.deployments import run_deployment

from infra.spec import RunSpec
from infra.stores import RunStores, open_run
from tasks.stage import stage
from training.ledger import finished

SEGMENT_FLOW = "segment"


def island_pool(island: str) -> str:
    return f"island-{island}"


def segment_deployment(island: str) -> str:
    """The deployment of an island's segments: `segment/island-<name>`, on work pool `island-<name>`."""
    return f"{SEGMENT_FLOW}/{island_pool(island)}"


def run_segment(spec: RunSpec, run_id: str, island: str, n: int = 0, start_at: datetime | None = None,
                until: datetime | None = None):
    """Segment `n` of an island, a run of its deployment on its work pool, from `start_at` (None: now;
    its worker may start the process earlier, Prefect holds the flow until then) until its learners
    finish or `until`; waits for it and returns the completed flow run."""
    flow_run = run_deployment(
        segment_deployment(island),
        parameters={"spec": spec.model_dump(mode="json"), "run_id": run_id, "island": island,
                    "until": until.isoformat() if until else None},
        scheduled_time=start_at,
        flow_run_name=f"{run_id}-{island}-window-{n}", poll_interval=2)
    if not flow_run.state.is_completed():
        raise RuntimeError(f"island {island}: segment {flow_run.name} on work pool {flow_run.work_pool_name} "
                           f"ended {flow_run.state.name}: {flow_run.state.message}")
    return flow_run


@stage("island-segments", task_run_name="segments-{island}")
def island_segments(spec: RunSpec, run_id: str, island: str) -> dict:
    """Run the island's learners window by window until every one has trained all its rounds."""
    logger = get_run_logger()
    island_spec = next(i for i in spec.islands if i.name == island)
    stores = RunStores(spec, open_run(spec, run_id, writer=None))
    learners = [slot.index for slot in spec.learners if slot.island.name == island]
    segments = []
    for n, window in enumerate(island_spec.ordered_windows or [None]):
        if window is not None and window.end_at <= datetime.now(timezone.utc):
            logger.info("window %s is over: skipped", window.describe())
            continue
        if window is not None:
            logger.info("segment %d of island %s scheduled for its window %s", n, island, window.describe())
        flow_run = run_segment(spec, run_id, island, n, window.start_at if window else None,
                               window.end_at if window else None)
        segments.append({"flow_run": flow_run.name, "work_pool": flow_run.work_pool_name})
        if all(finished(stores, spec, i) for i in learners):
            logger.info("island %s finished in %d segment(s) on work pool %s", island, len(segments),
                        flow_run.work_pool_name)
            return {"island": island, "segments": segments}
        logger.info("island %s paused at its window's end; resuming in its next window", island)
    raise RuntimeError(f"island {island}: its capacity windows ended before its learners finished "
                       f"{spec.sync.rounds} rounds; add windows to islands.{spec.islands.index(island_spec)}.windows "
                       f"and retry the run")
