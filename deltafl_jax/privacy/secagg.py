"""The quantile of the clients' losses through secure aggregation only (Delta-FL long version,
App. B.1 and Algorithm 3).

Secure aggregation lets the server learn the sum of vectors held by the sampled clients and
nothing else. It is simulated here as :func:`secure_sum`, a plain sum (the protocol's pairwise
masks cancel exactly in its modular sum, so the simulation leaves them out); every number the
server uses to find eta is the output of one such call, and the calls are counted.

The tau-quantile (tau = 1 - theta) minimises H_tau(mu) = sum_k alpha_k h_tau(x_k - mu) with
h_tau(rho) = tau rho for rho >= 0 and -(1 - tau) rho below. Majorisation-minimisation with the
quadratic surrogate of App. B.1 gives eq. 17, where the paper's "2q - 1" is (2 tau - 1) (the
surrogate's linear term is (4 tau - 2)/4):

    mu_{t+1} = (sum_k beta_k x_k + (2 tau - 1) sum_k alpha_k) / sum_k beta_k,
    beta_k = alpha_k / |x_k - mu_t|,

and mu_{t+1} = mu_t when mu_t equals some x_k. alpha_k are the unnormalised weights (n_k, or 1
unweighted), hence the factor sum_k alpha_k, learnt in the first call together with
sum_k alpha_k x_k, whose ratio is the starting point mu_0 (the weighted mean). One MM step is
one call: each client sends (beta_k x_k, beta_k, [x_k = mu_t]) for the mu_t broadcast to it.

Behaviour (derived from eq. 17 and checked in tests/test_round_options.py): near the quantile
x_j, mu_t - x_j shrinks by |2 tau - c_{j-1} - c_j| / alpha_j per step (c: normalised
cumulative weights, alpha_j: x_j's share), and after one step stays on the side of that
factor's sign: fast when tau lies inside x_j's jump (c_{j-1}, c_j], slow at its edges. In
float32 a step from mu_t at distance d of some x_k has relative error ~ ulp(x) / d. Since
Algorithm 3's clients pass when F_k > eta strictly, the boundary client x_j trains when eta
approaches it from below, i.e. when more than half of its weight lies above tau: the kept set
tends to the exact filter's with x_j's fraction rounded to 0 or 1, until float32 reaches x_j
itself (then mu stays there and x_j is dropped). If all losses tie exactly (a zero-initialised
linear model in exact arithmetic) mu_0 equals them, eta stays there and no client passes, so
w would never move; in float32, summation noise in the losses lets some pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp


def secure_sum(contributions: jax.Array) -> jax.Array:
    """[m, d] one vector per sampled client -> [d] their sum: all that one secure-aggregation
    call reveals to the server."""
    return jnp.sum(contributions, axis=0)


class SumNoise(NamedTuple):
    """Gaussian noise on every secure sum of :func:`mm_quantile`, for differential privacy
    (:mod:`deltafl_jax.privacy.dp`; weights must be at most 1).

    key: the replica's round key (each call folds in its index). multiplier: z_q, the noise
    std in units of each call's L2 sensitivity. bound: B, the values are clipped to [0, B].
    floor: xi > 0, beta_k = w_k / max(|x_k - mu|, xi) (0 only without noise: the plain MM).
    A client moves the first call's sum (w x, w) by at most sqrt(B^2 + 1) and each step's
    (beta x, beta) by at most sqrt(B^2 + 1) / xi.
    """

    key: jax.Array
    multiplier: jax.Array
    bound: float
    floor: float


def _noised(s, noise: Optional[SumNoise], call: int, sensitivity: float):
    """s [2+] with N(0, (z_q sensitivity)^2) added to its first two entries."""
    if noise is None:
        return s
    std = noise.multiplier * sensitivity if math.isfinite(sensitivity) else 0.0
    draw = jax.random.normal(jax.random.fold_in(noise.key, call), (2,), s.dtype)
    return s.at[:2].add(std * draw)


def mm_quantile(values, weights, tau, iters: int, noise: Optional[SumNoise] = None
                ) -> Tuple[jax.Array, int]:
    """(eta, calls): the tau-quantile of `values` with `weights` (>= 0; 0 = padding) after
    `iters` MM steps of eq. 17 from the weighted mean, and the number of secure-aggregation
    calls it made (iters + 1). With `noise`, every call's sum is noised (:class:`SumNoise`);
    with zero noise, a bound above every value and floor 0 it is the plain MM, bit for bit."""
    x = jnp.asarray(values, jnp.float32)
    w = jnp.asarray(weights, jnp.float32)
    tau = jnp.asarray(tau, jnp.float32)
    floor, sens = 0.0, math.inf
    if noise is not None:   # a NaN or infinite loss counts as B
        x = jnp.clip(jnp.nan_to_num(x, nan=noise.bound, posinf=noise.bound, neginf=0.0), 0.0,
                     noise.bound)
        floor, reach = float(noise.floor), math.sqrt(noise.bound ** 2 + 1.0)
        sens = reach / floor if floor > 0 else math.inf
    first = _noised(secure_sum(jnp.stack([w * x, w], axis=1)), noise, 0, reach
                    if noise is not None else 0.0)
    total = first[1]
    mu0 = first[0] / total

    def step(mu, i):
        diff = jnp.abs(x - mu)
        hit = (diff == 0) & (w > 0) if floor == 0 else jnp.zeros_like(w, bool)
        scale = jnp.maximum(diff, floor) if floor > 0 else jnp.where(diff > 0, diff, 1.0)
        beta = jnp.where(hit | (w <= 0), 0.0, w / scale)
        s = secure_sum(jnp.stack([beta * x, beta, hit.astype(jnp.float32)], axis=1))
        s = _noised(s, noise, i + 1, sens)
        new = (s[0] + (2.0 * tau - 1.0) * total) / s[1]
        return jnp.where(s[2] > 0, mu, new), None

    mu, _ = jax.lax.scan(step, mu0, jnp.arange(iters))
    return mu, iters + 1
