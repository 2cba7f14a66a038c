"""An independent NumPy implementation of Delta-FL rounds for softmax regression.

Written the way the authors' reference code works: a plain loop over the sampled clients,
F_k on each client's whole data, the filter, one local loop of minibatch SGD per kept client,
then a weighted average. It shares with the engine only the *random draws* (which clients are
sampled and the order of each client's examples, from deltafl_jax.sampling.plan), so the comparison
checks the algorithm, not the randomness.
"""

import math

import numpy as np

from deltafl_jax.sampling.plan import client_permutations, sample_clients


def scores(W, b, x):
    """Class scores <w_c, x> (+ b_c). b is None for the paper's linear model (App. C.1.1:
    w in R^{62 x 784}, score_c = <w_c, x>, no bias)."""
    return x @ W if b is None else x @ W + b


def softmax_xent(W, b, x, y):
    z = scores(W, b, x)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(y)), y]


def client_loss(W, b, x, y, l2):
    """F_k(w) + (lambda/2)||w||^2, w being every parameter (W, and b when there is one)."""
    sq = np.sum(W * W) + (0.0 if b is None else np.sum(b * b))
    return softmax_xent(W, b, x, y).mean() + 0.5 * l2 * sq


def grad_mean_xent(W, b, x, y):
    z = scores(W, b, x)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return x.T @ p, (None if b is None else p.sum(axis=0))


TIE_RTOL = 1e-5


def exact_weights(F, n, theta):
    """Greedy from the largest loss: fill caps n_k / (theta N) until the mass reaches 1.
    The losses within TIE_RTOL of the boundary loss form one group that shares what is left
    in proportion to n_k (the symmetric maximiser of the LP when the boundary falls on a tie,
    e.g. at a zero initialisation where every loss is log C up to rounding)."""
    caps = n / (theta * n.sum())
    order = np.argsort(-F, kind="stable")
    mass, boundary = 0.0, F[order[-1]]
    for k in order:              # find the loss at which the mass reaches 1
        mass += caps[k]
        if mass >= 1.0 - 1e-12:
            boundary = F[k]
            break
    tol = TIE_RTOL * abs(boundary)
    above = F > boundary + tol
    group = np.abs(F - boundary) <= tol
    pi = np.where(above, caps, 0.0)
    rest = min(max(0.0, 1.0 - pi.sum()), caps[group].sum())
    pi[group] = caps[group] * rest / caps[group].sum()
    return pi


def reference_weights(F, n, theta):
    """The reference code: repeat each loss n_k times, eta = sorted[ceil(N p) - 1], keep
    F_k >= eta with weight n_k."""
    p = 1.0 - theta
    rep = np.sort(np.repeat(F, n.astype(int)))
    eta = rep[0] if p == 0 else rep[math.ceil(rep.size * p) - 1]
    return np.where(F >= eta - TIE_RTOL * abs(eta), n, 0.0)


def local_sgd(W, b, x, y, order, lr, l2, batch, epochs=None, steps=None):
    """Minibatch SGD in the given example order; w <- (1 - lr l2) w - lr grad."""
    n = len(y)
    if steps is None:
        batches = [order[e * n:(e + 1) * n][s:s + batch]
                   for e in range(epochs) for s in range(0, n, batch)]
    else:
        batches = [order[s * batch:(s + 1) * batch] for s in range(steps)]
    for idx in batches:
        gW, gb = grad_mean_xent(W, b, x[idx], y[idx])
        W = W - lr * (gW + l2 * W)
        if b is not None:
            b = b - lr * (gb + l2 * b)
    return W, b


def delta_fl_round(W, b, xs, ys, seed, t, m, theta, filter, lr, l2, batch, epochs=1,
                   steps=None):
    """One round; xs/ys: lists of per-client arrays; b None = no bias. Returns
    (W, b, F, weights)."""
    chosen = sample_clients(seed, t, len(xs), m)
    n = np.array([len(ys[k]) for k in chosen], np.float64)
    F = np.array([client_loss(W, b, xs[k], ys[k], l2) for k in chosen])
    a = exact_weights(F, n, theta) if filter == "exact" else reference_weights(F, n, theta)
    dW, db, total = np.zeros_like(W), (None if b is None else np.zeros_like(b)), 0.0
    for slot, k in enumerate(chosen):
        if a[slot] <= 0:
            continue
        nk = len(ys[k])
        reps = epochs if steps is None else -(-(steps * batch) // nk)
        order = client_permutations(seed, t, int(k), nk, reps)
        Wk, bk = local_sgd(W, b, xs[k], ys[k], order, lr, l2, batch,
                           epochs=epochs if steps is None else None, steps=steps)
        dW += a[slot] * (Wk - W)
        if b is not None:
            db += a[slot] * (bk - b)
        total += a[slot]
    return W + dW / total, (None if b is None else b + db / total), F, a
