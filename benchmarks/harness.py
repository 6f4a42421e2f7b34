"""What the benchmarks and experiments share: a progress log kept beside their results, the CPU lock that benchmarks
sharing two cores take turns with, the arm-by-arm driver of the resumable ones, planned-against-measured
as a relative change, and a run started and trained through the product's own stages
(`training.stages`), as the lifecycle runs them."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from infra.spec import RunSpec
from infra.stores import open_run
from training.consolidate import consolidate
from training.data.shards import prepare_dataset
from training import events
from training.stages import new_run_id, start_run, train_learners

# The lock file that benchmarks and experiments sharing one machine's cores take turns on, arm by arm:
# $ARCHIPELAGO_CPU_LOCK, or one in the system's temporary folder.
CPU_LOCK = Path(os.environ.get("ARCHIPELAGO_CPU_LOCK") or Path(tempfile.gettempdir()) / "archipelago-cpu.lock")


class Log:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def __call__(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


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


def load_arms(results: Path) -> dict[str, dict]:
    """A resumable benchmark's finished arms, by name: `<results>/arms/<arm>.json`."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((results / "arms").glob("*.json"))}


def scores_text(scores: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in scores.items())


def run_arms(results: Path, todo_of: Callable[[dict[str, dict]], list], train: Callable[[object, dict[str, dict]], dict],
             after: Callable[[], None], log: Log, lock: str | Path | None = None) -> None:
    """Run a resumable benchmark arm by arm until nothing is left: `todo_of(finished)` is the arms still to
    run (asked again after every arm, so a sweep can grow), `train(arm, finished)` an arm's result, which
    is written to `<results>/arms/<arm>.json` at once; `after()` then rebuilds the benchmark's tables. An
    arm trains holding `lock`; a result marked `same_run_as` reused another arm's and stays out of the ETA."""
    durations: list[float] = []
    while True:
        finished = load_arms(results)
        todo = todo_of(finished)
        if not todo:
            return
        arm = todo[0]
        with cpu_lock(lock):
            started = time.monotonic()
            log(f"arm {arm.name} started ({len(finished)} finished; {len(todo)} known still to run)")
            result = train(arm, finished)
        path = results / "arms" / f"{arm.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        if "same_run_as" not in result:
            durations.append(time.monotonic() - started)
        eta = statistics.mean(durations) * (len(todo) - 1) if durations else 0.0
        log(f"arm {arm.name} done in {time.monotonic() - started:.0f} s: bpb {scores_text(result['bpb'])}, validation "
            f"{scores_text(result['validation_bpb'])}; ETA for the known rest {eta / 60:.0f} min")
        after()


def resumable_main(argv: list[str] | None, description: str, results: Path,
                   todo_of: Callable[..., list], run: Callable[..., None], write: Callable[[Log], None],
                   flags: dict[str, str] | None = None) -> int:
    """A resumable benchmark's command line: everything still to run, resuming (`run(log)`), then its
    tables and page (`write(log)`); `--plan` lists the arms known still to run (`todo_of(finished)`),
    `--table` only rebuilds the tables and page. `flags`: the benchmark's own switches (name: help),
    passed to `todo_of` and `run` as keywords."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--plan", action="store_true", help="list the arms known still to run and stop")
    parser.add_argument("--table", action="store_true", help="only rebuild the tables and the page from finished arms")
    for name, text in (flags or {}).items():
        parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=text)
    args = parser.parse_args(argv)
    switches = {name: getattr(args, name) for name in flags or {}}
    torch.set_num_threads(2)
    log = Log(results / "progress.log")
    if args.plan:
        for arm in todo_of(load_arms(results), **switches):
            print(arm.name)
        return 0
    if not args.table:
        run(log, **switches)
    write(log)
    return 0


def relative_change(value: float, reference: float) -> str:
    """`value` against `reference`, in percent (e.g. planned against measured)."""
    return f"{(value / reference - 1) * 100:+.1f}%" if reference else "n/a"


def new_run(spec: RunSpec, arm: str):
    """A fresh run of an arm, started and its data prepared; returns (run id, store, manifest)."""
    run_id = new_run_id(spec, arm)
    store = start_run(spec, run_id)
    return run_id, store, prepare_dataset(spec, store)


def train_islands(spec: RunSpec, run_id: str, log: Log, restarts: int = 0) -> dict:
    """Every learner as its own OS process, then consolidation; learner 0's progress every tenth round."""
    def relay(line: str) -> None:
        event = events.parse(line)
        if event is None:
            return
        if event["event"] == "round" and event["learner"] == 0 and event["round"] % 10 == 9:
            log(f"  learner 0 round {event['round'] + 1}/{event['rounds']} loss {event['loss']:.3f} "
                f"{event['tokens_per_s']:,} tok/s ETA {event['eta_s']:.0f} s")
        elif event["event"] in ("missed_exchange", "fault", "resumed", "skipping_rounds"):
            log(f"  {event}")

    train_learners(spec, run_id, relay, restarts,
                   on_restart=lambda learner, reason: log(f"  learner {learner} died ({reason}); restarting"))
    return consolidate(spec, open_run(spec, run_id))
