"""An island store's credentials from a Prefect Secret block (real Prefect API, real SeaweedFS):
the spec names the block, the flow's process gets the keys, and nothing else does."""

import json
import os

import pytest
from prefect.blocks.system import Secret

from infra.seaweed import seaweed_server
from infra.spec import SpecError, parse_spec
from infra.store import ObjectStore
from infra.stores import RunStores, foreign_writer_credentials
from tasks.credentials import load_credential_blocks

PREFIX = "BLOCKWEST"


def spec_with(store: dict):
    return parse_spec({
        "islands": [{"name": "east", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2},
                    {"name": "west", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2, "store": store}],
        "data": {"corpora": [{"name": "c", "source": "files", "paths": ["x"]}]},
        "sync": {"mode": "butterfly", "rounds": 2},
        "unauthenticated": True,  # what is tested here is which store keys a process holds
    })


@pytest.fixture
def clean_prefix():
    yield
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        os.environ.pop(f"{PREFIX}_{variable}", None)


def test_an_island_store_opens_with_the_keys_of_its_secret_block(prefect_api, s3_server, clean_prefix):
    Secret(value={"aws_access_key_id": s3_server.access_key, "aws_secret_access_key": s3_server.secret_key}).save(
        "west-store-keys", overwrite=True)
    spec = spec_with({"url": "s3://archipelago/blocks", "endpoint_url": s3_server.endpoint_url,
                      "credentials_env": PREFIX, "credentials_block": "west-store-keys"})
    assert f"{PREFIX}_AWS_SECRET_ACCESS_KEY" not in os.environ
    assert load_credential_blocks(spec) == ["west-store-keys"]
    ObjectStore.from_spec(spec.islands[1].store).check_reachable()
    # The spec (stored with the run, shown in the UI, a flow parameter) names the block, not the keys.
    assert s3_server.secret_key not in json.dumps(spec.model_dump(mode="json"))


def test_a_missing_or_malformed_block_is_named_by_its_field(prefect_api, clean_prefix):
    spec = spec_with({"url": "s3://archipelago/blocks", "credentials_env": PREFIX, "credentials_block": "no-such-block"})
    with pytest.raises(SpecError, match=r"islands\.1\.store\.credentials_block: no Prefect Secret block"):
        load_credential_blocks(spec)
    Secret(value={"aws_access_key_id": "only-half"}).save("half-keys", overwrite=True)
    spec = spec_with({"url": "s3://archipelago/blocks", "credentials_env": PREFIX, "credentials_block": "half-keys"})
    with pytest.raises(SpecError, match="aws_secret_access_key") as refused:
        load_credential_blocks(spec)
    assert "only-half" not in str(refused.value)
    assert f"{PREFIX}_AWS_ACCESS_KEY_ID" not in os.environ


def test_a_block_needs_the_variables_prefix_and_is_for_island_stores_only():
    with pytest.raises(ValueError, match="credentials_block 'keys' needs credentials_env"):
        spec_with({"url": "s3://archipelago/blocks", "credentials_block": "keys"})
    with pytest.raises(ValueError, match="store.credentials_block: the run's store"):
        parse_spec({**spec_with({"url": "s3://archipelago/west"}).model_dump(mode="json"),
                    "store": {"url": "s3://archipelago/run", "credentials_env": "RUN", "credentials_block": "keys"}})


@pytest.fixture(scope="module")
def west_server(tmp_path_factory):
    """West's store: its own key may write, a second key only read and list (SeaweedFS enforces both)."""
    with seaweed_server(tmp_path_factory.mktemp("seaweed-west-reader"), buckets=("west",), reader=True) as server:
        yield server


@pytest.fixture
def scoped_west(prefect_api, west_server):
    """A run whose west island has a writer block and a read-only block; the variables are cleared after."""
    Secret(value={"aws_access_key_id": west_server.access_key, "aws_secret_access_key": west_server.secret_key}).save(
        "west-writer", overwrite=True)
    Secret(value={"aws_access_key_id": west_server.read_access_key,
                  "aws_secret_access_key": west_server.read_secret_key}).save("west-reader", overwrite=True)
    yield spec_with({"url": "s3://west/scoped", "endpoint_url": west_server.endpoint_url,
                     "credentials_env": "WESTWRITE", "credentials_block": "west-writer",
                     "read_credentials_env": "WESTREAD", "read_credentials_block": "west-reader"})
    for prefix in ("WESTWRITE", "WESTREAD"):
        for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            os.environ.pop(f"{prefix}_{variable}", None)


def test_an_islands_segment_holds_no_other_islands_writer_key_and_reads_it_read_only(scoped_west, west_server,
                                                                                     tmp_path):
    """Attack surface: one compromised island; before, every segment loaded every island's writer block,
    learners inherited them, and a peer's store was read with its writer's key."""
    run = ObjectStore(str(tmp_path / "run")).child("runs/r")
    assert load_credential_blocks(scoped_west, "west") == ["west-writer"]  # west's own segment
    RunStores(scoped_west, run, reader="west").island("west").put_json("learners/001/note.json", {"by": "west"})
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        del os.environ[f"WESTWRITE_{variable}"]  # east's segment runs on east's worker, apart

    assert load_credential_blocks(scoped_west, "east") == ["west-reader"]
    assert not [name for name in os.environ if name.startswith("WESTWRITE_")]
    assert west_server.secret_key not in os.environ.values()
    west_seen_from_east = RunStores(scoped_west, run, reader="east").island("west")
    assert west_seen_from_east.get_json("learners/001/note.json") == {"by": "west"}
    with pytest.raises(PermissionError):  # the read-only key cannot write, as SeaweedFS's identities say
        west_seen_from_east.put_json("learners/001/planted.json", {"by": "east"})
    # Where one environment holds both (a single-host run), east's learners are not handed west's writer key.
    assert foreign_writer_credentials(scoped_west, "east") == [
        "WESTWRITE_AWS_ACCESS_KEY_ID", "WESTWRITE_AWS_SECRET_ACCESS_KEY", "WESTWRITE_AWS_SESSION_TOKEN"]
    assert foreign_writer_credentials(scoped_west, "west") == []
