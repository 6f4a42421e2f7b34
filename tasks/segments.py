"""An island's training segments as runs of its own deployment, on its own work pool.

Each island is a separate place to run code, reached the way Prefect reaches infrastructure:
the lifecycle asks the island's `segment` deployment for a run per capacity window (scheduled at
the window's start), and the island's worker executes it. Whether the island's learners finished
is read from the store, the run's source of truth, not from the segment's return value.

An island runs one segment of a run at a time: its flow runs carry the tags `run:<run id>` and
`island:<island>`, and a new one starts only once every earlier one not over has been cancelled
(one left by a lifecycle that died would otherwise train a second copy of each learner).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState,
                                            FlowRunFilterStateType, FlowRunFilterTags)
from prefect.client.schemas.objects import TERMINAL_STATES
from prefect.states import Cancelling
from prefect.deployments import run_deployment

from infra.spec import RunSpec
from infra.stores import RunStores, open_run
from infra.supervision import LearnersStopped, stopped_because
from tasks.stage import stage
from training.learner.ledger import finished

SEGMENT_FLOW = "segment"
BASELINE_FLOW = "baseline"


def island_pool(island: str) -> str:
    return f"island-{island}"


def segment_deployment(island: str) -> str:
    """The deployment of an island's segments: `segment/island-<name>`, on work pool `island-<name>`."""
    return f"{SEGMENT_FLOW}/{island_pool(island)}"


def baseline_deployment(island: str) -> str:
    """The deployment that trains standard training on an island: `baseline/island-<name>`."""
    return f"{BASELINE_FLOW}/{island_pool(island)}"


def segment_tags(run_id: str, island: str | None = None) -> list[str]:
    return [f"run:{run_id}"] + ([f"island:{island}"] if island else [])


class SegmentsNotStopped(RuntimeError):
    pass


def stop_segments(run_id: str, reason: str, island: str | None = None, timeout_s: float = 60) -> list[str]:
    """Have the workers cancel every segment flow run of `run_id` (of `island`, or of every island)
    not yet over, and wait until each is; returns their names. `SegmentsNotStopped` names those
    still not over after `timeout_s` (a worker that is gone cannot cancel its run)."""
    not_over = FlowRunFilter(tags=FlowRunFilterTags(all_=segment_tags(run_id, island)),
                             state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=list(TERMINAL_STATES))))
    only_segments = FlowFilter(name=FlowFilterName(any_=[SEGMENT_FLOW]))
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=only_segments, flow_run_filter=not_over)
        for run in runs:
            client.set_flow_run_state(run.id, Cancelling(message=reason), force=True)
        deadline = time.monotonic() + timeout_s
        while left := client.read_flow_runs(flow_filter=only_segments, flow_run_filter=not_over):
            if time.monotonic() > deadline:
                raise SegmentsNotStopped(f"run {run_id}: segment flow runs still "
                                         f"{', '.join(f'{r.name} {r.state.name}' for r in left)} {timeout_s:.0f} s "
                                         f"after they were cancelled")
            time.sleep(1)
    return [run.name for run in runs]


def run_segment(spec: RunSpec, run_id: str, island: str, n: int = 0, start_at: datetime | None = None,
                until: datetime | None = None, lease_term: int | None = None):
    """Segment `n` of an island, a run of its deployment on its work pool, from `start_at` (None: now;
    its worker may start the process earlier, Prefect holds the flow until then) until its learners
    finish or `until`; waits for it and returns the completed flow run. Earlier segment flow runs of
    the island and run id that are not over are cancelled first. Refused once this process stopped
    the run's learners (`infra.supervision.stop_learners`)."""
    if (reason := stopped_because(run_id)) is not None:
        raise LearnersStopped(f"run {run_id}: not starting segment {n} of island {island}: {reason}")
    stop_segments(run_id, f"segment {n} of island {island} replaces it", island)
    flow_run = run_deployment(
        segment_deployment(island),
        parameters={"spec": spec.model_dump(mode="json"), "run_id": run_id, "island": island,
                    "until": until.isoformat() if until else None, "lease_term": lease_term},
        scheduled_time=start_at, tags=segment_tags(run_id, island),
        flow_run_name=f"{run_id}-{island}-window-{n}", poll_interval=2)
    if not flow_run.state.is_completed():
        raise RuntimeError(f"island {island}: segment {flow_run.name} on work pool {flow_run.work_pool_name} "
                           f"ended {flow_run.state.name}: {flow_run.state.message}")
    return flow_run


@stage("island-segments", task_run_name="segments-{island}", ignored_inputs=("lease_term",))
def island_segments(spec: RunSpec, run_id: str, island: str, lease_term: int | None = None) -> dict:
    """Run the island's learners window by window until every one has trained all its rounds, under
    the lifecycle's `lease_term` (its learners stop once a newer term holds the run)."""
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
                               window.end_at if window else None, lease_term)
        segments.append({"flow_run": flow_run.name, "work_pool": flow_run.work_pool_name})
        if all(finished(stores, spec, i) for i in learners):
            logger.info("island %s finished in %d segment(s) on work pool %s", island, len(segments),
                        flow_run.work_pool_name)
            return {"island": island, "segments": segments}
        logger.info("island %s paused at its window's end; resuming in its next window", island)
    raise RuntimeError(f"island {island}: its capacity windows ended before its learners finished "
                       f"{spec.sync.rounds} rounds; add windows to islands.{spec.islands.index(island_spec)}.windows "
                       f"and retry the run")
