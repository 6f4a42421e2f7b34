"""The end of an islands run: one model from all learners, and how far apart they had drifted."""

from __future__ import annotations

import logging

import torch

from infra import layout
from infra.derived import commit_derived
from infra.spec import RunSpec
from infra.store import IntegrityError, StoreError
from infra.stores import RunStores
from training.exchange.mixing import weighted_mean
from training.learner.ledger import read_summary
from training.learner.state import MAX_WEIGHT_GROWTH
from training.model.params import flat_parameters
from training.model.registry import initial_model

log = logging.getLogger(__name__)

# A final state is left out when it lies further from the coordinate-wise median of the final states
# (relative to the median's norm) than this many times the learners' median distance, plus the floor:
# honest learners that mixed lie within a small spread of each other (0 in allreduce mode, a few percent
# in butterfly mode), and the floor keeps that spread's noise from dropping anyone.
OUTLIER_FACTOR = 10.0
OUTLIER_FLOOR = 0.1


def consolidate(spec: RunSpec, store) -> dict:
    """Token-weighted mean of the final weights of the learners whose final states pass the checks
    below (each read from its island's store), written to the run's store as the run's model.

    A learner's final checkpoint is the one its signed summary names, by key and sha256 (a learner
    without a summary: its final round's). A learner without one is left out and named, and so is one
    whose final checkpoint is corrupt or is not the one its summary names. A learner's own valid key
    signs whatever that learner's island writes, so each final state is also checked against the
    others before it is averaged, and is dropped, named with the reason, when it is not finite, lies
    more than `MAX_WEIGHT_GROWTH` times the initial weights' norm from them (as a restart refuses it),
    or, with three or more states left, lies far from their coordinate-wise median (`OUTLIER_FACTOR`).
    The mean of the states that pass, rather than a median or a trimmed mean of all: with no bad state
    it is exactly the mean every honest run has had, and the checks leave out what would move it.
    Consensus is reported over the states averaged: each learner's distance to the mean, relative to
    the mean's norm; in `allreduce` mode it is 0.
    """
    stores = RunStores(spec, store)
    initial = flat_parameters(initial_model(spec, store))
    states, missing, corrupt, dropped = {}, [], [], {}
    for slot in spec.learners:
        learner_store = stores.learner(slot.index)
        key, sha = _final_checkpoint(spec, learner_store, slot.index)
        if not learner_store.is_committed(key):
            missing.append(slot.index)
            continue
        try:
            if sha is not None and learner_store.get_json(f"{key}.json").get("tensors", {}).get("sha256") != sha:
                raise IntegrityError(f"{key} is not the checkpoint learner {slot.index}'s summary names")
            weights = learner_store.read_committed(key)[0]["weights"]
        except (IntegrityError, KeyError, AttributeError):
            corrupt.append(slot.index)
            continue
        reason = _implausible(weights, initial)
        if reason:
            dropped[slot.index] = reason
        else:
            states[slot.index] = weights
    dropped.update(_outliers(states))
    for learner, reason in dropped.items():
        states.pop(learner, None)
        log.warning("consolidation leaves out learner %d: %s", learner, reason)
    if not states:
        raise RuntimeError(f"no learner committed an intact, plausible checkpoint for the final round "
                           f"({spec.sync.rounds}) (missing: learners {missing}; corrupt: learners {corrupt}; "
                           f"dropped: {dropped})")
    included, weights = list(states), list(states.values())
    tokens = [spec.learners[i].tokens_per_round() * spec.sync.rounds for i in included]
    mean = weighted_mean(weights, tokens)
    norm = mean.norm().item()
    distances = [((w - mean).norm().item() / norm) for w in weights]
    pairwise = max((torch.dist(a, b).item() / norm for i, a in enumerate(weights) for b in weights[i + 1:]),
                   default=0.0)
    consensus = {"max_weight_distance": max(distances), "mean_weight_distance": sum(distances) / len(distances),
                 "max_pairwise_distance": pairwise, "per_learner": dict(zip(map(str, included), distances)),
                 "learners_without_final_checkpoint": missing, "learners_with_corrupt_final_checkpoint": corrupt,
                 "learners_dropped": {str(i): reason for i, reason in sorted(dropped.items())}}
    commit_derived(store, layout.CONSOLIDATED, {"weights": mean}, {"tokens": sum(tokens), "consensus": consensus})
    return consensus


def _final_checkpoint(spec: RunSpec, learner_store, learner: int) -> tuple[str, str | None]:
    """The key of the learner's final checkpoint and the sha256 of its tensors, as its summary names
    them; without a summary, its final round's key and no sha256."""
    try:
        named = read_summary(learner_store, spec, learner).final_checkpoint
    except StoreError:
        named = None
    if isinstance(named, dict) and isinstance(named.get("key"), str) and isinstance(named.get("sha256"), str):
        return named["key"], named["sha256"]
    return layout.checkpoint(learner, spec.sync.rounds - 1), None


def _implausible(weights: torch.Tensor, initial: torch.Tensor) -> str | None:
    """Why a final state cannot be a trained model of this run, or None."""
    if weights.shape != initial.shape:
        return f"weights of shape {tuple(weights.shape)}, expected {tuple(initial.shape)}"
    if not bool(torch.isfinite(weights).all()):
        return "non-finite weights"
    if float((weights - initial).norm()) > MAX_WEIGHT_GROWTH * float(initial.norm()):
        return f"weights more than {MAX_WEIGHT_GROWTH:g} times the initial weights' norm from them"
    return None


def _outliers(states: dict[int, torch.Tensor]) -> dict[int, str]:
    """The states that lie far from the coordinate-wise median of them all, with the reason. Two states'
    median is their mean, which tells neither from the other: only three or more are compared."""
    if len(states) < 3:
        return {}
    median = torch.stack(list(states.values())).median(dim=0).values
    scale = max(float(median.norm()), 1e-12)
    distances = {i: float((w - median).norm()) / scale for i, w in states.items()}
    typical = sorted(distances.values())[(len(distances) - 1) // 2]
    limit = OUTLIER_FACTOR * typical + OUTLIER_FLOOR
    return {i: f"final weights lie {d:.3g} of the median's norm from the learners' median, beyond {limit:.3g}"
            for i, d in distances.items() if d > limit}
