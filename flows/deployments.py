"""The flows that run as deployments: a whole run (`archipelago`), an island's segment (`segment`),
and a plan (`plan`) that predicts a run without training it.

`archipelago` is what a person starts from the Prefect UI: its parameters form is the run spec.
It runs the lifecycle with every island's segments as runs of that island's `segment`
deployment, so each island's learners execute on the island's own work pool. Retrying a failed
`archipelago` run (the UI's Retry) keeps its flow run, hence its run id: completed stages come
back from their persisted results and only the rest re-executes.
"""

from __future__ import annotations

from datetime import datetime, timezone

from prefect import flow
from prefect.runtime import flow_run

from infra import layout
from infra.spec import RunSpec, check_windows_ahead
from infra.stores import open_run
from infra.supervision import stop_learners_on_sigterm, yield_cpu_to_learners
from tasks.credentials import load_credential_blocks
from tasks.results import RESULT_SERIALIZER, RecordSigning, result_storage
from tasks.segments import BASELINE_FLOW, SEGMENT_FLOW
from tasks.setup import flow_run_run_id
from tasks.training import train_learner, train_standard


@flow(name=SEGMENT_FLOW, persist_result=False, result_serializer=RESULT_SERIALIZER)
def segment(spec: RunSpec, run_id: str, island: str, until: datetime | None = None,
            lease_term: int | None = None) -> dict:
    """The island's learners, each its own OS process, until they finish or the capacity window ends.

    `until`: the window's end; a learner stops before a round that would not finish in time,
    with that round's predecessor checkpointed, and the next segment resumes from there.
    `lease_term`: the lifecycle's; the learners stop once a newer term holds the run.
    """
    yield_cpu_to_learners()
    stop_learners_on_sigterm(run_id)  # a cancelled segment's learners stop with it
    load_credential_blocks(spec, island)  # its own writer key, the other islands' read-only keys
    # Its learners' records are signed by this island, and only this island's are read back.
    train = train_learner.with_options(result_storage=result_storage(spec.store, RecordSigning.of(spec, island)))
    learners = [train.submit(spec, run_id, island, slot.index, until, lease_term)
                for slot in spec.learners if slot.island.name == island]
    results = [learner.result() for learner in learners]
    return {"island": island, "finished": all(r["finished"] for r in results), "learners": results}


@flow(name=BASELINE_FLOW, persist_result=False, result_serializer=RESULT_SERIALIZER)
def baseline(spec: RunSpec, run_id: str) -> dict:
    """Standard training on the island `evaluation.baseline_island` names, on its device; its model is
    signed by the island."""
    island = spec.evaluation.baseline_island
    load_credential_blocks(spec, island)
    train = train_standard.with_options(result_storage=result_storage(spec.store, RecordSigning.of(spec, island)))
    return train(spec, run_id, writer=island)


@flow(name="archipelago", persist_result=False, result_serializer=RESULT_SERIALIZER)
def archipelago(spec: RunSpec, run_id: str | None = None) -> dict:
    """One Archipelago run: data, island segments on the islands' work pools, consolidation,
    standard baseline, evaluation and report. Leave `run_id` empty for a new run; name an
    existing run to continue it."""
    from flows.lifecycle import run_lifecycle

    run_id = run_id or flow_run_run_id(spec, flow_run.get_id())
    if not open_run(spec, run_id).exists(layout.SPEC):
        check_windows_ahead(spec, datetime.now(timezone.utc))
    return run_lifecycle(spec, run_id, islands_via="deployments")


@flow(name="plan", persist_result=False, result_serializer=RESULT_SERIALIZER)
def plan(spec: RunSpec, link_gbps: float = 25.0, step_seconds: dict[str, float] | None = None) -> dict:
    """What a run would deliver on an inter-island link of `link_gbps`, before paying for it:
    utilisation, bytes, wall time, and the link each utilisation goal needs (artifact `plan`); with
    capacity windows, the rounds each window holds and the waits on other islands (`plan-windows`,
    `plan-timeline`). Islands missing from `step_seconds` are profiled on the worker that runs this flow.
    First, each island's memory per rank and per host (`plan-memory`): a run that would not fit is refused."""
    from tasks.planning import publish_memory, publish_plan
    from training.planning.fit import refuse_unfit
    from training.planning.planner import complete_step_seconds

    refuse_unfit(spec, publish_memory(spec, "plan-memory"))

    given, _ = complete_step_seconds(spec, step_seconds or {})
    return publish_plan(spec, given, link_gbps * 1e9, key="plan",
                        description=f"Plan of {spec.name} on a {link_gbps:g} Gbit/s link")
