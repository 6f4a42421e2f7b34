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
import dataclasses
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch
from fsspec.exceptions import FSTimeoutError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from infra.authority import Authority, Unauthenticated, kind_of
from infra.faults import FaultInjectingFileSystem, StoreFaults
from infra.s3 import SINGLE_PUT_MAX_BYTES, is_create_conflict, s3_filesystem
from infra.store_errors import IntegrityError, ObjectExists, ObjectMissing, StoreError
from infra.retry import RetryPolicy, StoreUnavailable, call_with_retry

# A segment cannot start with '.', which keeps out '.', '..' and hidden temporary files.
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]*")
_KEY = re.compile(rf"{_SEGMENT.pattern}(/{_SEGMENT.pattern})*")
# S3's bucket naming rules (3-63 lowercase letters, digits, dots and hyphens, alphanumeric ends).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def validate_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise StoreError(f"invalid object key {key!r}: use relative paths of [A-Za-z0-9_.=-] segments")
    return key


def parse_store_url(url: str) -> str:
    """The normalised store root: an absolute local folder path, or s3://bucket[/prefix].

    Anything that would silently land somewhere unintended is refused: an unexpanded `~`
    (it would become a folder named `~`), a mistyped scheme such as `s3:/bucket` (it would
    become a local folder named `s3:`), other schemes, and empty or blank urls.
    """
    def refuse(why: str) -> StoreError:
        return StoreError(f"store url {url!r}: {why}; use a local folder or s3://bucket[/prefix]")

    if not isinstance(url, str) or not url.strip():
        raise refuse("empty")
    if url != url.strip() or any(ord(c) < 32 for c in url):
        raise refuse("leading/trailing whitespace or control characters")
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].rstrip("/").partition("/")
        if not bucket:
            raise refuse("no bucket")
        if not _BUCKET.fullmatch(bucket):
            raise refuse(f"bucket {bucket!r} is not a valid S3 bucket name")
        if prefix and not _KEY.fullmatch(prefix):
            raise refuse(f"prefix {prefix!r} must be [A-Za-z0-9_.=-] segments separated by single '/'")
        return f"s3://{bucket}" + (f"/{prefix}" if prefix else "")
    if url.startswith("file://"):
        path = url[len("file://"):]
        if not path.startswith("/"):
            raise refuse("a file:// url needs an absolute path (file:///path)")
    elif _SCHEME.match(url):
        raise refuse(f"unsupported scheme {url.split(':', 1)[0]!r}")
    else:
        path = url
    if path.startswith("~"):
        raise refuse("'~' is not expanded; give the folder's full path")
    return str(Path(path).resolve())


@dataclass(frozen=True)
class ObjectRef:
    """Where an object lives and what its bytes must hash to; what JSON documents point with."""

    key: str
    sha256: str
    nbytes: int

    def to_json(self) -> dict:
        return {"key": self.key, "sha256": self.sha256, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, raw: dict) -> "ObjectRef":
        return cls(key=raw["key"], sha256=raw["sha256"], nbytes=int(raw["nbytes"]))


# A poll gets at least this long to answer, so that a wait with no time left still looks once.
_MIN_POLL_BUDGET_S = 1.0
# `give_up` may itself read the store (a peer's liveness records, across the link from a partner on
# another island): a wait asks it once it has lasted a second, then every few seconds, so that the
# short waits of a run in step cost no more than their polls.
_GIVE_UP_AFTER_S = 1.0
_GIVE_UP_EVERY_S = 3.0
# What a JSON document may weigh unless its reader says otherwise: commits, records and manifests are
# kilobytes; a checkpoint's commit carries the learner's ledger, which grows with its rounds.
JSON_MAX_BYTES = 16 << 20
# A document nested deeper than this is refused before it is parsed (json.loads would recurse).
_JSON_MAX_DEPTH = 64
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# fsspec reads a timeout of 0 as no timeout at all: an attempt with no time left gets this instead.
_MIN_ATTEMPT_S = 0.001
# When every store call this thread makes must have ended (time.monotonic()), see `calls_end_by`.
_CALLS_END_BY: ContextVar[float | None] = ContextVar("store_calls_end_by", default=None)


@contextlib.contextmanager
def calls_end_by(deadline: float) -> Iterator[None]:
    """Every store call made inside, by this thread, ends by `deadline` (time.monotonic() seconds), or
    by an earlier one it is already under: no retry starts after it, and an S3 request under way is
    abandoned at it. A wait holds its deadline this way, with whatever it asks on the way (a peer's
    liveness records, from that peer's store) included."""
    outer = _CALLS_END_BY.get()
    token = _CALLS_END_BY.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _CALLS_END_BY.reset(token)


def _each_attempt_within(request: Callable, budget_s: float) -> Callable:
    """`request` (an s3fs call) with every attempt abandoned once `budget_s` from now have passed,
    whatever the server sends. botocore's read timeout is an idle timeout: a server that trickles a byte
    every few seconds never trips it, and held one GET for as long as it liked. fsspec's `timeout` runs
    the request under asyncio.wait_for, which cancels it (closing its connection) at the deadline."""
    ends = time.monotonic() + budget_s

    def attempt(*args, **kwargs):
        left = max(ends - time.monotonic(), _MIN_ATTEMPT_S)
        try:
            return request(*args, timeout=left, **kwargs)
        except FSTimeoutError:
            raise TimeoutError(f"no complete answer in the {left:.2f}s left of the call's "
                               f"{budget_s:.2f}s budget") from None
    return attempt


# Objects refused by kind in this process, over all its stores: a control plane's stages each open
# their own, and its report counts what any of them refused.
_REFUSED_IN_PROCESS: collections.Counter = collections.Counter()


def refused_in_process() -> dict[str, int]:
    return dict(sorted(_REFUSED_IN_PROCESS.items()))


def count_refused_in_process(kind: str) -> None:
    """Count a refused object of `kind` for this process's report: by a store, or by a reader of objects that
    no ObjectStore reads (Prefect's stage results)."""
    _REFUSED_IN_PROCESS[kind] += 1


class ObjectTooLarge(IntegrityError):
    """An object holds more bytes than its reader takes; it was not read whole, and is not read again."""


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
        policy = policy or self.retry
        end_by = _CALLS_END_BY.get()
        if end_by is not None:
            policy = dataclasses.replace(policy, budget_s=max(0.0, min(policy.budget_s, end_by - time.monotonic())))
        if not self.is_local:  # a local call cannot trickle, and local filesystem calls take no timeout
            fn = _each_attempt_within(fn, policy.budget_s)
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
        limit = {} if max_bytes is None else {"start": 0, "end": max_bytes + 1}
        for attempt in range(3):
            try:
                data = self._call(f"get {key} from", self.fs.cat_file, self._path(key), policy=policy, **limit)
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
            envelope = _verified_envelope(raw)
            if envelope is not None:
                if self.authority is not None:
                    try:
                        self.authority.verify(self._name(key), envelope["sha256"], envelope.get("signature"))
                    except Unauthenticated:
                        self.refused(key)
                        raise
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


def canonical_json(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def json_document(body: dict, digest: str | None = None, signature: dict | None = None) -> bytes:
    """A JSON object as the store writes it: the body beside the sha256 of its canonical form, and
    its writer's signature when it has one."""
    envelope = {"sha256": digest or sha256(canonical_json(body)), "body": body}
    if signature is not None:
        envelope["signature"] = signature
    return json.dumps(envelope, sort_keys=True, indent=1).encode()


def _verified_envelope(raw: bytes) -> dict | None:
    """The envelope of a JSON document whose body is an object matching its recorded sha256; else None.
    Nesting is bounded before parsing: json.loads recurses, and a document of brackets would crash it."""
    if _nesting_depth(raw) > _JSON_MAX_DEPTH:
        return None
    try:
        envelope = json.loads(raw)
        body, recorded = envelope["body"], envelope["sha256"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(recorded, str):
        return None
    return envelope if sha256(canonical_json(body)) == recorded else None


def _nesting_depth(raw: bytes) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings counted too: an upper bound)."""
    depth = deepest = 0
    for byte in raw.translate(None, delete=_NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


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
    if not isinstance(run_id, str) or not _SEGMENT.fullmatch(run_id):
        raise StoreError(f"invalid run id {run_id!r}: one path segment of [A-Za-z0-9_.=-], "
                         "not starting with '.'")
    return ObjectStore.from_spec(store_spec, authority=authority).child(f"runs/{run_id}")
