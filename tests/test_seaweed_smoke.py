"""Smoke test: a real SeaweedFS server starts, stores data and enforces auth."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket

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


def test_a_port_taken_before_weed_binds_it_starts_the_server_again_on_new_ones(tmp_path, monkeypatch):
    """Another socket takes the S3 port between the probe and weed's bind, as an outgoing connection
    from the same ephemeral range can: the first start fails on it, the second gets new ports."""
    import infra.seaweed as seaweed

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    probe, picks = seaweed._free_ports, []

    def free_ports(count, host):
        ports = probe(count, host)
        if not picks:
            ports[seaweed._COMPONENTS.index("s3")] = taken.getsockname()[1]
        picks.append(ports)
        return ports

    monkeypatch.setattr(seaweed, "_free_ports", free_ports)
    with taken, seaweed_server(tmp_path / "s3") as server:
        _fs(server).pipe("archipelago/after-retry.txt", b"ok")
        assert _fs(server).cat("archipelago/after-retry.txt") == b"ok"
    assert len(picks) == 2 and server.endpoint_url.endswith(f":{picks[1][3]}")
    assert "Port allocation failed" in (tmp_path / "s3" / "weed.log").read_text()
