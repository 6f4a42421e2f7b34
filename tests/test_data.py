import pytest
import torch

from infra.model_spec import BOS
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
