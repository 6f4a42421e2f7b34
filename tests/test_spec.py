from pathlib import Path

import pytest
import yaml

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


# The brief's tuning candidates (overrides laid over configs/brief.yaml) and the 32B planning input,
# larger than a learner here may hold, are not run specs.
NOT_RUN_SPECS = {"brief-candidates.yaml", "plan-brief-32b.yaml"}


@pytest.mark.parametrize("config", sorted(p.name for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")
                                          if p.name not in NOT_RUN_SPECS))
def test_every_shipped_run_config_is_a_valid_spec(config):
    spec = load_spec(Path(__file__).parents[1] / "configs" / config)
    assert spec.sync.rounds >= 1 and spec.learners


def test_a_spec_too_large_to_train_here_can_still_be_planned():
    config = Path(__file__).parents[1] / "configs" / "plan-brief-32b.yaml"
    with pytest.raises(SpecError, match="a learner can hold"):
        load_spec(config)
    assert load_spec(config, "plan").model.parameter_count(2048) > 30e9
