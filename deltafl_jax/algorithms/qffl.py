"""q-FFL / q-FedAvg (Li et al., ICLR 2020, Algorithm 3); its q = 10 case, ``afl_qffl``, is in
:mod:`deltafl_jax.algorithms.afl_qffl`.

With L = 1 / (the round's learning rate), Delta_k = L (w - w_k),
h_k = q F_k^(q-1) ||Delta_k||^2 + L F_k^q (with F_k + 1e-10), the server step is
w <- w - sum_k n_k F_k^q Delta_k / sum_k n_k h_k. With q = 0 this is
w <- sum_k n_k w_k / sum_k n_k, FedAvg. F_k is measured before local training.

F_k^q is scaled by (max_k F_k)^-q in the numerator and the denominator alike: the same result
in exact arithmetic, and no float32 overflow at q = 10.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltafl_jax.algorithms.leaderboard import Board
from deltafl_jax.algorithms.options import Sweep
from deltafl_jax.algorithms.protocol import FederatedAlgorithm, RoundContext, no_state
from deltafl_jax.algorithms.spec import AlgorithmSpec, Reporting

QFFL_EPS = 1e-10
DEFAULT_Q = (0.001, 0.01, 0.1, 1.0, 10.0)   # CISS 2021, Sec. V


class QFFLHyper(NamedTuple):
    """q: [] the fairness exponent q >= 0."""

    q: float


def _qffl_ratio(losses, q):
    """(F_k / max F)^q with F_k + 1e-10, as exp(q (log F_k - log max F)): in (0, 1], exactly 1
    at q = 0."""
    f = losses + QFFL_EPS
    return jnp.exp(q * (jnp.log(f) - jnp.log(jnp.max(f)))), f


def qffl() -> FederatedAlgorithm:
    """q-FedAvg with hyper.q.

    With a_k = n_k (F_k / F_max)^q the engine returns sum_k a_k (w_k - w) = -(1/L) sum_k
    n_k (F_k/F_max)^q Delta_k; the server divides by sum_k n_k h_k / F_max^q over the clients
    whose update is finite. Clients whose (F_k / F_max)^q underflows to 0 contribute nothing
    to either sum, and do no local work.
    """

    def client_weights(ctx: RoundContext) -> jax.Array:
        ratio, _ = _qffl_ratio(ctx.losses, ctx.hyper.q)
        return ctx.sizes.astype(jnp.float32) * ratio

    def server_update(state, params, feedback, hyper):
        q = hyper.q
        L = 1.0 / feedback.learning_rate
        ratio, f = _qffl_ratio(feedback.losses, q)
        n = feedback.sizes.astype(jnp.float32)
        ok = feedback.job_finite
        sq = jnp.where(ok, feedback.job_sqnorm, 0.0)          # ||w_k - w||^2
        # h_k / F_max^q with ||Delta_k||^2 = L^2 ||w_k - w||^2.
        h = ratio * (q * (L * L) * sq / f + L)
        denom = jnp.sum(jnp.where(ok, n * h, 0.0))
        scale = jnp.where(denom > 0, L / jnp.where(denom > 0, denom, 1.0), 0.0)
        delta = jax.tree.map(lambda w, d: (scale * d).astype(w.dtype), params,
                             feedback.delta_sum)
        # The server step relative to plain averaging of the same updates (1 at q = 0).
        step = scale * jnp.sum(jnp.where(ok, feedback.weights, 0.0))
        return delta, state, {"qffl_step": step}

    return FederatedAlgorithm(name="qffl", init=no_state, client_weights=client_weights,
                              server_update=server_update)


Q_SWEEP = Sweep(flag="qffl_q", field="q", default=DEFAULT_Q, minimum=0.0,
                help="qffl: fairness exponents q >= 0, swept", symbol="q")

SPEC = AlgorithmSpec(name="qffl", display_name="q-FFL", help="q-FFL (q-FedAvg)",
                     factory=lambda config, data, options: qffl(), hyper=QFFLHyper,
                     sweep=Q_SWEEP,
                     reporting=Reporting(leaderboard=Board(grid={"qffl_q": DEFAULT_Q},
                                                           quick={"qffl_q": (0.001, 0.1)})))
