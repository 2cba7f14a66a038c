"""Delta-FL under buffered asynchrony: the tail-robust buffered step (one
:class:`~deltafl_jax.asynchronous.rule.BufferedRule`).

FedBuff's server steps whenever K updates have arrived, each computed from its own base
version w_{tau_k} (Nguyen et al. 2022). Delta-FL's round (Algorithm 2 of the long paper)
filters a synchronous cohort by its losses at one model w_t. The buffered step puts the two
together on the buffer: each buffered client k also reports F_k(w_{tau_k}), its loss at the
version it trained from (its whole training split, plus (l2/2) ||w_{tau_k}||^2, as the
synchronous round's F_k(w_t)), and with alpha_k = 1 (FedBuff's uniform buffer)

    eta = Quantile(1 - theta, (F_k(w_{tau_k}), alpha_k)_{k <= K})                (line 5)
    m_k = the superquantile LP's share of alpha_k: 1 above eta, the boundary
          fraction at eta (the exact filter), 0 below             (lines 6-8)
    Delta = sum_k alpha_k m_k s(tau_k) Delta_k / sum_k alpha_k m_k               (line 9)

with s(tau) = 1 / sqrt(1 + tau) FedBuff's staleness weight and Delta_k = w_k - w_{tau_k}.
sum_k alpha_k m_k = theta K, so Delta = sum_k pi_k s(tau_k) Delta_k with pi the tail weights
of :func:`deltafl_jax.superquantile.tail_weights`: the average of the staleness-weighted
updates over the worst theta share of the buffer. The filter runs on the server after the
updates arrived, so every buffered client trained (the virtual clock counts its job); a
filtered-out update is simply not aggregated (here it is not computed either: weight 0).
``--filter=reference`` keeps every update with F_k >= eta at its full weight, as the
authors' code does.

**What it estimates.** With staleness bounded (``--max_staleness``) and a small learning
rate, F_k(w_{tau_k}) is close to F_k(w_t), and eta and the step are the synchronous round's
on a cohort of K: eta estimates the (1 - theta)-quantile of the losses, and the step is a
staleness-damped step on the superquantile F_theta (the mean loss of the worst theta share),
of the population the buffer samples: a buffer's K updates are the first K jobs to finish,
so clients with short jobs are over-represented, in FedBuff's mean as here. theta = 1
keeps every update (m_k = 1 exactly) and the step is FedBuff's, bit for bit; with K = C, no
update stale and every job of the buffer started at the same version, it is the
synchronous round of Delta-FL with ``--weighting=unweighted`` on those K clients (the same
losses, filter and weights; equal within float32 rounding, the divisions being ordered
differently).

A loss that is not finite is below every eta (m_k = 0), so at theta = 1 an update whose base
loss is NaN is dropped where FedBuff would aggregate it (its update is then NaN too, and
FedBuff rejects it: the two agree whenever FedBuff's update is finite).

The cost: the K losses are one evaluation of the K clients' examples per server step, each
at its own base version (:func:`deltafl_jax.asynchronous.step.base_losses`), the cost of a
synchronous Delta-FL round's evaluation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.buffered.spec import rule_spec
from deltafl_jax.algorithms.deltafl import (DEFAULT_TIE_RTOL, FILTER, name_the_filter,
                                            run_thetas, unnormalised_alphas)
from deltafl_jax.algorithms.spec import Reporting
from deltafl_jax.asynchronous.rule import AsyncStep, BufferedRule, StepContext
from deltafl_jax.superquantile import (quantile_levels, tail_fractions, threshold_weights,
                                       weighted_quantile)


@dataclasses.dataclass(frozen=True)
class BufferedDeltaFLOptions:
    """``filter``: Delta-FL's (the same flag, default and check)."""

    filter: str = FILTER.field()


def tail_rule(filter: str, thetas, tie_rtol: float = DEFAULT_TIE_RTOL) -> BufferedRule:
    """The tail-robust buffered rule for the run's `thetas` (module docstring)."""
    FILTER.check("filter", filter)
    level = quantile_levels(thetas)

    def kept(losses, alphas, theta):
        """m [K] of one replica: the share of alpha_k the filter keeps."""
        if filter == "reference":   # alpha_k in {0, 1}: the kept weights are m
            return threshold_weights(losses, alphas, theta, tie_rtol, level=level(theta))
        return alphas * tail_fractions(losses, alphas, theta, tie_rtol, level=level(theta))

    def shares(ctx: StepContext):
        alphas = unnormalised_alphas(ctx.sizes, "unweighted")               # [R, K]
        return alphas, jax.vmap(kept)(ctx.losses, alphas, ctx.hyper.theta)   # [R, K] m

    def weights(ctx: StepContext):
        alphas, m = shares(ctx)
        eta = jax.vmap(lambda v, a, t: weighted_quantile(v, a, level(t)))(
            ctx.losses, alphas, ctx.hyper.theta)
        return ctx.stale_weights * m, {"eta": eta, "kept_updates": jnp.sum(m > 0, axis=1)}

    def aggregate(ctx: StepContext):
        _, m = shares(ctx)
        mass = jnp.sum(m, axis=1)                                           # [R] theta K

        def divide(d):
            return d / mass.reshape(mass.shape + (1,) * (d.ndim - 1)).astype(d.dtype)
        return jax.tree.map(divide, ctx.delta_sum)

    return BufferedRule(aggregate=aggregate, weights=weights, uses_losses=True)


def column_name(label, options: BufferedDeltaFLOptions, head: str) -> str:
    """theta = 1 is FedBuff bit for bit and is named so; the reference filter is named."""
    if float(label.theta) == 1.0:
        return "FedBuff"
    return name_the_filter(head, options.filter)


POSITION = 3

SPEC = rule_spec(
    "deltafl_buffered", "Δ-FL (buffered)",
    "Delta-FL under buffered asynchrony: of the K buffered updates, those whose loss at their "
    "base version is above the (1 - theta)-quantile, staleness-weighted (--thetas, "
    "--concurrency, --buffer_size, --max_staleness; theta = 1 is FedBuff)",
    AsyncStep(make=lambda config, options: tail_rule(options.filter, run_thetas(config))),
    options_type=BufferedDeltaFLOptions, sweeps_theta=True,
    reporting=Reporting(column_name=column_name))
