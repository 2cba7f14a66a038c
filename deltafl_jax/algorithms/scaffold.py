"""SCAFFOLD (Karimireddy et al., *SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning*, ICML 2020, Algorithm 1) with option II control variates.

The server keeps a control variate c (``ScaffoldState``, shaped like w) and every training
client k its own c_k (per-client state: N x |w| per replica, zero at the start). In round t
each sampled client k:

- trains from w_t with the corrected local step y <- y - gamma (g_k(y) - c_k + c), for its K_k
  local steps (its client update, :func:`~deltafl_jax.engine.client.corrected_sgd`, keeps the
  correction c - c_k as the job's context and adds it to every minibatch gradient before the
  client optimizer; with
  ``--l2_reg`` the step also decays y, as every local step here);
- sets c_k+ = c_k - c + (w_t - y_k) / (K_k gamma) (option II) and sends Delta c_k = c_k+ - c_k
  (``final``: c_k+ becomes its state, Delta c_k its output).

The server then takes Delta = sum_k a_k (y_k - w_t) / sum_k a_k, applied by the round's server
optimizer: with ``--server_optimizer=sgd`` (default) w <- w + eta_g Delta, eta_g = ``--server_lr``
(Algorithm 1's global step size; 1 by default), and c <- c + sum_{k in S} alpha_k Delta c_k.

**Weighting** (``--weighting``): the paper's objective is the plain mean (1/N) sum_k f_k, with
a_k = 1 and c = (1/N) sum_k c_k kept by c <- c + (|S|/N) mean_S Delta c_k: that is
``--weighting=unweighted``, Algorithm 1 exactly. The default ``weighted`` uses this package's
objective sum_k alpha_k F_k with alpha_k = n_k / n (the one FedAvg and Delta-FL optimise
here, so that SCAFFOLD sits beside them in one table): a_k = n_k, and c <- c + sum_{k in S}
alpha_k Delta c_k, which keeps c = sum_k alpha_k c_k exactly (only the sampled c_k change).
Either way c stays the alpha-average of the clients' control variates, as option II's
correction c - c_k needs.

K_k is the client's own number of local steps (the engine's local epochs of its data, or
``--local_steps``); a client whose update is not finite keeps its c_k and adds nothing.
In the first round c = c_k = 0, so SCAFFOLD's first round is FedAvg's (bit for bit).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.algorithms.deltafl import at_theta_one, unnormalised_alphas
from deltafl_jax.algorithms.fedavg import FedAvgOptions
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import check_options
from deltafl_jax.algorithms.protocol import (FederatedAlgorithm, RoundContext, average_delta,
                                             zeros_like_params)
from deltafl_jax.algorithms.spec import AlgorithmSpec
from deltafl_jax.engine.client import corrected_sgd, difference


# FedAvg's options: ``weighting``, Delta-FL's option (module docstring).
ScaffoldOptions = FedAvgOptions


class ScaffoldState(NamedTuple):
    """c: pytree like the parameters: the server's control variate."""

    c: object


def population_weights(train_sizes, weighting: str) -> np.ndarray:
    """alpha_k over the N training clients: n_k / n (weighted) or 1 / N (unweighted)."""
    n = np.asarray(train_sizes, np.float64)
    return (n / n.sum() if weighting == "weighted" else np.full(n.shape, 1.0 / n.size))


def scaffold(train_sizes, options: ScaffoldOptions = ScaffoldOptions()) -> FederatedAlgorithm:
    """SCAFFOLD (option II) over training clients of sizes `train_sizes`."""
    check_options(options)
    weighting = options.weighting
    alpha = jnp.asarray(population_weights(train_sizes, weighting), jnp.float32)

    def init(params, hyper):
        return ScaffoldState(c=zeros_like_params(params, hyper))

    def client_weights(ctx: RoundContext) -> jax.Array:
        a = unnormalised_alphas(ctx.sizes, weighting)   # n_k or 1: FedAvg's weights
        return a / jnp.sum(a)

    def correction(state, client_state, params, hyper):
        del params, hyper
        return jax.tree.map(jnp.subtract, state.c, client_state)          # c - c_k

    def corrected(grads, params, correction, hyper):
        del params, hyper
        return jax.tree.map(jnp.add, grads, correction)                   # g - c_k + c

    def client_final(step, client_state, params, hyper, job):
        del hyper
        delta = difference(step.local.params, params)                  # y_k - w_t
        inv = 1.0 / (jnp.maximum(job.steps, 1).astype(jnp.float32) * job.learning_rate)
        # c_k+ = c_k - c + (w_t - y_k) / (K gamma), with c_k - c = -correction.
        new = jax.tree.map(lambda x, d: -x - d * inv, step.context, delta)
        return new, delta, jax.tree.map(jnp.subtract, new, client_state)   # Delta c_k

    def server_update(state, params, feedback, hyper):
        del hyper
        ok = feedback.job_finite                                                   # [m]
        coef = jnp.where(ok, alpha[feedback.clients], 0.0)

        def add(c, dc):   # c + sum_k alpha_k Delta c_k over the clients with a finite update
            dc = jnp.where(ok.reshape(ok.shape + (1,) * (dc.ndim - 1)), dc, 0.0)
            return c + jnp.tensordot(coef, dc, axes=1).astype(c.dtype)
        c = jax.tree.map(add, state.c, feedback.client_outputs)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(c)))
        return average_delta(params, feedback), ScaffoldState(c=c), {
            "control_variate_norm": norm}

    return FederatedAlgorithm(name="scaffold", init=init, client_weights=client_weights,
                              server_update=server_update, uses_losses=False,
                              client_state_init=zeros_like_params,
                              client_update=corrected_sgd(correction, corrected,
                                                          client_final))


SPEC = AlgorithmSpec(
    name="scaffold", display_name="SCAFFOLD",
    help="SCAFFOLD (option II control variates; --server_lr is its global step size eta_g)",
    factory=lambda config, data, options: scaffold(data.train.sizes, options),
    options_type=ScaffoldOptions, **at_theta_one("scaffold", leaderboard=Board()))
