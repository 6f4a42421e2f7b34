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


def load_credential_blocks(spec: RunSpec) -> list[str]:
    """Set <credentials_env>_AWS_* from every island store's Secret block; returns the blocks' names."""
    stores = [(f"islands.{n}.store", island.store) for n, island in enumerate(spec.islands) if island.store is not None]
    loaded = []
    for field, store in stores:
        if store.credentials_block is None or store.credentials_block in loaded:
            continue
        where = f"{field}.credentials_block"
        try:
            value = Secret.load(store.credentials_block).get()
        except ValueError:
            raise SpecError(f"{where}: no Prefect Secret block named {store.credentials_block!r}") from None
        if not isinstance(value, dict) or any(not isinstance(value.get(key), str) or not value[key]
                                              for key in _REQUIRED):
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise SpecError(f"{where}: Secret block {store.credentials_block!r} must hold JSON with "
                            f"{' and '.join(_REQUIRED)} (it has {keys})")
        unknown = sorted(set(value) - set(_VARIABLES))
        if unknown:
            raise SpecError(f"{where}: Secret block {store.credentials_block!r} has unknown key(s) {unknown}")
        for key, variable in _VARIABLES.items():
            if key in value:
                os.environ[f"{store.credentials_env}_{variable}"] = value[key]
        loaded.append(store.credentials_block)
    return loaded
