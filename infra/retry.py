"""Retries for store calls: ride out a flaky S3 service, fail loudly once it is really gone.

Only errors that a later attempt can cure are retried (timeouts, dropped connections, 5xx and
SlowDown answers). Everything else (a missing object, a denied request, a bug) propagates at
once, unchanged, because retrying it only delays the same failure.

This is the only retry loop: the S3 store turns off botocore's and s3fs's own retries
(infra/store.py) so that a policy's budget is what bounds a call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import http.client
import random
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from infra.faults import InjectedServiceUnavailable
from infra.store_errors import StoreError

T = TypeVar("T")

# s3fs.errors.translate_boto_error turns S3 5xx answers into a bare OSError whose text is the
# server's message ("Please reduce your request rate.", "Service Unavailable", ...):
# SlowDown, ServiceUnavailable and 503 get errno EBUSY, InternalError and 500 get EREMOTEIO
# (EIO where the platform lacks it, as in s3fs). The errno is the dependable signal; some s3fs
# paths (info/exists) also drop the botocore cause. EBUSY also covers 409 OperationAborted,
# which S3 documents as "try again".
_TRANSIENT_ERRNOS = frozenset({errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO)})
# 502/504 have no s3fs mapping and arrive as OSError(EIO, "An error occurred (502) when ...").
_TRANSIENT_MARKERS = (
    " 500 ", " 502 ", " 503 ", " 504 ", "(500)", "(502)", "(503)", "(504)",
    "SlowDown", "reduce your request rate", "ServiceUnavailable", "Service Unavailable",
    "InternalError", "Bad Gateway", "Gateway Timeout",
)
# ConditionalRequestConflict (409): a conditional write met a concurrent one; S3 documents it as
# "retry", and the retried create-only PUT then succeeds or is refused with 412.
# XAmzContentSHA256Mismatch: the body was damaged in transit; s3fs's own retries used to redo it.
_TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                              "ConditionalRequestConflict", "XAmzContentSHA256Mismatch"})
# Subclasses of OSError that no retry can cure; checked first because they share its errnos.
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)

# Its own entropy, so learners that seed `random` identically (or fork) still spread their
# retries apart instead of hammering a throttled service in lockstep.
_JITTER = random.SystemRandom()
# When every store call this thread makes must have ended (time.monotonic()), see `calls_end_by`.
_CALLS_END_BY: ContextVar[float | None] = ContextVar("store_calls_end_by", default=None)


class StoreUnavailable(StoreError):
    """The store kept failing transiently until the retry policy ran out: one of the ways a store
    cannot serve a request, so whoever handles a `StoreError` handles an outage too."""


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts and backoff for one store call; `budget_s` bounds the whole call, sleeps included.

    No attempt starts once the budget is spent; one already under way runs to its own timeouts,
    which the S3 store caps at the budget.
    """

    attempts: int = 6
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0
    budget_s: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts!r}")
        for name in ("base_delay_s", "max_delay_s", "budget_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RetryPolicy.{name} must be >= 0, got {getattr(self, name)!r}")


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    # Imported on first use, and only if installed: a local-folder store needs neither.
    # IncompleteRead: the connection dropped mid-body; s3fs re-raises it as is once its own
    # retries are spent.
    types: list[type[BaseException]] = [TimeoutError, ConnectionError, InjectedServiceUnavailable,
                                        http.client.IncompleteRead]
    try:
        from botocore import exceptions as boto
        from botocore.parsers import ResponseParserError
    except ImportError:
        pass
    else:
        # HTTPClientError covers ReadTimeoutError and ConnectionClosedError; boto's
        # ConnectionError covers EndpointConnectionError and ConnectTimeoutError.
        # ResponseParserError: throttling answers can come back as invalid XML (s3fs issue
        # #484), which s3fs's own retries used to absorb.
        types += [boto.ConnectionError, boto.HTTPClientError, ResponseParserError]
    try:
        import aiohttp
    except ImportError:
        pass
    else:
        types.append(aiohttp.ClientError)
    return tuple(types)


def _is_transient_response(error: BaseException | None) -> bool:
    """A botocore ClientError (raised directly, or the cause s3fs chained) reporting a 5xx or
    one of the codes that S3 documents as worth retrying."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return status >= 500 or response.get("Error", {}).get("Code") in _TRANSIENT_CODES


def is_transient(error: BaseException) -> bool:
    """Whether a later attempt of the same store call may succeed."""
    if isinstance(error, _PERMANENT):
        return False
    if isinstance(error, _transient_types()):
        # aiohttp's ClientResponseError is a ClientError that carries an HTTP status; a 4xx
        # answer will be the same on the next attempt.
        status = getattr(error, "status", None)
        return not (isinstance(status, int) and status < 500)
    if _is_transient_response(error):
        return True
    if isinstance(error, OSError):
        return (error.errno in _TRANSIENT_ERRNOS or _is_transient_response(error.__cause__)
                or any(marker in str(error) for marker in _TRANSIENT_MARKERS))
    return False


def call_with_retry(fn: Callable[..., T], *args: Any, policy: RetryPolicy, describe: str,
                    on_retry: Callable[[int, BaseException, float], None] | None = None,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, retried on transient errors with capped exponential full-jitter backoff.

    `on_retry(attempt, error, delay)` is called before each sleep, `attempt` counting the failed
    attempts so far. Raises StoreUnavailable, chained from the last error, when the attempts or
    the time budget run out; any other error propagates unchanged on its first occurrence.
    """
    start = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - classified below, re-raised as is unless transient
            if not is_transient(err):
                raise
            last = err
        remaining = policy.budget_s - (clock() - start)
        if attempt >= policy.attempts or remaining <= 0:
            break
        # Full jitter, clipped so that no sleep carries the call past its budget.
        cap = min(policy.max_delay_s, policy.base_delay_s * 2 ** (attempt - 1))
        delay = min(_JITTER.uniform(0, cap), remaining)
        if on_retry is not None:
            on_retry(attempt, last, delay)
        sleep(delay)
    raise StoreUnavailable(
        f"{describe}: store still unavailable after {attempt} attempts in {clock() - start:.1f}s "
        f"(policy: {policy.attempts} attempts, {policy.budget_s:g}s budget); "
        f"last error {type(last).__name__}: {last}") from last


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


def within_calls_deadline(policy: RetryPolicy) -> RetryPolicy:
    """`policy` with its budget cut to what is left before the `calls_end_by` deadline this thread is under."""
    end_by = _CALLS_END_BY.get()
    if end_by is None:
        return policy
    return dataclasses.replace(policy, budget_s=max(0.0, min(policy.budget_s, end_by - time.monotonic())))
