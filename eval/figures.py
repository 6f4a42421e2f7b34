"""The run's figures as PNG bytes: bpb versus tokens, communication, utilisation."""

from __future__ import annotations

import base64
import io
from datetime import datetime, timedelta

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402 - the backend must be chosen first
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from training.learner.ledger import LearnerSummary  # noqa: E402
from training.planning.windows import rounds_text  # noqa: E402

ARM_COLOURS = {"islands": "tab:blue", "standard": "tab:orange"}


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def data_url(png: bytes) -> str:
    """The PNG inline, for an image artifact: the UI shows it wherever the PNG's store is."""
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def bpb_versus_tokens(points: list[dict], eval_bytes: int) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    evals = sorted({p["eval"] for p in points})
    for arm, name in sorted({(p["arm"], p["eval"]) for p in points}):
        series = sorted((p["tokens"], p["bpb"]) for p in points if (p["arm"], p["eval"]) == (arm, name))
        ax.plot(*zip(*series), ["-o", "--s", ":^", "-.d"][evals.index(name) % 4], color=ARM_COLOURS.get(arm),
                label=f"{arm}: {name}")
    ax.set(xlabel="training tokens", ylabel="bits per byte",
           title=f"Bits per byte versus tokens (first {eval_bytes:,} bytes of each held-out set)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


def communication(comm: dict) -> bytes:
    fig, (total, per_learner) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["islands (inter-island)", "per-step all-reduce (inter-island)"]
    values = [comm["inter_island_bytes"], comm["allreduce_equivalent_bytes"]]
    bars = total.bar(labels, values, color=["tab:blue", "tab:gray"])
    total.bar_label(bars, labels=[f"{v:,}" for v in values], fontsize=8)
    total.set(ylabel="bytes", title="Bytes crossing between islands")
    total.tick_params(axis="x", labelsize=8)
    learners = [f"{p['learner']} ({p['island']})" for p in comm["per_learner"]]
    bottom = [0] * len(learners)
    for field, colour in (("bytes_read_intra", "tab:green"), ("bytes_read_inter", "tab:blue"),
                          ("checkpoint_bytes", "tab:purple")):
        heights = [p[field] for p in comm["per_learner"]]
        per_learner.bar(learners, heights, bottom=bottom, color=colour, label=field.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    per_learner.set(xlabel="learner", ylabel="bytes", title="Store traffic per learner")
    per_learner.legend(fontsize=8)
    return _png(fig)


def utilisation(summaries: list[LearnerSummary]) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(summaries) + 1.5))
    names = [f"learner {s.learner} ({s.island})" for s in summaries]
    computing = [s.seconds_computing for s in summaries]
    syncing = [s.seconds_syncing for s in summaries]
    ax.barh(names, computing, color="tab:blue", label="computing")
    ax.barh(names, syncing, left=computing, color="tab:red", label="synchronising")
    for y, (c, s) in enumerate(zip(computing, syncing)):
        ax.text(c + s, y, f" {c / (c + s):.0%}" if c + s else "", va="center")
    ax.set(xlabel="seconds", title="Utilisation: time computing vs synchronising, per learner")
    ax.legend(loc="lower right")
    return _png(fig)


def windows_timeline(windows: dict) -> bytes:
    """A windows plan (`training.planning.windows.windows_plan`): one row per island, its capacity windows
    as bars with the rounds planned in each, and hatched where its learners wait on another island."""
    origin = datetime.fromisoformat(windows["origin"])
    islands = list(dict.fromkeys(row["island"] for row in windows["rows"]))
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(islands) + 1.8))
    for y, island in enumerate(islands):
        for row in (r for r in windows["rows"] if r["island"] == island):
            start, end = (mdates.date2num(datetime.fromisoformat(row[k])) for k in ("start", "end"))
            ax.broken_barh([(start, end - start)], (y - 0.3, 0.6),
                           color="tab:blue" if row["window"] is not None else "tab:cyan")
            ax.broken_barh([(mdates.date2num(origin + timedelta(seconds=a)), (b - a) / 86400) for a, b in row["waits"]],
                           (y - 0.3, 0.6), facecolor="none", edgecolor="tab:red", hatch="///", linewidth=0)
            rounds = rounds_text(row["rounds"])
            ax.text((start + end) / 2, y, f"{rounds} round{'' if rounds == '1' else 's'}", ha="center", va="center",
                    fontsize=8, color="white", fontweight="bold")
    ax.set_yticks(range(len(islands)), islands)
    ax.set_ylim(len(islands) - 0.5, -0.5)
    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.set(xlabel="time (UTC)", title="Planned rounds per capacity window, and waits on other islands")
    rows = windows["rows"]
    legend = [(any(r["window"] is not None for r in rows),
               Patch(color="tab:blue", label="capacity window (rounds planned in it)")),
              (any(r["window"] is None for r in rows),
               Patch(color="tab:cyan", label="island without windows: start to its last round")),
              (any(r["waits"] for r in rows),
               Patch(facecolor="none", edgecolor="tab:red", hatch="///", label="waiting on another island"))]
    ax.legend(handles=[patch for present, patch in legend if present],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=8, frameon=False)
    return _png(fig)
