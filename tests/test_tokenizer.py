"""A tokenizers vocabulary for a run: trained on the training split only, its ids streamed with a
separator after the vocabulary, and bits per byte counted over each document's UTF-8 bytes."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from tokenizers import Tokenizer

from eval.bpb import bits_per_byte
from flows.cli import main
from infra import layout
from infra.spec import SpecError, parse_spec
from infra.store import ObjectStore
from tests.corpora import corpus_folder
from training.data.shards import prepare_dataset, split_corpus
from training.data.streams import read_stream


def word(i: int) -> str:
    """A word of document i's own: letters only, so that byte-level BPE can merge it whole."""
    return "".join("abcdefghij"[int(d)] for d in f"{i:03d}") + "zqx"


def spec_of(tmp_path, tokenizer: dict | None = None):
    corpus = corpus_folder(tmp_path)
    for i in range(30):
        (corpus / f"doc{i}.txt").write_text(" ".join([word(i)] * 60) + f"\nthe common text of document {i}\n")
    return parse_spec({
        "name": "tok", "model": {"layers": 1, "width": 16, "heads": 2},
        "islands": [{"name": "a", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 2}],
        "data": {"corpora": [{"name": "text", "source": "files", "paths": [str(corpus / "doc*.txt")],
                              "eval_fraction": 0.2}], **({"tokenizer": tokenizer} if tokenizer else {})},
        "sync": {"rounds": 2}, "store": {"url": str(tmp_path / "store")},
    })


def trained_tokenizer(tmp_path, capsys, vocab_size: int = 400) -> dict:
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(spec_of(tmp_path).model_dump(mode="json")))
    out = corpus_folder(tmp_path) / "tokenizer.json"
    assert main(["tokenizer", "train", str(config), "--vocab-size", str(vocab_size), "--out", str(out)]) == 0
    return yaml.safe_load(capsys.readouterr().out)["data"]["tokenizer"]


def test_a_tokenizer_is_trained_on_the_training_split_alone(tmp_path, capsys):
    section = trained_tokenizer(tmp_path, capsys)
    spec = spec_of(tmp_path, section)
    tokenizer = Tokenizer.from_file(str(corpus_folder(tmp_path) / "tokenizer.json"))
    assert section["vocab_size"] == tokenizer.get_vocab_size() <= 400
    _, _, train, held, _ = split_corpus(spec, spec.data.corpora[0])
    words = {doc.id: doc.text.split()[0] for doc in train + held}
    assert held and all(tokenizer.token_to_id(words[doc.id]) is None for doc in held)  # never seen
    assert all(tokenizer.token_to_id(words[doc.id]) is not None for doc in train)  # merged whole


def test_tokenized_streams_put_the_separator_after_the_vocabulary_and_count_utf8_bytes(tmp_path, capsys):
    spec = spec_of(tmp_path, trained_tokenizer(tmp_path, capsys))
    store = ObjectStore(spec.store.url).child("runs/r")
    store.put_json(layout.SPEC, spec.model_dump(mode="json"))
    manifest = prepare_dataset(spec, store)
    held = manifest["heldout"]["text"]
    stream = read_stream(store, held)
    assert spec.separator == spec.vocab_size - 1 == spec.data.tokenizer.vocab_size
    assert int((stream == spec.separator).sum()) == held["documents"] == len(held["document_bytes"])
    assert sum(held["document_bytes"]) == held["bytes"] > len(stream) - held["documents"]  # merges: fewer ids

    class Uniform(torch.nn.Module):  # every id equally likely: log2(V) bits a token
        def forward(self, idx):
            return torch.zeros(*idx.shape, spec.vocab_size)

    scored = bits_per_byte(Uniform(), stream, 16, 4, spec.separator, held["document_bytes"])
    tokens = len(stream) - held["documents"]  # separators are never scored
    assert scored["bytes"] == held["bytes"]
    assert scored["bpb"] == pytest.approx(tokens * math.log2(spec.vocab_size) / held["bytes"])


def test_a_tokenizer_that_is_not_the_spec_s_is_refused_naming_both_sizes(tmp_path, capsys):
    section = trained_tokenizer(tmp_path, capsys)
    spec = spec_of(tmp_path, {**section, "vocab_size": section["vocab_size"] + 1})
    with pytest.raises(ValueError, match=f"has {section['vocab_size']} ids, the spec says vocab_size "
                                         f"{section['vocab_size'] + 1}"):
        prepare_dataset(spec, ObjectStore(spec.store.url).child("runs/r"))
    with pytest.raises(ValueError, match="is not a file under the data root"):
        prepare_dataset(spec_of(tmp_path, {**section, "path": "../../etc/passwd"}),
                        ObjectStore(spec.store.url).child("runs/q"))
    with pytest.raises(SpecError, match="vocab_size"):
        spec_of(tmp_path, {"path": "x.json", "vocab_size": 1})


def test_tokenizer_train_without_a_data_root_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """Its corpora and its --out both lie under the data root, which only the environment sets."""
    from training.data.corpora import DATA_ROOT_ENV

    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(spec_of(tmp_path).model_dump(mode="json")))
    monkeypatch.delenv(DATA_ROOT_ENV)
    assert main(["tokenizer", "train", str(config), "--out", str(tmp_path / "tokenizer.json")]) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: the spec's data paths are read only under the control plane's {DATA_ROOT_ENV}, "
                          "which is not set")
    assert not (tmp_path / "tokenizer.json").exists()
