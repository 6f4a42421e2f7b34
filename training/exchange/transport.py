"""One transport per learner: every message it sends or fetches goes through here.

* A priority queue served by one background thread, so the learner keeps computing while
  messages travel. Inter-island transfers go first (the wide-area link is the bottleneck), then
  intra-island ones, then checkpoints written in the background; within a class, first come
  first served.
* Messages larger than `chunk_bytes` travel as multipart objects: parts named by their own
  checksum (a re-send after a crash never collides with a dead life's half-written parts), then
  the JSON commit listing them, written last. A message within one chunk keeps the plain
  `ObjectStore.commit_tensors` layout.
* A bandwidth budget per link class (bytes/s, unlimited by default) paces transfers chunk by
  chunk: a chunk of n bytes occupies the class's link for n / rate seconds.
* Counters per link class: bytes written and read, messages, store requests, seconds spent
  transferring and seconds held back by the budget. The clock and the sleep are injectable, for tests.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from infra import watchdog
from infra.objects import ObjectRef, sha256
from infra.store import ObjectExists, ObjectStore
from training.exchange.channel import Channel, MalformedMessage, Message

LINK_CLASSES = ("inter", "intra")
# A message's commit lists its parts and a few fields; anything much larger is not a commit.
COMMIT_MAX_BYTES = 64 << 10
PRIORITY = {"inter": 0, "intra": 1, "checkpoint": 2}  # checkpoints written in the background go last


def _message_refs(key: str, meta: dict, max_bytes: int) -> list[ObjectRef]:
    try:
        refs = ([ObjectRef.from_json(meta.pop("tensors"))] if "tensors" in meta
                else [ObjectRef.from_json(r) for r in meta.pop("parts")[:max_bytes // 1024 + 1]])
        if not all(isinstance(ref.key, str) and isinstance(ref.sha256, str) for ref in refs):
            raise TypeError("keys and checksums must be strings")
    except (KeyError, TypeError, ValueError, AttributeError):
        # The reason is ours, never the commit's text: that is the peer's word and could be anything.
        raise MalformedMessage(f"message {key}: its commit lists no valid tensor objects") from None
    meta.pop("nbytes", None)
    if any(not ref.key.startswith(f"{key}.") for ref in refs):
        raise MalformedMessage(f"message {key}: its commit points outside the message")
    if sum(max(0, ref.nbytes) for ref in refs) > max_bytes:
        raise MalformedMessage(f"message {key}: declares more than {max_bytes} bytes")
    return refs


@dataclass
class LinkCounters:
    bytes_written: int = 0
    bytes_read: int = 0
    messages_written: int = 0
    messages_read: int = 0
    # Store requests of the exchange: `requests` write or read a message's objects and commits (as many
    # as its size and chunking fix, so the planner predicts them); `polls` are GETs of a peer's commit,
    # the last of which brings it (one when it is already there; more the longer the reader waits).
    requests: int = 0
    polls: int = 0
    seconds_transferring: float = 0.0
    seconds_paced: float = 0.0


class LinkBudget:
    """Paces one link class to `bytes_per_s`; None means unlimited.

    The link is modelled as busy until `free_at`: a chunk starts when the link is free and
    holds it for nbytes / rate. `finish` sleeps until the chunk would have left the link, so
    a store that is faster than the budget is slowed to it and a slower one is not slowed more.
    Chunks are booked after they are sent, with their real size (a JSON commit's size is known
    only once written).
    """

    def __init__(self, bytes_per_s: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.rate, self.clock, self.sleep = bytes_per_s, clock, sleep
        self.free_at = 0.0

    def book(self, nbytes: int, began: float | None = None) -> float:
        """Book the link for a chunk whose transfer began at `began` (now by default); returns the
        time at which the chunk has left the link."""
        began = self.clock() if began is None else began
        if self.rate is None:
            return began
        self.free_at = max(began, self.free_at) + nbytes / self.rate
        return self.free_at

    def finish(self, done_at: float) -> float:
        """Wait until `done_at`; returns the seconds waited."""
        wait = done_at - self.clock()
        if wait > 0:
            self.sleep(wait)
            return wait
        return 0.0


class Transport(Channel):
    def __init__(self, store: ObjectStore, chunk_bytes: int = 64 << 20,
                 bytes_per_s: dict[str, float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 read_from: Callable[[int], ObjectStore] | None = None):
        """Messages are written to `store`; a peer's is read from `read_from(peer)` (its island's
        store, see infra/stores.py), by default `store` too."""
        self.store, self.chunk_bytes, self.clock, self.sleep = store, chunk_bytes, clock, sleep
        self.read_from = read_from
        # Message bytes by the store they went to and came from (its URL), for the report.
        self.by_store: dict[str, dict[str, int]] = {}
        rates = bytes_per_s or {}
        self.budgets = {link: LinkBudget(rates.get(link), clock, sleep) for link in LINK_CLASSES}
        self.counters = {link: LinkCounters() for link in LINK_CLASSES}
        self._queue: list[tuple[int, int, Callable, Future]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None

    @classmethod
    def of(cls, store: ObjectStore, settings, read_from: Callable[[int], ObjectStore] | None = None) -> "Transport":
        """The transport a run's `sync.transport` settings describe."""
        return cls(store, settings.chunk_bytes,
                   {"inter": settings.bandwidth.inter_island, "intra": settings.bandwidth.intra_island},
                   read_from=read_from)

    # -- the queue ------------------------------------------------------------------------------

    def submit(self, link: str, job: Callable, *args) -> Future:
        """Run `job(*args)` on the transport thread, after queued jobs of higher priority."""
        future: Future = Future()
        with self._ready:
            self._queue.append((PRIORITY[link], next(self._order), lambda: job(*args), future))
            self._queue.sort(key=lambda item: item[:2])
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="transport", daemon=True)
                self._worker.start()
            self._ready.notify()
        return future

    def pending(self) -> int:
        with self._ready:
            return len(self._queue)

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                _, _, job, future = self._queue.pop(0)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)

    # -- messages -------------------------------------------------------------------------------

    def send(self, key: str, tensors: dict[str, torch.Tensor], meta: dict, link: str) -> int:
        """Write a committed tensor set, paced and counted on `link`; returns bytes written.

        Raises ObjectExists when a different message was already committed under `key`.
        """
        data = save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
        single = None
        if len(data) <= self.chunk_bytes:
            try:
                single = self._put_chunk(f"{key}.safetensors", data, link)
            except ObjectExists:
                if self.store.exists(f"{key}.json"):
                    raise
                # A dead life wrote other tensors here but never committed them: send as parts instead.
        if single is not None:
            refs = [single]
            body = {"tensors": single.to_json(), **meta}
        else:
            refs = [self._put_chunk(f"{key}.part-{i:04d}", data[i * self.chunk_bytes:(i + 1) * self.chunk_bytes], link)
                    for i in range((len(data) + self.chunk_bytes - 1) // self.chunk_bytes)]
            body = {"parts": [r.to_json() for r in refs], "nbytes": len(data), **meta}
        commit = self._timed(link, lambda: self.store.put_json(f"{key}.json", body))
        written = sum(r.nbytes for r in refs) + commit.nbytes
        self.counters[link].bytes_written += written
        self._count(self.store, "written", written)
        self.counters[link].messages_written += 1
        self.counters[link].requests += len(refs) + 1
        return written

    def _put_chunk(self, base: str, data: bytes, link: str) -> ObjectRef:
        digest = sha256(data)
        # Multipart names carry their checksum: parts are write-once, so a re-send whose bytes differ
        # (a learner that died mid-send and re-encoded) writes new parts instead of colliding.
        key = base if base.endswith(".safetensors") else f"{base}-{digest[:16]}.bin"
        return self._timed(link, lambda: self.store.put_bytes(key, data))

    def read_own(self, key: str, link: str, max_bytes: int) -> Message:
        commit = self._timed(link, lambda: self.store.get_json_sized(f"{key}.json", max_bytes=COMMIT_MAX_BYTES),
                             size=lambda r: r[1])
        self.counters[link].requests += 1
        return self._read(self.store, key, link, max_bytes, commit)

    def fetch(self, peer: int, key: str, link: str, max_bytes: int, timeout_s: float,
              give_up: Callable[[], bool]) -> Message | None:
        """The look that finds the commit brings it; polls are counted apart from requests."""
        def polled() -> None:
            self.counters[link].polls += 1
        source = self.store if self.read_from is None else self.read_from(peer)
        commit = source.wait_for_json(f"{key}.json", timeout_s, give_up=give_up, on_poll=polled,
                                      max_bytes=COMMIT_MAX_BYTES)
        if commit is None:
            return None
        return self._read(source, key, link, max_bytes, self._timed(link, lambda: commit, size=lambda r: r[1]))

    def _read(self, source: ObjectStore, key: str, link: str, max_bytes: int, commit: tuple[dict, int]) -> Message:
        """A committed tensor set (either layout), verified part by part. The commit is the sender's
        word: it may only point at its own message's objects, and at no more than `max_bytes` of them,
        or nothing is read (MalformedMessage)."""
        meta, meta_bytes = commit
        meta = dict(meta)
        refs = _message_refs(key, meta, max_bytes)
        data = b"".join(self._timed(link, lambda ref=ref: source.get_bytes(ref.key, ref.sha256, max_bytes=ref.nbytes))
                        for ref in refs)
        nbytes = len(data) + meta_bytes
        self.counters[link].bytes_read += nbytes
        self._count(source, "read", nbytes)
        self.counters[link].messages_read += 1
        self.counters[link].requests += len(refs)
        try:
            return Message(load_safetensors(data), meta, nbytes)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
            raise MalformedMessage(f"message {key}: not a safetensors payload ({err})") from None

    def _count(self, store: ObjectStore, direction: str, nbytes: int) -> None:
        totals = self.by_store.setdefault(store.url, {"written": 0, "read": 0})
        totals[direction] += nbytes

    def _timed(self, link: str, transfer: Callable, size: Callable = len):
        """Run one chunk's transfer, then hold the caller until the budget says it has left the link."""
        began = self.clock()
        result = transfer()
        watchdog.progress()
        done_at = self.budgets[link].book(result.nbytes if isinstance(result, ObjectRef) else size(result), began)
        counters = self.counters[link]
        counters.seconds_paced += self.budgets[link].finish(done_at)
        counters.seconds_transferring += self.clock() - began
        return result

    def report(self) -> dict[str, dict]:
        return {link: asdict(c) for link, c in self.counters.items()}

    def load_report(self, saved: dict[str, dict], by_store: dict[str, dict[str, int]] | None = None) -> None:
        """Counters of this learner's earlier lives, so a restarted learner's totals include them."""
        for link, values in saved.items():
            if link in self.counters:
                self.counters[link] = LinkCounters(**values)
        self.by_store = {url: dict(totals) for url, totals in (by_store or {}).items()}

