"""A short profiling run: the run's own learners, for a few rounds, on this machine with nothing on a link.

`training.planning.planner.measure_step_seconds` times inner steps alone. A learner's round also spends time
outside them: the exchange's local work (encoding, checksums, the store's requests, the outer step),
its checkpoint, the background work that competes with its compute for cores; and the run spends
time before the first inner step (imports, the spec, its shard) and after the last round (final
checkpoint, summary, exit). Those do not depend on the link, so they are measured here, once, with
every learner of the spec started as the lifecycle starts it (`infra.launch`), all at once, against
a store at local speed, each island's learners on cores of their own as separate sites' would be
(`infra.launch.island_cores`); the planner then adds what the link costs (`plan_run(..., profile=...)`).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from infra.launch import LearnerProcess, island_cores, run_learner, threads_per_process
from infra.spec import RunSpec, parse_spec, spec_sha256
from training.exchange.exchanger import SYNC_MODES, first_crossing
from training.learner.ledger import read_summaries

# At least four timed rounds give each learner four round lengths (`profile_rounds`).
PROFILE_ROUNDS = 5

# A round's parts, as the learners' summaries record them. On the learner's path: its inner steps,
# syncing (queueing its message, applying the exchange), the part of syncing spent waiting for the
# exchange's job, and its checkpoint. On the transport thread, overlapping the next round's inner
# steps unless the learner waits for them: the message's encoding and write, its peers' messages,
# the mix and outer step.
ROUND_PARTS = ("inner_steps", "sync", "waiting_for_exchange", "checkpoint", "publish", "receive", "outer_step")


@dataclass(frozen=True)
class RunProfile:
    step_seconds: dict[str, float]  # per island: an inner step, with the run's background work going on
    # Per island: a round's seconds besides its inner steps, on no link; the mean over whole periods of the
    # mode's crossings after the settling rounds (`profile_rounds`), so a round that crosses islands
    # counts as often as it comes.
    round_overhead_s: dict[str, float]
    startup_s: float  # launch to the first inner step, slowest learner
    # The last round's end to the process's exit, with what the last round takes beyond a timed one
    # (the exchanges still in flight, the final checkpoint), slowest learner.
    teardown_s: float
    # Per island, mean seconds of a round's parts (`ROUND_PARTS`) over the same rounds: where the
    # overhead comes from. Means, so a checkpoint every k rounds counts 1/k of its cost.
    round_parts_s: dict[str, dict[str, float]] = field(default_factory=dict)
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
    return first_crossing(spec) + 1 + (spec.sync.transport.tau > 0)


def profile_rounds(spec: RunSpec, at_least: int = PROFILE_ROUNDS) -> int:
    """The settling rounds (`settling_rounds`), then whole periods of the mode's peers and island
    crossings (`SyncMode.period`), at least `at_least` - 1 timed rounds (a mode that crosses islands
    only every so often spends its rounds unevenly), then the last round, untimed: it waits for the
    exchanges still in flight and writes the final checkpoint, once a run, so it is the teardown's."""
    period = SYNC_MODES[spec.sync.mode].period(spec.sync.transport.fragments, len(spec.learners),
                                               spec.sync.inter_island_every)
    return settling_rounds(spec) + period * math.ceil((at_least - 1) / period) + 1


def profile_run(spec: RunSpec, store: dict | None = None, rounds: int | None = None) -> RunProfile:
    """Run the spec's learners for `rounds` rounds (`profile_rounds` when None) against `store` (a
    run-spec `store` section; by default a fresh local folder) and time them. Capacity windows and
    bandwidth limits are dropped: the profile is of the islands, not of their reservations or their link."""
    from training.data.shards import prepare_dataset
    from training.stages import start_run

    with tempfile.TemporaryDirectory(prefix="archipelago-profile-") as folder:
        raw = spec.model_dump(mode="json")
        raw["store"] = store or {"url": folder}
        raw["sync"]["rounds"] = rounds or profile_rounds(spec)
        raw["sync"]["transport"]["bandwidth"] = {}
        # Nor is it of their keys: a profile's objects live in a throwaway folder.
        raw["signing"] = None
        for island in raw["islands"]:
            island["windows"] = []
            island.pop("store", None)
            island.pop("signing", None)
        profiled = parse_spec(raw)
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
            for done in [pool.submit(learner, slot) for slot in profiled.learners]:
                done.result()
        summaries = read_summaries(profiled, run)
    return summarise(profiled, summaries, round_times, exits)


def summarise(spec: RunSpec, summaries, round_times: dict[int, list[float]], exits: dict[int, float]) -> RunProfile:
    """The profile from each learner's summary (compute per round) and when its rounds ended, timed
    from the end of the last settling round (`settling_rounds`) to the end of the last round but one;
    what the last round takes beyond a timed one counts in `teardown_s`."""
    settle = settling_rounds(spec)
    steps: dict[str, list[float]] = {}
    overheads: dict[str, list[float]] = {}
    parts: dict[str, dict[str, list[float]]] = {}
    startups, teardowns = [], []
    for summary in summaries:
        island = spec.learners[summary.learner].island
        ends, compute = round_times[summary.learner], [r["compute_s"] for r in summary.rounds]
        last = len(ends) - 1
        if last <= settle:
            raise ValueError(f"learner {summary.learner} ran {len(ends)} rounds; a profile times the rounds "
                             f"after the first {settle}, before the last")
        steps.setdefault(island.name, []).extend(c / island.inner_steps for c in compute[settle:last])
        overhead = [ends[t] - ends[t - 1] - compute[t] for t in range(settle, last)]
        overheads.setdefault(island.name, []).extend(overhead)
        mine = parts.setdefault(island.name, {part: [] for part in ROUND_PARTS})
        for r in summary.rounds[settle:last]:
            mine["inner_steps"].append(r["compute_s"])
            mine["sync"].append(r["sync_s"])
            mine["checkpoint"].append(r.get("checkpoint_s", 0.0))
        for exchange in summary.exchanges[settle:last]:
            mine["waiting_for_exchange"].append(exchange["blocked_s"])
            for part in ("publish", "receive", "outer_step"):
                mine[part].append(exchange["seconds"][part])
        startups.append(ends[0] - compute[0] - statistics.median(overhead))
        last_beyond_timed = ends[last] - ends[last - 1] - compute[last] - statistics.fmean(overhead)
        teardowns.append(exits[summary.learner] - ends[last] + max(0.0, last_beyond_timed))
    return RunProfile({name: statistics.median(v) for name, v in steps.items()},
                      {name: max(0.0, statistics.fmean(v)) for name, v in overheads.items()},
                      max(startups), max(teardowns),
                      {name: {part: statistics.fmean(v) if v else 0.0 for part, v in island_parts.items()}
                       for name, island_parts in parts.items()},
                      sum(spec.learners[s.learner].tokens_per_round() * (len(round_times[s.learner]) - 1 - settle)
                          for s in summaries) /
                      (max(ends[-2] for ends in round_times.values()) -
                       min(ends[settle - 1] for ends in round_times.values())))
