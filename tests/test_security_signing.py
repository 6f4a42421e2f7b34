"""Signing on by default, and what a run trusts on the operator's machine: a spec with island stores and
no keys is refused (tests/test_spec.py), `resume --store` takes a stored spec only against a pinned key,
the data root holds no keys or Prefect home, and a tracker's endpoint is the worker's own setting."""

from __future__ import annotations

import base64
import socket
import tempfile

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flows.cli import main
from flows.cli_run import load_spec_or_say_why, stored_spec
from infra import layout
from infra.authority import CONTROL, Authority, Signer, generate_keypair, public_key_of
from infra.local_keys import KEYS_DIR_ENV, keys_root
from infra.store import ObjectStore, run_store
from infra.stores import open_run
from tests.test_cli import write_config
from tests.test_security_inputs import files_spec
from training.data.corpora import DATA_ROOT_ENV, DataError, data_root


@pytest.fixture
def signed_demo(tmp_path, monkeypatch):
    """configs/demo.yaml as `archipelago run` loads it (this host's keys), its spec.json written by the
    control plane as a run's start writes it."""
    spec = load_spec_or_say_why(write_config(tmp_path, store={"url": str(tmp_path / "store")}), host_keys="read")
    folder = keys_root() / spec.name
    for writer in [CONTROL, *(i.name for i in spec.islands)]:
        section = spec.signing if writer == CONTROL else next(i.signing for i in spec.islands if i.name == writer)
        monkeypatch.setenv(section.private_key_env, (folder / f"{writer}.key").read_text().strip())
    open_run(spec, "r").put_json(layout.SPEC, spec.model_dump(mode="json"))
    return spec


def test_resume_from_a_store_takes_its_spec_only_against_the_pinned_control_key(signed_demo, tmp_path, capsys):
    spec, url = signed_demo, signed_demo.store.url
    key = spec.signing.public_key
    # Without a pinned key: refused, whatever the store holds.
    assert main(["resume", "r", "--store", url]) == 2
    assert "cannot resume r from --store alone" in capsys.readouterr().err
    # Signed by the control plane and naming the pinned key: taken.
    assert stored_spec(spec.store, "r", key) == spec

    # A store writer's swap: the run's spec without its keys (an unauthenticated run of their choosing).
    unsigned = spec.model_dump(mode="json") | {"signing": None, "unauthenticated": True,
                                               "islands": [{**i, "signing": None} for i in spec.model_dump(
                                                   mode="json")["islands"]]}
    ObjectStore(url).child("runs/swapped").put_json(layout.SPEC, unsigned)
    # ... the same spec signed with an island's valid key, which may not write it ...
    island = run_store(spec.store, "island-signed", Authority.of(spec, "east"))
    island.put_json(layout.SPEC, spec.model_dump(mode="json"))
    # ... and a spec of the attacker's own keys, signed with them.
    private, public = generate_keypair()
    theirs = Authority({CONTROL: public_key_of(public)}, (), Signer(
        CONTROL, Ed25519PrivateKey.from_private_bytes(base64.b64decode(private))))
    run_store(spec.store, "own-keys", theirs).put_json(
        layout.SPEC, spec.model_dump(mode="json") | {"signing": {**spec.signing.model_dump(), "public_key": public}})
    assert main(["resume", "r", "--store", url, "--unauthenticated"]) == 2  # the run has keys: pin them
    assert "its stored spec has signing keys: pin its control key" in capsys.readouterr().err
    for run_id, why in [("swapped", "not signed"), ("island-signed", "signed by a writer that may not write it"),
                        ("own-keys", "its signature does not verify")]:
        assert main(["resume", run_id, "--store", url, "--control-public-key", key]) == 2, run_id
        assert f"error: cannot resume {run_id}: object runs/{run_id}/spec.json: {why}" in capsys.readouterr().err


def test_a_failed_signed_run_prints_a_resume_command_that_pins_its_key(signed_demo):
    from flows.cli_run import resume_command

    assert resume_command(signed_demo, "r").endswith(f"--control-public-key {signed_demo.signing.public_key}")


@pytest.mark.parametrize("holds", ["the signing keys", "the working directory's .archipelago", "the temporary folder"])
def test_a_data_root_holding_keys_or_a_prefect_home_is_refused(tmp_path, monkeypatch, holds):
    """The keys `run` signs with, `serve`'s Prefect home (.archipelago/prefect) and the temporary server's
    (in the temporary folder) must not be readable as a corpus."""
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "elsewhere" / "prefect"))
    monkeypatch.setenv(KEYS_DIR_ENV, str(tmp_path / "elsewhere" / "keys"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere" / "tmp"))
    (tmp_path / "elsewhere" / "tmp").mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", None)  # read $TMPDIR again
    root = tmp_path / "corpora"
    if holds == "the signing keys":
        monkeypatch.setenv(KEYS_DIR_ENV, str(root / "keys"))
    elif holds == "the working directory's .archipelago":  # ARCHIPELAGO_DATA_ROOT=. where `serve` runs
        root.mkdir()
        monkeypatch.chdir(root)
    else:
        monkeypatch.setenv("TMPDIR", str(root / "tmp"))
        (root / "tmp").mkdir(parents=True)
    monkeypatch.setenv(DATA_ROOT_ENV, str(root))
    spec = files_spec(tmp_path / "stores", "docs/*.txt")
    with pytest.raises(DataError, match=f"{DATA_ROOT_ENV} {root} (overlaps|holds) {holds}"):
        data_root(spec)
    if holds == "the signing keys":
        monkeypatch.setenv(KEYS_DIR_ENV, str(tmp_path / "elsewhere" / "keys"))
        assert data_root(spec) == root  # the same root, once the keys are elsewhere


def test_a_spec_cannot_send_a_workers_tracker_token_to_a_host_it_names(monkeypatch):
    """The spec names an MLflow server that listens here; the worker is configured for another one and
    holds a token. Opening the run's tracker is refused before any connection to the spec's host."""
    from eval.tracking import TrackingUnavailable, check_endpoint, open_sink
    from infra.spec.tracking import TrackingSpec

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        named = f"http://127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "worker-token-do-not-send")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.internal.example")
        with pytest.raises(TrackingUnavailable, match=r"tracking.uri names a mlflow server that is not this "
                                                      r"worker's \$MLFLOW_TRACKING_URI") as refusal:
            open_sink(TrackingSpec(backend="mlflow", uri=named), "run", "run-1", "east")
        assert "127.0.0.1" not in str(refusal.value) and "internal" not in str(refusal.value)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
        monkeypatch.delenv("MLFLOW_TRACKING_URI")
        with pytest.raises(TrackingUnavailable):  # a worker configured for no server logs to none
            open_sink(TrackingSpec(backend="wandb", uri=named), "run", "run-1", "east")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", named + "/")
    check_endpoint(TrackingSpec(backend="mlflow", uri=named))  # the worker's own server: allowed


def test_no_island_may_take_the_control_planes_writer_name(tmp_path):
    """An island named `control` would sign with the control plane's key (one key file, one writer name)."""
    from infra.spec import SpecError, parse_spec
    from tests.test_spec import demo_raw

    raw = demo_raw()
    raw["islands"][1]["name"] = CONTROL
    with pytest.raises(SpecError, match="'control' names the control plane's writer"):
        parse_spec(raw)


def test_the_demo_config_dry_runs_signed_with_keys_made_outside_the_data_root(tmp_path, monkeypatch, capsys):
    """`make demo`'s spec as `archipelago run` takes it: keys made for it, the signing sections filled in."""
    monkeypatch.setenv(KEYS_DIR_ENV, str(tmp_path / "keys"))
    assert main(["run", "configs/demo.yaml", "--dry-run", "--set", f"store.url={tmp_path / 'store'}"]) == 0
    assert "dry run: every check passed" in capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "keys" / "demo").iterdir()) == ["control.key", "east.key",
                                                                                     "west.key"]
