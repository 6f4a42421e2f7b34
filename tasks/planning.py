"""The planner's figures as Prefect artifacts: a plan asked for from the UI, and the plan of a
finished run set beside what it measured."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from infra.spec import RunSpec
from training.ledger import LearnerSummary
from training.planner import plan_run

UNLIMITED_BPS = 1e18


def plan_markdown(result: dict, measured: dict | None = None) -> str:
    """A plan as Markdown: per island, for the run, and the link each utilisation goal needs;
    with `measured` (utilisation, inter-island bytes), the run's own figures beside the plan's."""
    link = "unlimited" if result["link_bps"] >= UNLIMITED_BPS else f"{result['link_bps'] / 1e9:g} Gbit/s"
    lines = [f"**{result['learners']} learners, {result['parameters']:,} parameters, {result['rounds']} rounds, "
             f"inter-island link {link}**", "",
             "| island | s per inner step | compute s | blocked s | inter-island MB per round | utilisation |",
             "|---|---|---|---|---|---|"]
    for name, island in result["islands"].items():
        lines.append(f"| {name} | {island['step_seconds']:.4f} | {island['compute_s']:.1f} | {island['blocked_s']:.1f} | "
                     f"{island['bytes_read_per_round']['inter'] / 1e6:.3f} | {island['utilisation']:.1%} |")
    lines += ["", f"Run: utilisation {result['utilisation']:.1%}, wall {result['wall_s']:.1f} s, inter-island "
                  f"{result['exchange_bytes']['inter']:,} bytes.", ""]
    for goal, bps in result["bandwidth_for_utilisation"].items():
        need = f"{bps / 1e9:.3g} Gbit/s" if bps else "not reachable: the islands wait on each other's compute"
        lines.append(f"- link for {float(goal):.0%} utilisation: {need}")
    if measured:
        lines += ["", "| | planned | measured |", "|---|---|---|",
                  f"| utilisation (compute / (compute + sync)) | {result['utilisation']:.1%} | "
                  f"{measured['utilisation']:.1%} |",
                  f"| inter-island exchange bytes | {result['exchange_bytes']['inter']:,} | "
                  f"{measured['inter_island_bytes']:,} |"]
    return "\n".join(lines)


def publish_plan(spec: RunSpec, step_seconds: dict[str, float], link_bps: float, key: str, description: str,
                 measured: dict | None = None) -> dict:
    result = plan_run(spec, step_seconds, link_bps)
    create_markdown_artifact(plan_markdown(result, measured), key=key, description=description)
    return result


def measured_step_seconds(spec: RunSpec, summaries: list[LearnerSummary]) -> dict[str, float]:
    """Each island's seconds per inner step as its learners measured them (compute per round over steps)."""
    steps: dict[str, list[float]] = {}
    for s in summaries:
        island = next(i for i in spec.islands if i.name == s.island)
        steps.setdefault(s.island, []).extend(r["compute_s"] / island.inner_steps for r in s.rounds)
    return {island: sum(values) / len(values) for island, values in steps.items()}
