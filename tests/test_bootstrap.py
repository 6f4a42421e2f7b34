import numpy as np
import pytest

from eval.bootstrap import paired_bootstrap


def documents(count=400, seed=1):
    rng = np.random.default_rng(seed)
    nbytes = rng.integers(200, 5000, size=count).astype(float)
    bits = nbytes * rng.uniform(1.5, 3.5, size=count)  # documents differ in difficulty
    return bits, nbytes


def test_identical_models_differ_by_exactly_zero():
    """Pairing: the same resampled documents for both, so equal losses give [0, 0] whatever the spread."""
    bits, nbytes = documents()
    result = paired_bootstrap(bits, bits, nbytes)
    assert (result.low, result.relative, result.high) == (0, 0, 0)
    assert result.bpb_a == result.bpb_b == pytest.approx(bits.sum() / nbytes.sum())


def test_a_model_uniformly_ten_percent_worse_is_ten_percent_worse_in_every_resample():
    bits, nbytes = documents()
    result = paired_bootstrap(1.1 * bits, bits, nbytes)
    assert result.low == pytest.approx(0.1, abs=1e-12) and result.high == pytest.approx(0.1, abs=1e-12)
    assert result.relative == pytest.approx(0.1, abs=1e-12)


def test_interval_matches_the_delta_method_normal_approximation():
    """Noisy per-document differences: the percentile interval agrees with the closed-form
    (linearised ratio) standard error, R - 1 +- 1.96 sqrt(n var(a - R b)) / sum(b)."""
    bits_b, nbytes = documents()
    rng = np.random.default_rng(2)
    bits_a = bits_b * rng.normal(1.03, 0.1, size=len(bits_b))
    result = paired_bootstrap(bits_a, bits_b, nbytes, resamples=20_000)
    ratio = bits_a.sum() / bits_b.sum()
    standard_error = np.sqrt(len(bits_b) * np.var(bits_a - ratio * bits_b)) / bits_b.sum()
    expected_low, expected_high = ratio - 1 - 1.96 * standard_error, ratio - 1 + 1.96 * standard_error
    width = expected_high - expected_low
    assert 0 < result.low < result.relative < result.high
    assert result.low == pytest.approx(expected_low, abs=0.05 * width)
    assert result.high == pytest.approx(expected_high, abs=0.05 * width)


def test_the_generator_seed_fixes_the_interval():
    bits_b, nbytes = documents()
    bits_a = bits_b * np.random.default_rng(3).normal(1.0, 0.2, size=len(bits_b))
    first = paired_bootstrap(bits_a, bits_b, nbytes, seed=7)
    assert paired_bootstrap(bits_a, bits_b, nbytes, seed=7) == first
    assert paired_bootstrap(bits_a, bits_b, nbytes, seed=8) != first


@pytest.mark.parametrize("bits_a, bits_b, nbytes, named", [
    ([1.0, 2.0], [1.0], [10, 10], "one entry per document"),
    ([], [], [], "bits_a must be a non-empty"),
    ([1.0, float("nan")], [1.0, 1.0], [10, 10], "bits_a must hold finite"),
    ([1.0, 1.0], [1.0, 1.0], [10, -1], "nbytes must hold finite numbers >= 0"),
    ([1.0, 1.0], [0.0, 0.0], [10, 10], "bits_b and nbytes must not sum to 0"),
])
def test_malformed_losses_are_refused_naming_the_argument(bits_a, bits_b, nbytes, named):
    """Mismatched, empty, non-finite or negative inputs would give a silently wrong interval."""
    with pytest.raises(ValueError, match=named):
        paired_bootstrap(bits_a, bits_b, nbytes)
