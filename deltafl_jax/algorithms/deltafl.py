"""Delta-FL (Algorithm 2 of "Device Heterogeneity in Federated Learning: A Superquantile
Approach") and FedAvg, its theta = 1 case.

Each round, eta_t is the alpha-weighted (1 - theta)-quantile of the sampled clients' losses
F_k(w_t) (line 5); the clients with F_k >= eta_t train (line 6-8); the server averages their
models (line 9). Two filters:

- ``exact`` (default): aggregation weights proportional to
  :func:`deltafl_jax.superquantile.tail_weights`, the maximiser of the superquantile LP: the
  clients above eta keep alpha_k and the boundary client gets a fraction, so the kept mass is
  exactly theta.
- ``reference``: the authors' code: every client with F_k >= eta keeps its full alpha_k
  (ties and the boundary client included).
"""

from __future__ import annotations

import jax.numpy as jnp

from deltafl_jax.algorithms.base import FederatedAlgorithm, average_update, no_state
from deltafl_jax.superquantile import tail_weights, threshold_weights, weighted_quantile

FILTERS = ("exact", "reference")


def deltafl(filter: str = "exact") -> FederatedAlgorithm:
    """Delta-FL with hyper["theta"] in (0, 1]; theta = 1 is FedAvg."""
    if filter not in FILTERS:
        raise ValueError(f"unknown filter {filter!r}; choose one of {', '.join(FILTERS)}")
    rule = tail_weights if filter == "exact" else threshold_weights

    def client_weights(state, losses, sizes, hyper, key):
        del state, key
        return rule(losses, sizes.astype(jnp.float32), hyper["theta"])

    def server_update(state, params, feedback, hyper):
        eta = weighted_quantile(feedback.losses, feedback.sizes.astype(jnp.float32),
                                1.0 - hyper["theta"])
        return average_update(params, feedback), state, {"eta": eta}

    return FederatedAlgorithm(name="deltafl", init=no_state, client_weights=client_weights,
                              server_update=server_update, sweep="theta")
