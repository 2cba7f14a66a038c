"""The superquantile primitives against scipy's LP and against the definitions written out."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import linprog

from deltafl_jax import superquantile, superquantile_dual, tail_weights, threshold_weights
from deltafl_jax import weighted_quantile


def lp_superquantile(v, w, theta):
    """max sum pi v s.t. 0 <= pi_k <= w_k / (theta W), sum pi = 1, by scipy's HiGHS."""
    caps = w / (theta * w.sum())
    res = linprog(-v, A_eq=np.ones((1, v.size)), b_eq=[1.0],
                  bounds=list(zip(np.zeros_like(caps), caps)), method="highs")
    assert res.status == 0
    return -res.fun


def quantile_by_definition(v, w, level):
    """min{v_k : sum_{j: v_j <= v_k} w_j >= level * W}, over k with w_k > 0 (double loop)."""
    total = w.sum()
    best = math.inf
    for k in range(v.size):
        if w[k] <= 0:
            continue
        mass = sum(w[j] for j in range(v.size) if v[j] <= v[k])
        if mass >= level * total * (1 - 1e-12) and v[k] < best:
            best = v[k]
    return best


def random_case(rng):
    n = int(rng.integers(1, 40))
    kind = rng.integers(4)
    if kind == 0:    # continuous values
        v = rng.normal(size=n) * 3
    elif kind == 1:  # many ties
        v = rng.integers(0, 4, size=n).astype(float)
    elif kind == 2:  # heavy tail
        v = rng.pareto(1.5, size=n)
    else:            # losses-like, some ties
        v = np.round(rng.exponential(size=n), 1)
    if rng.random() < 0.5:
        w = rng.integers(1, 500, size=n).astype(float)   # client sizes n_k
    else:
        w = rng.random(n) + 0.01
    u = rng.random()
    if u < 0.1:
        theta = 1.0
    elif u < 0.2:
        theta = float(rng.integers(1, n + 1)) / n          # theta N integer
    elif u < 0.3:
        theta = float(rng.uniform(1e-4, 1e-2))             # tends to the max
    else:
        theta = float(rng.uniform(0.01, 1.0))
    return v, w, theta


CASES = [random_case(np.random.default_rng(seed)) for seed in range(600)]
NPAD = 40


def padded(v, w):
    """Pad to NPAD entries with zero weight (arbitrary values), so one compile serves all."""
    k = NPAD - v.size
    junk = np.linspace(-50, 50, k)
    return np.concatenate([v, junk]), np.concatenate([w, np.zeros(k)])


def test_superquantile_and_tail_weights_match_lp_on_600_cases():
    with jax.enable_x64(True):
        sq = jax.jit(superquantile)
        tw = jax.jit(tail_weights)
        dual = jax.jit(superquantile_dual)
        for v, w, theta in CASES:
            ref = lp_superquantile(v, w, theta)
            vp, wp = padded(v, w)
            value = float(sq(vp, wp, theta))
            assert value == pytest.approx(ref, abs=1e-6, rel=1e-9), (v, w, theta)
            assert float(dual(vp, wp, theta)) == pytest.approx(ref, abs=1e-6, rel=1e-9)
            pi_padded = np.asarray(tw(vp, wp, theta))
            assert np.all(pi_padded[v.size:] == 0)
            pi = pi_padded[:v.size]
            caps = w / (theta * w.sum())
            assert np.all(pi >= 0)
            assert np.all(pi <= caps + 1e-12)
            assert pi.sum() == pytest.approx(1.0, abs=1e-12)
            assert float(pi @ v) == pytest.approx(ref, abs=1e-6, rel=1e-9)


def test_weighted_quantile_matches_definition_and_reference_rule():
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        wq = jax.jit(weighted_quantile)
        for v, w, theta in CASES[:300]:
            vp, wp = padded(v, w)
            for level in (0.0, 1.0 - theta, float(rng.random()), 1.0):
                got = float(wq(vp, wp, level))
                assert got == quantile_by_definition(v, w, level), (v, w, level)
        # The reference code's rule on integer weights: repeat each value n_k times, sort,
        # eta = sorted[ceil(N p) - 1] (and the minimum when p = 0).
        for _ in range(200):
            n = int(rng.integers(1, 20))
            v = np.round(rng.normal(size=n), 2)
            counts = rng.integers(1, 30, size=n)
            p = float(rng.integers(0, 11)) / 10
            rep = np.sort(np.repeat(v, counts))
            ref = rep[0] if p == 0 else rep[math.ceil(rep.size * p) - 1]
            vp, wp = padded(v, counts.astype(float))
            assert float(wq(vp, wp, p)) == ref


# The float32 cases below run the primitives jitted: one program per shape, not one compile
# per operation run eagerly.
SQ, TAIL, THRESHOLD = jax.jit(superquantile), jax.jit(tail_weights), jax.jit(threshold_weights)
QUANTILE = jax.jit(weighted_quantile)


def test_limits_theta_one_is_mean_and_small_theta_is_max():
    rng = np.random.default_rng(1)
    for _ in range(50):
        v = rng.normal(size=12).astype(np.float32)
        w = rng.integers(1, 100, size=12).astype(np.float32)
        assert float(SQ(v, w, 1.0)) == pytest.approx(float(w @ v / w.sum()), rel=1e-5)
        np.testing.assert_allclose(TAIL(v, w, 1.0), w / w.sum(), rtol=1e-6)
        theta = 0.5 * w.min() / w.sum()  # below the smallest weight share: only the max counts
        assert float(SQ(v, w, theta)) == pytest.approx(float(v.max()), rel=1e-6)


def test_hand_computed_cases():
    # Three clients with losses 1, 2, 3 and equal weight, theta = 1/2: the tail mass 1/2 is
    # covered by all of client 3 (cap 2/3 > 1/2) -> value 3. At theta = 2/3: 3 and 2 get 1/2.
    v = np.array([1.0, 2.0, 3.0], np.float32)
    w = np.ones(3, np.float32)
    np.testing.assert_allclose(TAIL(v, w, 0.5), [0, 1 / 3, 2 / 3], atol=1e-6)
    np.testing.assert_allclose(TAIL(v, w, 2 / 3), [0, 0.5, 0.5], atol=1e-6)
    assert float(SQ(v, w, 2 / 3)) == pytest.approx(2.5)
    # Boundary client with a fraction: weights 1, 1, 2, theta = 0.6 -> tail mass 2.4 of 4:
    # client 3 (weight 2, value 3) full, client 2 gets 0.4 of its 1 -> pi = (0, 1/6, 5/6).
    w = np.array([1.0, 1.0, 2.0], np.float32)
    np.testing.assert_allclose(TAIL(v, w, 0.6), [0, 0.4 / 2.4, 2 / 2.4], atol=1e-6)
    # The reference filter keeps the boundary client with its full weight.
    np.testing.assert_allclose(THRESHOLD(v, w, 0.6), [0, 1, 2])
    # Ties at the boundary share the remainder in proportion to their weights.
    v = np.array([5.0, 2.0, 2.0, 1.0], np.float32)
    w = np.array([1.0, 1.0, 3.0, 1.0], np.float32)   # W = 6, theta = 0.5 -> mass 3
    np.testing.assert_allclose(TAIL(v, w, 0.5), [1 / 3, 0.5 / 3, 1.5 / 3, 0], atol=1e-6)


def test_zero_weights_are_ignored_and_vmap_over_theta_and_batches():
    v = np.array([9.0, 1.0, 2.0, 3.0], np.float32)
    w = np.array([0.0, 1.0, 1.0, 1.0], np.float32)  # the 9 is padding
    assert float(QUANTILE(v, w, 1.0)) == 3.0
    assert float(SQ(v, w, 1 / 3)) == pytest.approx(3.0)
    thetas = jnp.array([1.0, 2 / 3, 1 / 3])
    got = jax.jit(jax.vmap(superquantile, in_axes=(None, None, 0)))(v, w, thetas)
    np.testing.assert_allclose(got, [2.0, 2.5, 3.0], rtol=1e-6)
    vs = np.stack([v, v[::-1]])
    ws = np.stack([w, w[::-1]])
    got = jax.jit(jax.vmap(tail_weights, in_axes=(0, 0, None)))(vs, ws, 0.5)
    np.testing.assert_allclose(got[1], np.asarray(got[0])[::-1], atol=1e-7)
