"""The train/held-out split by whole group of near-duplicates, and per-learner shards.

Documents become one stream of ids, each document's UTF-8 bytes (or its tokenizer ids, with
`data.tokenizer`) after the document separator. Which side of the split a document
lands on depends only on a hash of its id and `data.split_seed` (never the run's seed), so runs of
different seeds evaluate on the same documents, and adding a corpus or changing the number of
learners never moves a document between training and evaluation.

Near-duplicates (MinHash over token 3-grams, and exact copies up to whitespace) form groups that go
wholly to one side: a held-out file whose twin is in training would measure memory, not modelling.

Three sides, by whole group: the evaluation's held-out set, a validation set carved from what
is left (a separately salted hash, so the evaluation set is the same with or without it), and
training. Validation is for tuning settings; the evaluation set is only ever reported.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from datasketch import MinHash, MinHashLSH

from infra import layout
from infra.stores import RunStores
from infra.spec.model import BOS
from training.data.corpora import DataError, Document, data_root, document_rank, load_documents, under_data_root
from training.data.streams import min_stream_tokens

# Words and single punctuation marks: code and prose alike give shingles that reformatting keeps.
_TOKEN = re.compile(r"\w+|[^\w\s]")
SHINGLE_TOKENS = 3
# Measured on the stdlib: `encodings/` code pages share 74-97% of their token 3-grams with their
# twins, six standard errors of a 128-permutation estimate (sqrt(J(1 - J) / 128) = 0.039 at 0.74)
# above 0.5. Below 0.5 are small modules that share only boilerplate (codec wrappers such as
# utf_8.py and unicode_escape.py at 40-50%, one-line re-exports); ordinary files share under 33%.
NEAR_DUPLICATE_JACCARD = 0.5
_MINHASH_PERMUTATIONS = 128
# LSH banding proposes pairs from below the verified threshold, so that pairs just above it are
# rarely lost to the banding's S-curve.
_LSH_CANDIDATE_JACCARD = 0.4


def token_shingles(text: str) -> set[str]:
    """The set of consecutive SHINGLE_TOKENS-token runs of a text (empty below SHINGLE_TOKENS tokens)."""
    tokens = _TOKEN.findall(text)
    return {"\x00".join(tokens[i:i + SHINGLE_TOKENS]) for i in range(len(tokens) - SHINGLE_TOKENS + 1)}


def group_near_duplicates(docs: list[Document]) -> list[list[Document]]:
    """Documents joined (transitively) when identical up to whitespace or when their estimated Jaccard
    similarity of token 3-grams reaches NEAR_DUPLICATE_JACCARD. Each group is sorted by id, groups by
    their first id; a document without a twin is a group of one.
    """
    parent = list(range(len(docs)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(i: int, j: int) -> None:
        parent[max(root(i), root(j))] = min(root(i), root(j))

    first_with_text: dict[str, int] = {}
    for i, doc in enumerate(docs):
        j = first_with_text.setdefault(" ".join(doc.text.split()), i)
        if j != i:
            join(i, j)
    shingled = [(i, {s.encode() for s in token_shingles(doc.text)}) for i, doc in enumerate(docs)]
    # An empty set's MinHash matches every other empty one; such documents are joined only as exact copies.
    shingled = [(i, shingles) for i, shingles in shingled if shingles]
    signatures = MinHash.bulk([shingles for _, shingles in shingled], num_perm=_MINHASH_PERMUTATIONS)
    lsh = MinHashLSH(threshold=_LSH_CANDIDATE_JACCARD, num_perm=_MINHASH_PERMUTATIONS)
    for (i, _), signature in zip(shingled, signatures):
        lsh.insert(i, signature)
    by_index = {i: signature for (i, _), signature in zip(shingled, signatures)}
    for i, signature in by_index.items():
        for j in lsh.query(signature):
            if j > i and signature.jaccard(by_index[j]) >= NEAR_DUPLICATE_JACCARD:
                join(i, j)
    groups: dict[int, list[Document]] = {}
    for i, doc in enumerate(docs):
        groups.setdefault(root(i), []).append(doc)
    return sorted((sorted(group, key=lambda d: d.id) for group in groups.values()), key=lambda g: g[0].id)



def split_documents(groups: list[list[Document]], eval_fraction: float, max_eval_bytes: int,
                    seed: int | str) -> tuple[list[list[Document]], list[list[Document]]]:
    """Whole groups (see group_near_duplicates) to either side: (training, held out).

    Groups are tried in the order of their first member's hash, and taken while they fit both
    budgets: `eval_fraction` of the documents and `max_eval_bytes`. One that would overflow is
    skipped and the next tried, so that a large document does not end the filling early. When none
    fits, the first alone is held out, so that there always is an evaluation.
    """
    ranked = sorted(groups, key=lambda group: document_rank(group[0].id, seed))
    max_documents = max(1, round(sum(map(len, groups)) * eval_fraction))
    held_out, documents, used = [], 0, 0
    for group in ranked:
        nbytes = sum(d.nbytes for d in group)
        if documents + len(group) <= max_documents and used + nbytes <= max_eval_bytes:
            held_out.append(group)
            documents += len(group)
            used += nbytes
        if documents == max_documents:
            break
    held_out = held_out or ranked[:1]
    held_ids = {group[0].id for group in held_out}
    train = [group for group in groups if group[0].id not in held_ids]
    if not train:
        raise ValueError("no training documents left after the held-out split")
    return train, held_out


def split_validation(train: list[list[Document]], fraction: float, max_bytes: int,
                     seed: int) -> tuple[list[list[Document]], list[list[Document]]]:
    """Whole training groups set aside for tuning: (still training, validation)."""
    if fraction == 0:
        return train, []
    return split_documents(train, fraction, max_bytes, seed=f"{seed}:validation")


def _documents(groups: list[list[Document]]) -> list[Document]:
    return [doc for group in groups for doc in group]


def shard_documents(docs: list[Document], shares: list[float]) -> list[list[Document]]:
    """Assign whole documents to learners so each gets bytes in proportion to its share.

    Largest documents first, each to the learner furthest below its target: simple and within
    one document of the target for every learner.
    """
    if len(docs) < len(shares):
        raise ValueError(f"{len(shares)} learners but only {len(docs)} training documents")
    total = sum(d.nbytes for d in docs)
    weight = sum(shares)
    targets = [total * s / weight for s in shares]
    shards: list[list[Document]] = [[] for _ in shares]
    filled = [0] * len(shares)
    for doc in sorted(docs, key=lambda d: (-d.nbytes, d.id)):
        i = max(range(len(shares)), key=lambda j: (targets[j] - filled[j], -j))
        shards[i].append(doc)
        filled[i] += doc.nbytes
    return shards


def encode(docs: list[Document]) -> torch.Tensor:
    """One int16 stream: BOS, then the document's UTF-8 bytes, for each document."""
    parts = []
    for doc in docs:
        parts.append(torch.tensor([BOS], dtype=torch.int16))
        parts.append(torch.frombuffer(bytearray(doc.text.encode("utf-8")), dtype=torch.uint8).to(torch.int16))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int16)


def load_tokenizer(spec, root: Path):
    """The spec's `tokenizers` vocabulary, from its file under `root` (the control plane's data root),
    checked to have the size the spec declares."""
    from tokenizers import Tokenizer

    path = under_data_root(spec.data.tokenizer.path, root)
    if path is None or not path.is_file():
        raise DataError(f"data.tokenizer.path: {spec.data.tokenizer.path!r} is not a file under the data root {root}")
    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_vocab_size() != spec.data.tokenizer.vocab_size:
        raise DataError(f"data.tokenizer: {path} has {tokenizer.get_vocab_size()} ids, the spec says vocab_size "
                        f"{spec.data.tokenizer.vocab_size}")
    return tokenizer


def encoder(spec):
    """How this run's documents become a stream: `encode` for bytes, else the tokenizer's ids after the
    separator (int16 while the vocabulary fits, int32 beyond)."""
    if spec.data.tokenizer is None:
        return encode
    tokenizer = load_tokenizer(spec, data_root(spec))
    dtype = torch.int16 if spec.vocab_size <= 1 << 15 else torch.int32

    def tokenized(docs: list[Document]) -> torch.Tensor:
        ids = [[spec.separator, *encoding.ids]
               for encoding in tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)]
        return torch.tensor([i for doc in ids for i in doc], dtype=dtype)

    return tokenized


def split_corpus(spec, corpus) -> tuple[list[Document], list[list[Document]], list[Document], list[Document],
                                         list[Document]]:
    """A corpus's documents, their near-duplicate groups, and its training, held-out and validation sides."""
    docs = load_documents(corpus, spec.data.split_seed, spec)
    groups = group_near_duplicates(docs)
    train, held = split_documents(groups, corpus.eval_fraction, corpus.max_eval_bytes, spec.data.split_seed)
    train, tuning = split_validation(train, corpus.validation_fraction, corpus.max_validation_bytes,
                                     spec.data.split_seed)
    return docs, groups, _documents(train), _documents(held), _documents(tuning)


def prepare_dataset(spec, store) -> dict:
    """Split every corpus, shard its training side over the learners, write all of it to the run's store.

    Shares follow each learner's planned tokens (batch x sequence x inner steps x rounds), so a
    learner that trains on more tokens also owns more data. The returned manifest, also written
    to the store, records the sha256 of every object.
    """
    learners = spec.learners
    shares = [slot.tokens_per_round() * spec.sync.rounds for slot in learners]
    per_learner: list[list[Document]] = [[] for _ in learners]
    bytes_from: list[dict[str, int]] = [{} for _ in learners]  # per learner, training bytes by corpus
    sides, corpora = {}, {}
    to_stream = encoder(spec)
    for corpus in spec.data.corpora:
        docs, groups, train, held, tuning = split_corpus(spec, corpus)
        sides[corpus.name] = held, tuning
        for shard, origin, assigned in zip(per_learner, bytes_from, shard_documents(train, shares)):
            shard.extend(assigned)
            origin[corpus.name] = sum(d.nbytes for d in assigned)
        merged = [group for group in groups if len(group) > 1]
        corpora[corpus.name] = {"documents": len(docs), "train_documents": len(train),
                                "train_bytes": sum(d.nbytes for d in train),
                                "near_duplicate_groups": len(merged),
                                "near_duplicate_documents": sum(map(len, merged))}
    streams = [to_stream(docs) for docs in per_learner]
    _check_shards_fit(spec, streams, bytes_from)
    heldout, validation = {}, {}
    for name, (held, tuning) in sides.items():
        if tuning:
            ref = store.put_tensors(layout.validation(name), {"tokens": to_stream(tuning)})
            validation[name] = {"object": ref.to_json(), **evaluation_entry(spec, tuning)}
        ref = store.put_tensors(layout.heldout(name), {"tokens": to_stream(held)})
        heldout[name] = {"object": ref.to_json(), **evaluation_entry(spec, held)}
    shards, stores = [], RunStores(spec, store)
    for slot, docs, stream in zip(learners, per_learner, streams):
        # In the learner's island's store: read once per life of the learner, it never crosses the link.
        home = stores.learner(slot.index)
        ref = home.put_tensors(layout.shard(slot.index), {"tokens": stream})
        shards.append({"learner": slot.index, "island": slot.island.name, "object": ref.to_json(), "store": home.url,
                       "documents": len(docs), "bytes": sum(d.nbytes for d in docs),
                       "planned_tokens": shares[slot.index],
                       "document_ids": sorted(d.id for d in docs)})
    manifest = {"shards": shards, "heldout": heldout, "validation": validation, "corpora": corpora}
    store.put_json(layout.DATA_MANIFEST, manifest)
    return manifest


def evaluation_entry(spec, docs: list[Document]) -> dict:
    """A held-out or validation set's manifest fields; with a tokenizer, each document's UTF-8 bytes in
    stream order too, which bits per byte divide by (with bytes, the stream's ids are the bytes)."""
    entry = {"documents": len(docs), "bytes": sum(d.nbytes for d in docs), "document_ids": sorted(d.id for d in docs)}
    if spec.data.tokenizer is not None:
        entry["document_bytes"] = [d.nbytes for d in docs]
    return entry


def _check_shards_fit(spec, streams: list[torch.Tensor], bytes_from: list[dict[str, int]]) -> None:
    """Before anything is written: a shard too short for one window would fail only once its learner starts."""
    island_index = {island.name: n for n, island in enumerate(spec.islands)}
    for slot, stream, origin in zip(spec.learners, streams, bytes_from):
        if len(stream) < min_stream_tokens(slot.island.seq_len):
            sources = ", ".join(f"{name} {nbytes}" for name, nbytes in origin.items())
            raise ValueError(
                f"learner {slot.index} (island {slot.island.name}) gets a shard of {len(stream)} tokens (training "
                f"bytes by corpus: {sources}), but islands.{island_index[slot.island.name]}.seq_len "
                f"{slot.island.seq_len} needs at least {min_stream_tokens(slot.island.seq_len)}: add documents "
                f"to the corpora or lower seq_len")
