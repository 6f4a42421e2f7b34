"""The store's contract, on a local folder and on a real S3 server."""

import os

import pytest
import torch

from infra.store import IntegrityError, ObjectExists, ObjectMissing, ObjectStore, StoreError


def test_objects_are_written_once(store):
    store.put_bytes("a/b.bin", b"first")
    with pytest.raises(ObjectExists):
        store.put_bytes("a/b.bin", b"second")
    assert store.get_bytes("a/b.bin") == b"first"


def test_committed_tensors_round_trip_and_are_verified(store):
    tensors = {"weights": torch.randn(100), "tokens": torch.arange(10, dtype=torch.int16)}
    written = store.commit_tensors("round-0/message", tensors, {"tokens": 7})
    assert store.is_committed("round-0/message")
    loaded, meta, read = store.read_committed("round-0/message")
    assert meta == {"tokens": 7} and read == written
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_corrupt_objects_are_detected_and_named(store):
    ref = store.put_tensors("m/x.safetensors", {"w": torch.ones(10)})
    store.put_json("m/ok.json", {"a": 1})
    with pytest.raises(IntegrityError, match="m/x.safetensors"):
        store.get_bytes(ref.key, "0" * 64)
    store.put_bytes("m/bad.json", b'{"sha256": "00", "body": {"a": 2}}')
    with pytest.raises(IntegrityError, match="m/bad.json"):
        store.get_json("m/bad.json")
    assert store.get_json("m/ok.json") == {"a": 1}


def test_missing_objects_and_bad_keys(store):
    with pytest.raises(ObjectMissing, match="nothing/here"):
        store.get_bytes("nothing/here")
    for key in ["../escape", "/abs", "a//b", "a/../b", "sp ace"]:
        with pytest.raises(StoreError, match="invalid object key"):
            store.put_bytes(key, b"x")


def test_s3_store_without_credentials_is_refused(monkeypatch, tmp_path):
    """Nowhere in the AWS credential chain holds credentials: refused at once, by name."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match="needs AWS credentials and found none.*AWS_PROFILE"):
        ObjectStore("s3://archipelago/x")


def test_an_existence_check_on_s3_is_one_head_request(s3_env, tmp_path):
    store = ObjectStore(f"s3://archipelago/test_store/{tmp_path.name}")
    store.put_bytes("round-0/message.json", b"{}")
    calls: list[str] = []
    store.fs.s3.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    assert store.exists("round-0/message.json")
    # A key that is not there yet (a peer's commit a reader waits for) and a key that only prefixes
    # others: neither is an object, and asking costs one HEAD, never a LIST besides it.
    assert not store.exists("round-1/message.json")
    assert not store.exists("round-0")
    assert calls == ["HeadObject"] * 3


def test_a_read_and_a_look_for_a_document_on_s3_are_one_get_each(s3_env, tmp_path):
    """A peer's message crosses the link as GETs: s3fs would ask each object's size first (a HEAD
    per read); a wait for a commit looks with GETs and the look that finds it brings it."""
    store = ObjectStore(f"s3://archipelago/test_store/{tmp_path.name}")
    store.put_bytes("round-0/message.safetensors", b"tensors")
    store.put_json("round-0/message.json", {"a": 1})
    calls: list[str] = []
    store.fs.s3.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    assert store.get_bytes("round-0/message.safetensors") == b"tensors"
    assert store.wait_for_json("round-0/message.json", 1.0)[0] == {"a": 1}
    assert store.wait_for_json("round-1/message.json", 0.0) is None
    assert calls == ["GetObject"] * 3
