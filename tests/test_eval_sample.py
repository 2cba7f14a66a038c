"""Evaluation on sampled clients (deltafl_jax.evaluation.sample): the draws, the order-statistic
intervals against a brute-force binomial and hand-computed cases, their coverage of the true
alpha-weighted percentiles of a known population, and the point estimates against
metrics.summarize."""

import math

import numpy as np
import pytest
from scipy import stats

from deltafl_jax.errors import ConfigError
from deltafl_jax.evaluation.metrics import percentiles, summarize
from deltafl_jax.evaluation.sample import (EvalSampler, interval_coverage, interval_of, lower_rank,
                                           quantile_interval_ranks, sample_eval_clients,
                                           summarize_sample)
from deltafl_jax.run.config import PERCENTILES


# --------------------------------------------------------------------------------------------
# (b) order-statistic ranks


def _brute_ranks(k, percent, confidence):
    """Equal-tailed ranks from the binomial pmf written with math.comb (no scipy)."""
    p, tail = percent / 100.0, (1.0 - confidence) / 2.0
    pmf = [math.comb(k, j) * p ** j * (1 - p) ** (k - j) for j in range(k + 1)]
    lo = 0
    for l in range(1, k + 1):           # P(B <= l - 1) <= tail
        if sum(pmf[:l]) <= tail:
            lo = l
    hi = k + 1
    for u in range(k, 0, -1):           # P(B >= u) <= tail
        if sum(pmf[u:]) <= tail:
            hi = u
    return lo, hi


def test_ranks_hand_computed():
    # k = 10, median: P(B <= 1) = 11/1024 <= 0.025 < P(B <= 2) = 56/1024, so l = 2 and by
    # symmetry u = 9: the textbook [X_(2), X_(9)], coverage 1 - 22/1024.
    assert quantile_interval_ranks(10, 50.0, 0.95) == (2, 9)
    assert interval_coverage(10, 2, 9, 50.0) == pytest.approx(1 - 22 / 1024)
    # k = 5: P(B = 0) = 1/32 > 0.025, no order statistic bounds the median at 95%.
    assert quantile_interval_ranks(5, 50.0, 0.95) == (0, 6)
    # k = 5 at 90%: 1/32 <= 0.05 gives [X_(1), X_(5)], coverage 1 - 2/32.
    assert quantile_interval_ranks(5, 50.0, 0.90) == (1, 5)
    assert interval_coverage(5, 1, 5, 50.0) == pytest.approx(1 - 2 / 32)


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_ranks_match_brute_force(confidence):
    for k in (1, 2, 3, 7, 10, 19, 40, 61):
        for p in PERCENTILES:
            lo, hi = quantile_interval_ranks(k, float(p), confidence)
            assert (lo, hi) == _brute_ranks(k, p, confidence), (k, p)
            if 1 <= lo and hi <= k:
                assert interval_coverage(k, lo, hi, p) >= confidence - 1e-12
                assert lo <= lower_rank(k, p) <= hi


def test_lower_rank_is_ceil():
    assert lower_rank(300, 10) == 30
    assert lower_rank(7, 50) == 4
    assert lower_rank(5, 20) == 1
    assert lower_rank(3, 0) == 1
    assert lower_rank(40, 95) == 38
    assert lower_rank(8, 12.5) == 1


def test_summarize_sample_small_hand_case():
    x = np.array([[7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 6.0, 4.0]])
    s = summarize_sample(x, x / 10, x, [50, 90])
    assert s["train_loss_p50"][0] == 5.0              # ceil(0.5 * 10) = 5th
    assert (s["train_loss_p50_lo"][0], s["train_loss_p50_hi"][0]) == (2.0, 9.0)
    assert s["train_loss_p90"][0] == 9.0
    # p = 90: P(B <= 6) = 0.0128 <= 0.025 < P(B <= 7) = 0.0702, so l = 7; P(B = 10) = 0.349
    # > 0.025: no upper bound.
    assert quantile_interval_ranks(10, 90.0) == (7, 11)
    assert s["train_loss_p90_lo"][0] == 7.0 and s["train_loss_p90_hi"][0] == np.inf
    assert s["test_error_p50_lo"][0] == pytest.approx(0.2)
    few = summarize_sample(x[:, :5], x[:, :5], x[:, :5], [50])
    assert few["test_error_p50_lo"][0] == -np.inf and few["test_error_p50_hi"][0] == np.inf
    se = x.std(ddof=1) / math.sqrt(10)
    assert s["train_loss_mean_hi"][0] - s["train_loss_mean"][0] == pytest.approx(
        stats.norm.ppf(0.975) * se)
    assert interval_of(s, "train_loss_p50") == (s["train_loss_p50_lo"], s["train_loss_p50_hi"])
    assert interval_of(s, "test_loss_mean") is None


# --------------------------------------------------------------------------------------------
# (d) point estimates vs metrics.summarize with equal sizes


def _lower_by_counting(row, p):
    """The smallest sample value v with #{x <= v} / k >= p / 100, in integer arithmetic."""
    k = row.size
    return min(v for v in row if 100 * np.count_nonzero(row <= v) >= p * k)


@pytest.mark.parametrize("k", [1, 7, 20, 33, 100, 300])
def test_point_estimates_match_summarize_with_equal_sizes(k):
    rng = np.random.default_rng(k)
    R = 3
    train = rng.lognormal(size=(R, k)).astype(np.float32)
    sizes = rng.integers(1, 9, size=(R, k))
    err = (rng.binomial(sizes, 0.3) / sizes).astype(np.float32)   # ties
    tloss = rng.normal(size=(R, k)).astype(np.float32)
    want = summarize(train, np.full(k, 5), err, tloss, PERCENTILES)
    got = summarize_sample(train, err, tloss, PERCENTILES)
    assert set(want) == {key for key in got if not key.endswith(("_lo", "_hi"))}
    for name, x in (("train_loss", train), ("test_error", err)):
        for p in PERCENTILES:
            key = f"{name}_p{p}"
            assert np.all(got[key + "_lo"] <= got[key]) and np.all(got[key] <= got[key + "_hi"])
            np.testing.assert_array_equal(got[key], [_lower_by_counting(row, p) for row in x])
    # metrics.summarize agrees everywhere but at ranks where p k / 100 is a whole number
    # (k = 20, 100, 300): there its float32 level (0.6f > 0.6) or its normalised float32
    # alpha sums can round past the boundary and take the next order statistic.
    exact_boundary = any(p * k % 100 == 0 for p in PERCENTILES) and k > 1
    for key, v in want.items():
        if exact_boundary and "_p" in key:
            continue
        np.testing.assert_allclose(got[key], v, rtol=1e-6, err_msg=key)


# --------------------------------------------------------------------------------------------
# (c) sampling


def test_draw_is_inverse_cdf_of_the_stream():
    """train = the client of integer x in [0, sum n) with the clients' examples laid end to
    end (np.repeat), x from default_rng([seed, round, 2]); then the test draw."""
    sizes = np.array([3, 0, 5, 1, 7, 2])
    got = sample_eval_clients(4, 11, sizes, 9, 6)
    rng = np.random.default_rng([4, 11, 2])
    x = rng.integers(0, sizes.sum(), size=6)
    owner = np.repeat(np.arange(sizes.size), sizes)
    np.testing.assert_array_equal(got.train, np.sort(owner[x]))
    np.testing.assert_array_equal(got.test, np.sort(rng.choice(9, size=6, replace=False)))
    assert got.train.dtype == np.int64 and got.test.dtype == np.int64


def test_draw_pure_in_seed_and_round():
    sizes = np.random.default_rng(0).integers(1, 50, size=1000)
    sampler = EvalSampler(sizes, 800)
    a = sampler.draw(3, 10, 64)
    b = sample_eval_clients(3, 10, sizes, 800, 64)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.test, b.test)
    for other in (sampler.draw(3, 11, 64), sampler.draw(4, 10, 64)):
        assert not np.array_equal(a.train, other.train)
        assert not np.array_equal(a.test, other.test)
    assert np.all(np.diff(a.train) >= 0) and np.all(np.diff(a.test) > 0)   # sorted; distinct
    assert a.test.min() >= 0 and a.test.max() < 800 and a.train.max() < 1000


def test_test_sample_is_capped_and_distinct():
    s = sample_eval_clients(0, 1, np.ones(10, np.int64), 25, 40)
    np.testing.assert_array_equal(s.test, np.arange(25))
    assert s.train.shape == (40,)
    big = EvalSampler(np.ones(5, np.int64), 10 ** 6).draw(1, 2, 5000)
    assert np.unique(big.test).size == 5000


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_pps_frequencies_match_alpha(dtype):
    sizes = np.array([1, 2, 3, 0, 4, 10, 30], dtype)
    alpha = sizes / sizes.sum()
    draws = EvalSampler(sizes, 5).draw(7, 0, 200_000).train
    counts = np.bincount(draws, minlength=sizes.size)
    assert counts[3] == 0
    keep = alpha > 0
    _, pvalue = stats.chisquare(counts[keep], 200_000 * alpha[keep])
    assert pvalue > 1e-3


def test_bad_inputs():
    with pytest.raises(ConfigError):
        EvalSampler(np.zeros(4, np.int64), 3)
    with pytest.raises(ConfigError):
        EvalSampler(np.array([1, -1]), 3)
    with pytest.raises(ConfigError):
        EvalSampler(np.ones(4, np.int64), 0)
    with pytest.raises(ConfigError, match="eval_clients"):
        EvalSampler(np.ones(4, np.int64), 3).draw(0, 0, 0)


# --------------------------------------------------------------------------------------------
# (a) coverage of the true alpha-weighted percentiles of a known population


@pytest.fixture(scope="module")
def population():
    rng = np.random.default_rng(2024)
    n = 20000
    sizes = np.ceil(rng.lognormal(3.0, 1.0, size=n)).astype(np.int64)
    # Heavier clients have smaller losses (correlated with size), so the alpha-weighted
    # percentiles differ from the unweighted ones. float32 values: the reference below is.
    loss = (rng.lognormal(0.0, 0.5, size=n) * 3.0 / np.log(sizes + 2.0)).astype(np.float32)
    test_sizes = rng.integers(1, 21, size=n)
    test_err = (rng.binomial(test_sizes, rng.beta(2, 5, size=n)) / test_sizes
                ).astype(np.float32)   # fractions j/n: many ties, 0 among them
    return sizes, loss.astype(np.float64), test_err.astype(np.float64)


TRIALS, K = 400, 300


@pytest.fixture(scope="module")
def trials(population):
    sizes, loss, test_err = population
    sampler = EvalSampler(sizes, test_err.size)
    out = []
    for t in range(TRIALS):
        s = sampler.draw(t, 0, K)
        out.append(summarize_sample(loss[s.train][None], test_err[s.test][None],
                                    test_err[s.test][None], [10, 50, 90],
                                    num_test=test_err.size))
    return {key: np.array([o[key][0] for o in out]) for key in out[0]}


def _truth(values, weights, percents):
    return percentiles(values[None], weights, percents)[0]


@pytest.mark.parametrize("name", ["train_loss", "test_error"])
@pytest.mark.parametrize("p", [10, 50, 90])
def test_intervals_cover_true_percentiles(population, trials, name, p):
    sizes, loss, test_err = population
    values, weights = (loss, sizes) if name == "train_loss" else (test_err, None)
    truth, below, above = _truth(values, weights, [p, max(p - 15, 0), min(p + 15, 100)])
    lo, hi = trials[f"{name}_p{p}_lo"], trials[f"{name}_p{p}_hi"]
    coverage = np.mean((lo <= truth) & (truth <= hi))
    assert coverage >= 0.93, coverage
    # Not absurdly wide: the bounds lie between the population's (p -+ 15)-th percentiles in
    # nearly every trial (the bounds' ranks are ~ K p / 100 -+ 1.96 sqrt(K p (1 - p)) / 100;
    # +- 15 points is >= 3.3 standard errors of the sample fraction beyond them at K = 300).
    narrow = np.mean((lo >= below) & (hi <= above) & np.isfinite(lo) & np.isfinite(hi))
    assert narrow >= 0.97, narrow
    if name == "train_loss":   # ~20000 distinct values: coverage near its exact binomial value
        exact = interval_coverage(K, *quantile_interval_ranks(K, float(p)), p)
        assert abs(coverage - exact) <= 4 * math.sqrt(exact * (1 - exact) / TRIALS)


def test_means_unbiased_and_covered(population, trials):
    sizes, loss, test_err = population
    true_train = loss @ (sizes / sizes.sum())
    est = trials["train_loss_mean"]
    assert abs(est.mean() - true_train) <= 4 * est.std() / math.sqrt(TRIALS)
    cover = np.mean((trials["train_loss_mean_lo"] <= true_train)
                    & (true_train <= trials["train_loss_mean_hi"]))
    assert 0.92 <= cover <= 0.99
    true_err = test_err.mean()
    cover = np.mean((trials["test_error_mean_lo"] <= true_err)
                    & (true_err <= trials["test_error_mean_hi"]))
    assert 0.92 <= cover <= 0.99
