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
"""

from __future__ import annotations

import jax.numpy as jnp


def _sorted(values, weights):
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    order = jnp.argsort(values, stable=True)
    return values[order], weights[order]


def weighted_quantile(values, weights, level):
    """Weighted lower quantile.

    The smallest v_k such that the weight of {j : v_j <= v_k} is at least level * W.
    level = 0 gives the smallest value with positive weight, level = 1 the largest one.
    This is eta of Algorithm 2 (line 5) at level 1 - theta, and the reference code's rule
    eta = v[ceil(N_tot p) - 1] on losses repeated n_k times.

    Args:
      values: [N] values.
      weights: [N] non-negative weights, not all zero.
      level: scalar in [0, 1].
    Returns:
      scalar: the quantile, one of `values`.
    """
    v, w = _sorted(values, weights)
    cum = jnp.cumsum(w)
    # Compare against the last cumulative sum rather than sum(w): the same float additions,
    # so level = 1 reaches exactly the last positive weight.
    target = jnp.asarray(level, cum.dtype) * cum[-1]
    ok = (cum >= target) & (w > 0)
    return v[jnp.argmax(ok)]


def _tie_tolerance(eta, tie_rtol):
    return jnp.asarray(tie_rtol, eta.dtype) * jnp.abs(eta)


def tail_weights(values, weights, theta, tie_rtol=0.0):
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
    Returns:
      [N] pi, in the order of `values`.
    """
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    theta = jnp.asarray(theta, weights.dtype)
    total = jnp.sum(weights)
    eta = weighted_quantile(values, weights, 1.0 - theta)
    tol = _tie_tolerance(eta, tie_rtol)
    above = values > eta + tol
    tied = (jnp.abs(values - eta) <= tol) & (weights > 0)
    w_above = jnp.sum(jnp.where(above, weights, 0.0))
    w_tied = jnp.sum(jnp.where(tied, weights, 0.0))
    # Mass (in weight units) that the tied values may still take: theta W - w_above, which is
    # in [0, w_tied] by the quantile's definition; clip against rounding.
    rest = jnp.clip(theta * total - w_above, 0.0, w_tied)
    pi = jnp.where(above, weights, 0.0) + jnp.where(tied, weights * (rest / w_tied), 0.0)
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


def threshold_weights(values, weights, theta, tie_rtol=0.0):
    """The reference code's filter: every value >= eta keeps its full weight (ties and the
    boundary included, so the kept mass may exceed theta). Returns [N] weights (not
    normalised), zero for the filtered-out values. `tie_rtol` as in :func:`tail_weights`."""
    values = jnp.asarray(values)
    weights = jnp.asarray(weights, dtype=jnp.result_type(values.dtype, jnp.float32))
    eta = weighted_quantile(values, weights, 1.0 - jnp.asarray(theta, weights.dtype))
    return jnp.where(values >= eta - _tie_tolerance(eta, tie_rtol), weights, 0.0)


__all__ = [
    "weighted_quantile",
    "superquantile",
    "superquantile_dual",
    "tail_weights",
    "threshold_weights",
]
