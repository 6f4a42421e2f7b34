import pytest
import torch

from training.exchange.mixing import butterfly_partner, mix_pair, stage_count, weighted_mean


def butterfly_average(values: list[torch.Tensor], stages: int | None = None) -> list[torch.Tensor]:
    """`stages` stages of the butterfly's pairwise averaging over N values with no training in between:
    the mixing network alone, which the tests below pin down through `butterfly_partner`."""
    n = len(values)
    current = [v.clone() for v in values]
    for stage in range(stage_count(n) if stages is None else stages):
        nxt = []
        for i in range(n):
            partner = butterfly_partner(i, stage, n)
            nxt.append(current[i] if partner is None else weighted_mean(
                [current[min(i, partner)], current[max(i, partner)]], [1.0, 1.0]))
        current = nxt
    return current


@pytest.mark.parametrize("n", [2, 4, 8])
def test_butterfly_stages_reach_the_exact_mean(n):
    values = [torch.randn(1000, dtype=torch.float64) for _ in range(n)]
    mean = torch.stack(values).mean(dim=0)
    mixed = butterfly_average(values)
    assert stage_count(n) == {2: 1, 4: 2, 8: 3}[n]
    for v in mixed:
        torch.testing.assert_close(v, mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [4, 8])
def test_fewer_stages_than_log2_n_do_not_reach_the_mean(n):
    values = [torch.full((3,), float(i)) for i in range(n)]
    mixed = butterfly_average(values, stages=stage_count(n) - 1)
    assert not all(torch.allclose(v, torch.full((3,), (n - 1) / 2)) for v in mixed)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pairing_is_i_xor_2_to_the_stage_and_symmetric(n):
    for t in range(3 * stage_count(n)):
        for i in range(n):
            partner = butterfly_partner(i, t, n)
            assert partner == i ^ (1 << (t % stage_count(n)))
            assert butterfly_partner(partner, t, n) == i


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_non_power_of_two_pairs_are_symmetric_and_spread_information(n):
    rounds = 2 * stage_count(n)
    reached = [{i} for i in range(n)]
    for t in range(rounds):
        partners = [butterfly_partner(i, t, n) for i in range(n)]
        for i, p in enumerate(partners):
            if p is not None:
                assert 0 <= p < n and partners[p] == i
        reached = [reached[i] | (reached[p] if p is not None else set()) for i, p in enumerate(partners)]
    assert all(r == set(range(n)) for r in reached)


def test_mix_pair_agrees_bitwise_for_both_partners_and_weights_tokens():
    a_anchor, a_delta = torch.randn(50), torch.randn(50)
    b_anchor, b_delta = torch.randn(50), torch.randn(50)
    left = mix_pair(a_anchor, a_delta, 300, b_anchor, b_delta, 100, own_index=0, partner_index=1)
    right = mix_pair(b_anchor, b_delta, 100, a_anchor, a_delta, 300, own_index=1, partner_index=0)
    assert torch.equal(left[0], right[0]) and torch.equal(left[1], right[1])
    torch.testing.assert_close(left[0], (a_anchor + b_anchor) / 2)
    torch.testing.assert_close(left[1], 0.75 * a_delta + 0.25 * b_delta)


def test_weighted_mean_weights_each_learner_by_the_tokens_it_processed():
    # The all-reduce path: three learners from islands with different batch sizes and inner steps.
    deltas = [torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((4,), 4.0)]
    tokens = [8 * 20 * 128, 16 * 10 * 128, 32 * 5 * 128 * 2]
    mixed = weighted_mean(deltas, tokens)
    torch.testing.assert_close(mixed, torch.full((4,), (1 * 1 + 2 * 1 + 4 * 2) / 4))
    assert not torch.allclose(mixed, torch.stack(deltas).mean(dim=0))


def test_partner_wait_is_bounded_by_a_round_of_own_compute_when_asked():
    from infra.spec.sync import SyncSpec
    from training.exchange.plan import partner_wait_s

    assert partner_wait_s(SyncSpec(rounds=3, partner_timeout_s=600), 12.0) is None  # per-peer timeout as before
    bounded = SyncSpec(rounds=3, partner_timeout_s=600, partner_wait_rounds=1.0)
    assert partner_wait_s(bounded, 12.0) == 12.0
    assert partner_wait_s(bounded, 5000.0) == 600  # never past the hard timeout
