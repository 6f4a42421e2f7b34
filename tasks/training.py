"""Training stages as Prefect tasks: learners (island by island), consolidation, the baseline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.deployments import run_deployment

from eval.tracking import Sink, TrackingUnavailable, learner_points, shared_sink
from infra import layout
from infra.authority import CONTROL
from infra.derived import read_derived
from infra.resumable import what_to_fix
from infra.spec import RunSpec
from infra.stores import open_run
from tasks.faults import fail_once_if_asked
from tasks.segments import baseline_deployment, segment_tags
from tasks.stage import stage
from training import stages
from training.baseline import train_baseline
from training import events
from training.consolidate import consolidate


# Rounds can take well under a second; each progress update and each batch of log lines is a request
# to the Prefect API, which may sit across a slow link from the island. A learner's whole record of
# its rounds is its ledger, in its store.
PROGRESS_EVERY_S = 10.0


def learner_relay(logger, progress: UUID, on_round: Callable[[dict], None] = lambda event: None) -> Callable[[str], None]:
    """What becomes of each line a learner prints: its JSON events turn into log lines and progress
    (its rounds logged and its progress updated at most every `PROGRESS_EVERY_S` seconds, and at its
    last round), anything else (a library's warning, a traceback, JSON that is not an event) is logged
    as text. Every `round` event also goes to `on_round` (the experiment tracker)."""
    last_update = -math.inf

    def relay(line: str) -> None:
        nonlocal last_update
        event = events.parse(line)
        if event is None:
            logger.info("%s", line)
            return
        if event["event"] == "round":
            on_round(event)
            now = time.monotonic()
            if now - last_update >= PROGRESS_EVERY_S or event["round"] + 1 == event["rounds"]:
                logger.info("round %d/%d loss %.4f, %s tokens/s, ETA %.0f s", event["round"] + 1, event["rounds"],
                            event["loss"], f"{event['tokens_per_s']:,}", event["eta_s"])
                update_progress_artifact(progress, 100.0 * (event["round"] + 1) / event["rounds"])
                last_update = now
        elif event["event"] == "window_closed":
            logger.warning("capacity window ends %s: stopping before round %d/%d; the next window resumes here",
                           event["until"], event["next_round"] + 1, event["rounds"])
        elif event["event"] in ("missed_exchange", "fault", "corrupt_checkpoint"):
            logger.warning("%s", numbered_from_one(event))
        else:
            logger.info("%s", numbered_from_one(event))

    return relay


def numbered_from_one(event: dict) -> dict:
    """An event as the logs show it: its rounds numbered from 1, as the `round r/R` lines and the trackers
    number them (a learner's events carry the ledger's indices, from 0)."""
    return {**event, **{field: event[field] + 1 for field in ("round", "next_round") if isinstance(event.get(field), int)}}


def worth_retrying(task, task_run, state) -> bool:
    """A failed learner is retried unless its error is one a retry would meet again (`what_to_fix`)."""
    return not isinstance(state.data, BaseException) or what_to_fix(state.data) is None


# The lease term is the lifecycle's, not the learner's work: a resumed run's learners that finished stay Cached.
@stage("train-learner", task_run_name="train-{island}-learner-{learner}", retries=2, retry_delay_seconds=1,
       retry_condition_fn=worth_retrying, ignored_inputs=("lease_term",))
def train_learner(spec: RunSpec, run_id: str, island: str, learner: int, until: datetime | None = None,
                  lease_term: int | None = None) -> dict:
    """One learner of an island's segment, as its own OS process (a torchrun group if it has several).

    A learner that dies is retried by Prefect and resumes (`training.stages.train_learner`)."""
    progress = create_progress_artifact(0.0, key=f"progress-learner-{learner}",
                                        description=f"Rounds completed by learner {learner} on {island} ({run_id})")
    logger = get_run_logger()
    with ExitStack() as tracking:
        try:
            sink = tracking.enter_context(shared_sink(spec.tracking, spec.name, run_id, island))
        except TrackingUnavailable:
            raise
        except Exception as err:  # noqa: BLE001 - a tracker out of reach costs its curves, never the training
            logger.warning("tracking: %s unavailable, training without it: %s: %s", spec.tracking.backend,
                           type(err).__name__, err)
            sink = None
        on_round = (lambda event: None) if sink is None else round_tracker(sink, spec, island, learner, logger)
        return stages.train_learner(spec, run_id, learner, learner_relay(logger, progress, on_round), until, lease_term)


def round_tracker(sink: Sink, spec: RunSpec, island: str, learner: int, logger) -> Callable[[dict], None]:
    """What a learner's `round` event brings the tracker: the ledger entries it booked in that round."""
    tokens_per_round = spec.learners[learner].tokens_per_round()

    def track(event: dict) -> None:
        try:
            booked = event["booked"]
            sink.log(learner_points(island, learner, tokens_per_round, booked["rounds"], booked["exchanges"]))
        except Exception as err:  # noqa: BLE001 - a tracker out of reach costs its curves, never the training
            logger.warning("tracking: round %s of learner %d not logged: %s: %s", event.get("round"), learner,
                           type(err).__name__, err)

    return track


@stage("consolidate")
def consolidate_learners(spec: RunSpec, run_id: str) -> dict:
    fail_once_if_asked(spec, run_id, "consolidate")
    consensus = consolidate(spec, open_run(spec, run_id))
    logger = get_run_logger()
    logger.info("consolidated %d learners; max relative weight distance %.4f",
                len(consensus["per_learner"]), consensus["max_weight_distance"])
    if consensus["learners_with_corrupt_final_checkpoint"]:
        logger.warning("left out learners %s: their final checkpoint is corrupt",
                       consensus["learners_with_corrupt_final_checkpoint"])
    return consensus


@stage("train-standard-baseline")
def train_standard(spec: RunSpec, run_id: str, writer: str = CONTROL) -> dict:
    """Standard training, by the control plane or (`writer`) the island `evaluation.baseline_island`
    names, on that island's device."""
    fail_once_if_asked(spec, run_id, "baseline")
    logger = get_run_logger()
    island = next((i for i in spec.islands if i.name == spec.evaluation.baseline_island), None)

    def progress(p: dict) -> None:
        logger.info("baseline step %d/%d loss %.4f, %s tokens/s, ETA %.0f s", p["step"], p["steps"], p["loss"],
                    f"{p['tokens_per_s']:,}", p["eta_s"])

    return train_baseline(spec, open_run(spec, run_id, writer=writer), progress, device=island.device if island else "cpu",
                          reader=None if writer == CONTROL else writer)


@stage("island-baseline", task_run_name="train-standard-baseline-on-island")
def island_baseline(spec: RunSpec, run_id: str) -> dict:
    """Standard training as a run of the `baseline` deployment of the island the spec names, on its work
    pool; what it trained is read back from the run's store."""
    island = spec.evaluation.baseline_island
    flow_run = run_deployment(baseline_deployment(island), parameters={"spec": spec.model_dump(mode="json"),
                                                                       "run_id": run_id},
                              tags=segment_tags(run_id, island), flow_run_name=f"{run_id}-{island}-baseline",
                              poll_interval=2)
    if not flow_run.state.is_completed():
        raise RuntimeError(f"island {island}: baseline {flow_run.name} on work pool {flow_run.work_pool_name} "
                           f"ended {flow_run.state.name}: {flow_run.state.message}")
    _, meta, _ = read_derived(open_run(spec, run_id, writer=None), layout.BASELINE)
    get_run_logger().info("standard training ran on work pool %s", flow_run.work_pool_name)
    return {"tokens": meta["tokens"], "steps": meta["steps"], "global_batch": meta["global_batch"],
            "island": island, "work_pool": flow_run.work_pool_name}
