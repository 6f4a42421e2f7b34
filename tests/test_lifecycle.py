"""The whole lifecycle, end to end: real SeaweedFS, real Prefect API, learners as real processes."""

import math

import pytest

from infra import layout
from infra.spec import parse_spec
from infra.store import run_store

TINY = {
    "name": "e2e",
    "islands": [
        {"name": "east", "learners": 2, "batch_size": 4, "seq_len": 32, "inner_steps": 3},
        {"name": "west", "learners": 1, "batch_size": 4, "seq_len": 32, "inner_steps": 2,
         "processes_per_learner": 2},
    ],
    "model": {"layers": 1, "width": 32, "heads": 2},
    "data": {"corpora": [
        {"name": "prose", "source": "shakespeare", "max_documents": 8, "eval_fraction": 0.2,
         "max_eval_bytes": 20000},
        {"name": "code", "source": "python_stdlib", "max_documents": 24, "eval_fraction": 0.2,
         "max_eval_bytes": 20000},
    ]},
    "training": {"warmup_steps": 2},
    "sync": {"mode": "butterfly", "rounds": 4, "partner_timeout_s": 60},
    "store": {"url": "s3://archipelago/e2e"},
}


@pytest.mark.parametrize("mode", ["butterfly", "allreduce"])
def test_lifecycle_on_s3_with_a_torchrun_learner(mode, s3_env, prefect_api):
    from flows.lifecycle import run_lifecycle
    from training.stages import new_run_id

    # Every message is kept (keep_checkpoints empty): the byte counts below are recomputed from them. Every
    # learner takes the whole outer step, so each reads its peers' round messages (test_sharded_outer.py
    # counts a sharded step's reads).
    spec = parse_spec({**TINY, "training": {**TINY["training"], "keep_checkpoints": None},
                       "sync": {**TINY["sync"], "mode": mode, "shard_outer_step": False}})
    report = run_lifecycle(spec, new_run_id(spec))

    assert set(report["evals"]) == {"prose", "code"}
    for scores in report["evals"].values():
        assert 0 < scores["islands_bpb"] < 8 and 0 < scores["baseline_bpb"] < 8
    assert report["compute"]["islands_tokens"] == report["compute"]["baseline_tokens"] == (2 * 4 * 32 * 3 + 4 * 32 * 2) * 4
    store = run_store(spec.store, report["run_id"])
    summaries = [store.get_json(layout.learner_summary(i)) for i in range(3)]
    assert [s["processes"] for s in summaries] == [1, 1, 2]

    # Byte counts, recomputed from the objects themselves: every message read, classified by link.
    expected = {"intra": 0, "inter": 0}
    for t in range(spec.sync.rounds):
        for reader in range(3):
            if mode == "butterfly":
                peers = [p for p in [reader ^ (1 << (t % 2))] if p < 3]
            else:
                peers = [p for p in range(3) if p != reader]
            for peer in peers:
                key = layout.message(peer, t)
                size = len(store.get_bytes(f"{key}.json")) + len(store.get_bytes(f"{key}.safetensors"))
                link = "intra" if spec.learners[peer].island.name == spec.learners[reader].island.name else "inter"
                expected[link] += size
    comm = report["communication"]
    assert comm["inter_island_bytes"] == expected["inter"] > 0
    assert comm["intra_island_bytes"] == expected["intra"]
    assert comm["allreduce_equivalent_bytes"] > comm["inter_island_bytes"]
    if mode == "allreduce":
        assert report["consensus"]["max_weight_distance"] == 0
    else:
        assert 0 < report["consensus"]["max_weight_distance"] < 0.5
    assert math.isfinite(report["wall_seconds"]) and store.exists(layout.REPORT)
