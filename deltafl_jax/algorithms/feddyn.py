"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, *Federated Learning Based on
Dynamic Regularization*, ICLR 2021, Algorithm 1), with partial participation.

Every training client k keeps g_k (per-client state: N x |w| per replica, zero at the start):
the sum of its past updates, g_k = -grad L_k(theta_k) / alpha in the paper's terms (the
authors' code, alpemreacar/FedDyn, ``utils_methods.py``, keeps the same vector). In round t
each sampled client k:

- starts from theta_t and runs its K_k local steps of the run's client optimizer on the
  gradient grad l(theta) + alpha (theta - theta_t + g_k): the gradient of its loss plus the
  dynamic regulariser -<grad L_k(theta_k^{t-1}), theta> + (alpha/2)||theta - theta_t||^2
  (with ``--l2_reg`` the optimizer adds lambda theta, as every local step here);
- sets g_k <- g_k + (theta_k - theta_t) (its new state; the update is theta_k - theta_t).

The server keeps G = sum_k c_k g_k / sum_k c_k over all N training clients (``FedDynState``;
the paper's h-state is h = -alpha G), kept exactly by G <- G + sum_{k in S} c_k (theta_k -
theta_t) / sum_k c_k (only the sampled g_k change), and sets

    theta_{t+1} = sum_{k in S} c_k theta_k / sum_{k in S} c_k + G_{t+1}

(the paper's theta = mean_S theta_k - h / alpha). It is expressed as the aggregate
Delta = sum_S c_k (theta_k - theta_t) / sum_S c_k + G_{t+1}, applied by the round's server
step: with the default w + Delta it is the paper's step; another ``--server_optimizer`` or
``--server_lr`` applies to this Delta (not in the paper). A round in which no client's update
is finite leaves the model where it was (Delta = 0; G unchanged).

**Weighting** (``--weighting``, the same flag as FedAvg's, c_k above):

- ``unweighted``: c_k = 1: the paper's Algorithm 1 exactly (the plain mean of the sampled
  models, h <- h - (alpha/N) sum_S (theta_k - theta_t)) for the objective (1/N) sum_k L_k.
- ``weighted`` (default): c_k = n_k, for this package's objective sum_k (n_k/n) L_k (the one
  FedAvg and Delta-FL optimise): the n-weighted mean of the sampled models and
  G = sum_k (n_k/n) g_k. At a fixed point (theta_k = theta_t for every client) the local
  optimality gives grad L_k(theta*) = -alpha g_k and the server's G = 0, i.e.
  sum_k n_k grad L_k(theta*) = 0: the weighted objective's stationary point.

**Per-client alpha** (``--feddyn_alpha_scaling``):

- ``none`` (default): every client's local problem uses alpha.
- ``size``: client k's uses alpha_k = alpha / (n_k N / sum_j n_j) = alpha * mean_j n_j / n_k,
  as the authors' code forms it (``train_FedDyn``: ``weight_list`` = n_k / sum n * N, then
  ``alpha_coef / weight_list[clnt]``): the regulariser's weight shrinks on large clients and
  grows on small ones, everywhere alpha appears in the client's gradient. The sums over the N
  training clients are fixed at the start; g_k and the server step are unchanged.

The authors' code reaches the weighted objective another way: a plain mean of the sampled
models and of the g_k, with alpha_k in the local problem (the same stationary point: it is
FedDyn on the losses (n_k N / sum n) L_k), i.e. ``--weighting=unweighted
--feddyn_alpha_scaling=size``; on clients of equal size alpha_k = alpha and it coincides
with ``unweighted``. The code also clips each
local gradient to norm 10 (not done here) and reports, besides the server model, the mean of
the sampled models; here the server model theta_t is evaluated and saved.

With alpha = 0 the local problem is FedAvg's (the regulariser adds exact zeros), but the
server still adds G (the mean of every client's accumulated updates): FedDyn at alpha -> 0
is not FedAvg; its first round is theta_0 + (1 + sum_S c_k / sum_k c_k) Delta_FedAvg.
FedDyn has no private version (its per-client state and the G-step release more than a
bounded-weight average).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.algorithms.deltafl import WEIGHTING, unnormalised_alphas
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import (FederatedAlgorithm, RoundContext, average_delta,
                                             zeros_like_params)
from deltafl_jax.algorithms.spec import AlgorithmSpec, Reporting
from deltafl_jax.declared import setting
from deltafl_jax.engine.client import corrected_sgd, difference

DEFAULT_ALPHA = (0.001, 0.01, 0.1)   # around the paper's and the code's default 0.01


class FedDynHyper(NamedTuple):
    """alpha: [] the dynamic regulariser's weight >= 0."""

    alpha: float


ALPHA_SCALINGS = ("none", "size")


@dataclasses.dataclass(frozen=True)
class FedDynOptions:
    """``weighting``: FedAvg's option (the same flag, default and check);
    ``feddyn_alpha_scaling``: alpha_k (module docstring)."""

    weighting: str = WEIGHTING.field()
    feddyn_alpha_scaling: str = setting(
        "none", "feddyn: per-client alpha_k: none (alpha for every client) or size (alpha * "
        "mean n / n_k, the authors' code)", choices=ALPHA_SCALINGS)


class FedDynState(NamedTuple):
    """G: pytree like the parameters: sum_k c_k g_k / sum_k c_k over the training clients."""

    G: object


def regularised_gradient(grads, params, shift, hyper):
    """grad l(theta) + alpha (theta - theta_t + g_k), with shift = g_k - theta_t."""
    return jax.tree.map(lambda g, w, s: g + hyper.alpha * (w + s), grads, params, shift)


def _shift(server_state, client_state, params, hyper):
    """The job's context: g_k - theta_t."""
    return difference(client_state, params)


def _final(state, client_state, params, hyper, job):
    """(g_k + theta_k - theta_t, theta_k - theta_t, no output)."""
    del hyper, job
    delta = difference(state.local.params, params)
    return jax.tree.map(jnp.add, client_state, delta), delta, None


dynamic_update = corrected_sgd(context=_shift, correct=regularised_gradient, final=_final)


def size_scaled_update(mean_size: float):
    """FedDyn's client update with alpha_k = alpha * mean_size / n_k (the job's n_k; a job of
    no examples, a padding lane, keeps alpha): ``dynamic_update`` on hyper with alpha_k."""

    def scaled(hyper, job):
        size = jnp.asarray(job.size, jnp.float32)
        factor = jnp.where(size > 0, jnp.float32(mean_size) / jnp.maximum(size, 1.0), 1.0)
        return hyper._replace(alpha=hyper.alpha * factor)

    def init(server_state, client_state, params, hyper, job):
        return dynamic_update.init(server_state, client_state, params, scaled(hyper, job), job)

    def step(state, grad_fn, hyper, job):
        return dynamic_update.step(state, grad_fn, scaled(hyper, job), job)

    return dynamic_update._replace(init=init, step=step)


def feddyn_server_step(G, params, feedback, total):
    """(Delta, G') from the engine's sums (a_k = c_k): G' = G + delta_sum / total with total =
    sum_k c_k over the N training clients; Delta = delta_sum / weight_sum + G', or 0 when no
    update was finite."""
    G = jax.tree.map(lambda g, d: g + (d / total).astype(g.dtype), G, feedback.delta_sum)
    mean = average_delta(params, feedback)
    reached = feedback.weight_sum > 0
    delta = jax.tree.map(lambda m, g: jnp.where(reached, m + g, jnp.zeros_like(m)), mean, G)
    return delta, G


def feddyn(train_sizes, options: FedDynOptions = FedDynOptions()) -> FederatedAlgorithm:
    """FedDyn with hyper.alpha over training clients of sizes `train_sizes`."""
    check_options(options)
    weighting = options.weighting
    total = float(np.sum(train_sizes, dtype=np.float64) if weighting == "weighted"
                  else len(train_sizes))
    update = dynamic_update
    if options.feddyn_alpha_scaling == "size":
        update = size_scaled_update(float(np.mean(np.asarray(train_sizes, np.float64))))

    def init(params, hyper):
        return FedDynState(G=zeros_like_params(params, hyper))

    def client_weights(ctx: RoundContext) -> jax.Array:
        return unnormalised_alphas(ctx.sizes, weighting)   # c_k: n_k or 1

    def server_update(state, params, feedback, hyper):
        del hyper
        delta, G = feddyn_server_step(state.G, params, feedback, total)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(G)))
        return delta, FedDynState(G=G), {"feddyn_state_norm": norm}

    return FederatedAlgorithm(name="feddyn", init=init, client_weights=client_weights,
                              server_update=server_update, uses_losses=False,
                              client_state_init=zeros_like_params,
                              client_update=update)


SPEC = AlgorithmSpec(
    name="feddyn", display_name="FedDyn",
    help="FedDyn: dynamic regulariser per client (g_k), server h-state; partial participation",
    factory=lambda config, data, options: feddyn(data.train.sizes, options),
    hyper=FedDynHyper, options_type=FedDynOptions,
    sweep=Sweep(flag="feddyn_alpha", field="alpha", default=DEFAULT_ALPHA, minimum=0.0,
                help="feddyn: weights alpha >= 0 of the dynamic regulariser, swept",
                symbol="α"),
    reporting=Reporting(leaderboard=Board(grid={"feddyn_alpha": DEFAULT_ALPHA},
                                          quick={"feddyn_alpha": (0.01, 0.1)})))
