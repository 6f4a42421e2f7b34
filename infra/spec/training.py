"""The `training` and `baseline` sections of a run spec: how each learner trains between exchanges,
and how the standard training it is measured against does."""

from __future__ import annotations

from pydantic import Field

from infra.spec.base import MAX_BATCH, MAX_STEPS, SpecModel


class TrainingSpec(SpecModel):
    """How each learner trains between exchanges, and how often it checkpoints."""

    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate of the inner steps (and of the baseline, "
                                               "unless baseline.lr says otherwise).")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps of the learning-rate schedule.")
    checkpoint_every: int = Field(
        1, ge=1, le=MAX_STEPS,
        description="Rounds between a learner's checkpoints; the last round and a round a capacity window ends "
                    "after are always checkpointed. A restart replays at most this many rounds.")
    keep_checkpoints: int | None = Field(
        2, ge=1, le=MAX_STEPS,
        description="Newest committed checkpoints each learner keeps; older ones are retired, and so is a "
                    "message once every learner that could read it has committed a checkpoint of a later round. "
                    "The bpb curve's rounds keep their weights alone, whatever this says. Empty: keep everything.")


class BaselineSpec(SpecModel):
    """Standard training, the run's yardstick. Tuned on its own (see experiments/quality/): a baseline held
    to the islands' learning rate and batch would flatter the islands."""

    lr: float | None = Field(None, gt=0, description="Peak AdamW learning rate; defaults to training.lr.")
    global_batch: int | None = Field(
        None, ge=1, le=MAX_BATCH, description="Rows per step; defaults to the sum of the learners' batch sizes. "
                                              "The token count stays the islands run's either way.")
