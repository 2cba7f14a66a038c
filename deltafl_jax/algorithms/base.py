"""The interface every federated algorithm implements (an optax-style factory of pure functions).

A round of any algorithm here has the same shape (Algorithm 2 of the Delta-FL paper, and the
baselines of the CISS paper, Table I):

1. the engine computes each sampled client's loss F_k(w_t) on its whole training data;
2. ``client_weights`` turns (F, n) into aggregation weights a_k >= 0; a_k = 0 means the client
   does no local work (the Delta-FL filter, FedAvg-Sub's subset, ...). It also receives the
   replica's round key and the ids of the sampled clients (AFL keeps one lambda_k per
   training client);
3. the engine runs LocalUpdate on every client with a_k > 0 and returns sums over them;
4. ``server_update`` forms the new global model.

An algorithm may also say which parameters are *served* (evaluated and saved): AFL serves the
average of its iterates (``eval_params``); by default the served model is w_t.

All three functions act on ONE replica (one conformity level / hyper-parameter and one seed);
the round vmaps them over replicas. Hyper-parameters that may differ between replicas of one
program (theta, q, t, mu, ...) arrive in ``hyper``, a dict of scalars; the rest are captured
when the factory builds the algorithm.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

Params = Any
State = Any


class ClientFeedback(NamedTuple):
    """What the server learns from one round, for one replica.

    Attributes:
      losses: [m] F_k(w_t) of the sampled clients (with the L2 term when l2 > 0).
      sizes: [m] their example counts n_k.
      weights: [m] the a_k that ``client_weights`` returned.
      delta_sum: pytree, sum over trained clients with a finite update of a_k (w_k - w_t).
      weight_sum: sum of a_k over the same clients.
      job_sqnorm: [m] ||w_k - w_t||^2 of each trained client.
      job_finite: [m] the client trained and its update is finite.
      job_trained: [m] the client trained.
      learning_rate: this round's client learning rate.
      clients: [m] int32 ids of the sampled clients (indices into the training clients).
    """

    losses: jax.Array
    sizes: jax.Array
    weights: jax.Array
    delta_sum: Params
    weight_sum: jax.Array
    job_sqnorm: jax.Array
    job_finite: jax.Array
    job_trained: jax.Array
    learning_rate: jax.Array
    clients: Any = None


class FederatedAlgorithm(NamedTuple):
    """init(params, hyper) -> state;
    client_weights(state, losses, sizes, hyper, key, clients) -> [m] a_k;
    server_update(state, params, feedback, hyper) -> (params, state, metrics dict of scalars);
    eval_params(state, params) -> the parameters to evaluate and save (None: params).

    `sweep`: name of the hyper-parameter that a multi-value flag sweeps (e.g. "theta").
    `use_prox`: the local objective carries FedProx's (mu/2)||w - w_t||^2 (hyper["mu"]).
    `local_steps`: force this many local steps (None: the run's --local_epochs/--local_steps).
    """

    name: str
    init: Callable[[Params, Dict[str, jax.Array]], State]
    client_weights: Callable[..., jax.Array]
    server_update: Callable[..., Tuple[Params, State, Dict[str, jax.Array]]]
    sweep: str = "theta"
    use_prox: bool = False
    local_steps: Any = None
    eval_params: Optional[Callable[[State, Params], Params]] = None


def served_params(algorithm: FederatedAlgorithm, state, params):
    """The parameters an algorithm serves, for ONE replica: eval_params(state, params), or
    params itself when the algorithm has no such hook."""
    if algorithm.eval_params is None:
        return params
    return algorithm.eval_params(state, params)


def average_update(params, feedback: ClientFeedback):
    """w + sum_k a_k (w_k - w) / sum_k a_k over the trained clients with a finite update
    (server learning rate 1, as the reference code); w unchanged if there is none."""
    total = feedback.weight_sum
    scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return jax.tree.map(lambda w, d: w + (scale * d).astype(w.dtype), params, feedback.delta_sum)


def no_state(params, hyper):
    del params, hyper
    return ()
