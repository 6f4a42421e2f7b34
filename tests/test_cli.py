"""Bad input stops before any work, with an error that names the problem."""

import pytest
import yaml

from flows.cli import main
from infra import layout
from infra.spec import load_spec
from infra.store import ObjectStore
from tests.test_spec import demo_raw


def write_config(tmp_path, **changes):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**demo_raw(), **changes}))
    return str(path)


def test_unknown_field_is_named(tmp_path, capsys):
    assert main(["run", write_config(tmp_path, colour="blue")]) == 2
    assert "colour" in capsys.readouterr().err


def test_missing_credentials_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    assert main(["run", write_config(tmp_path, store={"url": "s3://archipelago/x"})]) == 2
    assert "AWS_ACCESS_KEY_ID" in capsys.readouterr().err


def test_unreachable_store_is_refused_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    config = write_config(tmp_path, store={"url": "s3://archipelago/x", "endpoint_url": "http://127.0.0.1:9"})
    assert main(["run", config]) == 2
    err = capsys.readouterr().err
    assert "not writable" in err and "not-a-real-secret" not in err


def test_resume_of_an_unknown_run_names_it(tmp_path, capsys):
    assert main(["resume", "no-such-run", "--store", str(tmp_path)]) == 2
    assert "no-such-run" in capsys.readouterr().err


def test_a_capacity_window_already_over_is_refused_naming_island_and_window(tmp_path, capsys):
    raw = demo_raw()
    raw["islands"][1]["windows"] = [{"start": "2020-01-06T09:00:00", "end": "2020-01-06T17:00:00",
                                     "timezone": "Asia/Tokyo"}]
    assert main(["run", write_config(tmp_path, islands=raw["islands"])]) == 2
    err = capsys.readouterr().err
    assert "islands.1.windows.0" in err and "west" in err and "has already ended" in err


def test_resume_with_the_config_refuses_a_store_whose_spec_is_not_it(tmp_path, capsys):
    config = write_config(tmp_path, store={"url": str(tmp_path / "store")})
    spec = load_spec(config)
    store = ObjectStore(spec.store.url).child("runs/r")
    planted = spec.model_dump(mode="json")
    planted["sync"]["rounds"] += 1  # a store writer's spec: one more round of somebody's choosing
    store.put_json(layout.SPEC, planted)
    assert main(["resume", "r", "--config", config]) == 2
    # The config gets this host's keys, as its run did: an unsigned spec.json is not the run's.
    assert "cannot resume r: object runs/r/spec.json: not signed" in capsys.readouterr().err
    assert main(["resume", "no-such-run", "--config", config]) == 2
    assert "cannot resume no-such-run" in capsys.readouterr().err


def test_version_names_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"archipelago {version('archipelago')}")


def test_set_overrides_the_yaml_before_validation(tmp_path):
    raw = demo_raw()
    path = write_config(tmp_path)
    spec = load_spec(path, overrides=["islands.1.batch_size=4", "sync.rounds=3", "tracking.backend=tensorboard",
                                      "tracking.uri=runs/tb", "name=other"])
    assert [island.batch_size for island in spec.islands] == [raw["islands"][0]["batch_size"], 4]
    assert (spec.sync.rounds, spec.tracking.backend, spec.tracking.uri, spec.name) == (3, "tensorboard", "runs/tb", "other")
    assert load_spec(path) == load_spec(path, overrides=[])


@pytest.mark.parametrize("override, problem", [
    ("islands.0.batch_size=eight", "invalid run spec: islands.0.batch_size: Input should be a valid integer"),
    ("sync.roundz=3", "invalid run spec: sync.roundz: Extra inputs are not permitted"),
    ("islands.2.batch_size=4", "islands is a list of 2 entries, addressed by their index from 0, not '2'"),
    ("islands.east.batch_size=4", "islands is a list of 2 entries, addressed by their index from 0, not 'east'"),
    ("name.first=x", "name is 'demo', not a section with fields"),
    ("sync.rounds", "expected section.field=value"),
    ("sync.rounds=[3", "the value is not valid YAML"),
])
def test_a_bad_override_is_named_in_one_line_before_any_work(tmp_path, capsys, override, problem):
    assert main(["plan", write_config(tmp_path), "--set", override]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_resume_takes_overrides_only_with_its_config(tmp_path, capsys):
    assert main(["resume", "r", "--store", str(tmp_path), "--set", "sync.rounds=3"]) == 2
    assert "resume takes it with --config" in capsys.readouterr().err


def test_deploy_without_a_prefect_api_is_refused(tmp_path, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["deploy", write_config(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: deploy needs the Prefect server") and "PREFECT_API_URL" in err
