"""Training stages as Prefect tasks: island segments, consolidation, the standard baseline."""

from __future__ import annotations

import json
import os

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from infra.launch import LearnerProcess, run_learners
from infra.spec import RunSpec
from infra.store import run_store
from training.baseline import train_baseline
from training.consolidate import consolidate


def threads_per_process(spec: RunSpec) -> int:
    """Share the host's cores among every learner process running at once."""
    processes = sum(i.learners * i.processes_per_learner for i in spec.islands)
    return max(1, (os.cpu_count() or 1) // processes)


@task(name="train-island")
def train_island(spec: RunSpec, run_id: str, island_name: str) -> None:
    """Run every learner of one island, as OS processes, until the run's last round."""
    logger = get_run_logger()
    island = next(i for i in spec.islands if i.name == island_name)
    slots = [s for s in spec.learners if s.island.name == island_name]
    threads = threads_per_process(spec)
    progress = create_progress_artifact(0.0, description=f"Rounds completed on island {island_name}")
    done: dict[int, int] = {}

    def relay(learner: int, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            logger.info("learner %d: %s", learner, line)
            return
        if event.get("event") == "round":
            done[learner] = event["round"] + 1
            logger.info("learner %d round %d/%d loss %.4f, %s tokens/s, ETA %.0f s", learner, event["round"] + 1,
                        event["rounds"], event["loss"], f"{event['tokens_per_s']:,}", event["eta_s"])
            update_progress_artifact(progress, 100.0 * sum(done.values()) / (len(slots) * spec.sync.rounds))
        else:
            logger.info("learner %d: %s", learner, event)

    logger.info("island %s: %d learners x %d processes, batch %d, H=%d", island_name, island.learners,
                island.processes_per_learner, island.batch_size, island.inner_steps)
    run_learners([LearnerProcess(s.index, island.processes_per_learner, threads) for s in slots],
                 spec.store.url, spec.store.endpoint_url, run_id, relay)


@task(name="consolidate")
def consolidate_learners(spec: RunSpec, run_id: str) -> dict:
    consensus = consolidate(spec, run_store(spec.store, run_id))
    get_run_logger().info("consolidated %d learners; max relative weight distance %.4f",
                          len(spec.learners), consensus["max_weight_distance"])
    return consensus


@task(name="train-standard-baseline")
def train_standard(spec: RunSpec, run_id: str) -> dict:
    logger = get_run_logger()

    def progress(p: dict) -> None:
        logger.info("baseline step %d/%d loss %.4f, %s tokens/s, ETA %.0f s", p["step"], p["steps"], p["loss"],
                    f"{p['tokens_per_s']:,}", p["eta_s"])

    return train_baseline(spec, run_store(spec.store, run_id), progress)
