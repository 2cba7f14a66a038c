"""GIFAIR-FL (Yue, Nouiehed, Al Kontar, *GIFAIR-FL: A Framework for Group and Individual
Fairness in Federated Learning*, INFORMS Journal on Data Science 2023; arXiv 2108.02741),
individual fairness (every client its own group), as a reweighting of the client weights.

The paper's objective is sum_k p_k F_k(w) + lambda sum_{i < j} |F_i(w) - F_j(w)|. Its
penalty is sum_k r_k F_k with r_k = sum_{j != k} sign(F_k - F_j): the number of clients
with a smaller loss minus the number with a larger one (-(m - 1), -(m - 3), ..., m - 1 for
distinct losses), so the objective is the reweighted sum_k (p_k + lambda r_k) F_k, whose
weights stay >= 0 for lambda <= lambda_max = min_k p_k / (m - 1).

A round: the engine computes F_k(w_t) of the m sampled clients on their whole training data
(as the FairFL benchmark's ``losses`` before local training); each sampled client k trains
from w_t with weight a_k = p_k + c lambda_max r_k, with p_k = n_k / sum_S n (``--weighting
=unweighted``: 1/m), r_k and lambda_max over the sampled clients, c = ``--gifair_coeff`` in
[0, 1] the share of lambda_max used; Delta = sum_k a_k (w_k - w_t) / sum_k a_k (the a_k sum to
1). A loss that is NaN counts as the largest. Two losses within a relative 1e-5 of each other
are tied (sign 0; Delta-FL's tie tolerance): the float32 losses cannot order closer ones, e.g.
at the zero initialisation of a linear model every F_k is log C up to rounding. c = 0 is
FedAvg.

Read: the paper's objective (its eq. for the regularised loss and the rank form of its
gradient) and the FairFL benchmark of Zhang et al. (huawei-noah/Federated-Learning at
8d111ed, ``FairFL/algs/algorithms.py``, class ``GiFair``), which applies the reweighting to
the aggregation weights exactly so, with lambda_max = min p_k / (N - 1) and c = ``coeff``
(default 0.1), every client taking part in every round. Here r_k and lambda_max are over the
round's sampled clients (partial participation), and tied losses get equal r_k (the
subgradient sign(0) = 0; the benchmark's argsort breaks ties arbitrarily).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import DEFAULT_TIE_RTOL, WEIGHTING, unnormalised_alphas
from deltafl_jax.algorithms.leaderboard import Board, needs_clients
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import (FederatedAlgorithm, RoundContext, average_delta,
                                             no_state)
from deltafl_jax.algorithms.spec import AlgorithmSpec, Reporting
from deltafl_jax.errors import ConfigError

DEFAULT_COEFF = (0.1, 0.5, 1.0)   # the benchmark's default 0.1, and larger shares of lambda_max


class GifairHyper(NamedTuple):
    """coeff: [] c in [0, 1], the share of lambda_max = min_k p_k / (m - 1)."""

    coeff: float


@dataclasses.dataclass(frozen=True)
class GifairOptions:
    """``weighting``: p_k proportional to n_k or uniform (Delta-FL's option)."""

    weighting: str = WEIGHTING.field()


def rank_signs(losses, tie_rtol: float = DEFAULT_TIE_RTOL):
    """r_k = sum_j sign(F_k - F_j) over the [m] losses, two losses within a relative
    `tie_rtol` of each other counting as tied (sign 0); NaN counts as the largest."""
    f = jnp.where(jnp.isnan(losses), jnp.inf, losses)
    tol = tie_rtol * jnp.maximum(jnp.abs(f[:, None]), jnp.abs(f[None, :]))
    tol = jnp.where(jnp.isfinite(tol), tol, 0.0)
    above = f[:, None] > f[None, :] + tol
    below = f[:, None] < f[None, :] - tol
    return jnp.sum(above.astype(f.dtype) - below.astype(f.dtype), axis=1)


def gifair_weights(losses, sizes, coeff, weighting: str):
    """a_k = p_k + c lambda_max r_k (module docstring)."""
    p = unnormalised_alphas(sizes, weighting)
    p = p / jnp.sum(p)
    m = losses.shape[0]
    lam_max = jnp.min(p) / max(m - 1, 1)
    return p + coeff * lam_max * rank_signs(losses)


def gifair(options: GifairOptions = GifairOptions()) -> FederatedAlgorithm:
    """GIFAIR-FL's round (module docstring) with hyper.coeff."""
    check_options(options)
    weighting = options.weighting

    def client_weights(ctx: RoundContext) -> jax.Array:
        return gifair_weights(ctx.losses, ctx.sizes, ctx.hyper.coeff, weighting)

    def server_update(state, params, feedback, hyper):
        del hyper
        return average_delta(params, feedback), state, {}

    return FederatedAlgorithm(name="gifair", init=no_state, client_weights=client_weights,
                              server_update=server_update)


def check_coeff(config) -> None:
    """--gifair_coeff within [0, 1] (a share of lambda_max keeps every weight >= 0)."""
    for c in config.sweep("gifair_coeff"):
        if c > 1.0:
            raise ConfigError(f"--gifair_coeff must be in [0, 1] (a share of lambda_max = "
                              f"min p_k / (m - 1), which keeps every weight >= 0), got {c:g}")


SPEC = AlgorithmSpec(
    name="gifair", display_name="GIFAIR-FL",
    help="GIFAIR-FL: client weights p_k + c lambda_max r_k, r_k the rank sign sum of F_k(w_t)",
    factory=lambda config, data, options: gifair(options), hyper=GifairHyper,
    options_type=GifairOptions, validate=check_coeff,
    sweep=Sweep(flag="gifair_coeff", field="coeff", default=DEFAULT_COEFF, minimum=0.0,
                help="gifair: c in [0, 1], the share of lambda_max = min p_k / (m - 1), swept",
                symbol="c"),
    reporting=Reporting(leaderboard=Board(grid={"gifair_coeff": DEFAULT_COEFF},
                                          quick={"gifair_coeff": (0.5, 1.0)},
                                          applies=needs_clients(2))))
