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

import dataclasses
from typing import Optional

import jax
import optax

from deltafl_jax import engine
from deltafl_jax.algorithms.deltafl import THETA_SWEEP, DeltaFLHyper, theta_one
from deltafl_jax.algorithms.fedavg import fedavg
from deltafl_jax.algorithms.fedbuff import (AsyncStep, async_validator, build_buffered_step,
                                            current_params, versions_at)
from deltafl_jax.algorithms.spec import AlgorithmSpec, Grid, Reporting
from deltafl_jax.declared import Bounds, setting
from deltafl_jax.errors import ConfigError
from deltafl_jax.replicas.labels import Replicas


ALPHA_BOUNDS = Bounds(0.0, 1.0, low_open=True)   # the mixing weight alpha in (0, 1]


def check_alpha(alpha: float) -> None:
    """ConfigError naming --fedasync_alpha unless 0 < alpha <= 1."""
    ALPHA_BOUNDS.check("fedasync_alpha", alpha)


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
    check_alpha(alpha)
    return build_buffered_step(model, replicas, local, server_tx, aggregate=mixing(alpha))


@dataclasses.dataclass(frozen=True)
class FedAsyncOptions:
    """``fedasync_alpha``: the mixing weight alpha (Xie et al. run 0.6 and 0.9)."""

    fedasync_alpha: float = setting(
        0.6, "fedasync: the mixing weight alpha in (0, 1]; each update is mixed in with "
        "alpha / sqrt(1 + staleness)", bounds=ALPHA_BOUNDS)


FEDASYNC = AsyncStep(aggregate=lambda options: mixing(options.fedasync_alpha), buffer_size=1)

SPEC = AlgorithmSpec(
    name="fedasync", display_name="FedAsync",
    help="FedAsync: each update mixed into the model as it arrives, weight alpha / sqrt(1 + "
         "staleness) (--concurrency, --max_staleness, --fedasync_alpha; K = 1)",
    factory=lambda config, data, options: fedavg()._replace(name="fedasync"),
    hyper=DeltaFLHyper, sweep=THETA_SWEEP, options_type=FedAsyncOptions,
    validate=async_validator(FEDASYNC),
    grid=Grid(values=theta_one("fedasync", "trains every update it mixes in (theta = 1)"),
              fixed_sweep=True),
    reporting=Reporting(names_value=False), asynchronous=FEDASYNC)
