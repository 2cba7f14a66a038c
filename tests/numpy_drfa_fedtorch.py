"""DRFA as the authors' FedTorch code runs it, centred version, as a float64 NumPy loop for
softmax regression.

Written from a reading of MLOPTPSU/FedTorch at ab8068d (``fedtorch/comms/trainings/federated/
centered/drfa.py``, ``fedtorch/comms/algorithms/federated/centered/{misc,fedavg}.py``), not from
deltafl_jax's code. Round by round, one server and the client objects in one process:

* before the rounds, lambda = n_k / n (the clients' example counts, normalised);
* each round first multiplies gamma by 0.9;
* the online clients are m of the N drawn uniformly without replacement; each starts from the
  server model, draws its own k uniform in {1..tau-1}, and runs tau SGD steps (with weight
  decay), copying its model into its "k-th model" at the top of step k, before that step;
* the server model moves by sum_k lambda_k (N/m) (w_k - w) (its optimizer's step at scale 1);
* the server's k-th model is the plain mean (1/m) of the online clients' k-th models;
* a second uniform sample of m clients reports losses at that model, each scaled by N/m, and
  lambda <- Proj_simplex(lambda + gamma tau loss);
* if some lambda_i <= 1e-3, the first such i is set to 1e-3 and lambda renormalised.

Two departures, the engine's conventions (``deltafl_jax/algorithms/drfa.py`` documents them):
a client's loss is its mean loss on its whole data with the L2 term (FedTorch: one minibatch,
no weight decay), and the random draws are the engine's (passed in as :class:`Draws`), not
torch's and NumPy's global generators.
"""

from typing import Callable, NamedTuple

import numpy as np

from numpy_baselines import project_simplex_bisection
from numpy_reference import client_loss, grad_mean_xent


class Draws(NamedTuple):
    """The random draws of a run, as functions of the round t (0-based) and the client:
    online(t) -> m client ids; k(t, client) -> FedTorch's k in {1..tau-1};
    probe(t) -> the m client ids of the loss sample; order(t, client) -> that client's
    example order (at least tau * batch entries)."""

    online: Callable
    k: Callable
    probe: Callable
    order: Callable


def client_round(W, b, x, y, order, k, tau, batch, lr, l2):
    """tau local SGD steps from (W, b); returns (final model, the model at the top of step
    k, before it)."""
    kth = None
    for step in range(1, tau + 1):
        if step == k:
            kth = (W.copy(), b.copy())
        idx = order[(step - 1) * batch:step * batch]
        gW, gb = grad_mean_xent(W, b, x[idx], y[idx])
        W, b = W - lr * (gW + l2 * W), b - lr * (gb + l2 * b)
    return (W, b), kth


def fedtorch_drfa(xs, ys, draws, rounds, m, tau, batch, lr, l2, gamma, num_classes=10):
    """`rounds` rounds from w = 0; returns (W, b, lambda)."""
    N = len(xs)
    W, b = np.zeros((xs[0].shape[1], num_classes)), np.zeros(num_classes)
    lam = np.array([len(y) for y in ys], np.float64)
    lam /= lam.sum()
    for t in range(rounds):
        gamma *= 0.9
        online = draws.online(t)
        gW, gb = np.zeros_like(W), np.zeros_like(b)         # the server's "gradient"
        kW, kb = np.zeros_like(W), np.zeros_like(b)         # the server's k-th model
        for c in online:
            (Wc, bc), (KW, Kb) = client_round(W, b, xs[c], ys[c], draws.order(t, c),
                                              draws.k(t, c), tau, batch, lr, l2)
            weight = lam[c] * N / len(online)
            gW, gb = gW + (W - Wc) * weight, gb + (b - bc) * weight
            kW, kb = kW + KW / len(online), kb + Kb / len(online)
        W, b = W - gW, b - gb
        loss = np.zeros(N)
        sample = draws.probe(t)
        for c in sample:
            loss[c] = client_loss(kW, kb, xs[c], ys[c], l2) * (N / len(sample))
        lam = project_simplex_bisection(lam + gamma * tau * loss)
        small = np.flatnonzero(lam <= 1e-3)
        if small.size:
            lam[small[0]] = 1e-3
            lam /= lam.sum()
    return W, b, lam
