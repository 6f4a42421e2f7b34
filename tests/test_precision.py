"""bf16 inner steps: autocast arithmetic on fp32 weights, so what learners store and send keeps its kind."""

import pytest
import torch

from infra import layout
from infra.spec import parse_spec
from tests.learners import run_both
from training.model.inner import forward_precision
from training.learner.loop import Learner
from training.model.registry import build_model
from training.model.params import flat_parameters


@pytest.mark.parametrize("moe", [None, {"experts": 4, "top_k": 2}], ids=["dense", "moe"])
def test_bf16_forward_runs_in_bf16_and_stays_close_to_fp32(moe):
    spec = parse_spec({"islands": [{"name": "a", "learners": 1, "batch_size": 2, "seq_len": 16, "inner_steps": 1}],
                       "model": {"layers": 2, "width": 32, "heads": 2, "moe": moe},
                       "data": {"corpora": [{"name": "c", "source": "files", "paths": ["x"]}]},
                       "sync": {"rounds": 1}})
    model = build_model(spec)
    data = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    with forward_precision(cpu, "fp32"):
        full = model.loss(data[:, :-1], data[:, 1:])
    with forward_precision(cpu, "bf16"):
        logits_dtype = torch.matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype
        half = model.loss(data[:, :-1], data[:, 1:])
    assert logits_dtype == torch.bfloat16
    assert full.dtype == torch.float32
    assert half.item() != full.item()
    assert abs(half.item() - full.item()) / full.item() < 0.02
    half.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_learners_in_bf16_train_together_and_store_fp32(two_learner_run):
    spec, store = two_learner_run("bf16", layers=2, inner_steps=3, rounds=2, island={"precision": "bf16"})
    learners = [Learner(spec, store, i) for i in range(2)]
    run_both(learners)
    assert all(learner.ledger.missed_exchanges == [] for learner in learners)
    a, b = (flat_parameters(learner.model) for learner in learners)
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a, b)  # butterfly partners mix to the same weights
    tensors, _, _ = store.read_committed(layout.checkpoint(0, 1))
    assert {t.dtype for t in tensors.values()} <= {torch.float32, torch.int64}
