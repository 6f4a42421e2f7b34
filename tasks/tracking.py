"""The experiment tracker in the Prefect layer: the link to the run's tracker run on the lifecycle's
flow run, and the report's figures at the end (each learner's rounds come through its relay,
tasks/training.py)."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact

from eval.tracking import open_sink, report_points
from infra.authority import CONTROL
from infra.spec import RunSpec


def publish_tracker_link(spec: RunSpec, run_id: str) -> None:
    """Open (or create) the run's tracker run before any training, so a tracker that cannot be reached or
    is not installed stops the run before it costs compute, and put a link to it on the flow run."""
    if spec.tracking.backend == "none":
        return
    sink = open_sink(spec.tracking, spec.name, run_id, CONTROL, primary=True)
    try:
        link = sink.link()
    finally:
        sink.close()
    create_link_artifact(link.url, link_text=f"{spec.tracking.backend} run {run_id}", key="tracker-run",
                         description=f"The run's curves in {spec.tracking.backend}: {link.description}")
    get_run_logger().info("tracking in %s: %s", spec.tracking.backend, link.url)


def log_report(spec: RunSpec, run_id: str, report: dict) -> None:
    """The report's bpb table, consensus distances and communication totals, into the run's tracker run,
    which this ends. The report in the store is the record: a tracker that fails here costs a warning,
    and `archipelago export-metrics` can log the run again later."""
    if spec.tracking.backend == "none":
        return
    try:
        sink = open_sink(spec.tracking, spec.name, run_id, CONTROL, primary=True)
        try:
            sink.log(report_points(report, spec.sync.rounds))
        finally:
            sink.close(finished=True)
    except Exception as err:  # noqa: BLE001 - see above
        get_run_logger().warning("tracking: the report's figures did not reach %s (%s: %s); `archipelago "
                                 "export-metrics %s --config SPEC --to ...` logs them from the store",
                                 spec.tracking.backend, type(err).__name__, err, run_id)
