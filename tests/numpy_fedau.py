"""NumPy loops of FedAU, known-probability weighting, MIFA and FedVARP, written from the
authors' code of FedAU (IBM/fedau at commit 6e9cce9b2e568666b5c3e0fab8f092a539884d7b,
``main.py``: ``-weighting adaptive | known_prob | mifa | fedvarp``), in float64, over an
explicit participation matrix ``took_part`` [rounds, N] (bool: client i trains in round t).

They keep the authors' per-round, per-client state: every client's counter moves every round
(the package's O(m) lazy form must give the same weights); MIFA's average is recomputed over all
N stored updates every round (the package keeps a running sum). ``local(params, i, t)`` is the
client's update Delta_i = y_i - x_t; ``beta`` [N] the population weights, 1/N (the authors') or
n_i / n."""

from __future__ import annotations

import numpy as np

from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import local_sgd


class AdaptiveWeights:
    """The authors' estimate of the participation interval (``-weighting adaptive``): a counter
    of rounds not taken part per client (0 before round 0), a list of recorded intervals."""

    def __init__(self, num_clients, cap=0):
        self.count = [0] * num_clients
        self.intervals = [[] for _ in range(num_clients)]
        self.cap = cap if cap > 0 else 10 ** 9

    def round(self, took_part):
        """[N] omega of the clients that take part (NaN for the others); the state moves on."""
        omega = np.full(len(self.count), np.nan)
        for i, part in enumerate(took_part):
            if part:
                omega[i] = np.mean(self.intervals[i]) if self.intervals[i] else 1.0
                self.intervals[i].append(self.count[i] + 1)
                self.count[i] = 0
            else:
                self.count[i] += 1
                if self.count[i] >= self.cap:
                    self.intervals[i].append(self.count[i])
                    self.count[i] = 0
        return omega


def _step(params, eta_g, direction):
    return [p + eta_g * d for p, d in zip(params, direction)]


def _zeros(params):
    return [np.zeros_like(p) for p in params]


def fedau(params, took_part, local, beta, eta_g=1.0, cap=0, inverse_p=None):
    """x <- x + eta_g sum_{i took part} beta_i omega_i Delta_i; omega from
    :class:`AdaptiveWeights`, or 1/p_i (``inverse_p`` [N]: ``-weighting known_prob``).
    Returns (params, [rounds, N] the omega used, NaN where not taken part)."""
    est, used = AdaptiveWeights(len(beta), cap), []
    for t, row in enumerate(took_part):
        omega = est.round(row)
        if inverse_p is not None:
            omega = np.where(row, inverse_p, np.nan)
        used.append(omega)
        acc = _zeros(params)
        for i in np.flatnonzero(row):
            acc = [a + beta[i] * omega[i] * d for a, d in zip(acc, local(params, i, t))]
        params = _step(params, eta_g, acc)
    return params, np.array(used)


def mifa(params, took_part, local, beta, eta_g=1.0):
    """G_i <- Delta_i for the clients that take part; x <- x + eta_g sum_i beta_i G_i over all
    N, every round. Returns (params, G)."""
    G = [_zeros(params) for _ in beta]
    for t, row in enumerate(took_part):
        for i in np.flatnonzero(row):
            G[i] = local(params, i, t)
        avg = [sum(beta[i] * G[i][j] for i in range(len(beta))) for j in range(len(params))]
        params = _step(params, eta_g, avg)
    return params, G


def fedvarp(params, took_part, local, beta, a, eta_g=1.0):
    """v = sum_i beta_i y_i (before the round) + the a-weighted mean over the cohort of
    Delta_i - y_i; y_i <- Delta_i; x <- x + eta_g v, or no step in a round with no client.
    Returns (params, y)."""
    y = [_zeros(params) for _ in beta]
    for t, row in enumerate(took_part):
        chosen = np.flatnonzero(row)
        if chosen.size == 0:
            continue
        S = [sum(beta[i] * y[i][j] for i in range(len(beta))) for j in range(len(params))]
        new = {int(i): local(params, i, t) for i in chosen}
        w = np.array([a[i] for i in chosen], np.float64)
        corr = [sum(wk * (new[int(i)][j] - y[i][j]) for wk, i in zip(w, chosen)) / w.sum()
                for j in range(len(params))]
        for i, d in new.items():
            y[i] = d
        params = _step(params, eta_g, [s + c for s, c in zip(S, corr)])
    return params, y


def sampled_matrix(seed, rounds, num_clients, m):
    """[rounds, N] bool: the clients that the uniform sampler draws in each round."""
    out = np.zeros((rounds, num_clients), bool)
    for t in range(rounds):
        out[t, sample_clients(seed, t, num_clients, m)] = True
    return out


def local_fn(xs, ys, seed, lr, l2, batch, epochs):
    """local(params, i, t) -> [dW, db]: the engine's local SGD of client i in round t (its
    example order from deltafl_jax.sampling.plan), in float64."""
    def local(params, i, t):
        W, b = params
        order = client_permutations(seed, t, int(i), len(ys[i]), epochs)
        W2, b2 = local_sgd(W, b, xs[i], ys[i], order, lr, l2, batch, epochs=epochs)
        return [W2 - W, b2 - b]
    return local
