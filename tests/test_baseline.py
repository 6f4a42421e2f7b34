"""Standard training as data parallelism over ranks (one per island) is the single-process baseline:
the same steps on the same rows, gradients summed by a real gloo all-reduce between OS processes."""

from __future__ import annotations

import socket
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infra import layout
from infra.derived import read_derived
from infra.store import ObjectStore
from infra.spec import parse_spec
from training.baseline import BaselinePlan, DataParallelRank, all_reduce_gradients, train_baseline
from training.model.registry import build_model
from training.model.params import flat_parameters


def rank_main(rank: int, port: int, spec, store_url: str, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        island = spec.islands[rank].name
        mine = [slot.index for slot in spec.learners if slot.island.name == island]
        train_baseline(spec, ObjectStore(store_url).child("runs/dp"), rank=DataParallelRank(
            mine, all_reduce_gradients, commits=rank == 0))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_summing_gradients_train_the_single_process_baseline(two_learner_run, tmp_path):
    spec, single = two_learner_run("dp", layers=1, inner_steps=2, rounds=3)
    parallel = ObjectStore(spec.store.url).child("runs/dp")
    for key in [layout.SPEC, layout.DATA_MANIFEST, *single.list("data")]:
        parallel.put_bytes(key, single.get_bytes(key))

    expected = train_baseline(spec, single)
    mp.spawn(rank_main, args=(free_port(), spec, spec.store.url, 2), nprocs=2, join=True)

    weights, meta, _ = read_derived(parallel, layout.BASELINE)
    reference, reference_meta, _ = read_derived(single, layout.BASELINE)
    assert meta["tokens"] == reference_meta["tokens"] == expected["tokens"] > 0
    assert meta["steps"] == expected["steps"]
    # The same sum in another order: equal up to float rounding, and far from the initial weights.
    assert torch.allclose(weights["weights"], reference["weights"], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(weights["weights"], flat_parameters(build_model(spec)), atol=1e-4)


@pytest.mark.parametrize("global_batch", [3, 5, 12, 19])
def test_every_step_holds_the_global_batch_drawn_from_the_shards_in_proportion(global_batch):
    """Fewer rows a step than shards, or a batch the shards do not divide, still gives every step the
    global batch (the last what remains) and every shard exactly its learner's rows."""
    spec = parse_spec({
        "name": "plan", "seed": 0,
        "islands": [{"name": "east", "learners": 3, "batch_size": 4, "seq_len": 16, "inner_steps": 3},
                    {"name": "west", "learners": 2, "batch_size": 2, "seq_len": 16, "inner_steps": 2}],
        "model": {"layers": 1, "width": 16, "heads": 2},
        "data": {"corpora": [{"name": "text", "source": "files", "paths": ["unused/*.txt"]}]},
        "sync": {"mode": "allreduce", "rounds": 7},
        "baseline": {"global_batch": global_batch},
    })
    plan = BaselinePlan.of(spec)
    rows = np.array([plan.step_rows(step) for step in range(plan.steps)])
    total = sum(plan.planned_rows)
    assert rows.sum(axis=1)[:-1].tolist() == [global_batch] * (plan.steps - 1)
    assert rows.sum(axis=1)[-1] == total - global_batch * (plan.steps - 1)
    assert rows.sum(axis=0).tolist() == plan.planned_rows
    # At every step so far each shard has given its share of the rows taken, to within a row.
    taken = np.cumsum(rows, axis=0)
    share = np.outer(taken.sum(axis=1), plan.planned_rows) / total
    assert np.abs(taken - share).max() <= 1
    assert plan.step_tokens(0) == [r * 16 for r in plan.step_rows(0)]
