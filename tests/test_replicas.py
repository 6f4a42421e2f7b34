"""The replica path (training/replicas.py) trains a run's learners as the learner path does: the same
rows, inner steps and exchanges give the same weights, to float rounding."""

import pytest
import torch

from infra.stores import RunStores
from tests.learners import run_both
from training.learner.loop import Learner
from training.model.params import flat_parameters
from training.model.registry import build_model
from training.replicas import NotReplicable, train_replicas

SYNCS = {
    "allreduce": {"mode": "allreduce", "outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
    "butterfly, int8, 2 fragments, tau 1": {"mode": "butterfly", "transport": {"compression": "int8", "fragments": 2,
                                                                              "tau": 1}},
    "hierarchical, shampoo": {"mode": "hierarchical", "inter_island_every": 2},
}


@pytest.mark.parametrize("sync", SYNCS, ids=list(SYNCS))
def test_replicas_end_where_the_learner_processes_end(two_learner_run, sync):
    learners_per_island = 2 if SYNCS[sync]["mode"] == "hierarchical" else 1
    spec, store = two_learner_run("replicas", layers=2, inner_steps=3, rounds=4, island={"learners": learners_per_island},
                                  **SYNCS[sync])
    learners = [Learner(spec, store, i) for i in range(len(spec.learners))]
    run_both(learners)
    expected = [flat_parameters(learner.model) for learner in learners]

    rounds = []
    replicas = train_replicas(spec, RunStores(spec, store), progress=rounds.append)

    assert [r["round"] for r in rounds] == list(range(spec.sync.rounds))
    assert len(replicas) == len(expected)
    for replica, learner in zip(replicas, expected):
        torch.testing.assert_close(replica, learner, rtol=0, atol=1e-4)
    moved = (expected[0] - flat_parameters(build_model(spec))).abs().max()
    assert moved > 1e-2  # training moved the weights far beyond the tolerance


@pytest.mark.parametrize("change, named", [({"island": {"precision": "bf16"}}, "fp32 CPU"),
                                           ({"model": {"layers": 2, "width": 16, "heads": 2,
                                                       "moe": {"experts": 2, "top_k": 1}}}, "dense")])
def test_a_run_the_replicas_cannot_train_as_its_learners_is_refused_by_name(two_learner_run, change, named):
    spec, store = two_learner_run("refused", layers=2, inner_steps=1, rounds=1, **change)
    with pytest.raises(NotReplicable, match=named):
        train_replicas(spec, RunStores(spec, store))
