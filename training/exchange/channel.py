"""The channel: everything the exchanger asks of the stores, and nothing else.

The real channel is `training.exchange.transport.Transport` (a priority queue on one background
thread, chunking, link pacing and counters); the exchanger's tests use an in-memory fake. Both
implement this class, so a method the exchanger needs and a fake lacks fails at construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import torch

from infra.store import StoreError


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
