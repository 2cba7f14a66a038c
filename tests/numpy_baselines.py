"""Independent NumPy implementations of one round of each baseline, for softmax regression.

Written from the update rules of shared/reference-notes.md ("Baselines", from their reference
code) as plain float64 loops over clients, the way the baselines' reference code is written;
not from deltafl_jax's code. As in numpy_reference.py, the only thing shared with the engine is
the *random draws*: the sampled clients and each client's example order (deltafl_jax.sampling.plan),
and for FedAvg-Sub the uniform draws of the replica's round key (:func:`subset_draws`), from
which the subset is chosen here.

Conventions of the engine that these loops follow (documented in deltafl_jax/sampling/plan.py and
deltafl_jax/algorithms/protocol.py, each baseline in its own deltafl_jax/algorithms/NAME.py):
clients are sampled uniformly without replacement and weighted by n_k; F_k is the mean loss on
the client's whole data (+ (l2/2)||w||^2); local SGD steps are
w <- w - lr (grad + l2 w [+ mu (w - w_t)]).
"""

import math

import jax
import numpy as np

from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import client_loss, exact_weights, grad_mean_xent, reference_weights


def subset_draws(seed, t, m):
    """The m uniform draws of FedAvg-Sub in round t of a replica with this seed (its round key
    is the seed's key folded with t)."""
    key = jax.random.fold_in(jax.random.key(seed), t)
    return np.asarray(jax.random.uniform(key, (m,)), np.float64)


def local_prox_sgd(W, b, x, y, order, lr, l2, mu, batch, epochs):
    """`epochs` passes of minibatch SGD in the given order, from (W, b) = w_t, on
    F_k(w) + (mu/2)||w - w_t||^2 with weight decay l2."""
    W0, b0 = W, b
    n = len(y)
    for e in range(epochs):
        for s in range(0, n, batch):
            idx = order[e * n:(e + 1) * n][s:s + batch]
            gW, gb = grad_mean_xent(W, b, x[idx], y[idx])
            W = W - lr * (gW + l2 * W + mu * (W - W0))
            b = b - lr * (gb + l2 * b + mu * (b - b0))
    return W, b


def _sampled(W, b, xs, ys, seed, t, m, l2):
    chosen = sample_clients(seed, t, len(xs), m)
    n = np.array([len(ys[k]) for k in chosen], np.float64)
    F = np.array([client_loss(W, b, xs[k], ys[k], l2) for k in chosen])
    return chosen, n, F


def _local(W, b, xs, ys, k, seed, t, lr, l2, batch, epochs=1, mu=0.0):
    order = client_permutations(seed, t, int(k), len(ys[k]), epochs)
    return local_prox_sgd(W, b, xs[k], ys[k], order, lr, l2, mu, batch, epochs)


def fedavg_sub_round(W, b, xs, ys, seed, t, m, lr, l2, batch, count=None, theta=None,
                     filter="exact"):
    """FedAvg on the `count` sampled clients with the smallest draws; count = the number of
    clients the Delta-FL filter keeps at theta when `count` is None. Returns (W, b, kept)."""
    chosen, n, F = _sampled(W, b, xs, ys, seed, t, m, l2)
    if count is None:
        keep = exact_weights(F, n, theta) if filter == "exact" else reference_weights(F, n, theta)
        count = int(np.sum(keep > 0))
    slots = np.argsort(subset_draws(seed, t, m), kind="stable")[:count]
    num_W, num_b = np.zeros_like(W), np.zeros_like(b)
    for s in slots:
        Wk, bk = _local(W, b, xs, ys, chosen[s], seed, t, lr, l2, batch)
        num_W += n[s] * Wk
        num_b += n[s] * bk
    total = n[slots].sum()
    return num_W / total, num_b / total, len(slots)


def fedprox_round(W, b, xs, ys, seed, t, m, lr, l2, mu, batch, epochs=1):
    """Every sampled client minimises F_k + (mu/2)||w - w_t||^2; models averaged by n_k."""
    chosen, n, _ = _sampled(W, b, xs, ys, seed, t, m, l2)
    models = [_local(W, b, xs, ys, k, seed, t, lr, l2, batch, epochs, mu) for k in chosen]
    W_new = sum(nk * Wk for nk, (Wk, _) in zip(n, models)) / n.sum()
    b_new = sum(nk * bk for nk, (_, bk) in zip(n, models)) / n.sum()
    return W_new, b_new


def qffl_round(W, b, xs, ys, seed, t, m, lr, l2, q, batch):
    """q-FedAvg: L = 1/lr, Delta_k = L (w - w_k), h_k = q (F_k+1e-10)^(q-1) ||Delta_k||^2
    + L (F_k+1e-10)^q, w <- w - sum n_k F^q Delta_k / sum n_k h_k. Returns (W, b, models)."""
    chosen, n, F = _sampled(W, b, xs, ys, seed, t, m, l2)
    L = 1.0 / lr
    num_W, num_b, den = np.zeros_like(W), np.zeros_like(b), 0.0
    models = []
    for nk, Fk, k in zip(n, F, chosen):
        Wk, bk = _local(W, b, xs, ys, k, seed, t, lr, l2, batch)
        models.append((nk, Wk, bk))
        dW, db = L * (W - Wk), L * (b - bk)
        Fq = np.float_power(Fk + 1e-10, q)
        num_W += nk * Fq * dW
        num_b += nk * Fq * db
        sq = np.sum(dW ** 2) + np.sum(db ** 2)
        den += nk * (q * np.float_power(Fk + 1e-10, q - 1) * sq + L * Fq)
    return W - num_W / den, b - num_b / den, models


def project_simplex_bisection(v, iters=200):
    """argmin_{p in simplex} ||p - v||: p = max(v - tau, 0) with sum p = 1; tau by bisection."""
    lo, hi = v.min() - 1.0, v.max()
    for _ in range(iters):
        tau = 0.5 * (lo + hi)
        if np.maximum(v - tau, 0.0).sum() > 1.0:
            lo = tau
        else:
            hi = tau
    p = np.maximum(v - 0.5 * (lo + hi), 0.0)
    return p / p.sum()


def afl_round(W, b, lam, xs, ys, seed, t, lr, l2, lambda_lr, batch):
    """AFL with every client: one minibatch gradient g_k at w per client (its first `batch`
    examples in this round's order), w <- w - lr sum_k lam_k (g_k + l2 w) / sum_k lam_k,
    lam <- Proj(lam + lambda_lr F(w)). Returns (W, b, lam)."""
    N = len(xs)
    chosen = sample_clients(seed, t, N, N)
    assert np.array_equal(chosen, np.arange(N))
    F = np.array([client_loss(W, b, xs[k], ys[k], l2) for k in range(N)])
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for k in range(N):
        if lam[k] <= 0:
            continue
        nk = len(ys[k])
        idx = client_permutations(seed, t, k, nk, math.ceil(batch / nk))[:batch]
        g1, g2 = grad_mean_xent(W, b, xs[k][idx], ys[k][idx])
        gW += lam[k] * (g1 + l2 * W)
        gb += lam[k] * (g2 + l2 * b)
    total = lam[lam > 0].sum()
    W_new, b_new = W - lr * gW / total, b - lr * gb / total
    return W_new, b_new, project_simplex_bisection(lam + lambda_lr * F)


def term_round(W, b, estimate, first, xs, ys, seed, t, m, lr, l2, tilt, batch):
    """Tilted-ERM: e_k = exp(tilt (F_k - max F)); E = mean_n(e) on the first round, else
    0.5 E + 0.5 mean_n(e); w <- w + sum n_k (e_k / E) (w_k - w) / sum n_k.
    Returns (W, b, E)."""
    chosen, n, F = _sampled(W, b, xs, ys, seed, t, m, l2)
    shift = F.max() if tilt >= 0 else F.min()
    e = np.exp(tilt * (F - shift))
    mean = np.sum(n * e) / n.sum()
    estimate = mean if first else 0.5 * estimate + 0.5 * mean
    dW, db = np.zeros_like(W), np.zeros_like(b)
    for nk, ek, k in zip(n, e, chosen):
        Wk, bk = _local(W, b, xs, ys, k, seed, t, lr, l2, batch)
        dW += nk * ek / estimate * (Wk - W)
        db += nk * ek / estimate * (bk - b)
    return W + dW / n.sum(), b + db / n.sum(), estimate
