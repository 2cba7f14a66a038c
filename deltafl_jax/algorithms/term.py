"""Tilted-ERM (Li et al., ICLR 2021), the objective (1/t) log sum_k alpha_k exp(t F_k), as the
Delta-FL 2022 paper compares it (Tables 1-2).

e_k = exp(t (F_k - max F)) (min F when t < 0, so the exponent stays <= 0);
E <- 0.5 E + 0.5 (alpha-weighted mean of e over the sampled clients), with E = that mean in
the first round; w <- w + sum_k n_k (e_k / E) (w_k - w) / sum_k n_k. t -> 0 is FedAvg.

Deviations from the reference code: E starts at the first round's value instead of 0 (the
reference's E_0 = 0 doubles the first step), and the average is not divided by m a second time
(the reference's accidental server step of 1/m).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext, scaled_delta
from deltafl_jax.algorithms.spec import AlgorithmSpec, Reporting

TERM_EMA = 0.5
DEFAULT_T = (0.1, 1.0, 10.0)


class TERMHyper(NamedTuple):
    """t: [] the tilt."""

    t: float


class TERMState(NamedTuple):
    """estimate: [] the running mean E of the tilted weights; rounds: [] rounds done."""

    estimate: jax.Array
    rounds: jax.Array


def _tilt(state, losses, sizes, t):
    """e_k and the updated running mean E."""
    shift = jnp.where(t >= 0, jnp.max(losses), jnp.min(losses))
    e = jnp.exp(t * (losses - shift))
    n = sizes.astype(jnp.float32)
    mean = jnp.sum(n * e) / jnp.sum(n)
    estimate = jnp.where(state.rounds == 0, mean,
                         TERM_EMA * state.estimate + (1.0 - TERM_EMA) * mean)
    return e, estimate


def term() -> FederatedAlgorithm:
    """Tilted-ERM with hyper.t. Weights a_k = n_k e_k / E; the update divides by sum_k n_k over
    the sampled clients less those whose update was rejected (non-finite)."""

    def init(params, hyper):
        del params, hyper
        return TERMState(estimate=jnp.ones((), jnp.float32), rounds=jnp.zeros((), jnp.int32))

    def client_weights(ctx: RoundContext) -> jax.Array:
        e, estimate = _tilt(ctx.state, ctx.losses, ctx.sizes, ctx.hyper.t)
        return ctx.sizes.astype(jnp.float32) * (e / estimate)

    def server_update(state, params, feedback, hyper):
        _, estimate = _tilt(state, feedback.losses, feedback.sizes, hyper.t)
        rejected = feedback.job_trained & ~feedback.job_finite
        total = jnp.sum(jnp.where(rejected, 0.0, feedback.sizes.astype(jnp.float32)))
        delta = scaled_delta(params, feedback.delta_sum, total)
        return delta, TERMState(estimate=estimate, rounds=state.rounds + 1), {
            "term_estimate": estimate}

    return FederatedAlgorithm(name="term", init=init, client_weights=client_weights,
                              server_update=server_update)


SPEC = AlgorithmSpec(
    name="term", display_name="TERM", help="Tilted-ERM",
    factory=lambda config, data, options: term(), hyper=TERMHyper,
    sweep=Sweep(flag="term_t", field="t", default=DEFAULT_T, help="term: tilts t, swept",
                symbol="t"),
    reporting=Reporting(leaderboard=Board(grid={"term_t": DEFAULT_T},
                                          quick={"term_t": (0.1, 1.0)})))
