"""A run's learners without Prefect: each its own OS process, as the lifecycle runs them, with a
progress log that a benchmark keeps beside its results."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infra.launch import LearnerFailed, LearnerProcess, run_learner, threads_per_process
from infra.spec import RunSpec
from infra.store import run_store
from training.consolidate import consolidate


class Log:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def __call__(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def train_islands(spec: RunSpec, run_id: str, log: Log, restarts: int = 0) -> dict:
    """Every learner as its own OS process (as the lifecycle runs them), then consolidation. A
    learner that dies is started again up to `restarts` times, a second later, as the lifecycle's
    `train-learner` task retries it."""
    threads = threads_per_process(spec)

    def train(slot) -> None:
        for attempt in range(restarts + 1):
            try:
                return run_learner(LearnerProcess(slot.index, slot.island.processes_per_learner, threads),
                                   spec.store.url, spec.store.endpoint_url, run_id, relay, spec.store.credentials_env)
            except LearnerFailed as err:
                if attempt == restarts:
                    raise
                log(f"  learner {slot.index} died ({str(err).splitlines()[0]}); restarting")
                time.sleep(1)

    def relay(line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if event.get("event") == "round" and event["learner"] == 0 and event["round"] % 10 == 9:
            log(f"  learner 0 round {event['round'] + 1}/{event['rounds']} loss {event['loss']:.3f} "
                f"{event['tokens_per_s']:,} tok/s ETA {event['eta_s']:.0f} s")
        elif event.get("event") in ("missed_exchange", "fault", "resumed", "skipping_rounds"):
            log(f"  {event}")

    with ThreadPoolExecutor(len(spec.learners)) as pool:
        running = [pool.submit(train, slot) for slot in spec.learners]
        for learner in running:
            learner.result()
    return consolidate(spec, run_store(spec.store, run_id))
