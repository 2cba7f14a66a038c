"""FedBuff (Nguyen et al., *Federated Learning with Buffered Asynchronous Aggregation*,
AISTATS 2022, Algorithm 1): the buffered rule

    Delta = (1/K) sum_k s(tau_k) Delta_k,    s(tau) = 1 / sqrt(1 + tau),

Delta_k = w_k - w_{base_k} the client's local SGD from its base version and tau_k its
staleness, applied through the server optimizer from the current version
(:mod:`deltafl_jax.asynchronous.step`). The 1/K and the uniform weights are Algorithm 1's
(the buffer's sum divided by its size K, no weighting by n_k) with the paper's polynomial
staleness scaling 1/sqrt(1 + tau) applied to each update. FLSim (the authors' simulator,
facebookresearch/FLSim at 7311f2d) sums the weighted updates without the 1/K and normalises
the staleness weight at tau = 1 (sqrt(2) / sqrt(1 + tau)): constant factors, sqrt(2) K,
that a server learning rate absorbs. FedScale's form (model averaging, its own events) is
:mod:`deltafl_jax.algorithms.buffered.fedscale`.

The events, the ring of versions and the server step every buffered rule shares are
:mod:`deltafl_jax.asynchronous`; this module is FedBuff's
:class:`~deltafl_jax.asynchronous.rule.BufferedRule` and its spec.

Why an algorithm of its own rather than an asynchronous mode that every algorithm's
aggregation could use: the other algorithms' server updates read a synchronous cohort's
quantities at one global model w_t (SCAFFOLD's and MIFA's per-client memories of the same
round, q-FFL's Lipschitz terms at w_t); with every update from a different version those
have no meaning, and each needs its own asynchronous derivation, as Delta-FL's has
(:mod:`deltafl_jax.algorithms.buffered.deltafl_buffered`).
"""

from __future__ import annotations

import jax

from deltafl_jax.algorithms.buffered.spec import rule_spec
from deltafl_jax.asynchronous.rule import AsyncStep, BufferedRule, StepContext


def buffered_mean(ctx: StepContext):
    """FedBuff's Delta = (1/K) sum_k s(tau_k) Delta_k from the sum of the weighted updates."""
    K = ctx.slots.shape[1]
    return jax.tree.map(lambda d: d / K, ctx.delta_sum)


RULE = BufferedRule(aggregate=buffered_mean)


POSITION = 0   # the first rule in --help and the flag reference

SPEC = rule_spec(
    "fedbuff", "FedBuff",
    "FedBuff: buffered asynchronous aggregation of K staleness-weighted updates from C "
    "clients in flight (--concurrency, --buffer_size, --max_staleness)",
    AsyncStep(make=lambda config, options: RULE))
