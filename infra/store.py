"""Object storage that learners use as their only channel: write-once, checksummed objects.

The same semantics hold for a local folder (the embedded default) and for S3 through s3fs:
  * an object is written once and never overwritten; a second write of a key with other bytes
    is an error, also when two writers race (local writes land through a hard link, which
    refuses an existing name; S3 writes are conditional PUTs, If-None-Match: *);
  * a reader never sees a partial object (the hard link and the PUT are atomic);
  * a local store never follows a symlink out of its root;
  * every read can be verified: JSON documents carry their own sha256, and tensors are read
    against the sha256 that the JSON document referencing them recorded;
  * with an `Authority` (infra/authority.py), JSON documents are signed by their writer, and a
    document that is not signed by a writer allowed to write its name is refused (`Unauthenticated`);
  * every read is bounded: a reader says how many bytes it will take, and a larger object is refused
    after reading one byte more than that, never read whole.
Nothing read from the store is unpickled: tensors are safetensors, metadata is JSON.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from infra.authority import Authority, Unauthenticated, kind_of
from infra.faults import FaultInjectingFileSystem, StoreFaults
from infra.objects import (JSON_MAX_BYTES, KEY_SEGMENT, ObjectRef, canonical_json, json_document, parse_store_url,
                           sha256, validate_key, verified_envelope)
from infra.retry import RetryPolicy, StoreUnavailable, call_with_retry, calls_end_by, within_calls_deadline
from infra.s3 import SINGLE_PUT_MAX_BYTES, each_attempt_within, is_create_conflict, read_at_most, s3_filesystem
from infra.store_errors import IntegrityError, ObjectExists, ObjectMissing, ObjectTooLarge, StoreError

# A poll gets at least this long to answer, so that a wait with no time left still looks once.
_MIN_POLL_BUDGET_S = 1.0
# `give_up` may itself read the store (a peer's liveness records, across the link from a partner on
# another island): a wait asks it once it has lasted a second, then every few seconds, so that the
# short waits of a run in step cost no more than their polls.
_GIVE_UP_AFTER_S = 1.0
_GIVE_UP_EVERY_S = 3.0

# Objects refused by kind in this process, over all its stores: a control plane's stages each open
# their own, and its report counts what any of them refused.
_REFUSED_IN_PROCESS: collections.Counter = collections.Counter()


def refused_in_process() -> dict[str, int]:
    return dict(sorted(_REFUSED_IN_PROCESS.items()))


def count_refused_in_process(kind: str) -> None:
    """Count a refused object of `kind` for this process's report: by a store, or by a reader of objects that
    no ObjectStore reads (Prefect's stage results)."""
    _REFUSED_IN_PROCESS[kind] += 1


class ObjectStore:
    """A prefix of a local folder or an S3 bucket, seen as write-once checksummed objects."""

    def __init__(self, url: str, endpoint_url: str | None = None, retry: RetryPolicy = RetryPolicy(),
                 faults: StoreFaults | None = None, credentials_env: str | None = None,
                 authority: Authority | None = None, _shared: "_Shared | None" = None):
        self.url = parse_store_url(url)
        self.endpoint_url = endpoint_url
        self.retry = retry
        self.is_local = not self.url.startswith("s3://")
        self.root = self.url if self.is_local else self.url[len("s3://"):]
        if _shared is None:
            fs = fsspec.filesystem("file") if self.is_local else s3_filesystem(endpoint_url, retry, credentials_env)
            _shared = _Shared(FaultInjectingFileSystem(fs, faults) if faults else fs, self.root, authority)
        self._shared = _shared
        self.fs = _shared.fs

    @classmethod
    def from_spec(cls, store_spec, faults: StoreFaults | None = None,
                  authority: Authority | None = None) -> "ObjectStore":
        return cls(store_spec.url, store_spec.endpoint_url,
                   RetryPolicy(attempts=store_spec.retry_attempts, budget_s=store_spec.retry_budget_s), faults,
                   store_spec.credentials_env, authority)

    def child(self, prefix: str) -> "ObjectStore":
        """A sub-prefix sharing this store's connection, retry policy, faults and counters."""
        validate_key(prefix)
        return ObjectStore(f"{self.url}/{prefix}", self.endpoint_url, self.retry, _shared=self._shared)

    @property
    def prefix(self) -> str:
        """Where this store sits under the root it was opened at (e.g. `runs/<run id>`); empty at the root."""
        return self.root[len(self._shared.root):].lstrip("/")

    @property
    def stats(self) -> dict:
        """Retries, integrity failures and refused objects (by kind) seen by this store and its children,
        for the report."""
        return self._shared.stats

    @property
    def authority(self) -> Authority | None:
        return self._shared.authority

    def _name(self, key: str) -> str:
        """An object's name as signatures cover it: its key under the outermost root (`runs/<run id>/...`)."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _path(self, key: str) -> str:
        path = f"{self.root}/{validate_key(key)}"
        if self.is_local:
            # Checked against the outermost store's root: a child whose prefix is itself a
            # symlink has a root outside it.
            jail = self._shared.root
            resolved = os.path.realpath(path)
            if resolved != jail and not resolved.startswith(jail + os.sep):
                raise StoreError(f"object {key} in {self.url} resolves to {resolved}, outside the store "
                                 f"root {jail}: a symlink leads out of the store; refusing to follow it")
        return path

    def address(self, key: str) -> str:
        """Where a person finds an object: its file:// or s3:// URL."""
        return Path(self._path(key)).as_uri() if self.is_local else f"s3://{self._path(key)}"

    def _call(self, describe: str, fn, *args, policy: RetryPolicy | None = None, **kwargs):
        def count(attempt, error, delay):
            self._shared.stats["retries"] += 1
        policy = within_calls_deadline(policy or self.retry)
        if not self.is_local:  # a local call cannot trickle, and local filesystem calls take no timeout
            fn = each_attempt_within(fn, policy.budget_s)
        return call_with_retry(fn, *args, policy=policy, describe=f"{describe} {self.url}",
                               on_retry=count, **kwargs)

    def check_reachable(self) -> None:
        """Fail fast, before any training, when the store cannot be written."""
        probe = f"_probe/{uuid.uuid4().hex}"
        try:
            policy = RetryPolicy(attempts=2, budget_s=10)
            self._write(probe, b"ok", policy)
            self._call(f"remove {probe} from", self.fs.rm_file, self._path(probe), policy=policy)
        except Exception as err:  # noqa: BLE001 - any failure here means the store is unusable
            raise StoreError(f"store {self.url} is not writable: {type(err).__name__}: {err}") from None

    # -- raw objects -------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self._call(f"exists {key} in", self.fs.exists, self._path(key))

    def put_bytes(self, key: str, data: bytes) -> ObjectRef:
        """Write an object once. Writing the same bytes again is a no-op (so a retried stage can
        redo its writes, and a retried PUT whose first answer was lost succeeds); different bytes
        under an existing key are refused, whichever of two racing writers comes second."""
        ref = ObjectRef(key, sha256(data), len(data))
        try:
            self._write(key, data)
        except ObjectExists:
            if self._existing_matches(key, ref.sha256):
                return ref
            raise ObjectExists(f"object {key} already exists in {self.url} with other content; "
                               "objects are written once") from None
        return ref

    def _existing_matches(self, key: str, digest: str) -> bool:
        try:
            self.get_bytes(key, digest)
            return True
        except IntegrityError:
            return False

    def _write(self, key: str, data: bytes, policy: RetryPolicy | None = None) -> None:
        payload = self._shared.take_corruption(data)
        if not self.is_local:
            try:
                self._call(f"put {key} to", self.fs.pipe_file, self._path(key), payload, mode="create",
                           chunksize=SINGLE_PUT_MAX_BYTES, policy=policy)
            except OSError as err:
                if is_create_conflict(err):
                    raise ObjectExists(f"object {key} already exists in {self.url}; objects are written once") from None
                raise
            return
        final = Path(self._path(key))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.{uuid.uuid4().hex}.tmp"
        self._call(f"put {key} to", self.fs.pipe_file, str(tmp), payload, policy=policy)
        try:
            os.link(tmp, final)  # atomic, and refuses to replace an existing object
        except FileExistsError:
            raise ObjectExists(f"object {key} already exists in {self.url}; objects are written once") from None
        finally:
            tmp.unlink(missing_ok=True)

    def corrupt_next_write(self) -> None:
        """Fault injection: the next object written gets damaged bytes under the true checksum."""
        self._shared.corrupt_next = True

    def get_bytes(self, key: str, expected_sha256: str | None = None, policy: RetryPolicy | None = None,
                  max_bytes: int | None = None) -> bytes:
        """Read an object of at most `max_bytes` (ObjectTooLarge beyond); with a checksum, re-read a
        damaged transfer a few times before giving up."""
        for attempt in range(3):
            try:
                data = self._call(f"get {key} from", read_at_most, self.fs, self._path(key),
                                  None if max_bytes is None else max_bytes + 1, policy=policy)
            except FileNotFoundError:
                raise ObjectMissing(f"object {key} not found in {self.url}") from None
            except PermissionError:
                raise StoreError(f"object {key} in {self.url}: access denied") from None
            if max_bytes is not None and len(data) > max_bytes:
                self.refused(key)
                raise ObjectTooLarge(f"object {key} in {self.url} holds more than {max_bytes} bytes: refused")
            if expected_sha256 is None or sha256(data) == expected_sha256:
                return data
            self._shared.stats["checksum_mismatches"] += 1
        raise IntegrityError(f"object {key} in {self.url} is corrupt: sha256 {sha256(data)[:12]} "
                             f"!= recorded {expected_sha256[:12]} ({len(data)} bytes read, {attempt + 1} reads)")

    def list(self, prefix: str) -> list[str]:
        """Keys under a prefix, relative to this store; empty if the prefix does not exist."""
        base = self._path(prefix)
        try:
            found = self._call(f"list {prefix} in", self.fs.find, base)
        except FileNotFoundError:
            return []
        root = self.root + "/"
        return sorted(p.split(root, 1)[1] if root in p else p for p in found
                      if not Path(p).name.startswith("."))

    def retire(self, key: str, listed: list[str] | None = None) -> int:
        """Remove a committed object for good: its JSON commit first, so that no reader finds it half
        there, then what the commit names (tensors, or a message's parts). Only state nothing will read
        again is retired (see training/learner/retention.py): a retired key is never written again. `listed`:
        keys of the object's folder, when the caller has them. Returns the objects removed."""
        folder = key.rpartition("/")[0]
        siblings = listed if listed is not None else self.list(folder)
        commit = f"{key}.json"
        rest = [k for k in siblings if k.startswith(f"{key}.") and k != commit]
        removed = 0
        for k in [commit, *rest]:
            try:
                self._call(f"remove {k} from", self.fs.rm_file, self._path(k))
                removed += 1
            except FileNotFoundError:
                continue
        if self.is_local:
            with contextlib.suppress(OSError):  # a folder still holding the round's other objects stays
                os.rmdir(self._path(folder))
        return removed

    def wait_for_json(self, key: str, timeout_s: float, poll_s: float = 0.05,
                      give_up: Callable[[], bool] = lambda: False,
                      on_poll: Callable[[], None] = lambda: None,
                      max_bytes: int = JSON_MAX_BYTES) -> tuple[dict, int] | None:
        """The JSON document `key` and its size once it exists, within `timeout_s`; None if it did not
        appear, or once `give_up()` says it never will. `on_poll` is told of every look, for the
        caller's request count. Each look is one GET: a look that finds the document has it, where an
        existence check (a HEAD) would need a GET after it. Every store call of the wait, `give_up`'s
        included, ends with it (`calls_end_by`): a store that has gone away, or trickles, costs the
        waiter its deadline, not a retry budget per call."""
        deadline = time.monotonic() + timeout_s
        next_ask = time.monotonic() + _GIVE_UP_AFTER_S
        with calls_end_by(max(deadline, time.monotonic() + _MIN_POLL_BUDGET_S)):
            while True:
                on_poll()
                found = self._json_by(key, deadline, max_bytes)
                if found is not None:
                    return found
                if deadline > time.monotonic() >= next_ask:  # at the deadline, no reason is needed
                    next_ask = time.monotonic() + _GIVE_UP_EVERY_S
                    if give_up():
                        return self._json_by(key, deadline, max_bytes)  # it may have landed just before the reason to give up
                if time.monotonic() >= deadline:
                    return None
                time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
                poll_s = min(poll_s * 1.5, 1.0)

    def _json_by(self, key: str, deadline: float, max_bytes: int) -> tuple[dict, int] | None:
        """One look of a wait; a store out of reach before the deadline is the caller's to hear of."""
        try:
            return self.get_json_sized(key, max_bytes=max_bytes)
        except ObjectMissing:
            return None
        except StoreUnavailable:
            if time.monotonic() < deadline:
                raise
            return None

    # -- typed objects ------------------------------------------------------------------------

    def put_json(self, key: str, body: dict) -> ObjectRef:
        """JSON with its own checksum, so a reader needs nothing else to verify it; signed by this
        store's writer when it has one."""
        digest = sha256(canonical_json(body))
        signature = None if self.authority is None else self.authority.sign(self._name(key), digest)
        return self.put_bytes(key, json_document(body, digest, signature))

    def get_json(self, key: str, max_bytes: int = JSON_MAX_BYTES) -> dict:
        return self.get_json_sized(key, max_bytes=max_bytes)[0]

    def get_json_sized(self, key: str, policy: RetryPolicy | None = None,
                       max_bytes: int = JSON_MAX_BYTES) -> tuple[dict, int]:
        """A JSON object verified against its checksum and, with an authority, its writer's signature;
        and its size. Anything else is an IntegrityError naming the object (Unauthenticated,
        ObjectTooLarge), never a crash of the reader."""
        for _ in range(3):  # a damaged transfer heals on re-read; a damaged object does not
            raw = self.get_bytes(key, policy=policy, max_bytes=max_bytes)
            try:  # the signature first: a planted document of megabytes costs a read, never a parse
                signed = None if self.authority is None else self.authority.verify_unparsed(self._name(key), raw)
            except Unauthenticated:
                self.refused(key)
                raise
            envelope = verified_envelope(raw)
            if envelope is not None and signed in (None, (envelope["sha256"], envelope.get("signature"))):
                return envelope["body"], len(raw)
            self._shared.stats["checksum_mismatches"] += 1
        raise IntegrityError(f"object {key} in {self.url} is corrupt: not a JSON object whose body "
                             f"matches its recorded sha256 ({len(raw)} bytes read)")

    def refused(self, key: str) -> None:
        """Count an object refused for what it holds, by its kind, for the report."""
        kinds = self._shared.stats["refused"]
        kind = kind_of(self._name(key))
        kinds[kind] = kinds.get(kind, 0) + 1
        count_refused_in_process(kind)

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor],
                    metadata: dict[str, str] | None = None) -> ObjectRef:
        payload = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        return self.put_bytes(key, save_safetensors(payload, metadata=metadata))

    def get_tensors(self, ref: ObjectRef) -> dict[str, torch.Tensor]:
        """The tensors `ref` names, read at most at its recorded size and verified against its checksum;
        an IntegrityError (counted as refused) if the bytes are no safetensors payload."""
        data = self.get_bytes(ref.key, ref.sha256, max_bytes=ref.nbytes)
        try:
            return load_safetensors(data)
        except Exception:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
            self.refused(ref.key)
            raise IntegrityError(f"object {ref.key} in {self.url}: not a safetensors payload") from None

    # -- committed tensor sets ------------------------------------------------------------------

    def commit_tensors(self, key: str, tensors: dict[str, torch.Tensor], meta: dict) -> int:
        """Tensors, then the JSON that makes them visible: a reader sees all of it or nothing.

        Returns the bytes written, for traffic accounting.
        """
        ref = self.put_tensors(f"{key}.safetensors", tensors)
        commit = self.put_json(f"{key}.json", {"tensors": ref.to_json(), **meta})
        return ref.nbytes + commit.nbytes

    def is_committed(self, key: str) -> bool:
        return self.exists(f"{key}.json")

    def read_committed(self, key: str) -> tuple[dict[str, torch.Tensor], dict, int]:
        """Tensors and metadata of a commit, verified against the commit's checksum (and signature),
        the tensors read at most at the size the commit declares; and bytes read."""
        meta, meta_bytes = self.get_json_sized(f"{key}.json")
        try:
            ref = ObjectRef.from_json(meta.pop("tensors"))
        except (KeyError, TypeError, ValueError, AttributeError):
            self.refused(key)
            raise IntegrityError(f"object {key} in {self.url}: its commit names no tensor object") from None
        if ref.key != f"{key}.safetensors":
            self.refused(key)
            raise IntegrityError(f"object {key} in {self.url}: its commit points elsewhere")
        return self.get_tensors(ref), meta, ref.nbytes + meta_bytes


class _Shared:
    """What a store and its children share: one connection, the outermost root, the fault
    switch, the writer's authority, the counters."""

    def __init__(self, fs, root: str, authority: Authority | None = None):
        self.fs = fs
        self.root = root
        self.authority = authority
        self.corrupt_next = False
        self.stats = {"retries": 0, "checksum_mismatches": 0, "refused": {}}

    def take_corruption(self, data: bytes) -> bytes:
        if not self.corrupt_next or not data:
            return data
        self.corrupt_next = False
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0xFF
        return bytes(damaged)


def run_store(store_spec, run_id: str, authority: Authority | None = None) -> ObjectStore:
    """The prefix that holds everything of one run; `authority`: how this process signs and checks it."""
    if not isinstance(run_id, str) or not KEY_SEGMENT.fullmatch(run_id):
        raise StoreError(f"invalid run id {run_id!r}: one path segment of [A-Za-z0-9_.=-], "
                         "not starting with '.'")
    return ObjectStore.from_spec(store_spec, authority=authority).child(f"runs/{run_id}")
