"""Reserved capacity: the spans of time in which an island may compute for a run."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, model_validator

from infra.spec.base import SpecModel


class CapacityWindow(SpecModel):
    """A span of time in which an island's capacity is reserved for this run."""

    start: datetime = Field(description="When the reservation starts (local time in `timezone`, or with an offset).")
    end: datetime = Field(description="When it ends: a segment stops cleanly (checkpoint, then exit) before this.")
    timezone: str = Field("UTC", description="IANA timezone of start and end, e.g. Europe/Paris.")

    @model_validator(mode="after")
    def _ordered_in_a_known_zone(self) -> "CapacityWindow":
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown timezone {self.timezone!r}") from None
        if self.end_at <= self.start_at:
            raise ValueError(f"window ends ({self.end}) before it starts ({self.start})")
        return self

    def _aware(self, moment: datetime) -> datetime:
        return moment.replace(tzinfo=ZoneInfo(self.timezone)) if moment.tzinfo is None else moment

    @property
    def start_at(self) -> datetime:
        return self._aware(self.start)

    @property
    def end_at(self) -> datetime:
        return self._aware(self.end)

    def local(self, moment: datetime) -> datetime:
        """`moment` on the wall clock of the window's timezone, as the person who reserved it reads it."""
        return moment.astimezone(ZoneInfo(self.timezone))

    def describe(self) -> str:
        return f"{self.start_at.isoformat()} to {self.end_at.isoformat()} ({self.timezone})"


def round_fits(seconds_left: float, last_round_s: float) -> bool:
    """Whether a learner starts another round before its window ends: only if a round as long as its
    last one would end in time. A life's first round (`last_round_s` 0) starts whenever the window is
    still open. The learner stops by this rule, and the planner's replay predicts with it."""
    return last_round_s < seconds_left
