"""Independent NumPy loops, in float64, for the server optimizers of Reddi et al., *Adaptive
Federated Optimization* (ICLR 2021, Algorithm 2: FedAdagrad, FedYogi, FedAdam; FedAvgM as
their momentum baseline) and for SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1,
option II), for softmax regression.

Written from the papers' pseudo-code, not from deltafl_jax's code: a loop over the sampled
clients, local minibatch SGD, then the server's step. As in numpy_reference.py, the only thing
shared with the engine is the random draws (the sampled clients and each client's example
order, from deltafl_jax.plan).
"""

import numpy as np

from deltafl_jax.plan import client_permutations, sample_clients
from numpy_reference import grad_mean_xent


class FedOpt:
    """Algorithm 2's server: x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau), with m_{-1} = 0,
    v_{-1} = tau^2 and no bias correction; FedAvgM: v <- beta v + Delta, x <- x + eta v;
    sgd: x <- x + eta Delta."""

    def __init__(self, kind, eta, beta1=0.9, beta2=0.99, tau=1e-3, momentum=0.9):
        self.kind, self.eta, self.b1, self.b2, self.tau = kind, eta, beta1, beta2, tau
        self.beta = momentum
        self.m = self.v = None

    def step(self, x, delta):
        """x, delta: lists of arrays (the parameters and Delta_t)."""
        if self.m is None:
            self.m = [np.zeros_like(d) for d in delta]
            self.v = [np.full_like(d, self.tau ** 2) for d in delta]
        if self.kind == "sgd":
            return [xi + self.eta * d for xi, d in zip(x, delta)]
        if self.kind == "momentum":
            self.m = [self.beta * m + d for m, d in zip(self.m, delta)]
            return [xi + self.eta * m for xi, m in zip(x, self.m)]
        self.m = [self.b1 * m + (1 - self.b1) * d for m, d in zip(self.m, delta)]
        if self.kind == "adagrad":
            self.v = [v + d * d for v, d in zip(self.v, delta)]
        elif self.kind == "yogi":
            self.v = [v - (1 - self.b2) * d * d * np.sign(v - d * d)
                      for v, d in zip(self.v, delta)]
        elif self.kind == "adam":
            self.v = [self.b2 * v + (1 - self.b2) * d * d for v, d in zip(self.v, delta)]
        else:
            raise ValueError(self.kind)
        return [xi + self.eta * m / (np.sqrt(v) + self.tau)
                for xi, m, v in zip(x, self.m, self.v)]


def full_batch_round(W, b, xs, ys, lr):
    """Every client takes one gradient step on all its data; Delta = sum_k n_k (w_k - w) /
    sum_k n_k (the clients' models, weighted by their sizes)."""
    n = np.array([len(y) for y in ys], np.float64)
    dW, db = np.zeros_like(W), np.zeros_like(b)
    for nk, x, y in zip(n, xs, ys):
        gW, gb = grad_mean_xent(W, b, x, y)
        dW += nk * (-lr * gW)
        db += nk * (-lr * gb)
    return dW / n.sum(), db / n.sum()


class Scaffold:
    """Algorithm 1 of the SCAFFOLD paper with option II, for one replica.

    weighting "unweighted" is the paper as written: Delta x = mean over S of Delta y_i and
    c <- c + (|S|/N) mean over S of Delta c_i. "weighted": Delta x weighted by n_i and
    c <- c + sum_{i in S} (n_i / n) Delta c_i (c stays the n-weighted mean of the c_i).
    """

    def __init__(self, xs, ys, weighting, shape_W, shape_b):
        self.xs, self.ys, self.weighting = xs, ys, weighting
        self.N = len(xs)
        self.n = np.array([len(y) for y in ys], np.float64)
        self.c = [np.zeros(shape_W), np.zeros(shape_b)]
        self.ci = [[np.zeros(shape_W), np.zeros(shape_b)] for _ in range(self.N)]

    def local(self, x0, k, seed, t, lr, l2, batch, epochs):
        """y_i <- y_i - lr (g_i(y_i) - c_i + c) [- lr l2 y_i], K steps; returns (y, K)."""
        x, y = self.xs[k], self.ys[k]
        order = client_permutations(seed, t, int(k), len(y), epochs)
        W, b = x0
        K = 0
        nk = len(y)
        for e in range(epochs):
            for s in range(0, nk, batch):
                idx = order[e * nk:(e + 1) * nk][s:s + batch]
                gW, gb = grad_mean_xent(W, b, x[idx], y[idx])
                W = W - lr * (gW + l2 * W - self.ci[k][0] + self.c[0])
                b = b - lr * (gb + l2 * b - self.ci[k][1] + self.c[1])
                K += 1
        return [W, b], K

    def round(self, params, seed, t, m, lr, l2, batch, epochs, eta_g):
        chosen = sample_clients(seed, t, self.N, m)
        dys, dcs, new_ci = [], [], {}
        for k in chosen:
            y, K = self.local(params, k, seed, t, lr, l2, batch, epochs)
            cplus = [ci - c + (x - yi) / (K * lr)
                     for ci, c, x, yi in zip(self.ci[k], self.c, params, y)]
            dys.append([yi - x for yi, x in zip(y, params)])
            dcs.append([cp - ci for cp, ci in zip(cplus, self.ci[k])])
            new_ci[int(k)] = cplus
        a = self.n[chosen] if self.weighting == "weighted" else np.ones(len(chosen))
        dx = [sum(ak * d[j] for ak, d in zip(a, dys)) / a.sum() for j in range(2)]
        if self.weighting == "weighted":
            alpha = self.n[chosen] / self.n.sum()
            dc = [sum(al * d[j] for al, d in zip(alpha, dcs)) for j in range(2)]
        else:   # (|S| / N) * mean over S, as Algorithm 1 writes it
            dc = [len(chosen) / self.N * (sum(d[j] for d in dcs) / len(chosen))
                  for j in range(2)]
        params = [x + eta_g * d for x, d in zip(params, dx)]
        self.c = [c + d for c, d in zip(self.c, dc)]
        for k, cplus in new_ci.items():
            self.ci[k] = cplus
        return params
