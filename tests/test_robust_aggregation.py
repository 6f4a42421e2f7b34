"""A compromised island's own objects, signed with its own valid key, do not take the run: final states
that are not finite or lie far from the others are left out of the consolidated model, and a peer's
messages inside every fixed bound are clipped to what the pair agreed and to the peer's recent steps."""

import pytest
import torch

from infra import layout
from infra.authority import CONTROL
from training.consolidate import consolidate
from training.learner.ledger import LearnerSummary, write_summary
from training.model.params import flat_parameters
from training.model.registry import build_model, load_model
from tests.test_security_authority import signed_run  # noqa: F401 - the fixture


def commit_final(spec, store, learner: int, weights: torch.Tensor, round_index: int | None = None) -> None:
    """What a learner's island writes at the end, signed with that island's key: a checkpoint of
    `weights` and a summary that names it."""
    key = layout.checkpoint(learner, spec.sync.rounds - 1 if round_index is None else round_index)
    store.commit_tensors(key, {"weights": weights}, {"round": spec.sync.rounds - 1})
    sha = store.get_json(f"{key}.json")["tensors"]["sha256"]
    write_summary(store, spec, LearnerSummary(learner=learner, island=spec.learners[learner].island.name,
                                              final_checkpoint={"key": key, "sha256": sha}))


@pytest.mark.parametrize("planted", [float("nan"), 1e30], ids=["nan", "1e30"])
def test_a_final_state_signed_by_its_own_island_that_is_not_finite_or_huge_is_dropped_and_named(
        signed_run, planted, caplog):  # noqa: F811
    """Before, consolidation took the plain mean: a NaN model, or one of 5e29."""
    spec, store_of = signed_run
    honest = flat_parameters(build_model(spec)) + 0.01
    commit_final(spec, store_of("a"), 0, honest)
    commit_final(spec, store_of("b"), 1, torch.full_like(honest, planted))

    consensus = consolidate(spec, store_of(CONTROL))

    assert list(consensus["learners_dropped"]) == ["1"] and list(consensus["per_learner"]) == ["0"]
    model = flat_parameters(load_model(spec, store_of(CONTROL), layout.CONSOLIDATED)[0])
    assert bool(torch.isfinite(model).all()) and torch.equal(model, honest)
    assert "consolidation leaves out learner 1" in caplog.text


def test_consolidation_reads_the_checkpoint_the_summary_names(signed_run):  # noqa: F811
    """The final round's key holds other weights than the checkpoint learner 1's summary names (an
    earlier round's): the named one is averaged."""
    spec, store_of = signed_run
    base = flat_parameters(build_model(spec))
    commit_final(spec, store_of("a"), 0, base)
    commit_final(spec, store_of("b"), 1, base + 0.02, round_index=spec.sync.rounds - 2)
    store_of("b").commit_tensors(layout.checkpoint(1, spec.sync.rounds - 1), {"weights": base + 5.0}, {})

    consolidate(spec, store_of(CONTROL))

    model = flat_parameters(load_model(spec, store_of(CONTROL), layout.CONSOLIDATED)[0])
    assert torch.allclose(model, base + 0.01)
