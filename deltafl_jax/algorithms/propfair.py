"""PropFair (Zhang, Malekmohammadi, Chen, Yu, *Proportional Fairness in Federated Learning*,
TMLR 2023): FedAvg whose clients train on a concave transform of their loss.

Proportional fairness maximises sum_k log(M - F_k(w)) (a Nash bargaining solution with the
disagreement point at loss M), i.e. minimises sum_k phi(F_k) with phi(L) = -log(1 - L/M). The
transform's slope 1 / (M - L) grows with the loss, so a client that does badly takes larger
steps. It is undefined at L >= M, so within a margin eps of M the paper continues it by its
tangent (the Huber form, C^1 at L = M - eps):

    phi(L) = -log(1 - L/M)                             when M - L >= eps,
    phi(L) = -log(eps/M) + (L - (M - eps)) / eps       beyond.

A round is FedAvg's (every sampled client trains from w_t; the server averages with weights
n_k, or uniformly with ``--weighting=unweighted``; the losses at w_t are not evaluated: the
functions of :mod:`deltafl_jax.algorithms.fedavg`, its private version with ``--dp_clip``
included); on each local step the client replaces
its minibatch mean loss L by phi(L), i.e. scales the minibatch gradient by phi'(L):

    grad <- grad L / (M - L)   when M - L >= eps,      grad L / eps   beyond

(:func:`gradient_scale`), before the client optimizer's step (whose L2 term, ``--l2_reg``, is
not scaled: it is the optimizer's weight decay, outside the transformed loss). The server
optimizers apply to the average as to FedAvg's.

**The continuation** (``--propfair_continuation``): ``huber`` (default) is the paper's C^1
form above. ``reference`` is the authors' code's default branch (huawei-noah/Federated-Learning
at 8d111ed, ``FairFL/algs/algorithms.py``, class ``PropFair``, ``huber=False``): beyond the
margin the loss is L/M, whose gradient grad L / M jumps from grad L / eps at the margin (a
factor M/eps = 10 at the defaults): the transformed loss is discontinuous in value and slope.
Their ``huber=True`` branch returns L/eps (the paper's slope, without the constant that makes
the value continuous, which no gradient sees): ``huber`` here.

Defaults as their code's: M = ``--propfair_base`` = 2, eps = ``--propfair_epsilon`` = 0.2
(their run script fixes eps at 0.2 and sweeps M and the learning rate). The boundary
M - L = eps takes the log branch, as in their code. Their clients all take part in every
round; here m of them are sampled, as for every method.

**Limit M -> infinity**: while L < M - eps the scale is 1/(M - L) = (1/M)(1 + L/(M - L)), so
a local step of PropFair at rate gamma M is FedAvg's step at rate gamma plus
gamma L/(M - L) grad L: the runs agree up to O(max L / M) (with ``--l2_reg=0``; the
optimizer's L2 term is not rescaled).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.deltafl import WEIGHTING
from deltafl_jax.algorithms.fedavg import DP_REQUIRES, FedAvgOptions, fedavg
from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep, check_options
from deltafl_jax.algorithms.protocol import FederatedAlgorithm
from deltafl_jax.algorithms.spec import AlgorithmSpec, Clients, Reporting
from deltafl_jax.engine.client import (ClientUpdate, LocalState, local_final, local_init,
                                       optimizer_step)
from deltafl_jax.declared import Bounds, setting
from deltafl_jax.errors import ConfigError

DEFAULT_BASE = (2.0,)      # the authors' default M
# The leaderboard's grid: M near 1 + a typical loss keeps the steps near FedAvg's at its rate
# (1/(M - L) ~ 1); losses at the start are log C (2.3 for 10 classes, 4.0 for Shakespeare's
# 53), so the grid spans both.
BOARD_BASE = (1.5, 2.0, 3.0, 6.0, 10.0)
CONTINUATIONS = ("huber", "reference")


class PropFairHyper(NamedTuple):
    """base: [] M > eps, the loss at which a client's utility log(M - L) vanishes."""

    base: float


@dataclasses.dataclass(frozen=True)
class PropFairOptions:
    """``weighting``: FedAvg's (the same flag); the margin eps and the continuation beyond it,
    the same for every replica."""

    weighting: str = WEIGHTING.field()
    propfair_epsilon: float = setting(
        0.2, "propfair: the margin eps > 0 below M where -log(1 - L/M) gives way to its "
        "continuation (the authors' 0.2)", bounds=Bounds(0.0, low_open=True))
    propfair_continuation: str = setting(
        "huber", "propfair: beyond the margin, huber: the paper's C^1 continuation, gradient "
        "grad L / eps | reference: the authors' code's default L / M, gradient grad L / M "
        "(discontinuous)", choices=CONTINUATIONS)


def gradient_scale(loss, base, epsilon: float, continuation: str = "huber"):
    """phi'(L): 1 / (M - L) when M - L >= eps; beyond, 1 / eps (``huber``) or 1 / M
    (``reference``). A NaN loss takes the branch beyond (its gradient is NaN anyway)."""
    gap = base - loss
    inside = gap >= epsilon
    beyond = 1.0 / epsilon if continuation == "huber" else 1.0 / base
    return jnp.where(inside, 1.0 / jnp.where(inside, gap, 1.0), beyond)


def transformed_loss(loss, base, epsilon: float, continuation: str = "huber"):
    """phi(L) of the module docstring (``reference``: L / M beyond the margin): what the
    scaled gradient descends."""
    gap = base - loss
    inside = gap >= epsilon
    log_branch = -jnp.log(jnp.where(inside, gap, base) / base)
    if continuation == "huber":
        beyond = -jnp.log(epsilon / base) + (loss - (base - epsilon)) / epsilon
    else:
        beyond = loss / base
    return jnp.where(inside, log_branch, beyond)


def proportional_update(epsilon: float, continuation: str) -> ClientUpdate:
    """Local SGD from w_t on phi(L): each minibatch gradient times phi'(L) before the client
    optimizer's step; the update w_k - w_t."""

    def step(state: LocalState, grad_fn, hyper, job) -> LocalState:
        loss, grads = grad_fn(state.params)
        scale = gradient_scale(loss, hyper.base, epsilon, continuation)
        grads = jax.tree.map(lambda g: (scale * g).astype(g.dtype), grads)
        return LocalState(*optimizer_step(state.params, state.opt_state, grads, job.optimizer))

    return ClientUpdate(init=local_init, step=step, final=local_final)


def propfair(options: PropFairOptions = PropFairOptions()) -> FederatedAlgorithm:
    """PropFair with hyper.base = M (module docstring)."""
    check_options(options)
    return fedavg(FedAvgOptions(weighting=options.weighting))._replace(
        name="propfair", client_update=proportional_update(options.propfair_epsilon,
                                                           options.propfair_continuation))


def check_base(config) -> None:
    """Every M above the margin eps (else the log branch is never reached)."""
    eps = SPEC.options_for(config).propfair_epsilon
    for base in config.sweep("propfair_base") or DEFAULT_BASE:
        if base <= eps:
            raise ConfigError(f"--propfair_base must exceed --propfair_epsilon={eps:g} (M - L "
                              f">= eps is where -log(1 - L/M) applies), got {base:g}")


SPEC = AlgorithmSpec(
    name="propfair", display_name="PropFair",
    help="PropFair: FedAvg whose clients descend -log(1 - L/M) of each minibatch loss (its "
    "Huber continuation within eps of M)",
    factory=lambda config, data, options: propfair(options), hyper=PropFairHyper,
    options_type=PropFairOptions, dp_requires=DP_REQUIRES, clients=Clients(variable_cohort=True),
    validate=check_base,
    sweep=Sweep(flag="propfair_base", field="base", default=DEFAULT_BASE, minimum=0.0,
                help="propfair: M > eps, the loss at which log(M - L) vanishes, swept",
                symbol="M"),
    reporting=Reporting(leaderboard=Board(grid={"propfair_base": BOARD_BASE},
                                          quick={"propfair_base": (2.0, 6.0)})))
