"""Agnostic Federated Learning (Mohri et al., ICML 2019), as the CISS 2021 paper runs it.

Every training client takes part each round (m = N) with ONE minibatch step, so the client
update is w_k - w = -gamma (g_k + l2 w), and w <- w + sum_k lambda_k (w_k - w) / sum_k lambda_k
is the step w - gamma sum_k lambda_k g_k (sum_k lambda_k = 1; renormalised over the clients
whose update is finite). Then lambda <- Proj_simplex(lambda + gamma_lambda F), with the losses
F_k(w_t) of this round, and lambda_0 = alpha (n_k / n), so gamma_lambda = 0 is FedAvg on
one-step updates. Clients with lambda_k = 0 do no local work. The served (evaluated and saved)
model is the average of the iterates w_1..w_t.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.algorithms.leaderboard import Board, population_at_most
from deltafl_jax.algorithms.options import Sweep
from deltafl_jax.algorithms.protocol import (FederatedAlgorithm, RoundContext, apply_delta,
                                             average_delta)
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Reporting

DEFAULT_LAMBDA_LR = (0.01,)


class AFLHyper(NamedTuple):
    """lambda_lr: [] the step size gamma_lambda >= 0 of the projected ascent on lambda."""

    lambda_lr: float


class AFLState(NamedTuple):
    """lam: [N] mixture weights over the training clients; avg: the average of the iterates
    w_1..w_t (the served model; zeros before the first round, when w_0 is served); count: [] t."""

    lam: jax.Array
    avg: object
    count: jax.Array   # type: ignore[assignment]  # a field's name, not tuple.count


def project_simplex(v):
    """Euclidean projection of v [N] onto the probability simplex (sort and threshold:
    tau = (sum of the rho largest - 1) / rho for the largest rho with u_rho > tau)."""
    u = jnp.sort(v)[::-1]
    css = jnp.cumsum(u) - 1.0
    k = jnp.arange(1, v.shape[0] + 1, dtype=v.dtype)
    rho = jnp.sum(u - css / k > 0)
    tau = css[rho - 1] / rho.astype(v.dtype)
    return jnp.maximum(v - tau, 0.0)


def afl(train_sizes) -> FederatedAlgorithm:
    """AFL over the training clients of sizes `train_sizes`, hyper.lambda_lr = gamma_lambda."""
    sizes = np.asarray(train_sizes, np.float64)
    alpha = jnp.asarray(sizes / sizes.sum(), jnp.float32)
    N = int(sizes.size)

    def init(params, hyper):
        del hyper
        return AFLState(lam=alpha, avg=jax.tree.map(jnp.zeros_like, params),
                        count=jnp.zeros((), jnp.int32))

    def client_weights(ctx: RoundContext) -> jax.Array:
        return ctx.state.lam[ctx.clients]

    def server_update(state, params, feedback, hyper):
        delta = average_delta(params, feedback)
        new = apply_delta(params, delta)   # the round's step (AFL takes no server optimizer)
        losses = jnp.zeros((N,), jnp.float32).at[feedback.clients].set(feedback.losses)
        lam = project_simplex(state.lam + hyper.lambda_lr * losses)
        count = state.count + 1
        inv = 1.0 / count.astype(jnp.float32)
        avg = jax.tree.map(lambda a, w: a + ((w - a) * inv).astype(a.dtype), state.avg, new)
        return delta, AFLState(lam=lam, avg=avg, count=count), {
            "afl_lambda_max": jnp.max(lam), "afl_lambda_support": jnp.sum(lam > 0)}

    def eval_params(state, params):
        return jax.tree.map(lambda a, w: jnp.where(state.count > 0, a, w), state.avg, params)

    return FederatedAlgorithm(name="afl", init=init, client_weights=client_weights,
                              server_update=server_update, eval_params=eval_params)


SPEC = AlgorithmSpec(
    name="afl", display_name="AFL",
    help="AFL: all training clients, one step each, projected ascent on lambda",
    factory=lambda config, data, options: afl(data.train.sizes), hyper=AFLHyper,
    sweep=Sweep(flag="afl_lambda_lr", field="lambda_lr", default=DEFAULT_LAMBDA_LR,
                minimum=0.0, help="afl: step sizes >= 0 of the projected ascent on lambda, "
                "swept", symbol="γ_λ"),
    clients=Clients(full_participation=True, local_steps=1),
    reporting=Reporting(leaderboard=Board(grid={"afl_lambda_lr": (0.001, 0.01, 0.1)},
                                          quick={"afl_lambda_lr": (0.01, 0.1)},
                                          applies=population_at_most(1000))),
    own_server_step="AFL's w-step is one SGD step w - gamma sum_k lambda_k g_k of its "
    "saddle-point problem, coupled with the projected ascent on lambda and served as the "
    "average of its iterates")
