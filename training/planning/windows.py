"""Capacity windows in the planner's replay: a learner computes only inside its island's windows.

A learner stops by its own rule (`infra.spec.windows.round_fits`: a round starts only if one as long as
its last would end before the window does) and resumes at its next window's start as a new life,
with its exchange in flight carried over as its checkpoint carries it. A partner on another island
meanwhile waits for its messages: those waits are where one island waits on another.

The replay's clock counts seconds from the earliest window's start, when the lifecycle deployment
is scheduled; an island without windows is available from then on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from infra.spec import RunSpec
from infra.spec.windows import round_fits


class WindowsTooShort(ValueError):
    """An island's capacity windows end before its learners can finish the run's rounds."""


@dataclass
class Stretch:
    """A learner's rounds in one window of its island, and the seconds it spent there blocked on peers."""

    rounds: int = 0
    wait_s: float = 0.0
    # (from, to) in plan seconds; a round's wait is placed at its end, where a learner with tau 0 spends it.
    waits: list[tuple[float, float]] = field(default_factory=list)


def plan_origin(spec: RunSpec) -> datetime | None:
    """When the plan's clock starts: the earliest window's start (None when no island has windows)."""
    starts = [window.start_at for island in spec.islands for window in island.windows]
    return min(starts) if starts else None


class WindowedClock:
    """One learner's way through its island's windows during the replay; it keeps `plan.windows`
    (a `Stretch` per window, and one for rounds after the last window ends) and `plan.paused_s`."""

    def __init__(self, spec: RunSpec, plan):
        island = spec.learners[plan.learner].island
        origin = plan_origin(spec)
        spans = [((w.start_at - origin).total_seconds(), (w.end_at - origin).total_seconds())
                 for w in island.ordered_windows]
        # Past its last window a learner goes on, so that the replay finishes: `windows_plan` refuses such a plan.
        self.spans = spans + [(spans[-1][1], math.inf)] if spans else [(0.0, math.inf)]
        self.plan, self.window = plan, 0
        plan.windows = [Stretch() for _ in self.spans]
        self.last_round_s = 0.0  # as the learner measures it, in this life: none yet at a life's start
        self.round_started = 0.0
        self.blocked_before = 0.0

    def begin_round(self, clock: float) -> float:
        """When the learner's next round starts: at `clock` if it fits the window, else in the next
        window it fits, as a new life. From its stop at a window's end to that start it is paused: its
        process has exited, so its own ledger does not count that time either."""
        start = max(clock, self.spans[self.window][0])
        while not round_fits(self.spans[self.window][1] - start, self.last_round_s):
            self.window, self.last_round_s = self.window + 1, 0.0
            start = max(clock, self.spans[self.window][0])
        if self.plan.round_ends:
            self.plan.paused_s += start - clock
        self.round_started = start
        return start

    def end_round(self) -> None:
        """Book the round just ended (the plan's newest round end) and its blocked seconds to the window."""
        end, waited = self.plan.round_ends[-1], self.plan.blocked_s - self.blocked_before
        self.blocked_before = self.plan.blocked_s
        stretch = self.plan.windows[self.window]
        stretch.rounds += 1
        if waited > 0:
            stretch.wait_s += waited
            stretch.waits.append((end - waited, end))
        self.last_round_s = end - self.round_started


def window_rows(spec: RunSpec) -> list[dict]:
    """Each island's windows in order (`window` numbers them as the island's segment flow runs are
    named), start and end on the wall clock of the window's timezone; an island without windows
    has one row, window None."""
    rows = []
    for island in spec.islands:
        rows += [{"island": island.name, "window": n, "start": w.local(w.start_at).isoformat(),
                  "end": w.local(w.end_at).isoformat(), "timezone": w.timezone}
                 for n, w in enumerate(island.ordered_windows)]
        if not island.windows:
            rows.append({"island": island.name, "window": None, "start": None, "end": None, "timezone": None})
    return rows


def windows_plan(spec: RunSpec, plans: list) -> dict | None:
    """Per island and window: the rounds each of its learners runs there, their mean seconds waiting
    on peers there (the link included), the longest single wait, and the spans any of them waits
    (plan seconds from `origin`). An island without windows spans from the plan's start to its last
    round. None when no island has windows."""
    origin = plan_origin(spec)
    if origin is None:
        return None
    _check_windows_hold(spec, plans)
    rows = window_rows(spec)
    for row in rows:
        mine = [p for p in plans if p.island == row["island"]]
        stretches = [p.windows[0 if row["window"] is None else row["window"]] for p in mine]
        waits = [span for s in stretches for span in s.waits]
        row.update(rounds=[s.rounds for s in stretches], wait_s=sum(s.wait_s for s in stretches) / len(mine),
                   longest_wait_s=max((b - a for a, b in waits), default=0.0), waits=_union(waits))
        if row["window"] is None:
            finish = origin + timedelta(seconds=max(p.round_ends[-1] for p in mine))
            row.update(start=origin.astimezone(timezone.utc).isoformat(),
                       end=finish.astimezone(timezone.utc).isoformat(), timezone="UTC")
    return {"origin": origin.astimezone(timezone.utc).isoformat(),
            "partner_timeout_s": spec.sync.partner_timeout_s, "rows": rows}


def _check_windows_hold(spec: RunSpec, plans: list) -> None:
    for n, island in enumerate(spec.islands):
        mine = [p for p in plans if p.island == island.name]
        if island.windows and any(p.windows[-1].rounds for p in mine):
            fit = min(spec.sync.rounds - p.windows[-1].rounds for p in mine)
            raise WindowsTooShort(
                f"islands.{n}.windows: island {island.name}'s capacity windows end before its learners finish "
                f"the run's {spec.sync.rounds} rounds (the plan fits {fit} of them); add or lengthen windows")


def without_windows(spec: RunSpec) -> RunSpec:
    """The same run with every island always available."""
    return spec.model_copy(update={"islands": [i.model_copy(update={"windows": []}) for i in spec.islands]})


def rounds_text(rounds: list[int]) -> str:
    """The rounds an island's learners run in a window: one number when they agree, else the range."""
    low, high = min(rounds), max(rounds)
    return f"{low}" if low == high else f"{low}-{high}"


def _union(spans: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
