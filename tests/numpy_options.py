"""Independent NumPy (float64) versions of Delta-FL's round options and of Delta-FL with an
alternating eta (deltafl_alt), written from the papers' equations, not from deltafl_jax's code:

- the smoothed superquantile (long paper, eqs. 5-7 and Property 9): g_nu, g_nu', and eta* by
  bisection on h'(eta) = 1 - (1/theta) sum_k alpha_k g_nu'(x_k - eta), which is continuous and
  non-decreasing (no breakpoint formula);
- the quantile by majorisation-minimisation (App. B.1, eq. 17 with 2q - 1 = 2 tau - 1);
- a round loop over clients with a given weight rule (the engine's sampling and example
  orders are shared, as in numpy_reference.py).
"""

import math

import numpy as np

from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import client_loss, grad_mean_xent, local_sgd


def g_nu(rho, nu):
    rho = np.asarray(rho, np.float64)
    return np.where(rho <= 0, nu / 2, np.where(rho <= nu, rho ** 2 / (2 * nu) + nu / 2, rho))


def g_nu_prime(rho, nu):
    rho = np.asarray(rho, np.float64)
    return np.where(rho <= 0, 0.0, np.where(rho <= nu, rho / nu, 1.0))


def smoothed_eta(x, alpha, theta, nu, iters=200):
    """The smallest root of h'(eta) = 0 by bisection (h' is non-decreasing)."""
    x = np.asarray(x, np.float64)
    alpha = np.asarray(alpha, np.float64) / np.sum(alpha)

    def h_prime(eta):
        return 1.0 - np.sum(alpha * g_nu_prime(x - eta, nu)) / theta

    lo, hi = x.min() - nu - 1.0, x.max() + 1.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if h_prime(mid) < 0:
            lo = mid
        else:
            hi = mid
    return hi


def smoothed_objective(x, alpha, theta, nu):
    """F_{theta,nu} = min_eta eta + (1/theta) sum alpha_k g_nu(x_k - eta), and eta*."""
    alpha = np.asarray(alpha, np.float64) / np.sum(alpha)
    eta = smoothed_eta(x, alpha, theta, nu)
    return eta + np.sum(alpha * g_nu(np.asarray(x) - eta, nu)) / theta, eta


def smoothed_weights(x, alpha, theta, nu):
    """pi_k = alpha_k g_nu'(x_k - eta*) / theta (they sum to 1 at eta*)."""
    alpha = np.asarray(alpha, np.float64) / np.sum(alpha)
    eta = smoothed_eta(x, alpha, theta, nu)
    return alpha * g_nu_prime(np.asarray(x) - eta, nu) / theta


def mm_quantile(x, alpha, tau, iters):
    """Eq. 17 from mu_0 = the weighted mean: mu <- (sum beta x + (2 tau - 1) sum alpha) /
    sum beta, beta_k = alpha_k / |x_k - mu|; mu stays when it equals some x_k."""
    x = np.asarray(x, np.float64)
    alpha = np.asarray(alpha, np.float64)
    mu = np.sum(alpha * x) / np.sum(alpha)
    for _ in range(iters):
        d = np.abs(x - mu)
        if np.any(d == 0):
            continue
        beta = alpha / d
        mu = (np.sum(beta * x) + (2 * tau - 1) * np.sum(alpha)) / np.sum(beta)
    return mu


def lower_quantile(x, alpha, tau):
    """The smallest x_k whose cumulative weight (sorted) reaches tau * sum(alpha)."""
    order = np.argsort(x, kind="stable")
    cum = np.cumsum(np.asarray(alpha, np.float64)[order])
    return np.asarray(x)[order][np.argmax(cum >= tau * cum[-1])]


def authors_eta(F, n, theta):
    """The reference code: losses repeated n_k times, eta = sorted[ceil(N p) - 1], p = 1 - th."""
    p = 1.0 - theta
    rep = np.sort(np.repeat(F, np.asarray(n, np.int64)))
    return rep[0] if p == 0 else rep[math.ceil(rep.size * p) - 1]


def weighted_round(W, b, xs, ys, seed, t, m, lr, l2, batch, rule, epochs=1):
    """One round: sample, F_k, a = rule(F, n), local SGD on the clients with a_k > 0, then
    w + sum a_k (w_k - w) / sum a_k (w unchanged when no client has a_k > 0).
    Returns (W, b, F, a)."""
    chosen = sample_clients(seed, t, len(xs), m)
    n = np.array([len(ys[k]) for k in chosen], np.float64)
    F = np.array([client_loss(W, b, xs[k], ys[k], l2) for k in chosen])
    a = np.asarray(rule(F, n), np.float64)
    dW, db, total = np.zeros_like(W), np.zeros_like(b), 0.0
    for slot, k in enumerate(chosen):
        if a[slot] <= 0:
            continue
        order = client_permutations(seed, t, int(k), len(ys[k]), epochs)
        Wk, bk = local_sgd(W, b, xs[k], ys[k], order, lr, l2, batch, epochs=epochs)
        dW += a[slot] * (Wk - W)
        db += a[slot] * (bk - b)
        total += a[slot]
    if total == 0:
        return W, b, F, a
    return W + dW / total, b + db / total, F, a


def full_gradient(W, b, xs, ys, l2, pi):
    """sum_k pi_k grad F_k(w) over all clients (F_k with (l2/2)||w||^2)."""
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for k, p in enumerate(pi):
        if p > 0:
            kW, kb = grad_mean_xent(W, b, xs[k], ys[k])
            gW += p * (kW + l2 * W)
            gb += p * (kb + l2 * b)
    return gW, gb
