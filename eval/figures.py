"""The run's figures as PNG bytes: bpb versus tokens, communication, utilisation."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from training.ledger import LearnerSummary  # noqa: E402

ARM_COLOURS = {"islands": "tab:blue", "standard": "tab:orange"}


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


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
