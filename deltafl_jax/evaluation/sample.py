"""Evaluation on a sample of clients (``--eval_clients=K``), with confidence intervals.

At 10^5..10^6 clients, evaluating every replica on every client at every evaluation costs more
than the rounds. Each evaluation then evaluates K training and K test clients, and the
summaries of :func:`deltafl_jax.evaluation.metrics.summarize` become estimates with intervals.

Sampling (:func:`sample_eval_clients`, :class:`EvalSampler`), a pure function of (seed, round):
NumPy ``default_rng([seed, round, 2])`` (streams 0 and 1 are the round plans',
:mod:`deltafl_jax.sampling.plan`), the training draw first, then the test draw.

- Training clients are drawn WITH replacement with probability alpha_k = n_k / sum_j n_j
  (probability proportional to size; Hansen & Hurwitz 1943; Cochran, *Sampling Techniques*,
  3rd ed. 1977, Sec. 9A.2). The loss of each draw, F_I with I ~ alpha, is then an iid draw from
  the alpha-weighted distribution G(x) = sum_{k: F_k <= x} alpha_k of the per-client losses, so
  the plain sample mean is unbiased for the alpha-weighted mean sum_k alpha_k F_k, and the
  order statistics of the sample give exact distribution-free intervals for the quantiles of
  G (the alpha-weighted lower percentiles of :mod:`deltafl_jax.evaluation.metrics`). A draw is an integer
  in [0, sum n) located by binary search in the cumulative sizes: O(N) once (cached by
  :class:`EvalSampler`), then O(K log N) per evaluation.
- Test clients (unweighted, App. C.2.3) are drawn uniformly WITHOUT replacement
  (min(K, N_test) of them). The intervals below assume iid draws; for a sample without
  replacement the count of sampled values below a quantile is hypergeometric, which is more
  concentrated than the binomial of the same mean (Hoeffding 1963, Thm. 4), so the intervals
  are conservative (exact, a point, when K = N_test).
- Both samples are sorted (training: with its repeats) so the device reads clients in order.

Point estimates (:func:`summarize_sample`, the keys of :func:`deltafl_jax.evaluation.metrics.summarize`):
``train_loss_mean`` the sample mean of the PPS draws; ``train_loss_p{p}`` and
``test_error_p{p}`` the lower sample quantile, the ceil(p K / 100)-th order statistic (the
lower quantile of the sample with unit weights, in exact integer arithmetic: where p K / 100
is a whole number, :func:`deltafl_jax.evaluation.metrics.percentiles` compares a float32 level and may
take the next order statistic); ``test_error_mean`` and ``test_loss_mean``
sample means.

Intervals, ``KEY_lo`` / ``KEY_hi`` for every percentile key: the distribution-free interval
[X_(l), X_(u)] from order statistics (David & Nagaraja, *Order Statistics*, 3rd ed. 2003,
Sec. 7.1; Hahn & Meeker, *Statistical Intervals*, 1991, Sec. 5.2). With B ~ Binomial(K, p/100),
P(X_(l) <= q_p <= X_(u)) >= P(l <= B <= u - 1) for the lower quantile q_p of ANY distribution,
ties included (conservative then). The pair is EQUAL-TAILED: l is the largest index with
P(B <= l - 1) <= (1 - c) / 2 and u the smallest with P(B >= u) <= (1 - c) / 2, so the coverage
is at least c. When K is too small for such an l (or u) to exist (e.g. K = 5 for the median
at c = 0.95), that bound is -inf (or +inf): no finite order statistic bounds q_p at that
confidence, and an infinite bound keeps the statement true.

``train_loss_mean_lo/hi`` and ``test_error_mean_lo/hi`` are NORMAL-APPROXIMATION intervals
mean +- z_{(1+c)/2} s / sqrt(K) (s the sample standard deviation, ddof = 1; for the test error
times the finite-population correction sqrt((N - K) / (N - 1)) when N_test is given): the
central limit theorem, not exact; NaN when K < 2.

**The tail metrics** (:func:`deltafl_jax.evaluation.metrics.tail_summaries`) from the test sample:

- ``test_error_worst10``: the superquantile at 0.9 of the sample (the same fractional
  definition), with a DISTRIBUTION-FREE interval ``_lo`` / ``_hi`` from the
  Dvoretzky-Kiefer-Wolfowitz band with Massart's constant (Massart 1990): for K iid draws from
  any distribution G, P(sup_x |G_K(x) - G(x)| > e) <= 2 exp(-2 K e^2), so with
  e = sqrt(ln(2 / (1 - c)) / (2 K)) the band G_K -+ e holds G with probability >= c. The
  superquantile is monotone in the stochastic order, so over the band it is largest for the
  distribution that moves the lowest mass e of the sample to the top of the errors' range
  [0, 1], and smallest for the one that moves the highest mass e to the bottom: with
  S(s) = the sum of the largest sample values carrying mass s (1/K each, fractional at the
  boundary) and t = 0.1, hi = (min(e, t) b + S(max(t - e, 0))) / t and
  lo = (S(min(e + t, 1)) - S(min(e, 1)) + max(e + t - 1, 0) a) / t, with [a, b] = [0, 1]
  (Thomas & Learned-Miller, *Concentration Inequalities for Conditional Value at Risk*, ICML
  2019, derive the same bounds). For a regression (errors are losses, unbounded above) b is
  infinite and so is ``_hi``. Coverage is >= c for iid draws; the test clients are drawn
  without replacement, for which each count below a point is hypergeometric and more
  concentrated (as above), and ``tests/test_eval_sample.py`` checks the coverage of a
  finite population drawn without replacement. When the sample is the whole population
  (K = N_test) the estimate is exact and the interval is that point.
- ``test_error_std``: the sample std rescaled to estimate the population's std (ddof = 0 over
  the N_test clients): s sqrt((N - 1) / N) with s the ddof = 1 std, whose square is unbiased
  for the population variance under sampling without replacement (Cochran 1977, Thm. 2.4), and
  equals the ddof = 0 std of the population when K = N; without N_test (iid draws) the
  plug-in ddof = 0 std of the sample. No interval (a std has no distribution-free one of
  useful width at these K).
- ``test_share_below_target``: the sample share, with an EXACT interval: the count of sampled
  clients below the target is hypergeometric (N_test, M, K) in the unknown population count
  M, and ``_lo`` / ``_hi`` are M_lo / N and M_hi / N with M_lo the smallest M and M_hi the
  largest M whose one-sided tail P(X >= x) (resp. P(X <= x)) exceeds (1 - c) / 2 (the
  Clopper-Pearson construction for the hypergeometric; Clopper-Pearson's binomial one without
  N_test).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.errors import ConfigError
from deltafl_jax.evaluation.metrics import (DEFAULT_TARGET_ACCURACY, WORST_LEVEL,
                                            share_below_target, superquantile_rows)

def scipy_stats():
    """scipy.stats, imported on first use: it takes about a third of the package's import
    time, and most runs draw no evaluation sample."""
    from scipy import stats
    return stats


STREAM = 2   # default_rng([seed, round, STREAM]); plan.py uses streams 0 and 1
INTERVAL_SUFFIXES = ("_lo", "_hi")


class EvalSample(NamedTuple):
    """Clients of one evaluation: ``train`` int64[K] sorted, with repeats (PPS draws);
    ``test`` int64[min(K, N_test)] sorted, distinct."""

    train: np.ndarray
    test: np.ndarray


class EvalSampler:
    """Draws :class:`EvalSample` s; holds the cumulative training sizes (O(N) once)."""

    def __init__(self, train_sizes, num_test: int):
        sizes = np.asarray(train_sizes)
        if sizes.ndim != 1 or sizes.size == 0:
            raise ConfigError("evaluation sampling needs a non-empty 1-D array of train sizes")
        if np.any(sizes < 0) or not np.all(np.isfinite(sizes)):
            raise ConfigError("evaluation sampling: train sizes must be finite and >= 0")
        self.integer = np.issubdtype(sizes.dtype, np.integer)
        self.cumulative = np.cumsum(sizes.astype(np.int64 if self.integer else np.float64))
        if self.cumulative[-1] <= 0:
            raise ConfigError("evaluation sampling: every train size is 0")
        if int(num_test) < 1:
            raise ConfigError(f"evaluation sampling needs test clients, got {num_test}")
        self.num_train = sizes.size
        self.num_test = int(num_test)

    def draw(self, seed: int, round_idx: int, k: int) -> EvalSample:
        """K PPS training draws and min(K, N_test) test clients of evaluation `round_idx`."""
        if int(k) < 1:
            raise ConfigError(f"--eval_clients must be >= 1, got {k}")
        rng = np.random.default_rng([int(seed), int(round_idx), STREAM])
        total = self.cumulative[-1]
        x = (rng.integers(0, total, size=k) if self.integer
             else rng.uniform(0.0, total, size=k))
        # client i covers [cum[i-1], cum[i]): the first i with cum[i] > x (zero sizes: none)
        train = np.searchsorted(self.cumulative, x, side="right").astype(np.int64)
        train = np.minimum(train, self.num_train - 1)   # float round-off at the top end
        test = rng.choice(self.num_test, size=min(int(k), self.num_test), replace=False)
        return EvalSample(train=np.sort(train), test=np.sort(test.astype(np.int64)))


def sample_eval_clients(seed: int, round_idx: int, train_sizes: np.ndarray, num_test: int,
                        k: int) -> EvalSample:
    """:meth:`EvalSampler.draw` without the cache (O(N) for the cumulative sizes)."""
    return EvalSampler(train_sizes, num_test).draw(seed, round_idx, k)


# --------------------------------------------------------------------------------------------
# Order statistics


def lower_rank(k: int, percent: float) -> int:
    """1-based rank of the lower p-quantile of k values: ceil(p k / 100), at least 1."""
    frac = Fraction(percent).limit_denominator(10 ** 9)   # exact for integer percents
    return max(1, math.ceil(frac * k / 100))


@functools.lru_cache(maxsize=256)
def quantile_interval_ranks(k: int, percent: float, confidence: float = 0.95
                            ) -> Tuple[int, int]:
    """Equal-tailed 1-based ranks (l, u) of the order-statistic interval for the p-quantile.

    B ~ Binomial(k, p/100); l = the largest rank with P(B <= l - 1) <= (1 - c)/2 (0 when
    none: no lower bound), u = the smallest with P(B >= u) <= (1 - c)/2 (k + 1 when none: no
    upper bound). Coverage P(l <= B <= u - 1) >= c when both exist.
    """
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    tail = (1.0 - confidence) / 2.0
    j = np.arange(k + 1)
    p = float(percent) / 100.0
    cdf = scipy_stats().binom.cdf(j, k, p)      # P(B <= j)
    sf = scipy_stats().binom.sf(j, k, p)        # P(B > j) = P(B >= j + 1)
    lo = int(np.count_nonzero(cdf <= tail))          # P(B <= l - 1) <= tail for l <= this
    hi = int(np.count_nonzero(sf > tail)) + 1        # smallest u with P(B >= u) <= tail
    return lo, hi


def interval_coverage(k: int, lo: int, hi: int, percent: float) -> float:
    """P(lo <= B <= hi - 1), B ~ Binomial(k, p/100): the guaranteed coverage of the ranks
    (an infinite bound, rank 0 or k + 1, counts as always covering)."""
    p = float(percent) / 100.0
    below = scipy_stats().binom.cdf(lo - 1, k, p) if lo >= 1 else 0.0
    above = scipy_stats().binom.sf(hi - 1, k, p) if hi <= k else 0.0
    return float(1.0 - below - above)


def _order_stat(sorted_values: np.ndarray, rank: int) -> np.ndarray:
    """[R] the rank-th order statistic (1-based) of each row; -inf / +inf off the ends."""
    k = sorted_values.shape[1]
    if rank < 1:
        return np.full(sorted_values.shape[0], -np.inf)
    if rank > k:
        return np.full(sorted_values.shape[0], np.inf)
    return sorted_values[:, rank - 1]


def _percentile_summaries(values: np.ndarray, name: str, percents: Sequence[float],
                          confidence: float) -> Dict[str, np.ndarray]:
    """name_p{p}, name_p{p}_lo, name_p{p}_hi for every p, from the sorted rows of values."""
    srt = np.sort(values, axis=1)   # NaN sort last: a diverged client counts as the largest
    k = srt.shape[1]
    out = {}
    for p in percents:
        key = f"{name}_p{p}"
        out[key] = _order_stat(srt, lower_rank(k, p))
        lo, hi = quantile_interval_ranks(k, float(p), float(confidence))
        out[key + "_lo"] = _order_stat(srt, lo)
        out[key + "_hi"] = _order_stat(srt, hi)
    return out


def _mean_interval(values: np.ndarray, confidence: float,
                   population: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Normal-approximation interval of the row means (finite-population corrected when the
    population size is given and the sample is drawn without replacement)."""
    k = values.shape[1]
    mean = values.mean(axis=1)
    if k < 2:
        nan = np.full_like(mean, np.nan)
        return nan, nan
    se = values.std(axis=1, ddof=1) / math.sqrt(k)
    if population is not None and population > 1:
        se = se * math.sqrt(max(population - k, 0) / (population - 1))
    z = scipy_stats().norm.ppf(0.5 + confidence / 2.0)
    return mean - z * se, mean + z * se


def summarize_sample(train_loss, test_error, test_loss, percents,
                     confidence: float = 0.95,
                     num_test: Optional[int] = None,
                     target_accuracy: Optional[float] = DEFAULT_TARGET_ACCURACY,
                     error_bounds: Tuple[float, float] = (0.0, 1.0)
                     ) -> Dict[str, np.ndarray]:
    """Per-replica summaries from sampled clients: name -> [R].

    Args:
      train_loss: [R, K] losses of the PPS training draws (repeats included, unweighted).
      test_error: [R, K'] errors of the test clients drawn without replacement.
      test_loss: [R, K'] their losses.
      percents: the percentiles (e.g. config.PERCENTILES).
      confidence: of every interval.
      num_test: N_test, for the finite-population correction of ``test_error_mean_lo/hi``
        and the tail metrics' intervals (None: none).
      target_accuracy: of ``test_share_below_target`` (None: a regression, not computed).
      error_bounds: the range of a client's error (the superquantile's interval): [0, 1] for
        a misclassification rate, [0, inf) for a regression's loss.
    Returns:
      the keys of :func:`deltafl_jax.evaluation.metrics.summarize`, plus ``KEY_lo`` / ``KEY_hi`` for
      every ``train_loss_p{p}`` / ``test_error_p{p}`` (order-statistic intervals, -inf /
      +inf where K is too small) and ``train_loss_mean_lo/hi``, ``test_error_mean_lo/hi``
      (normal approximation).
    """
    train_loss = np.atleast_2d(np.asarray(train_loss, np.float64))
    test_error = np.atleast_2d(np.asarray(test_error, np.float64))
    test_loss = np.atleast_2d(np.asarray(test_loss, np.float64))
    if train_loss.shape[1] < 1 or test_error.shape[1] < 1:
        raise ConfigError("summarize_sample needs at least one sampled client per split")
    out = {"train_loss_mean": train_loss.mean(axis=1)}
    out["train_loss_mean_lo"], out["train_loss_mean_hi"] = _mean_interval(train_loss,
                                                                          confidence)
    out.update(_percentile_summaries(train_loss, "train_loss", percents, confidence))
    out["test_error_mean"] = test_error.mean(axis=1)
    out["test_error_mean_lo"], out["test_error_mean_hi"] = _mean_interval(
        test_error, confidence, num_test)
    out.update(_percentile_summaries(test_error, "test_error", percents, confidence))
    out["test_loss_mean"] = test_loss.mean(axis=1)
    out.update(tail_sample_summaries(test_error, confidence, num_test, target_accuracy,
                                     error_bounds))
    return out


# --------------------------------------------------------------------------------------------
# The tail metrics of a sample


def dkw_epsilon(k: int, confidence: float = 0.95) -> float:
    """e = sqrt(ln(2 / (1 - c)) / (2 K)): the half-width of the DKW band (Massart's constant)
    that holds an iid sample's distribution with probability >= c."""
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    return math.sqrt(math.log(2.0 / (1.0 - confidence)) / (2.0 * int(k)))


def _top_sums(desc: np.ndarray, mass: float) -> np.ndarray:
    """[R]: the sum of the largest values of each row (sorted descending, 1/K each) that carry
    `mass` in [0, 1], the boundary value counted in part."""
    k = desc.shape[1]
    share = np.clip(mass - np.arange(k) / k, 0.0, 1.0 / k)
    return np.sum(np.where(share > 0, desc * share, 0.0), axis=1)


def superquantile_interval(values: np.ndarray, level: float, confidence: float = 0.95,
                           bounds: Tuple[float, float] = (0.0, 1.0),
                           population: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """([R], [R]): the DKW interval of the superquantile at `level` of the distribution each
    row [R, K] was drawn from (module docstring), the values lying in `bounds`; the sample's
    own superquantile at both ends when the sample is the whole population (K = population).
    A NaN in a row makes both ends NaN."""
    values = np.atleast_2d(np.asarray(values, np.float64))
    k = values.shape[1]
    t = 1.0 - float(level)
    if population is not None and k >= int(population) or t <= 0.0:
        point = superquantile_rows(values, level)
        return point, point
    a, b = (float(x) for x in bounds)
    e = dkw_epsilon(k, confidence)
    desc = -np.sort(-np.where(np.isnan(values), np.inf, values), axis=1)
    bad = np.any(np.isnan(values), axis=1)
    top = (min(e, t) * b if min(e, t) > 0 else 0.0)
    hi = (top + _top_sums(desc, max(t - e, 0.0))) / t
    lo = (_top_sums(desc, min(e + t, 1.0)) - _top_sums(desc, min(e, 1.0))
          + (max(e + t - 1.0, 0.0) * a if e + t > 1.0 else 0.0)) / t
    return np.where(bad, np.nan, lo), np.where(bad, np.nan, hi)


def _first_true(pred, lo: int, hi: int) -> int:
    """The smallest m in [lo, hi] with pred(m), for pred monotone (false, then true) and true
    at hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def share_interval(count: int, k: int, confidence: float = 0.95,
                   population: Optional[int] = None) -> Tuple[float, float]:
    """The exact interval of a population share from `count` of `k` sampled units
    (module docstring): hypergeometric inversion with the population size, Clopper-Pearson
    without it."""
    tail = (1.0 - confidence) / 2.0
    if population is None:
        lo = 0.0 if count == 0 else float(scipy_stats().beta.ppf(tail, count, k - count + 1))
        hi = 1.0 if count == k else float(scipy_stats().beta.ppf(1.0 - tail, count + 1, k - count))
        return lo, hi
    n = int(population)
    if k >= n:
        return count / n, count / n
    # M ranges over [count, n - (k - count)]; P(X >= count; M) rises with M (1 at the top),
    # P(X <= count; M) falls (1 at the bottom).
    top = n - (k - count)
    lower = _first_true(lambda m: scipy_stats().hypergeom.sf(count - 1, n, m, k) > tail, count, top)
    upper = top - _first_true(lambda j: scipy_stats().hypergeom.cdf(count, n, top - j, k) > tail,
                              0, top - count)
    return lower / n, upper / n


def tail_sample_summaries(test_error, confidence: float = 0.95,
                          num_test: Optional[int] = None,
                          target_accuracy: Optional[float] = DEFAULT_TARGET_ACCURACY,
                          error_bounds: Tuple[float, float] = (0.0, 1.0)
                          ) -> Dict[str, np.ndarray]:
    """The tail metrics' estimates from the [R, K] test errors of a sample drawn without
    replacement from `num_test` clients (None: iid draws), with the intervals of the module
    docstring; ``test_share_below_target`` only when `target_accuracy` is not None."""
    test_error = np.atleast_2d(np.asarray(test_error, np.float64))
    k = test_error.shape[1]
    out = {"test_error_worst10": superquantile_rows(test_error, WORST_LEVEL)}
    out["test_error_worst10_lo"], out["test_error_worst10_hi"] = superquantile_interval(
        test_error, WORST_LEVEL, confidence, error_bounds, num_test)
    if num_test is None or k < 2:   # iid draws: the plug-in (ddof = 0) estimate
        out["test_error_std"] = test_error.std(axis=1)
    else:
        out["test_error_std"] = (test_error.std(axis=1, ddof=1)
                                 * math.sqrt((num_test - 1) / num_test))
    if target_accuracy is not None:
        share = share_below_target(test_error, target_accuracy)
        out["test_share_below_target"] = share
        bounds = [share_interval(int(round(s * k)), k, confidence, num_test) for s in share]
        out["test_share_below_target_lo"] = np.array([b[0] for b in bounds])
        out["test_share_below_target_hi"] = np.array([b[1] for b in bounds])
    return out


def interval_of(summary, key: str):
    """(lo, hi) of `key` from a summaries mapping (arrays or floats), or None when it has no
    interval."""
    lo, hi = (f"{key}{s}" for s in INTERVAL_SUFFIXES)
    if lo in summary and hi in summary:
        return summary[lo], summary[hi]
    return None


def summarize_population_sample(name: str, error, loss, percents, confidence: float = 0.95,
                                num_population: Optional[int] = None) -> Dict[str, np.ndarray]:
    """:func:`deltafl_jax.evaluation.metrics.summarize_population` of clients drawn uniformly without
    replacement from a population of `num_population`, with the test errors' intervals
    (order statistics for the percentiles, normal with the finite-population correction for
    the mean); the worst-10% mean is the sample's own (no interval)."""
    from deltafl_jax.evaluation.metrics import worst_mean
    error = np.atleast_2d(np.asarray(error, np.float64))
    out = {f"{name}_error_mean": error.mean(axis=1)}
    out[f"{name}_error_mean_lo"], out[f"{name}_error_mean_hi"] = _mean_interval(
        error, confidence, num_population)
    out.update(_percentile_summaries(error, f"{name}_error", percents, confidence))
    out[f"{name}_error_worst10"] = worst_mean(error)
    out[f"{name}_loss_mean"] = np.asarray(loss, np.float64).mean(axis=1)
    return out
