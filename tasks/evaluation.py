"""Evaluation and the report as Prefect tasks and artifacts."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eval.evaluate import evaluate
from eval.report import build_report, evaluation_table, settings_markdown
from infra import layout
from infra.spec import RunSpec
from infra.store import run_store
from training.learner import build_model


@task(name="evaluate")
def evaluate_models(spec: RunSpec, run_id: str) -> dict:
    results = evaluate(spec, run_store(spec.store, run_id))
    logger = get_run_logger()
    for name, arms in results.items():
        logger.info("%s: islands %.4f bpb, standard %.4f bpb over %s bytes", name, arms["islands"]["bpb"],
                    arms["baseline"]["bpb"], f"{arms['islands']['bytes']:,}")
    return results


@task(name="report")
def publish_report(spec: RunSpec, run_id: str, evals: dict, consensus: dict, baseline: dict,
                   wall_seconds: float) -> dict:
    store = run_store(spec.store, run_id)
    summaries = [store.get_json(layout.learner_summary(s.index)) for s in spec.learners]
    report = build_report(spec, run_id, evals, consensus, summaries, baseline,
                          build_model(spec).parameter_counts(), wall_seconds)
    store.put_json(layout.REPORT, report)
    table = evaluation_table(evals)
    create_table_artifact(table.round(5).to_dict(orient="records"), key="bpb-table",
                          description=f"Bits per byte, islands vs standard training ({run_id})")
    create_markdown_artifact(settings_markdown(spec, report), key="run-report",
                             description=f"Settings and communication of {run_id}")
    return report
