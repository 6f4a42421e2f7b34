"""Bad input stops before any work, with an error that names the problem."""

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
    assert f"its store holds another spec than {config}" in capsys.readouterr().err
    assert main(["resume", "no-such-run", "--config", config]) == 2
    assert "cannot resume no-such-run" in capsys.readouterr().err
