"""Where Prefect keeps stage results: next to the run's data, in the same store, as plain JSON.

Persisted results plus a cache key made of a stage's inputs (which include the run id) make
every completed stage of a run reusable: retrying a failed flow run, or resuming the run with a
new flow run, re-executes only the stages that did not complete.

Anyone who can write the store can also write a result record under a key they can compute, and
Prefect decodes a record with whatever serializer the record itself names (cloudpickle by
default). So stages write plain JSON, and the storage blocks below hand Prefect a record only if
it names exactly that serializer: nothing read from storage is unpickled or imported.
"""

from __future__ import annotations

import hashlib
import json
import logging

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.exceptions import ObjectAlreadyExists
from prefect.filesystems import LocalFileSystem, RemoteFileSystem
from prefect.serializers import JSONSerializer

from infra.store import parse_store_url


def stage_cache(ignored_inputs: tuple[str, ...] = ()):
    """A stage's cache key: its inputs and its source. `ignored_inputs` are inputs that differ
    between attempts without changing what the stage computes (a wall time): with them in the key,
    a resumed run would recompute the stage and clash with the objects it wrote the first time."""
    inputs = INPUTS
    for name in ignored_inputs:
        inputs = inputs - name
    return inputs + TASK_SOURCE


# JSON read back by `json.loads` alone: Prefect's default object decoder would import and build
# any class a record names ("__class__"), so it is switched off; the encoder stays, so that a
# failed stage's exception is still recorded (as a plain dict).
RESULT_SERIALIZER = JSONSerializer(object_decoder=None)
_TRUSTED_SERIALIZER = RESULT_SERIALIZER.model_dump(mode="json")

logger = logging.getLogger(__name__)


class UntrustedResultRecord(ValueError):
    """A result record in storage that is not plain JSON; it is refused, never decoded."""


def plain_json_record(path: str, content: bytes) -> bytes:
    """The bytes of a result file, if they are JSON and, where they are a whole record (metadata and
    result), the record names the plain JSON serializer.

    A flow's result file is the bare result: Prefect keeps its metadata, serializer included, in
    the API (this lifecycle's names plain JSON), so only its being JSON is checked here."""
    try:
        document = json.loads(content)
    except ValueError:
        why = "is not JSON"
    else:
        if not (isinstance(document, dict) and "metadata" in document):
            return content
        metadata = document["metadata"]
        serializer = metadata.get("serializer") if isinstance(metadata, dict) else None
        if serializer == _TRUSTED_SERIALIZER:
            return content
        why = f"names serializer {serializer!r}, not plain JSON"
    message = (f"result record {path} {why}: refused, results are read only as plain JSON and never "
               "unpickled (a stage whose record is refused runs again)")
    logger.warning("%s", message)
    raise UntrustedResultRecord(message)


class _PlainJsonRecordsOnly:
    """Every read of a result record, the cache lookup's included, goes through `read_path`."""

    async def aread_path(self, path: str) -> bytes:
        return plain_json_record(path, await super().aread_path(path))

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return plain_json_record(path, super().read_path(path, _sync=True))


class LocalJsonResults(_PlainJsonRecordsOnly, LocalFileSystem):
    _block_type_name = "Archipelago Local JSON Results"


class RemoteJsonResults(_PlainJsonRecordsOnly, RemoteFileSystem):
    _block_type_name = "Archipelago Remote JSON Results"


REGISTRATION_ATTEMPTS = 3


def result_storage(store_spec):
    """A result storage block under `<store>/prefect-results`, saved so flows can reference it.

    The block holds a path and an endpoint, never credentials: S3 keys stay in the environment.
    """
    root = parse_store_url(store_spec.url)
    if root.startswith("s3://"):
        settings = {"endpoint_url": store_spec.endpoint_url} if store_spec.endpoint_url else {}
        block = RemoteJsonResults(basepath=f"{root}/prefect-results", settings=settings)
    else:
        block = LocalJsonResults(basepath=f"{root}/prefect-results")
    save_block(block, f"archipelago-results-{hashlib.sha256(block.basepath.encode()).hexdigest()[:16]}")
    return block


def save_block(block, name: str) -> None:
    """Save (or overwrite) a block document. Flows that start at the same moment (two islands'
    segments at a shared window start) each register the block's type and schema when the API has
    none yet: all but the first are refused, and find them registered when they try again."""
    for attempt in range(REGISTRATION_ATTEMPTS):
        try:
            block.save(name, overwrite=True)
            return
        except ObjectAlreadyExists:
            if attempt == REGISTRATION_ATTEMPTS - 1:
                raise
