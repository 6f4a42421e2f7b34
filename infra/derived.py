"""Derived objects: models the lifecycle computes from other objects (the consolidated model, the
baseline and its snapshots), committed so that a damaged write does not fail their stage forever.

The writer reads each commit back; if the store damaged it, or an earlier attempt left a damaged
or different commit under the key, it commits again under the next rewrite key
(`layout.rewrite`), never over what is there. Readers take the newest commit.
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


def newest_commit(store, key: str) -> str:
    """The newest committed rewrite of `key`, else `key` itself."""
    return next((layout.rewrite(key, n) for n in range(REWRITES, 0, -1) if store.is_committed(layout.rewrite(key, n))),
                key)


def read_derived(store, key: str) -> tuple[dict[str, torch.Tensor], dict, int]:
    """`store.read_committed` of the newest commit of a derived object."""
    return store.read_committed(newest_commit(store, key))
