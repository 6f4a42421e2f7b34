"""Stores' S3 credentials from Prefect Secret blocks: a site's keys kept in the Prefect server it
trusts, not in a worker's shell. The spec names a block (`credentials_block`) and the variables'
prefix (`credentials_env`); the flow that opens the stores or starts learners loads the block on its
own worker and sets <PREFIX>_AWS_* in its process, where `infra.s3.credentials_from_env` and the
learners it starts read them. Values never reach the spec, parameters, logs or artifacts."""

from __future__ import annotations

import os

from prefect.blocks.system import Secret

from infra.spec import RunSpec, SpecError

_VARIABLES = {"aws_access_key_id": "AWS_ACCESS_KEY_ID", "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
              "aws_session_token": "AWS_SESSION_TOKEN"}
_REQUIRED = ("aws_access_key_id", "aws_secret_access_key")


def load_credential_blocks(spec: RunSpec, island: str | None = None) -> list[str]:
    """Set <PREFIX>_AWS_* from island stores' Secret blocks; returns the blocks' names.

    `island`: the segment of that island loads its own store's writer block and the other islands'
    read-only blocks (`read_credentials_block`), so that no island holds another's writer key. None:
    the control plane, which writes every island's data shards, loads every writer block."""
    wanted = []  # (field, block, variables' prefix)
    for n, spec_island in enumerate(spec.islands):
        store = spec_island.store
        if store is None:
            continue
        if island is None or spec_island.name == island:
            wanted.append((f"islands.{n}.store.credentials_block", store.credentials_block, store.credentials_env))
        else:
            wanted.append((f"islands.{n}.store.read_credentials_block", store.read_credentials_block,
                           store.read_credentials_env))
    loaded = []
    for where, block, prefix in wanted:
        if block is None or block in loaded:
            continue
        try:
            value = Secret.load(block).get()
        except ValueError:
            raise SpecError(f"{where}: no Prefect Secret block named {block!r}") from None
        if not isinstance(value, dict) or any(not isinstance(value.get(key), str) or not value[key]
                                              for key in _REQUIRED):
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise SpecError(f"{where}: Secret block {block!r} must hold JSON with "
                            f"{' and '.join(_REQUIRED)} (it has {keys})")
        unknown = sorted(set(value) - set(_VARIABLES))
        if unknown:
            raise SpecError(f"{where}: Secret block {block!r} has unknown key(s) {unknown}")
        for key, variable in _VARIABLES.items():
            if key in value:
                os.environ[f"{prefix}_{variable}"] = value[key]
        loaded.append(block)
    return loaded
