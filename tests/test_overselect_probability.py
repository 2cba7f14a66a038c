"""The probability that over-selection keeps a client (deltafl_jax/sampling/inclusion.py), and
the known-probability method that divides by it.

References: every M-subset of the online clients enumerated, each passed through the real
keep rule (:func:`deltafl_jax.sampling.clock.finish`: the m first to arrive, ties by client
id, none past the deadline, a late client's partial work with --partial_work), so p_i is the
share of the subsets that keep i; scipy.stats.hypergeom for the tail; and a Monte Carlo of the
run's selection sampler and :meth:`VirtualClock.select` over 10^4 rounds.
"""

import itertools

import numpy as np
import pytest
from scipy import stats

from conftest import tiny_config
from deltafl_jax.run.resolve import participation_probabilities, resolve
from deltafl_jax.sampling.availability import Schedule
from deltafl_jax.sampling.clock import SlotJobs, finish
from deltafl_jax.sampling.inclusion import (arrivals, expected_kept_probability,
                                            hypergeom_cdf, hypergeom_cdf_by_marked, keep_order,
                                            kept_probability, mean_kept_probability)
from deltafl_jax.sampling.plan import LocalWork
from deltafl_jax.sampling.speeds import DeviceSpeeds, TimingSettings, build_speeds
from deltafl_jax.sampling.timeline import VirtualClock

B, BYTES = 10, 1024
# 12 clients; equal sizes give equal jobs under uniform speeds (ties broken by id)
SIZES = np.array([30, 50, 30, 80, 20, 50, 60, 30, 40, 70, 30, 50], np.int64)
PLANNED = -(-SIZES // B)                        # one epoch


def uniform(n=SIZES.size):
    """Every client 0.01 s an example and 1024 B/s: a job is 2 s + 0.01 n."""
    return DeviceSpeeds(n, example_s=0.01, bandwidth_Bps=1024.0)


def brute_force(speeds, online, M, m, deadline, partial):
    """[N] p_i: the share of the M-subsets of `online` (all of them when fewer) whose keep
    rule keeps i."""
    online = [int(c) for c in online]
    draws = list(itertools.combinations(online, min(M, len(online))))
    kept = np.zeros(SIZES.size)
    for subset in draws:
        ids = np.array(subset, np.int64)
        fin = finish(speeds, SlotJobs(ids, np.ones(ids.size, bool), PLANNED[ids], SIZES[ids]), B,
                     BYTES, m=m, deadline=deadline, partial_work=partial)
        kept[ids[fin.keep]] += 1
    return kept / len(draws)


def order_of(speeds, deadline, partial):
    return keep_order(arrivals(speeds, SIZES, PLANNED, B, BYTES, deadline=deadline,
                               partial_work=partial))


# jobs (uniform speeds): 2.2, 2.5, 2.2, 2.8, 2.2 s, ... a deadline of 2.45 s leaves the sizes
# <= 40 in time; with partial work the others arrive at 2.4 s after 4 steps (tied); at 2.15 s
# every client is late and arrives at 2.1 s after one step (all tied: kept by id)
TIMINGS = [(None, False), (2.45, False), (2.45, True), (2.15, True)]
ONLINE = [np.arange(8), np.array([0, 2, 3, 5, 6, 7, 9, 11]), np.array([1, 4, 10])]


@pytest.mark.parametrize("deadline, partial", TIMINGS)
@pytest.mark.parametrize("online", range(len(ONLINE)))
def test_the_formula_equals_every_subset_enumerated(deadline, partial, online):
    """n = 8 online of 12 (and n = 3 < M), M = 4, m = 2, with ties, with and without a
    deadline and partial work: exact to rounding."""
    speeds = uniform()
    ids = ONLINE[online]
    want = brute_force(speeds, ids, 4, 2, deadline, partial)
    got = kept_probability(order_of(speeds, deadline, partial), ids, 4, 2, ids)
    np.testing.assert_allclose(got, want[ids], rtol=1e-12, atol=1e-15)
    assert (want > 0).any() and (want[ids] < 4 / ids.size - 1e-9).any()   # not M / n


@pytest.mark.parametrize("deadline, partial", [(None, False), (4.0, True)])
def test_the_formula_with_lognormal_speeds_and_every_client_online(deadline, partial):
    """12 clients, all online, M = 6, m = 4: the closed form of :func:`mean_kept_probability`."""
    speeds = build_speeds(TimingSettings(client_speed="lognormal"), num_clients=SIZES.size,
                          data_seed=5)
    want = brute_force(speeds, np.arange(SIZES.size), 6, 4, deadline, partial)
    got = mean_kept_probability(order_of(speeds, deadline, partial), 6, 4)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_the_tail_equals_scipys_hypergeometric_cdf():
    """P(X <= x) on random parameters (populations 1 to 10^6, tails down to 1e-250), and for
    every number marked of 10^6 - 1 (the all-client vector of a million clients: one by one,
    and by the recurrence over the number marked)."""
    rng = np.random.default_rng(0)
    for total in (1, 2, 7, 50, 1000, 10**6):
        K = rng.integers(0, total + 1, 300)
        k = rng.integers(0, total + 1, 300)
        x = rng.integers(-1, k + 2)
        want = stats.hypergeom.cdf(x, total, K, k)
        got = hypergeom_cdf(x, total, K, k)
        tiny = want < 1e-250
        np.testing.assert_allclose(got[~tiny], want[~tiny], rtol=1e-7, atol=0)
        assert np.all(got[tiny] < 1e-240)
    marked = np.arange(0, 10**6, 97)
    want = stats.hypergeom.cdf(99, 10**6 - 1, marked, 129)
    ok = want > 1e-250
    every = hypergeom_cdf_by_marked(99, 10**6 - 1, 129)         # F = 0 .. 10^6 - 1
    for got in (every[marked], hypergeom_cdf(99, 10**6 - 1, marked, 129)):
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-7, atol=0)


def clock(over_select, m, deadline, partial):
    settings = TimingSettings(client_speed="uniform", over_select=over_select,
                              round_deadline=deadline, partial_work=partial)
    return VirtualClock(settings, uniform(), (3,), SIZES, m, LocalWork(batch_size=B), BYTES)


@pytest.mark.parametrize("deadline, partial, online", [
    pytest.param(None, False, None, marks=pytest.mark.slow), (2.45, True, ONLINE[1])])
def test_the_run_keeps_each_client_as_often_as_its_probability(deadline, partial, online):
    """The run's selection sampler (M = 4 of the online) and VirtualClock.select (m = 2) over
    R = 10^4 rounds: each kept client carries its p_i (enumerated), and each client's count of
    rounds kept is within 5 binomial standard deviations (plus 1) of R p_i."""
    vc = clock(2.0, 2, deadline, partial)
    ids = np.arange(SIZES.size) if online is None else online
    want = brute_force(uniform(), ids, 4, 2, deadline, partial)
    sampler, rounds = vc.selection_sampler(), 10_000
    clients, present, carried = [], [], []
    for t in range(rounds):
        (kept,), _ = vc.select(t, [sampler.cohort(3, t, online)],
                               None if online is None else [online])
        clients.append(kept.clients)
        present.append(kept.present)
        carried.append(kept.probabilities)
    clients, present, carried = (np.concatenate(v) for v in (clients, present, carried))
    np.testing.assert_allclose(carried[present], want[clients[present]], rtol=1e-12)
    assert np.all(carried[~present] == 0)
    count = np.bincount(clients[present], minlength=SIZES.size)
    bound = 5 * np.sqrt(rounds * want * (1 - want)) + 1
    assert np.all(np.abs(count - rounds * want) <= bound), (count / rounds, want)


def test_without_over_selection_the_kept_carry_the_selection_probability():
    """A deadline alone: the kept carry m / N (the tail is 1), as before."""
    vc = clock(1.0, 4, 2.45, False)
    cohort = vc.selection_sampler().cohort(3, 0)
    (kept,), _ = vc.select(0, [cohort])
    assert kept.present.any()
    np.testing.assert_array_equal(kept.probabilities[kept.present], 4 / SIZES.size)


def test_a_replays_known_p_is_the_mean_of_each_rounds_and_a_generated_one_reduces_to_it():
    """Schedule: p_i = the mean over the run's rounds of the enumerated p_i of each round's
    online set; a Bernoulli model of rates 1 gives the all-online p_i."""
    speeds, rounds = uniform(), 4
    available = np.zeros((rounds, SIZES.size), bool)
    for t, ids in enumerate(ONLINE + [np.arange(SIZES.size)]):
        available[t, ids] = True
    order = order_of(speeds, 2.45, True)
    cfg = tiny_config(num_rounds=rounds, clients_per_round=2, client_speed="uniform",
                      over_select=2.0, round_deadline=2.45, partial_work=True)
    want = np.mean([brute_force(speeds, np.flatnonzero(a), 4, 2, 2.45, True)
                    for a in available], axis=0)
    got = participation_probabilities(cfg, Schedule(available, rounds), SIZES.size, 2, order)
    np.testing.assert_allclose(got, np.where(want > 0, want, 1.0), rtol=1e-12)
    np.testing.assert_allclose(expected_kept_probability(order, np.ones(SIZES.size), 4, 2),
                               mean_kept_probability(order, 4, 2), rtol=1e-12)


def test_known_prob_on_an_over_selected_run_weighs_by_the_kept_probability(tiny_synthetic):
    """--algorithm=known_prob with lognormal speeds, a deadline, --over_select=1.5 (M = 6 of
    the 12 training clients, m = 4): its weight of client i is 1 / p_i, p_i enumerated over
    the 924 subsets (1 where p_i = 0: never kept, never used), so the round's update
    sum_{kept} Delta_i / p_i has mean sum_{i: p_i > 0} Delta_i exactly, where dividing by
    m / N (the weight before) gives Delta_i the mean weight p_i N / m, unequal across
    devices."""
    data = tiny_synthetic
    sizes = np.asarray(data.train.sizes, np.int64)
    N, d = sizes.size, int(np.prod(data.train.feature_shape))
    settings = TimingSettings(client_speed="lognormal")
    speeds = build_speeds(settings, num_clients=N, data_seed=tiny_config().data.data_seed)
    model_bytes = 4 * (d * data.num_classes + data.num_classes)   # the linear model's W, b
    full = 2.0 * model_bytes / speeds.bandwidth_Bps(np.arange(N)) + \
        speeds.per_example_s(np.arange(N)) * sizes
    deadline = float(np.quantile(full, 0.8))
    cfg = tiny_config(algorithm="known_prob", thetas=(1.0,), clients_per_round=4,
                      client_speed="lognormal", over_select=1.5, weighting="unweighted",
                      round_deadline=deadline)
    planned = -(-sizes // cfg.batch_size)
    rounds = []
    for subset in itertools.combinations(range(N), 6):
        ids = np.array(subset, np.int64)
        fin = finish(speeds, SlotJobs(ids, np.ones(6, bool), planned[ids], sizes[ids]),
                     cfg.batch_size, model_bytes, m=4, deadline=deadline, partial_work=False)
        rounds.append(ids[fin.keep])
    p = np.bincount(np.concatenate(rounds), minlength=N) / len(rounds)
    assert (p == 0).any() and (p > 0).sum() > 4

    algo = resolve(cfg, data).algorithm
    from deltafl_jax.algorithms.protocol import RoundContext
    w = np.asarray(algo.client_weights(RoundContext(
        state=algo.init(None, None), losses=None, sizes=np.ones(N, np.int32), hyper=None,
        key=None, clients=np.arange(N, dtype=np.int32))))
    np.testing.assert_allclose(w, 1.0 / np.where(p > 0, p, 1.0), rtol=1e-6)
    delta = np.random.default_rng(1).normal(size=N)
    mean_update = np.mean([delta[ids].dot(w[ids]) for ids in rounds])
    np.testing.assert_allclose(mean_update, delta[p > 0].sum(), rtol=1e-5)
    bias = p[p > 0] * N / 4       # E[update] / Delta_i under the weight N / m
    assert bias.max() - bias.min() > 0.2
