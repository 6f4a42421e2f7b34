"""The planner honours capacity windows: a learner stops at a window's end by the learner's own rule
and resumes in its next window while its partner on another island waits; the windows plan is shown
as a table and a timeline, from the CLI, the plan flow and the lifecycle deployment's description."""

import ast
import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from eval.figures import windows_timeline
from flows.cli import main
from infra.spec import parse_spec
from training.planning.markdown import windows_markdown
from training.planning.windows import WindowsTooShort
from training.planning.planner import plan_run, replay

STEPS = {"east": 1.0, "west": 2.0}  # both islands run 10 inner steps a round: 10 s and 20 s per round


def window(start: str, end: str) -> dict:
    return {"start": f"2026-12-10T{start}", "end": f"2026-12-10T{end}", "timezone": "Europe/Paris"}


def spec_of(east_windows=(("10:00:00", "10:01:00"), ("10:02:00", "10:05:00")),
            west_windows=(("10:00:30", "10:10:00"),), partner_timeout_s=600):
    return parse_spec({
        "islands": [{"name": name, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 10,
                     "windows": [window(*w) for w in windows]}
                    for name, windows in (("east", east_windows), ("west", west_windows))],
        "model": {"layers": 2, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "c", "source": "files", "paths": ["x"]}]},
        "sync": {"mode": "butterfly", "rounds": 4, "partner_timeout_s": partner_timeout_s}})


def test_a_learner_stops_at_its_window_end_and_its_partner_waits_for_its_next_window():
    # Seconds from 10:00:00, on an unlimited link (tau 0: each exchange waited for at the round's end).
    # Round 0: east computes 0-10 and waits for west (window opens at 30, computes 30-50): ends at 50.
    # Round 1: east's last round took 50 s, its window has 10 s left: it stops, resumes at 120 and computes
    #          120-130; west computes 50-70 and waits for east until 130.
    # Rounds 2 and 3: east computes 10 s, west 20 s: east waits 10 s each, ends 150 and 170.
    east, west = replay(spec_of(), STEPS, 1e18)
    assert east.round_ends == pytest.approx([50, 130, 150, 170])
    assert [w.rounds for w in east.windows[:2]] == [1, 3] and [w.rounds for w in west.windows[:1]] == [4]
    assert [w.wait_s for w in east.windows[:2]] == pytest.approx([40, 20])
    assert west.windows[0].wait_s == pytest.approx(60)
    assert len(east.windows[0].waits) == 1 and east.windows[0].waits[0] == pytest.approx((10, 50))
    assert any((a, b) == pytest.approx((70, 130)) for a, b in west.windows[0].waits)
    assert east.paused_s == pytest.approx(70) and west.paused_s == 0
    # Utilisation leaves out the time between east's windows: (30 + 60) compute over (50 + 120) wall.
    assert plan_run(spec_of(), STEPS, 1e18)["utilisation"] == pytest.approx(90 / 170)


def test_windows_that_cannot_hold_the_run_are_refused_naming_the_field():
    with pytest.raises(WindowsTooShort, match=r"islands\.0\.windows: island east's .* \(the plan fits 1 of them\)"):
        plan_run(spec_of(east_windows=(("10:00:00", "10:01:00"),)), STEPS, 1e18)


def test_a_plan_without_windows_has_no_windows_plan():
    raw = spec_of().model_dump(mode="json")
    for island in raw["islands"]:
        island["windows"] = []
    plans = replay(parse_spec(raw), STEPS, 1e18)
    assert plans[0].round_ends == pytest.approx([20, 40, 60, 80]) and plans[0].paused_s == 0
    assert plan_run(parse_spec(raw), STEPS, 1e18)["windows"] is None


def test_the_windows_table_gives_rounds_and_waits_per_island_and_window():
    table = windows_markdown(plan_run(spec_of(), STEPS, 1e18)["windows"])
    assert "| east | 0 | 2026-12-10 10:00:00 | 2026-12-10 10:01:00 | Europe/Paris | 1 | 40.0 |" in table
    assert "| east | 1 | 2026-12-10 10:02:00 | 2026-12-10 10:05:00 | Europe/Paris | 3 | 20.0 |" in table
    assert "| west | 0 | 2026-12-10 10:00:30 | 2026-12-10 10:10:00 | Europe/Paris | 4 | 60.0 |" in table
    assert "partner_timeout_s" not in table
    # West's 60 s wait is longer than a learner waits for a partner: the table says what happens instead.
    impatient = windows_markdown(plan_run(spec_of(partner_timeout_s=30), STEPS, 1e18)["windows"])
    assert "The longest wait, 60 s, is longer than `sync.partner_timeout_s` (30 s)" in impatient


def test_the_timeline_draws_the_waits():
    windows = plan_run(spec_of(), STEPS, 1e18)["windows"]
    png = windows_timeline(windows)
    assert png.startswith(b"\x89PNG")
    no_waits = {**windows, "rows": [{**row, "waits": []} for row in windows["rows"]]}
    assert windows_timeline(no_waits) != png


def test_plan_command_prints_the_windows_table_and_writes_the_timeline(tmp_path, capsys):
    config = tmp_path / "spec.yaml"
    config.write_text(json.dumps(spec_of().model_dump(mode="json")))
    figure = tmp_path / "figures" / "timeline.png"
    assert main(["plan", str(config), "--step-seconds", "east=1", "--step-seconds", "west=2",
                 "--figure", str(figure)]) == 0
    assert "| east | 1 | 2026-12-10 10:02:00 | 2026-12-10 10:05:00 | Europe/Paris | 3 | 20.0 |" in capsys.readouterr().out
    assert figure.read_bytes().startswith(b"\x89PNG")

    short = tmp_path / "short.yaml"
    short.write_text(json.dumps(spec_of(east_windows=(("10:00:00", "10:01:00"),)).model_dump(mode="json")))
    assert main(["plan", str(short), "--step-seconds", "east=1", "--step-seconds", "west=2"]) == 2
    assert "islands.0.windows: island east's capacity windows end" in capsys.readouterr().err

    raw = spec_of().model_dump(mode="json")
    for island in raw["islands"]:
        island["windows"] = []
    always = tmp_path / "always.yaml"
    always.write_text(json.dumps(raw))
    assert main(["plan", str(always), "--step-seconds", "east=1", "--step-seconds", "west=2",
                 "--figure", str(tmp_path / "none.png")]) == 2
    assert "islands[].windows" in capsys.readouterr().err and not (tmp_path / "none.png").exists()


def test_the_server_free_commands_format_without_the_prefect_layer():
    """`plan`, and `run`'s memory table before its server starts, print through training.planning.markdown:
    the CLI's modules import nothing from tasks/, whose modules load Prefect."""
    for module in ("cli.py", "cli_plan.py", "cli_run.py"):
        tree = ast.parse((Path(__file__).resolve().parents[1] / "flows" / module).read_text())
        imported = ({node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
                    | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names})
        assert [name for name in imported if name and name.split(".")[0] == "tasks"] == [], module


def test_the_plan_flow_publishes_the_windows_table_and_timeline(prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.deployments import plan

    flow_run_id = plan(spec_of(), link_gbps=1.0, step_seconds=STEPS, return_state=True).state_details.flow_run_id

    async def read_and_remove():
        async with get_client() as client:
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
            for artifact in artifacts:  # tests/test_planner.py reads the `plan` artifact its own flow run made
                await client.delete_artifact(artifact.id)
            return {a.key: a for a in artifacts}

    artifacts = asyncio.run(read_and_remove())
    assert set(artifacts) == {"plan", "plan-memory", "plan-windows", "plan-timeline"}
    assert "| west | 0 | 2026-12-10 10:00:30 | 2026-12-10 10:10:00 | Europe/Paris | 4 |" in artifacts["plan-windows"].data
    assert artifacts["plan-timeline"].type == "image"
    assert artifacts["plan-timeline"].data.startswith("data:image/png;base64,")


def test_after_a_run_windows_too_short_for_its_measured_steps_leave_the_plan_without_them(prefect_api):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.planning import publish_plan

    @flow
    def report(spec, key: str) -> dict:
        return publish_plan(spec, STEPS, 1e9, key=key, description="after the run",
                            measured={"utilisation": 0.5, "inter_island_bytes": 1})

    held = report(spec_of(), "held-vs-measured")
    short = report(spec_of(east_windows=(("10:00:00", "10:01:00"),)), "short-vs-measured")
    assert held["windows"]["rows"][1]["rounds"] == [3] and short["windows"] is None

    async def keys():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                any_=["held-vs-measured-windows", "short-vs-measured", "short-vs-measured-windows"])))}

    assert asyncio.run(keys()) == {"held-vs-measured-windows", "short-vs-measured"}


def test_the_lifecycle_deployment_says_which_island_trains_when():
    from flows.serve import lifecycle_description

    raw = spec_of().model_dump(mode="json")
    raw["islands"][1]["windows"] = []
    spec = parse_spec(raw)
    described = lifecycle_description(spec, datetime(2026, 12, 4, tzinfo=timezone.utc))
    assert "Scheduled once, at the start of island east's window 0: 2026-12-10 10:00:00 Europe/Paris." in described
    assert "| east | 1 | 2026-12-10 10:02:00 | 2026-12-10 10:05:00 | Europe/Paris |" in described
    assert "| west | always available | - | - | - |" in described
    later = lifecycle_description(spec, datetime(2026, 12, 10, 9, 30, tzinfo=timezone.utc))
    assert "no run is scheduled" in later
    raw["islands"][0]["windows"] = []
    assert "window" not in lifecycle_description(parse_spec(raw), datetime(2026, 12, 4, tzinfo=timezone.utc))


def test_the_served_lifecycle_deployment_keeps_its_rrule_and_names_the_windows(prefect_api):
    from prefect.client.orchestration import get_client

    from flows.serve import LIFECYCLE_DEPLOYMENT, register

    spec = spec_of(east_windows=(("10:00:00", "10:01:00"), ("10:02:00", "10:05:00")))
    deployment_id = register(spec)[LIFECYCLE_DEPLOYMENT]

    async def read():
        async with get_client() as client:
            return await client.read_deployment(deployment_id)

    deployment = asyncio.run(read())
    assert "| west | 0 | 2026-12-10 10:00:30 | 2026-12-10 10:10:00 | Europe/Paris |" in deployment.description
    (schedule,) = deployment.schedules
    assert schedule.schedule.rrule == "DTSTART:20261210T100000\nRRULE:FREQ=DAILY;COUNT=1"
