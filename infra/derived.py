"""Derived objects: models the lifecycle computes from other objects (the consolidated model, the
baseline and its snapshots), committed so that a damaged write does not fail their stage forever.

The writer reads each commit back; if the store damaged it, or an earlier attempt left a damaged
or different commit under the key, it commits again under the next rewrite key
(`layout.rewrite`), never over what is there. Readers take the newest commit that verifies.
"""

from __future__ import annotations

import torch

from infra import layout
from infra.store import IntegrityError, ObjectExists, StoreError

REWRITES = 3


def commit_derived(store, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """Commit `tensors` and `meta` as `key` or, if that commit cannot be read back intact, as its next rewrite.
    Returns the key that holds them."""
    failures = []
    for candidate in [key, *(layout.rewrite(key, n) for n in range(1, REWRITES + 1))]:
        try:
            store.commit_tensors(candidate, tensors, meta)
            store.read_committed(candidate)
            return candidate
        except (IntegrityError, ObjectExists) as err:
            failures.append(str(err))
    raise StoreError(f"could not commit {key} intact in {REWRITES + 1} attempts: " + "; ".join(failures))


def read_derived(store, key: str) -> tuple[dict[str, torch.Tensor], dict, int]:
    """`store.read_committed` of the newest commit of a derived object that verifies: a rewrite planted
    past the real one (it does not verify in a run with keys) falls back to the real one."""
    candidates = [layout.rewrite(key, n) for n in range(REWRITES, 0, -1)] + [key]
    errors = []
    for candidate in candidates:
        if candidate != key and not store.is_committed(candidate):
            continue
        try:
            return store.read_committed(candidate)
        except IntegrityError as err:
            errors.append(str(err))
    raise IntegrityError(f"no commit of {key} verifies: " + "; ".join(errors))
