"""Smoke test: a real SeaweedFS server starts, stores data and enforces auth."""

from __future__ import annotations

import contextlib
import os
import pathlib

import pytest
import s3fs

from infra.seaweed import S3Server, seaweed_server


def _fs(server: S3Server, secret: str | None = None) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(
        key=server.access_key,
        secret=secret or server.secret_key,
        endpoint_url=server.endpoint_url,
        skip_instance_cache=True,
    )


def test_roundtrip_and_auth(tmp_path: pathlib.Path) -> None:
    payload = os.urandom(1 << 20)
    with seaweed_server(tmp_path / "s3") as server:
        assert server.env()["AWS_ENDPOINT_URL"] == server.endpoint_url
        assert server.secret_key not in repr(server)
        fs = _fs(server)
        fs.pipe("archipelago/smoke/blob.bin", payload)
        assert fs.cat("archipelago/smoke/blob.bin") == payload

        with pytest.raises(PermissionError):
            _fs(server, secret="0" * 40).cat("archipelago/smoke/blob.bin")


def test_two_servers_at_once(tmp_path: pathlib.Path) -> None:
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(seaweed_server(tmp_path / "a", buckets=("left",)))
        b = stack.enter_context(seaweed_server(tmp_path / "b", buckets=("right",)))
        assert a.endpoint_url != b.endpoint_url
        _fs(a).pipe("left/x", b"from a")
        _fs(b).pipe("right/x", b"from b")
        assert _fs(a).cat("left/x") == b"from a"
        assert _fs(b).cat("right/x") == b"from b"
        assert not _fs(b).exists("left/x")
