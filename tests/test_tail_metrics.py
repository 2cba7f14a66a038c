"""The tail metrics (deltafl_jax.evaluation.metrics, deltafl_jax.evaluation.sample): the worst-10% mean error
(the superquantile at 0.9) against scipy's LP and hand-computed cases, its relation to the
"mean of the floor(0.1 N) worst" of PropFair and pFL-Bench, the std and the share below a
target against NumPy loops, their sampled estimates and intervals (DKW bounds against an LP
over the band's extreme distributions, the exact hypergeometric interval against a brute-force
enumeration, coverage over a finite population drawn without replacement), and their way into
the run's summaries, the progress line and the closing table."""

import math
import types

import numpy as np
import pytest
from scipy import optimize, stats

from deltafl_jax.evaluation.metrics import (TAIL_KEYS, share_below_target, std_rows, summarize,
                                            superquantile_rows)
from deltafl_jax.evaluation.sample import (EvalSampler, dkw_epsilon, share_interval,
                                           summarize_sample, superquantile_interval)
from deltafl_jax.replicas.labels import ReplicaLabel, replica_names
from deltafl_jax.run.callbacks import Evaluation, RunContext
from deltafl_jax.run.config import PERCENTILES
from deltafl_jax.run.progress import error_table, evaluation_line


def _lp_superquantile(values, weights, level):
    """max sum_i q_i v_i over 0 <= q_i <= w_i / ((1 - level) W), sum q = 1: the superquantile
    as a linear program (Rockafellar & Uryasev's dual), solved by scipy's HiGHS."""
    v = np.asarray(values, np.float64)
    w = np.asarray(weights, np.float64)
    cap = w / ((1.0 - level) * w.sum())
    res = optimize.linprog(-v, A_eq=np.ones((1, v.size)), b_eq=[1.0],
                           bounds=list(zip(np.zeros(v.size), cap)), method="highs")
    assert res.status == 0
    return -res.fun


def test_superquantile_hand_cases():
    ten = np.arange(1.0, 11.0)[None]
    assert superquantile_rows(ten, 0.9)[0] == 10.0                # 0.1 K = 1: the largest
    twelve = np.arange(1.0, 13.0)[None]
    # 0.1 K = 1.2: (12 + 0.2 x 11) / 1.2
    assert superquantile_rows(twelve, 0.9)[0] == pytest.approx((12 + 0.2 * 11) / 1.2)
    five = np.array([[0.2, 0.9, 0.4, 0.1, 0.6]])
    # 0.1 K = 0.5 < 1: the largest error alone
    assert superquantile_rows(five, 0.9)[0] == pytest.approx(0.9)
    assert superquantile_rows(five, 0.0)[0] == pytest.approx(five.mean())
    assert superquantile_rows(five, 1.0)[0] == 0.9
    # 40% of the weight: the two largest (0.9, 0.6) at full weight, then 0.4 at none.
    assert superquantile_rows(five, 0.6)[0] == pytest.approx(0.75)
    # weights: 0.9 carries 1/6 of the weight, so the top 30% adds 0.6 at weight 1.8 / 6 - 1/6
    w = np.array([1.0, 1.0, 1.0, 2.0, 1.0])
    want = (0.9 * 1.0 + 0.6 * 0.8) / 1.8
    assert superquantile_rows(five, 0.7, w)[0] == pytest.approx(want)


@pytest.mark.parametrize("case", range(12))
def test_superquantile_matches_the_lp(case):
    rng = np.random.default_rng(case)
    n = int(rng.integers(3, 40))
    values = rng.integers(0, 6, size=(2, n)) / 5.0 if case % 2 else rng.random((2, n))
    weights = None if case % 3 == 0 else rng.integers(0, 9, size=n).astype(float)
    if weights is not None and weights.sum() == 0:
        weights[0] = 1.0
    level = float(rng.choice([0.9, 0.5, 0.75, 0.37]))
    got = superquantile_rows(values, level, weights)
    w = np.ones(n) if weights is None else weights
    for r in range(2):
        assert got[r] == pytest.approx(_lp_superquantile(values[r], w, level), abs=1e-9)


def _mean_of_floor_worst(errors, share=0.1):
    """PropFair's / pFL-Bench's worst 10%: the mean of the lowest floor(0.1 N) accuracies,
    written on the errors (1 - accuracy), by sorting a Python list."""
    j = int(math.floor(share * len(errors)))
    worst = sorted(errors, reverse=True)[:j]
    return sum(worst) / j


def test_relation_to_the_mean_of_the_floor_worst():
    rng = np.random.default_rng(5)
    for n in (10, 20, 50, 100, 13, 27, 99, 101):
        err = rng.random(n)
        sq = superquantile_rows(err[None], 0.9)[0]
        floor_mean = _mean_of_floor_worst(list(err))
        if n % 10 == 0:   # 0.1 N whole: the same number
            assert sq == pytest.approx(floor_mean, rel=1e-12)
        else:             # the boundary client's fraction pulls the superquantile down
            assert sq <= floor_mean + 1e-12
            j, f = divmod(0.1 * n, 1.0)
            desc = np.sort(err)[::-1]
            assert sq == pytest.approx((desc[:int(j)].sum() + f * desc[int(j)]) / (0.1 * n))


def test_nan_counts_as_the_worst():
    v = np.array([[0.1, np.nan, 0.3], [0.1, 0.2, 0.3]])
    got = superquantile_rows(v, 0.9)
    assert np.isnan(got[0]) and got[1] == pytest.approx(0.3)
    assert share_below_target(v, 0.5)[0] == pytest.approx(1 / 3)   # NaN: below target


def test_std_and_share_against_loops():
    rng = np.random.default_rng(1)
    err = rng.integers(0, 11, size=(3, 17)) / 10.0
    w = rng.integers(1, 5, size=17).astype(float)
    for r in range(3):
        row = list(err[r])
        mean = sum(row) / len(row)
        assert std_rows(err)[r] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in row)
                                                           / len(row)))
        wm = sum(a * b for a, b in zip(w, row)) / w.sum()
        assert std_rows(err, w)[r] == pytest.approx(
            math.sqrt(sum(a * (b - wm) ** 2 for a, b in zip(w, row)) / w.sum()))
        for target in (0.3, 0.5, 0.7):
            below = [x for x in row if 1 - x < target]
            assert share_below_target(err, target)[r] == pytest.approx(len(below) / len(row))
            wb = sum(a for a, x in zip(w, row) if 1 - x < target)
            assert share_below_target(err, target, w)[r] == pytest.approx(wb / w.sum())
    # accuracy exactly at the target is not below it
    assert share_below_target(np.array([[0.5, 0.25]]), 0.5)[0] == 0.0


def test_summarize_adds_the_tail_keys():
    rng = np.random.default_rng(2)
    train, test = rng.random((2, 30)), rng.integers(0, 5, size=(2, 40)) / 4.0
    s = summarize(train, np.ones(30), test, test, PERCENTILES)
    assert set(TAIL_KEYS) <= set(s)
    np.testing.assert_allclose(s["test_error_worst10"],
                               [np.sort(t)[::-1][:4].mean() for t in test])
    np.testing.assert_allclose(s["test_error_std"], test.std(axis=1))
    np.testing.assert_allclose(s["test_share_below_target"], (test > 0.5).mean(axis=1))
    assert "test_share_below_target" not in summarize(train, np.ones(30), test, test,
                                                      PERCENTILES, target_accuracy=None)


# --------------------------------------------------------------------------------------------
# Sampled evaluation


def _band_extremes(sample, e, a, b):
    """The DKW band's stochastically largest and smallest distributions as (atoms, masses),
    built from the sorted sample, for the LP above."""
    k = sample.size
    asc = np.sort(sample)
    m = np.full(k, 1.0 / k)
    # largest: remove mass e from the bottom, put it at b
    up = m.copy()
    left = e
    for i in range(k):
        take = min(up[i], left)
        up[i] -= take
        left -= take
    largest = (np.append(asc, b), np.append(up, e))
    # smallest: remove mass e from the top, put it at a
    lo = m.copy()
    left = e
    for i in reversed(range(k)):
        take = min(lo[i], left)
        lo[i] -= take
        left -= take
    smallest = (np.append(asc, a), np.append(lo, e))
    return largest, smallest


@pytest.mark.parametrize("k", [7, 30, 64, 300])
def test_dkw_interval_against_the_lp(k):
    rng = np.random.default_rng(k)
    sample = rng.integers(0, 8, size=k) / 7.0
    lo, hi = superquantile_interval(sample[None], 0.9, 0.95, (0.0, 1.0))
    e = math.sqrt(math.log(2 / 0.05) / (2 * k))
    assert dkw_epsilon(k, 0.95) == pytest.approx(e)
    (xu, mu), (xl, ml) = _band_extremes(sample, min(e, 1.0), 0.0, 1.0)
    assert hi[0] == pytest.approx(_lp_superquantile(xu, mu, 0.9), abs=1e-9)
    assert lo[0] == pytest.approx(_lp_superquantile(xl, ml, 0.9), abs=1e-9)
    assert lo[0] <= superquantile_rows(sample[None], 0.9)[0] <= hi[0]
    inf_hi = superquantile_interval(sample[None], 0.9, 0.95, (0.0, np.inf))[1]
    assert inf_hi[0] == np.inf


def test_whole_population_is_exact():
    x = np.random.default_rng(0).random((2, 20))
    lo, hi = superquantile_interval(x, 0.9, 0.95, (0.0, 1.0), population=20)
    np.testing.assert_array_equal(lo, superquantile_rows(x, 0.9))
    np.testing.assert_array_equal(hi, lo)
    assert share_interval(7, 20, 0.95, 20) == (0.35, 0.35)


def _brute_share_interval(count, k, n, confidence):
    """Every population count M, its hypergeometric tails by math.comb; the extreme M whose
    tail exceeds (1 - c) / 2."""
    tail = (1 - confidence) / 2

    def pmf(x, m):
        return math.comb(m, x) * math.comb(n - m, k - x) / math.comb(n, k)
    ok_lo = [m for m in range(n + 1) if sum(pmf(x, m) for x in range(count, k + 1)) > tail]
    ok_hi = [m for m in range(n + 1) if sum(pmf(x, m) for x in range(0, count + 1)) > tail]
    return min(ok_lo) / n, max(ok_hi) / n


@pytest.mark.parametrize("count,k,n", [(0, 5, 30), (3, 10, 40), (5, 5, 12), (7, 19, 25),
                                       (1, 2, 50)])
def test_share_interval_against_brute_force(count, k, n):
    assert share_interval(count, k, 0.95, n) == pytest.approx(
        _brute_share_interval(count, k, n, 0.95))
    lo, hi = share_interval(count, k, 0.95)    # Clopper-Pearson
    p = count / k
    assert lo <= p <= hi
    if count > 0:
        assert stats.binom.sf(count - 1, k, lo) == pytest.approx(0.025, abs=1e-9)
    if count < k:
        assert stats.binom.cdf(count, k, hi) == pytest.approx(0.025, abs=1e-9)


def test_sample_estimates_of_a_whole_population_equal_the_metrics():
    rng = np.random.default_rng(3)
    err = rng.integers(0, 9, size=(2, 25)) / 8.0
    full = summarize(rng.random((2, 5)), np.ones(5), err, err, PERCENTILES)
    got = summarize_sample(rng.random((2, 5)), err, err, PERCENTILES, num_test=25)
    for key in TAIL_KEYS:
        np.testing.assert_allclose(got[key], full[key], rtol=1e-12, err_msg=key)
    for key in ("test_error_worst10", "test_share_below_target"):
        np.testing.assert_allclose(got[key + "_lo"], full[key], rtol=1e-12)
        np.testing.assert_allclose(got[key + "_hi"], full[key], rtol=1e-12)


@pytest.fixture(scope="module")
def finite_population():
    """20000 test clients, errors j/n (ties, zeros), drawn without replacement K at a time."""
    rng = np.random.default_rng(2025)
    n = 20000
    sizes = rng.integers(1, 21, size=n)
    err = rng.binomial(sizes, rng.beta(2, 5, size=n)) / sizes
    return err


@pytest.mark.parametrize("k", [60, 300])
def test_tail_intervals_cover_the_population(finite_population, k):
    err = finite_population
    truth_w10 = superquantile_rows(err[None], 0.9)[0]
    truth_share = share_below_target(err[None], 0.5)[0]
    sampler = EvalSampler(np.ones(10, np.int64), err.size)
    trials = 300
    cover_w10 = cover_share = 0
    widths, std_est = [], []
    for t in range(trials):
        test = sampler.draw(t, 1, k).test
        s = summarize_sample(np.zeros((1, 2)), err[test][None], err[test][None], [90],
                             num_test=err.size)
        cover_w10 += s["test_error_worst10_lo"][0] <= truth_w10 <= s["test_error_worst10_hi"][0]
        cover_share += (s["test_share_below_target_lo"][0] <= truth_share
                        <= s["test_share_below_target_hi"][0])
        widths.append(s["test_error_worst10_hi"][0] - s["test_error_worst10_lo"][0])
        std_est.append(s["test_error_std"][0] ** 2)
    assert cover_w10 / trials >= 0.95
    assert cover_share / trials >= 0.93      # exact: >= 0.95 up to Monte Carlo noise
    # The DKW bound is conservative (coverage 1.0 here) but not vacuous: at K = 300 its
    # half-width e = 0.078 is below the 10% tail it bounds; measured mean widths 0.44 (K = 300)
    # and 0.55 (K = 60) around the true 0.77.
    assert np.mean(widths) < (0.5 if k == 300 else 0.7)
    # s^2 (N - 1) / N is unbiased for the population variance (ddof = 0)
    var = err.var()
    assert abs(np.mean(std_est) - var) <= 4 * np.std(std_est) / math.sqrt(trials)


# --------------------------------------------------------------------------------------------
# Display


LABELS = [ReplicaLabel("deltafl", 0.5, 1), ReplicaLabel("deltafl", 0.5, 2)]


def test_progress_line_and_closing_table_show_the_tail():
    summary = {"train_loss_mean": np.array([0.5, 0.7]),
               "test_error_mean": np.array([0.30, 0.32]),
               "test_error_p90": np.array([0.41, 0.43]),
               "test_error_worst10": np.array([0.60, 0.70]),
               "test_error_std": np.array([0.20, 0.22]),
               "test_share_below_target": np.array([0.25, 0.35])}
    config = types.SimpleNamespace(evaluation=types.SimpleNamespace(target_accuracy=0.6))
    view = types.SimpleNamespace(facts=types.SimpleNamespace(classify=True, config=config),
                                 names=replica_names(LABELS, "Δ-FL"))
    line = evaluation_line(RunContext(view=view, num_rounds=10),
                           Evaluation(round=5, per_client={}, summary=summary, records=[],
                                      elapsed_s=1.0))
    assert "p90 42.0% worst10 65.0% std 21.0% acc<0.6 30%" in line
    assert "\n" not in line
    finals = [{k: float(v[r]) for k, v in summary.items()} for r in range(2)]
    lines = error_table([("θ=0.5", finals)])
    assert lines[0].split()[-7:] == ["p90", "worst", "10%", "std", "below", "tgt", "seeds"]
    assert lines[1].split()[1:] == ["31.00%", "42.00%", "65.00%", "21.00%", "30.00%", "2"]
