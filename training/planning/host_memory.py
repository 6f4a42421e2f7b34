"""Memory per host: whether the hosts of the islands' learners hold what lives there, before any work.

The host of a learner's rank 0 holds (`learner_host`):
  * the exchange's state, as `training.exchange` keeps it (`exchange_state`): the run's initial weights
    (compressed anchors travel as their difference from them), every fragment's anchor, the outer
    optimizer's parameter-shaped copy of them, its state (Nesterov's momentum, or Shampoo's momentum,
    graft and per-block statistics and preconditioners) and the snapshot of that state checkpoints are
    written from, the error-feedback residual of both message fields when compression is lossy (in
    hierarchical mode a crossing's one field, its rounds' messages going exact). With a sharded outer
    step (`sync.shard_outer_step`) the outer optimizer's copy, state and snapshot are of the learner's
    shard only, about 1/n of them for a group of n learners sharing an anchor. Every rank of the
    learner on that host keeps all of it: each builds the learner's exchanger, and a resume restores
    the state into each, though only rank 0 exchanges;
  * both of what comes and goes, as they overlap (a checkpoint is written in the background while the
    next exchange is in flight):
      - a staged checkpoint (`checkpoint_staging`): copies of the weights, the inner moments, the
        anchors and the residual;
      - an exchange in flight (`exchange_in_flight`), at the largest fragment's size: the weights as
        sent and the pseudo-gradient, a lossy message's fields as decoded and their new residuals, each
        peer's fields decoded, the outer step's gradient, new anchor and its copy, and the fragment's
        share of the outer state's new snapshot;
  * under device cpu, its ranks themselves, each at its peak (`training.planning.memory.rank_memory`).

A learner's host is checked against its island's `host_memory_gb`. Islands that leave it empty run
here: all their learners share this host, whose memory (`this_host_bytes`) is checked against their
sum. Left out: Python and torch themselves (a few hundred MB a process) and the control plane's own
work (Prefect, data preparation, standard training after the islands).
"""

from __future__ import annotations

import os
from pathlib import Path

from infra.spec import RunSpec
from infra.spec.island import IslandSpec
from training.exchange.modes import sync_mode
from training.planning.memory import FP32, GB, ModelSizes, gigabytes, model_sizes

# Where a container's memory limit is, under cgroup v2 and v1.
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
HERE = "this host"


def this_host_bytes() -> int:
    """The memory of the host this runs on: its physical memory, or its container's limit if lower."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in CGROUP_LIMITS:
        text = limit.read_text().strip() if limit.is_file() else "max"
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def residual_bytes(spec: RunSpec, parameters: int) -> int:
    """The error-feedback residual: one vector per message field, kept only where feedback is on and the
    codec drops something (`training.exchange.compression.ErrorFeedback`)."""
    mode = sync_mode(spec)
    lossy = spec.sync.transport.error_feedback and not mode.run_codec.lossless
    return len(mode.residual_fields()) * FP32 * parameters if lossy else 0


def outer_shards(spec: RunSpec, island: IslandSpec | None = None) -> int:
    """How many learners share the outer step of `island`'s learners (the first island's if None): with
    `sync.shard_outer_step` in a mode whose learners share an anchor, each keeps about that share of the
    outer optimizer's parameters and state (its shard is whole parameters: a share of them, not exactly)."""
    mode = sync_mode(spec)
    me = next(slot.index for slot in spec.learners if island is None or slot.island.name == island.name)
    return len(mode.anchor_group(me)) if mode.sharded else 1


def exchange_state(spec: RunSpec, sizes: ModelSizes, island: IslandSpec | None = None) -> dict[str, int]:
    """The exchange's state one rank of one of `island`'s learners keeps, by part (see the module's docstring)."""
    vector, shards = FP32 * sizes.parameters, outer_shards(spec, island)
    return {"initial weights": vector, "anchors": vector, "outer parameters": vector // shards,
            "outer state": FP32 * sizes.outer_state // shards, "outer state snapshot": FP32 * sizes.outer_state // shards,
            "error-feedback residual": residual_bytes(spec, sizes.parameters)}


def checkpoint_staging(spec: RunSpec, sizes: ModelSizes) -> int:
    """What a checkpoint stages on rank 0's host: the weights, both inner moments, the anchors (unless
    one fragment with nothing in flight makes them the weights) and the residual."""
    transport = spec.sync.transport
    anchors_checkpointed = transport.fragments > 1 or transport.tau > 0
    return FP32 * sizes.parameters * (3 + anchors_checkpointed) + residual_bytes(spec, sizes.parameters)


def peers_per_exchange(spec: RunSpec, island: IslandSpec) -> int:
    """The most peers whose messages a learner of `island` holds at once, over the mode's period."""
    mode = sync_mode(spec)
    me = next(slot.index for slot in spec.learners if slot.island.name == island.name)
    return max(len(mode.peers(me, t)) for t in range(mode.period()))


def exchange_in_flight(spec: RunSpec, island: IslandSpec, sizes: ModelSizes) -> int:
    """What one exchange holds on rank 0's host while it is in flight (see the module's docstring)."""
    mode = sync_mode(spec)
    fields = len(mode.fields)
    decoded = 0 if mode.run_codec.lossless else fields  # lossless: the fields themselves
    residuals = fields if residual_bytes(spec, 1) else 0
    vectors = 2 + decoded + residuals + peers_per_exchange(spec, island) * fields + 3
    outer_share = sizes.outer_state * sizes.largest_fragment // sizes.parameters // outer_shards(spec, island)
    return FP32 * (vectors * sizes.largest_fragment + outer_share)


def learner_host(spec: RunSpec, island: IslandSpec, sizes: ModelSizes, rank_peak: int,
                 ranks: int | None = None) -> dict[str, int]:
    """Bytes the host of one of `island`'s learners' rank 0 holds, by part; `rank_peak`: one rank's
    peak, which lives on the host under device cpu; `ranks`: the learner's ranks on that host, if not
    the island's processes per node."""
    ranks = ranks or island.processes_per_node
    state = sum(exchange_state(spec, sizes, island).values())
    return {"ranks on cpu": ranks * rank_peak if island.device == "cpu" else 0,
            "exchange state": state, "other ranks' exchange state": (ranks - 1) * state,
            "checkpoint staging": checkpoint_staging(spec, sizes),
            "exchange in flight": exchange_in_flight(spec, island, sizes)}


def host_groups(spec: RunSpec) -> dict[str, list[IslandSpec]]:
    """The hosts checked: this host, shared by the learners of every island without `host_memory_gb`,
    and each other island's learner host."""
    groups = {HERE: [island for island in spec.islands if island.host_memory_gb is None]}
    groups.update({island.name: [island] for island in spec.islands if island.host_memory_gb is not None})
    return {name: islands for name, islands in groups.items() if islands}


def host_need(spec: RunSpec, host: str, islands: list[IslandSpec], sizes: ModelSizes, rank_peaks: dict[str, int],
              ranks: int | None = None) -> int:
    """Bytes `host` holds: this host the learners of all its islands, an island's host one learner
    (with `ranks` of its ranks there, if given)."""
    return sum(sum(learner_host(spec, island, sizes, rank_peaks[island.name], ranks).values())
               * (island.learners if host == HERE else 1) for island in islands)


def host_plan(spec: RunSpec, sizes: ModelSizes, rank_peaks: dict[str, int]) -> dict:
    """Every island's learner host by part, and each host of `host_groups` against its memory, with
    what would fit one that does not fit. `rank_peaks`: a rank's peak per island."""
    hosts = {}
    for name, islands in host_groups(spec).items():
        memory = this_host_bytes() if name == HERE else int(islands[0].host_memory_gb * GB)
        need = host_need(spec, name, islands, sizes, rank_peaks)
        hosts[name] = {"islands": [island.name for island in islands], "memory_bytes": memory, "need_bytes": need,
                       "learners": sum(island.learners for island in islands) if name == HERE else 1,
                       "fits": need <= memory,
                       "to_fit": None if need <= memory else
                       what_would_fit_host(spec, name, islands, memory, rank_peaks)}
    return {"exchange_state": exchange_state(spec, sizes),
            "islands": {island.name: {"host": HERE if island.host_memory_gb is None else island.name,
                                      "ranks": island.processes_per_node,
                                      "parts": learner_host(spec, island, sizes, rank_peaks[island.name])}
                        for island in spec.islands},
            "hosts": hosts}


def what_would_fit_host(spec: RunSpec, host: str, islands: list[IslandSpec], memory: int,
                        rank_peaks: dict[str, int]) -> str:
    """What would make `host` hold its learners, as a sentence: the first that fits of one rank of a
    learner per host (no other ranks' copies of the exchange's state), the Nesterov outer optimizer in
    place of Shampoo, and both; else what it needs even with both."""
    changes = {}  # what to change -> (the spec, the ranks per host) it gives
    if host != HERE and islands[0].processes_per_node > 1:
        changes[f"nodes_per_learner: {islands[0].processes_per_learner} (one rank per host)"] = (spec, 1)
    if spec.sync.outer.name == "shampoo":
        changes["sync.outer.name: nesterov"] = (spec.model_copy(update={"sync": spec.sync.model_copy(update={
            "outer": spec.sync.outer.model_copy(update={"name": "nesterov"})})}), None)
    if len(changes) == 2:
        changes[" and ".join(changes)] = (changes["sync.outer.name: nesterov"][0], 1)
    need = None
    for change, (other, ranks) in changes.items():
        need = host_need(other, host, islands, model_sizes(other), rank_peaks, ranks)
        if need <= memory:
            return f"{change} needs {gigabytes(need)} GB"
    even = f"even {change} needs {gigabytes(need)} GB" if need is not None else "nothing in the spec lowers it"
    if host == HERE:
        return f"{even}: fewer learners here, or host_memory_gb for islands whose learners run on other hosts"
    return f"{even}: hosts with more memory"


def learner_host_text(island: dict) -> str:
    """A learner host's parts (`host_plan`'s entry for an island), in words."""
    parts, ranks = island["parts"], island["ranks"]
    state = gigabytes(parts["exchange state"])
    on_cpu = gigabytes(parts["ranks on cpu"])
    words = [f"its {ranks} ranks on cpu {on_cpu}" if ranks > 1 else f"its rank on cpu {on_cpu}"] \
        if parts["ranks on cpu"] else []
    words.append(f"the exchange's state {state} on each of its {ranks} ranks there" if ranks > 1
                 else f"the exchange's state {state}")
    transient = ("checkpoint staging", "exchange in flight")
    return ", ".join(words + [f"{part} {gigabytes(parts[part])}" for part in transient])


def host_refusals(plan: dict) -> list[str]:
    """Why each host of a host plan (`host_plan`) cannot hold its learners: its figures, part by part
    for a learner of each of its islands, and what would fit."""
    problems = []
    for name, host in plan["hosts"].items():
        if host["fits"]:
            continue
        if name == HERE:
            where = f"this host: the {host['learners']} learners of islands {', '.join(host['islands'])} need "
            parts = "; ".join(f"a learner of {island}: {learner_host_text(plan['islands'][island])}"
                              for island in host["islands"])
        else:
            where, parts = f"island {name}: a learner's host needs ", learner_host_text(plan["islands"][name])
        problems.append(f"{where}{gigabytes(host['need_bytes'])} GB of host memory, it has "
                        f"{gigabytes(host['memory_bytes'])} GB ({parts}); {host['to_fit']}")
    return problems
