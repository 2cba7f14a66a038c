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

eta's level 1 - theta is computed on the host in float64 from the Python theta of ``--thetas``
(:func:`deltafl_jax.superquantile.quantile_levels`), so that at exact boundaries of the
cumulative weights (theta = 0.9 with 10 equal clients, theta = 2/3 with 3) the filter keeps
the clients that the authors' double-precision rule keeps.

Losses within ``tie_rtol`` (relative, 1e-5 by default) of eta count as tied with it. Losses that
are equal in exact arithmetic, such as log C for every client at the zero initialisation of the
linear models, differ in float32 by summation noise of that order; without the tolerance the
round-0 filter would pick clients by rounding noise, and the result would depend on how the
evaluation is chunked.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax.numpy as jnp

from deltafl_jax.algorithms.spec import (PAPER_THETAS, AlgorithmSpec, FederatedAlgorithm, Sweep,
                                         average_update, no_state)
from deltafl_jax.errors import ConfigError
from deltafl_jax.superquantile import (quantile_levels, tail_weights, threshold_weights,
                                       weighted_quantile)

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


def deltafl(filter: str = "exact", tie_rtol: float = DEFAULT_TIE_RTOL,
            thetas: Sequence[float] = ()) -> FederatedAlgorithm:
    """Delta-FL with hyper.theta in (0, 1]; theta = 1 is FedAvg. `thetas`: the run's levels
    as Python floats, whose 1 - theta is taken in float64 (others: 1 - float32 theta, in
    float64)."""
    rule = filter_rule(filter)
    level = quantile_levels(thetas)

    def client_weights(state, losses, sizes, hyper, key, clients):
        del state, key, clients
        return rule(losses, sizes.astype(jnp.float32), hyper.theta, tie_rtol,
                    level=level(hyper.theta))

    def server_update(state, params, feedback, hyper):
        eta = weighted_quantile(feedback.losses, feedback.sizes.astype(jnp.float32),
                                level(hyper.theta))
        return average_update(params, feedback), state, {"eta": eta}

    return FederatedAlgorithm(name="deltafl", init=no_state, client_weights=client_weights,
                              server_update=server_update)


THETA_SWEEP = Sweep(flag="thetas", field="theta", default=PAPER_THETAS,
                    help="conformity levels theta in (0, 1], all trained in one program",
                    labelled_by_theta=True)


def run_thetas(config) -> Sequence[float]:
    """The thetas that the run trains, as Python floats (--thetas, else the paper's)."""
    return tuple(config.thetas) or PAPER_THETAS


def check_thetas(config) -> None:
    for t in config.thetas:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 1.0:
            raise ConfigError(f"--thetas must lie in (0, 1], got {t!r}")


SPEC = AlgorithmSpec(
    name="deltafl", help="Delta-FL: the clients above the (1 - theta)-quantile train",
    make=lambda config, data: deltafl(config.filter, thetas=run_thetas(config)),
    hyper=DeltaFLHyper, sweep=THETA_SWEEP, validate=check_thetas)
