"""Delta-FL (Algorithm 2 of "Device Heterogeneity in Federated Learning: A Superquantile
Approach") and FedAvg, its theta = 1 case.

Each round, eta_t is the alpha-weighted (1 - theta)-quantile of the sampled clients' losses
F_k(w_t) (line 5); the clients with F_k >= eta_t train (lines 6-8); the server averages their
models (line 9). Two filters:

- ``exact`` (default): aggregation weights proportional to
  :func:`deltafl_jax.superquantile.tail_weights`, the maximiser of the superquantile LP: the
  clients above eta keep alpha_k and the boundary client gets a fraction, so the kept mass is
  exactly theta.
- ``reference``: the authors' code: every client with F_k >= eta keeps its full alpha_k
  (ties and the boundary client included).

Losses within ``tie_rtol`` (relative, 1e-5 by default) of eta count as tied with it. Losses that
are equal in exact arithmetic, such as log C for every client at the zero initialisation of the
linear models, differ in float32 by summation noise of that order; without the tolerance the
round-0 filter would pick clients by rounding noise, and the result would depend on how the
evaluation is chunked.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from deltafl_jax.algorithms.spec import (PAPER_THETAS, AlgorithmSpec, FederatedAlgorithm, Sweep,
                                         average_update, no_state)
from deltafl_jax.errors import ConfigError
from deltafl_jax.superquantile import tail_weights, threshold_weights, weighted_quantile

FILTERS = ("exact", "reference")
DEFAULT_TIE_RTOL = 1e-5


class DeltaFLHyper(NamedTuple):
    """theta: [] the conformity level in (0, 1]."""

    theta: float


def filter_rule(filter: str):
    """The weights of the kept clients: tail_weights (exact) or threshold_weights (reference)."""
    if filter not in FILTERS:
        raise ConfigError(f"unknown --filter={filter!r}; choose one of {', '.join(FILTERS)}")
    return tail_weights if filter == "exact" else threshold_weights


def deltafl(filter: str = "exact", tie_rtol: float = DEFAULT_TIE_RTOL) -> FederatedAlgorithm:
    """Delta-FL with hyper.theta in (0, 1]; theta = 1 is FedAvg."""
    rule = filter_rule(filter)

    def client_weights(state, losses, sizes, hyper, key, clients):
        del state, key, clients
        return rule(losses, sizes.astype(jnp.float32), hyper.theta, tie_rtol)

    def server_update(state, params, feedback, hyper):
        eta = weighted_quantile(feedback.losses, feedback.sizes.astype(jnp.float32),
                                1.0 - hyper.theta)
        return average_update(params, feedback), state, {"eta": eta}

    return FederatedAlgorithm(name="deltafl", init=no_state, client_weights=client_weights,
                              server_update=server_update)


THETA_SWEEP = Sweep(flag="thetas", field="theta", default=PAPER_THETAS,
                    help="conformity levels theta in (0, 1], all trained in one program",
                    labelled_by_theta=True)


def check_thetas(config) -> None:
    for t in config.thetas:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 1.0:
            raise ConfigError(f"--thetas must lie in (0, 1], got {t!r}")


SPEC = AlgorithmSpec(
    name="deltafl", help="Delta-FL: the clients above the (1 - theta)-quantile train",
    make=lambda config, data: deltafl(config.filter), hyper=DeltaFLHyper, sweep=THETA_SWEEP,
    validate=check_thetas)
