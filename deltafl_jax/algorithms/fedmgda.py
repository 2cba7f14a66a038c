"""FedMGDA+ (Hu, Shaloudegi, Zhang, Yu, *Federated Learning Meets Multi-objective
Optimization*, IEEE Transactions on Network Science and Engineering 2022; arXiv 2006.11489,
Algorithm 1).

Every sampled client trains from w_t as in FedAvg and sends its update d_k = w_k - w_t
(its client update's ``final`` returns it as the job's output too). The server normalises them,
g_k = d_k / ||d_k||, and takes the min-norm point of their convex hull within an
epsilon-box around the uniform weights:

    lambda* = argmin ||sum_k lambda_k g_k||^2  over  sum_k lambda_k = 1,
              max(0, 1/m - eps) <= lambda_k <= min(1, 1/m + eps),

and Delta = sum_k lambda*_k g_k, which the round's server optimizer applies: w + eta Delta
with ``--server_optimizer=sgd`` at eta = ``--server_lr`` (the paper's global learning rate;
||Delta|| <= 1, so eta is the longest step a round can take). eps = 0 is the uniform mean of
the normalised updates; eps >= 1 - 1/m leaves the simplex alone (MGDA's min-norm point).

The QP is solved inside the jitted round, per replica, by accelerated projected gradient
(FISTA) on lambda^T G lambda with G the [m, m] Gram matrix of the g_k, a fixed number of
iterations (``--fedmgda_iters``), step 1 / (2 L) with L the largest eigenvalue of G (30
power iterations, times 1.1), and the exact Euclidean projection onto the box-simplex
(:func:`project_box_simplex`: the breakpoints of sum_k clip(y_k - tau, lo_k, hi_k) = 1).
The update Delta, unlike lambda, is unique, and tests check it against scipy's SLSQP.

A client whose update is zero or not finite is left out (lambda_k = 0; the box is centred
on 1/m' over the m' others); a round with none left keeps the model.

Read: Algorithm 1 of the paper, and the FairFL benchmark of Zhang et al.
(huawei-noah/Federated-Learning at 8d111ed: ``FairFL/algs/algorithms.py``, class ``FedMGDA``,
and ``FairFL/utils/project.py``, ``solve_centered_w``), which solves the same QP with
quadprog over the box [1/n - eps, 1/n + eps] and lambda >= 0, sum 1, around uniform weights,
with a global learning rate of 1 and eps = 0.2 by default, every client in every round.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.leaderboard import Board, needs_clients
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext, no_state
from deltafl_jax.algorithms.spec import AlgorithmSpec, Reporting
from deltafl_jax.engine.client import ClientUpdate, local_final, local_init, local_step
from deltafl_jax.declared import Bounds, setting

DEFAULT_EPSILON = (0.05, 0.1, 0.5, 1.0)
POWER_ITERS = 30


class FedMGDAHyper(NamedTuple):
    """epsilon: [] the half-width eps >= 0 of the box around the uniform weights."""

    epsilon: float


@dataclasses.dataclass(frozen=True)
class FedMGDAOptions:
    """``fedmgda_iters``: the QP solver's fixed iteration count."""

    fedmgda_iters: int = setting(
        300, "fedmgda: iterations of the accelerated projected gradient that solves the "
        "round's min-norm QP", bounds=Bounds(1, integer=True))


def project_box_simplex(y, lo, hi):
    """The Euclidean projection of [m] y onto {sum lambda = 1, lo <= lambda <= hi} (requires
    sum lo <= 1 <= sum hi): clip(y - tau, lo, hi) with tau where the piecewise-linear,
    nonincreasing sum of the clipped values crosses 1, found among its 2m breakpoints."""
    b = jnp.sort(jnp.concatenate([y - lo, y - hi]))                            # [2m]
    s = jnp.sum(jnp.clip(y[None, :] - b[:, None], lo, hi), axis=1)             # s(b_j)
    j = jnp.argmax(s <= 1.0)           # the first breakpoint where the sum is <= 1
    i = jnp.maximum(j - 1, 0)
    gap = s[i] - s[j]
    frac = jnp.where(gap > 0, (s[i] - 1.0) / jnp.where(gap > 0, gap, 1.0), 0.0)
    tau = b[i] + frac * (b[j] - b[i])
    return jnp.clip(y - tau, lo, hi)


def box(valid, epsilon):
    """(lo, hi) [m]: the box [1/m' - eps, 1/m' + eps] within [0, 1] around the uniform
    weights of the m' valid clients; 0 for the others."""
    count = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    lo = jnp.where(valid, jnp.maximum(1.0 / count - epsilon, 0.0), 0.0)
    hi = jnp.where(valid, jnp.minimum(1.0 / count + epsilon, 1.0), 0.0)
    return lo, hi


def min_norm_weights(gram, valid, epsilon, iters: int):
    """[m] lambda minimising lambda^T gram lambda over the box-simplex of :func:`box`
    (FISTA, `iters` iterations; module docstring). All zero when no client is valid."""
    lo, hi = box(valid, epsilon)
    v = jnp.where(valid, 1.0, 0.0)
    v = jax.lax.fori_loop(0, POWER_ITERS,
                          lambda _, x: (gram @ x) / jnp.maximum(jnp.linalg.norm(gram @ x),
                                                                1e-30), v)
    top = 1.1 * jnp.maximum(v @ gram @ v / jnp.maximum(v @ v, 1e-30), 1e-12)
    step = 1.0 / (2.0 * top)
    start = jnp.where(valid, 1.0 / jnp.maximum(jnp.sum(valid), 1), 0.0).astype(gram.dtype)

    def body(t, carry):
        x, z, a = carry       # iterate, extrapolated point, momentum scalar
        x_new = project_box_simplex(z - step * 2.0 * (gram @ z), lo, hi)
        a_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * a * a))
        z_new = x_new + ((a - 1.0) / a_new) * (x_new - x)
        return x_new, z_new, a_new

    x, _, _ = jax.lax.fori_loop(0, iters, body, (start, start, jnp.ones((), gram.dtype)))
    return jnp.where(jnp.any(valid), x, 0.0)


def _rows(tree, m):
    """The leaves of a [m, ...] pytree as [m, size] matrices."""
    return [x.reshape(m, -1).astype(jnp.float32) for x in jax.tree.leaves(tree)]


def fedmgda(options: FedMGDAOptions = FedMGDAOptions()) -> FederatedAlgorithm:
    """FedMGDA+'s round (module docstring) with hyper.epsilon."""
    check_options(options)
    iters = options.fedmgda_iters

    def client_weights(ctx: RoundContext) -> jax.Array:
        return jnp.full(ctx.sizes.shape, 1.0 / ctx.sizes.shape[0], jnp.float32)

    def client_final(step, client_state, params, hyper, job):
        own, delta, _ = local_final(step, client_state, params, hyper, job)
        return own, delta, delta                   # the job's update w_k - w_t, as its output

    def server_update(state, params, feedback, hyper):
        d = feedback.client_outputs                # [m, ...] the updates
        m = feedback.job_finite.shape[0]
        ok = feedback.job_finite & feedback.job_trained
        rows = [jnp.where(ok[:, None], x, 0.0) for x in _rows(d, m)]
        raw = sum(x @ x.T for x in rows)                                      # [m, m]
        norm = jnp.sqrt(jnp.maximum(jnp.diagonal(raw), 0.0))
        valid = ok & (norm > 0)
        inv = jnp.where(valid, 1.0 / jnp.where(valid, norm, 1.0), 0.0)
        gram = raw * inv[:, None] * inv[None, :]
        lam = min_norm_weights(gram, valid, hyper.epsilon, iters)
        coef = lam * inv                                                       # lambda_k / ||d_k||
        delta = jax.tree.map(
            lambda w, x: jnp.tensordot(coef, jnp.where(
                ok.reshape((m,) + (1,) * (x.ndim - 1)), x, 0.0), axes=1).astype(w.dtype),
            params, d)
        return delta, state, {"fedmgda_direction_norm": jnp.sqrt(lam @ gram @ lam),
                              "fedmgda_weight_max": jnp.max(lam)}

    return FederatedAlgorithm(name="fedmgda", init=no_state, client_weights=client_weights,
                              server_update=server_update, uses_losses=False,
                              client_update=ClientUpdate(init=local_init, step=local_step,
                                                         final=client_final))


SPEC = AlgorithmSpec(
    name="fedmgda", display_name="FedMGDA+",
    help="FedMGDA+: the min-norm point of the normalised updates' hull in an eps-box around "
         "the uniform weights; --server_lr is its global learning rate",
    factory=lambda config, data, options: fedmgda(options), hyper=FedMGDAHyper,
    options_type=FedMGDAOptions,
    sweep=Sweep(flag="fedmgda_epsilon", field="epsilon", default=DEFAULT_EPSILON, minimum=0.0,
                help="fedmgda: eps >= 0, the half-width of the box around the uniform weights, "
                     "swept", symbol="ε"),
    reporting=Reporting(leaderboard=Board(
        grid={"fedmgda_epsilon": DEFAULT_EPSILON, "server_lr": (0.5, 1.0, 2.0)},
        quick={"fedmgda_epsilon": (0.1, 1.0), "server_lr": (1.0,)}, applies=needs_clients(2))))
