"""The client samplers (deltafl_jax.sampling): the moved fixed, Poisson, cyclic and by-weights
samplers give the round plans recorded from the code before they moved
(tests/fixtures/plans_before_36.npz, written by tests/fixtures/record_plans_before_36.py), and
among the online clients they draw as their docstrings say."""

import os

import numpy as np
import pytest

from deltafl_jax.sampling import plan
from deltafl_jax.sampling import (CyclicSampler, FixedSampler, PoissonSampler, Sampling,
                                  WeightedSampler)
from deltafl_jax.sampling.samplers import sample_clients

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "plans_before_36.npz")


def _sampler(name, N, probs):
    return {"fixed": (FixedSampler(N, 5), 5, False),
            "poisson": (PoissonSampler(N, 5 / N, 9), 9, False),
            "cyclic": (CyclicSampler(N, 5), 5, False),
            "weights": (WeightedSampler(N, 5), 5, True)}[name]


@pytest.mark.parametrize("name", ["fixed", "poisson", "cyclic", "weights"])
def test_the_moved_samplers_give_the_recorded_plans_bit_for_bit(name):
    rec = np.load(FIXTURE)
    sizes = rec["sizes"]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    N = sizes.size
    sampler, m, replace = _sampler(name, N, rec["probs"])
    for steps in (None, 3):
        work = plan.LocalWork(batch_size=4, local_epochs=2, local_steps=steps)
        caps = plan.capacities(sizes, m, work, 8, with_replacement=replace)
        for t in range(4):
            if name == "weights":
                cohorts = [sampler.with_weights(rec["probs"][g]).cohort(s, t)
                           for g, s in enumerate((3, 11))]
            else:
                cohorts = plan.draw_cohorts(sampler, (3, 11), t)
            for packed in (False, True):
                p = plan.make_round_plan([3, 11], t, offsets, m, work, caps, packed=packed,
                                         cohorts=cohorts)
                for f in p._fields:
                    want = rec[f"{name}_{steps}_{t}_{int(packed)}_{f}"]
                    got = getattr(p, f)
                    assert got.dtype == want.dtype, (name, steps, t, f)
                    np.testing.assert_array_equal(got, want, err_msg=f"{name} {steps} {t} {f}")


def test_the_default_plan_is_the_fixed_sampler():
    rec = np.load(FIXTURE)
    sizes = rec["sizes"]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    work = plan.LocalWork(batch_size=4, local_epochs=2)
    caps = plan.capacities(sizes, 5, work, 8)
    p = plan.make_round_plan([3, 11], 2, offsets, 5, work, caps)
    np.testing.assert_array_equal(p.train_idx, rec["fixed_None_2_0_train_idx"])


def test_every_client_online_is_the_same_as_no_availability():
    """online = every id draws what online=None draws (the same stream, the same indices)."""
    N = 40
    everyone = np.arange(N)
    for s in (FixedSampler(N, 7), PoissonSampler(N, 0.2, 14), CyclicSampler(N, 7),
              WeightedSampler(N, 7, np.linspace(1, 2, N))):
        for t in range(5):
            a, b = s.cohort(4, t), s.cohort(4, t, everyone)
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


def test_fixed_draws_m_online_clients_uniformly():
    """Each of k > m online clients is sampled with chance m / k; the offline never."""
    N, m = 30, 4
    online = np.array([1, 5, 6, 9, 14, 20, 22, 29])
    s = FixedSampler(N, m)
    counts = np.zeros(N)
    T = 4000
    for t in range(T):
        c = s.cohort(2, t, online)
        assert c.present.all() and len(set(c.clients.tolist())) == m
        assert np.all(np.diff(c.clients) > 0)
        counts[c.clients] += 1
    rate = counts[online] / T
    se = np.sqrt(0.5 * 0.5 / T)
    assert np.all(np.abs(rate - m / online.size) < 5 * se)
    assert counts[np.setdiff1d(np.arange(N), online)].sum() == 0
    np.testing.assert_allclose(c.probabilities, m / online.size)


def test_fixed_with_fewer_online_than_m_takes_them_all_and_leaves_empty_slots():
    s = FixedSampler(30, 5)
    c = s.cohort(1, 0, np.array([3, 17]))
    assert c.clients.tolist() == [3, 17, 0, 0, 0]
    assert c.present.tolist() == [True, True, False, False, False]
    np.testing.assert_array_equal(c.probabilities, [1, 1, 0, 0, 0])
    empty = s.cohort(1, 0, np.array([], np.int64))
    assert not empty.present.any()


def test_poisson_joins_each_online_client_with_q():
    N, q = 50, 0.3
    online = np.arange(0, N, 3)
    s = PoissonSampler(N, q, 40)
    T = 3000
    counts = np.zeros(N)
    for t in range(T):
        c = s.cohort(5, t, online)
        counts[c.clients[c.present]] += 1
    rate = counts[online] / T
    assert np.all(np.abs(rate - q) < 5 * np.sqrt(q * (1 - q) / T))
    assert counts[np.setdiff1d(np.arange(N), online)].sum() == 0


def test_cyclic_keeps_its_groups_online_members():
    N, m = 20, 5
    s = CyclicSampler(N, m)
    online = np.arange(0, N, 2)
    for t in range(8):
        full = s.cohort(3, t)
        c = s.cohort(3, t, online)
        want = full.clients[np.isin(full.clients, online)]
        np.testing.assert_array_equal(c.clients[c.present], want)
        assert c.present.sum() == want.size


def test_weighted_draws_among_the_online_by_their_renormalised_weights():
    N, m = 6, 3
    w = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    online = np.array([1, 4])
    s = WeightedSampler(N, m, w)
    T = 3000
    counts = np.zeros(N)
    for t in range(T):
        c = s.cohort(8, t, online)
        counts += np.bincount(c.clients, minlength=N)
    share = counts / counts.sum()
    np.testing.assert_allclose(share[online], [2 / 7, 5 / 7], atol=0.03)
    assert share[[0, 2, 3, 5]].sum() == 0
    assert not WeightedSampler(N, m, w).cohort(1, 0, np.array([], int)).present.any()


def test_the_settings_group_builds_each_sampler():
    s = Sampling(sampler="poisson").build(200, 20, rounds=20, overflow_budget=1e-12)
    assert isinstance(s, PoissonSampler) and s.q == 0.1
    assert s.cap == plan.poisson_cap(200, 0.1, 20, 1e-12)
    assert isinstance(Sampling().build(200, 20, rounds=1, overflow_budget=1.0), FixedSampler)
    np.testing.assert_array_equal(Sampling().build(50, 4, rounds=1, overflow_budget=1.0)
                                  .cohort(7, 3).clients, sample_clients(7, 3, 50, 4))


class _Chain:
    """A stateful availability for the test: client i online in round r iff (i + the number
    of rounds drawn so far for the seed + seed) is even; its state is that number."""

    def __init__(self, n):
        self.num_clients, self.drawn = n, {}

    def online(self, seed, t):
        k = self.drawn.get(seed, 0)
        assert k == t, "drawn in order"
        self.drawn[seed] = k + 1
        return np.flatnonzero((np.arange(self.num_clients) + k + seed) % 2 == 0)

    def state(self, seed):
        return {"drawn": np.asarray(self.drawn.get(seed, 0))}

    def restore(self, seed, state, next_round):
        assert int(state["drawn"]) == next_round
        self.drawn[seed] = int(state["drawn"])


def _run_rounds(part, sampler, rounds):
    for t in rounds:
        online = part.online(t)
        part.online(t + 1)    # the run plans the next round before counting this one
        part.drawn(t, plan.draw_cohorts(sampler, part.seeds, t, online))
        part.count(t)


def test_participation_counts_rounds_online_and_sampled_and_resumes_from_its_state():
    from deltafl_jax.run.planning import Participation
    N, m, seeds = 9, 3, (4, 7, 4)   # groups 0 and 2 share seed 4
    sampler = FixedSampler(N, m)
    whole = Participation(seeds, N, _Chain(N))
    _run_rounds(whole, sampler, range(6))
    online = np.zeros((3, N), np.int64)
    sampled = np.zeros((3, N), np.int64)
    for g, seed in enumerate(seeds):
        for t in range(6):
            ids = np.flatnonzero((np.arange(N) + t + seed) % 2 == 0)
            online[g, ids] += 1
            sampled[g, sampler.cohort(seed, t, ids).clients] += 1
    np.testing.assert_array_equal(whole.online_rounds, online)
    np.testing.assert_array_equal(whole.sampled_rounds, sampled)
    first = Participation(seeds, N, _Chain(N))
    _run_rounds(first, sampler, range(4))
    resumed = Participation(seeds, N, _Chain(N))
    resumed.restore(first.state())
    _run_rounds(resumed, sampler, range(4, 6))
    np.testing.assert_array_equal(resumed.online_rounds, online)
    np.testing.assert_array_equal(resumed.sampled_rounds, sampled)
