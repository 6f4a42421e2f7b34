"""The one decorator every lifecycle stage uses."""

from __future__ import annotations

from prefect import task

from tasks.results import RESULT_SERIALIZER, stage_cache


def stage(name: str, task_run_name: str | None = None, ignored_inputs: tuple[str, ...] = (), **options):
    """A lifecycle stage: a Prefect task whose result persists in the run's store under a key made
    of its inputs, so a retried or resumed run reuses it. Its result is plain JSON (so a stage
    returns dicts, lists, strings and numbers). Its runs carry `name` (or the `task_run_name`
    template) as is, in the UI and in the stage list `archipelago run` prints. `ignored_inputs`: see
    `stage_cache`."""
    return task(name=name, task_run_name=task_run_name or name, cache_policy=stage_cache(ignored_inputs),
                persist_result=True, result_serializer=RESULT_SERIALIZER, **options)
