"""The end of an islands run: one model from all learners, and how far apart they had drifted."""

from __future__ import annotations

import torch

from infra import layout
from infra.derived import commit_derived
from infra.spec import RunSpec
from infra.store import IntegrityError
from infra.stores import RunStores
from training.exchange.mixing import weighted_mean


def consolidate(spec: RunSpec, store) -> dict:
    """Token-weighted mean of the learners' final weights (each read from its island's store), written to
    the run's store as the run's model.

    A learner without a final-round checkpoint (it rejoined from a peer after the peers had
    finished) is left out and named, and so is one whose final checkpoint is corrupt: no retry
    would read it intact. Consensus is reported before averaging: each learner's
    distance to the mean, relative to the mean's norm; in `allreduce` mode it is 0.
    """
    final_round = spec.sync.rounds - 1
    stores = RunStores(spec, store)
    weights, tokens, included, missing, corrupt = [], [], [], [], []
    for slot in spec.learners:
        key = layout.checkpoint(slot.index, final_round)
        if not stores.learner(slot.index).is_committed(key):
            missing.append(slot.index)
            continue
        try:
            tensors, _, _ = stores.learner(slot.index).read_committed(key)
        except IntegrityError:
            corrupt.append(slot.index)
            continue
        weights.append(tensors["weights"])
        tokens.append(slot.tokens_per_round() * spec.sync.rounds)
        included.append(slot.index)
    if not weights:
        raise RuntimeError(f"no learner committed an intact checkpoint for the final round ({spec.sync.rounds}) "
                           f"(missing: learners {missing}; corrupt: learners {corrupt})")
    mean = weighted_mean(weights, tokens)
    norm = mean.norm().item()
    distances = [((w - mean).norm().item() / norm) for w in weights]
    pairwise = max((torch.dist(a, b).item() / norm for i, a in enumerate(weights) for b in weights[i + 1:]),
                   default=0.0)
    consensus = {"max_weight_distance": max(distances), "mean_weight_distance": sum(distances) / len(distances),
                 "max_pairwise_distance": pairwise, "per_learner": dict(zip(map(str, included), distances)),
                 "learners_without_final_checkpoint": missing, "learners_with_corrupt_final_checkpoint": corrupt}
    commit_derived(store, layout.CONSOLIDATED, {"weights": mean}, {"tokens": sum(tokens), "consensus": consensus})
    return consensus
