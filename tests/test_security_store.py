"""Hardening of the object store: store urls, keys, symlinks, write races, retries, credentials."""

import pytest

from infra.store import ObjectStore, StoreError, parse_store_url


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
