"""Faults a run spec can inject, for tests and drills: each names whom it hits and when."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from infra.spec.base import MAX_WAIT_S, SpecModel


class KillLearner(SpecModel):
    """A learner's process killed mid-round: its retry resumes from its last checkpoint."""

    kind: Literal["kill_learner"] = Field(description="SIGKILL a learner's process in the middle of a round.")
    learner: int = Field(ge=0, description="Global learner index.")
    round: int = Field(ge=0, description="Index from 0 of the round in which it dies (after half its inner steps), "
                                          "once; logs and trackers number rounds from 1.")


class CorruptObject(SpecModel):
    """One damaged message: its readers must refuse it and go on without it."""

    kind: Literal["corrupt_object"] = Field(description="Corrupt the next object a learner writes.")
    learner: int = Field(ge=0, description="Global learner index.")
    round: int = Field(0, ge=0, description="Index from 0 of the round whose message from this learner is "
                                                "corrupted; logs and trackers number rounds from 1.")


class StoreErrors(SpecModel):
    """Transient store faults on every request: the retries must absorb them."""

    kind: Literal["store_errors"] = Field(description="Transient store faults on every learner's requests.")
    rate: float = Field(ge=0, le=1, description="Probability that a store request meets a fault.")
    kinds: list[Literal["timeout", "unavailable", "disconnect", "slow", "truncate"]] = Field(
        ["timeout", "unavailable", "disconnect", "slow"], min_length=1, max_length=5,
        description="Fault kinds drawn from.")
    slow_seconds: float = Field(0.2, ge=0, le=MAX_WAIT_S, description="Delay of a 'slow' fault.")


class FailStage(SpecModel):
    """One failed lifecycle stage: retrying the run redoes it alone, the stages before it coming back from
    their results."""

    kind: Literal["fail_stage"] = Field(description="Fail a lifecycle stage once, to exercise reruns.")
    stage: Literal["evaluate", "report", "consolidate", "baseline"] = Field(description="Stage that fails once.")


class CloseWindow(SpecModel):
    """A capacity window cut short: the learner must pause and resume in the island's next window."""

    kind: Literal["close_window"] = Field(
        description="End a learner's capacity window right after a round, once, as when a reservation is cut "
                    "short: it stops as at a window's end and resumes in the island's next window.")
    learner: int = Field(ge=0, description="Global learner index.")
    round: int = Field(ge=0, description="Index from 0 of the round after which its window closes; logs and "
                                          "trackers number rounds from 1.")


Fault = Annotated[Union[KillLearner, CorruptObject, StoreErrors, FailStage, CloseWindow], Field(discriminator="kind")]
