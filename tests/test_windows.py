"""Capacity windows: validated in the spec, and a window's end pauses a learner without losing a round."""

import asyncio
from datetime import datetime, timedelta, timezone

import pytest

from infra import layout
from infra.launch import LearnerProcess
from infra.spec import SpecError, check_windows_ahead, parse_spec, spec_sha256
from infra.store import ObjectStore
from infra.supervision import run_learner
from tests.test_lifecycle import TINY
from training.data.shards import prepare_dataset
from training.learner.loop import Learner

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)


def with_windows(windows, island=0):
    islands = [dict(i) for i in TINY["islands"]]
    islands[island]["windows"] = windows
    return {**TINY, "islands": islands}


def test_windows_are_timezone_aware_and_ordered():
    spec = parse_spec(with_windows([
        {"start": "2026-12-03T18:00:00", "end": "2026-12-03T20:00:00", "timezone": "Europe/Paris"},
        {"start": "2026-12-03T09:00:00", "end": "2026-12-03T12:00:00", "timezone": "Europe/Paris"}]))
    first, second = spec.islands[0].ordered_windows
    assert first.start_at == datetime(2026, 12, 3, 8, 0, tzinfo=timezone.utc)
    assert second.end_at == datetime(2026, 12, 3, 19, 0, tzinfo=timezone.utc)
    check_windows_ahead(spec, NOW)


@pytest.mark.parametrize("windows, message", [
    ([{"start": "2026-12-03T09:00:00", "end": "2026-12-03T12:00:00"},
      {"start": "2026-12-03T11:00:00+00:00", "end": "2026-12-03T13:00:00+00:00"}], "island east: window"),
    ([{"start": "2026-12-03T09:00:00", "end": "2026-12-03T08:00:00"}], "ends"),
    ([{"start": "2026-12-03T09:00:00", "end": "2026-12-03T10:00:00", "timezone": "Mars/Olympus"}], "unknown timezone"),
])
def test_invalid_windows_are_refused_naming_the_island(windows, message):
    with pytest.raises(SpecError, match=message) as err:
        parse_spec(with_windows(windows))
    assert "islands.0" in str(err.value)


def test_a_window_already_over_at_submission_is_refused():
    spec = parse_spec(with_windows([{"start": "2026-12-01T09:00:00", "end": "2026-12-01T17:00:00",
                                     "timezone": "America/New_York"}], island=1))
    with pytest.raises(SpecError, match=r"islands\.1\.windows\.0: island west's window .* has already ended"):
        check_windows_ahead(spec, NOW)


class WindowClock:
    """Inside the window for the first `open_checks` checks, past its end afterwards."""

    def __init__(self, until: datetime, open_checks: int):
        self.until, self.open_checks = until, open_checks

    def __call__(self) -> datetime:
        self.open_checks -= 1
        return self.until - timedelta(hours=1) if self.open_checks >= 0 else self.until + timedelta(seconds=1)


@pytest.fixture
def one_learner_run(tmp_path):
    spec = parse_spec({**TINY, "islands": [{**TINY["islands"][0], "learners": 1}],
                       "sync": {**TINY["sync"], "rounds": 5}, "store": {"url": str(tmp_path / "store")}})
    store = ObjectStore(spec.store.url).child("runs/windows")
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, store)
    return spec, store


def test_a_window_end_pauses_after_a_committed_round_and_the_next_window_resumes(one_learner_run):
    spec, store = one_learner_run
    until = NOW + timedelta(hours=2)
    first = Learner(spec, store, 0)
    first.resume()
    assert first.run(until, WindowClock(until, open_checks=2)) is False
    assert [store.is_committed(layout.checkpoint(0, t)) for t in range(5)] == [True, True, False, False, False]
    assert not store.exists(layout.learner_summary(0))

    second = Learner(spec, store, 0)
    second.resume()
    assert second.start_round == 2 and second.rejoined_from == {"learner": 0, "round": 1}
    assert second.run() is True
    summary = store.get_json(layout.learner_summary(0))
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2, 3, 4]
    assert summary["tokens"] == 5 * spec.learners[0].tokens_per_round()


def test_a_learner_process_past_its_window_exits_cleanly_without_training(one_learner_run):
    spec, store = one_learner_run
    lines = []
    run_learner(LearnerProcess(0, 1, 1, until=datetime.now(timezone.utc) - timedelta(seconds=1),
                               spec_sha256=spec_sha256(spec)),
                spec.store.url, None, "windows", lines.append)
    assert any('"window_closed"' in line for line in lines)
    assert not any(store.is_committed(layout.checkpoint(0, t)) for t in range(5))


def _segments_through_windows(spec, run_id):
    """island_segments with the deployment dispatch done in-process: the real `segment` flow and
    learner processes, without a server and workers (tests/test_ui.py covers those)."""
    from types import SimpleNamespace

    from prefect import flow
    from prefect.states import Completed

    import tasks.segments as segments
    from flows.deployments import segment

    dispatched = []

    def run_deployment_here(name, parameters, scheduled_time, tags, flow_run_name, poll_interval):
        assert tags == segments.segment_tags(run_id, "east")  # what stop_segments finds the run's segments by
        dispatched.append((name, scheduled_time, parameters["until"]))
        segment(**parameters)
        return SimpleNamespace(state=Completed(), name=flow_run_name, work_pool_name=segments.island_pool("east"))

    @flow
    def drive():
        return segments.island_segments(spec, run_id, "east")

    original = segments.run_deployment
    segments.run_deployment = run_deployment_here
    try:
        return drive(), dispatched
    finally:
        segments.run_deployment = original


def windowed_run(tmp_path, windows, close_after_round):
    spec = parse_spec({**TINY, "islands": [{**TINY["islands"][0], "learners": 1, "windows": windows}],
                       "sync": {**TINY["sync"], "rounds": 4}, "store": {"url": str(tmp_path / "store")},
                       "faults": [{"kind": "close_window", "learner": 0, "round": close_after_round}]})
    run_id = f"windows-{tmp_path.name}"
    store = ObjectStore(spec.store.url).child(f"runs/{run_id}")
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, store)
    return spec, run_id, store


def test_an_island_pauses_at_its_window_end_and_resumes_in_its_next_window(tmp_path, prefect_api):
    now = datetime.now(timezone.utc)
    windows = [{"start": (now + timedelta(hours=1)).isoformat(), "end": (now + timedelta(hours=2)).isoformat()},
               {"start": (now - timedelta(minutes=1)).isoformat(), "end": (now + timedelta(hours=1)).isoformat()}]
    spec, run_id, store = windowed_run(tmp_path, windows, close_after_round=1)

    result, dispatched = _segments_through_windows(spec, run_id)

    first, second = spec.islands[0].ordered_windows
    assert dispatched == [("segment/island-east", first.start_at, first.end_at.isoformat()),
                          ("segment/island-east", second.start_at, second.end_at.isoformat())]
    assert [s["work_pool"] for s in result["segments"]] == ["island-east", "island-east"]
    summary = store.get_json(layout.learner_summary(0))
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2, 3]  # no committed round lost or redone
    assert summary["rejoined_from"] == {"learner": 0, "round": 1}
    # The newest two checkpoints are kept; the bpb curve scores every round of four, from their weights alone.
    assert layout.checkpoint_rounds(store.list(layout.learner_prefix(0))) == [2, 3]
    assert all(store.is_committed(layout.curve_weights(0, t)) for t in range(4))


def test_an_island_out_of_windows_fails_saying_so(tmp_path, prefect_api):
    now = datetime.now(timezone.utc)
    spec, run_id, store = windowed_run(
        tmp_path, [{"start": now.isoformat(), "end": (now + timedelta(hours=1)).isoformat()}], close_after_round=0)
    with pytest.raises(RuntimeError, match="island east: its capacity windows ended before its learners finished"):
        _segments_through_windows(spec, run_id)
    assert store.is_committed(layout.checkpoint(0, 0)) and not store.exists(layout.learner_summary(0))


def test_the_lifecycle_deployment_is_scheduled_at_the_earliest_window_start():
    from prefect.server.schemas.schedules import RRuleSchedule

    from flows.serve import capacity_schedules

    spec = parse_spec(with_windows([
        {"start": "2026-12-04T09:00:00", "end": "2026-12-04T12:00:00", "timezone": "Europe/Paris"},
        {"start": "2026-12-03T10:30:00", "end": "2026-12-03T11:00:00", "timezone": "Europe/Paris"}]))
    (schedule,) = capacity_schedules(spec, NOW)
    assert schedule.timezone == "Europe/Paris"
    (first,) = asyncio.run(RRuleSchedule(rrule=schedule.rrule, timezone=schedule.timezone).get_dates(n=5, start=NOW))
    assert first == datetime(2026, 12, 3, 9, 30, tzinfo=timezone.utc)
    assert capacity_schedules(parse_spec(TINY), NOW) == []


def test_a_torchrun_group_pauses_together_after_a_committed_round(tmp_path):
    spec = parse_spec({**TINY, "islands": [{**TINY["islands"][1], "learners": 1}],
                       "sync": {**TINY["sync"], "rounds": 3}, "store": {"url": str(tmp_path / "store")},
                       "faults": [{"kind": "close_window", "learner": 0, "round": 0}]})
    store = ObjectStore(spec.store.url).child("runs/group")
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    prepare_dataset(spec, store)
    lines = []
    run_learner(LearnerProcess(0, 2, 1, spec_sha256=spec_sha256(spec)), spec.store.url, None, "group", lines.append)
    assert sum('"window_closed"' in line for line in lines) == 1  # rank 0 speaks for the group
    assert store.is_committed(layout.checkpoint(0, 0)) and not store.is_committed(layout.checkpoint(0, 1))
    run_learner(LearnerProcess(0, 2, 1, spec_sha256=spec_sha256(spec)), spec.store.url, None, "group", lines.append)
    assert [r["round"] for r in store.get_json(layout.learner_summary(0))["rounds"]] == [0, 1, 2]
