"""Faults a run spec asks for at the level of lifecycle stages."""

from __future__ import annotations

from infra import layout
from infra.spec import RunSpec
from infra.spec.faults import FailStage
from infra.stores import open_run


def fail_once_if_asked(spec: RunSpec, run_id: str, stage: str) -> None:
    """Fault injection: a `fail_stage` fault fails its stage the first time only."""
    if any(f.stage == stage for f in spec.faults_of(FailStage)):
        store = open_run(spec, run_id)
        marker = layout.failed_stage_marker(stage)
        if not store.exists(marker):
            store.put_json(marker, {"stage": stage})
            raise RuntimeError(f"stage {stage} failed on purpose (fault 'fail_stage'); retry the run to continue")
