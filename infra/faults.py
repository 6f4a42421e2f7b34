"""A flaky object store on demand: wrap a filesystem so that its calls fail the way S3 does.

Learners synchronise only through the store, so the retry layer above it has to be proven
against the failures a real S3 service produces (timeouts, 503 SlowDown, dropped connections,
slow answers, short reads) without waiting for a real outage. Faults are drawn from a seeded
generator so that a failing chaos run can be replayed exactly.
"""

from __future__ import annotations

import errno
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

FAULT_KINDS = ("timeout", "unavailable", "disconnect", "slow", "truncate")


class InjectedServiceUnavailable(OSError):
    """A 503, shaped like s3fs's translation of SlowDown/ServiceUnavailable: an OSError with EBUSY."""

    def __init__(self, what: str):
        super().__init__(errno.EBUSY, f"503 Service Unavailable (injected SlowDown): {what}")


@dataclass(frozen=True)
class StoreFaults:
    """How often a store call fails, and how; every call draws independently."""

    error_rate: float
    kinds: tuple[str, ...]
    slow_seconds: float = 0.2
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"StoreFaults.error_rate must be in [0, 1], got {self.error_rate!r}")
        if not self.kinds:
            raise ValueError(f"StoreFaults.kinds must name at least one of {', '.join(FAULT_KINDS)}")
        unknown = [k for k in self.kinds if k not in FAULT_KINDS]
        if unknown:
            raise ValueError(f"StoreFaults.kinds has unknown kinds {unknown}; "
                             f"known: {', '.join(FAULT_KINDS)}")
        if self.slow_seconds < 0:
            raise ValueError(f"StoreFaults.slow_seconds must be >= 0, got {self.slow_seconds!r}")


class FaultInjectingFileSystem:
    """Delegates to `fs`, injecting faults into the five calls the store makes.

    Faults fire before delegation, so a failed write never reaches `fs`. Anything else is passed
    through untouched, so the wrapper can stand wherever the store expects a filesystem.
    """

    def __init__(self, fs: Any, faults: StoreFaults):
        self.fs = fs
        self.faults = faults
        self.counts: dict[str, int] = {kind: 0 for kind in FAULT_KINDS}
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()  # learners may share one store across threads

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._call("exists", path, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> Any:
        return self._call("pipe_file", path, value, **kwargs)

    def cat_file(self, path: str, **kwargs: Any) -> bytes:
        return self._call("cat_file", path, **kwargs)

    def find(self, path: str, **kwargs: Any) -> Any:
        return self._call("find", path, **kwargs)

    def rm_file(self, path: str, **kwargs: Any) -> Any:
        return self._call("rm_file", path, **kwargs)

    def _draw(self, method: str) -> str | None:
        # One lock around draw and count keeps the sequence of faults a function of the seed
        # and the order of calls alone.
        with self._lock:
            if self._rng.random() >= self.faults.error_rate:
                return None
            kind = self._rng.choice(self.faults.kinds)
            if kind == "truncate" and method != "cat_file":
                return None  # only a read has a transfer to cut short
            self.counts[kind] += 1
            return kind

    def _call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        kind = self._draw(method)
        what = f"{method} {path}"
        if kind == "timeout":
            raise TimeoutError(f"injected timeout: {what}")
        if kind == "unavailable":
            raise InjectedServiceUnavailable(what)
        if kind == "disconnect":
            raise ConnectionResetError(errno.ECONNRESET, f"injected connection reset: {what}")
        if kind == "slow":
            time.sleep(self.faults.slow_seconds)
        result = getattr(self.fs, method)(path, *args, **kwargs)
        if kind == "truncate":
            return result[: len(result) // 2]
        return result
