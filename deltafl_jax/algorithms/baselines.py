"""The baselines of the Delta-FL papers, as factories in the same engine as Delta-FL.

The CISS 2021 paper (Table I) compares Delta-FL with FedAvg, FedAvg-Sub, FedProx, q-FFL and AFL;
the 2022 distribution-shift paper (Tables 1-2) adds Tilted-ERM. The update rules below follow
``shared/reference-notes.md`` ("Baselines", read from the baselines' reference code). Every
factory returns a :class:`FederatedAlgorithm`: the round samples m clients uniformly without
replacement, computes F_k(w_t) on each client's whole training data, runs LocalUpdate (minibatch
SGD from w_t, the engine's lanes) on the clients with a_k > 0, and calls ``server_update``.

Where a reference implementation samples clients with probability proportional to n_k and then
averages uniformly, the engine samples uniformly and weights client k by n_k instead: both are
unbiased for the alpha-weighted objective sum_k alpha_k (...) of the papers (alpha_k = n_k / n).

- :func:`fedavg_sub` -- FedAvg on a uniformly random subset of the sampled clients, as many as
  Delta-FL keeps (the count that Delta-FL's filter keeps this round at a conformity level theta,
  or a fixed count), weights proportional to n_k.
- :func:`fedprox` -- FedAvg whose local objective is F_k(w) + (mu/2)||w - w_t||^2 (hyper "mu").
- :func:`qffl` -- q-FedAvg (Li et al., ICLR 2020) with L = 1 / (the round's learning rate):
  Delta_k = L (w - w_k), h_k = q F_k^(q-1) ||Delta_k||^2 + L F_k^q (F_k + 1e-10),
  w <- w - sum_k n_k F_k^q Delta_k / sum_k n_k h_k (hyper "q"). With q = 0 this is
  w <- sum_k n_k w_k / sum_k n_k, FedAvg.
- :func:`afl` -- Agnostic FL (Mohri et al., ICML 2019): every training client takes part each
  round with ONE minibatch gradient g_k; w <- w - gamma sum_k lambda_k g_k;
  lambda <- Proj_simplex(lambda + gamma_lambda F) (hyper "afl_lambda_lr"); lambda_0 = alpha;
  the served (evaluated and saved) model is the average of the iterates w_1..w_t.
- :func:`term` -- Tilted-ERM (Li et al., ICLR 2021), objective (1/t) log sum_k alpha_k
  exp(t F_k): e_k = exp(t (F_k - max F)), E <- 0.5 E + 0.5 (alpha-weighted mean of e over the
  sampled clients); w <- w + sum_k n_k (e_k / E) (w_k - w) / sum_k n_k (hyper "t").

Deviations from the reference code, each documented where it is implemented: Tilted-ERM starts
its running mean E at the first round's value instead of 0 (the reference's E_0 = 0 doubles the
first step) and averages without the reference's second division by m (an accidental server
step of 1/m); for t < 0 the exponent is shifted by min F rather than max F so that it stays
<= 0. q-FFL scales F_k^q by (max_k F_k)^-q in the numerator and the denominator alike, which
changes nothing in exact arithmetic and keeps q = 10 from overflowing float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.algorithms.base import FederatedAlgorithm, average_update, no_state
from deltafl_jax.algorithms.deltafl import DEFAULT_TIE_RTOL, FILTERS, deltafl
from deltafl_jax.superquantile import tail_weights, threshold_weights

QFFL_EPS = 1e-10
TERM_EMA = 0.5


def _rule(filter: str):
    if filter not in FILTERS:
        raise ValueError(f"unknown filter {filter!r}; choose one of {', '.join(FILTERS)}")
    return tail_weights if filter == "exact" else threshold_weights


# ----------------------------------------------------------------------------- FedAvg-Sub


def random_subset(key, m: int, count) -> jax.Array:
    """[m] bool: a uniformly random subset of `count` of m slots, the `count` slots with the
    smallest of m uniform draws jax.random.uniform(key, (m,)) (stable order on ties)."""
    draws = jax.random.uniform(key, (m,))
    rank = jnp.argsort(jnp.argsort(draws, stable=True), stable=True)
    return rank < count


def fedavg_sub(count_from: str = "theta", filter: str = "exact",
               tie_rtol: float = DEFAULT_TIE_RTOL) -> FederatedAlgorithm:
    """FedAvg with as many clients per round as Delta-FL keeps (CISS 2021, Sec. V).

    count_from="theta": K_t = the number of clients that Delta-FL's filter (`filter`, at
    hyper["theta"]) keeps on this round's losses; count_from="count": K = hyper
    ["fedavg_sub_clients"]. The K clients are a uniformly random subset of the m sampled ones,
    drawn from the replica's round key (replicas of one seed share it: nested subsets), and are
    averaged with weights n_k.
    """
    if count_from not in ("theta", "count"):
        raise ValueError(f"count_from must be 'theta' or 'count', got {count_from!r}")
    rule = _rule(filter)

    def client_weights(state, losses, sizes, hyper, key, clients):
        del state, clients
        n = sizes.astype(jnp.float32)
        if count_from == "theta":
            count = jnp.sum(rule(losses, n, hyper["theta"], tie_rtol) > 0)
        else:
            count = hyper["fedavg_sub_clients"]
        return jnp.where(random_subset(key, losses.shape[0], count), n, 0.0)

    def server_update(state, params, feedback, hyper):
        del hyper
        return average_update(params, feedback), state, {
            "subset_size": jnp.sum(feedback.weights > 0)}

    return FederatedAlgorithm(name="fedavg_sub", init=no_state, client_weights=client_weights,
                              server_update=server_update,
                              sweep="theta" if count_from == "theta" else "fedavg_sub_clients")


# ----------------------------------------------------------------------------- FedProx


def fedprox(filter: str = "exact", tie_rtol: float = DEFAULT_TIE_RTOL) -> FederatedAlgorithm:
    """FedProx (Li et al., MLSys 2020): FedAvg (Delta-FL's round at hyper["theta"] = 1, the same
    weights n_k / n) whose local objective adds (mu/2)||w - w_t||^2, mu = hyper["mu"]. With
    mu = 0 the local gradients gain an exact +0, so the run is FedAvg bit for bit."""
    return deltafl(filter, tie_rtol)._replace(name="fedprox", sweep="mu", use_prox=True)


# ----------------------------------------------------------------------------- q-FFL


def _qffl_ratio(losses, q):
    """(F_k / max F)^q with F_k + 1e-10, as exp(q (log F_k - log max F)): in (0, 1], exactly 1
    at q = 0."""
    f = losses + QFFL_EPS
    return jnp.exp(q * (jnp.log(f) - jnp.log(jnp.max(f)))), f


def qffl() -> FederatedAlgorithm:
    """q-FedAvg, hyper["q"] >= 0 (q-FFL paper, Algorithm 3; update in the module docstring).

    With a_k = n_k (F_k / F_max)^q the engine returns sum_k a_k (w_k - w) = -(1/L) sum_k
    n_k (F_k/F_max)^q Delta_k; the server divides by sum_k n_k h_k / F_max^q over the clients
    whose update is finite. Clients whose (F_k / F_max)^q underflows to 0 contribute nothing
    to either sum, and do no local work.
    """

    def client_weights(state, losses, sizes, hyper, key, clients):
        del state, key, clients
        ratio, _ = _qffl_ratio(losses, hyper["q"])
        return sizes.astype(jnp.float32) * ratio

    def server_update(state, params, feedback, hyper):
        q = hyper["q"]
        L = 1.0 / feedback.learning_rate
        ratio, f = _qffl_ratio(feedback.losses, q)
        n = feedback.sizes.astype(jnp.float32)
        ok = feedback.job_finite
        sq = jnp.where(ok, feedback.job_sqnorm, 0.0)          # ||w_k - w||^2
        # h_k / F_max^q with ||Delta_k||^2 = L^2 ||w_k - w||^2.
        h = ratio * (q * (L * L) * sq / f + L)
        denom = jnp.sum(jnp.where(ok, n * h, 0.0))
        scale = jnp.where(denom > 0, L / jnp.where(denom > 0, denom, 1.0), 0.0)
        new = jax.tree.map(lambda w, d: w + (scale * d).astype(w.dtype), params,
                           feedback.delta_sum)
        # The server step relative to plain averaging of the same updates (1 at q = 0).
        step = scale * jnp.sum(jnp.where(ok, feedback.weights, 0.0))
        return new, state, {"qffl_step": step}

    return FederatedAlgorithm(name="qffl", init=no_state, client_weights=client_weights,
                              server_update=server_update, sweep="q")


# ----------------------------------------------------------------------------- AFL


def project_simplex(v):
    """Euclidean projection of v [N] onto the probability simplex (sort and threshold:
    tau = (sum of the rho largest - 1) / rho for the largest rho with u_rho > tau)."""
    u = jnp.sort(v)[::-1]
    css = jnp.cumsum(u) - 1.0
    k = jnp.arange(1, v.shape[0] + 1, dtype=v.dtype)
    rho = jnp.sum(u - css / k > 0)
    tau = css[rho - 1] / rho.astype(v.dtype)
    return jnp.maximum(v - tau, 0.0)


class AFLState(NamedTuple):
    """lam: [N] mixture weights over the training clients; avg: the average of the iterates
    w_1..w_t (the served model; zeros before the first round, when w_0 is served); count: t."""

    lam: jax.Array
    avg: object
    count: jax.Array


def afl(train_sizes) -> FederatedAlgorithm:
    """Agnostic Federated Learning, hyper["afl_lambda_lr"] = gamma_lambda >= 0.

    Meant to run with all N training clients sampled every round and one local step
    (the registry forces m = N and local_steps = 1): then the client update is w_k - w =
    -gamma (g_k + l2 w), and w <- w + sum_k lambda_k (w_k - w) / sum_k lambda_k is the step
    w - gamma sum_k lambda_k g_k (sum_k lambda_k = 1; renormalised over the clients whose update
    is finite). lambda_0 = alpha (n_k / n), so gamma_lambda = 0 is FedAvg on one-step updates.
    The ascent step uses the losses F_k(w_t) of this round (before the w-step); clients with
    lambda_k = 0 do no local work.
    """
    sizes = np.asarray(train_sizes, np.float64)
    alpha = jnp.asarray(sizes / sizes.sum(), jnp.float32)
    N = int(sizes.size)

    def init(params, hyper):
        del hyper
        return AFLState(lam=alpha, avg=jax.tree.map(jnp.zeros_like, params),
                        count=jnp.zeros((), jnp.int32))

    def client_weights(state, losses, sizes, hyper, key, clients):
        del losses, sizes, hyper, key
        return state.lam[clients]

    def server_update(state, params, feedback, hyper):
        new = average_update(params, feedback)
        losses = jnp.zeros((N,), jnp.float32).at[feedback.clients].set(feedback.losses)
        lam = project_simplex(state.lam + hyper["afl_lambda_lr"] * losses)
        count = state.count + 1
        inv = 1.0 / count.astype(jnp.float32)
        avg = jax.tree.map(lambda a, w: a + ((w - a) * inv).astype(a.dtype), state.avg, new)
        return new, AFLState(lam=lam, avg=avg, count=count), {
            "afl_lambda_max": jnp.max(lam), "afl_lambda_support": jnp.sum(lam > 0)}

    def eval_params(state, params):
        return jax.tree.map(lambda a, w: jnp.where(state.count > 0, a, w), state.avg, params)

    return FederatedAlgorithm(name="afl", init=init, client_weights=client_weights,
                              server_update=server_update, sweep="afl_lambda_lr",
                              local_steps=1, eval_params=eval_params)


# ----------------------------------------------------------------------------- Tilted-ERM


class TERMState(NamedTuple):
    """estimate: the running mean E of the tilted weights; rounds: rounds done."""

    estimate: jax.Array
    rounds: jax.Array


def _tilt(state, losses, sizes, t):
    """e_k = exp(t (F_k - max F)) (min F when t < 0) and the updated running mean E."""
    shift = jnp.where(t >= 0, jnp.max(losses), jnp.min(losses))
    e = jnp.exp(t * (losses - shift))
    n = sizes.astype(jnp.float32)
    mean = jnp.sum(n * e) / jnp.sum(n)
    estimate = jnp.where(state.rounds == 0, mean,
                         TERM_EMA * state.estimate + (1.0 - TERM_EMA) * mean)
    return e, estimate


def term() -> FederatedAlgorithm:
    """Tilted-ERM, hyper["t"] (t > 0 up-weights the clients with large losses; t -> 0 is
    FedAvg). Weights a_k = n_k e_k / E; the update w + sum_k a_k (w_k - w) / sum_k n_k, the
    denominator over the sampled clients less those whose update was rejected (non-finite)."""

    def init(params, hyper):
        del params, hyper
        return TERMState(estimate=jnp.ones((), jnp.float32), rounds=jnp.zeros((), jnp.int32))

    def client_weights(state, losses, sizes, hyper, key, clients):
        del key, clients
        e, estimate = _tilt(state, losses, sizes, hyper["t"])
        return sizes.astype(jnp.float32) * (e / estimate)

    def server_update(state, params, feedback, hyper):
        _, estimate = _tilt(state, feedback.losses, feedback.sizes, hyper["t"])
        rejected = feedback.job_trained & ~feedback.job_finite
        total = jnp.sum(jnp.where(rejected, 0.0, feedback.sizes.astype(jnp.float32)))
        scale = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
        new = jax.tree.map(lambda w, d: w + (scale * d).astype(w.dtype), params,
                           feedback.delta_sum)
        return new, TERMState(estimate=estimate, rounds=state.rounds + 1), {
            "term_estimate": estimate}

    return FederatedAlgorithm(name="term", init=init, client_weights=client_weights,
                              server_update=server_update, sweep="t")
