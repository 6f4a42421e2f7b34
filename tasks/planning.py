"""The planner's figures as Prefect artifacts: a plan asked for from the UI, and the plan of a
finished run set beside what it measured."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact

from eval.figures import data_url, windows_timeline
from infra.spec import RunSpec
from training.learner.ledger import LearnerSummary
from training.planning.fit import memory_plan, refuse_unfit
from training.planning.markdown import memory_markdown, plan_markdown, windows_markdown
from training.planning.planner import plan_run
from training.planning.windows import WindowsTooShort, without_windows


def publish_memory(spec: RunSpec, key: str) -> dict:
    """The memory plan of a spec's islands, as Markdown artifact `key`."""
    memory = memory_plan(spec)
    create_markdown_artifact(memory_markdown(memory), key=key, description=f"Memory per rank of {spec.name}'s islands")
    return memory


def check_memory(spec: RunSpec) -> None:
    """Before any training: refuse a run whose ranks would not fit the accelerators of islands that set
    device_memory_gb, or whose learners would not fit their hosts (`training.planning.fit.MemoryRefused`,
    naming each island or host and what would fit), with the memory plan as artifact `memory`."""
    refuse_unfit(spec, publish_memory(spec, "memory"))


def publish_plan(spec: RunSpec, step_seconds: dict[str, float], link_bps: float, key: str, description: str,
                 measured: dict | None = None) -> dict:
    """The plan as artifact `key`, and with capacity windows `key`-windows (table) and `key`-timeline
    (figure). With `measured`, the run is over: a plan whose windows cannot hold it at the measured
    step times is published without them rather than failing the run's report."""
    try:
        result = plan_run(spec, step_seconds, link_bps)
    except WindowsTooShort as err:
        if measured is None:
            raise
        get_run_logger().warning("planned without capacity windows: %s", err)
        result = plan_run(without_windows(spec), step_seconds, link_bps)
    create_markdown_artifact(plan_markdown(result, measured), key=key, description=description)
    if result["windows"]:
        create_markdown_artifact(windows_markdown(result["windows"]), key=f"{key}-windows",
                                 description=f"{description}: rounds and waits per capacity window")
        create_image_artifact(data_url(windows_timeline(result["windows"])), key=f"{key}-timeline",
                              description=f"{description}: timeline of the capacity windows")
    return result


def measured_step_seconds(spec: RunSpec, summaries: list[LearnerSummary]) -> dict[str, float]:
    """Each island's seconds per inner step as its learners measured them (compute per round over steps)."""
    steps: dict[str, list[float]] = {}
    for s in summaries:
        island = next(i for i in spec.islands if i.name == s.island)
        steps.setdefault(s.island, []).extend(r["compute_s"] / island.inner_steps for r in s.rounds)
    return {island: sum(values) / len(values) for island, values in steps.items()}
