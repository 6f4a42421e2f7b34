"""Shared fixtures: a real SeaweedFS S3 server and a real (test-harness) Prefect API."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from infra import layout
from infra.local_keys import KEYS_DIR_ENV, SIGNING_KEY_PREFIX
from infra.seaweed import seaweed_server
from infra.spec import parse_spec
from infra.store import ObjectStore
from training.data.corpora import DATA_ROOT_ENV
from training.data.shards import prepare_dataset
from tests.corpora import corpus_folder

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


# A test that uses one of these runs against a real server: the integration tier.
SERVER_FIXTURES = {"s3_server", "s3_env", "prefect_api"}
# Modules whose tests start servers of their own or learner processes: the integration tier too.
INTEGRATION_MODULES = {"test_baseline", "test_cli", "test_deadlines", "test_security_control_plane", "test_security_processes",
                       "test_seaweed_smoke", "test_splits", "test_windows"}


# Seconds each test file took in a full run on 2 cores: spread over workers, files start longest first,
# so that the last file to finish on one worker is a short one. Refresh it after a file changes much:
# `pytest -n 2 --dist loadfile --no-loadscope-reorder --record-file-seconds tests/file_seconds.json`.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", metavar="PATH",
                     help="write each test file's seconds (setup, call and teardown of its tests) to PATH as JSON")


def pytest_collection_modifyitems(config, items):
    """Every test in one tier: `ui` and `integration` as marked (a module's `pytestmark` or the test's
    own), else integration when it uses a server fixture, is the S3 side of a parametrised test or sits
    in one of `INTEGRATION_MODULES`, else unit. Spread over workers, files start longest first."""
    for item in items:
        if item.get_closest_marker("ui") or item.get_closest_marker("integration"):
            continue
        callspec = getattr(item, "callspec", None)
        on_s3 = callspec is not None and "s3" in callspec.params.values()  # `store`'s and others' S3 side
        if SERVER_FIXTURES & set(item.fixturenames) or on_s3 or item.module.__name__.rsplit(".", 1)[-1] in INTEGRATION_MODULES:
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)
    # xdist schedules files in the order its workers collect them, and tells a worker it runs no `--dist`.
    if hasattr(config, "workerinput") or config.getoption("dist", "no") != "no":
        items[:] = longest_files_first(items, json.loads(FILE_SECONDS.read_text()))


def longest_files_first(items: list, seconds: dict[str, float]) -> list:
    """Whole files, longest first by `seconds`; a file with no record yet first of all, as it may be long."""
    return sorted(items, key=lambda item: -seconds.get(item.location[0], float("inf")))


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    file = report.location[0]
    _file_seconds[file] = _file_seconds.get(file, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("record_file_seconds")
    if path and not hasattr(session.config, "workerinput"):
        Path(path).write_text(json.dumps({name: round(s, 1) for name, s in sorted(_file_seconds.items())}, indent=1) + "\n")


@pytest.fixture(scope="session", autouse=True)
def data_root(tmp_path_factory):
    """`files` corpora may read only under the data root: here a folder of this session's, where tests write
    their corpora (tests/corpora.py); their stores lie beside it, as no data root may hold a store."""
    root = tmp_path_factory.getbasetemp() / "data"
    root.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DATA_ROOT_ENV, str(root))
        # The keys `archipelago run`, `serve` and `deploy` sign a spec without its own with: this session's.
        patch.setenv(KEYS_DIR_ENV, str(tmp_path_factory.getbasetemp() / "keys"))
        yield root


@pytest.fixture(autouse=True)
def no_signing_key_left_behind():
    """`archipelago run` in a test's process puts this host's signing keys in its environment: they go with the test."""
    before = {name for name in os.environ if name.startswith(SIGNING_KEY_PREFIX)}
    yield
    for name in [name for name in os.environ if name.startswith(SIGNING_KEY_PREFIX) and name not in before]:
        del os.environ[name]


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


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """The same store tests against a local folder and against SeaweedFS."""
    if request.param == "local":
        return ObjectStore(str(tmp_path / "store"))
    request.getfixturevalue("s3_env")
    return ObjectStore(f"s3://archipelago/{request.module.__name__.rsplit('.', 1)[-1]}/{tmp_path.name}")


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session", autouse=True)
def no_prefect_server_left_at_exit():
    """A flow run outside `prefect_api` makes Prefect start a temporary server of its own, stopped by
    an atexit hook that logs to the stderr pytest has closed by then ("--- Logging error ---"):
    stop it here, while pytest still captures output."""
    yield
    server = sys.modules.get("prefect.server.api.server")
    if server is not None:
        server.SubprocessASGIServer().stop()


@pytest.fixture
def two_learner_run(tmp_path):
    """Prepares a run of two one-learner islands in a local store, from small text files.

    Call it with the model, island, training and sync settings a test needs; it returns the spec and the run's store.
    """
    corpus = corpus_folder(tmp_path)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 400)

    def prepare(name: str, layers: int, inner_steps: int, run_id: str = "r", island: dict | None = None,
                training: dict | None = None, model: dict | None = None, **sync):
        spec = parse_spec({
            "name": name,
            "islands": [{"name": name_, "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": inner_steps,
                         **(island or {})} for name_ in ("a", "b")],
            "model": model or {"layers": layers, "width": 16, "heads": 2},
            "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                                  "eval_fraction": 0.2}]},
            "training": {"warmup_steps": 1, **(training or {})},
            "sync": {"mode": "butterfly", **sync},
            "store": {"url": str(tmp_path / "store")},
        })
        store = ObjectStore(spec.store.url).child(f"runs/{run_id}")
        store.put_json(layout.SPEC, spec.model_dump(mode="json"))
        prepare_dataset(spec, store)
        return spec, store

    return prepare


@pytest.fixture
def installed_model(tmp_path, monkeypatch):
    """A package installed beside the tests that registers a model under `archipelago.models`."""
    site = tmp_path / "site"
    (site / "tiny_models").mkdir(parents=True)
    (site / "tiny_models" / "__init__.py").write_text(
        "from training.model.gpt import ByteGPT, GPTConfig\n\n"
        "def build(options, vocab_size, max_seq_len):\n"
        "    return ByteGPT(GPTConfig(layers=options['layers'], width=16, heads=2, max_seq_len=max_seq_len,\n"
        "                             vocab=vocab_size))\n\n"
        "def build_broken(options, vocab_size, max_seq_len):\n"
        "    import torch\n"
        "    return torch.nn.Linear(2, 2)\n")
    dist = site / "tiny_models-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-models\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[archipelago.models]\ntiny = tiny_models:build\n"
                                           "broken = tiny_models:build_broken\n")
    monkeypatch.syspath_prepend(str(site))
