"""An island store's credentials from a Prefect Secret block (real Prefect API, real SeaweedFS):
the spec names the block, the flow's process gets the keys, and nothing else does."""

import json
import os

import pytest
from prefect.blocks.system import Secret

from infra.spec import SpecError, parse_spec
from infra.store import ObjectStore
from tasks.credentials import load_credential_blocks

PREFIX = "BLOCKWEST"


def spec_with(store: dict):
    return parse_spec({
        "islands": [{"name": "east", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2},
                    {"name": "west", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2, "store": store}],
        "data": {"corpora": [{"name": "c", "source": "files", "paths": ["x"]}]},
        "sync": {"mode": "butterfly", "rounds": 2},
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
