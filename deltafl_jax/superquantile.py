"""Weighted quantile, superquantile and tail weights: the aggregation rule of Delta-FL.

For values v_1..v_N (client losses F_k) with weights w_k > 0 (alpha_k, proportional to n_k) and
a conformity level theta in (0, 1], the paper's objective (eq. 1 and Property 2) is

    F_theta = max { sum_k pi_k v_k : pi in simplex, pi_k <= w_k / (theta * W) },  W = sum_k w_k
            = min_eta  eta + (1/theta) sum_k (w_k / W) (v_k - eta)_+,

the (1 - theta)-superquantile (CVaR) of the weighted values. The maximising pi (the
"tail weights") puts each value above the (1 - theta)-quantile eta at its cap w_k / (theta W),
gives the values tied at eta what is left, and zero to the rest. Those are the exact
aggregation weights of a Delta-FL round (Algorithm 2, lines 5-9).

All functions are pure jnp code: they run under jit and vmap (one call per theta, per seed).
Entries with weight 0 are ignored, which lets callers pad.

**The quantile level in float64.** The authors' code computes eta = v[ceil(N_tot * p) - 1]
with p = 1 - theta and the product in double precision. In float32, 1 - theta and the product
round differently, and at exact boundaries of the cumulative weights the rule picks another
client: theta = 0.9 with 10 equal weights (in double, N_tot p falls just below N_tot / 10 and
eta is the smallest loss; in float32 just above, the second smallest), theta = 2/3 with 3
equal weights (double: just above N_tot / 3, the middle loss; float32: the smallest). A level
given as a Python float or a float64 array (e.g. from :func:`quantile_levels`) is therefore
compared in float64 (under ``jax.enable_x64`` locally, whatever the global setting):
cumulative integer weights are then exact and the target is the same double product as the
authors'. A float32 level keeps the float32 comparison (the run's percentile metrics use it).
At theta = 1 and 0.5 (and any theta whose 1 - theta and products are exact in float32) both
comparisons pick the same client, so those runs are unchanged bit for bit.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _sorted(values, weights):
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    order = jnp.argsort(values, stable=True)
    return values[order], weights[order]


def _is_float64(level) -> bool:
    """A level to compare in float64: a Python float (np.float64 included) or a float64 array."""
    if isinstance(level, float):
        return True
    return getattr(level, "dtype", None) == np.float64


def _first_reaching(w, level):
    """Index (into the sorted order) of the first positive weight whose cumulative sum reaches
    level * (sum of w); float64 arithmetic when the level is float64."""
    if _is_float64(level):
        # Only float64 arithmetic inside the x64 scope: integer ops (argmax, iota) lowered
        # there would mix int64 and int32 when the global setting is 32-bit.
        with jax.enable_x64(True):
            cum = jnp.cumsum(w.astype(jnp.float64))
            ok = (cum >= jnp.asarray(level, jnp.float64) * cum[-1]) & (w > 0)
        return jnp.argmax(ok)
    cum = jnp.cumsum(w)
    # Compare against the last cumulative sum rather than sum(w): the same float additions,
    # so level = 1 reaches exactly the last positive weight.
    target = jnp.asarray(level, cum.dtype) * cum[-1]
    ok = (cum >= target) & (w > 0)
    return jnp.argmax(ok)


def quantile_levels(thetas: Sequence[float]) -> Callable:
    """level(theta) -> 1 - theta in float64, for replicas that carry theta in float32.

    Replicas hold their hyper-parameters as float32 arrays, which loses the double value
    1 - theta that the authors' rule uses. This table remembers, for each theta of a run (the
    Python floats of ``--thetas``), 1 - theta computed on the host in float64, and looks it
    up from the float32 theta under jit and vmap. A theta missing from the table falls back to
    1 - float64(float32 theta). Two thetas with the same float32 value are refused.
    """
    thetas = tuple(float(t) for t in thetas)
    keys = np.asarray(thetas, np.float32)
    if len(set(keys.tolist())) != len(keys):
        raise ValueError(f"thetas {thetas} are not distinct in float32")
    levels = 1.0 - np.asarray(thetas, np.float64)

    def level(theta):
        theta = jnp.asarray(theta, jnp.float32)
        hit = jnp.asarray(keys) == theta            # at most one True: keys are distinct
        with jax.enable_x64(True):                  # float64 arithmetic only (no argmax)
            fallback = 1.0 - theta.astype(jnp.float64)
            if not thetas:
                return fallback
            found = jnp.sum(jnp.where(hit, jnp.asarray(levels, jnp.float64), 0.0))
            return jnp.where(jnp.any(hit), found, fallback)

    return level


def weighted_quantile(values, weights, level):
    """Weighted lower quantile.

    The smallest v_k such that the weight of {j : v_j <= v_k} is at least level * W.
    level = 0 gives the smallest value with positive weight, level = 1 the largest one.
    This is eta of Algorithm 2 (line 5) at level 1 - theta, and the reference code's rule
    eta = v[ceil(N_tot p) - 1] on losses repeated n_k times.

    Args:
      values: [N] values.
      weights: [N] non-negative weights, not all zero.
      level: scalar in [0, 1]; a Python float or a float64 array is compared in float64 (the
        authors' double-precision rule, see the module docstring), a float32 one in float32.
    Returns:
      scalar: the quantile, one of `values`.
    """
    v, w = _sorted(values, weights)
    return v[_first_reaching(w, level)]


def _tie_tolerance(eta, tie_rtol):
    return jnp.asarray(tie_rtol, eta.dtype) * jnp.abs(eta)


def _tail_split(values, weights, theta, tie_rtol, level):
    """(weights, above [N], tied [N], share): the values above eta = weighted_quantile(v, w,
    1 - theta), those tied at it, and the fraction (theta W - w_above) / w_tied of their
    weight that the tied values keep (:func:`tail_fractions`)."""
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    theta = jnp.asarray(theta, weights.dtype)
    total = jnp.sum(weights)
    eta = weighted_quantile(values, weights, 1.0 - theta if level is None else level)
    tol = _tie_tolerance(eta, tie_rtol)
    above = values > eta + tol
    tied = (jnp.abs(values - eta) <= tol) & (weights > 0)
    w_above = jnp.sum(jnp.where(above, weights, 0.0))
    w_tied = jnp.sum(jnp.where(tied, weights, 0.0))
    # Mass (in weight units) that the tied values may still take: theta W - w_above, which is
    # in [0, w_tied] by the quantile's definition; clip against rounding.
    rest = jnp.clip(theta * total - w_above, 0.0, w_tied)
    return weights, above, tied, rest / w_tied


def tail_fractions(values, weights, theta, tie_rtol=0.0, level=None):
    """The share m_k in [0, 1] of each weight that the superquantile LP's maximiser keeps:
    1 for v_k above eta = weighted_quantile(v, w, 1 - theta), the same fraction
    (theta W - w_above) / w_tied for the values tied at eta, 0 below; the tail weights are
    pi = w m / sum(w m) (:func:`tail_weights`), and sum_k w_k m_k = theta W. At theta = 1
    every m_k with a finite value and a positive weight is exactly 1. Arguments as
    :func:`tail_weights`'s; returns [N] m, in the order of `values`."""
    weights, above, tied, share = _tail_split(values, weights, theta, tie_rtol, level)
    return jnp.where(above, 1.0, jnp.where(tied, share, 0.0)).astype(weights.dtype)


def tail_weights(values, weights, theta, tie_rtol=0.0, level=None):
    """The maximising pi of the superquantile LP (the exact Delta-FL aggregation weights).

    pi_k = w_k / (theta W) for v_k above eta = weighted_quantile(v, w, 1 - theta); the values
    tied at eta share the remaining mass in proportion to their weights (so the boundary client
    gets a fraction); pi_k = 0 below eta. pi >= 0 and sums to 1 (theta = 1 gives w / W).

    Args:
      values: [N]; weights: [N] non-negative, not all zero; theta: scalar in (0, 1].
      tie_rtol: values within tie_rtol * |eta| of eta count as tied with it. 0 (the default)
        is the exact LP maximiser. Client losses that are equal in exact arithmetic (e.g. all
        log C at a zero initialisation) differ in float32 by summation noise; a small
        tolerance lets them share the boundary mass, so the choice does not depend on the
        order of additions.
      level: the quantile level of eta (None: 1 - theta in the weights' precision); pass
        ``quantile_levels(thetas)(theta)`` for the authors' double-precision 1 - theta.
    Returns:
      [N] pi, in the order of `values`: w m / sum(w m), m of :func:`tail_fractions`.
    """
    weights, above, tied, share = _tail_split(values, weights, theta, tie_rtol, level)
    # w m of :func:`tail_fractions`, written as a sum of the two cases: the product form
    # (w * 1.0 above eta) let XLA fuse the round differently on two devices than on one (a last
    # bit of one client's loss, tests/test_devices.py)
    pi = jnp.where(above, weights, 0.0) + jnp.where(tied, weights * share, 0.0)
    return pi / jnp.sum(pi)


def superquantile(values, weights, theta):
    """The (1 - theta)-superquantile max{sum pi_k v_k : pi in simplex, pi_k <= w_k/(theta W)}.

    theta = 1 is the weighted mean; theta -> 0 tends to the largest value. Exact for any
    theta (the boundary value gets a fractional weight) and for ties.
    """
    values = jnp.asarray(values)
    pi = tail_weights(values, weights, theta)
    return jnp.sum(pi * jnp.where(pi > 0, values, 0.0))


def superquantile_dual(values, weights, theta):
    """The same value from the dual form of Property 2, evaluated at eta = the quantile:
    eta + (1/theta) sum_k (w_k/W)(v_k - eta)_+ . Used to cross-check the primal form."""
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    eta = weighted_quantile(values, weights, 1.0 - theta)
    alpha = weights / jnp.sum(weights)
    return eta + jnp.sum(alpha * jnp.maximum(values - eta, 0.0)) / theta


def threshold_weights(values, weights, theta, tie_rtol=0.0, level=None):
    """The reference code's filter: every value >= eta keeps its full weight (ties and the
    boundary included, so the kept mass may exceed theta). Returns [N] weights (not
    normalised), zero for the filtered-out values. `tie_rtol` and `level` as in
    :func:`tail_weights`."""
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    if level is None:
        level = 1.0 - jnp.asarray(theta, weights.dtype)
    eta = weighted_quantile(values, weights, level)
    return jnp.where(values >= eta - _tie_tolerance(eta, tie_rtol), weights, 0.0)


# ----------------------------------------------------------------------------- smoothing


def smoothing_slope(rho, nu):
    """g_nu'(rho) of eq. 6: 0 for rho <= 0, rho / nu on (0, nu], 1 above: the weight that the
    smoothed superquantile gives to a value rho above eta (the derivative of g_nu)."""
    return jnp.clip(rho / nu, 0.0, 1.0)


def smoothing_function(rho, nu):
    """g_nu(rho) of eq. 6: nu/2 for rho <= 0, rho^2/(2 nu) + nu/2 on (0, nu], rho above."""
    return jnp.where(rho <= 0, 0.5 * nu,
                     jnp.where(rho <= nu, rho * rho / (2.0 * nu) + 0.5 * nu, rho))


def smoothed_eta(values, weights, theta, nu):
    """A minimiser eta* of h(eta) = eta + (1/theta) sum_k alpha_k g_nu(v_k - eta) (Property 9).

    h' is continuous, non-decreasing and piecewise linear with breakpoints at v_k and
    v_k - nu; following the proof of Property 9, a = the smallest breakpoint with h' >= 0 and
    b = the largest with h' <= 0; eta* = a when h'(a) = 0, else the zero of the linear piece
    between b and a. alpha_k = w_k / sum(w); entries with weight 0 are ignored.
    """
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    alpha = weights / jnp.sum(weights)

    def slope(eta):                                       # [S] -> [S] h'(eta)
        g = smoothing_slope(values[None, :] - eta[:, None], nu)
        return 1.0 - jnp.sum(alpha[None, :] * g, axis=1) / theta

    points = jnp.concatenate([values, values - nu])
    d = slope(points)
    a = jnp.min(jnp.where(d >= 0, points, jnp.inf))
    has_b = jnp.any(d <= 0)
    b = jnp.max(jnp.where(d <= 0, points, -jnp.inf))
    da, db = slope(a[None])[0], slope(jnp.where(has_b, b, a)[None])[0]
    between = b + (-db) * (a - b) / jnp.where(da > db, da - db, 1.0)
    return jnp.where((da > 0) & has_b & (da > db), between, a)


def smoothed_tail_weights(values, weights, theta, nu):
    """The aggregation weights of the smoothed superquantile: pi_k proportional to
    alpha_k g_nu'(v_k - eta*) with eta* of :func:`smoothed_eta`, the gradient weights of
    F_{theta,nu} (eqs. 5-7: grad = (1/theta) sum_k alpha_k g_nu'(F_k - eta*) grad F_k, whose
    weights sum to 1 at eta*). When nu is below the gaps between the values these are exactly
    :func:`tail_weights` (the boundary value's g_nu' is its fraction); nu -> 0 recovers the
    exact filter. Returns [N] pi, summing to 1."""
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    eta = smoothed_eta(values, weights, theta, nu)
    pi = jnp.where(weights > 0, weights * smoothing_slope(values - eta, nu), 0.0)
    return pi / jnp.sum(pi)


def smoothed_superquantile(values, weights, theta, nu):
    """F_{theta,nu} = min_eta eta + (1/theta) sum_k alpha_k g_nu(v_k - eta) (eqs. 5-7)."""
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    alpha = weights / jnp.sum(weights)
    eta = smoothed_eta(values, weights, theta, nu)
    return eta + jnp.sum(alpha * smoothing_function(values - eta, nu)) / theta


__all__ = [
    "quantile_levels",
    "weighted_quantile",
    "superquantile",
    "superquantile_dual",
    "tail_weights",
    "tail_fractions",
    "threshold_weights",
    "smoothed_eta",
    "smoothed_tail_weights",
    "smoothed_superquantile",
]
