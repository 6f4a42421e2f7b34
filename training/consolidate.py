"""The end of an islands run: one model from all learners, and how far apart they had drifted."""

from __future__ import annotations

import torch

from infra import layout
from infra.spec import RunSpec
from training.mixing import weighted_mean


def consolidate(spec: RunSpec, store) -> dict:
    """Token-weighted mean of every learner's final weights, written to the store as the run's model.

    Consensus is reported before averaging: each learner's distance to the mean, relative to the
    mean's norm. In `allreduce` mode learners hold identical weights and the distance is 0.
    """
    final_round = spec.sync.rounds - 1
    weights, tokens = [], []
    for slot in spec.learners:
        tensors, _, _ = store.read_committed(layout.checkpoint(slot.index, final_round))
        weights.append(tensors["weights"])
        tokens.append(slot.tokens_per_round() * spec.sync.rounds)
    mean = weighted_mean(weights, tokens)
    norm = mean.norm().item()
    distances = [((w - mean).norm().item() / norm) for w in weights]
    pairwise = max((torch.dist(a, b).item() / norm for i, a in enumerate(weights) for b in weights[i + 1:]),
                   default=0.0)
    consensus = {"max_weight_distance": max(distances), "mean_weight_distance": sum(distances) / len(distances),
                 "max_pairwise_distance": pairwise, "per_learner": distances}
    store.commit_tensors(layout.CONSOLIDATED, {"weights": mean}, {"tokens": sum(tokens), "consensus": consensus})
    return consensus
