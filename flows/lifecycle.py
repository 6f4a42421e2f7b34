"""The whole life of an Archipelago run, as one Prefect flow.

spec -> shards -> island training segments (concurrently) -> consolidation -> standard baseline
-> evaluation -> report.
"""

from __future__ import annotations

import time

from prefect import flow

from infra.spec import RunSpec
from tasks.data import prepare_data
from tasks.evaluation import evaluate_models, publish_report
from tasks.setup import new_run_id, start_run
from tasks.training import consolidate_learners, train_island, train_standard


@flow(name="lifecycle")
def lifecycle(spec: RunSpec, run_id: str | None = None) -> dict:
    started = time.monotonic()
    run_id = start_run(spec, run_id or new_run_id(spec))
    prepare_data(spec, run_id)
    segments = [train_island.submit(spec, run_id, island.name) for island in spec.islands]
    for segment in segments:
        segment.result()
    consensus = consolidate_learners(spec, run_id)
    baseline = train_standard(spec, run_id)
    evals = evaluate_models(spec, run_id)
    return publish_report(spec, run_id, evals, consensus, baseline, time.monotonic() - started)
