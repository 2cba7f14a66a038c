"""FedAU, MIFA, FedVARP and known-probability weighting through the real run path with a
replayed availability schedule (``--availability=schedule``) whose participation rates differ
by client, every online client sampled (m >= the most clients online in any round), against
the NumPy loops written from the authors' code of FedAU (tests/numpy_fedau.py; IBM/fedau at
commit 6e9cce9b2e568666b5c3e0fab8f092a539884d7b) fed the same schedule as the participation
matrix: the model after every round, within 1e-5. Then the run's p_i of known-probability
weighting (run.resolve.participation_probabilities) against the fixed sampler's draws over many
seeds and the closed forms, and MIFA and FedVARP with Poisson cohorts (empty slots, no
availability)."""

import functools

import jax
import numpy as np
import pytest

import numpy_fedau as ref
from conftest import client_lists, linear_rows, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.run.resolve import participation_probabilities
from deltafl_jax.sampling.availability import AvailabilitySettings, Bernoulli, Schedule
from deltafl_jax.sampling.samplers import FixedSampler

ROUNDS, EPOCHS, CAP = 10, 1, 2


def schedule(num_clients: int, rounds: int = ROUNDS) -> np.ndarray:
    """[rounds, N] bool: client i online every k_i rounds from round o_i, k_i in 1..5 (rates
    from 1 to 1/5); nobody online in round 6. Absences of up to 4 rounds, longer than the cap
    K = 2, so FedAU's pieces of K are recorded."""
    t = np.arange(rounds)[:, None]
    i = np.arange(num_clients)[None, :]
    every, start = 1 + i % 5, i % 3
    available = (t >= start) & ((t - start) % every == 0)
    available[6] = False
    return available


@pytest.fixture(scope="module")
def replay(tiny_synthetic, tmp_path_factory):
    """(path, available, m): the schedule's file and array; m = the most clients online in any
    round (every online client sampled, m < N)."""
    available = schedule(tiny_synthetic.train.num_clients)
    path = str(tmp_path_factory.mktemp("schedule") / "available.npz")
    np.savez(path, available=available)
    rates = available.mean(axis=0)
    m = int(available.sum(axis=1).max())
    assert m < available.shape[1] and len(set(rates.round(6))) >= 4 and rates.min() > 0
    return path, available, m


def run(tiny_synthetic, replay, algorithm, **kw):
    """Every round of `algorithm` under the schedule: (experiment, [state after round t])."""
    path, _, m = replay
    cfg = tiny_config(algorithm=algorithm, thetas=(), seeds=(1,), l2_reg=1e-3,
                      local_epochs=EPOCHS, batch_size=8, learning_rate=0.05,
                      num_rounds=ROUNDS, clients_per_round=m, weighting="unweighted",
                      online=AvailabilitySettings(model="schedule", schedule=path), **kw)
    exp = build_experiment(cfg, tiny_synthetic)
    state, keys, states = exp.initial_state(), exp.keys(), []
    for t in range(ROUNDS):
        state, _ = exp.round_fn(state, exp.round_data(t, state), keys)
        states.append(jax.device_get(state.params))
    return cfg, exp, states


def reference(tiny_synthetic, cfg, available, loop, **kw):
    """The NumPy loop's model after each round, fed the schedule's first t + 1 rows."""
    xs, ys = client_lists(tiny_synthetic.train)
    N = len(ys)
    local = ref.local_fn(xs, ys, cfg.seeds[0], cfg.learning_rate, cfg.l2_reg, 8, EPOCHS)
    W0 = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes))
    x0, beta = [W0, np.zeros(W0.shape[1])], np.full(N, 1.0 / N)
    return [loop([p.copy() for p in x0], available[:t + 1], local, beta, **kw)[0]
            for t in range(ROUNDS)]


def assert_every_round(states, wants):
    for t, (got, want) in enumerate(zip(states, wants)):
        for g, w in zip(linear_rows(got, 0), want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=f"round {t}")


def test_every_online_client_is_sampled_in_slot_order(tiny_synthetic, replay):
    """m >= the online count: the plan's cohort is exactly the round's online clients (sorted,
    then empty slots)."""
    path, available, m = replay
    cfg = tiny_config(algorithm="fedau", thetas=(), seeds=(1,), clients_per_round=m,
                      online=AvailabilitySettings(model="schedule", schedule=path))
    exp = build_experiment(cfg, tiny_synthetic)
    for t in range(ROUNDS):
        (cohort,) = exp.cohorts(t)
        online = np.flatnonzero(available[t])
        np.testing.assert_array_equal(cohort.clients[cohort.present], online)
        assert cohort.present.tolist() == [True] * online.size + [False] * (m - online.size)


def omegas(available, cap):
    """[rounds, N] the authors' omega of each client that takes part (NaN elsewhere)."""
    est = ref.AdaptiveWeights(available.shape[1], cap)
    return np.array([est.round(row) for row in available])


def test_fedau_with_a_cap_follows_the_authors_loop_round_by_round(tiny_synthetic, replay):
    available = replay[1]
    capped = omegas(available, CAP)
    assert np.nanmax(capped) > 1.0                               # omega moved off 1
    assert not np.array_equal(np.isnan(capped) | (capped == omegas(available, 0)),
                              np.ones_like(capped, bool))        # and the cap bites
    cfg, _, states = run(tiny_synthetic, replay, "fedau", fedau_cap=CAP)
    assert_every_round(states, reference(tiny_synthetic, cfg, available, ref.fedau, cap=CAP))


def test_mifa_follows_the_authors_loop_round_by_round(tiny_synthetic, replay):
    """Round 6 has no client online: MIFA still steps with its stored updates."""
    cfg, _, states = run(tiny_synthetic, replay, "mifa")
    wants = reference(tiny_synthetic, cfg, replay[1], ref.mifa)
    assert_every_round(states, wants)
    assert not np.allclose(linear_rows(states[6], 0)[0], linear_rows(states[5], 0)[0])


def test_fedvarp_follows_the_authors_loop_round_by_round(tiny_synthetic, replay):
    cfg, _, states = run(tiny_synthetic, replay, "fedvarp")
    N = replay[1].shape[1]
    wants = reference(tiny_synthetic, cfg, replay[1], ref.fedvarp, a=np.ones(N))
    assert_every_round(states, wants)


def test_known_prob_divides_by_the_schedules_rate(tiny_synthetic, replay):
    """p_i, wired from the run: the schedule's rate of client i (m >= every online count, so
    an online client always takes part), not m / N."""
    available = replay[1]
    cfg, _, states = run(tiny_synthetic, replay, "known_prob")
    rate = available.mean(axis=0)
    wants = reference(tiny_synthetic, cfg, available, ref.fedau, inverse_p=1.0 / rate)
    assert_every_round(states, wants)


# --- p_i as the run computes it (run.resolve.participation_probabilities) -------------------

def probabilities(available_or_model, m, sampler="fixed", rounds=ROUNDS):
    cfg = tiny_config(num_rounds=rounds, clients_per_round=m, client_sampling=sampler)
    model = available_or_model
    if isinstance(model, np.ndarray):
        model = Schedule(model, rounds)
    return participation_probabilities(cfg, model, model.num_clients, m)


def test_a_replays_p_is_the_fixed_samplers_expected_share_of_rounds():
    """m = 3, fewer than the online count in most rounds: p_i equals the fraction of the
    rounds in which the fixed sampler draws client i, counted over 3000 seeds (the standard
    error of each is below 0.004)."""
    available = schedule(12)
    m, seeds = 3, 3000
    sampler = FixedSampler(num_clients=12, slots=m)
    drawn = np.zeros(12)
    for seed in range(seeds):
        for t in range(ROUNDS):
            c = sampler.cohort(seed, t, np.flatnonzero(available[t]))
            drawn[c.clients[c.present]] += 1
    np.testing.assert_allclose(probabilities(available, m), drawn / (seeds * ROUNDS),
                               atol=0.015)


def test_p_with_every_online_client_sampled_is_the_rate_and_never_online_gets_1():
    available = schedule(12)
    available[:, 4] = False                     # client 4 never online: p = 1 (never used)
    want = np.where(available.mean(axis=0) > 0, available.mean(axis=0), 1.0)
    np.testing.assert_allclose(probabilities(available, 12), want)
    np.testing.assert_allclose(probabilities(available, 12, "poisson"), want)   # q = 1


def test_p_of_generated_availability_by_sampler():
    """Bernoulli rates r: Poisson r q (q = m / N); fixed r min(1, m / sum r); m / N with every
    client online."""
    r = np.array([0.1, 0.2, 0.4, 0.8])
    model = Bernoulli(r)
    np.testing.assert_allclose(probabilities(model, 2, "poisson"), r * 0.5)
    np.testing.assert_allclose(probabilities(model, 1), r / r.sum())
    np.testing.assert_allclose(probabilities(model, 2), r)              # sum r = 1.5 <= 2
    cfg = tiny_config(clients_per_round=3)
    np.testing.assert_allclose(participation_probabilities(cfg, None, 12, 3), np.full(12, 0.25))


@pytest.mark.parametrize("algorithm", ["mifa", pytest.param("fedvarp", marks=pytest.mark.slow)])
def test_poisson_cohorts_with_stored_updates_follow_the_authors_loop(tiny_synthetic, algorithm):
    """A variable cohort without availability (--client_sampling=poisson, q = 4/12): the
    participation matrix is the plan's cohorts; the model after 6 rounds and every client's
    stored update equal the NumPy loop's."""
    rounds = 6
    cfg = tiny_config(algorithm=algorithm, thetas=(), seeds=(1,), l2_reg=1e-3,
                      local_epochs=EPOCHS, batch_size=8, num_rounds=rounds,
                      clients_per_round=4, client_sampling="poisson", weighting="unweighted")
    exp = build_experiment(cfg, tiny_synthetic)
    N = tiny_synthetic.train.num_clients
    took = np.zeros((rounds, N), bool)
    state, keys = exp.initial_state(), exp.keys()
    for t in range(rounds):
        (cohort,) = exp.cohorts(t)
        took[t, cohort.clients[cohort.present]] = True
        state, _ = exp.round_fn(state, exp.round_data(t, state), keys)
    assert took[:, 0].any() and not took.all(axis=1).any()
    assert (took.sum(axis=1) < exp.num_sampled).any()             # some slots were empty
    xs, ys = client_lists(tiny_synthetic.train)
    local = ref.local_fn(xs, ys, 1, cfg.learning_rate, cfg.l2_reg, 8, EPOCHS)
    W0 = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes))
    beta = np.full(N, 1.0 / N)
    loop = ref.mifa if algorithm == "mifa" else functools.partial(ref.fedvarp, a=np.ones(N))
    want, stored = loop([W0, np.zeros(W0.shape[1])], took, local, beta)
    assert_every_round([jax.device_get(state.params)], [want])
    kept = jax.device_get(state.client_state)["Dense_0"]
    for k in range(N):          # every client's stored update (0 if it never trained)
        for got, w in zip((kept["kernel"][0, k], kept["bias"][0, k]), stored[k]):
            np.testing.assert_allclose(got, w, atol=1e-5, rtol=1e-5, err_msg=f"client {k}")
