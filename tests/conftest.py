"""Shared fixtures: a real SeaweedFS S3 server and a real (test-harness) Prefect API."""

from __future__ import annotations

import os

import pytest

from infra.seaweed import seaweed_server

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS server on loopback for the whole session, stopped at the end."""
    with seaweed_server(tmp_path_factory.mktemp("seaweed"), buckets=("archipelago",)) as server:
        yield server


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Credentials and endpoint in the environment, where the store (and learners) read them."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
