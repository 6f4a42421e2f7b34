"""The `evaluation` section of a run spec: the yardstick a run is scored against, and its curve."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from infra.spec.base import MAX_BATCH, SpecModel


class EvaluationSpec(SpecModel):
    """How the run's model is scored: against standard training or alone, where that baseline trains,
    and the bpb-versus-tokens curve."""

    baseline: Literal["standard", "none"] = Field(
        "standard", description="standard: train standard data-parallel training on the same shards and tokens "
                                "and score both models; none: score the islands' model alone (no baseline is "
                                "trained, and the report says so).")
    baseline_island: str | None = Field(
        None, description="Train standard training on this island: on its work pool (a run of its `baseline` "
                          "deployment, when the run's islands run as deployments) and its device, instead of "
                          "the control plane's CPU. Empty: on the control plane.")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="Windows per forward pass during evaluation.")
    curve_points: int = Field(
        4, ge=1, le=100, description="Points of the bpb-versus-tokens curve: the learners keep their weights after "
                                     "this many evenly spread rounds (the last included), and standard training its "
                                     "snapshots at the matching tokens.")
