"""`archipelago export`: a run's consolidated model in the transformers format, loaded back by
`AutoModelForCausalLM.from_pretrained` with the same logits as Archipelago's own forward pass, and its
tokenizer by `AutoTokenizer.from_pretrained`, giving the ids training gave."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from flows.cli import main
from flows.cli_run import load_spec_or_say_why
from infra import layout
from infra.derived import commit_derived
from infra.local_keys import keys_root
from infra.store import ObjectStore
from infra.stores import open_run
from tests.test_models import MODELS
from training.model.params import flat_parameters
from training.model.registry import build_model, load_model


def consolidated_run(tmp_path, model: dict, tokenizer: dict | None = None):
    """A run spec and its run with a consolidated model (trained-looking weights: the initial ones moved)."""
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump({
        "name": "export", "model": model,
        "islands": [{"name": "a", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2}],
        "data": {"corpora": [{"name": "text", "source": "files", "paths": ["unused/*.txt"]}],
                 **({"tokenizer": tokenizer} if tokenizer else {})},
        "sync": {"rounds": 2}, "store": {"url": str(tmp_path / "store")}}))
    spec = load_spec_or_say_why(str(config), host_keys="read")  # signed with this host's keys, as `run` signs it
    weights = flat_parameters(build_model(spec))
    weights += 0.05 * torch.randn(weights.shape, generator=torch.Generator().manual_seed(1))
    # The control plane's private key is in the environment only while the model is committed: export reads
    # with the spec's public keys alone.
    with pytest.MonkeyPatch.context() as patch:
        sign_as_control_plane(patch, spec)
        store = open_run(spec, "r")
        commit_derived(store, layout.CONSOLIDATED, {"weights": weights}, {"tokens": 1})
    assert spec.signing.private_key_env not in os.environ
    return config, spec, store


def sign_as_control_plane(monkeypatch, spec) -> None:
    """The control plane's private key, from this host's keys, where a run's start reads it."""
    monkeypatch.setenv(spec.signing.private_key_env, (keys_root() / spec.name / "control.key").read_text().strip())


def test_export_reads_with_public_keys_only_and_refuses_a_planted_model(tmp_path, capsys):
    config, spec, store = consolidated_run(tmp_path, {"layers": 2, "width": 32, "heads": 2})
    assert main(["export", str(config), "r", "--out", str(tmp_path / "hf")]) == 0  # no private key here
    planted = ObjectStore(spec.store.url).child("runs/planted")  # a store writer without the control plane's key
    commit_derived(planted, layout.CONSOLIDATED, {"weights": flat_parameters(build_model(spec))}, {"tokens": 1})
    assert main(["export", str(config), "planted", "--out", str(tmp_path / "hf-planted")]) == 2
    assert "not signed" in capsys.readouterr().err and not (tmp_path / "hf-planted").exists()


@pytest.mark.parametrize("name", ["byte_gpt", "llama", "mixtral"])
def test_an_exported_model_loads_with_transformers_and_gives_the_same_logits(tmp_path, capsys, name):
    model = {"layers": 2, "width": 32, "heads": 2} if name == "byte_gpt" else MODELS[name]
    config, spec, store = consolidated_run(tmp_path, model)
    assert main(["export", str(config), "r", "--out", str(tmp_path / "hf")]) == 0
    assert "from_pretrained" in capsys.readouterr().out

    ours = load_model(spec, store, layout.CONSOLIDATED)[0].eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=tokens).logits, ours(tokens), atol=1e-5)
    assert sum(p.numel() for p in theirs.parameters()) >= ours.parameter_counts()["total"]


def test_a_model_with_no_transformers_counterpart_is_refused_naming_why(tmp_path, capsys):
    config, _, _ = consolidated_run(tmp_path, {"layers": 2, "width": 32, "heads": 2, "moe": {"experts": 2}})
    assert main(["export", str(config), "r", "--out", str(tmp_path / "hf")]) == 2
    assert "no transformers counterpart" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_run_without_a_consolidated_model_is_named(tmp_path, capsys):
    config, _, _ = consolidated_run(tmp_path, MODELS["llama"])
    assert main(["export", str(config), "not-a-run", "--out", str(tmp_path / "hf")]) == 2
    assert "cannot export not-a-run" in capsys.readouterr().err


def test_a_run_started_from_an_export_starts_from_its_weights(tmp_path, monkeypatch):
    from infra.spec import parse_spec
    from training.model.registry import initial_model
    from training.stages import start_run

    config, spec, store = consolidated_run(tmp_path, MODELS["mixtral"])
    assert main(["export", str(config), "r", "--out", str(tmp_path / "corpora" / "exported")]) == 0
    monkeypatch.setenv("ARCHIPELAGO_DATA_ROOT", str(tmp_path / "corpora"))
    raw = spec.model_dump(mode="json")
    again = parse_spec({**raw, "seed": 7, "model": {**raw["model"], "init_from": "exported"}})
    sign_as_control_plane(monkeypatch, spec)
    started = start_run(again, "continued")

    trained, _ = load_model(spec, store, layout.CONSOLIDATED)
    continued = initial_model(again, started)
    assert torch.equal(flat_parameters(continued), flat_parameters(trained))
    tokens = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(3))
    assert continued.loss(tokens[:, :-1], tokens[:, 1:]) == trained.loss(tokens[:, :-1], tokens[:, 1:])


def test_weights_that_do_not_fit_the_spec_or_lie_outside_the_data_root_are_refused(tmp_path, monkeypatch):
    from infra.spec import parse_spec
    from training.stages import start_run

    config, spec, _ = consolidated_run(tmp_path, MODELS["llama"])
    assert main(["export", str(config), "r", "--out", str(tmp_path / "corpora" / "llama")]) == 0
    monkeypatch.setenv("ARCHIPELAGO_DATA_ROOT", str(tmp_path / "corpora"))
    sign_as_control_plane(monkeypatch, spec)
    raw = spec.model_dump(mode="json")
    wider = {**raw["model"]["transformers"], "config": {**raw["model"]["transformers"]["config"], "hidden_size": 64}}
    with pytest.raises(ValueError, match="does not fit the spec's model"):
        start_run(parse_spec({**raw, "model": {**raw["model"], "transformers": wider, "init_from": "llama"}}), "x")
    with pytest.raises(ValueError, match="not a transformers model folder under the data root"):
        start_run(parse_spec({**raw, "model": {**raw["model"], "init_from": "../store"}}), "y")


TEXT = "Wherefore art thou, Romeo?\n\tdéjà vu ✓ 𝄞 <b>"


def training_ids(spec, text: str) -> list[int]:
    """The ids data preparation gives a document: the separator, then the text's bytes or tokenizer ids."""
    from training.data.corpora import Document
    from training.data.shards import encoder

    return encoder(spec)([Document("d", text)]).tolist()


@pytest.mark.parametrize("tokenized", [False, True], ids=["bytes", "tokenizer"])
def test_an_export_has_the_runs_tokenizer_and_the_modes_of_the_umask(tmp_path, monkeypatch, capsys, tokenized):
    tokenizer = None
    if tokenized:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        trained = Tokenizer(models.BPE())
        trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trained.decoder = decoders.ByteLevel()
        trained.train_from_iterator([TEXT * 3, "thou art Romeo, wherefore"], trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        (tmp_path / "data").mkdir()
        trained.save(str(tmp_path / "data" / "tokenizer.json"))
        monkeypatch.setenv("ARCHIPELAGO_DATA_ROOT", str(tmp_path / "data"))
        tokenizer = {"path": "tokenizer.json", "vocab_size": trained.get_vocab_size()}
    config, spec, _ = consolidated_run(tmp_path, {"layers": 2, "width": 32, "heads": 2}, tokenizer)
    umask = os.umask(0o022)
    try:
        assert main(["export", str(config), "r", "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(umask)
    said = capsys.readouterr().out
    assert "AutoTokenizer.from_pretrained" in said and f"{spec.separator} the document separator <|endoftext|>" in said

    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = theirs(TEXT).input_ids
    assert ids == training_ids(spec, TEXT)
    if tokenized:
        assert len(ids) < 1 + len(TEXT.encode())  # merges, not bytes
    else:
        assert ids[1:] == list(TEXT.encode())
    assert ids[0] == theirs.bos_token_id == theirs.eos_token_id == spec.separator and len(theirs) == spec.vocab_size
    assert theirs.decode(ids, skip_special_tokens=True) == TEXT
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size == len(theirs) and theirs.model_max_length == model.config.n_positions
    files = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= set(files)
    assert set(files.values()) == {0o644} and (tmp_path / "hf").stat().st_mode & 0o777 == 0o755


def test_a_tokenizer_missing_from_the_data_root_stops_the_export_before_it_writes(tmp_path, monkeypatch, capsys):
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("ARCHIPELAGO_DATA_ROOT", str(tmp_path / "data"))
    config, _, _ = consolidated_run(tmp_path, {"layers": 2, "width": 32, "heads": 2},
                                    {"path": "gone.json", "vocab_size": 300})
    assert main(["export", str(config), "r", "--out", str(tmp_path / "hf")]) == 2
    assert "'gone.json' is not a file under the data root" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
