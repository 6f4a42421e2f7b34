"""Score the run's consolidated model and the standard baseline on every held-out evaluation."""

from __future__ import annotations

from infra import layout
from infra.spec import RunSpec
from eval.bpb import bits_per_byte
from training.data.streams import read_stream
from training.model.registry import load_model


def score_model(spec: RunSpec, store, key: str, splits: tuple[str, ...] = ("heldout",)) -> dict:
    """{split: {eval name: bpb result}} of one stored model over every byte of each split's sets
    (`heldout` for reporting, `validation` for tuning), and the tokens it was trained on."""
    manifest = store.get_json(layout.DATA_MANIFEST)
    model, meta = load_model(spec, store, key)
    return {"tokens": meta.get("tokens"), **{split: score_sets(spec, store, model, manifest[split]) for split in splits}}


def score_sets(spec: RunSpec, store, model, entries: dict) -> dict:
    """{eval name: bpb result} of `model` over every byte of each set the manifest's `entries` name."""
    return {name: bits_per_byte(model, read_stream(store, entry), spec.max_seq_len, spec.evaluation.batch_size,
                                spec.separator, entry.get("document_bytes"))
            for name, entry in entries.items()}


def sets_bpb(spec: RunSpec, store, model, entries: dict) -> dict[str, float]:
    """{eval name: bpb} of `model` over every byte of each set `entries` names."""
    return {name: result["bpb"] for name, result in score_sets(spec, store, model, entries).items()}


def heldout_bpb(spec: RunSpec, store, key: str) -> dict[str, float]:
    """{eval name: bpb} of one stored model on every held-out evaluation."""
    return sets_bpb(spec, store, load_model(spec, store, key)[0], store.get_json(layout.DATA_MANIFEST)["heldout"])


def evaluate(spec: RunSpec, store) -> dict:
    """{eval name: {"islands": bpb result, "baseline": bpb result, or None without a baseline}} over
    every held-out byte."""
    islands = score_model(spec, store, layout.CONSOLIDATED)["heldout"]
    baseline = score_model(spec, store, layout.BASELINE)["heldout"] if spec.evaluation.baseline == "standard" else {}
    return {name: {"islands": islands[name], "baseline": baseline.get(name)} for name in islands}
