"""The one decorator every lifecycle stage uses."""

from __future__ import annotations

from prefect import task

from infra.results import STAGE_CACHE


def stage(name: str, task_run_name: str | None = None, **options):
    """A lifecycle stage: a Prefect task whose result persists in the run's store under a key made
    of its inputs, so a retried or resumed run reuses it. Its runs carry `name` (or the
    `task_run_name` template) as is, in the UI and in the stage list `archipelago run` prints."""
    return task(name=name, task_run_name=task_run_name or name, cache_policy=STAGE_CACHE, persist_result=True,
                **options)
