import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.local_keys import KEYS_DIR_ENV
from infra.spec import SpecError, load_spec, parse_spec

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def demo_raw():
    return yaml.safe_load(DEMO.read_text())


def test_demo_config_is_valid_and_heterogeneous():
    spec = load_spec(DEMO)
    assert len(spec.islands) >= 2 and len(spec.learners) >= 4
    assert len({i.batch_size for i in spec.islands}) > 1 and len({i.inner_steps for i in spec.islands}) > 1
    assert [s.index for s in spec.learners] == list(range(len(spec.learners)))


@pytest.mark.parametrize("edit, field", [
    (lambda r: r["islands"][0].update(batch_size="eight"), "islands.0.batch_size"),
    (lambda r: r["islands"][1].update(colour="blue"), "islands.1.colour"),
    (lambda r: r["sync"].update(rounds=0), "sync.rounds"),
    (lambda r: r["sync"].update(mode="ring"), "sync.mode"),
    (lambda r: r["model"].update(heads=3), "model"),
    (lambda r: r.pop("data"), "data"),
    (lambda r: r["sync"].update(outer={"name": "shampoo", "shampoo": {"graft": "lion"}}), "sync.outer.shampoo.graft"),
    (lambda r: r["sync"].update(outer={"name": "adam"}), "sync.outer.name"),
])
def test_invalid_input_names_the_field(edit, field):
    raw = demo_raw()
    edit(raw)
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert field in str(err.value)


def test_missing_file_and_bad_yaml_are_named(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("islands: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


# The brief's tuning candidates are overrides laid over configs/brief.yaml, not a run spec.
NOT_RUN_SPECS = {"brief-candidates.yaml"}


@pytest.mark.parametrize("config", sorted(p.name for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")
                                          if p.name not in NOT_RUN_SPECS))
def test_every_shipped_run_config_is_a_valid_spec_and_runs_signed(config, tmp_path, monkeypatch):
    """As `archipelago run`, `serve` and `deploy` load them: a config without keys gets this host's (made
    into an owner-only folder outside the data root), so every shipped config runs signed."""
    from flows.cli_run import load_spec_or_say_why

    monkeypatch.setenv(KEYS_DIR_ENV, str(tmp_path / "keys"))
    spec = load_spec_or_say_why(str(Path(__file__).parents[1] / "configs" / config), host_keys="read")
    assert spec.sync.rounds >= 1 and spec.learners
    assert spec.signing is not None and not spec.unauthenticated
    folder = tmp_path / "keys" / spec.name
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(path.name for path in folder.iterdir()) == sorted(f"{w}.key" for w in ["control", *(
        i.name for i in spec.islands)])
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in folder.iterdir())
    # The same keys the next time (a resume's spec is the run's), and "read" puts no private key in the environment.
    assert load_spec_or_say_why(str(Path(__file__).parents[1] / "configs" / config), host_keys="read") == spec
    assert spec.signing.private_key_env not in os.environ


def test_a_spec_of_several_stores_without_keys_is_refused_unless_it_says_unauthenticated():
    raw = {"islands": [{"name": "east", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 1},
                       {"name": "west", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 1,
                        "store": {"url": "s3://west/runs"}}],
           "data": {"corpora": [{"name": "prose", "source": "shakespeare"}]}, "sync": {"rounds": 1}}
    with pytest.raises(SpecError, match=r"islands \['west'\] have stores of their own, and the spec has no "
                                        r"signing keys: add the `signing` sections `archipelago keys` prints, or say "
                                        r"unauthenticated: true"):
        parse_spec(raw)
    assert parse_spec({**raw, "unauthenticated": True}).signing is None
    del raw["islands"][1]["store"]
    assert not parse_spec(raw).unauthenticated  # one store: `run` signs it with the host's keys


def test_an_unauthenticated_run_says_so_when_it_starts(tmp_path, capsys):
    from flows.cli_run import _launch

    spec = parse_spec({**demo_raw(), "unauthenticated": True, "store": {"url": str(tmp_path / "store")},
                       "data": {"corpora": [{"name": "none", "source": "files", "paths": ["nothing-here/*"]}]}})
    assert _launch(spec, "r", None) == 2  # its data path is refused after the warning, before any work
    err = capsys.readouterr().err
    assert err.index("warning: run r is unauthenticated (unauthenticated: true)") < err.index("matched no files")


def test_no_model_size_is_refused_by_the_spec_alone():
    # A 32B model on sharded islands is a run spec: whether it fits is the memory plan's to say, per
    # rank and per host (tests/test_plan_memory.py), not a cap on parameters.
    spec = load_spec(Path(__file__).parents[1] / "configs" / "plan-brief-32b.yaml")
    assert spec.model.parameter_count(spec.max_seq_len) > 30e9


@pytest.mark.parametrize("island, message", [
    ({"fsdp_mixed_precision": True, "parallelism": "data_parallel", "processes_per_learner": 2, "batch_size": 8,
      "precision": "bf16"}, "fsdp_mixed_precision needs parallelism fsdp over more than one process and precision "
                            "bf16 (not data_parallel over 2 and bf16)"),
    ({"fsdp_mixed_precision": True, "parallelism": "fsdp", "processes_per_learner": 2, "batch_size": 8},
     "(not fsdp over 2 and fp32)"),
    ({"fsdp_mixed_precision": True, "parallelism": "fsdp", "precision": "bf16"}, "(not fsdp over 1 and bf16)"),
    ({"host_memory_gb": 0}, "islands.0.host_memory_gb"),
    ({"activation_checkpointing": "sometimes"}, "islands.0.activation_checkpointing"),
])
def test_memory_options_of_an_island_are_checked(island, message):
    raw = demo_raw()
    raw["islands"][0].update(island)
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert message in str(err.value)


# What checking a spec must never pull in: the stores, process launching, S3 clients, Prefect.
SPEC_MUST_NOT_IMPORT = ("infra.store", "infra.stores", "infra.s3", "infra.launch", "infra.seaweed", "infra.lease",
                        "fsspec", "s3fs", "boto3", "botocore", "subprocess", "prefect", "torch")


def test_spec_package_imports_no_store_or_process_code():
    """Every module of infra.spec imported, and the demo spec loaded, in a fresh interpreter: none of
    the modules that do I/O is imported on the way."""
    probe = ("import json, pkgutil, importlib, sys; import infra.spec; "
             "[importlib.import_module(m.name) for m in pkgutil.iter_modules(infra.spec.__path__, 'infra.spec.')]; "
             f"infra.spec.load_spec({str(DEMO)!r}); print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                       cwd=Path(__file__).resolve().parents[1]).stdout)
    assert "infra.spec.sync" in loaded and "infra.spec.windows" in loaded
    assert [name for name in loaded
            if any(name == forbidden or name.startswith(f"{forbidden}.") for forbidden in SPEC_MUST_NOT_IMPORT)] == []
