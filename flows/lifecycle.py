"""The whole life of an Archipelago run, as one Prefect flow.

spec -> memory check -> shards -> island training segments (every learner of every island, concurrently)
-> consolidation -> standard baseline (unless `evaluation.baseline` is none) -> evaluation -> report.

Every stage persists its result in the run's store under a cache key made of its inputs, so a
retried or resumed run re-executes only the stages that did not complete. A lifecycle holds the
run's lease while it runs, so a second lifecycle of the same run id (a resume of a run still
going) is refused. An interrupted lifecycle (Ctrl-C, SIGTERM: Prefect raises `TerminationSignal`)
stops the run's work, then releases the lease.
"""

from __future__ import annotations

import time
from typing import Literal
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from infra.authority import CONTROL
from infra.lease import STOP_MARGIN_S, held_lease, this_process
from infra.spec import RunSpec
from infra.stores import open_run
from infra.supervision import stop_learners
from tasks.credentials import load_credential_blocks
from tasks.data import prepare_data_once
from tasks.evaluation import evaluate_curve_points, evaluate_models, publish_figures, publish_report
from tasks.planning import check_memory
from tasks.results import RESULT_SERIALIZER, RecordSigning, result_storage
from tasks.segments import island_segments, stop_segments
from tasks.setup import start_run
from tasks.tracking import publish_tracker_link
from tasks.training import consolidate_learners, island_baseline, train_learner, train_standard
from training.stages import new_run_id


@flow(name="lifecycle", persist_result=True, result_serializer=RESULT_SERIALIZER)
def lifecycle(spec: RunSpec, run_id: str | None = None,
              islands_via: Literal["tasks", "deployments"] = "tasks") -> dict:
    """`islands_via`: "tasks" runs every learner from this flow's own process; "deployments" runs
    each island's segments as runs of that island's deployment, on the island's own work pool."""
    started = time.monotonic()
    check_memory(spec)  # a run whose ranks would not fit their accelerators fails here, before any work
    load_credential_blocks(spec)
    run_id = run_id or new_run_id(spec)
    if spec.signing is None:
        get_run_logger().warning("run %s is unauthenticated (unauthenticated: true): nothing it reads from its "
                                 "stores is checked, so anyone who can write them can change what it trains", run_id)
    with held_lease(open_run(spec, run_id), run_id, this_process(**{"flow run": str(flow_run.id)}),
                    warn=get_run_logger().warning, on_lost=lambda reason: stop_run_work(run_id, reason)) as lease:
        try:
            start_run(spec, run_id)
            publish_tracker_link(spec, run_id)
            prepare_data_once(spec, run_id)
            if islands_via == "deployments":
                segments = [island_segments.submit(spec, run_id, island.name, lease.term) for island in spec.islands]
            else:
                segments = [train_learner.submit(spec, run_id, slot.island.name, slot.index, lease_term=lease.term)
                            for slot in spec.learners]
            for segment in segments:
                segment.result()
            consensus = consolidate_learners(spec, run_id)
            baseline = None
            if spec.evaluation.baseline == "standard":
                on_island = spec.evaluation.baseline_island is not None and islands_via == "deployments"
                baseline = island_baseline(spec, run_id) if on_island else train_standard(spec, run_id)
            evals = evaluate_models(spec, run_id)
            curve = evaluate_curve_points(spec, run_id)
            report = publish_report(spec, run_id, evals, consensus, baseline, time.monotonic() - started)
            publish_figures(spec, run_id, report["communication"], curve)
        except (KeyboardInterrupt, TerminationSignal) as interrupt:
            # Stopped before the lease is released, so no resume trains beside these learners; and
            # before the flow ends, whose task runner waits for every learner's thread.
            stop_run_work(run_id, f"the lifecycle was interrupted ({type(interrupt).__name__})")
            raise
    return report


def stop_run_work(run_id: str, reason: str) -> None:
    """What a lifecycle that cannot keep its lease does before the lease expires: end the learners it
    runs itself, start no more, and have the islands' workers cancel the run's segment flow runs."""
    stop_learners(run_id, reason)
    stop_segments(run_id, reason, timeout_s=STOP_MARGIN_S)


def run_lifecycle(spec: RunSpec, run_id: str, islands_via: Literal["tasks", "deployments"] = "tasks",
                  return_state: bool = False):
    """Run (or resume) the lifecycle with its stage results kept in the run's own store.

    Returns the report, or with `return_state` the flow run's final state (failed without raising)."""
    return lifecycle.with_options(result_storage=result_storage(spec.store, RecordSigning.of(spec, CONTROL)))(
        spec=spec, run_id=run_id, islands_via=islands_via, return_state=return_state)


def stage_states(flow_run_id: UUID) -> dict[str, str]:
    """Each stage (task run) of one lifecycle flow run and its final state: "Completed" (it ran),
    "Cached" (the result an earlier attempt persisted was reused), "Failed", ..."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run.state.name for run in runs if run.state}
