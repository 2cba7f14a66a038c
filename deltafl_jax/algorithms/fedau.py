"""FedAU (Wang & Ji, *A Lightweight Method for Tackling Unknown Participation Statistics in
Federated Averaging*, ICLR 2024, Algorithm 1) and its known-probability counterpart.

Read from the authors' code: IBM/fedau at commit 6e9cce9b2e568666b5c3e0fab8f092a539884d7b
(``main.py``: ``-weighting adaptive`` with ``-k-adaptive``, and ``-weighting known_prob``).

**FedAU** (``--algorithm=fedau``). In round t each sampled client i trains from x_t (local SGD,
update Delta_i = y_i - x_t) and the server takes

    x_{t+1} = x_t + eta_g (1/N) sum_{i in S_t} omega_i Delta_i,

N the number of training clients (not the cohort), omega_i the online estimate of client i's
mean participation interval (:func:`deltafl_jax.algorithms.participation.fedau_omega`: the mean
of the intervals recorded before this round, 1 while none is; this round's interval is recorded
after its use; absences cut into pieces of K = ``--fedau_cap``). As the authors, the sum runs
over the clients that take part and is divided by N: a round in which no client trains adds
nothing (Delta = 0; the model stays). "Taking part" is training this round: with the default
samplers every client is available, and it takes part when it is sampled (every sampled client
trains, omega_i > 0); under ``--availability`` the sampler draws among the online clients and
an empty slot takes no part (it records nothing). eta_g is ``--server_lr``
(``--server_optimizer=sgd``, the authors' ``-lr-global``).

The estimator (round of each client's last participation, sum and count of its recorded
intervals; :class:`~deltafl_jax.algorithms.participation.Estimator`, arrays [N]) is the
algorithm's state, saved with the run and restored on resume; a round reads and writes only
its m clients' entries (O(m)).

**Known probabilities** (``--algorithm=known_prob``): omega_i = 1 / p_i, p_i the probability
that client i takes part in a round, given when the algorithm is built (:func:`known_prob`'s
`probabilities`, [N]); the estimator is then unbiased for (1/N) sum_i Delta_i. The spec takes
them from the run (``Clients``): the run computes p_i from its availability model and
sampler (:func:`deltafl_jax.run.resolve.participation_probabilities`: m / N with every client
online; the replayed schedule's or trace's expected share of rounds in which i trains; r_i
times the sampler's probability among the online clients for a generated model; under
``--over_select``, the probability of being kept among the M drawn,
:mod:`deltafl_jax.sampling.inclusion`), and the factory falls back to m / N
(:func:`sampling_probabilities`) when none are given.

**Weighting** (``--weighting``, Delta-FL's option): ``unweighted`` is the authors' 1/N;
``weighted`` (the default, this package's objective sum_i (n_i / n) F_i) puts n_i / n in place
of 1/N: x_{t+1} = x_t + eta_g sum_{i in S_t} (n_i / n) omega_i Delta_i.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.algorithms.deltafl import WEIGHTING, at_theta_one, unnormalised_alphas
from deltafl_jax.algorithms.options import check_options
from deltafl_jax.algorithms.participation import (FEDAU_CAP, fedau_omega, fedau_record,
                                                  init_estimator)
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext, no_state, scaled_delta
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients
from deltafl_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FedAUOptions:
    """``fedau_cap``: K (0: none); ``weighting``: 1/N or n_i/n (module docstring)."""

    fedau_cap: int = FEDAU_CAP.field()
    weighting: str = WEIGHTING.field()


@dataclasses.dataclass(frozen=True)
class KnownProbOptions:
    """``weighting``: 1/N or n_i/n (module docstring)."""

    weighting: str = WEIGHTING.field()


def population_total(train_sizes, weighting: str) -> float:
    """The denominator of the population mean: N (unweighted) or n = sum_i n_i (weighted)."""
    n = np.asarray(train_sizes, np.float64)
    return float(n.sum()) if weighting == "weighted" else float(n.size)


def _omega_average(name: str, train_sizes, weighting: str, init, omega, record
                   ) -> FederatedAlgorithm:
    """The round x + (1/D) sum_{i in S} a_i omega_i Delta_i (a_i = n_i or 1, D = n or N), with
    omega(state, clients) -> [m] and record(state, clients, took_part) -> state."""
    total = population_total(train_sizes, weighting)

    def client_weights(ctx: RoundContext) -> jax.Array:
        return unnormalised_alphas(ctx.sizes, weighting) * omega(ctx.state, ctx.clients)

    def server_update(state, params, feedback, hyper):
        del hyper
        took_part = feedback.job_trained & (feedback.sizes > 0)
        delta = scaled_delta(params, feedback.delta_sum, jnp.float32(total))
        used = omega(state, feedback.clients)
        shown = jnp.sum(jnp.where(took_part, used, 0.0)) / jnp.maximum(jnp.sum(took_part), 1)
        return delta, record(state, feedback.clients, took_part), {"omega_mean": shown}

    return FederatedAlgorithm(name=name, init=init, client_weights=client_weights,
                              server_update=server_update, uses_losses=False)


def fedau(train_sizes, options: FedAUOptions = FedAUOptions()) -> FederatedAlgorithm:
    """FedAU over training clients of sizes `train_sizes` (module docstring)."""
    check_options(options)
    cap, n = int(options.fedau_cap), len(train_sizes)
    return _omega_average(
        "fedau", train_sizes, options.weighting,
        init=lambda params, hyper: init_estimator(n),
        omega=lambda state, clients: fedau_omega(state, clients, cap),
        record=lambda state, clients, took: fedau_record(state, clients, took, cap))


def known_prob(train_sizes, probabilities: "Sequence[float] | np.ndarray",
               options: KnownProbOptions = KnownProbOptions()) -> FederatedAlgorithm:
    """Delta_i / p_i over training clients of sizes `train_sizes`, `probabilities` [N] each
    client's probability p_i in (0, 1] of taking part in a round (the hook an availability
    model fills)."""
    check_options(options)
    p = np.asarray(probabilities, np.float64)
    if p.shape != (len(train_sizes),) or not np.all((p > 0) & (p <= 1)):
        raise ConfigError(f"known_prob needs one probability in (0, 1] per training client "
                          f"({len(train_sizes)}), got shape {p.shape} in "
                          f"[{p.min() if p.size else 'none'}, {p.max() if p.size else 'none'}]")
    inv = jnp.asarray(1.0 / p, jnp.float32)
    return _omega_average("known_prob", train_sizes, options.weighting, init=no_state,
                          omega=lambda state, clients: inv[clients],
                          record=lambda state, clients, took: state)


def sampling_probabilities(num_clients: int, clients_per_round: int) -> np.ndarray:
    """[N] each client's probability of taking part in a round under the run's sampler when
    every client is available: m / N for the uniform, Poisson and cyclic samplers (1 when
    m >= N)."""
    return np.full((num_clients,), min(1.0, clients_per_round / num_clients), np.float64)


def build_known_prob(config, data, options: KnownProbOptions,
                     probabilities: "Optional[Sequence[float] | np.ndarray]" = None
                     ) -> FederatedAlgorithm:
    """The spec's factory: :func:`known_prob` with `probabilities` (the run's, from its
    availability and sampler), by default m / N (:func:`sampling_probabilities`)."""
    sizes = data.train.sizes
    p = (sampling_probabilities(len(sizes), config.training.clients_per_round)
         if probabilities is None else probabilities)
    return known_prob(sizes, p, options)


SPEC = AlgorithmSpec(
    name="fedau", display_name="FedAU",
    help="FedAU: each update weighted by its client's estimated participation interval, over N "
    "(--fedau_cap K; --server_lr is eta_g)",
    factory=lambda config, data, options: fedau(data.train.sizes, options),
    options_type=FedAUOptions, clients=Clients(variable_cohort=True), **at_theta_one("fedau"))

KNOWN_PROB = AlgorithmSpec(
    name="known_prob", display_name="known p",
    help="each update divided by its client's known participation probability p_i, over N "
    "(m/N with every client available)",
    factory=build_known_prob,
    options_type=KnownProbOptions,
    clients=Clients(variable_cohort=True, takes_probabilities=True), **at_theta_one("known_prob"))
