"""Where Prefect keeps stage results: next to the run's data, in the same store, as plain JSON.

Persisted results plus a cache key made of a stage's inputs (which include the run id) make
every completed stage of a run reusable: retrying a failed flow run, or resuming the run with a
new flow run, re-executes only the stages that did not complete.

Anyone who can write the store can also write a result record under a key they can compute, and
Prefect decodes a record with whatever serializer the record itself names (cloudpickle by
default). So stages write plain JSON, and the storage blocks below hand Prefect a record only if
it names exactly that serializer: nothing read from storage is unpickled or imported.

A plain JSON record can still be forged (a stage coming back Cached with numbers nobody computed).
So in a run with keys each process signs the records it writes with its own writer's key and
reads back only records signed by that writer (`RecordSigning`): the lifecycle the control
plane's, an island's segment its island's.
"""

from __future__ import annotations

import hashlib
import json
import logging

from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.exceptions import ObjectAlreadyExists
from prefect.filesystems import LocalFileSystem, RemoteFileSystem
from prefect.serializers import JSONSerializer
from pydantic import BaseModel, Field

from infra.authority import Signer, Unauthenticated, public_key_of, signing_section, verify_signature
from infra.objects import parse_store_url, sha256
from infra.store import count_refused_in_process


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
    """A result record in storage that is not plain JSON, or in a run with keys not signed by the reading
    process's own writer; it is refused, never decoded."""


REFUSED_KIND = "stage-result"  # in the report's count of refused objects by kind


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
    _refuse(path, why, "results are read only as plain JSON and never unpickled")


def _refuse(path: str, why: str, rule: str):
    """Refuse a result record: logged with its path and counted for this process's report. Prefect takes
    the error for a missing record, so the stage runs again."""
    message = f"result record {path} {why}: refused, {rule} (a stage whose record is refused runs again)"
    logger.warning("%s", message)
    count_refused_in_process(REFUSED_KIND)
    raise UntrustedResultRecord(message)


def _signed_name(name: str) -> str:
    """What a record's signature covers: its name under `prefect-results/`. A store object's signed name
    begins `runs/`, so a signature of one never passes for the other."""
    return f"prefect-results/{name}"


class RecordSigning(BaseModel):
    """The one writer whose result records a storage block writes and reads back: the process's own.

    A record is stored as {"record": its text, "signature": by the writer, over the record's path
    relative to the storage's basepath and the sha256 of its bytes}. The block document holds the
    writer's public key and the name of the variable with its private key, never the key: a block
    that Prefect reloads from the API (to read a flow's result back) verifies without it."""

    writer: str = Field(description="CONTROL for the lifecycle, an island's name for its segments.")
    public_key: str = Field(description="The writer's Ed25519 public key, base64, as in the run's spec.")
    private_key_env: str = Field(description="Environment variable holding the writer's private key.")

    @classmethod
    def of(cls, spec, writer: str) -> "RecordSigning | None":
        """`writer`'s (CONTROL or an island's name) in `spec`; None in a run without keys."""
        section = signing_section(spec, writer)
        return None if section is None else cls(writer=writer, public_key=section.public_key,
                                                 private_key_env=section.private_key_env)

    def sign(self, name: str, record: bytes) -> bytes:
        """`record` as stored under `name`, signed with the private key from this process's environment."""
        signature = Signer.from_environment(self.writer, self.private_key_env).sign(_signed_name(name), sha256(record))
        return json.dumps({"record": record.decode(), "signature": signature}).encode()

    def verified(self, name: str, stored: bytes) -> bytes:
        """The record in `stored` if this writer signed it under `name`; else Unauthenticated."""
        try:
            document = json.loads(stored)
            record, signature = document["record"].encode(), document.get("signature")
        except (ValueError, RecursionError, TypeError, KeyError, AttributeError):
            raise Unauthenticated(f"object {name}: not a signed record") from None
        verify_signature({self.writer: public_key_of(self.public_key)}, _signed_name(name), sha256(record), signature)
        return record


class _TrustedRecordsOnly(BaseModel):
    """Every read of a result record, the cache lookup's included, goes through `read_path`, and every
    write through `write_path`. Prefect's task runs use the very block their flow was given; a flow's
    result read back through the API uses a copy loaded from the block's document (fields only)."""

    record_signing: RecordSigning | None = Field(
        default=None, description="Who signs these records, the only writer read back; none in a run without keys.")

    def _record_name(self, path: str) -> str:
        """A record's path relative to the basepath, wherever the storage is mounted."""
        basepath = str(self._resolve_path("")).rstrip("/")
        return str(self._resolve_path(path))[len(basepath) + 1:]

    def _stored(self, path: str, content: bytes) -> bytes:
        return content if self.record_signing is None else self.record_signing.sign(self._record_name(path), content)

    def _trusted(self, path: str, stored: bytes) -> bytes:
        if self.record_signing is not None:
            try:
                stored = self.record_signing.verified(self._record_name(path), stored)
            except Unauthenticated as err:
                _refuse(path, f"fails its signature check ({err})",
                        f"only records signed by {self.record_signing.writer} are read back")
        return plain_json_record(path, stored)

    # Prefect reaches a storage block through the explicit async methods from async code and through the
    # sync ones, with `_sync=True`, from sync code (prefect.results): so the sync ones need no dispatch
    # of their own, and tell the parent's, which dispatches on the calling context, to run synchronously.
    async def aread_path(self, path: str) -> bytes:
        return self._trusted(path, await super().aread_path(path))

    def read_path(self, path: str, _sync: bool = True) -> bytes:
        return self._trusted(path, super().read_path(path, _sync=True))

    async def awrite_path(self, path: str, content: bytes) -> str:
        return await super().awrite_path(path, self._stored(path, content))

    def write_path(self, path: str, content: bytes, _sync: bool = True) -> str:
        return super().write_path(path, self._stored(path, content), _sync=True)


class LocalJsonResults(_TrustedRecordsOnly, LocalFileSystem):
    _block_type_name = "Archipelago Local JSON Results"


class RemoteJsonResults(_TrustedRecordsOnly, RemoteFileSystem):
    _block_type_name = "Archipelago Remote JSON Results"


REGISTRATION_ATTEMPTS = 3


def result_storage(store_spec, signing: RecordSigning | None = None):
    """A result storage block under `<store>/prefect-results`, saved so flows can reference it.
    `signing`: in a run with keys, the writer of the process that uses it (`RecordSigning.of`).

    The block holds a path, an endpoint and the writer's public key and variable's name, never
    credentials nor keys: those stay in the environment. Each writer (and key) has a block document of
    its own, so one writer's save never changes what another's reads back.
    """
    root = parse_store_url(store_spec.url)
    if root.startswith("s3://"):
        settings = {"endpoint_url": store_spec.endpoint_url} if store_spec.endpoint_url else {}
        block = RemoteJsonResults(basepath=f"{root}/prefect-results", settings=settings, record_signing=signing)
    else:
        block = LocalJsonResults(basepath=f"{root}/prefect-results", record_signing=signing)
    named_by = block.basepath if signing is None else f"{block.basepath}\0{signing.writer}\0{signing.public_key}"
    save_block(block, f"archipelago-results-{hashlib.sha256(named_by.encode()).hexdigest()[:16]}")
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
