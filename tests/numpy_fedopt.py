"""Independent NumPy loops, in float64, for the server optimizers of Reddi et al., *Adaptive
Federated Optimization* (ICLR 2021, Algorithm 2: FedAdagrad, FedYogi, FedAdam; FedAvgM as
their momentum baseline), for softmax regression.

Written from the papers' pseudo-code, not from deltafl_jax's code: a loop over the sampled
clients, local minibatch SGD, then the server's step. As in numpy_reference.py, the only thing
shared with the engine is the random draws (the sampled clients and each client's example
order, from deltafl_jax.sampling.plan).
"""

import numpy as np

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
