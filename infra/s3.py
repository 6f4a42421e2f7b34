"""The S3 side of the object store: an s3fs filesystem with one retry loop, and S3's answers read right."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import s3fs
from fsspec.asyn import sync_wrapper
from fsspec.exceptions import FSTimeoutError

from infra.retry import RetryPolicy
from infra.store_errors import StoreError

# s3fs sends one PUT below 2 * chunksize, capped at S3's 5 GiB single-PUT limit. A conditional
# single PUT is atomic on S3 and on SeaweedFS. SeaweedFS checks the condition of a multipart
# completion before, not with, the write it routes to the key's owner filer (weed/s3api/
# filer_multipart.go, 2026-08), so racing completions can both win: chunks this large keep
# every object under 5 GiB a single PUT instead of s3fs's multipart from 100 MiB.
SINGLE_PUT_MAX_BYTES = 5 * 2**30
# s3fs's own defaults, capped at the retry budget. Both are idle timeouts (a server that keeps sending a
# byte now and then trips neither): what bounds an attempt's total time is `each_attempt_within`.
_CONNECT_TIMEOUT_S = 5.0
_READ_TIMEOUT_S = 15.0
# fsspec reads a timeout of 0 as no timeout at all: an attempt with no time left gets this instead.
_MIN_ATTEMPT_S = 0.001


def is_create_conflict(error: OSError) -> bool:
    """A create-only PUT refused because the key exists (HTTP 412 to If-None-Match: *).

    s3fs turns it into FileExistsError only when the answer names the failed condition, as
    AWS's does; SeaweedFS's does not, and arrives as a plain OSError caused by the ClientError.
    """
    if isinstance(error, FileExistsError):
        return True
    response = getattr(error.__cause__, "response", None)
    if not isinstance(response, dict):
        return False
    return (response.get("Error", {}).get("Code") == "PreconditionFailed"
            or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)


def read_at_most(fs, path: str, nbytes: int | None, **options) -> bytes:
    """An object's first `nbytes` bytes (all of them with None); `options` go to `cat_file`. S3 refuses a
    ranged read of an empty object (416, "range not satisfiable"): it holds no bytes, and reads as none."""
    if nbytes is None:
        return fs.cat_file(path, **options)
    try:
        return fs.cat_file(path, start=0, end=nbytes, **options)
    except OSError as err:
        if type(err) is not OSError or "range is not satisfiable" not in str(err):
            raise
        return b""


def require_aws_credentials() -> None:
    """Fail at once, by name, when the standard AWS chain finds no credentials at all.

    The chain is botocore's: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE with the
    shared credentials and config files (static keys, roles, SSO, credential_process), then
    container and instance roles. Credentials are never taken from the spec, and never logged.
    """
    import botocore.session
    from botocore.exceptions import BotoCoreError

    try:
        found = botocore.session.Session().get_credentials()
    except BotoCoreError as err:  # e.g. AWS_PROFILE names a profile that no file defines
        raise StoreError(f"s3 store: the AWS credential chain failed: {err}") from None
    if found is None:
        raise StoreError("s3 store needs AWS credentials and found none: set AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with a shared credentials/config file, "
                         "or run with an instance or container role")


# What a store's credentials_env prefixes: <PREFIX>_AWS_ACCESS_KEY_ID and so on.
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def credentials_from_env(prefix: str) -> dict[str, str]:
    """s3fs's key, secret (and token) from <prefix>_AWS_*: one site's credentials beside another's.
    A missing variable is named; no value ever is."""
    names = {"key": f"{prefix}_AWS_ACCESS_KEY_ID", "secret": f"{prefix}_AWS_SECRET_ACCESS_KEY"}
    missing = [name for name in names.values() if not os.environ.get(name)]
    if missing:
        raise StoreError(f"s3 store with credentials_env {prefix}: {' and '.join(missing)} not set")
    found = {option: os.environ[name] for option, name in names.items()}
    if os.environ.get(f"{prefix}_AWS_SESSION_TOKEN"):
        found["token"] = os.environ[f"{prefix}_AWS_SESSION_TOKEN"]
    return found


class ObjectS3FileSystem(s3fs.S3FileSystem):
    """s3fs, asked only about objects: whether a key exists is one HEAD. s3fs follows a HEAD that
    finds nothing with a LIST, to tell whether the key names a folder; the store's keys never name
    folders, and a reader waiting for a peer's commit would pay two requests per look, over the
    wide-area link when the peer's store is on another island."""

    async def _exists(self, path):
        bucket, key, _ = self.split_path(path)
        if not key:
            return await super()._exists(path)
        try:
            await self._call_s3("head_object", self.kwargs, Bucket=bucket, Key=key)
            return True
        except FileNotFoundError:
            return False

    exists = sync_wrapper(_exists)


def s3_filesystem(endpoint_url: str | None, retry: RetryPolicy, credentials_env: str | None = None):
    """An s3fs filesystem that makes one attempt per call: `retry` (infra/retry.py) is the only
    retry loop, so its budget bounds a call instead of botocore's and s3fs's retries under it.
    Credentials: from <credentials_env>_AWS_* when given, else the standard AWS chain."""
    # max_concurrency 1: a read is one GET. Above 1, s3fs first asks an object's size (a HEAD, a
    # second request across the link for every message read) to fetch big objects in ranges.
    options: dict = {"use_listings_cache": False, "max_concurrency": 1, "config_kwargs": {
        "retries": {"total_max_attempts": 1},
        "connect_timeout": min(_CONNECT_TIMEOUT_S, retry.budget_s),
        "read_timeout": min(_READ_TIMEOUT_S, retry.budget_s),
    }}
    if credentials_env:
        options.update(credentials_from_env(credentials_env))
        endpoint = endpoint_url or os.environ.get(f"{credentials_env}_AWS_ENDPOINT_URL")
    else:
        require_aws_credentials()
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    fs = ObjectS3FileSystem(**options)
    # A class attribute in s3fs, not a constructor option; these options are ours alone, so
    # setting it on the shared instance changes no other user of s3fs.
    fs.retries = 1
    return fs


def each_attempt_within(request: Callable, budget_s: float) -> Callable:
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
