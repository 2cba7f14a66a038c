"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective is F_k(w) + (mu/2)||w - w_t||^2.

The round is FedAvg's (every sampled client trains, weights n_k / n, or uniform with
``--weighting=unweighted``, no evaluation at w_t: :mod:`deltafl_jax.algorithms.fedavg`, whose
private version it shares); its client update adds the proximal term's gradient mu (w - w_t)
to each minibatch gradient before the client optimizer's step (:func:`proximal_update`). With
mu = 0 the local gradients gain an exact +0, so the run is FedAvg bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from deltafl_jax.algorithms.deltafl import WEIGHTING
from deltafl_jax.algorithms.fedavg import DP_REQUIRES, FedAvgOptions, fedavg
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep
from deltafl_jax.algorithms.protocol import FederatedAlgorithm
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Reporting
from deltafl_jax.engine.client import corrected_sgd

DEFAULT_MU = (0.001, 0.01, 0.1, 1.0)   # the FedProx paper's grid


class FedProxHyper(NamedTuple):
    """mu: [] the proximal weight >= 0 (the weights are FedAvg's: its replicas are labelled
    theta = 1)."""

    mu: float


def proximal_gradient(grads, params, anchor, hyper):
    """grad F_k(w) + mu (w - w_t): the gradient of F_k(w) + (mu/2)||w - w_t||^2."""
    return jax.tree.map(lambda g, w, a: g + hyper.mu * (w - a), grads, params, anchor)


# The job's context is its anchor w_t.
proximal_update = corrected_sgd(context=lambda server_state, client_state, params, hyper: params,
                                correct=proximal_gradient)


@dataclasses.dataclass(frozen=True)
class FedProxOptions:
    """``weighting``: FedAvg's (Delta-FL's option: the same flag, default and check)."""

    weighting: str = WEIGHTING.field()


def fedprox(options: FedProxOptions = FedProxOptions()) -> FederatedAlgorithm:
    return fedavg(FedAvgOptions(weighting=options.weighting))._replace(
        name="fedprox", client_update=proximal_update)


SPEC = AlgorithmSpec(
    name="fedprox", display_name="FedProx",
    help="FedProx: FedAvg with the proximal term (mu/2)||w - w_t||^2",
    factory=lambda config, data, options: fedprox(options), hyper=FedProxHyper,
    options_type=FedProxOptions, dp_requires=DP_REQUIRES, clients=Clients(variable_cohort=True),
    sweep=Sweep(flag="fedprox_mu", field="mu", default=DEFAULT_MU, minimum=0.0,
                help="fedprox: proximal weights mu >= 0, swept", symbol="μ"),
    reporting=Reporting(leaderboard=Board(grid={"fedprox_mu": DEFAULT_MU},
                                          quick={"fedprox_mu": (0.01, 0.1)})))
