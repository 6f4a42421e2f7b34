"""A run's learners without Prefect: each its own OS process, as the lifecycle runs them, with a
progress log that a benchmark keeps beside its results; a fresh run in a store; the CPU lock that
benchmarks sharing two cores take turns with; planned-against-measured as a relative change."""

from __future__ import annotations

import contextlib
import fcntl
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infra.launch import LearnerFailed, LearnerProcess, run_learner, threads_per_process
from infra.spec import RunSpec, spec_sha256
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


def new_run(spec: RunSpec, arm: str):
    """A fresh run in the spec's store with its spec and data; returns (run id, store, manifest)."""
    from infra import layout
    from training.data.shards import prepare_dataset
    run_id = f"{spec.name}-{arm}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    store = run_store(spec.store, run_id)
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    return run_id, store, prepare_dataset(spec, store)


@contextlib.contextmanager
def cpu_lock(path: str | Path | None):
    """Hold the lock file `path` (none when None) while one arm trains, so that benchmarks sharing the
    cores take turns arm by arm; yields the seconds spent waiting for it."""
    if path is None:
        yield 0.0
        return
    Path(path).touch(exist_ok=True)
    with open(path) as lock:
        waited = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - waited
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def relative_change(value: float, reference: float) -> str:
    """`value` against `reference`, in percent (e.g. planned against measured)."""
    return f"{(value / reference - 1) * 100:+.1f}%" if reference else "n/a"


def train_islands(spec: RunSpec, run_id: str, log: Log, restarts: int = 0) -> dict:
    """Every learner as its own OS process (as the lifecycle runs them), then consolidation. A
    learner that dies is started again up to `restarts` times, a second later, as the lifecycle's
    `train-learner` task retries it."""
    threads = threads_per_process(spec)

    def train(slot) -> None:
        for attempt in range(restarts + 1):
            try:
                return run_learner(LearnerProcess(slot.index, slot.island.processes_per_learner, threads,
                                                  spec_sha256=spec_sha256(spec)),
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
