"""FedVARP (Jhunjhunwala, Sharma, Nagarkatti and Joshi, *FedVARP: Tackling the Variance Due to
Partial Client Participation in Federated Learning*, UAI 2022, Algorithm 1): MIFA's stored
updates used as a control variate of the cohort's average.

Read from the authors' code of FedAU, which runs FedVARP as a baseline: IBM/fedau at commit
6e9cce9b2e568666b5c3e0fab8f092a539884d7b (``main.py``, ``-weighting fedvarp``).

The state is MIFA's (:mod:`deltafl_jax.algorithms.mifa`): every client's latest update y_i
(zero before it first trains) and the server's S = (1/N) sum_i y_i. In round t each sampled
client trains from x_t (Delta_i = y_i' - x_t, sending Delta_i - y_i) and the server takes

    v_t = S_t + (1/|S_t|) sum_{i in S_t} (Delta_i - y_i),     x_{t+1} = x_t + eta_g v_t,

then y_i <- Delta_i for i in S_t and S_{t+1} = S_t + (1/N) sum_{i in S_t} (Delta_i - y_i)
(O(m): only the cohort's y_i change). A round in which no client trains adds nothing (v_t = 0,
as the authors' code). eta_g is ``--server_lr``.

**Weighting** (``--weighting``): ``unweighted`` is the paper's (a plain mean over the cohort,
1/N in S); ``weighted`` (the default) averages the cohort with weights n_i and keeps
S = sum_i (n_i / n) y_i.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import at_theta_one, unnormalised_alphas
from deltafl_jax.algorithms.fedau import population_total
from deltafl_jax.algorithms.mifa import (LATEST_UPDATE, MifaOptions, MifaState,
                                         init_stored_sum, zeros_like_params)
from deltafl_jax.algorithms.options import check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext, scaled_delta
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients


def fedvarp(train_sizes, options: MifaOptions = MifaOptions()) -> FederatedAlgorithm:
    """FedVARP over training clients of sizes `train_sizes` (module docstring)."""
    check_options(options)
    weighting = options.weighting
    total = jnp.float32(population_total(train_sizes, weighting))

    def client_weights(ctx: RoundContext) -> jax.Array:
        return unnormalised_alphas(ctx.sizes, weighting)              # n_i or 1

    def server_update(state, params, feedback, hyper):
        del hyper
        cohort = scaled_delta(params, feedback.delta_sum, feedback.weight_sum)
        some = feedback.weight_sum > 0
        delta = jax.tree.map(lambda c, s: jnp.where(some, c + s, 0.0).astype(c.dtype),
                             cohort, state.total)
        s = jax.tree.map(lambda a, d: a + (d / total).astype(a.dtype), state.total,
                         feedback.delta_sum)
        return delta, MifaState(total=s), {}

    return FederatedAlgorithm(name="fedvarp", init=init_stored_sum, client_weights=client_weights,
                              server_update=server_update, uses_losses=False,
                              client_update=LATEST_UPDATE, client_state_init=zeros_like_params)


SPEC = AlgorithmSpec(
    name="fedvarp", display_name="FedVARP",
    help="FedVARP: the cohort's average corrected by every client's latest update (MIFA's "
    "state; --server_lr is eta_g)",
    factory=lambda config, data, options: fedvarp(data.train.sizes, options),
    options_type=MifaOptions, clients=Clients(variable_cohort=True), **at_theta_one("fedvarp"))
