"""Experiment trackers: one small two-island lifecycle with TensorBoard tracking on (real Prefect API,
learners as real processes, the islands' relays writing), then its store replayed into TensorBoard, a
local sqlite MLflow store and W&B offline files by `archipelago export-metrics`. Each tracker must hold
the learners' ledgers and the report, value for value: per round (numbered from 1, as the logs number
them) and per inner step. Offline: no network."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eval.tracking import Point, Sink, TrackingUnavailable, learner_points, open_sink
from flows.cli import main
from infra.spec import SpecError, parse_spec
from infra.store import run_store
from infra.spec.tracking import TrackingSpec
from tests.test_security_results import tiny_spec
from tests.test_spec import demo_raw
from training.learner.ledger import read_summaries
from training.model.schedule import learning_rate


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, prefect_api):
    """(spec, its YAML, run id, report, the lifecycle's flow run id) of a finished run tracked in TensorBoard."""
    from flows.lifecycle import run_lifecycle
    from training.stages import new_run_id

    root = tmp_path_factory.mktemp("tracking")
    raw = tiny_spec(root, name="tracked").model_dump(mode="json", exclude_unset=True)
    raw["sync"]["rounds"] = 3
    raw["islands"][1]["inner_steps"] = 3  # the islands' inner steps differ: each learner's step axis is its own
    spec = parse_spec({**raw, "tracking": {"backend": "tensorboard", "uri": str(root / "tensorboard")}})
    config = root / "tracked.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_unset=True)))
    run_id = new_run_id(spec)
    state = run_lifecycle(spec, run_id, return_state=True)
    return spec, str(config), run_id, state.result(), state.state_details.flow_run_id


def ledger_series(spec, report) -> dict[str, dict[int, float]]:
    """What every tracker must hold, straight from the learners' summaries and the report: series by
    name, values by round (from 1) or, for the per-step series, by inner step (from 1)."""
    series: dict[str, dict[int, float]] = {}
    for summary in read_summaries(spec, run_store(spec.store, report["run_id"])):
        tag = f"{summary.island}/learner-{summary.learner}"
        tokens = summary.tokens / len(summary.rounds)
        for entry in summary.rounds:
            series.setdefault(f"loss/{tag}", {})[entry["round"] + 1] = entry["loss"]
            series.setdefault(f"tokens_per_s/{tag}", {})[entry["round"] + 1] = \
                tokens / (entry["compute_s"] + entry["sync_s"])
            steps = entry["steps"]
            for name, field in [("inner_loss", "loss"), ("learning_rate", "learning_rate"),
                                ("grad_norm", "grad_norm"), ("peak_memory_bytes", "peak_memory_bytes")]:
                series.setdefault(f"{name}/{tag}", {}).update(
                    (step + 1, value) for step, value in zip(steps["step"], steps[field], strict=True))
        for entry in summary.exchanges:
            for name, value in [("seconds_blocked", entry["blocked_s"]), ("bytes_read_intra", entry["bytes_read_intra"]),
                                ("bytes_read_inter", entry["bytes_read_inter"]), ("bytes_written", entry["bytes_sent"]),
                                ("missed_exchanges", entry["missed"]), ("refused_messages", entry["refused"])]:
                series.setdefault(f"{name}/{tag}", {})[entry["round"] + 1] = value
    end = spec.sync.rounds
    for name, entry in report["evals"].items():
        series[f"bpb/{name}/islands"] = {end: entry["islands_bpb"]}
        series[f"bpb/{name}/baseline"] = {end: entry["baseline_bpb"]}
        series[f"bpb/{name}/relative_difference"] = {end: entry["relative_difference"]}
    for name in ("max_weight_distance", "mean_weight_distance", "max_pairwise_distance"):
        series[f"consensus/{name}"] = {end: report["consensus"][name]}
    for name in ("inter_island_bytes", "intra_island_bytes", "bytes_written", "checkpoint_bytes",
                 "allreduce_equivalent_bytes", "inter_island_reduction"):
        series[f"communication/{name}"] = {end: report["communication"][name]}
    return series


def assert_holds(found: dict[str, dict[int, float]], expected: dict[str, dict[int, float]], rel: float = 0.0) -> None:
    assert set(found) == set(expected)
    for name, values in expected.items():
        assert set(found[name]) == set(values), name
        for step, value in values.items():
            assert found[name][step] == pytest.approx(value, rel=rel, abs=0), (name, step)


def test_the_series_add_up_to_the_report(tracked_run):
    """The per-exchange bytes the trackers get are the report's totals, split by learner and round."""
    spec, _, _, report, _ = tracked_run
    series = ledger_series(spec, report)
    for link in ("inter", "intra"):
        total = sum(v for name, values in series.items() if name.startswith(f"bytes_read_{link}/") for v in values.values())
        assert total == report["communication"][f"{link}_island_bytes"]
    assert report["communication"]["inter_island_bytes"] > 0
    assert {name.split("/", 1)[1] for name in series if name.startswith("loss/")} == {"a/learner-0", "b/learner-1"}
    assert all(sorted(series[f"loss/{tag}"]) == list(range(1, spec.sync.rounds + 1)) for tag in ("a/learner-0", "b/learner-1"))


def test_every_inner_step_has_its_loss_learning_rate_grad_norm_and_memory(tracked_run):
    """At these sizes the ledger keeps every inner step: their index over the learner's run, the loss whose
    mean is the round's, the schedule's learning rate, a gradient norm and the process's peak memory."""
    spec, _, _, report, _ = tracked_run
    for summary in read_summaries(spec, run_store(spec.store, report["run_id"])):
        island = spec.learners[summary.learner].island
        total = island.inner_steps * spec.sync.rounds
        steps = [entry["steps"] for entry in summary.rounds]
        assert [i for kept in steps for i in kept["step"]] == list(range(total))
        for entry, kept in zip(summary.rounds, steps):
            assert entry["loss"] == sum(kept["loss"]) / island.inner_steps
        assert [lr for kept in steps for lr in kept["learning_rate"]] == \
            [learning_rate(i, total, spec.training.lr, spec.training.warmup_steps) for i in range(total)]
        norms = [norm for kept in steps for norm in kept["grad_norm"]]
        assert all(0 < norm < 1e3 for norm in norms) and len(set(norms)) == total
        memory = [m for kept in steps for m in kept["peak_memory_bytes"]]
        assert memory == sorted(memory) and memory[0] > 50e6  # a peak so far: a Python process with torch holds more


def test_the_logs_and_the_trackers_number_rounds_alike(tracked_run):
    """The relays' `round r/R` lines and the trackers' round steps both run from 1 to R."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter, LogFilterFlowRunId

    spec, _, run_id, _, flow_run_id = tracked_run

    async def round_lines():
        async with get_client() as client:
            runs, parents = [flow_run_id], [flow_run_id]
            while parents:  # the lifecycle's flow run and its subflows' (the islands' segments)
                children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)))
                parents = [child.id for child in children]
                runs += parents
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=runs)))
        return [log.message for log in logs if log.message.startswith("round ")]

    logged = {int(line.split()[1].split("/")[0]) for line in asyncio.run(round_lines())}
    tracked = tensorboard_series(Path(spec.tracking.uri) / run_id)
    last = spec.sync.rounds
    assert f"round {last}/{last}" in {f"round {r}/{last}" for r in logged} and logged <= set(range(1, last + 1))
    for tag in ("a/learner-0", "b/learner-1"):
        assert sorted(tracked[f"loss/{tag}"]) == list(range(1, last + 1))
    report_steps = [set(values) for name, values in tracked.items() if name.startswith("bpb/")]
    assert report_steps and all(steps == {last} for steps in report_steps)


def tensorboard_series(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_the_islands_relays_and_the_report_fill_tensorboard_with_the_ledgers_values(tracked_run):
    """Logged while the run ran: each learner's rounds by its island's relay (event files of writer `a`
    and `b`), the report by its stage (the control plane's). TensorBoard keeps float32, hence the tolerance."""
    spec, _, run_id, report, _ = tracked_run
    folder = Path(spec.tracking.uri) / run_id
    expected = ledger_series(spec, report)
    assert_holds(tensorboard_series(folder), expected, rel=1e-6)
    by_writer: dict[str, set[str]] = {}
    for events in folder.glob("events.out.tfevents.*"):
        by_writer.setdefault(events.suffix[1:], set()).update(tensorboard_series(events))
    assert by_writer == {"a": {name for name in expected if name.endswith("/a/learner-0")},
                         "b": {name for name in expected if name.endswith("/b/learner-1")},
                         "control": {name for name in expected if name.split("/")[0] in ("bpb", "consensus", "communication")}}


def test_export_metrics_replays_the_run_into_tensorboard(tracked_run, tmp_path, capsys):
    spec, config, run_id, report, _ = tracked_run
    assert main(["export-metrics", run_id, "--config", config, "--to", "tensorboard", str(tmp_path)]) == 0
    assert (tmp_path / run_id).as_uri() in capsys.readouterr().out
    assert_holds(tensorboard_series(tmp_path / run_id), ledger_series(spec, report), rel=1e-6)


@pytest.mark.parametrize("to, problem", [(["comet", "x"], "--to comet: expected one of tensorboard, mlflow, wandb"),
                                         (["mlflow", "https://u:pw@mlflow.example"], "must not carry credentials")])
def test_export_metrics_refuses_a_target_it_cannot_use(tracked_run, to, problem, capsys):
    _, config, run_id, _, _ = tracked_run
    assert main(["export-metrics", run_id, "--config", config, "--to", *to]) == 2
    err = capsys.readouterr().err
    assert problem in err and "pw@" not in err


def test_export_metrics_into_a_sqlite_mlflow_store(tracked_run, tmp_path):
    from mlflow import MlflowClient

    spec, config, run_id, report, _ = tracked_run
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["export-metrics", run_id, "--config", config, "--to", "mlflow", uri, "--project", "islands"]) == 0
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("islands").experiment_id])
    assert run.info.run_name == run_id and run.data.tags["archipelago.run_id"] == run_id
    assert run.info.status == "FINISHED"
    found = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics}
    assert_holds(found, ledger_series(spec, report))
    late = open_sink(TrackingSpec(backend="mlflow", uri=uri, project="islands"), spec.name, run_id, "b")
    assert late.run_uuid == run.info.run_id  # a writer that comes later joins the run's one MLflow run


def test_export_metrics_into_wandb_offline_files(tracked_run, tmp_path, monkeypatch):
    """Read back with wandb's own reader of its offline run log (`wandb leet inspect`)."""
    spec, config, run_id, report, _ = tracked_run
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["export-metrics", run_id, "--config", config, "--to", "wandb", str(tmp_path)]) == 0
    [log] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(log)],
                             capture_output=True, text=True, check=True, timeout=120).stdout.splitlines()
    found: dict[str, dict[int, float]] = {}
    for record in map(json.loads, records):
        if record["type"] == "history":
            row = record["history"]["item"]
            axis = "round" if "round" in row else "inner_step"
            for key, value in row.items():
                if not key.startswith("_") and key != axis:
                    found.setdefault(key, {})[row[axis]] = value
        if record["type"] == "run":
            assert record["run"]["display_name"] == run_id and record["run"]["run_id"] == run_id
    assert_holds(found, ledger_series(spec, report))


def test_the_lifecycle_links_its_tracker_run_in_the_ui(tracked_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    spec, _, run_id, _, flow_run_id = tracked_run

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=["tracker-run"])))

    [artifact] = asyncio.run(read())
    assert artifact.type == "markdown" and (Path(spec.tracking.uri) / run_id).as_uri() in artifact.data
    assert f"tensorboard --logdir {Path(spec.tracking.uri) / run_id}" in artifact.description


@pytest.mark.parametrize("backend, module", [("tensorboard", "torch.utils.tensorboard"), ("mlflow", "mlflow"),
                                             ("wandb", "wandb")])
def test_a_missing_extra_is_named_with_how_to_install_it(backend, module, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # what importing a package that is not installed does
    settings = TrackingSpec(backend=backend, uri=None if backend == "wandb" else str(tmp_path))
    with pytest.raises(TrackingUnavailable, match=rf"needs the '{backend}' extra.*pip install 'archipelago\[{backend}\]'"):
        open_sink(settings, "run", "run-1", "control")


def test_a_tensorboard_sink_makes_its_folder_only_with_its_first_point(tmp_path):
    """The lifecycle opens the tracker run before training: a run that fails before any point leaves no
    empty folder behind."""
    settings = TrackingSpec(backend="tensorboard", uri=str(tmp_path / "tb"))
    sink = open_sink(settings, "run", "run-1", "control", primary=True)
    assert sink.link().url == (tmp_path / "tb" / "run-1").as_uri()
    sink.close(finished=True)
    assert not (tmp_path / "tb").exists()
    sink = open_sink(settings, "run", "run-1", "a")
    sink.log(learner_points("a", 0, 64, [{"round": 0, "loss": 2.5, "compute_s": 1.0, "sync_s": 1.0,
                                          "steps": {"step": [0, 1], "loss": [3.0, 2.0], "learning_rate": [0.5, 1.0],
                                                    "grad_norm": [0.25, 0.75], "peak_memory_bytes": [7, 8]}}], []))
    sink.close()
    assert tensorboard_series(tmp_path / "tb" / "run-1") == {
        "loss/a/learner-0": {1: 2.5}, "tokens_per_s/a/learner-0": {1: 32.0}, "inner_loss/a/learner-0": {1: 3.0, 2: 2.0},
        "learning_rate/a/learner-0": {1: 0.5, 2: 1.0}, "grad_norm/a/learner-0": {1: 0.25, 2: 0.75},
        "peak_memory_bytes/a/learner-0": {1: 7.0, 2: 8.0}}


class Recorded(Sink):
    """The batching every backend shares, with its writes recorded."""

    def __init__(self, settings, clock):
        super().__init__(settings, clock)
        self.writes, self.closed = [], None

    def _write(self, points):
        self.writes.append([p.step for p in points])

    def _close(self, finished):
        self.closed = finished

    def link(self):
        raise NotImplementedError


def test_a_sink_writes_in_batches_by_count_by_age_and_at_close():
    now = [0.0]
    sink = Recorded(TrackingSpec(backend="tensorboard", uri="unused", flush_every_records=3, flush_every_s=10),
                    clock=lambda: now[0])
    sink.log([Point("loss", 1.0, 0), Point("loss", 1.0, 1)])
    assert sink.writes == []
    sink.log([Point("loss", 1.0, 2)])
    assert sink.writes == [[0, 1, 2]]
    sink.log([Point("loss", 1.0, 3)])
    now[0] = 10.0
    sink.log([Point("loss", 1.0, 4)])
    assert sink.writes == [[0, 1, 2], [3, 4]]
    sink.log([Point("loss", 1.0, 5)])
    sink.close(finished=True)
    assert sink.writes == [[0, 1, 2], [3, 4], [5]] and sink.closed is True


@pytest.mark.parametrize("tracking, problem", [
    ({"backend": "tensorboard"}, "backend tensorboard needs uri"),
    ({"backend": "mlflow"}, "backend mlflow needs uri"),
    ({"uri": "/tmp/runs"}, "uri and project need a backend"),
    ({"backend": "mlflow", "uri": "https://admin:hunter2@mlflow.example"}, "must not carry credentials"),
    ({"backend": "mlflow", "uri": "https://mlflow.example/?token=hunter2"}, "must not have a query string"),
    ({"backend": "tensorboard", "uri": "s3://bucket/tb"}, "uri is a folder"),
    ({"backend": "wandb", "uri": "ftp://wandb.example"}, "a folder or the http(s):// base URL"),
    ({"backend": "comet"}, "tracking.backend"),
])
def test_a_tracking_section_that_cannot_work_is_refused_naming_the_problem(tracking, problem):
    with pytest.raises(SpecError) as err:
        parse_spec({**demo_raw(), "tracking": tracking})
    assert problem in str(err.value) and "tracking" in str(err.value) and "hunter2" not in str(err.value)
