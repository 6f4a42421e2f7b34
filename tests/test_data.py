import os
from pathlib import Path

import pytest
import torch

from infra.spec.model import BOS
from training.data.corpora import Document
from training.data.shards import encode, shard_documents, split_documents, split_validation


def docs(n):
    return [Document(f"doc-{i}", "x" * (100 + 37 * i)) for i in range(n)]


def singletons(documents):
    return [[d] for d in documents]


def ids(groups):
    return {d.id for group in groups for d in group}


def test_split_is_by_whole_document_and_capped():
    corpus = singletons(docs(50))
    train, held = split_documents(corpus, eval_fraction=0.2, max_eval_bytes=5000, seed=3)
    assert ids(train).isdisjoint(ids(held))
    assert ids(train) | ids(held) == ids(corpus)
    assert 0 < sum(d.nbytes for group in held for d in group) <= 5000 and len(held) > 1
    assert split_documents(corpus, 0.2, 5000, seed=3) == (train, held)


@pytest.mark.parametrize("shares", [[1, 1, 1, 1], [1, 2, 1], [3, 1]])
def test_shards_are_disjoint_cover_the_split_and_follow_shares(shares):
    corpus = docs(60)
    shards = shard_documents(corpus, shares)
    ids = [d.id for shard in shards for d in shard]
    assert len(ids) == len(set(ids)) and set(ids) == {d.id for d in corpus}
    total = sum(d.nbytes for d in corpus)
    largest = max(d.nbytes for d in corpus)
    for shard, share in zip(shards, shares):
        assert abs(sum(d.nbytes for d in shard) - total * share / sum(shares)) <= largest


def test_more_learners_than_documents_is_refused():
    with pytest.raises(ValueError, match="learners but only"):
        shard_documents(docs(2), [1, 1, 1])


def test_encoding_counts_text_bytes_only():
    stream = encode([Document("a", "héllo"), Document("b", "ok")])
    assert stream[0] == BOS and int((stream == BOS).sum()) == 2
    assert int((stream != BOS).sum()) == len("héllo".encode()) + 2
    assert bytes(stream[stream != BOS].to(torch.uint8).tolist()) == "héllo".encode() + b"ok"


def test_validation_is_carved_from_training_by_whole_document_and_leaves_the_evaluation_alone():
    corpus = singletons(docs(80))
    train, held = split_documents(corpus, eval_fraction=0.1, max_eval_bytes=5000, seed=3)
    still_training, validation = split_validation(train, fraction=0.1, max_bytes=4000, seed=3)
    sides = [ids(side) for side in (still_training, validation, held)]
    assert all(sides) and sum(map(len, sides)) == len(corpus) and set.union(*sides) == ids(corpus)
    assert 0 < sum(d.nbytes for group in validation for d in group) <= 4000
    assert split_validation(train, 0.0, 4000, seed=3) == (train, [])


def test_every_path_in_a_spec_is_relative_to_the_data_root_wherever_the_command_runs(tmp_path, monkeypatch):
    """Corpus patterns, the tokenizer's file and init_from's folder alike, none of them from the working
    directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from infra.spec import parse_spec
    from tests.corpora import corpus_folder
    from training.data.corpora import check_data_paths, corpus_files, data_root, init_from_folder
    from training.data.shards import load_tokenizer

    folder = corpus_folder(tmp_path)
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * 20)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["document"] * 10, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    spec = parse_spec({
        "islands": [{"name": "a", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 1}],
        "model": {"kind": "transformers", "init_from": f"{folder.name}/model", "transformers": {
            "architecture": "LlamaForCausalLM", "config": {"hidden_size": 16, "num_hidden_layers": 1,
                                                           "num_attention_heads": 2, "intermediate_size": 32}}},
        "data": {"tokenizer": {"path": f"{folder.name}/tokenizer.json", "vocab_size": tokenizer.get_vocab_size()},
                 "corpora": [{"name": "mine", "source": "files", "paths": [f"{folder.name}/doc*.txt"]}]},
        "sync": {"rounds": 1}, "store": {"url": str(tmp_path / "store")}})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    check_data_paths(spec)
    root = data_root(spec)
    assert corpus_files(spec.data.corpora[0], root) == [(folder / f"doc{i}.txt").resolve() for i in range(3)]
    assert load_tokenizer(spec, root).get_vocab_size() == tokenizer.get_vocab_size()
    assert init_from_folder(spec, root) == (folder / "model").resolve()


def test_a_corpus_pattern_that_matches_nothing_stops_the_run_before_prefect_starts(tmp_path, capsys):
    import yaml

    from flows.cli import main
    from tests.corpora import corpus_folder
    from training.data.corpora import DATA_ROOT_ENV

    folder = corpus_folder(tmp_path)
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * 50)
    missing = f"{folder.name}/chapters/*.txt"
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump({
        "islands": [{"name": "a", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 1}],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "mine", "source": "files", "paths": [f"{folder.name}/doc*.txt", missing]}]},
        "sync": {"rounds": 1}, "store": {"url": str(tmp_path / "store")}}))
    for command in (["run", str(config)], ["prepare", str(config)]):
        assert main(command) == 2
        out, err = capsys.readouterr()
        assert f"corpus mine: pattern {missing!r} matched no files in the data root" in err
        assert len(err.strip().splitlines()) == 1 and str(Path(os.environ[DATA_ROOT_ENV]).resolve()) in err
        assert "resume" not in err and not out  # nothing was started, and there is nothing to resume
