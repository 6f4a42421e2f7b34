"""Evaluation and the report as Prefect tasks and artifacts."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eval.evaluate import evaluate
from eval.report import build_report, evaluation_table, fault_report, settings_markdown
from infra import layout
from infra.results import STAGE_CACHE
from infra.spec import RunSpec
from infra.store import run_store
from tasks.faults import fail_once_if_asked
from training.learner import build_model


@task(name="evaluate", cache_policy=STAGE_CACHE, persist_result=True)
def evaluate_models(spec: RunSpec, run_id: str) -> dict:
    fail_once_if_asked(spec, run_id, "evaluate")
    results = evaluate(spec, run_store(spec.store, run_id))
    logger = get_run_logger()
    for name, arms in results.items():
        logger.info("%s: islands %.4f bpb, standard %.4f bpb over %s bytes", name, arms["islands"]["bpb"],
                    arms["baseline"]["bpb"], f"{arms['islands']['bytes']:,}")
    return results


@task(name="report", cache_policy=STAGE_CACHE, persist_result=True)
def publish_report(spec: RunSpec, run_id: str, evals: dict, consensus: dict, baseline: dict,
                   wall_seconds: float) -> dict:
    fail_once_if_asked(spec, run_id, "report")
    store = run_store(spec.store, run_id)
    summaries = [store.get_json(layout.learner_summary(s.index)) for s in spec.learners]
    checkpointed = {s.index: sum(key.endswith("/checkpoint.json") for key in store.list(layout.learner_prefix(s.index)))
                    for s in spec.learners}
    report = build_report(spec, run_id, evals, consensus, summaries, baseline,
                          build_model(spec).parameter_counts(), wall_seconds)
    report["faults"] = fault_report(spec, summaries, checkpointed, store.list("faults"))
    store.put_json(layout.REPORT, report)
    table = evaluation_table(report)
    create_table_artifact(table.round(5).to_dict(orient="records"), key="bpb-table",
                          description=f"Bits per byte, islands vs standard training ({run_id})")
    create_markdown_artifact(settings_markdown(spec, report), key="run-report",
                             description=f"Settings and communication of {run_id}")
    return report
