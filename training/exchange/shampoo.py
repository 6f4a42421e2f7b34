"""Shampoo as the outer optimizer: pytorch-optimizer's `ScalableShampoo` with layer-wise grafting
(see `training.exchange.outer`), its inverse roots from a symmetric eigendecomposition. Imported only
where a run's outer optimizer is Shampoo."""

from __future__ import annotations

import torch
from pytorch_optimizer import ScalableShampoo
from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting
from pytorch_optimizer.optimizer.utils.preconditioner import PreConditioner

GRAFTS = {"sgd": LayerWiseGrafting.SGD, "adagrad": LayerWiseGrafting.ADAGRAD, "rmsprop": LayerWiseGrafting.RMSPROP}


def build_shampoo(params: list[torch.nn.Parameter], outer_spec) -> "SymmetricShampoo":
    shampoo = outer_spec.shampoo
    return SymmetricShampoo(
        params, lr=outer_spec.lr, betas=(outer_spec.momentum, shampoo.beta2),
        nesterov=outer_spec.momentum > 0, graft_type=GRAFTS[shampoo.graft],
        start_preconditioning_step=shampoo.start_preconditioning_step,
        preconditioning_compute_steps=shampoo.preconditioning_compute_steps,
        block_size=shampoo.block_size, matrix_eps=shampoo.matrix_eps,
        # Inverse roots by a decomposition (see SymmetricShampoo): the library's default
        # Schur-Newton iteration seeds a power iteration from the global RNG, so learners with
        # the same inputs and state (all of them in allreduce mode; a restored learner and its
        # uninterrupted self) would not land on bit-identical anchors.
        use_svd=True)


class SymmetricShampoo(ScalableShampoo):
    """ScalableShampoo whose inverse roots come from a symmetric eigendecomposition instead of an SVD.

    The statistics are symmetric (sums of G G^T), so with S = Q diag(l) Q^T the SVD's
    U diag(s^(-1/p)) V^T is Q diag(sign(l) |l|^(-1/p)) Q^T: the same matrix, from a decomposition
    that takes about 45% of the SVD's time on the brief's 512 x 512 blocks (11 ms against 25 ms
    on one core). Both are deterministic LAPACK routines, no RNG."""

    def init_group(self, group, **kwargs) -> None:
        super().init_group(group, **kwargs)
        for p in group["params"]:
            pre_conditioner = self.state.get(p, {}).get("pre_conditioner")
            if type(pre_conditioner) is PreConditioner:
                # The library builds its own class inline; ours differs only in one method and no data.
                pre_conditioner.__class__ = _SymmetricPreConditioner


class _SymmetricPreConditioner(PreConditioner):
    def compute_pre_conditioners(self) -> None:
        if self.is_same_shapes:  # the statistics are one stacked tensor: one batched decomposition
            self.pre_conditioners = symmetric_inverse_root(self.statistics, self.exponent_for_pre_conditioner)
            return
        for i, statistic in enumerate(self.statistics):
            self.pre_conditioners[i] = symmetric_inverse_root(statistic, self.exponent_for_pre_conditioner)


@torch.no_grad()
def symmetric_inverse_root(matrix: torch.Tensor, power: float) -> torch.Tensor:
    """matrix^(-1/power) of a symmetric matrix (or a batch), as an SVD-based root computes it:
    eigenvalues l enter as sign(l) |l|^(-1/power)."""
    dtype = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    values, vectors = torch.linalg.eigh(matrix.to(dtype))
    scaled = values.sign() * values.abs().pow(-1.0 / power)
    return ((vectors * scaled.unsqueeze(-2)) @ vectors.mT).to(matrix.dtype)


def init_shampoo_state(optimizer: torch.optim.Optimizer) -> None:
    """Let the library build its per-parameter state objects (preconditioners, grafts), to be overwritten."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
        optimizer.init_group(group)
        for p in group["params"]:
            p.grad = None
