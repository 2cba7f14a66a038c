"""MIFA (Gu, Huang, Zhang and Zhang, *Fast Federated Learning in the Presence of Arbitrary
Device Unavailability*, NeurIPS 2021, Algorithm 1): the server remembers every client's latest
update and steps with their average over all N clients every round.

Read from the authors' code of FedAU, which runs MIFA as a baseline: IBM/fedau at commit
6e9cce9b2e568666b5c3e0fab8f092a539884d7b (``main.py``, ``-weighting mifa``).

Every training client i keeps G_i, its latest update (per-client state, zero before its first
participation; leaves [N, ...] per replica, saved and restored on resume like SCAFFOLD's c_i).
In round t each sampled client trains from x_t (local SGD), Delta_i = y_i - x_t, sets
G_i <- Delta_i, and the server takes

    x_{t+1} = x_t + eta_g (1/N) sum_{i=1..N} G_i

over all N clients, those that did not take part included (their G_i is older). eta_g is
``--server_lr`` (``--server_optimizer=sgd``).

**O(m) per round.** The server state keeps the sum S = (1/N) sum_i G_i (:class:`MifaState`); a
client that trains sends Delta_i - G_i (its update as the engine sees it: the round sums
a_i (Delta_i - G_i) with a_i = 1/N) and the server adds that sum to S, so a round reads and writes
only its m clients' G_i. A client whose update is not finite keeps its G_i and adds nothing.

**A round in which no client trains** steps with the stored S (x_{t+1} = x_t + eta_g S), as the
authors' code does (``steps_without_clients``: with a server optimizer too).

**Weighting** (``--weighting``, Delta-FL's option): ``unweighted`` is the paper's 1/N;
``weighted`` (the default, this package's objective) puts n_i / n in place of 1/N:
S = sum_i (n_i / n) G_i.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import at_theta_one, unnormalised_alphas
from deltafl_jax.algorithms.fedau import population_total
from deltafl_jax.algorithms.fedavg import FedAvgOptions
from deltafl_jax.algorithms.options import check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients
from deltafl_jax.engine.client import ClientUpdate, difference, local_init, local_step

# FedAvg's options: ``weighting``, beta_i = 1/N or n_i/n (module docstring).
MifaOptions = FedAvgOptions


class MifaState(NamedTuple):
    """total: pytree like the parameters: S = sum_i beta_i G_i (beta_i = 1/N or n_i/n)."""

    total: object


def replace_final(state, client_state, params, hyper, job):
    """The end of a client's local SGD: its new G_i = Delta_i = y_i - x_t, and the update it
    sends, Delta_i - G_i (old); no output."""
    del hyper, job
    new = difference(state.params, params)
    return new, jax.tree.map(jnp.subtract, new, client_state), None


# Local SGD whose update is the change of the client's stored update.
LATEST_UPDATE = ClientUpdate(init=local_init, step=local_step, final=replace_final)


def zeros_like_params(params, hyper):
    """G_i = 0 (one client), or S = 0 (the server)."""
    del hyper
    return jax.tree.map(jnp.zeros_like, params)


def init_stored_sum(params, hyper) -> MifaState:
    """The server state before any client has trained: S = 0 (MIFA's and FedVARP's)."""
    return MifaState(total=zeros_like_params(params, hyper))


def mifa(train_sizes, options: MifaOptions = MifaOptions()) -> FederatedAlgorithm:
    """MIFA over training clients of sizes `train_sizes` (module docstring)."""
    check_options(options)
    weighting = options.weighting
    total = jnp.float32(population_total(train_sizes, weighting))

    def client_weights(ctx: RoundContext) -> jax.Array:
        return unnormalised_alphas(ctx.sizes, weighting) / total      # beta_i

    def server_update(state, params, feedback, hyper):
        del params, hyper
        s = jax.tree.map(lambda a, d: a + d.astype(a.dtype), state.total, feedback.delta_sum)
        return s, MifaState(total=s), {}

    return FederatedAlgorithm(name="mifa", init=init_stored_sum, client_weights=client_weights,
                              server_update=server_update, uses_losses=False,
                              client_update=LATEST_UPDATE, client_state_init=zeros_like_params,
                              steps_without_clients=True)


SPEC = AlgorithmSpec(
    name="mifa", display_name="MIFA",
    help="MIFA: every client's latest update kept, their average over all N clients applied "
    "every round (--server_lr is eta_g)",
    factory=lambda config, data, options: mifa(data.train.sizes, options),
    options_type=MifaOptions, clients=Clients(variable_cohort=True), **at_theta_one("mifa"))
