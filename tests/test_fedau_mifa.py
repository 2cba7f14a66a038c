"""FedAU, known-probability weighting, MIFA, FedVARP and Delta-FL's participation correction
against NumPy loops written from the authors' code of FedAU (tests/numpy_fedau.py; IBM/fedau
at commit 6e9cce9b2e568666b5c3e0fab8f092a539884d7b): the pure functions on hand-made inputs
first, then rounds of the engine with partial participation (m < N, so each client's
participation differs), and a kill-and-resume run with MIFA's per-client state."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_fedau as ref
from conftest import run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.algorithms import deltafl as deltafl_module
from deltafl_jax.algorithms.fedau import FedAUOptions, KnownProbOptions, fedau, known_prob
from deltafl_jax.algorithms.mifa import MifaOptions, mifa
from deltafl_jax.algorithms.participation import (correction, fedau_omega, fedau_record,
                                                  init_estimator, inverse_rate, omega_all,
                                                  rate_record)
from deltafl_jax.algorithms.protocol import RoundContext
from deltafl_jax.algorithms.protocol import ClientFeedback
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.plan import sample_clients
from numpy_reference import exact_weights

ROUNDS, M, EPOCHS = 5, 4, 2


def lazy_omegas(took_part, cap):
    """[rounds, N] omega of the package's O(m) estimator for a participation matrix (NaN where
    the client does not take part), fed one round at a time with the cohort's ids."""
    N = took_part.shape[1]
    ids = jnp.arange(N, dtype=jnp.int32)     # every client a slot; those absent do not record
    omega = jax.jit(lambda s: fedau_omega(s, ids, cap))
    record = jax.jit(lambda s, took: fedau_record(s, ids, took, cap))
    state, out = jax.jit(init_estimator, static_argnums=0)(N), []
    for row in took_part:
        out.append(np.where(row, np.asarray(omega(state)), np.nan))
        state = record(state, jnp.asarray(row))
    return np.array(out), state


# --- the estimator on hand-made inputs -----------------------------------------------------

def test_omega_by_hand_an_absence_cut_into_pieces_of_k():
    """One client absent in rounds 0-4, present in 5, 6 and 9, K = 2. The authors' counter
    records 2 in rounds 1 and 3 (pieces of K), so round 5 uses mean(2, 2) = 2 and records
    (5 mod 2) + 1 = 2; round 6: mean(2, 2, 2) = 2, records 1; round 9 (2 missed: a piece of
    2 in round 8): mean(2, 2, 2, 1, 2) = 1.8. (min(interval, K) would give 1 in round 5.)"""
    took = np.zeros((10, 1), bool)
    took[[5, 6, 9], 0] = True
    got, _ = lazy_omegas(took, cap=2)
    np.testing.assert_allclose(got[[5, 6, 9], 0], [2.0, 2.0, 1.8], rtol=1e-6)


def test_omega_by_hand_without_a_cut_off():
    """Present in rounds 0, 3, 4 (no cut-off): 1 (none recorded; records 1), then mean(1) = 1
    (records 3), then mean(1, 3) = 2. A client first present in round 2 records 3."""
    took = np.zeros((5, 2), bool)
    took[[0, 3, 4], 0] = True
    took[[2, 4], 1] = True
    got, state = lazy_omegas(took, cap=0)
    np.testing.assert_allclose(got[[0, 3, 4], 0], [1.0, 1.0, 2.0])
    np.testing.assert_allclose(got[[2, 4], 1], [1.0, 3.0])
    assert state.total.tolist() == [1 + 3 + 1, 3 + 2] and state.count.tolist() == [3, 2]


@pytest.mark.parametrize("cap", [0, 1, 2, 3, 7])
def test_lazy_estimator_equals_the_authors_counter(cap):
    """Random participation with rates from 0.05 to 0.9 over 120 rounds: the O(m) estimator's
    omega equals the authors' per-round counter in every round; at the end, with the pieces of
    the absences still open recorded (omega_all), their estimate of every client."""
    rng = np.random.default_rng(cap)
    rates = np.linspace(0.05, 0.9, 9)
    took = rng.random((120, rates.size)) < rates
    got, state = lazy_omegas(took, cap)
    authors = ref.AdaptiveWeights(rates.size, cap)
    want = np.array([authors.round(row) for row in took])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    final = [np.mean(v) if v else 1.0 for v in authors.intervals]
    every = jax.jit(omega_all, static_argnums=1)(state, cap)
    np.testing.assert_allclose(np.asarray(every), final, rtol=1e-6)


def test_inverse_rate_by_hand():
    """(t + 1) / (c + 1): a client present in rounds 0 and 2 of 4 gets 1, 3/2; one present in
    round 3 alone gets 4."""
    took = np.zeros((4, 2), bool)
    took[[0, 2], 0] = True
    took[3, 1] = True
    rate, record = jax.jit(inverse_rate), jax.jit(rate_record)   # one program per cohort size
    state, got = jax.jit(init_estimator, static_argnums=0)(2), {}
    for t, row in enumerate(took):
        ids = np.flatnonzero(row).astype(np.int32)
        for i, w in zip(np.asarray(ids), np.asarray(rate(state, ids))):
            got[(t, int(i))] = float(w)
        state = record(state, ids, np.ones(ids.shape, bool))
    assert got == {(0, 0): 1.0, (2, 0): 1.5, (3, 1): 4.0}


def test_padded_slots_record_nothing():
    """Empty slots of a variable cohort (id 0 repeated, not taking part) leave client 0 alone."""
    state = jax.jit(init_estimator, static_argnums=0)(3)
    ids = np.asarray([2, 0, 0], np.int32)
    new = jax.jit(fedau_record, static_argnums=3)(state, ids, np.asarray([True, False, False]),
                                                  0)
    assert new.last.tolist() == [-1, -1, 0] and new.count.tolist() == [0, 0, 1]


def feedback(clients, sizes, delta_sum, trained=None):
    m = len(clients)
    trained = np.ones(m, bool) if trained is None else np.asarray(trained)
    return ClientFeedback(
        losses=np.full((m,), np.nan, np.float32), sizes=np.asarray(sizes, np.int32),
        weights=np.ones((m,), np.float32), delta_sum=np.asarray(delta_sum, np.float32),
        weight_sum=np.float32(trained.sum()), job_sqnorm=np.zeros((m,), np.float32),
        job_finite=trained, job_trained=trained,
        learning_rate=np.float32(0.1), clients=np.asarray(clients, np.int32))


@pytest.mark.parametrize("weighting,denominator", [("unweighted", 4.0), ("weighted", 100.0)])
def test_fedau_weights_and_step_on_hand_made_inputs(weighting, denominator):
    """Round 1 of 4 clients (n = 10, 20, 30, 40): client 2 took part in round 0 (interval 1),
    client 3 did not (first interval 2 recorded after use). Weights a = alpha omega; the step
    is the engine's sum of a_k Delta_k over N (unweighted) or n (weighted)."""
    sizes = np.array([10, 20, 30, 40])
    alg = fedau(sizes, FedAUOptions(weighting=weighting))
    server_update, client_weights = jax.jit(alg.server_update), jax.jit(alg.client_weights)
    state = jax.jit(alg.init)(None, None)
    zero = np.zeros(2, np.float32)
    _, state, _ = server_update(state, zero, feedback([2], [30], [0.0, 0.0]), None)
    a = client_weights(RoundContext(state, None, np.asarray([30, 40], np.int32), None, None,
                       np.asarray([2, 3], np.int32)))
    alpha = sizes[[2, 3]] if weighting == "weighted" else np.ones(2)
    np.testing.assert_allclose(np.asarray(a), alpha * [1.0, 1.0])
    delta, state, metrics = server_update(state, zero,
                                          feedback([2, 3], [30, 40], [4.0, -8.0]), None)
    np.testing.assert_allclose(np.asarray(delta), np.array([4.0, -8.0]) / denominator,
                               rtol=1e-6)
    assert state.count.tolist() == [0, 0, 2, 1] and state.total.tolist() == [0, 0, 2, 2]
    assert float(metrics["omega_mean"]) == 1.0


def test_known_prob_weights_are_inverse_probabilities():
    alg = known_prob([5, 5, 5], [0.5, 0.25, 1.0], KnownProbOptions(weighting="unweighted"))
    a = jax.jit(alg.client_weights)(RoundContext((), None, np.asarray([5, 5], np.int32), None,
                                                 None, np.asarray([0, 1], np.int32)))
    np.testing.assert_allclose(np.asarray(a), [2.0, 4.0])


@pytest.mark.parametrize("p", [[0.5, 0.0, 1.0], [0.5, 1.5, 1.0], [0.5, 0.5]])
def test_known_prob_refuses_probabilities_that_are_not_one_per_client_in_0_1(p):
    with pytest.raises(ConfigError, match="one probability in \\(0, 1\\] per training client"):
        known_prob([5, 5, 5], p)


def test_mifa_steps_with_the_stored_sum_in_a_round_with_no_client():
    """S = (1/N) sum G_i moves by the round's sum of (Delta_i - G_i) / N; with no client the
    step is S as stored."""
    alg = mifa([1, 1, 1, 1], MifaOptions(weighting="unweighted"))
    assert alg.steps_without_clients
    server_update = jax.jit(alg.server_update)
    params = np.zeros(2, np.float32)
    state = jax.jit(alg.init)(params, None)
    np.testing.assert_allclose(np.asarray(jax.jit(alg.client_weights)(RoundContext(
        state, None, np.asarray([3, 3], np.int32), None, None,
        np.asarray([0, 1], np.int32)))), [0.25, 0.25])
    # the engine's sum of a_i (Delta_i - G_i): clients 0 and 1 send (2, 0) and (0, 4), G = 0
    delta, state, _ = server_update(state, params, feedback([0, 1], [3, 3], [0.5, 1.0]), None)
    np.testing.assert_allclose(np.asarray(delta), [0.5, 1.0])
    delta, state, _ = server_update(state, params,
                                    feedback([0, 1], [3, 3], [0.0, 0.0], [False] * 2), None)
    np.testing.assert_allclose(np.asarray(delta), [0.5, 1.0])


# --- Delta-FL's participation correction ---------------------------------------------------

def test_deltafl_correction_multiplies_alpha_by_omega():
    """Client 7 took part in rounds 0 and 4 (omega = mean(1, 4) = 2.5 in round 8; it records
    4 then), the others first appear in round 8 (omega 1): the filter is the exact
    superquantile of the losses with weights n_k omega_k (NumPy's, numpy_reference)."""
    options = deltafl_module.DeltaFLOptions(deltafl_participation="fedau")
    alg = deltafl_module.deltafl(options, thetas=(0.5,), num_clients=10)
    state = jax.jit(alg.init)(None, None)
    record = jax.jit(fedau_record, static_argnums=3)   # one program per cohort size
    for t in range(8):
        ids = np.asarray([7] if t in (0, 4) else [], np.int32)
        state = record(state, ids, np.ones(ids.shape, bool), 0)
    clients, sizes = np.array([1, 3, 7, 9]), np.array([10, 30, 20, 40])
    losses = np.array([0.5, 1.0, 2.0, 0.8], np.float32)
    got = np.asarray(jax.jit(alg.client_weights)(RoundContext(
        state, losses, sizes.astype(np.int32),
        deltafl_module.DeltaFLHyper(theta=np.float32(0.5)), None, clients.astype(np.int32))))
    want = exact_weights(losses.astype(np.float64), sizes * np.array([1, 1, 2.5, 1]), 0.5)
    np.testing.assert_allclose(got / np.sum(got), want / want.sum(), atol=1e-6)
    plain = exact_weights(losses.astype(np.float64), sizes.astype(np.float64), 0.5)
    assert not np.allclose(plain / plain.sum(), want / want.sum())   # the correction mattered


@pytest.mark.parametrize("kind", ["fedau", "inverse"])
def test_uniform_participation_gives_every_client_the_same_correction_in_expectation(kind):
    """m = 3 of N = 12 drawn uniformly for 6000 rounds: every client's correction (as if it
    took part in the next round) is N / m = 4 within 10% (the standard error of a mean of
    ~1500 geometric intervals is 2.3%), so the relative weights are those of none."""
    N, m, rounds = 12, 3, 6000
    corr = correction(kind, 0)
    ids = jnp.asarray(np.stack([sample_clients(5, t, N, m) for t in range(rounds)]))

    def one(state, row):
        return corr.record(state, row, jnp.ones((m,), bool)), None

    @jax.jit   # one program, not one per operation
    def corrections(ids):
        state, _ = jax.lax.scan(one, init_estimator(N), ids)
        return corr.weights(state, jnp.arange(N))
    c = np.asarray(corrections(ids))
    np.testing.assert_allclose(c, N / m, rtol=0.1)


def tiny_exp(tiny_synthetic, algorithm, rounds, **kw):
    kw.setdefault("thetas", ())
    kw.setdefault("seeds", (1, 2))
    cfg = tiny_config(algorithm=algorithm, l2_reg=1e-3, local_epochs=EPOCHS,
                      batch_size=8, **kw)
    exp = build_experiment(cfg, tiny_synthetic)
    return cfg, exp, run_rounds_history(exp, rounds)


@pytest.fixture(scope="module")
def full_participation(tiny_synthetic):
    """Delta-FL at theta = 0.5 with every client in every round, no correction."""
    N = tiny_synthetic.train.num_clients
    return dict(thetas=(0.5,), clients_per_round=N, seeds=(1,)), tiny_exp(
        tiny_synthetic, "deltafl", 3, thetas=(0.5,), clients_per_round=N, seeds=(1,))[2][0]


@pytest.mark.parametrize("kind", ["fedau", "inverse"])
def test_full_participation_corrections_change_nothing(tiny_synthetic, full_participation,
                                                       kind):
    """Every client in every round (m = N): omega = 1 and p_hat = 1 exactly, the same models as
    --deltafl_participation=none bit for bit."""
    kw, plain = full_participation
    _, _, (corrected, _) = tiny_exp(tiny_synthetic, "deltafl", 3, deltafl_participation=kind,
                                    **kw)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(corrected.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- rounds of the engine against the NumPy loops ------------------------------------------

def problem(tiny_synthetic, weighting, lr, l2, seed):
    train = tiny_synthetic.train
    xs = [train.client(k)[0].astype(np.float64) for k in range(train.num_clients)]
    ys = [train.client(k)[1] for k in range(train.num_clients)]
    n = np.array([len(y) for y in ys], np.float64)
    beta = n / n.sum() if weighting == "weighted" else np.full(n.size, 1.0 / n.size)
    W0 = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes))
    took = ref.sampled_matrix(seed, ROUNDS, train.num_clients, M)
    assert M < train.num_clients and len(set(took.sum(0))) > 1   # rates differ per client
    local = ref.local_fn(xs, ys, seed, lr, l2, 8, EPOCHS)
    return [W0, np.zeros(W0.shape[1])], took, local, beta, n


def rows(tree, *index):
    p = jax.device_get(tree)["Dense_0"]
    return [np.asarray(p["kernel"][index], np.float64), np.asarray(p["bias"][index], np.float64)]


def assert_params(state, r, want):
    for got, w in zip(rows(state.params, r), want):
        np.testing.assert_allclose(got, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weighting,cap,etas", [
    ("unweighted", 2, (1.0,)), pytest.param("weighted", 0, (1.0, 0.7), marks=pytest.mark.slow)])
def test_fedau_rounds_equal_the_authors_loop(tiny_synthetic, weighting, cap, etas):
    cfg, exp, (state, hist) = tiny_exp(tiny_synthetic, "fedau", ROUNDS, clients_per_round=M,
                                       weighting=weighting, fedau_cap=cap, server_lr=etas)
    for r, lab in enumerate(exp.replicas.labels):
        eta = dict(lab.extra).get("server_lr", 1.0)
        x0, took, local, beta, _ = problem(tiny_synthetic, weighting, cfg.learning_rate,
                                           cfg.l2_reg, lab.seed)
        want, used = ref.fedau(x0, took, local, beta, eta, cap)
        assert_params(state, r, want)
        np.testing.assert_allclose([h["omega_mean"][r] for h in hist],
                                   np.nanmean(used, axis=1), rtol=1e-6)
        assert np.nanmax(used) > 1.0                             # omega moved off 1


def test_known_prob_rounds_equal_the_authors_loop(tiny_synthetic):
    cfg, exp, (state, _) = tiny_exp(tiny_synthetic, "known_prob", ROUNDS, clients_per_round=M,
                                    weighting="unweighted")
    N = tiny_synthetic.train.num_clients
    for r, lab in enumerate(exp.replicas.labels):
        x0, took, local, beta, _ = problem(tiny_synthetic, "unweighted", cfg.learning_rate,
                                           cfg.l2_reg, lab.seed)
        want, _ = ref.fedau(x0, took, local, beta, inverse_p=np.full(N, N / M))
        assert_params(state, r, want)


@pytest.mark.parametrize("weighting,etas", [
    ("unweighted", (1.0, 0.7)), pytest.param("weighted", (1.0,), marks=pytest.mark.slow)])
def test_mifa_rounds_equal_the_authors_loop(tiny_synthetic, weighting, etas):
    cfg, exp, (state, _) = tiny_exp(tiny_synthetic, "mifa", ROUNDS, clients_per_round=M,
                                    weighting=weighting, server_lr=etas)
    for r, lab in enumerate(exp.replicas.labels):
        eta = dict(lab.extra).get("server_lr", 1.0)
        x0, took, local, beta, _ = problem(tiny_synthetic, weighting, cfg.learning_rate,
                                           cfg.l2_reg, lab.seed)
        want, G = ref.mifa(x0, took, local, beta, eta)
        assert_params(state, r, want)
        for k in range(len(beta)):      # every client's stored update (0 if it never trained)
            for got, w in zip(rows(state.client_state, r, k), G[k]):
                np.testing.assert_allclose(got, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weighting", [
    "unweighted", pytest.param("weighted", marks=pytest.mark.slow)])
def test_fedvarp_rounds_equal_the_authors_loop(tiny_synthetic, weighting):
    cfg, exp, (state, _) = tiny_exp(tiny_synthetic, "fedvarp", ROUNDS, clients_per_round=M,
                                    weighting=weighting)
    for r, lab in enumerate(exp.replicas.labels):
        x0, took, local, beta, n = problem(tiny_synthetic, weighting, cfg.learning_rate,
                                           cfg.l2_reg, lab.seed)
        a = n if weighting == "weighted" else np.ones_like(n)
        want, _ = ref.fedvarp(x0, took, local, beta, a)
        assert_params(state, r, want)


def test_a_negative_cap_exits_2_with_one_line(tmp_path, capsys):
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=fedau", "--fedau_cap=-1",
                               f"--output_dir={tmp_path / 'o'}"], capsys)
    assert code == 2 and "--fedau_cap" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ("--algorithm=mifa", "--thetas=1", "--weighting=unweighted", "--server_lr=0.5,1"),
    ("--algorithm=fedau", "--thetas=1", "--fedau_cap=3")], ids=["mifa", "fedau"])
def test_sigkill_then_rerun_is_bit_identical(tmp_path, flags):
    """MIFA's stored updates (per-client state) and their sum (server state), FedAU's
    estimate (server state), through a checkpoint: a run killed with SIGKILL and rerun ends
    bit-identical to an uninterrupted one."""
    import test_resume as resume
    whole = str(tmp_path / "whole")
    proc = resume.run(whole, *flags)
    assert proc.returncode == 0, proc.stderr
    out = str(tmp_path / "run")
    proc = resume.start_and_kill(out, signal.SIGKILL, *flags, after_checkpoint=6)
    assert proc.returncode == -signal.SIGKILL
    resumed = resume.run(out, *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("resuming") == 1, resumed.stdout
    resume.assert_same_outputs(out, whole)
