"""Whether a run fits its memory, before any work: the memory plan, per rank of every island
(`training.planning.memory`) and per host (`training.planning.host_memory`), and the refusal of a run
that does not fit, with the plan's figures and what would fit."""

from __future__ import annotations

from infra.spec import RunSpec, SpecError
from training.planning.host_memory import host_plan, host_refusals
from training.planning.memory import gigabytes, island_memory, model_shape, model_sizes


class MemoryRefused(SpecError):
    """A run whose ranks would not fit their accelerators' memory, or whose fit cannot be checked, or
    whose learners would not fit their hosts' memory; names each island or host, what it needs, what
    it has and what would make it fit."""


def memory_plan(spec: RunSpec) -> dict:
    """Memory per rank of every island, and per host (`training.planning.host_memory.host_plan`)."""
    sizes, shape = model_sizes(spec), model_shape(spec)
    islands = {island.name: island_memory(spec, island, sizes, shape) for island in spec.islands}
    return {"parameters": sizes.parameters, "active_parameters": sizes.active, "islands": islands,
            "host": host_plan(spec, sizes, {name: island["peak_bytes"] for name, island in islands.items()})}


def refusals(spec: RunSpec, plan: dict) -> list[str]:
    """Why a memory plan's run cannot run: an island's ranks do not fit their accelerators, or their
    fit cannot be checked; a host does not hold its learners."""
    problems = []
    for name, island in plan["islands"].items():
        if island["device_memory_gb"] is not None and not island["activations_estimated"]:
            problems.append(f"island {name}: device_memory_gb is set, but the activations of model kind "
                            f"{spec.model.kind!r} cannot be estimated here (byte_gpt and transformers only); "
                            "leave device_memory_gb empty")
        elif island["fits"] is False:
            rank = island["rank"]
            options = f" with {' and '.join(rank['options'])}" if rank["options"] else ""
            problems.append(f"island {name}: {rank['parallelism']} over {rank['processes']} processes{options} "
                            f"needs {gigabytes(island['peak_bytes'])} GB per rank, its accelerators have "
                            f"{island['device_memory_gb']:g} GB; {island['to_fit']}")
    return problems + host_refusals(plan["host"])


def refuse_unfit(spec: RunSpec, plan: dict) -> None:
    """Raise MemoryRefused if the run of a memory plan cannot run (`refusals`)."""
    problems = refusals(spec, plan)
    if problems:
        raise MemoryRefused("; ".join(problems))


def check_fits(spec: RunSpec) -> dict:
    """The spec's memory plan; raise MemoryRefused if its ranks do not fit the accelerators of islands
    that set `device_memory_gb`, or a host does not hold its learners."""
    plan = memory_plan(spec)
    refuse_unfit(spec, plan)
    return plan
