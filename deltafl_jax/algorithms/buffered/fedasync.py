"""FedAsync (Xie, Koyejo and Gupta, *Asynchronous Federated Optimization*, 2019, Algorithm 1):
the server mixes each update into the model as it arrives,

    x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new,    alpha_t = alpha s(t - tau),

x_new the client's model trained from its base version x_tau, s the polynomial staleness
function (t - tau + 1)^(-a) at a = 1/2, 1 / sqrt(1 + staleness), the weight FedBuff uses.
The worker minimises the regularised local objective of the paper's Algorithm 1,

    f(x; z) + (rho / 2) ||x - x_tau||^2,

by local SGD from x_tau (``--fedasync_rho``; the default rho = 0 is plain local SGD, the runs
of this module before rho existed, bit for bit).

It is a :class:`~deltafl_jax.asynchronous.rule.BufferedRule` with a buffer of K = 1 and its
own aggregate: Delta = alpha s(tau) (x_new - x_{t-1}), which the default server step
w + Delta turns into the mixing above (a server optimizer then treats -Delta as its
pseudo-gradient, as for every algorithm here). x_new - x_{t-1} = Delta_k + (x_tau - x_{t-1})
with Delta_k the client's update from its base, so the step reads the base version from the
ring besides the current one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import optax

from deltafl_jax import engine
from deltafl_jax.algorithms.buffered.spec import rule_spec
from deltafl_jax.asynchronous.rule import AsyncStep, BufferedRule, StepContext
from deltafl_jax.asynchronous.step import build_buffered_step, current_params, versions_at
from deltafl_jax.declared import Bounds, setting
from deltafl_jax.engine.client import corrected_sgd
from deltafl_jax.errors import ConfigError
from deltafl_jax.replicas.labels import Replicas


ALPHA_BOUNDS = Bounds(0.0, 1.0, low_open=True)   # the mixing weight alpha in (0, 1]


def check_alpha(alpha: float) -> None:
    """ConfigError naming --fedasync_alpha unless 0 < alpha <= 1."""
    ALPHA_BOUNDS.check("fedasync_alpha", alpha)


def mixing(alpha: float):
    """The aggregate of FedAsync with mixing weight `alpha` (over a buffer of one update):
    Delta = alpha s(tau) (x_tau + Delta_k - x_{t-1}), from s(tau) Delta_k (the weighted sum the
    engine returns), the update's base slot and its weight s(tau)."""

    def aggregate(ctx: StepContext):
        slots = ctx.slots
        if slots.shape[1] != 1:
            raise ConfigError(f"FedAsync mixes one update at a time: --buffer_size="
                              f"{slots.shape[1]} must be 1")
        s = ctx.stale_weights[:, 0]
        base, now = versions_at(ctx.state.ring, slots[:, 0]), current_params(ctx.state)

        def one(d, b, c):
            scale = s.reshape(s.shape + (1,) * (d.ndim - 1)).astype(d.dtype)
            return alpha * (d + scale * (b - c))

        return jax.tree.map(one, ctx.delta_sum, base, now)

    return aggregate


def proximal(rho: float) -> Optional[engine.ClientUpdate]:
    """The worker's local SGD on f(x) + (rho/2) ||x - x_tau||^2 from x_tau (each minibatch
    gradient plus rho (x - x_tau)); None (plain local SGD) at rho = 0."""
    if rho == 0:
        return None
    return corrected_sgd(context=lambda server_state, client_state, params, hyper: params,
                         correct=lambda grads, w, anchor, hyper: jax.tree.map(
                             lambda g, x, a: g + rho * (x - a), grads, w, anchor))


def rule(alpha: float, rho: float = 0.0) -> BufferedRule:
    """FedAsync's rule, for 0 < alpha <= 1 and rho >= 0."""
    check_alpha(alpha)
    return BufferedRule(aggregate=mixing(alpha), client_update=proximal(rho))


def build_fedasync_step(model, replicas: Replicas, local: engine.LocalSGDConfig,
                        alpha: float, server_tx: Optional[optax.GradientTransformation] = None,
                        rho: float = 0.0):
    """FedAsync's server step (:func:`~deltafl_jax.asynchronous.step.build_buffered_step`)."""
    return build_buffered_step(model, replicas, local, server_tx, rule=rule(alpha, rho))


@dataclasses.dataclass(frozen=True)
class FedAsyncOptions:
    """``fedasync_alpha``: the mixing weight alpha (Xie et al. run 0.6 and 0.9);
    ``fedasync_rho``: the worker's proximal weight rho (Xie et al.'s regularised objective)."""

    fedasync_alpha: float = setting(
        0.6, "fedasync: the mixing weight alpha in (0, 1]; each update is mixed in with "
        "alpha / sqrt(1 + staleness)", bounds=ALPHA_BOUNDS)
    fedasync_rho: float = setting(
        0.0, "fedasync: the worker minimises f(x) + (rho/2)||x - x_tau||^2 from the version "
        "x_tau it started from (Xie et al.'s Algorithm 1); 0: plain local SGD",
        bounds=Bounds(0.0))


POSITION = 1

SPEC = rule_spec(
    "fedasync", "FedAsync",
    "FedAsync: each update mixed into the model as it arrives, weight alpha / sqrt(1 + "
    "staleness) (--concurrency, --max_staleness, --fedasync_alpha, --fedasync_rho; K = 1)",
    AsyncStep(make=lambda config, options: rule(options.fedasync_alpha, options.fedasync_rho),
              buffer_size=1),
    options_type=FedAsyncOptions, why="trains every update it mixes in (theta = 1)")
