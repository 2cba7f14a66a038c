"""FedAvg-Sub (CISS 2021, Sec. V): FedAvg on a uniformly random subset of the m sampled clients,
as many as Delta-FL keeps.

The count is either the number of clients that Delta-FL's filter keeps this round at a
conformity level theta (``--thetas``, replicas labelled by theta), or a fixed count
(``--fedavg_sub_clients``). The subset is drawn from the replica's round key (replicas of one
seed share it, so subsets are nested), and its clients are averaged with weights n_k.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import (DEFAULT_TIE_RTOL, FILTER, THETA_SWEEP, check_thetas,
                                           filter_rule)
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import (FederatedAlgorithm, RoundContext, average_delta,
                                             no_state)
from deltafl_jax.algorithms.spec import AlgorithmSpec, Grid
from deltafl_jax.errors import ConfigError
from deltafl_jax.superquantile import quantile_levels

DEFAULT_SUB_THETAS = (0.8, 0.5, 0.1)


class FedAvgSubHyper(NamedTuple):
    """theta: [] the level whose Delta-FL count is matched (count mode: unused);
    clients: [] the fixed count K (theta mode: unused)."""

    theta: float
    clients: float


@dataclasses.dataclass(frozen=True)
class FedAvgSubOptions:
    """``filter``: Delta-FL's option, the filter whose kept clients are counted."""

    filter: str = FILTER.field()


def random_subset(key, m: int, count) -> jax.Array:
    """[m] bool: a uniformly random subset of `count` of m slots, the `count` slots with the
    smallest of m uniform draws jax.random.uniform(key, (m,)) (stable order on ties)."""
    draws = jax.random.uniform(key, (m,))
    rank = jnp.argsort(jnp.argsort(draws, stable=True), stable=True)
    return rank < count


def fedavg_sub(count_from: str = "theta", options: FedAvgSubOptions = FedAvgSubOptions(),
               tie_rtol: float = DEFAULT_TIE_RTOL,
               thetas: Sequence[float] = ()) -> FederatedAlgorithm:
    """count_from="theta": K_t = the clients Delta-FL's filter (``options.filter``) keeps at
    hyper.theta (its level 1 - theta in float64 for the Python floats `thetas`, as Delta-FL);
    count_from="count": K = hyper.clients."""
    if count_from not in ("theta", "count"):
        raise ValueError(f"count_from must be 'theta' or 'count', got {count_from!r}")
    check_options(options)
    rule = filter_rule(options.filter)
    level = quantile_levels(thetas)

    def client_weights(ctx: RoundContext) -> jax.Array:
        n = ctx.sizes.astype(jnp.float32)
        if count_from == "theta":
            count = jnp.sum(rule(ctx.losses, n, ctx.hyper.theta, tie_rtol,
                                 level=level(ctx.hyper.theta)) > 0)
        else:
            count = ctx.hyper.clients
        return jnp.where(random_subset(ctx.key, ctx.losses.shape[0], count), n, 0.0)

    def server_update(state, params, feedback, hyper):
        del hyper
        return average_delta(params, feedback), state, {
            "subset_size": jnp.sum(feedback.weights > 0)}

    return FederatedAlgorithm(name="fedavg_sub", init=no_state, client_weights=client_weights,
                              server_update=server_update)


def _theta_levels(config, given):
    """The theta < 1 of --thetas (FedAvg-Sub at theta = 1 would be FedAvg)."""
    return tuple(t for t in (given or config.thetas) if t < 1.0) or DEFAULT_SUB_THETAS


def _validate(config) -> None:
    check_thetas(config)
    m = config.training.clients_per_round
    for k in config.sweep("fedavg_sub_clients"):
        if not 1 <= k <= m:
            raise ConfigError(f"--fedavg_sub_clients must be integers in [1, "
                              f"--clients_per_round={m}], got {k!r}")


def _make(config, data, options):
    counted = bool(config.sweep("fedavg_sub_clients"))
    return fedavg_sub("count" if counted else "theta", options,
                      thetas=_theta_levels(config, tuple(config.thetas)))


SPEC = AlgorithmSpec(
    name="fedavg_sub", display_name="FedAvg-Sub",
    help="FedAvg on a random subset of the sampled clients, as many as Delta-FL keeps",
    factory=_make, hyper=FedAvgSubHyper, options_type=FedAvgSubOptions,
    # Delta-FL's --thetas (its declaration, whose help names Delta-FL's grid), with a grid of
    # its own, tuned by the tuner.
    sweep=dataclasses.replace(THETA_SWEEP, default=DEFAULT_SUB_THETAS, tuned=True,
                              declared_by=THETA_SWEEP),
    grid=Grid(alt_sweep=Sweep(flag="fedavg_sub_clients", field="clients", default=(),
                              help="fedavg_sub: clients averaged per round, swept (empty: as "
                              "many as Delta-FL keeps at each theta < 1 of --thetas)",
                              integer=True, symbol="clients"),
              fixed={"theta": 1.0, "clients": 0.0}, values=_theta_levels),
    validate=_validate)
