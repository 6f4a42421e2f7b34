"""Evaluation and the report as Prefect tasks and artifacts."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.artifacts import (create_image_artifact, create_link_artifact, create_markdown_artifact,
                               create_table_artifact)

from eval import figures
from eval.curve import CURVE_EVAL_BYTES, evaluate_curve
from eval.evaluate import evaluate
from eval.report import build_report, evaluation_table, fault_report, settings_markdown
from infra import layout
from infra.spec import RunSpec
from infra.store import refused_in_process
from infra.stores import open_run
from tasks.faults import fail_once_if_asked
from tasks.planning import measured_step_seconds, publish_plan
from tasks.stage import stage
from tasks.tracking import log_report
from training.learner.ledger import read_summaries
from training.model.registry import build_model
from training.planning.markdown import UNLIMITED_BPS


@stage("evaluate")
def evaluate_models(spec: RunSpec, run_id: str) -> dict:
    fail_once_if_asked(spec, run_id, "evaluate")
    results = evaluate(spec, open_run(spec, run_id))
    logger = get_run_logger()
    for name, arms in results.items():
        standard = f", standard {arms['baseline']['bpb']:.4f} bpb" if arms["baseline"] else ""
        logger.info("%s: islands %.4f bpb%s over %s bytes", name, arms["islands"]["bpb"], standard,
                    f"{arms['islands']['bytes']:,}")
    return results


@stage("report", ignored_inputs=("wall_seconds",))
def publish_report(spec: RunSpec, run_id: str, evals: dict, consensus: dict, baseline: dict | None,
                   wall_seconds: float) -> dict:
    fail_once_if_asked(spec, run_id, "report")
    store = open_run(spec, run_id)
    summaries = read_summaries(spec, store)
    report = build_report(spec, run_id, evals, consensus, summaries, baseline,
                          build_model(spec).parameter_counts(), wall_seconds, refused_in_process())
    report["faults"] = fault_report(spec, summaries, store.list("faults"))
    store.put_json(layout.REPORT, report)
    log_report(spec, run_id, report)
    inter_bytes_per_s = spec.sync.transport.bandwidth.inter_island
    publish_plan(spec, measured_step_seconds(spec, summaries),
                 inter_bytes_per_s * 8 if inter_bytes_per_s else UNLIMITED_BPS, key="plan-vs-measured",
                 description=f"The planner's replay of this run at its learners' own step times, beside what it "
                             f"measured ({run_id})",
                 measured={"utilisation": report["utilisation"],
                           "inter_island_bytes": report["communication"]["inter_island_bytes"]})
    table = evaluation_table(report)
    create_table_artifact(table.round(5).to_dict(orient="records"), key="bpb-table",
                          description=f"Bits per byte, islands vs standard training ({run_id})")
    create_markdown_artifact(settings_markdown(spec, report), key="run-report",
                             description=f"Settings and communication of {run_id}")
    return report


@stage("evaluate-curve")
def evaluate_curve_points(spec: RunSpec, run_id: str) -> list[dict]:
    """Both arms at a few matching token counts, for the bpb-versus-tokens plot."""
    points = evaluate_curve(spec, open_run(spec, run_id))
    create_table_artifact([{**p, "bpb": round(p["bpb"], 5)} for p in points], key="bpb-curve",
                          description=f"Bits per byte along training, both arms, first {CURVE_EVAL_BYTES:,} bytes "
                                      f"of each held-out set ({run_id})")
    return points


@stage("figures")
def publish_figures(spec: RunSpec, run_id: str, communication: dict, curve: list[dict]) -> dict:
    """PNG figures in the run's store, each shown as an image artifact with a link to the stored file.

    The image artifact carries the PNG itself (a data URL): the UI shows it whether the store is a
    local folder or a private bucket the browser cannot read.
    """
    store = open_run(spec, run_id)
    summaries = read_summaries(spec, store)
    pngs = {"bpb-vs-tokens": (figures.bpb_versus_tokens(curve, CURVE_EVAL_BYTES),
                              "Bits per byte versus tokens, islands and standard"),
            "communication": (figures.communication(communication),
                              "Inter-island bytes vs per-step all-reduce; store traffic per learner"),
            "utilisation": (figures.utilisation(summaries), "Time computing vs synchronising, per learner")}
    addresses = {}
    for name, (png, description) in pngs.items():
        store.put_bytes(layout.figure(name), png)
        addresses[name] = store.address(layout.figure(name))
        create_image_artifact(figures.data_url(png), key=name,
                              description=f"{description} ({run_id})")
        create_link_artifact(addresses[name], link_text=f"{name}.png in the run's store", key=f"{name}-png",
                             description=f"{description}: the PNG file ({run_id})")
    return addresses
