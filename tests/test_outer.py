"""Outer optimizers: flat interface over parameter shapes, grafting, exact state save and restore."""

import json

import pytest
import torch
from safetensors.torch import load, save

from infra.spec.sync import OuterOptimizerSpec
from training.exchange.outer import OuterOptimizer

# Matrices above the default block size (512 elements), which Shampoo would flatten into vectors.
SHAPES = [torch.Size([40, 24]), torch.Size([24]), torch.Size([16, 40])]
SIZE = sum(s.numel() for s in SHAPES)
SPECS = {
    "nesterov": OuterOptimizerSpec(name="nesterov", lr=0.7, momentum=0.9),
    "shampoo": OuterOptimizerSpec(name="shampoo", lr=0.7, momentum=0.9,
                                  shampoo={"graft": "rmsprop", "beta2": 0.99, "start_preconditioning_step": 2}),
}


def rounds(optimizer: OuterOptimizer, anchor: torch.Tensor, seeds) -> torch.Tensor:
    for seed in seeds:
        anchor = optimizer.step(anchor, torch.randn(SIZE, generator=torch.Generator().manual_seed(seed)) * 0.01)
    return anchor


@pytest.mark.parametrize("name", sorted(SPECS))
def test_state_round_trips_through_safetensors_and_json(name):
    spec = SPECS[name]
    original = OuterOptimizer.from_spec(spec, SHAPES)
    anchor = rounds(original, torch.randn(SIZE, generator=torch.Generator().manual_seed(0)), range(1, 5))
    tensors, scalars = original.state()
    assert tensors, "momentum and preconditioner statistics must be saved"
    restored = OuterOptimizer.from_spec(spec, SHAPES)
    restored.load_state(load(save(tensors)), json.loads(json.dumps(scalars)))
    expected = rounds(original, anchor, [10, 11])
    got = rounds(restored, anchor, [10, 11])
    assert torch.equal(expected, got)
    # A fresh optimizer (no state) steps differently, so the comparison above has teeth.
    assert not torch.equal(rounds(OuterOptimizer.from_spec(spec, SHAPES), anchor, [10, 11]), expected)


@pytest.mark.parametrize("batch", [(), (3,)])
def test_the_symmetric_inverse_root_is_the_svd_s(batch):
    from pytorch_optimizer.optimizer.utils.matrix import compute_power_svd

    from training.exchange.shampoo import symmetric_inverse_root
    g = torch.randn(*batch, 48, 20, generator=torch.Generator().manual_seed(0))
    statistics = g @ g.mT + 1e-3 * torch.eye(48)  # rank-deficient before the ridge, as Shampoo's are
    root = symmetric_inverse_root(statistics, 4)
    # The library's SVD root in float64 is the reference; in float32 both roots are off it by rounding
    # (here 0.2% for this one, 0.6% for the SVD's).
    exact = compute_power_svd(statistics.double(), 4)
    assert (root.double() - exact).norm() < 0.01 * exact.norm()
    assert (root.double() - exact).norm() < 2 * (compute_power_svd(statistics, 4).double() - exact).norm()
    assert torch.equal(symmetric_inverse_root(statistics, 4), root)  # no RNG: the same bits every time


def test_plain_averaging_moves_the_anchor_by_the_pseudo_gradient():
    optimizer = OuterOptimizer.from_spec(OuterOptimizerSpec(name="nesterov", lr=1.0, momentum=0.0), SHAPES)
    anchor, delta = torch.randn(SIZE), torch.randn(SIZE)
    assert torch.allclose(optimizer.step(anchor, delta), anchor - delta)


def test_sgd_grafting_keeps_each_parameters_step_norm_and_turns_its_direction():
    spec = OuterOptimizerSpec(name="shampoo", lr=1.0, momentum=0.0, shampoo={"graft": "sgd", "start_preconditioning_step": 1})
    optimizer = OuterOptimizer.from_spec(spec, SHAPES)
    anchor = torch.randn(SIZE)
    # Anisotropic pseudo-gradients, so Shampoo's preconditioner is far from the identity.
    scale = torch.cat([torch.linspace(0.1, 3.0, s.numel()) for s in SHAPES])
    for seed in range(3):
        delta = torch.randn(SIZE, generator=torch.Generator().manual_seed(seed)) * scale
        step = anchor - optimizer.step(anchor, delta)
        for moved, wanted, shape in zip(step.split([s.numel() for s in SHAPES]), delta.split([s.numel() for s in SHAPES]), SHAPES):
            assert torch.isclose(moved.norm(), wanted.norm(), rtol=1e-4)
            if len(shape) == 2:
                assert not torch.allclose(moved, wanted, rtol=1e-2)  # Shampoo changed the direction
