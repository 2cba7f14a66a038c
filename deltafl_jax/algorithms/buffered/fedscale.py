"""FedBuff in FedScale's form (SymbioticLab/FedScale, ``async_aggregator.py`` and its
asynchronous executor, read at 7ec441c2): one :class:`~deltafl_jax.asynchronous.rule.BufferedRule`.

FedScale's buffered aggregation differs from FedBuff's Algorithm 1
(:mod:`deltafl_jax.algorithms.buffered.fedbuff`) in three ways, all kept here:

- it steps to the staleness-weighted average of the buffered clients' *models*,

      w <- sum_k s(tau_k) w_k / sum_k s(tau_k),    w_k = w_{tau_k} + Delta_k,

  with s(tau) = 1 / sqrt(1 + tau) (since FedScale's commit 549e426, citing FedBuff's
  staleness scaling; the commit before it, 1539103, used 1 / (1 + tau)), not to
  w + (1/K) sum_k s(tau_k) Delta_k. When every update is fresh (tau_k = 0) the two differ by
  the normalisation only: the mean of the updates against their sum over K;
- the job that the completion filling the buffer frees starts *before* the server step, so it
  trains from the model before the step (``refill_before_step``);
- a new job's client is drawn among all online clients, including those still training
  (``draw_busy``: a client may run two jobs at once).

The step's Delta = sum_k s_k w_k / sum_k s_k - w_t over the updates that are finite goes
through the server optimizer as every rule's (by default w + Delta, FedScale's step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.buffered.spec import rule_spec
from deltafl_jax.asynchronous.rule import AsyncStep, BufferedRule, StepContext
from deltafl_jax.asynchronous.step import current_params


def model_average(ctx: StepContext):
    """Delta = sum_k a_k (w_{tau_k} + Delta_k) / sum_k a_k - w_t over the kept (trained,
    finite) updates, a_k = s(tau_k): the step to the weighted average of the models."""
    assert ctx.kept is not None and ctx.job_weights is not None   # after training
    a = jnp.where(ctx.kept, ctx.job_weights, 0.0)                          # [R, K]
    total = jnp.sum(a, axis=1)                                             # [R]
    safe = jnp.where(total > 0, total, 1.0)
    now = current_params(ctx.state)

    def one(ring, d, w):   # ring [R, V, ...], d and w [R, ...]
        bases = jax.vmap(lambda x, s: x[s])(ring, ctx.slots)               # [R, K, ...]
        shape = a.shape + (1,) * (bases.ndim - 2)
        based = jnp.sum(a.reshape(shape).astype(d.dtype) * bases, axis=1)
        return (d + based) / safe.reshape(safe.shape + (1,) * (d.ndim - 1)).astype(d.dtype) - w

    return jax.tree.map(one, ctx.state.ring, ctx.delta_sum, now)


RULE = BufferedRule(aggregate=model_average, refill_before_step=True, draw_busy=True)

POSITION = 2

SPEC = rule_spec(
    "fedbuff_fedscale", "FedBuff (FedScale)",
    "FedBuff as FedScale runs it: the staleness-weighted average of the K buffered models, "
    "the freed slot refilled before the step, clients drawn among all online ones "
    "(--concurrency, --buffer_size, --max_staleness)",
    AsyncStep(make=lambda config, options: RULE))
