"""Plan before renting: what a run's islands and link will deliver, replayed from the learners' own schedule.

Given a run spec, each island's seconds per inner step and the inter-island link's rate, the plan
replays every round of every learner: its inner steps, the fragment the round exchanges and the
peers it exchanges with (`training.exchange.fragments`, the sync mode's `peers`; in hierarchical mode,
in rounds that cross islands, then the other islands' slices of its own slice, then its island's
mixed slices), the exact size of each
message (the run's codec encodes a message of the fragment's size), the wait for peers' messages
and the overlap rule (a round's exchange is applied `tau` inner steps into the next round, the
last round's at once). Transfers across the link queue on it, one direction at a time, in the
order they start; a learner's transport reads its peers one after another. Reads within an
island cost nothing here: each island's store is on its own site.

What it leaves out: store request latency, checkpoint writes, and cores shared by learners on one
machine. `benchmarks/shaped_link.py` measures what those cost and sets the plan beside the measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as save_safetensors

from infra.authority import placeholder_signature
from infra.objects import ObjectRef, json_document
from infra.spec import RunSpec
from training.exchange.fragments import assign_fragments, fragment_of_round
from training.model.registry import build_model
from training.planning.profile import check_profiling_fits_here, measure_step_seconds
from training.planning.windows import Stretch, WindowedClock, windows_plan
from training.exchange.modes import SyncMode, sync_mode
from training.exchange.plan import ROUND, SCATTERED, expected_message, message_key

UTILISATION_GOALS = (0.90, 0.95, 0.99)
# Messages of fragments up to this many elements are encoded for their size; larger ones are sized by
# an affine fit between two encoded sizes (multiples of any scale chunk, so only padding is missed).
_EXACT_UP_TO = 1 << 24
_FIT_SIZES = (1 << 12, 1 << 13)


def fragment_sizes(spec: RunSpec) -> list[int]:
    """Elements of each fragment, from the model's parameter shapes alone (built on the meta
    device, so a plan for billions of parameters allocates nothing)."""
    return [sum(sizes) for sizes in fragment_parameters(spec)]


def fragment_parameters(spec: RunSpec) -> list[list[int]]:
    """Each fragment's parameters' elements, in their order in it, as `fragment_sizes` finds them; kept
    per model and fragment layout, as a plan replays the run for every link it tries and a large model
    takes a second to build even on the meta device."""
    transport = spec.sync.transport
    key = json.dumps([spec.model.model_dump(mode="json"), spec.vocab_size, spec.max_seq_len, transport.fragments,
                      transport.layout], sort_keys=True)
    if key not in _FRAGMENT_PARAMETERS:
        with torch.device("meta"):
            model = build_model(spec)
        _FRAGMENT_PARAMETERS[key] = fragment_parameters_of(model, spec)
    return [list(sizes) for sizes in _FRAGMENT_PARAMETERS[key]]


_FRAGMENT_PARAMETERS: dict[str, list[list[int]]] = {}


def fragment_sizes_of(model: torch.nn.Module, spec: RunSpec) -> list[int]:
    """Elements of each fragment of `model`, dealt as the spec's transport deals them."""
    return [sum(sizes) for sizes in fragment_parameters_of(model, spec)]


def fragment_parameters_of(model: torch.nn.Module, spec: RunSpec) -> list[list[int]]:
    """Each fragment's parameters' elements in `model`, in flat-parameter order (`FragmentLayout`'s)."""
    named = [(name, p.numel()) for name, p in model.named_parameters()]
    owner = assign_fragments(named, model.block_of, spec.sync.transport.fragments, spec.sync.transport.layout)
    return [[numel for name, numel in named if owner[name] == f] for f in range(spec.sync.transport.fragments)]


def message_bytes(spec: RunSpec, numel: int, learner: int = 0, round_index: int = 0, kind: str = ROUND) -> int:
    """Bytes a learner reads for one peer's message of `kind` of a fragment of `numel` elements (a
    hierarchical crossing's and mixed slice's: of a slice of `numel` elements): the tensors as the
    message's codec (`SyncMode.codec`) encodes them, and the JSON commit that points at them."""
    settings, mode = spec.sync.transport, sync_mode(spec)
    codec = mode.codec(kind)
    expected = expected_message(mode, learner, round_index, numel, kind)

    def tensors(n: int) -> int:
        payload: dict[str, torch.Tensor] = {}
        for name in expected.fields:
            # As `Exchanger.publish` encodes them: anchors are never sparsified.
            payload.update({name: torch.zeros(n)} if codec.lossless else
                           codec.encode(name, torch.zeros(n), sparsify=name != "anchor"))
        return len(save_safetensors(payload))

    if numel <= _EXACT_UP_TO:
        nbytes = tensors(numel)
    else:  # too large to encode here: affine in the elements, up to a chunk's padding
        small, large = (tensors(n) for n in _FIT_SIZES)
        nbytes = round(small + (large - small) / (_FIT_SIZES[1] - _FIT_SIZES[0]) * (numel - _FIT_SIZES[0]))
    key = message_key(settings.fragments, learner, round_index, kind,
                      shard=mode.position(learner) if kind == SCATTERED else None)
    commit = {"tensors": ObjectRef(f"{key}.safetensors", "0" * 64, nbytes).to_json(), **expected.metadata()}
    signature = None if spec.signing is None else placeholder_signature(spec.learners[learner].island.name)
    return nbytes + len(json_document(commit, signature=signature))


@dataclass(frozen=True)
class MessageSizes:
    """Bytes of each message a run's rounds write: per kind of message (`training.exchange.plan`), per
    fragment, per learner (a hierarchical crossing's carry a learner's slice of the fragment)."""

    bytes: dict[str, list[list[int]]]
    mode: SyncMode  # whose messages they are: the plan replays its phases

    @classmethod
    def of(cls, spec: RunSpec, mode: SyncMode) -> "MessageSizes":
        """The messages of `mode` (built with its fragments' sizes) over a period of its rounds."""
        kinds = {phase.kind for t in range(mode.period()) for phase in mode.phases(0, t)}
        sizes = {kind: [[message_bytes(spec, end - start, learner, round_index=fragment, kind=kind)
                         for learner in range(mode.topology.learners)
                         for start, end in [mode.span(fragment, learner, kind)]]
                        for fragment in range(mode.fragments)] for kind in sorted(kinds - {ROUND})}
        # Every learner's round message of a fragment is sized as learner 0's of round 0: theirs differ
        # only in a few characters of their commits.
        sizes[ROUND] = [[message_bytes(spec, size)] * mode.topology.learners for size in mode.fragment_sizes]
        return cls(sizes, mode)


def message_requests(spec: RunSpec, nbytes: int) -> int:
    """Store requests to write one message of `nbytes`: its parts (one object up to
    `sync.transport.chunk_bytes`) and its commit. A reader makes one request fewer: the poll that
    finds the commit brings it."""
    return math.ceil(nbytes / spec.sync.transport.chunk_bytes) + 1


@dataclass
class LearnerPlan:
    """One learner's replayed run: its seconds computing and blocked, when each round ended, its bytes."""

    learner: int
    island: str
    compute_s: float = 0.0
    blocked_s: float = 0.0
    round_ends: list[float] = field(default_factory=list)
    bytes_written: int = 0
    bytes_read: dict[str, int] = field(default_factory=lambda: {"inter": 0, "intra": 0})
    requests: int = 0  # PUTs and GETs of messages and their commits, as `training.exchange.transport` counts them
    polls: int = 0  # GETs of peers' commits, one per message read: a reader that waits makes more
    paused_s: float = 0.0  # between its island's capacity windows after its first round: no capacity to use
    windows: list[Stretch] = field(default_factory=list)  # its rounds and waits in each of its island's windows


def replay(spec: RunSpec, step_seconds: dict[str, float], link_bps: float,
           sizes: MessageSizes | None = None, round_overhead_s: dict[str, float] | None = None) -> list[LearnerPlan]:
    """Every learner's rounds on this link: when each computes, waits and finishes; with capacity
    windows, each computes only inside its island's (`training.planning.windows`)."""
    slots = spec.learners
    sizes = sizes or MessageSizes.of(spec, sync_mode(spec, fragment_parameters(spec)))
    settings, mode = spec.sync.transport, sizes.mode
    links_of = [mode.topology.links(s.index) for s in slots]
    plans = [LearnerPlan(s.index, s.island.name) for s in slots]
    windows = [WindowedClock(spec, plan) for plan in plans]
    clock = [0.0] * len(slots)
    pending: list[float | None] = [None] * len(slots)  # when the previous round's exchange is complete
    busy_until: dict[tuple[str, str], float] = {}  # the link, each direction

    def read(ready: list[float], published: list[float], sources: list[list[int]], size_of: list[int],
             writes: list[bool] | None = None, addressed: bool = False) -> None:
        """Each learner writes its message (`size_of[learner]` bytes, committed at `published`; where
        `writes` says so) and reads its sources', one after another from when it is `ready`; the link
        carries one transfer a direction at a time. `addressed`: each source writes the reader a message
        of its own (`size_of[reader]` bytes), read by it alone."""
        transfers = sorted(((published[me], me, peer) for me in range(len(slots)) for peer in sources[me]),
                           key=lambda item: (max(item[0], published[item[2]]), item[1]))
        for _, me, peer in transfers:
            nbytes = size_of[me if addressed else peer]
            if addressed:
                plans[peer].bytes_written += nbytes
                plans[peer].requests += message_requests(spec, nbytes)
            start = max(ready[me], published[peer])
            if links_of[me][peer] == "inter":
                direction = (slots[peer].island.name, slots[me].island.name)
                start = max(start, busy_until.get(direction, 0.0))
                busy_until[direction] = start + nbytes * 8 / link_bps
                ready[me] = busy_until[direction]
            else:
                ready[me] = start
            plans[me].bytes_read[links_of[me][peer]] += nbytes
            plans[me].requests += message_requests(spec, nbytes) - 1
            plans[me].polls += 1
        for plan in plans:
            if not addressed and (writes is None or writes[plan.learner]):
                plan.bytes_written += size_of[plan.learner]
                plan.requests += message_requests(spec, size_of[plan.learner])

    for t in range(spec.sync.rounds):
        sent = []
        for s, plan in zip(slots, plans):
            clock[s.index] = windows[s.index].begin_round(clock[s.index])
            steps, per_step = s.island.inner_steps, step_seconds[s.island.name]
            compute = steps * per_step
            blocked = max(0.0, pending[s.index] - (clock[s.index] + min(settings.tau, steps) * per_step)) \
                if pending[s.index] is not None else 0.0
            clock[s.index] += compute + blocked
            plan.compute_s += compute
            plan.blocked_s += blocked
            sent.append(clock[s.index])
        fragment = fragment_of_round(t, settings.fragments)
        ready = list(sent)
        # Each phase's messages are committed once the phase before it is read (in hierarchical mode, a
        # crossing's slice once its island's mean is taken, then the slice's mix).
        for phases in zip(*(mode.phases(s.index, t) for s in slots)):
            read(ready, list(ready), [phase.sources for phase in phases], sizes.bytes[phases[0].kind][fragment],
                 writes=[phase.writes for phase in phases], addressed=phases[0].kind == SCATTERED)
        for s, plan in zip(slots, plans):
            if settings.tau == 0 or t == spec.sync.rounds - 1:
                wait = max(0.0, ready[s.index] - clock[s.index])
                clock[s.index] += wait
                plan.blocked_s += wait
                pending[s.index] = None
            else:
                pending[s.index] = ready[s.index]
            # The round's work besides inner steps and the link (profiled: `training.planning.profile`).
            clock[s.index] += (round_overhead_s or {}).get(s.island.name, 0.0)
            plan.round_ends.append(clock[s.index])
            windows[s.index].end_round()
    return plans


def steady_utilisation(plans: list[LearnerPlan]) -> float:
    """Compute over wall from the end of each learner's first round to the end of its last, as the
    shaped-link bench measures it; time between capacity windows is not wall a learner is rented for."""
    computing = sum(p.compute_s * (len(p.round_ends) - 1) / len(p.round_ends) for p in plans)
    return min(1.0, computing / sum(p.round_ends[-1] - p.round_ends[0] - p.paused_s for p in plans))


def bandwidth_for(spec: RunSpec, step_seconds: dict[str, float], goal: float,
                  sizes: MessageSizes | None = None, round_overhead_s: dict[str, float] | None = None) -> float | None:
    """The slowest link (bit/s) at which the run keeps `goal` utilisation; None when even an
    unlimited link does not (the islands wait on each other's compute, or on their own rounds'
    overhead). `sizes`: the run's messages' bytes (`MessageSizes.of`),
    when the caller has them."""
    sizes = sizes or MessageSizes.of(spec, sync_mode(spec, fragment_parameters(spec)))

    def utilisation(link_bps: float) -> float:
        return steady_utilisation(replay(spec, step_seconds, link_bps, sizes, round_overhead_s))

    if utilisation(1e18) < goal:
        return None
    low, high = 1e3, 1e15
    for _ in range(60):  # bisection in log space: 60 halvings of a factor of 1e12 leave 1e-7 of it
        mid = math.sqrt(low * high)
        low, high = (mid, high) if utilisation(mid) < goal else (low, mid)
    return high


def plan_run(spec: RunSpec, step_seconds: dict[str, float], link_bps: float, startup_s: float = 0.0,
             round_overhead_s: dict[str, float] | None = None, teardown_s: float = 0.0) -> dict:
    """The plan of a run: per island and for the run, compute, bytes per link class, time blocked on
    the link, utilisation, wall time, and the link needed for each utilisation goal. `startup_s`,
    `round_overhead_s` (per island) and `teardown_s`: what a run spends besides inner steps and the
    link, from a profiling run (`training.planning.profile`); zero when not profiled."""
    missing = sorted({s.island.name for s in spec.learners} - set(step_seconds))
    if missing:
        raise ValueError(f"no seconds per inner step for island(s) {', '.join(missing)}")
    parameters = fragment_parameters(spec)
    fragments = [sum(sizes) for sizes in parameters]
    sizes = MessageSizes.of(spec, sync_mode(spec, parameters))
    plans = replay(spec, step_seconds, link_bps, sizes, round_overhead_s)
    islands = {}
    for island in spec.islands:
        mine = [p for p in plans if p.island == island.name]
        islands[island.name] = {
            "learners": len(mine), "step_seconds": step_seconds[island.name],
            "compute_s": sum(p.compute_s for p in mine) / len(mine),
            "blocked_s": sum(p.blocked_s for p in mine) / len(mine),
            "bytes_written_per_round": sum(p.bytes_written for p in mine) / spec.sync.rounds,
            "bytes_read_per_round": {c: sum(p.bytes_read[c] for p in mine) / spec.sync.rounds for c in ("inter", "intra")},
            "utilisation": steady_utilisation(mine)}
    inter = sum(p.bytes_read["inter"] for p in plans)
    return {
        "link_bps": link_bps, "rounds": spec.sync.rounds, "learners": len(plans),
        "parameters": sum(fragments), "fragment_sizes": fragments,
        "islands": islands,
        "exchange_bytes": {"inter": inter, "intra": sum(p.bytes_read["intra"] for p in plans)},
        "blocked_s": sum(p.blocked_s for p in plans),
        "utilisation": steady_utilisation(plans),
        "wall_s": startup_s + max(p.round_ends[-1] for p in plans) + teardown_s,
        "overheads": {"startup_s": startup_s, "round_overhead_s": round_overhead_s or {}, "teardown_s": teardown_s},
        "windows": windows_plan(spec, plans),
        "bandwidth_for_utilisation": {f"{goal:.2f}": bandwidth_for(spec, step_seconds, goal, sizes, round_overhead_s)
                                      for goal in UTILISATION_GOALS},
    }


def plan_data_parallel(spec: RunSpec, step_seconds: float, link_bps: float, startup_s: float = 0.0,
                       teardown_s: float = 0.0) -> dict:
    """Standard training of the same model and tokens across the same link, for comparison: one rank
    per island, the fp32 gradient all-reduced over the link after every step (a ring sends 2(n-1)/n of
    it each way), not overlapped with the step's compute. `step_seconds`: one rank's forward,
    backward and optimizer step on its island's share of the global batch."""
    from training.baseline import BaselinePlan

    steps, ranks = BaselinePlan.of(spec).steps, len(spec.islands)
    parameters = sum(fragment_sizes(spec))
    each_way = 2 * (ranks - 1) / ranks * parameters * 4
    communicate = each_way * 8 / link_bps
    return {"steps": steps, "ranks": ranks, "step_seconds": step_seconds, "bytes_each_way_per_step": each_way,
            "exchange_bytes": {"inter": round(steps * each_way * ranks)},
            "utilisation": step_seconds / (step_seconds + communicate),
            "wall_s": startup_s + steps * (step_seconds + communicate) + teardown_s}


def complete_step_seconds(spec: RunSpec, given: dict[str, float]) -> tuple[dict[str, float], float | None]:
    """`given` seconds per inner step, with every island it leaves out measured here; and the
    seconds a learner takes to be ready to step, when anything was measured."""
    if all(island.name in given for island in spec.islands):
        return dict(given), None
    check_profiling_fits_here(spec, given, profile_run=False)
    measured, ready_s = measure_step_seconds(spec)
    return {**measured, **given}, ready_s
