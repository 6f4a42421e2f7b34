"""Retries: transient errors are ridden out within attempts and budget, others surface at once."""

import errno
import uuid

import fsspec
import pytest

from infra.faults import FaultInjectingFileSystem, InjectedServiceUnavailable, StoreFaults
from infra.retry import RetryPolicy, StoreUnavailable, call_with_retry, is_transient

POLICY = RetryPolicy(attempts=6, base_delay_s=0.05, max_delay_s=0.3, budget_s=60.0)


class Flaky:
    """Raises the given errors in turn, then returns its arguments."""

    def __init__(self, *errors):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return args, kwargs


def no_sleep(_delay):
    pass


def test_succeeds_after_transient_failures_with_bounded_backoff():
    fn = Flaky(TimeoutError("t"), ConnectionResetError("r"), InjectedServiceUnavailable("x"),
               OSError(errno.EBUSY, "Please reduce your request rate."))
    retries, sleeps = [], []
    result = call_with_retry(fn, 1, policy=POLICY, describe="put k", key="v",
                             on_retry=lambda a, e, d: retries.append((a, type(e), d)),
                             sleep=sleeps.append)
    assert result == ((1,), {"key": "v"}) and fn.calls == 5
    assert [(a, t) for a, t, _ in retries] == [(1, TimeoutError), (2, ConnectionResetError),
                                              (3, InjectedServiceUnavailable), (4, OSError)]
    assert sleeps == [d for _, _, d in retries]
    for attempt, delay in enumerate(sleeps):
        assert 0 <= delay <= min(POLICY.max_delay_s, POLICY.base_delay_s * 2 ** attempt)


def test_gives_up_after_attempts_naming_the_call_and_chaining_the_cause():
    last = TimeoutError("read timed out")
    fn = Flaky(*[TimeoutError("earlier")] * 3, last)
    sleeps = []
    with pytest.raises(StoreUnavailable) as caught:
        call_with_retry(fn, policy=RetryPolicy(attempts=4), sleep=sleeps.append,
                        describe="put runs/x/learners/000/round-00003/message.json")
    message = str(caught.value)
    assert "put runs/x/learners/000/round-00003/message.json" in message
    assert "4 attempts" in message and "TimeoutError: read timed out" in message
    assert caught.value.__cause__ is last
    assert fn.calls == 4 and len(sleeps) == 3


def test_time_budget_bounds_the_call_including_slow_attempts():
    now = [0.0]

    def slow_failure():
        now[0] += 1.0  # every attempt takes a second to time out
        raise TimeoutError("slow")

    def sleep(delay):
        now[0] += delay

    fn_calls = []
    with pytest.raises(StoreUnavailable, match="4 attempts"):
        call_with_retry(lambda: fn_calls.append(1) or slow_failure(),
                        policy=RetryPolicy(attempts=100, budget_s=3.5), describe="get k",
                        sleep=sleep, clock=lambda: now[0])
    # Attempts start at ~0, ~1, ~2, ~3 s; after the fourth the budget is spent.
    assert len(fn_calls) == 4 and now[0] <= 3.5 + 1.0


def test_sleeps_are_clipped_to_the_remaining_budget():
    now = [0.0]
    sleeps = []

    def sleep(delay):
        sleeps.append(delay)
        now[0] += delay

    with pytest.raises(StoreUnavailable):
        call_with_retry(Flaky(*[TimeoutError()] * 50), policy=RetryPolicy(
            attempts=50, base_delay_s=10.0, max_delay_s=10.0, budget_s=0.5),
            describe="get k", sleep=sleep, clock=lambda: now[0])
    assert sum(sleeps) <= 0.5 + 1e-9


@pytest.mark.parametrize("error", [FileNotFoundError("gone"), PermissionError("denied"),
                                   FileExistsError("there"), ValueError("bad"), KeyError("k"),
                                   OSError(errno.EIO, "disk on fire")])
def test_permanent_errors_propagate_unchanged_at_once(error):
    fn = Flaky(error)
    sleeps = []
    with pytest.raises(type(error)) as caught:
        call_with_retry(fn, policy=POLICY, describe="get k", sleep=sleeps.append)
    assert caught.value is error and fn.calls == 1 and sleeps == []


def s3fs_error(code, status, message=None, set_cause=True):
    """An S3 error answer, translated exactly as s3fs translates it before raising."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    error = {"Code": code} | ({"Message": message} if message else {})
    raw = ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    return translate_boto_error(raw, set_cause=set_cause)


@pytest.mark.parametrize("code, status, message", [
    ("SlowDown", 503, "Please reduce your request rate."),
    ("ServiceUnavailable", 503, "Service is unable to handle request."),
    ("503", 503, "Service Unavailable"),
    ("InternalError", 500, "We encountered an internal error. Please try again."),
    ("502", 502, "Bad Gateway"),
    ("504", 504, "Gateway Timeout"),
    ("504", 504, None),
])
@pytest.mark.parametrize("set_cause", [True, False])
def test_s3fs_translated_5xx_answers_are_transient(code, status, message, set_cause):
    error = s3fs_error(code, status, message, set_cause)
    assert type(error) is OSError and is_transient(error)


@pytest.mark.parametrize("code, status, message", [
    ("ConditionalRequestConflict", 409, "The conditional request cannot succeed due to a conflicting operation"),
    ("XAmzContentSHA256Mismatch", 400, "The provided 'x-amz-content-sha256' header does not match"),
])
def test_answers_that_s3fs_used_to_retry_itself_are_transient(code, status, message):
    """s3fs and botocore no longer retry under our policy, so what they retried, we must:
    a conditional PUT that met a concurrent one (409: S3 says retry; the next attempt gets
    200 or 412) and a body damaged in transit."""
    error = s3fs_error(code, status, message)
    assert type(error) is OSError and is_transient(error)


@pytest.mark.parametrize("code, status, expected", [
    ("NoSuchKey", 404, FileNotFoundError), ("AccessDenied", 403, PermissionError),
    ("InvalidArgument", 400, OSError),
])
def test_s3fs_translated_4xx_answers_are_not_transient(code, status, expected):
    error = s3fs_error(code, status, "no")
    assert type(error) is expected and not is_transient(error)


def test_connection_level_errors_are_transient():
    import aiohttp
    from botocore import exceptions as boto
    from botocore.parsers import ResponseParserError  # throttling answers with invalid XML
    from urllib3.exceptions import IncompleteRead  # what s3fs raises for a cut-short body

    for error in [boto.EndpointConnectionError(endpoint_url="http://s3"),
                  boto.ReadTimeoutError(endpoint_url="http://s3"),
                  boto.ConnectTimeoutError(endpoint_url="http://s3"),
                  boto.ConnectionClosedError(endpoint_url="http://s3"),
                  aiohttp.ClientConnectionError("reset"), aiohttp.ClientPayloadError("cut"),
                  IncompleteRead(b"partial", 100), ConnectionRefusedError(),
                  aiohttp.ClientResponseError(None, (), status=503), ResponseParserError("bad XML")]:
        assert is_transient(error), error
    assert not is_transient(aiohttp.ClientResponseError(None, (), status=403))


def test_flaky_memory_store_loses_nothing():
    memory = fsspec.filesystem("memory")
    root = f"/retry-{uuid.uuid4().hex}"
    fs = FaultInjectingFileSystem(memory, StoreFaults(0.3, ("timeout", "unavailable", "disconnect"),
                                                      seed=1))
    # 0.3**10 per call keeps 400 calls clear of a spurious give-up whatever the draws.
    policy = RetryPolicy(attempts=10)
    try:
        for i in range(200):
            path, data = f"{root}/round-{i:05d}/message.json", f"payload {i}".encode() * (i + 1)
            call_with_retry(fs.pipe_file, path, data, policy=policy, describe=f"put {path}",
                            sleep=no_sleep)
            assert call_with_retry(fs.cat_file, path, policy=policy, describe=f"get {path}",
                                   sleep=no_sleep) == data
        assert len(memory.find(root)) == 200
        faults = sum(fs.counts.values())  # every fault cost one extra call
        assert 0.2 < faults / (400 + faults) < 0.4
    finally:
        memory.rm(root, recursive=True)
