"""A short profiling run: the run's own learners, for a few rounds, on this machine with nothing on a link.

`measure_step_seconds` (below) times inner steps alone. A learner's round also spends time
outside them: the exchange's local work (encoding, checksums, the store's requests, the outer step),
its checkpoint, the background work that competes with its compute for cores; and the run spends
time before the first inner step (imports, the spec, its shard) and after the last round (final
checkpoint, summary, exit). Those do not depend on the link, so they are measured here, once, with
every learner of the spec started as the lifecycle starts it (`infra.launch`), all at once, against
a store at local speed, each island's learners on cores of their own as separate sites' would be
(`infra.launch.island_cores`); the planner then adds what the link costs (`plan_run(..., profile=...)`).

Both start only when the memory plan's figures for them fit the memory this machine has available
(`check_fits_here`), and end as soon as one of their processes fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import queue
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

import psutil
import torch

from infra.launch import LearnerProcess, island_cores, threads_per_process
from infra.spec import RunSpec, SpecError, parse_spec, spec_sha256
from infra.supervision import run_learner, stop_learners
from training.exchange.modes import sync_mode
from training.learner.ledger import read_summaries
from training.model.registry import build_model
from training.planning.host_memory import learner_host, this_host_bytes
from training.planning.memory import gigabytes, model_shape, model_sizes, rank_memory

# At least four timed rounds give each learner four round lengths (`profile_rounds`).
PROFILE_ROUNDS = 5

# A round's parts, as the learners' summaries record them. On the learner's path: its inner steps,
# syncing (queueing its message, applying the exchange), the part of syncing spent waiting for the
# exchange's job, and its checkpoint. On the transport thread, overlapping the next round's inner
# steps unless the learner waits for them: the message's encoding and write, its peers' messages,
# the mix and outer step.
ROUND_PARTS = ("inner_steps", "sync", "waiting_for_exchange", "checkpoint", "publish", "receive", "outer_step")


class CannotProfileHere(SpecError):
    """A spec whose learners would not fit this machine's memory, so cannot be profiled here."""


class ProfilingFailed(RuntimeError):
    """A profiling process failed or died; the profile ended there, its other processes with it."""


def stepping_bytes(spec: RunSpec) -> int:
    """What `measure_step_seconds` holds here at once: every learner as one process with the whole model,
    its inner optimizer and one rank's batch (the memory plan's figures)."""
    sizes, shape = model_sizes(spec), model_shape(spec)
    return sum(rank_memory(spec, slot.island, sizes, shape, "data_parallel", slot.island.processes_per_learner).peak
               for slot in spec.learners)


def profile_run_bytes(spec: RunSpec) -> int:
    """What `profile_run` holds here at once: every learner with all its ranks on this host, as the memory
    plan counts a learner's host (`learner_host`)."""
    sizes, shape = model_sizes(spec), model_shape(spec)
    return sum(island.learners * sum(learner_host(spec, island, sizes, rank_memory(spec, island, sizes, shape).peak,
                                                  island.processes_per_learner).values())
               for island in spec.islands)


def check_fits_here(spec: RunSpec, needed: int, what: str) -> None:
    """Raise CannotProfileHere, before anything starts, when `needed` bytes (the memory plan's figure for
    `what`) exceed the memory this machine has available (free now, and within its container's limit):
    otherwise its processes would be killed, or swap, on a model meant for other machines."""
    available = min(psutil.virtual_memory().available, this_host_bytes())
    if needed > available:
        flags = " ".join(f"--step-seconds {island.name}=S" for island in spec.islands)
        raise CannotProfileHere(
            f"cannot {what} here: the {len(spec.learners)} learners at once need {gigabytes(needed)} GB by the "
            f"memory plan, and this machine has {gigabytes(available)} GB available; give each island's "
            f"seconds per inner step ({flags}), or plan on a machine that fits (--profile-run there profiles "
            "with the run's own learners)")


def check_profiling_fits_here(spec: RunSpec, given_step_seconds: dict[str, float], profile_run: bool) -> None:
    """Before `plan` does anything else: raise CannotProfileHere when what it would run here to fill in
    what it was not given (the run's own learners with `profile_run`, else the inner steps of the islands
    `given_step_seconds` leaves out) does not fit this machine."""
    if profile_run:
        check_fits_here(spec, profile_run_bytes(spec), "profile the run's own learners")
    elif any(island.name not in given_step_seconds for island in spec.islands):
        check_fits_here(spec, stepping_bytes(spec), "measure the inner steps")


def one_line(err: BaseException) -> str:
    """An error's first line and, when it goes on (a learner's last output), its last: what failed and why."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(dict.fromkeys(lines[:1] + lines[-1:])) or type(err).__name__


@dataclass(frozen=True)
class RunProfile:
    # Per island: an inner step, with the run's background work going on. This and `round_overhead_s` are
    # means over whole periods of the mode's crossings after the settling rounds (`profile_rounds`), so a
    # round that crosses islands counts as often as it comes, each with its share of what the run's
    # periodic checkpoints add (`checkpoint_s`) spread over the run's rounds.
    step_seconds: dict[str, float]
    # Per island: a round's seconds besides its inner steps, on no link.
    round_overhead_s: dict[str, float]
    startup_s: float  # launch to the first inner step, slowest learner
    # The last round's end to the process's exit, with what the last round takes beyond a timed one
    # (the exchanges still in flight, the final checkpoint), slowest learner.
    teardown_s: float
    # Per island, mean seconds of a round's parts (`ROUND_PARTS`) over the same rounds: where the
    # overhead comes from. The checkpoint's part is what the run's checkpoints add per round.
    round_parts_s: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per island: what one checkpoint adds to the rounds it reaches (`checkpoint_rounds`), inner steps and
    # overhead together, beyond the same rounds of the mode's period without one.
    checkpoint_s: dict[str, float] = field(default_factory=dict)
    # The learners together: the tokens of their timed rounds, over the span from the earliest end of a
    # last settling round to the latest end of a last timed round.
    tokens_per_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def largest_part(self, island: str) -> tuple[str, float]:
        """What binds an island's round besides its inner steps: the largest of its round's other parts. A
        wait for the exchange is not a part of its own but the exchange's parts not yet done (publish,
        receive, outer step), so syncing counts without it."""
        parts = dict(self.round_parts_s[island])
        parts["sync"] -= parts.pop("waiting_for_exchange")
        return max(((part, seconds) for part, seconds in parts.items() if part != "inner_steps"), key=lambda p: p[1])


def settling_rounds(spec: RunSpec) -> int:
    """The rounds a profile does not time: the first (it builds the outer optimizer's state) and every
    round up to the one that applies the first exchange to hear from another island (the next round,
    where the exchange is applied `tau` steps into it). Learners start unevenly (a learner of several
    processes starts later), and those that start early wait there for the others: their start-up's
    lag, which `startup_s` holds, not a round's overhead."""
    return sync_mode(spec).first_crossing() + 1 + (spec.sync.transport.tau > 0)


def checkpoint_rounds(spec: RunSpec) -> int:
    """The rounds a checkpoint's cost reaches: its own, and, written in the background, the transport
    thread it holds up, so the next round's exchange, applied `tau` steps into the round after."""
    return 2 + spec.sync.transport.tau


def timed_rounds(spec: RunSpec, at_least: int = PROFILE_ROUNDS) -> int:
    """Whole periods of the mode's peers and island crossings (`SyncMode.period`), at least `at_least` - 1
    rounds: a mode that crosses islands only every so often spends its rounds unevenly."""
    period = sync_mode(spec).period()
    return period * math.ceil((at_least - 1) / period)


def profile_rounds(spec: RunSpec, at_least: int = PROFILE_ROUNDS) -> int:
    """The settling rounds (`settling_rounds`), the timed rounds (`timed_rounds`), then one checkpoint and
    the rounds its cost reaches (`checkpoint_rounds`): a run checkpoints every so often, and a short
    profile's rounds would count it as often as it happens to fall among them. Then the last round,
    untimed: it waits for the exchanges still in flight and writes the final checkpoint, once a run, so
    it is the teardown's."""
    return settling_rounds(spec) + timed_rounds(spec, at_least) + checkpoint_rounds(spec) + 1


def checkpoints_per_round(spec: RunSpec) -> float:
    """The run's periodic checkpoints (the last round's, at the end, is the teardown's) over its rounds."""
    rounds = spec.sync.rounds
    return (rounds - 1) // spec.training.checkpoint_every / rounds


def profile_spec(spec: RunSpec, store: dict, at_least: int = PROFILE_ROUNDS) -> RunSpec:
    """The spec a profile runs: `profile_rounds(spec, at_least)` rounds against `store` (a run-spec `store`
    section), with one periodic checkpoint, right after the timed rounds. Capacity windows and bandwidth
    limits are dropped: the profile is of the islands, not of their reservations or their link."""
    raw = spec.model_dump(mode="json")
    raw["store"] = store
    raw["sync"]["rounds"] = profile_rounds(spec, at_least)
    raw["training"]["checkpoint_every"] = settling_rounds(spec) + timed_rounds(spec, at_least) + 1
    raw["sync"]["transport"]["bandwidth"] = {}
    # Nor is it of their keys: a profile's objects live in a throwaway folder.
    raw["signing"] = None
    for island in raw["islands"]:
        island["windows"] = []
        island.pop("store", None)
        island.pop("signing", None)
    return parse_spec(raw)


def profile_run(spec: RunSpec, store: dict | None = None, at_least: int = PROFILE_ROUNDS) -> RunProfile:
    """Run the spec's learners as `profile_spec` says, against `store` (by default a fresh local folder),
    and time them."""
    from training.data.corpora import check_data_paths
    from training.data.shards import prepare_dataset
    from training.stages import start_run

    check_profiling_fits_here(spec, {}, profile_run=True)
    check_data_paths(spec)
    with tempfile.TemporaryDirectory(prefix="archipelago-profile-") as folder:
        profiled = profile_spec(spec, store or {"url": folder}, at_least)
        run_id = f"profile-{time.strftime('%Y%m%d-%H%M%S')}"
        run = start_run(profiled, run_id)
        prepare_dataset(profiled, run)
        round_times: dict[int, list[float]] = {slot.index: [] for slot in profiled.learners}
        exits: dict[int, float] = {}
        threads = threads_per_process(profiled)
        islands = [island.name for island in profiled.islands]
        launched = time.monotonic()

        def learner(slot) -> None:
            def on_line(line: str) -> None:
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("event") == "round":
                        round_times[slot.index].append(time.monotonic() - launched)
            run_learner(LearnerProcess(slot.index, slot.island.processes_per_learner, threads,
                                       wrapper=island_cores(islands.index(slot.island.name), len(islands)),
                                       spec_sha256=spec_sha256(profiled)),
                        profiled.store.url, profiled.store.endpoint_url, run_id, on_line,
                        profiled.store.credentials_env)
            exits[slot.index] = time.monotonic() - launched

        with ThreadPoolExecutor(len(profiled.learners)) as pool:
            for done in as_completed([pool.submit(learner, slot) for slot in profiled.learners]):
                if done.exception() is not None:
                    # Its partners would otherwise wait out their timeouts for it.
                    stop_learners(run_id, "another learner of the profile failed")
                    raise ProfilingFailed(f"profiling run: {one_line(done.exception())}")
        summaries = read_summaries(profiled, run)
    return summarise(profiled, summaries, round_times, exits, checkpoints_per_round(spec))


def summarise(spec: RunSpec, summaries, round_times: dict[int, list[float]], exits: dict[int, float],
              checkpoints_per_run_round: float) -> RunProfile:
    """The profile from each learner's summary (compute per round) and when its rounds ended (`spec` is the
    profile's, `profile_run`'s). The timed rounds, after the settling ones and before the profile's one
    periodic checkpoint, give an inner step and a round's overhead (means, as a run's seconds add up);
    the checkpoint's rounds (`checkpoint_rounds`) what one checkpoint adds to both beyond the same rounds
    of the mode's period (its writes slow the inner steps beside them and hold up the exchange), which
    the run pays `checkpoints_per_run_round` times a round; what the last round takes beyond a timed
    one counts in `teardown_s`."""
    settle, period = settling_rounds(spec), sync_mode(spec).period()
    checkpointed = spec.training.checkpoint_every - 1
    timed = range(settle, checkpointed)
    last = checkpointed + checkpoint_rounds(spec)

    def beyond_timed(series: dict[int, float]) -> float:
        """What the checkpoint's rounds of `series` add beyond the timed rounds at the same place in the
        mode's period (the timed rounds are whole periods, so each has its like among them)."""
        same_phase = [statistics.fmean(series[t] for t in timed if (t - settle) % period == phase)
                      for phase in range(period)]
        return sum(series[t] - same_phase[(t - settle) % period] for t in range(checkpointed, last))

    steps: dict[str, list[float]] = {}
    overheads: dict[str, list[float]] = {}
    checkpoint_compute: dict[str, list[float]] = {}
    checkpoint_overhead: dict[str, list[float]] = {}
    parts: dict[str, dict[str, list[float]]] = {}
    startups, teardowns = [], []
    for summary in summaries:
        island = spec.learners[summary.learner].island
        ends, compute = round_times[summary.learner], [r["compute_s"] for r in summary.rounds]
        if len(ends) != last + 1 or not timed:
            raise ValueError(f"learner {summary.learner} ran {len(ends)} rounds; a profile times the rounds after "
                             f"the first {settle}, before a checkpoint in round {checkpointed} and the "
                             f"{checkpoint_rounds(spec) - 1} after it, then one more, {last + 1} in all")
        overhead = {t: ends[t] - ends[t - 1] - compute[t] for t in range(settle, last)}
        mine_timed = [overhead[t] for t in timed]
        steps.setdefault(island.name, []).extend(compute[t] / island.inner_steps for t in timed)
        overheads.setdefault(island.name, []).extend(mine_timed)
        checkpoint_compute.setdefault(island.name, []).append(beyond_timed(dict(enumerate(compute))))
        checkpoint_overhead.setdefault(island.name, []).append(beyond_timed(overhead))
        mine = parts.setdefault(island.name, {part: [] for part in ROUND_PARTS})
        for t in timed:
            mine["inner_steps"].append(compute[t])
            mine["sync"].append(summary.rounds[t]["sync_s"])
            exchange = summary.exchanges[t]
            mine["waiting_for_exchange"].append(exchange["blocked_s"])
            for part in ("publish", "receive", "outer_step"):
                mine[part].append(exchange["seconds"][part])
        startups.append(ends[0] - compute[0] - statistics.median(mine_timed))
        last_beyond_timed = ends[last] - ends[last - 1] - compute[last] - statistics.fmean(mine_timed)
        teardowns.append(exits[summary.learner] - ends[last] + max(0.0, last_beyond_timed))
    islands = {learner.island.name: learner.island for learner in spec.learners}
    share = checkpoints_per_run_round
    checkpoint_s = {name: max(0.0, statistics.fmean(checkpoint_compute[name]) + statistics.fmean(v))
                    for name, v in checkpoint_overhead.items()}
    round_parts = {name: {part: statistics.fmean(v) if v else 0.0 for part, v in island_parts.items()}
                   for name, island_parts in parts.items()}
    for name, island_parts in round_parts.items():
        island_parts["checkpoint"] = checkpoint_s[name] * share
    return RunProfile({name: max(0.0, statistics.fmean(v) + statistics.fmean(checkpoint_compute[name]) * share
                                 / islands[name].inner_steps) for name, v in steps.items()},
                      {name: max(0.0, statistics.fmean(v) + statistics.fmean(checkpoint_overhead[name]) * share)
                       for name, v in overheads.items()},
                      max(startups), max(teardowns), round_parts, checkpoint_s,
                      sum(spec.learners[s.learner].tokens_per_round() * len(timed) for s in summaries) /
                      (max(ends[checkpointed - 1] for ends in round_times.values()) -
                       min(ends[settle - 1] for ends in round_times.values())))


def measure_step_seconds(spec: RunSpec, steps: int = 6, timeout_s: float = 600) -> tuple[dict[str, float], float]:
    """Seconds per inner step of each island's learners, measured here with every learner of the run
    stepping at once, each in its own process with the threads a learner process gets, as they
    will share this machine's cores; and the seconds a learner process takes to be ready to step.
    Raises ProfilingFailed as soon as one of the processes fails or dies, ending the others."""
    from infra.launch import threads_per_process

    context = multiprocessing.get_context("spawn")
    start = context.Barrier(len(spec.learners))
    results = context.Queue()
    began = time.monotonic()
    workers = [context.Process(target=_profile_learner,
                               args=(spec.model_dump(mode="json"), slot.index, steps, threads_per_process(spec),
                                     start, results, began))
               for slot in spec.learners]
    for worker in workers:
        worker.start()
    try:
        measured = _results_while_alive(workers, results, began + timeout_s)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
            worker.join()
    per_island: dict[str, list[float]] = {}
    for learner, seconds, _ in measured:
        per_island.setdefault(spec.learners[learner].island.name, []).append(seconds)
    return ({island: statistics.median(times) for island, times in per_island.items()},
            max(ready for _, _, ready in measured))


def _results_while_alive(workers: list, results, deadline: float) -> list[tuple[int, float, float]]:
    """Every worker's measurement (learner, seconds per step, seconds to be ready); a worker's error, or
    its death without a measurement (killed for memory, say), ends the wait at once."""
    measured = []
    while len(measured) < len(workers):
        try:
            learner, seconds, ready = results.get(timeout=0.5)
        except queue.Empty:
            died = next((n for n, worker in enumerate(workers) if worker.exitcode not in (None, 0)), None)
            if died is not None:
                code = workers[died].exitcode
                cause = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                raise ProfilingFailed(f"measuring the inner steps: learner {died}'s process died ({cause})") from None
            if time.monotonic() > deadline:
                raise ProfilingFailed("measuring the inner steps: no measurement within the time allowed") from None
            continue
        if isinstance(seconds, str):  # the worker's error
            raise ProfilingFailed(f"measuring the inner steps: learner {learner}: {seconds}")
        measured.append((learner, seconds, ready))
    return measured


def _profile_learner(raw_spec: dict, learner: int, steps: int, threads: int, start, results, began: float) -> None:
    """One learner's inner steps on random bytes: its model, optimizer, batch and precision. An error is
    sent back as one line, in place of the seconds, for the parent to end the profile with."""
    try:
        _step_learner(raw_spec, learner, steps, threads, start, results, began)
    except threading.BrokenBarrierError:
        pass  # another learner failed, and the parent ends this one
    except Exception as err:  # noqa: BLE001 - whatever ended it, the parent says so and ends the others
        results.put((learner, one_line(err), 0.0))
        start.abort()


def _step_learner(raw_spec: dict, learner: int, steps: int, threads: int, start, results, began: float) -> None:
    from training.model.inner import forward_precision, inner_optimizer, optimizer_step

    spec = parse_spec(raw_spec, "plan")  # the parent checked it for what planning needs
    torch.set_num_threads(threads)
    island = spec.learners[learner].island
    model = build_model(spec)
    optimizer = inner_optimizer(model.parameters(), spec.training.lr, spec.training.weight_decay)
    rows = island.batch_size // island.processes_per_learner
    data = torch.randint(0, 256, (rows, island.seq_len + 1), generator=torch.Generator().manual_seed(learner))
    ready = time.monotonic() - began
    start.wait()
    times = []
    for _ in range(steps + 1):
        step_began = time.perf_counter()
        with forward_precision(torch.device("cpu"), island.precision):
            loss = model.loss(data[:, :-1], data[:, 1:])
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer_step(model, optimizer, spec.training.lr)
        times.append(time.perf_counter() - step_began)
    results.put((learner, statistics.median(times[1:]), ready))  # the first step pays for allocation
