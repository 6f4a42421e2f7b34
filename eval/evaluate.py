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
    scores = {split: {name: bits_per_byte(model, read_stream(store, entry), spec.max_seq_len,
                                          spec.evaluation.batch_size, spec.separator, entry.get("document_bytes"))
                      for name, entry in manifest[split].items()} for split in splits}
    return {"tokens": meta.get("tokens"), **scores}


def heldout_bpb(spec: RunSpec, store, key: str) -> dict[str, float]:
    """{eval name: bpb} of one stored model on every held-out evaluation."""
    return {name: result["bpb"] for name, result in score_model(spec, store, key)["heldout"].items()}


def evaluate(spec: RunSpec, store) -> dict:
    """{eval name: {"islands": bpb result, "baseline": bpb result, or None without a baseline}} over
    every held-out byte."""
    islands = score_model(spec, store, layout.CONSOLIDATED)["heldout"]
    baseline = score_model(spec, store, layout.BASELINE)["heldout"] if spec.evaluation.baseline == "standard" else {}
    return {name: {"islands": islands[name], "baseline": baseline.get(name)} for name in islands}
