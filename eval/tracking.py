"""A run's series in the experiment trackers ML teams already use: TensorBoard, MLflow, Weights & Biases.

Each learner's ledger (training/learner/ledger.py) is the record: an island's worker relays the part
of it each `round` event carries (tasks/training.py), `archipelago export-metrics` replays a finished
run's, and both turn into the same points through `learner_points`, so a tracker holds the ledger's
values whichever way they came. The control plane adds the report's figures (`report_points`) at
the end. Every writer of a run, on any worker, logs to one tracker run named by the run id.

A `Sink` buffers points and writes them in batches (`tracking.flush_every_records` or
`flush_every_s`, and when it closes), so a remote tracker is not called per round. Each backend's
package is an optional extra, imported only when a spec names the backend. Credentials come from the
writing process's environment, never from the spec, and so does a tracker server: a spec's server must
be the one that environment names (`check_endpoint`).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from infra import layout
from infra.spec.tracking import TrackingSpec
from training.learner.ledger import read_summaries

logger = logging.getLogger(__name__)

# The series each learner gets, under `<metric>/<island>/learner-<index>`. Rounds are numbered from 1
# to `sync.rounds`, as the logs number them; the ledger's indices, from 0, are one less. At step = the
# round, a round's own (`learner_points`): its mean inner loss (`loss`) and its tokens over its seconds
# computing and syncing (`tokens_per_s`); an exchange's, at the round it exchanged, by the ledger
# entry's field it comes from: seconds the learner waited for it, message bytes it read over each link
# class and wrote, partners' messages that never came or were refused.
EXCHANGE_METRICS = {"seconds_blocked": "blocked_s", "bytes_read_intra": "bytes_read_intra",
                    "bytes_read_inter": "bytes_read_inter", "bytes_written": "bytes_sent",
                    "missed_exchanges": "missed", "refused_messages": "refused"}
# At step = the inner step over the learner's whole run, from 1 (round r's are (r-1)*H+1 to r*H, H the
# island's inner steps), those the ledger keeps (training/learner/ledger.py): by the field of a round's
# `steps` each comes from.
STEP_METRICS = {"inner_loss": "loss", "learning_rate": "learning_rate", "grad_norm": "grad_norm",
                "peak_memory_bytes": "peak_memory_bytes"}
# The report's communication totals, under `communication/<name>`.
COMMUNICATION_TOTALS = ("inter_island_bytes", "intra_island_bytes", "bytes_written", "checkpoint_bytes",
                        "allreduce_equivalent_bytes", "inter_island_reduction")
CONSENSUS = ("max_weight_distance", "mean_weight_distance", "max_pairwise_distance")
# Each series' x axis, by the name before its first "/": W&B plots them against these fields.
AXES = {"round": ("loss", "tokens_per_s", *EXCHANGE_METRICS, "bpb", "consensus", "communication"),
        "inner_step": tuple(STEP_METRICS)}
RUN_TAG = "archipelago.run_id"  # the MLflow tag that names a tracker run's archipelago run


@dataclass(frozen=True)
class Point:
    key: str
    value: float
    step: int
    axis: str = "round"  # what `step` counts: rounds, or a learner's inner steps ("inner_step")


@dataclass(frozen=True)
class TrackerLink:
    """Where a person finds the tracker run: a URL (http, or file:// for local files) and how to open it."""

    url: str
    description: str


class TrackingUnavailable(RuntimeError):
    """The backend's package is not installed here (the message names the extra that installs it), or
    the spec names a tracker server that is not the one this process is configured for."""


# Where a writing process is configured to log to a tracker server: its own settings, as its credentials are.
TRACKER_ENDPOINTS = {"mlflow": "MLFLOW_TRACKING_URI", "wandb": "WANDB_BASE_URL"}


def check_endpoint(settings: TrackingSpec) -> None:
    """A tracker server a spec names (an http(s) or databricks `tracking.uri`) must be the one this process
    is configured for ($MLFLOW_TRACKING_URI, $WANDB_BASE_URL): its credentials for that server are sent
    to it, so a spec must not pick the host. Folders and local databases are not servers."""
    if settings.uri is None or urlsplit(settings.uri).scheme not in ("http", "https", "databricks"):
        return
    variable = TRACKER_ENDPOINTS[settings.backend]
    if settings.uri.rstrip("/") != os.environ.get(variable, "").rstrip("/"):
        # Neither value is quoted: either may hold what a log should not.
        raise TrackingUnavailable(f"tracking.uri names a {settings.backend} server that is not this worker's "
                                  f"${variable}; a tracker's server is the worker's own setting, so that its "
                                  f"credentials go nowhere else: set ${variable} where the run's writers run")


def learner_points(island: str, learner: int, tokens_per_round: int, rounds: list[dict],
                   exchanges: list[dict]) -> list[Point]:
    """A learner's points from its ledger's round and exchange entries (all of them, or those booked since
    its last `round` event)."""
    tag = f"{island}/learner-{learner}"
    points = []
    for entry in rounds:
        seconds, number = entry["compute_s"] + entry["sync_s"], entry["round"] + 1
        points.append(Point(f"loss/{tag}", entry["loss"], number))
        if seconds > 0:
            points.append(Point(f"tokens_per_s/{tag}", tokens_per_round / seconds, number))
        steps = entry.get("steps") or {"step": []}
        for metric, field in STEP_METRICS.items():
            points.extend(Point(f"{metric}/{tag}", value, index + 1, "inner_step")
                          for index, value in zip(steps["step"], steps.get(field, ())))
    for entry in exchanges:
        points.extend(Point(f"{metric}/{tag}", entry[field], entry["round"] + 1)
                      for metric, field in EXCHANGE_METRICS.items())
    return points


def report_points(report: dict, step: int) -> list[Point]:
    """The report's bpb table (`bpb/<evaluation>/islands`, `/baseline`, `/relative_difference`), consensus
    distances and communication totals, at `step` (the run's number of rounds: its last round's)."""
    values = {}
    for name, entry in report["evals"].items():
        values.update({f"bpb/{name}/islands": entry["islands_bpb"], f"bpb/{name}/baseline": entry["baseline_bpb"],
                       f"bpb/{name}/relative_difference": entry["relative_difference"]})
    values.update({f"consensus/{name}": report["consensus"][name] for name in CONSENSUS})
    values.update({f"communication/{name}": report["communication"][name] for name in COMMUNICATION_TOTALS})
    return [Point(key, value, step) for key, value in values.items() if value is not None]


def replay_run(spec, store, sink: "Sink") -> dict:
    """A run's ledgers (its learners' summaries) and, once it has one, its report from its store into
    `sink`: what its relays and its report stage logged, or would have. Returns what it logged."""
    summaries = read_summaries(spec, store)
    points = 0
    for summary in summaries:
        slot = spec.learners[summary.learner]
        learner = learner_points(slot.island.name, slot.index, slot.tokens_per_round(), summary.rounds,
                                 summary.exchanges)
        sink.log(learner)
        points += len(learner)
    report = store.get_json(layout.REPORT) if store.exists(layout.REPORT) else None
    if report is not None:
        final = report_points(report, spec.sync.rounds)
        sink.log(final)
        points += len(final)
    return {"learners": len(summaries), "points": points, "report": report is not None}


def _import(module: str, backend: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise TrackingUnavailable(f"tracking.backend {backend} needs the '{backend}' extra, which is not installed "
                                  f"here ({err}): pip install 'archipelago[{backend}]'") from None


class Sink(ABC):
    """A buffered writer of points to one tracker run; safe to share between threads."""

    def __init__(self, settings: TrackingSpec, clock: Callable[[], float] = time.monotonic):
        self.settings, self.clock = settings, clock
        self._buffer: list[Point] = []
        self._flushed_at = clock()
        self._lock = threading.Lock()

    def log(self, points: Iterable[Point]) -> None:
        """Buffer `points`; write the buffer once it holds `flush_every_records` or `flush_every_s` has passed."""
        with self._lock:
            self._buffer.extend(points)
            if len(self._buffer) >= self.settings.flush_every_records \
                    or self.clock() - self._flushed_at >= self.settings.flush_every_s:
                self._flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def close(self, finished: bool = False) -> None:
        """Write what is buffered and let the tracker go; `finished`: the run is over (the report is logged)."""
        with self._lock:
            self._flush()
            self._close(finished)

    def _flush(self) -> None:
        points, self._buffer, self._flushed_at = self._buffer, [], self.clock()
        if points:
            self._write(points)

    @abstractmethod
    def _write(self, points: list[Point]) -> None: ...

    @abstractmethod
    def _close(self, finished: bool) -> None: ...

    @abstractmethod
    def link(self) -> TrackerLink: ...


class TensorBoardSink(Sink):
    """Event files under `<uri>/<run id>`: each writing process adds its own file, named by its writer,
    once it has a point to write (a run that fails before any leaves no empty folder)."""

    def __init__(self, settings: TrackingSpec, project: str, run_id: str, writer: str, **options):
        super().__init__(settings, **options)
        self.tensorboard = _import("torch.utils.tensorboard", "tensorboard")
        self.logdir, self.writer_name = Path(settings.uri) / run_id, writer
        self.writer = None

    def _write(self, points: list[Point]) -> None:
        if self.writer is None:
            self.writer = self.tensorboard.SummaryWriter(str(self.logdir), filename_suffix=f".{self.writer_name}")
        for point in points:
            self.writer.add_scalar(point.key, point.value, point.step)
        self.writer.flush()

    def _close(self, finished: bool) -> None:
        if self.writer is not None:
            self.writer.close()

    def link(self) -> TrackerLink:
        return TrackerLink(self.logdir.resolve().as_uri(),
                           f"TensorBoard event files of this run: `tensorboard --logdir {self.logdir}`")


class MlflowSink(Sink):
    """An MLflow run, named and tagged by the run id, in the experiment `project`.

    MLflow picks run ids itself, so writers that start at once may each create one: each then keeps
    the earliest of the run's (by start time, then id) and deletes its own if that is not it."""

    BATCH = 1000  # metrics per log_batch call, MLflow's limit

    def __init__(self, settings: TrackingSpec, project: str, run_id: str, writer: str, **options):
        super().__init__(settings, **options)
        mlflow = _import("mlflow", "mlflow")
        self.entities = importlib.import_module("mlflow.entities")
        self.client = mlflow.MlflowClient(tracking_uri=settings.uri)
        self.experiment_id = self._experiment(project, importlib.import_module("mlflow.exceptions").MlflowException)
        self.run_uuid = self._run(run_id)

    def _experiment(self, name: str, error: type) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except error:  # another writer created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def _earliest_run_of(self, run_id: str) -> str | None:
        runs = self.client.search_runs([self.experiment_id], f"tags.`{RUN_TAG}` = '{run_id}'")
        return min(((run.info.start_time, run.info.run_id) for run in runs), default=(None, None))[1]

    def _run(self, run_id: str) -> str:
        kept = self._earliest_run_of(run_id)
        if kept is None:
            mine = self.client.create_run(self.experiment_id, run_name=run_id, tags={RUN_TAG: run_id}).info.run_id
            kept = self._earliest_run_of(run_id)
            if kept != mine:
                self.client.delete_run(mine)
        return kept

    def _write(self, points: list[Point]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.entities.Metric(p.key, float(p.value), now, p.step) for p in points]
        for start in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_uuid, metrics=metrics[start:start + self.BATCH])

    def _close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run_uuid, "FINISHED")

    def link(self) -> TrackerLink:
        uri = self.settings.uri
        page = f"#/experiments/{self.experiment_id}/runs/{self.run_uuid}"
        scheme = urlsplit(uri).scheme
        if scheme in ("http", "https"):
            return TrackerLink(f"{uri.rstrip('/')}/{page}", f"MLflow run {self.run_uuid}")
        local = uri[len("sqlite:///"):] if scheme == "sqlite" else urlsplit(uri).path if scheme == "file" else uri
        return TrackerLink(Path(local).resolve().as_uri() if scheme in ("sqlite", "file", "") else uri,
                           f"MLflow run {self.run_uuid} in {uri}: `mlflow server --backend-store-uri {uri}` "
                           f"(the full mlflow package) shows it at /{page}")


class WandbSink(Sink):
    """A W&B run whose id is the run id. Online, every writing process joins it in W&B's shared mode (the
    control plane as the primary writer); with WANDB_MODE=offline each process writes an offline run
    folder of that id, which `wandb sync` uploads into the one run. W&B holds one live run of an id per process: the
    sinks of a process (the islands whose learners it relays) share it. A point is logged with its step as
    the field of its axis: `round`, or `inner_step` for the per-step series."""

    _runs: dict[str, list] = {}  # W&B run id -> [run, sinks using it]
    _runs_lock = threading.Lock()

    def __init__(self, settings: TrackingSpec, project: str, run_id: str, writer: str, primary: bool, **options):
        super().__init__(settings, **options)
        wandb = _import("wandb", "wandb")
        self.run_id = run_id
        with self._runs_lock:
            if run_id not in self._runs:
                self._runs[run_id] = [self._init(wandb, settings, project, run_id, writer, primary), 0]
            self._runs[run_id][1] += 1
            self.run = self._runs[run_id][0]

    @staticmethod
    def _init(wandb, settings: TrackingSpec, project: str, run_id: str, writer: str, primary: bool):
        offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun")
        server = settings.uri is not None and urlsplit(settings.uri).scheme in ("http", "https")
        folder = None if settings.uri is None or server else Path(settings.uri)
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=project, id=run_id, name=run_id, dir=folder, resume="allow", reinit="create_new",
            settings=wandb.Settings(mode="offline" if offline else "shared", x_label=writer, x_primary=primary,
                                    console="off", x_disable_stats=True, silent=True,
                                    **({"base_url": settings.uri} if server else {})))
        for axis, series in AXES.items():
            run.define_metric(axis)
            for name in series:
                run.define_metric(f"{name}/*", step_metric=axis)
        return run

    def _write(self, points: list[Point]) -> None:
        by_step: dict[tuple[str, int], dict] = {}
        for point in points:
            by_step.setdefault((point.axis, point.step), {})[point.key] = point.value
        with self._runs_lock:
            for (axis, step), values in by_step.items():
                self.run.log({**values, axis: step})

    def _close(self, finished: bool) -> None:
        with self._runs_lock:
            self._runs[self.run_id][1] -= 1
            if self._runs[self.run_id][1] == 0:
                del self._runs[self.run_id]
                self.run.finish()

    def link(self) -> TrackerLink:
        if not self.run.offline:
            return TrackerLink(self.run.url, f"W&B run {self.run.id}")
        folder = Path(self.run.settings.sync_dir)
        return TrackerLink(folder.resolve().as_uri(), f"W&B offline run {self.run.id}: `wandb sync {folder}` "
                                                      "uploads it")


BACKENDS: dict[str, type[Sink]] = {"tensorboard": TensorBoardSink, "mlflow": MlflowSink, "wandb": WandbSink}


def open_sink(settings: TrackingSpec, spec_name: str, run_id: str, writer: str, primary: bool = False,
              from_spec: bool = True) -> Sink:
    """A sink on the tracker run of `run_id`, for `writer` (the control plane, an island, an export).
    `primary`: the writer that creates the run and ends it (the control plane). `from_spec`: `settings`
    are a run spec's, whose server must be this process's own (`check_endpoint`); an operator's command
    line names its own."""
    if from_spec:
        check_endpoint(settings)
    options = {"primary": primary} if settings.backend == "wandb" else {}
    return BACKENDS[settings.backend](settings, settings.project_of(spec_name), run_id, writer, **options)


_shared: dict[tuple, list] = {}  # (settings, run id, writer) -> [sink, users]
_shared_lock = threading.Lock()


@contextmanager
def shared_sink(settings: TrackingSpec, spec_name: str, run_id: str, writer: str) -> Iterator[Sink | None]:
    """The process's one sink of `writer` (an island) on the run's tracker run, shared by the relays of
    the island's learners in it and closed when the last lets go (a tracker that fails then costs its
    last points, logged as a warning, not the training); None when the spec tracks nothing."""
    if settings.backend == "none":
        yield None
        return
    key = (settings, run_id, writer)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = [open_sink(settings, spec_name, run_id, writer), 0]
        _shared[key][1] += 1
        sink = _shared[key][0]
    try:
        yield sink
    finally:
        with _shared_lock:
            _shared[key][1] -= 1
            last = _shared[key][1] == 0
            if last:
                del _shared[key]
        if last:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - see above
                logger.warning("tracking: closing the %s run of %s failed: %s: %s", settings.backend, run_id,
                               type(err).__name__, err)
