"""The planner's figures as Markdown: what `archipelago plan` and `archipelago run` print, and what the
lifecycle publishes as Prefect artifacts (tasks/planning.py)."""

from __future__ import annotations

from datetime import datetime

from training.planning.host_memory import HERE
from training.planning.memory import gigabytes, sequences
from training.planning.windows import rounds_text

# A link this fast is shown as unlimited: what the planner is given when a run sets no bandwidth.
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


# The parts of a rank's memory as `training.planning.memory.rank_memory` names them, in the table's order.
RESIDENT = ("weights", "gradients", "inner optimizer")
FORWARD_BACKWARD = ("activations", "gathered layers", "bf16 weight copies")


HOST_PARTS = ("ranks on cpu", "exchange state", "other ranks' exchange state", "checkpoint staging",
              "exchange in flight")


def memory_markdown(memory: dict) -> str:
    """A memory plan (`training.planning.fit.memory_plan`) as Markdown: per island, a rank's device
    memory by part and whether it fits, and what the other parallelism would need; per island, its
    learners' host memory by part, and whether each host fits."""
    lines = ["**Memory per rank, GB (10^9 bytes): what stays, plus the largest of what comes and goes "
             "(forward and backward, the optimizer step, applying an exchange)**", "",
             "| island | parallelism | processes | sequences per rank | " + " | ".join(RESIDENT + FORWARD_BACKWARD)
             + " | optimizer step | exchange | peak | device | fits |", "|" + "---|" * 15]
    notes = []
    for name, island in memory["islands"].items():
        rank = island["rank"]
        passes = rank["transient"]["forward and backward"]
        cells = [name, ", ".join([rank["parallelism"], *rank["options"]]), str(rank["processes"]), str(rank["rows"]),
                 *(gigabytes(rank["resident"][part]) for part in RESIDENT),
                 *(gigabytes(passes[part]) if part in passes else "-" for part in FORWARD_BACKWARD),
                 *(gigabytes(sum(rank["transient"][phase].values())) if phase in rank["transient"] else "-"
                   for phase in ("optimizer step", "applying an exchange")),
                 gigabytes(island["peak_bytes"]),
                 "-" if island["device_memory_gb"] is None else f"{island['device_memory_gb']:g}",
                 {None: "not checked", True: "yes", False: "no"}[island["fits"]]]
        lines.append("| " + " | ".join(cells) + " |")
        other = island["other_parallelism"]
        fewest = island["fewest_fsdp_processes"]
        notes.append(f"- {name}: {other['parallelism']} over {other['processes']} processes would need "
                     f"{gigabytes(other['peak_bytes'])} GB per rank"
                     + ("" if fewest is None or not island["fits"] else
                        f"; fsdp fits {island['device_memory_gb']:g} GB from {fewest['processes']} processes per "
                        f"learner ({sequences(fewest['rows'])} per rank, {gigabytes(fewest['peak_bytes'])} GB)")
                     + (f"; to fit, {island['to_fit']}" if island["to_fit"] else "")
                     + ("" if island["activations_estimated"] else "; activations not estimated for this model kind"))
    host = memory["host"]
    lines += ["", *notes, "", "**Memory per host, GB: the host of a learner's rank 0 (an island's host_memory_gb), "
              "or this host, which the learners of every island without one share; what stays, plus a checkpoint "
              "staged while an exchange is in flight**", "",
              "| island | host | ranks there | " + " | ".join(HOST_PARTS) + " | per learner | host memory | fits |",
              "|" + "---|" * 11]
    for name, island in host["islands"].items():
        where = host["hosts"][island["host"]]
        lines.append("| " + " | ".join([name, island["host"], str(island["ranks"]),
                                        *(gigabytes(island["parts"][part]) for part in HOST_PARTS),
                                        gigabytes(sum(island["parts"].values())),
                                        gigabytes(where["memory_bytes"]), "yes" if where["fits"] else "no"]) + " |")
    state = host["exchange_state"]
    lines += ["", f"The exchange's state on each rank of a learner there: {gigabytes(sum(state.values()))} GB ("
              + ", ".join(f"{part} {gigabytes(nbytes)}" for part, nbytes in state.items() if nbytes) + ")."]
    for name, where in host["hosts"].items():
        learners = (f"this host: the {where['learners']} learners of {', '.join(where['islands'])} need" if name == HERE
                    else f"{name}: a learner's host needs")
        lines.append(f"- {learners} {gigabytes(where['need_bytes'])} GB of {gigabytes(where['memory_bytes'])} GB"
                     + (f"; to fit, {where['to_fit']}" if where["to_fit"] else ""))
    return "\n".join(lines)


def windows_table(rows: list[dict]) -> str:
    """Capacity windows by island as a Markdown table (`training.planning.windows.window_rows`), with the
    rounds planned and the waits when the rows come from a plan."""
    planned = "rounds" in rows[0]
    head = ["island", "window", "start", "end", "timezone"] + \
        (["rounds planned", "s waiting on another island"] if planned else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["island"], "always available" if row["window"] is None else str(row["window"]),
                 _wall_clock(row["start"]), _wall_clock(row["end"]), row["timezone"] or "-"]
        if planned:
            cells += [rounds_text(row["rounds"]), f"{row['wait_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _wall_clock(moment: str | None) -> str:
    return "-" if moment is None else datetime.fromisoformat(moment).strftime("%Y-%m-%d %H:%M:%S")


def windows_markdown(windows: dict) -> str:
    """A windows plan (`training.planning.windows.windows_plan`) as Markdown: the table, and what the
    learners do instead of a wait longer than they wait for a partner."""
    lines = ["**Capacity windows: the rounds planned in each, and the mean seconds each island's learners "
             "wait there on another island (its compute, its windows, or the link)**", "",
             windows_table(windows["rows"])]
    longest = max(row["longest_wait_s"] for row in windows["rows"])
    if longest > windows["partner_timeout_s"]:
        lines += ["", f"The longest wait, {longest:.0f} s, is longer than `sync.partner_timeout_s` "
                      f"({windows['partner_timeout_s']:g} s): the learners will not wait that long, but miss "
                      "those exchanges and go on."]
    return "\n".join(lines)
