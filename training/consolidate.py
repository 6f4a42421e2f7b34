"""The end of an islands run: one model from all learners, and how far apart they had drifted."""

from __future__ import annotations

import torch

from infra import layout
from infra.spec import RunSpec
from training.mixing import weighted_mean


def consolidate(spec: RunSpec, store) -> dict:
    """Token-weighted mean of the learners' final weights, written to the store as the run's model.

    A learner without a final-round checkpoint (it rejoined from a peer after the peers had
    finished) is left out and named. Consensus is reported before averaging: each learner's
    distance to the mean, relative to the mean's norm; in `allreduce` mode it is 0.
    """
    final_round = spec.sync.rounds - 1
    weights, tokens, included, missing = [], [], [], []
    for slot in spec.learners:
        key = layout.checkpoint(slot.index, final_round)
        if not store.is_committed(key):
            missing.append(slot.index)
            continue
        tensors, _, _ = store.read_committed(key)
        weights.append(tensors["weights"])
        tokens.append(slot.tokens_per_round() * spec.sync.rounds)
        included.append(slot.index)
    if not weights:
        raise RuntimeError(f"no learner committed a checkpoint for the final round {final_round}")
    mean = weighted_mean(weights, tokens)
    norm = mean.norm().item()
    distances = [((w - mean).norm().item() / norm) for w in weights]
    pairwise = max((torch.dist(a, b).item() / norm for i, a in enumerate(weights) for b in weights[i + 1:]),
                   default=0.0)
    consensus = {"max_weight_distance": max(distances), "mean_weight_distance": sum(distances) / len(distances),
                 "max_pairwise_distance": pairwise, "per_learner": dict(zip(map(str, included), distances)),
                 "learners_without_final_checkpoint": missing}
    store.commit_tensors(layout.CONSOLIDATED, {"weights": mean}, {"tokens": sum(tokens), "consensus": consensus})
    return consensus
