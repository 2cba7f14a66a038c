"""The smallest algorithm: plain averaging, written from the round's protocol alone.

Every sampled client with examples trains with the default client update (the run's local SGD,
:data:`~deltafl_jax.engine.client.LOCAL_SGD`) and the server averages the updates with equal
weights: Delta = (1/|S|) sum_{k in S} (w_k - w_t) over the trained clients S whose update is
finite, and the round's server optimizer applies Delta (w + Delta by default). It is FedAvg with
``--weighting=unweighted`` (:mod:`deltafl_jax.algorithms.fedavg`), kept as the worked example of
:mod:`deltafl_jax.algorithms.protocol` and of the guide "Add an algorithm"; it is not
registered (FedAvg is the method a run asks for). Each function matches its Protocol
(:class:`~deltafl_jax.algorithms.protocol.ClientWeightsFn`,
:class:`~deltafl_jax.algorithms.protocol.ServerUpdateFn`), which ``mypy`` checks.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.protocol import (ClientFeedback, FederatedAlgorithm, Hyper, Metrics,
                                             Params, RoundContext, State, average_delta,
                                             no_state)


def equal_weights(ctx: RoundContext) -> jax.Array:
    """a_k = 1 for every sampled client with examples (0 on an empty slot)."""
    return (ctx.sizes > 0).astype(jnp.float32)


def mean_update(state: State, params: Params, feedback: ClientFeedback,
                hyper: Hyper) -> Tuple[Params, State, Metrics]:
    """Delta = sum_k a_k u_k / sum_k a_k (the engine's sums): the plain mean of the updates."""
    return average_delta(params, feedback), state, {}


def plain_average() -> FederatedAlgorithm:
    """No state; the weights above; the mean; the losses F_k(w_t) are not needed."""
    return FederatedAlgorithm(name="plain_average", init=no_state, client_weights=equal_weights,
                              server_update=mean_update, uses_losses=False)
