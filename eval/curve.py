"""Bits per byte along training, for both arms: the points of the bpb-versus-tokens plot.

Islands: the token-weighted mean of the learners' weights after a round (what consolidation
would produce then), read from the weights-only objects learners commit for these rounds
(`layout.curve_weights`): their checkpoints of them may be retired by now. Standard training: its
snapshots at the step whose token count matches.
Intermediate points are scored on the first `CURVE_EVAL_BYTES` of each held-out set (with a
tokenizer, its first whole documents within as many tokens), to keep them cheap; the report's table
scores every held-out byte of the final models.
"""

from __future__ import annotations

from eval.bpb import bits_per_byte
from eval.evaluate import sets_bpb
from infra import layout
from infra.spec import RunSpec
from infra.store import IntegrityError
from infra.stores import RunStores
from training.data.streams import read_stream
from training.exchange.mixing import weighted_mean
from training.model.registry import build_model, load_model
from training.model.params import load_flat_parameters
from training.model.schedule import curve_rounds

CURVE_EVAL_BYTES = 16_384


def _islands_model(spec: RunSpec, store, round_index: int):
    stores = RunStores(spec, store)
    weights, tokens = [], []
    for slot in spec.learners:
        key = layout.curve_weights(slot.index, round_index)
        if not stores.learner(slot.index).is_committed(key):  # e.g. it rejoined from a peer past this round
            continue
        try:
            weights.append(stores.learner(slot.index).read_committed(key)[0]["weights"])
        except IntegrityError:  # left out, as consolidation leaves out a corrupt final checkpoint
            continue
        tokens.append(slot.tokens_per_round())
    if not weights:
        return None, 0
    model = build_model(spec)
    load_flat_parameters(model, weighted_mean(weights, tokens))
    return model, sum(slot.tokens_per_round() for slot in spec.learners) * (round_index + 1)


def _curve_stream(spec: RunSpec, store, entry: dict):
    """The start of a held-out set that the curve scores, and its documents' UTF-8 bytes (None: bytes)."""
    stream = read_stream(store, entry)
    if "document_bytes" not in entry:
        return stream[:CURVE_EVAL_BYTES + 1], None
    ends = (stream == spec.separator).nonzero().flatten().tolist()[1:] + [len(stream)]
    whole = max(1, sum(1 for end in ends if end <= CURVE_EVAL_BYTES + 1))
    return stream[:ends[whole - 1]], entry["document_bytes"][:whole]


def islands_heldout_curve(spec: RunSpec, store) -> list[dict]:
    """The islands' model after each curve round scored on every held-out byte, as the report scores the
    final models (for when they reach a given bpb): [{"round", "tokens", "bpb": {eval name: bpb}}]."""
    heldout = store.get_json(layout.DATA_MANIFEST)["heldout"]
    points = []
    for r in curve_rounds(spec.sync.rounds, spec.evaluation.curve_points):
        model, tokens = _islands_model(spec, store, r)
        if model is not None:
            points.append({"round": r, "tokens": tokens,
                           "bpb": sets_bpb(spec, store, model, heldout)})
    return points


def standard_heldout_curve(spec: RunSpec, store) -> list[dict]:
    """Standard training's snapshots and final model scored on every held-out byte:
    [{"tokens", "bpb": {eval name: bpb}}] in token order (for how many tokens it needs to reach a bpb)."""
    heldout = store.get_json(layout.DATA_MANIFEST)["heldout"]
    keys = [key.removesuffix(".json") for key in store.list(layout.BASELINE_SNAPSHOTS) if key.endswith(".json")]
    points = []
    for key in keys + [layout.BASELINE]:
        model, meta = load_model(spec, store, key)
        points.append({"tokens": meta["tokens"],
                       "bpb": sets_bpb(spec, store, model, heldout)})
    return sorted(points, key=lambda point: point["tokens"])


def evaluate_curve(spec: RunSpec, store) -> list[dict]:
    """[{"arm", "tokens", "eval", "bpb"}] for both arms (the islands alone without a baseline) at matching
    token counts."""
    manifest = store.get_json(layout.DATA_MANIFEST)
    streams = {name: _curve_stream(spec, store, entry) for name, entry in manifest["heldout"].items()}
    models = []
    for r in curve_rounds(spec.sync.rounds, spec.evaluation.curve_points):
        model, tokens = _islands_model(spec, store, r)
        if model is not None:
            models.append(("islands", tokens, model))
    snapshots = [key.removesuffix(".json") for key in store.list(layout.BASELINE_SNAPSHOTS) if key.endswith(".json")]
    for key in snapshots + ([layout.BASELINE] if spec.evaluation.baseline == "standard" else []):
        model, meta = load_model(spec, store, key)
        models.append(("standard", meta["tokens"], model))
    return [{"arm": arm, "tokens": tokens, "eval": name,
             "bpb": bits_per_byte(model, stream, spec.max_seq_len, spec.evaluation.batch_size, spec.separator,
                                  document_bytes)["bpb"]}
            for arm, tokens, model in models for name, (stream, document_bytes) in streams.items()]
