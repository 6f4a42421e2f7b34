"""The sparse mixture-of-experts feed-forward: top-k routing, its balance loss, parameter counts."""

import pytest
import torch

from training.model.gpt import MoE, ByteGPT, GPTConfig

WIDTH, EXPERTS = 16, 4


def moe(top_k: int) -> MoE:
    torch.manual_seed(0)
    return MoE(GPTConfig(layers=1, width=WIDTH, heads=2, max_seq_len=8, experts=EXPERTS, top_k=top_k))


@pytest.mark.parametrize("top_k", [1, 2])
def test_each_token_is_the_router_weighted_sum_of_exactly_its_top_k_experts(top_k):
    layer = moe(top_k)
    x = torch.randn(3, 5, WIDTH)
    out = layer(x).reshape(-1, WIDTH)
    tokens = x.reshape(-1, WIDTH)
    probs = layer.router(tokens).softmax(dim=-1)
    for row in range(len(tokens)):
        chosen = probs[row].argsort(descending=True)[:top_k]
        weights = probs[row, chosen] / (probs[row, chosen].sum() if top_k > 1 else 1)
        expected = sum(w * layer.experts[int(e)](tokens[row]) for w, e in zip(weights, chosen))
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-6)
        # Experts outside the top k do not contribute: with one of them instead the output differs.
        other = next(e for e in range(EXPERTS) if e not in chosen.tolist())
        assert not torch.allclose(out[row], layer.experts[other](tokens[row]), atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_router_learns_from_the_language_model_loss(top_k):
    layer = moe(top_k)
    layer(torch.randn(3, 5, WIDTH)).square().sum().backward()  # the task loss only, no balance term
    router, expert = layer.router.weight.grad.abs().sum(), layer.experts[0].up.weight.grad.abs().sum()
    # A gate renormalised to exactly 1 leaves only rounding noise (about 1e-7 of the experts' gradient).
    assert router > 0.01 * expert


def test_balance_loss_is_lowest_for_balanced_routing():
    layer = moe(1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :EXPERTS] = 10 * torch.eye(EXPERTS)  # basis vector e routes to expert e
    basis = torch.eye(EXPERTS, WIDTH)
    with torch.no_grad():
        layer(basis.repeat(16, 1))  # 16 tokens per expert
        balanced = float(layer.aux_loss)
        layer(basis[:1].repeat(64, 1))  # every token to expert 0
        collapsed = float(layer.aux_loss)
    # Switch loss: experts * sum_e fraction_e * mean_prob_e; 1 when balanced, the number of experts when collapsed.
    assert balanced == pytest.approx(1.0, abs=1e-2)
    assert collapsed == pytest.approx(EXPERTS, rel=1e-2)


def test_active_parameters_count_top_k_experts_only():
    dense = ByteGPT(GPTConfig(layers=2, width=32, heads=4, max_seq_len=16))
    sparse = ByteGPT(GPTConfig(layers=2, width=32, heads=4, max_seq_len=16, experts=4, top_k=1))
    counts = sparse.parameter_counts()
    per_expert = 2 * 32 * 4 * 32
    assert counts["total"] == sum(p.numel() for p in sparse.parameters())
    assert counts["total"] - counts["active"] == 2 * 3 * per_expert
    # Active parameters of a top-1 MoE are the dense model's plus the routers.
    assert counts["active"] == dense.parameter_counts()["active"] + 2 * 32 * 4
