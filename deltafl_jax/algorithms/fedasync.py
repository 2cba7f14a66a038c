"""FedAsync (Xie, Koyejo and Gupta, *Asynchronous Federated Optimization*, 2019, Algorithm 1):
the server mixes each update into the model as it arrives,

    x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new,    alpha_t = alpha s(t - tau),

x_new the client's model trained from its base version x_tau, s the polynomial staleness
function (t - tau + 1)^(-a) at a = 1/2, 1 / sqrt(1 + staleness), the weight FedBuff uses.

It is the buffered server step of :mod:`deltafl_jax.algorithms.fedbuff` with a buffer of
K = 1 and another aggregate: Delta = alpha s(tau) (x_new - x_{t-1}), which the default
server step w + Delta turns into the mixing above (a server optimizer then treats -Delta as
its pseudo-gradient, as for every algorithm here). x_new - x_{t-1} = Delta_k + (x_tau - x_{t-1})
with Delta_k the client's update from its base, so the step reads the base version from the
ring besides the current one.
"""

from __future__ import annotations

from typing import Optional

import jax
import optax

from deltafl_jax import engine
from deltafl_jax.algorithms.fedbuff import build_buffered_step, current_params, versions_at
from deltafl_jax.errors import ConfigError
from deltafl_jax.replicas import Replicas


def mixing(alpha: float):
    """The aggregate of FedAsync with mixing weight `alpha` (over a buffer of one update):
    Delta = alpha s(tau) (x_tau + Delta_k - x_{t-1}), from s(tau) Delta_k (the weighted sum the
    engine returns), the update's base slot and its weight s(tau)."""

    def aggregate(delta_sum, state, slots, weights):
        if slots.shape[1] != 1:
            raise ConfigError(f"FedAsync mixes one update at a time: --buffer_size="
                              f"{slots.shape[1]} must be 1")
        s = weights[:, 0]
        base, now = versions_at(state.ring, slots[:, 0]), current_params(state)

        def one(d, b, c):
            scale = s.reshape(s.shape + (1,) * (d.ndim - 1)).astype(d.dtype)
            return alpha * (d + scale * (b - c))

        return jax.tree.map(one, delta_sum, base, now)

    return aggregate


def build_fedasync_step(model, replicas: Replicas, local: engine.LocalSGDConfig,
                        alpha: float, server_tx: Optional[optax.GradientTransformation] = None):
    """FedAsync's server step (the step function of
    :func:`~deltafl_jax.algorithms.fedbuff.build_buffered_step`), for 0 < alpha <= 1."""
    if not 0.0 < alpha <= 1.0:
        raise ConfigError(f"--fedasync_alpha={alpha}: the mixing weight must be in (0, 1]")
    return build_buffered_step(model, replicas, local, server_tx, aggregate=mixing(alpha))
