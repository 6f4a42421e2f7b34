"""The channel: everything the exchanger asks of the stores, and nothing else.

The real channel is `training.exchange.transport.Transport` (a priority queue on one background
thread, chunking, link pacing and counters). `MemoryChannel` holds a run's messages in memory: the
exchanger's tests and the in-process replicas (`training.replicas`) use it. Both implement this
class, so a method the exchanger needs and a channel lacks fails at construction.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from infra.store import ObjectExists, StoreError


class MalformedMessage(StoreError):
    """A message's commit does not describe a message: foreign keys, too many bytes, bad payload."""


class Message(NamedTuple):
    tensors: dict[str, torch.Tensor]
    meta: dict  # the commit's fields besides the objects it lists: the sender's word, still unchecked
    nbytes: int  # bytes read, commit included


class Channel(ABC):
    @abstractmethod
    def submit(self, link: str, job: Callable, *args) -> Future:
        """Run `job(*args)` off the learner's thread, after queued jobs of higher priority (`link`)."""

    @abstractmethod
    def send(self, key: str, tensors: dict[str, torch.Tensor], meta: dict, link: str) -> int:
        """Commit this learner's message under `key`; returns bytes written. Raises
        `infra.store.ObjectExists` when a different message was already committed there."""

    @abstractmethod
    def read_own(self, key: str, link: str, max_bytes: int) -> Message:
        """The message already committed under this learner's own `key` (by an earlier life of it)."""

    @abstractmethod
    def fetch(self, peer: int, key: str, link: str, max_bytes: int, timeout_s: float,
              give_up: Callable[[], bool]) -> Message | None:
        """Learner `peer`'s message under `key`, from the peer's store, once it is committed within
        `timeout_s`; None if it is not, at once when `give_up()` says it never will be. A commit that
        points outside the message or at more than `max_bytes` reads nothing (`MalformedMessage`)."""


class MemoryChannel(Channel):
    """Every learner's messages of one run, held in memory and shared by the learners' exchangers in one
    process. Each job runs on a thread of its own, as each learner's exchange runs on its own transport
    thread: a job waiting for a peer's message never blocks the peer's."""

    def __init__(self, learners: int):
        self.messages: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}
        self.arrived = threading.Condition()
        self.pool = ThreadPoolExecutor(learners, thread_name_prefix="exchange")

    def submit(self, link: str, job: Callable, *args) -> Future:
        return self.pool.submit(job, *args)

    def send(self, key: str, tensors: dict[str, torch.Tensor], meta: dict, link: str) -> int:
        with self.arrived:
            if key in self.messages:
                raise ObjectExists(key)
            self.messages[key] = ({k: v.clone() for k, v in tensors.items()}, dict(meta))
            self.arrived.notify_all()
        return message_bytes(tensors)

    def read_own(self, key: str, link: str, max_bytes: int) -> Message:
        tensors, meta = self.messages[key]
        return Message(dict(tensors), dict(meta), message_bytes(tensors))

    def fetch(self, peer: int, key: str, link: str, max_bytes: int, timeout_s: float,
              give_up: Callable[[], bool]) -> Message | None:
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            # Woken by every send; the short wait also notices `give_up` turning true.
            while key not in self.messages and not give_up() and (left := deadline - time.monotonic()) > 0:
                self.arrived.wait(min(left, 0.05))
        return self.read_own(key, link, max_bytes) if key in self.messages else None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def message_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in tensors.values())
