"""Comparison metrics: llama-perplexity's KL statistics and their definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qllama.measure import metrics


def test_identical_logits_give_zero_divergence():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 100)).astype(np.float32)
    s = metrics.kl_stats(logits, logits, rng.integers(0, 100, 50))
    assert abs(s.mean_kld) < 1e-12 and s.same_top == 1.0 and s.rms_dp == 0.0
    assert s.ppl_test == s.ppl_ref


@settings(max_examples=30, deadline=None)
@given(shift=st.floats(-50, 50), seed=st.integers(0, 1000))
def test_kld_ignores_a_constant_shift_and_is_non_negative(shift, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((20, 30)) * 3
    b = a + rng.standard_normal((20, 30)) * 0.3
    tokens = rng.integers(0, 30, 20)
    s1, s2 = metrics.kl_stats(a, b, tokens), metrics.kl_stats(a, b + shift, tokens)
    assert s1.mean_kld >= -1e-12
    assert abs(s1.mean_kld - s2.mean_kld) < 1e-9


@settings(max_examples=30, deadline=None)
# a target at the row's maximum whose sum of exponentials is 1.0: -0.0, not +0.0
@example(rows=33, vocab=2, block=1, scale=14.0, seed=0)
@given(
    rows=st.integers(1, 40),
    vocab=st.integers(2, 300),
    block=st.integers(1, 5000),
    scale=st.floats(0.1, 60),
    seed=st.integers(0, 1000),
)
# a target at the row's maximum whose sum of exponentials is 1.0: -0.0, not +0.0
@example(rows=33, vocab=2, block=1, scale=14.0, seed=0)
def test_nll_is_the_log_softmax_entry_bit_for_bit(rows, vocab, block, scale, seed):
    """Rows in blocks of any size, without the whole log-softmax: the same float64 values."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    targets = rng.integers(0, vocab, rows)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics, "NLL_BLOCK_BYTES", block)
        got = metrics.nll(logits, targets)
    want = -metrics.log_softmax(logits)[np.arange(rows), targets]
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


def test_llama_cpp_definitions():
    x = np.arange(11, dtype=np.float64)
    assert metrics.percentile(x, 50) == 5.0 and metrics.percentile(x, 95) == 9.5
    assert metrics.uncertainty(np.ones(10)) == 0.0  # ten values or fewer: no uncertainty
    y = np.array([0.0, 1.0] * 10)
    assert abs(metrics.uncertainty(y) - np.sqrt(0.25 / 19)) < 1e-12


def test_margin_and_top_k():
    row = np.array([1.0, 5.0, 4.5, -2.0])
    assert metrics.margin(row[None])[0] == 0.5
    assert metrics.top_k(row, 2) == [(1, 5.0), (2, 4.5)]


def test_format_has_llama_perplexity_sections():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((40, 10))
    text = metrics.format_kl_stats(
        metrics.kl_stats(a, a + 0.1 * rng.standard_normal(a.shape), np.zeros(40, int))
    )
    for line in (
        "====== KL divergence statistics ======",
        "Mean    KLD:",
        "99.9%   KLD:",  # llama-perplexity's labels, spaces and all
        "Median  KLD:",
        "RMS Δp",
        "Same top p",
    ):
        assert line in text


def test_rounding_spread_is_zero_without_rounding_differences():
    a = np.random.default_rng(0).exponential(0.004, 1000)
    spread = metrics.rounding_spread(a, a.copy())
    assert set(spread) == {"mean", "max", "median", "min"} | {
        f"{f:g}%" for f in metrics.KLD_PERCENTILES if f != 50
    }
    assert all(v == 0.0 for v in spread.values())


@settings(deadline=None, max_examples=20)
@given(st.integers(0, 2**31), st.floats(1e-4, 1e-1))
def test_rounding_spread_of_the_mean(seed, scale):
    """The mean's line moves by mean(d) over the resampled positions: its root mean square
    over the resamples is sqrt(mean(d)^2 + var(d) / n) in expectation; over 400 of them the
    estimate is within a few of its standard errors."""
    rng = np.random.default_rng(seed)
    a = rng.exponential(0.004, 500)
    d = (rng.standard_normal(500) + 0.5) * scale * a
    got = metrics.rounding_spread(a, a + d, draws=400, seed=seed)["mean"]
    want = np.sqrt(d.mean() ** 2 + d.var() / d.size)
    # a mean square over 400 draws: relative sd at most sqrt(2/400) = 7% (chi-square)
    assert abs(got * got / (want * want) - 1) < 5 * np.sqrt(2 / 400)


def test_rounding_spread_of_a_percentile_follows_the_values_near_it():
    """Values that differ only in the bottom tenth, by less than their gaps to the values
    above, leave the median and the upper percentiles where they are."""
    a = np.linspace(0.0, 1.0, 1001)
    b = a.copy()
    b[:100] += 1e-4  # only the bottom tenth differs
    spread = metrics.rounding_spread(a, b)
    assert spread["median"] == spread["90%"] == spread["max"] == 0.0
    assert 0.0 < spread["5%"] < 2e-4 and 0.0 < spread["min"] < 2e-4


def test_rounding_spread_refuses_values_of_other_shapes():
    import pytest

    with pytest.raises(ValueError, match="one shape"):
        metrics.rounding_spread(np.zeros(3), np.zeros(4))


def test_an_uncertainty_that_is_not_computed_says_so():
    # llama.cpp computes no standard error of ten values or fewer: a 0 there is no measurement
    assert metrics.plus_minus(1.5e-3, 0.0, 10) == "1.500e-03 (± not computed: 10 values)"
    assert metrics.plus_minus(1.5e-3, 2e-4, 11) == "1.500e-03 ± 2.0e-04"
    rng = np.random.default_rng(2)
    for n, noted in ((8, True), (40, False)):
        a = rng.standard_normal((n, 10))
        text = metrics.format_kl_stats(metrics.kl_stats(a, a + 0.1, np.zeros(n, int)))
        assert (metrics.UNCERTAINTY_NOTE in text) == noted
