"""FedAvg (McMahan et al., 2017), the theta = 1 case of Delta-FL (Algorithm 2): every sampled
client trains and the server averages with weights alpha_k proportional to n_k
(``--weighting=unweighted``: uniformly).

At theta = 1 the filter keeps every client whatever the losses, so FedAvg does not compute them:
it declares ``uses_losses=False`` and the round skips the evaluation of the sampled clients at
w_t (no ``eta`` or ``sampled_loss_mean`` in its round metrics). Its weights alpha / sum(alpha)
are the ones Delta-FL's exact filter gives at theta = 1 (integer n_k sum exactly in float32), so
its models equal ``--algorithm=deltafl --thetas=1.0`` bit for bit whenever every sampled loss
is finite (Delta-FL drops a client whose F_k(w_t) is NaN; FedAvg trains it, and the engine
discards its update if that is not finite). Delta-FL's --smoothing and --quantile are not
used (at theta = 1 smoothing gives the same average, and the strict filter F_k > eta of
--quantile=secagg_mm would drop the client with the lowest loss)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import WEIGHTING, at_theta_one, unnormalised_alphas
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import check_options
from deltafl_jax.algorithms.protocol import (FederatedAlgorithm, PrivateAggregate, RoundContext,
                                             average_delta, no_state)
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients


@dataclasses.dataclass(frozen=True)
class FedAvgOptions:
    """``weighting``: Delta-FL's option (the same flag, default and check)."""

    weighting: str = WEIGHTING.field()


# What FedAvg and FedProx need for their private version (--dp_clip).
DP_REQUIRES = ("--weighting=unweighted (each sampled client's clipped update then weighs 1/m "
               "of the average; with weights n_k one client's share has no useful bound)")


def private_fedavg(weighting: str) -> Optional[PrivateAggregate]:
    """DP-FedAvg with uniform weights a_k = 1/m: sensitivity C / m, the fixed denominator
    1 (every round draws m clients); None for weights n_k."""
    if weighting != "unweighted":
        return None
    return PrivateAggregate(max_weight=lambda hyper, m: 1.0 / m,
                            denominator=lambda hyper, m: 1.0)


def size_weights(weighting: str):
    """FedAvg's ``client_weights``: a_k = alpha_k / sum(alpha) over the sampled clients
    (alpha_k = n_k, or 1 with ``unweighted``); the losses are not used."""

    def client_weights(ctx: RoundContext) -> jax.Array:
        alphas = unnormalised_alphas(ctx.sizes, weighting)
        return alphas / jnp.sum(alphas)

    return client_weights


def fedavg(options: FedAvgOptions = FedAvgOptions()) -> FederatedAlgorithm:
    """FedAvg: a_k = alpha_k / sum(alpha) for every sampled client; the losses are not used."""
    check_options(options)
    weighting = options.weighting
    client_weights = size_weights(weighting)

    def server_update(state, params, feedback, hyper):
        del hyper
        return average_delta(params, feedback), state, {}

    return FederatedAlgorithm(name="fedavg", init=no_state, client_weights=client_weights,
                              server_update=server_update, uses_losses=False,
                              private=private_fedavg(weighting))


SPEC = AlgorithmSpec(
    name="fedavg", display_name="FedAvg",
    help="FedAvg: Delta-FL at theta = 1 without the evaluation at w_t",
    factory=lambda config, data, options: fedavg(options), options_type=FedAvgOptions,
    clients=Clients(variable_cohort=True), dp_requires=DP_REQUIRES,
    **at_theta_one("fedavg", "is Delta-FL at theta=1 (use --algorithm=deltafl to sweep theta)",
                   tunes_l2=True, leaderboard=Board(joins=("deltafl", 1.0))))
