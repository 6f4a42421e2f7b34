"""Hardening of the object store: store urls, keys, symlinks, write races, retries, credentials."""

import os
import socket
import threading
import time

import pytest
import s3fs

from infra.objects import parse_store_url, validate_key
from infra.retry import RetryPolicy, StoreUnavailable
from infra.spec.store import StoreSpec
from infra.store import ObjectExists, ObjectStore, StoreError, run_store


@pytest.mark.parametrize("url, why", [
    ("", "empty"), ("   ", "empty"),
    ("s3://", "no bucket"), ("s3:///prefix", "no bucket"),
    ("s3:/bucket", "unsupported scheme 's3'"),
    ("~/store", "'~' is not expanded"),
    ("gs://bucket/x", "unsupported scheme 'gs'"), ("http://host/x", "unsupported scheme 'http'"),
    ("s3://Bad_Bucket/x", "not a valid S3 bucket name"),
    ("s3://bucket//x", "prefix"), ("s3://bucket/../x", "prefix"),
    ("file://host/x", "absolute path"), (" /tmp/store", "whitespace"),
])
def test_store_urls_that_would_land_somewhere_unintended_are_refused(url, why, tmp_path, monkeypatch):
    """Typos such as `s3:/bucket` or an unexpanded `~` used to become odd local folders
    (`./s3:/bucket`, `./~/store`); they must be refused, naming the url."""
    monkeypatch.chdir(tmp_path)
    for parse in (parse_store_url, ObjectStore):
        with pytest.raises(StoreError, match=why) as caught:
            parse(url)
        assert repr(url) in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_store_urls_are_normalised(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_store_url("rel/store/") == str(tmp_path / "rel" / "store")
    assert parse_store_url(f"file://{tmp_path}/x") == str(tmp_path / "x")
    assert parse_store_url("s3://archipelago/runs/a/") == "s3://archipelago/runs/a"
    assert parse_store_url("s3://archipelago") == "s3://archipelago"
    assert ObjectStore("rel/store").url == str(tmp_path / "rel" / "store")


def race(writers, key: str, payloads: list[bytes]) -> list[BaseException | None]:
    """Each writer puts its payload under `key`, all released at the same instant."""
    barrier = threading.Barrier(len(writers))
    outcomes: list[BaseException | None] = [None] * len(writers)

    def write(i):
        barrier.wait()
        try:
            writers[i].put_bytes(key, payloads[i])
        except BaseException as err:  # noqa: BLE001 - reported to the test
            outcomes[i] = err

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(writers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_racing_writers_of_different_bytes_leave_exactly_the_first_object(store):
    """Two writers put different bytes under one new key at the same instant (a check-then-write
    store lets both pass the check, and the last silently overwrites the first): exactly one
    wins, its bytes stay, the other gets ObjectExists."""
    writers = [store, ObjectStore(store.url, store.endpoint_url)]
    for round_ in range(10):
        key = f"race/{round_}/message.json"
        payloads = [f"writer {i} round {round_}".encode() * 50 for i in range(2)]
        outcomes = race(writers, key, payloads)
        winners = [i for i, outcome in enumerate(outcomes) if outcome is None]
        assert len(winners) == 1, f"round {round_}: {outcomes}"
        loser = outcomes[1 - winners[0]]
        assert isinstance(loser, ObjectExists) and "already exists" in str(loser)
        assert store.get_bytes(key) == payloads[winners[0]]


def test_racing_writers_of_the_same_bytes_both_succeed(store):
    """A retried stage may rewrite an object while its first attempt still runs: the same bytes
    under the same key are a no-op for both writers, never an ObjectExists."""
    writers = [store, ObjectStore(store.url, store.endpoint_url)]
    for round_ in range(5):
        data = f"round {round_}".encode() * 50
        assert race(writers, f"same/{round_}.bin", [data, data]) == [None, None]
        assert store.get_bytes(f"same/{round_}.bin") == data


@pytest.mark.parametrize("key", ["abc\n", "a/b\n", "a\nb", "\n"])
def test_keys_with_newlines_are_refused(key):
    """`$` matches before a trailing newline, so `abc\\n` passed the key check."""
    with pytest.raises(StoreError, match="invalid object key"):
        validate_key(key)


@pytest.mark.parametrize("run_id", ["a/b", "../x", "..", ".", "", "r\n", "x/../../y"])
def test_run_ids_are_one_path_segment(run_id, tmp_path):
    """A run id with `/` or `..` would place or read a run under another run's prefix."""
    with pytest.raises(StoreError, match="invalid run id"):
        run_store(StoreSpec(url=str(tmp_path / "store")), run_id)
    assert run_store(StoreSpec(url=str(tmp_path / "store")), "run-1.b").url == str(tmp_path / "store/runs/run-1.b")


def test_local_store_does_not_follow_symlinks_out_of_its_root(tmp_path):
    """Symlinks planted in the store (a folder, an object, a run's own prefix) that point
    outside it: reads, writes and listings through them are refused and nothing outside changes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text("top secret")
    root = tmp_path / "store"
    store = ObjectStore(str(root))
    store.put_bytes("inside/ok.bin", b"ok")
    (root / "evil").symlink_to(outside, target_is_directory=True)
    (root / "link.json").symlink_to(outside / "secret.json")
    (root / "runs").mkdir()
    (root / "runs" / "r").symlink_to(outside, target_is_directory=True)

    attempts = [lambda: store.get_bytes("evil/secret.json"), lambda: store.get_bytes("link.json"),
                lambda: store.put_bytes("evil/planted.bin", b"x"), lambda: store.exists("evil/secret.json"),
                lambda: store.list("evil"),
                lambda: run_store(StoreSpec(url=str(root)), "r").get_bytes("secret.json"),
                lambda: run_store(StoreSpec(url=str(root)), "r").put_bytes("planted.bin", b"x")]
    for attempt in attempts:
        with pytest.raises(StoreError, match="outside the store root"):
            attempt()
    assert sorted(p.name for p in outside.iterdir()) == ["secret.json"]
    assert store.get_bytes("inside/ok.bin") == b"ok"


@pytest.mark.parametrize("operation", ["put", "get"])
def test_a_refused_endpoint_fails_within_the_retry_budget(operation, monkeypatch):
    """botocore's and s3fs's retries ran under ours: a 3 s budget against a closed port took
    about 10 s. Only our policy may retry, so the call ends near its budget."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unused")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unused")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    store = ObjectStore("s3://archipelago/refused", f"http://127.0.0.1:{closed_port}",
                        RetryPolicy(attempts=100, budget_s=3.0))
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="3s budget"):
        store.put_bytes("k", b"x") if operation == "put" else store.get_bytes("k")
    assert time.monotonic() - start < 6.0


@pytest.fixture
def fresh_s3fs():
    """s3fs caches filesystems by their arguments, credentials resolved inside: start and end clean."""
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def clear_aws_environment(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_credentials_come_from_a_shared_credentials_profile(s3_server, monkeypatch, tmp_path, fresh_s3fs):
    """No static keys in the environment, only AWS_PROFILE and a credentials file (as with
    `aws configure --profile`): the store used to refuse this; it must work against S3."""
    clear_aws_environment(monkeypatch, tmp_path)
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[island]\naws_access_key_id = {s3_server.access_key}\n"
                           f"aws_secret_access_key = {s3_server.secret_key}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "island")
    store = ObjectStore(f"s3://archipelago/profile-tests/{tmp_path.name}", s3_server.endpoint_url)
    store.put_json("a.json", {"via": "profile"})
    assert store.get_json("a.json") == {"via": "profile"}


def test_a_profile_that_no_file_defines_is_named(monkeypatch, tmp_path, fresh_s3fs):
    clear_aws_environment(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_PROFILE", "nosuchprofile")
    with pytest.raises(StoreError, match="credential chain failed.*nosuchprofile"):
        ObjectStore("s3://archipelago/x")
