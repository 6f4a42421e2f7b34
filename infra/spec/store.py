"""Where a run's (or an island's) objects live and how to reach them: the `store` sections of a run spec."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from infra.objects import parse_store_url
from infra.spec.base import MAX_WAIT_S, SpecModel
from infra.store_errors import StoreError


class StoreSpec(SpecModel):
    """An object store: a local folder (the default, for a run on one machine) or an S3 prefix, how to
    authenticate to it (only ever by naming variables or blocks), and how hard to retry it."""

    url: str = Field(".archipelago/store",
                     description="Object store root: a local folder, or s3://bucket/prefix. "
                                 "S3 credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.")
    endpoint_url: str | None = Field(
        None, description="S3 endpoint for S3-compatible servers (http(s)://host[:port], no credentials); "
                          "defaults to $AWS_ENDPOINT_URL.")
    credentials_env: str | None = Field(
        None, pattern=r"^[A-Z][A-Z0-9_]{0,47}$",
        description="Prefix of the environment variables with this store's S3 credentials: "
                    "<PREFIX>_AWS_ACCESS_KEY_ID, <PREFIX>_AWS_SECRET_ACCESS_KEY, optionally <PREFIX>_AWS_SESSION_TOKEN "
                    "and <PREFIX>_AWS_ENDPOINT_URL. Empty: the standard AWS credential chain.")
    credentials_block: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9-]{0,63}$",
        description="Name of a Prefect Secret block holding this store's S3 credentials as JSON: aws_access_key_id, "
                    "aws_secret_access_key and optionally aws_session_token. The lifecycle and each island's "
                    "segment flow load it on their own worker and set <credentials_env>_AWS_* in their process, "
                    "which the learners they start inherit; needs credentials_env. Only the name is in the spec.")
    read_credentials_env: str | None = Field(
        None, pattern=r"^[A-Z][A-Z0-9_]{0,47}$",
        description="Prefix of the variables (<PREFIX>_AWS_*, as credentials_env) of a key that may only read and list "
                    "this store: what learners of other islands read it with, so that no island holds another's "
                    "writer key. Empty: readers use credentials_env.")
    read_credentials_block: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9-]{0,63}$",
        description="Name of a Prefect Secret block holding the read-only key (as credentials_block); the other "
                    "islands' segments load it, the island's own does not. Needs read_credentials_env.")
    retry_attempts: int = Field(8, ge=1, le=100, description="Attempts per store request before its stage fails.")
    retry_budget_s: float = Field(120, gt=0, le=MAX_WAIT_S, description="Seconds one store request may spend retrying.")

    @model_validator(mode="after")
    def _a_block_needs_variable_names(self) -> "StoreSpec":
        if self.credentials_block and not self.credentials_env:
            raise ValueError(f"credentials_block {self.credentials_block!r} needs credentials_env: the prefix of the "
                             "<PREFIX>_AWS_* variables the block's credentials are handed to learners in")
        if self.read_credentials_block and not self.read_credentials_env:
            raise ValueError(f"read_credentials_block {self.read_credentials_block!r} needs read_credentials_env")
        return self

    @field_validator("url")
    @classmethod
    def _a_store_url(cls, url: str) -> str:
        # Checked, not rewritten: a relative folder stays relative to where the run is started.
        try:
            parse_store_url(url)
        except StoreError as err:
            raise ValueError(str(err)) from None
        return url

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_without_credentials(cls, url: str | None) -> str | None:
        # The spec is stored with the run and shown in the UI: credentials only ever come from the
        # environment. The messages do not repeat the URL, which may hold them.
        if url is None:
            return url
        try:
            parts = urlsplit(url)
            parts.port  # a malformed port raises only when read
        except ValueError:
            raise ValueError("not a valid URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be http(s)://host[:port]")
        if "@" in parts.netloc:
            raise ValueError("must not carry credentials (user:password@host); S3 credentials come from "
                             "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
        if parts.query or parts.fragment:
            raise ValueError("must not have a query string or fragment (where signed credentials would go); "
                             "S3 credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
        return url
