"""An empirical audit of the reported epsilon: a canary client and a membership test.

A DP guarantee (epsilon, delta) bounds every test that tells whether one client took part:
for any rejection region, TPR <= e^eps FPR + delta and 1 - FPR <= e^eps (1 - TPR) + delta.
So a canary inserted in half of many runs, and a test that guesses from each run's releases
whether it was there, give a lower bound on epsilon from the test's true and false positive
rates (Jagielski, Ullman, Oprea 2020; Nasr et al. 2021): with Clopper-Pearson bounds at
confidence 1 - alpha on each rate,

    eps_lb = max(log((TPR_lo - delta) / FPR_hi), log((1 - FPR_hi - delta) / (1 - TPR_lo))),

which holds with probability >= 1 - 2 alpha if the mechanism is (eps, delta)-DP. An
accountant that under-reports epsilon (noise too small, a sensitivity off by a factor)
shows up as eps_lb above the reported epsilon, given enough runs; an audit of a correct
mechanism finds eps_lb below it.

What is audited here is DP-FedAvg's round as the simulator runs it, under Poisson client
sampling: each client joins a round with probability q = m / N (:func:`deltafl_jax.sampling.plan.
poisson_cohort`), every update is clipped to C (:func:`deltafl_jax.privacy.dp.clip_factor`),
weighted by a_max = 1 / m (:func:`deltafl_jax.privacy.dp.poisson_weights`), summed, noised and
divided by the fixed denominator as the round does it
(:func:`deltafl_jax.rounds.privatize_feedback`).
The other clients' updates are random vectors longer than C, orthogonal to the canary's
update, a fixed direction u of norm C (a "Dirac" canary on a coordinate that the others do not
use: without noise its presence is then certain to show), and the runs that include it have
one client more (add-or-remove neighbours, as the accountant). The attacker sees every round's
released update Delta_t and scores a run by sum_t <Delta_t, u>. The threshold is chosen on
half of the runs and the rates are measured on the other half, so the bound is not fitted
to the data that it is measured on. The reported epsilon is the run's
:class:`deltafl_jax.privacy.dp.Accounting`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.privacy.dp import Accounting, clip_factor, poisson_weights
from deltafl_jax.sampling import plan as plan_lib


@dataclasses.dataclass(frozen=True)
class CanaryAudit:
    """The audited setting: `population` clients besides the canary, m expected a round
    (q = m / (population + 1)), `rounds` rounds of a d-dimensional update, clip C, noise
    multiplier z, delta; `runs` runs (half with the canary); confidence 1 - alpha per rate."""

    population: int = 49
    m: int = 10
    rounds: int = 3
    dim: int = 64
    clip: float = 1.0
    z: float = 1.0
    delta: float = 1e-5
    runs: int = 4000
    alpha: float = 0.025
    seed: int = 0

    @property
    def q(self) -> float:
        return self.m / (self.population + 1)


def clopper_pearson(k: int, n: int, alpha: float) -> Tuple[float, float]:
    """Clopper-Pearson's exact bounds (lower, upper) of a binomial proportion from k of n,
    each one-sided at confidence 1 - alpha."""
    from scipy import stats
    lo = 0.0 if k == 0 else float(stats.beta.ppf(alpha, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - alpha, k + 1, n - k))
    return lo, hi


def epsilon_lower_bound(scores_in, scores_out, threshold: float, delta: float,
                        alpha: float) -> float:
    """eps_lb of the test 'score > threshold' (module docstring); 0 when it says nothing."""
    n_in, n_out = len(scores_in), len(scores_out)
    tp = int(np.sum(np.asarray(scores_in) > threshold))
    fp = int(np.sum(np.asarray(scores_out) > threshold))
    tpr_lo, tpr_hi = clopper_pearson(tp, n_in, alpha)
    fpr_lo, fpr_hi = clopper_pearson(fp, n_out, alpha)
    best = 0.0
    if tpr_lo - delta > 0 and fpr_hi > 0:
        best = max(best, math.log((tpr_lo - delta) / fpr_hi))
    if 1 - fpr_hi - delta > 0 and 1 - tpr_lo > 0:
        best = max(best, math.log((1 - fpr_hi - delta) / (1 - tpr_lo)))
    return best


def _private_fedavg():
    from deltafl_jax.algorithms.fedavg import private_fedavg
    return private_fedavg("unweighted")


def release_scores(audit: CanaryAudit, canary: np.ndarray, noise: bool = True) -> np.ndarray:
    """[runs] the attacker's score sum_t <Delta_t, u> of each run; canary[i]: run i has the
    canary. Each run is `rounds` rounds of the simulator's DP-FedAvg aggregation (module
    docstring), vmapped over runs; `noise` False removes the server's noise (z = 0)."""
    from deltafl_jax import rounds as rounds_lib
    from deltafl_jax.algorithms.protocol import ClientFeedback

    a = audit
    private = _private_fedavg()
    slots = a.population + 1
    # Membership, round by round: the canary is client `population` (the last id) of a
    # population of population + 1; a run without it drops it from its cohort.
    member = np.zeros((a.runs, a.rounds, slots), bool)
    for i in range(a.runs):
        for t in range(a.rounds):
            cohort = plan_lib.poisson_cohort(a.seed * 1_000_003 + i, t, slots, a.q)
            member[i, t, cohort] = True
    member[:, :, -1] &= np.asarray(canary, bool)[:, None]
    u = np.zeros((a.dim,), np.float32)
    u[0] = 1.0                                        # the canary's direction

    def one_round(key, present):
        k_upd, k_noise = jax.random.split(key)
        raw = 4.0 * a.clip * jax.random.normal(k_upd, (slots, a.dim), jnp.float32)
        raw = raw.at[:, 0].set(0.0)                    # the others: orthogonal to u
        raw = raw.at[-1].set(a.clip * jnp.asarray(u))  # the canary: norm C along u
        sq = jnp.sum(raw * raw, axis=1)
        clipped = raw * clip_factor(sq, a.clip)[:, None]
        weights = jnp.where(present, 1.0, 0.0)
        weights = poisson_weights(private, weights, None, a.m)            # a_max = 1 / m
        s = jnp.sum(weights[:, None] * clipped, axis=0)
        fb = ClientFeedback(losses=jnp.zeros(slots), sizes=present.astype(jnp.int32),
                            weights=weights, delta_sum={"w": s},
                            weight_sum=jnp.sum(weights), job_sqnorm=sq,
                            job_finite=present, job_trained=present,
                            learning_rate=jnp.float32(0.1), clients=jnp.arange(slots))
        out = rounds_lib.privatize_feedback(private, a.clip, a.m, fb, None, k_noise,
                                    jnp.float32(a.z if noise else 0.0))
        delta = out.delta_sum["w"] / out.weight_sum                      # Delta_t
        return jnp.dot(delta, jnp.asarray(u))

    keys = jax.random.split(jax.random.key(a.seed), a.runs * a.rounds).reshape(
        a.runs, a.rounds)
    per_round = jax.jit(jax.vmap(jax.vmap(one_round)))(keys, jnp.asarray(member))
    return np.asarray(jnp.sum(per_round, axis=1), np.float64)


def reported_epsilon(audit: CanaryAudit) -> float:
    """The simulator's epsilon for the audited setting: DP-FedAvg under Poisson sampling,
    add-or-remove, PLD (:class:`deltafl_jax.privacy.dp.Accounting`)."""
    acc = Accounting(population=audit.population + 1, m=audit.m, releases=(1.0,),
                     delta=audit.delta, noise=(audit.z,), sampler="poisson",
                     accountant="pld", rounds=audit.rounds)
    return float(acc.epsilons(audit.rounds)[0])


def run_audit(audit: CanaryAudit, noise: bool = True) -> Tuple[float, float]:
    """(eps_lb, the reported epsilon): the canary in every other run; the threshold that
    maximises eps_lb on the first half of the runs, eps_lb measured on the second half."""
    canary = np.arange(audit.runs) % 2 == 0
    scores = release_scores(audit, canary, noise)
    half = audit.runs // 2
    fit_in, fit_out = scores[:half][canary[:half]], scores[:half][~canary[:half]]
    candidates = np.unique(np.concatenate([fit_in, fit_out]))
    step = max(1, candidates.size // 400)
    best_t, best = candidates[0], -1.0
    for t in candidates[::step]:
        e = epsilon_lower_bound(fit_in, fit_out, t, audit.delta, audit.alpha)
        if e > best:
            best_t, best = t, e
    test_in, test_out = scores[half:][canary[half:]], scores[half:][~canary[half:]]
    return (epsilon_lower_bound(test_in, test_out, best_t, audit.delta, audit.alpha),
            reported_epsilon(audit))
