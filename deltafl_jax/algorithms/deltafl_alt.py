"""Delta-FL with eta refreshed every T_eta rounds: Algorithm 1 (alternating minimisation of
F_theta(w, eta) = eta + (1/theta) sum_k alpha_k (F_k(w) - eta)_+) run as the long paper's
App. C.3 runs it ("Effect of the period of update of eta", Figs. 17-18): the eta-step every
T_eta rounds, and T_eta w-steps of one FedAvg round each in between. T_eta = 1 is Algorithm 2.

- Round t with t = 0 mod T_eta (a refresh): eta is the alpha-weighted (1 - theta)-quantile of
  this round's sampled losses F_k(w_t) (Algorithm 2, line 5; level 1 - theta in float64), and
  the round is Delta-FL's, with its filter (``--filter``: exact tail weights, or F_k >= eta at
  full alpha_k), so that T_eta = 1 is Delta-FL bit for bit.
- Other rounds keep that eta (in the algorithm state) and train the sampled clients with
  F_k(w_t) > eta, strictly, at full alpha_k: the w-step's gradient
  (1/theta) sum_k alpha_k 1[F_k(w) > eta] grad F_k(w), and Algorithm 3's LocalUpdate test
  ("if F_k(w) > eta"); Algorithm 2, line 6 writes >= for the round that computes eta, which
  the refresh rounds follow. The kept models are averaged (server step 1, as Delta-FL).
- A round where no sampled client passes leaves w unchanged; the round metric
  ``empty_round`` is 1 then (its sum over rounds counts them), ``eta_refreshed`` is 1 in
  refresh rounds, and ``eta`` is the eta in force.

Replicas are theta (``--thetas``) x T_eta (``--eta_every``) x seeds, labelled
``theta=0.5_eta_every=5_seed=1``. Its options are Delta-FL's ``--filter`` and ``--weighting``
(:class:`DeltaFLAltOptions`); Delta-FL's --smoothing and --quantile are not read.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import (DEFAULT_TIE_RTOL, FILTER, THETA_SWEEP, WEIGHTING,
                                            DeltaFLOptions, check_thetas, name_the_filter,
                                            round_rule, run_thetas, unnormalised_alphas)
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext, average_delta
from deltafl_jax.algorithms.spec import AlgorithmSpec, Grid, Reporting
from deltafl_jax.superquantile import quantile_levels

DEFAULT_ETA_EVERY = (1.0, 5.0, 20.0)


@dataclasses.dataclass(frozen=True)
class DeltaFLAltOptions:
    """Delta-FL's ``filter`` (of the refresh rounds) and ``weighting``."""

    filter: str = FILTER.field()
    weighting: str = WEIGHTING.field()


class DeltaFLAltHyper(NamedTuple):
    """theta: [] the conformity level; eta_every: [] T_eta >= 1, rounds between refreshes."""

    theta: float
    eta_every: float


class DeltaFLAltState(NamedTuple):
    """eta: [] the eta in force; rounds: [] int32 rounds done."""

    eta: jax.Array
    rounds: jax.Array


def _refresh(state, hyper):
    period = jnp.maximum(jnp.round(hyper.eta_every), 1.0).astype(jnp.int32)
    return state.rounds % period == 0


def deltafl_alt(options: DeltaFLAltOptions = DeltaFLAltOptions(),
                tie_rtol: float = DEFAULT_TIE_RTOL, thetas: Sequence[float] = ()
                ) -> FederatedAlgorithm:
    """Delta-FL with eta refreshed every hyper.eta_every rounds (module docstring)."""
    check_options(options)
    weighting = options.weighting
    rule = round_rule(DeltaFLOptions(filter=options.filter, weighting=weighting), tie_rtol)
    level = quantile_levels(thetas)

    def init(params, hyper):
        del params, hyper
        return DeltaFLAltState(eta=jnp.zeros((), jnp.float32), rounds=jnp.zeros((), jnp.int32))

    def client_weights(ctx: RoundContext) -> jax.Array:
        alphas = unnormalised_alphas(ctx.sizes, weighting)
        fresh = rule(ctx.losses, alphas, ctx.hyper.theta, level(ctx.hyper.theta))[0]
        held = jnp.where((ctx.losses > ctx.state.eta) & (alphas > 0), alphas, 0.0)
        return jnp.where(_refresh(ctx.state, ctx.hyper), fresh, held)

    def server_update(state, params, feedback, hyper):
        alphas = unnormalised_alphas(feedback.sizes, weighting)
        refresh = _refresh(state, hyper)
        _, eta_now, _ = rule(feedback.losses, alphas, hyper.theta, level(hyper.theta))
        eta = jnp.where(refresh, eta_now, state.eta)
        empty = jnp.sum(feedback.weights > 0) == 0
        return (average_delta(params, feedback),
                DeltaFLAltState(eta=eta, rounds=state.rounds + 1),
                {"eta": eta, "eta_refreshed": refresh.astype(jnp.int32),
                 "empty_round": empty.astype(jnp.int32)})

    return FederatedAlgorithm(name="deltafl_alt", init=init, client_weights=client_weights,
                              server_update=server_update)


def _column_name(label, options: DeltaFLAltOptions, head: str) -> str:
    return name_the_filter(head, options.filter)


SPEC = AlgorithmSpec(
    name="deltafl_alt", display_name="Δ-FL (alternating)",
    help="Delta-FL with eta refreshed every T_eta rounds (Algorithm 1; App. C.3, Figs. 17-18)",
    factory=lambda config, data, options: deltafl_alt(options, thetas=run_thetas(config)),
    hyper=DeltaFLAltHyper, sweep=THETA_SWEEP, validate=check_thetas, options_type=DeltaFLAltOptions,
    reporting=Reporting(column_name=_column_name),
    grid=Grid(cross=(Sweep(flag="eta_every", field="eta_every", default=DEFAULT_ETA_EVERY,
                           minimum=1.0, integer=True, help="deltafl_alt: T_eta, rounds between "
                           "refreshes of eta, crossed with --thetas (1 = Delta-FL)",
                           symbol="T_η"),)))
