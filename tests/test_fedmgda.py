"""FedMGDA+ (Hu et al. 2022, Algorithm 1): the box-simplex projection and the round's min-norm
QP against scipy's SLSQP and an exact active-set enumeration written here, then 3 rounds
against a NumPy loop written from the paper (partial participation, two local epochs, two
epsilons and two global learning rates in one program); its limit eps = 0 is the uniform mean
of the normalised updates."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from conftest import client_lists, linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.algorithms import fedmgda
from numpy_baselines import _local
from deltafl_jax.sampling.plan import sample_clients

ROUNDS, M, EPOCHS = 3, 6, 2
# The QP's pieces jitted: one program per size, not one compile per operation run eagerly.
project_box_simplex = jax.jit(fedmgda.project_box_simplex)
min_norm_weights = jax.jit(fedmgda.min_norm_weights, static_argnums=3)


def box_of(m, eps):
    return np.full(m, max(1.0 / m - eps, 0.0)), np.full(m, min(1.0 / m + eps, 1.0))


def exact_qp(K, lo, hi):
    """min lambda^T K lambda over sum lambda = 1, lo <= lambda <= hi, by enumerating which
    bound each lambda_k sits at (or neither) and solving the KKT system of the free ones;
    the best feasible candidate is the optimum (the problem is convex)."""
    m = len(lo)
    best, arg = np.inf, None
    for assign in itertools.product((0, 1, 2), repeat=m):
        lam = np.where(np.array(assign) == 0, lo, hi).astype(float)
        free = [i for i in range(m) if assign[i] == 2]
        fixed = [i for i in range(m) if assign[i] != 2]
        if free:
            F = np.array(free)
            A = np.array(fixed, int)
            lhs = np.zeros((len(F) + 1, len(F) + 1))
            lhs[:-1, :-1] = 2 * K[np.ix_(F, F)]
            lhs[:-1, -1] = lhs[-1, :-1] = 1.0
            rhs = np.zeros(len(F) + 1)
            rhs[:-1] = -2 * K[np.ix_(F, A)] @ lam[A] if len(A) else 0.0
            rhs[-1] = 1.0 - (lam[A].sum() if len(A) else 0.0)
            lam[F] = np.linalg.lstsq(lhs, rhs, rcond=None)[0][:-1]
        ok = (abs(lam.sum() - 1) < 1e-9 and np.all(lam >= lo - 1e-12)
              and np.all(lam <= hi + 1e-12))
        if ok and lam @ K @ lam < best:
            best, arg = lam @ K @ lam, lam
    return arg


def slsqp(objective, gradient, m, lo, hi, x0):
    res = optimize.minimize(objective, x0, jac=gradient, method="SLSQP",
                            bounds=list(zip(lo, hi)),
                            constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1.0,
                                          "jac": lambda x: np.ones(m)}],
                            options={"ftol": 1e-13, "maxiter": 1000})
    assert res.success, res.message
    return res.x


@pytest.mark.parametrize("case", range(10))
def test_projection_matches_slsqp(case):
    rng = np.random.default_rng(case)
    m = int(rng.integers(2, 12))
    y = rng.normal(scale=rng.choice([0.1, 1.0, 5.0]), size=m)
    lo, hi = box_of(m, float(rng.choice([0.0, 0.03, 0.2, 1.0])))
    got = np.asarray(project_box_simplex(jnp.asarray(y), jnp.asarray(lo), jnp.asarray(hi)))
    want = slsqp(lambda x: np.sum((x - y) ** 2), lambda x: 2 * (x - y), m, lo, hi,
                 np.full(m, 1.0 / m))
    np.testing.assert_allclose(got, want, atol=1e-6)


def _random_updates(rng, m, dim):
    """m normalised vectors around a common direction (FL updates mostly agree)."""
    G = rng.normal(size=(m, dim)) + rng.uniform(0, 3) * rng.normal(size=dim)
    return G / np.linalg.norm(G, axis=1, keepdims=True)


@pytest.mark.parametrize("case", range(12))
def test_min_norm_qp_matches_scipy(case):
    """The direction d = sum lambda_k g_k is unique (lambda need not be: dim < m makes the
    Gram matrix singular); compare d and the objective."""
    rng = np.random.default_rng(100 + case)
    m, dim = int(rng.integers(3, 8)), int(rng.choice([2, 5, 60]))
    G = _random_updates(rng, m, dim)
    K = G @ G.T
    eps = float(rng.choice([0.02, 0.1, 0.3, 1.0]))
    lo, hi = box_of(m, eps)
    lam = np.asarray(min_norm_weights(jnp.asarray(K, jnp.float32), jnp.ones(m, bool), eps,
                                      1000), np.float64)
    ref = slsqp(lambda x: x @ K @ x, lambda x: 2 * K @ x, m, lo, hi, np.full(m, 1.0 / m))
    exact = exact_qp(K, lo, hi)
    assert np.all(lam >= lo - 1e-6) and np.all(lam <= hi + 1e-6)
    assert abs(lam.sum() - 1) < 1e-5
    for want in (ref, exact):
        np.testing.assert_allclose(lam @ G, want @ G, atol=1e-5)
        assert lam @ K @ lam == pytest.approx(want @ K @ want, abs=1e-6)


def test_qp_boundary_cases():
    K = np.array([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])   # g_1 = -g_2
    lam = np.asarray(min_norm_weights(jnp.asarray(K, jnp.float32), jnp.ones(3, bool), 1.0,
                                      500))
    np.testing.assert_allclose(lam, [0.5, 0.5, 0.0], atol=1e-5)             # d = 0 reached
    valid = jnp.asarray([True, False, True])                                 # one left out
    lam = np.asarray(min_norm_weights(jnp.asarray(K, jnp.float32), valid, 0.0, 50))
    np.testing.assert_array_equal(lam, [0.5, 0.0, 0.5])
    none = min_norm_weights(jnp.asarray(K, jnp.float32), jnp.zeros(3, bool), 0.3, 50)
    np.testing.assert_array_equal(np.asarray(none), 0.0)


def fedmgda_round(W, b, xs, ys, seed, t, m, lr, l2, batch, epochs, eps, eta):
    """Algorithm 1: FedAvg's local training, then normalise, the min-norm QP in the box
    (exact_qp; eps = 0: the uniform mean, no QP), w <- w + eta d."""
    chosen = sample_clients(seed, t, len(xs), m)
    g = []
    for k in chosen:
        Wk, bk = _local(W, b, xs, ys, k, seed, t, lr, l2, batch, epochs)
        d = np.concatenate([(Wk - W).ravel(), bk - b])
        g.append(d / np.linalg.norm(d))
    g = np.array(g)
    lam = np.full(m, 1.0 / m) if eps == 0 else exact_qp(g @ g.T, *box_of(m, eps))
    d = eta * lam @ g
    return W + d[:W.size].reshape(W.shape), b + d[W.size:]


@pytest.fixture(scope="module")
def three_rounds(tiny_synthetic):
    """run(lanes): (config, experiment, the models after round 1 (on the host), the final
    state, the rounds' metrics) of 3 rounds, each number of lanes run once in the module."""
    runs = {}

    def run(lanes):
        if lanes not in runs:
            cfg = tiny_config(algorithm="fedmgda", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                              clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                              clients_per_step=lanes, fedmgda_epsilon=(0.0, 0.05, 1.0),
                              fedmgda_iters=1000, server_lr=(1.0, 0.3))
            exp = build_experiment(cfg, tiny_synthetic)
            first, _ = run_rounds_history(exp, 1)
            first = jax.device_get(first.params)   # before the next round takes the state
            state, hist = run_rounds_history(exp, ROUNDS)
            runs[lanes] = cfg, exp, first, state, hist
        return runs[lanes]
    return run


@pytest.mark.parametrize("lanes", [3, 1])
def test_three_rounds_equal_algorithm_1(tiny_synthetic, three_rounds, lanes):
    cfg, exp, _, state, hist = three_rounds(lanes)
    xs, ys = client_lists(tiny_synthetic.train)
    assert M < len(xs)
    for r, lab in enumerate(exp.replicas.labels):
        eta = dict(lab.extra)["server_lr"]
        W, b = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes)), np.zeros(10)
        for t in range(ROUNDS):
            W, b = fedmgda_round(W, b, xs, ys, lab.seed, t, M, cfg.learning_rate, cfg.l2_reg,
                                 cfg.batch_size, EPOCHS, lab.param_value, eta)
        got_W, got_b = linear_rows(state.params, r)
        np.testing.assert_allclose(got_W, W, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got_b, b, atol=1e-5, rtol=1e-5)
    # Round 1 starts every replica from w_0 = 0: there the min-norm point (eps = 1) is shorter
    # than the uniform mean (eps = 0) of the same updates, and the weights stay in their box.
    norms = np.array([h["fedmgda_direction_norm"] for h in hist])     # [T, R]
    weights = np.array([h["fedmgda_weight_max"] for h in hist])
    eps = np.array([lab.param_value for lab in exp.replicas.labels])
    assert np.all(norms[0, eps == 1.0] < norms[0, eps == 0.0] - 1e-3)
    np.testing.assert_allclose(weights[:, eps == 0.0], 1.0 / M, rtol=1e-6)
    assert np.all(weights[:, eps == 0.05] <= 1.0 / M + 0.05 + 1e-6)


def test_epsilon_zero_is_the_uniform_mean_of_normalised_updates(tiny_synthetic, three_rounds):
    """One round at eps = 0 against FedAvg's own client models (uniform weights, plain step):
    w_1 = w_0 + mean_k (w_k - w_0) / ||w_k - w_0||. The replica at eps = 0, eta = 1, seed 1
    of the 3-lane run above, after its first round."""
    _, exp, first, _, _ = three_rounds(3)
    (r,) = [r for r, lab in enumerate(exp.replicas.labels) if lab.param_value == 0.0
            and dict(lab.extra)["server_lr"] == 1.0 and lab.seed == 1]
    xs, ys = client_lists(tiny_synthetic.train)
    W0, b0 = np.zeros((xs[0].shape[1], 10)), np.zeros(10)
    steps = []
    for k in sample_clients(1, 0, len(xs), M):
        Wk, bk = _local(W0, b0, xs, ys, k, 1, 0, 0.05, 1e-3, 8, EPOCHS)
        d = np.concatenate([(Wk - W0).ravel(), bk - b0])
        steps.append(d / np.linalg.norm(d))
    mean = np.mean(steps, axis=0)
    got_W, got_b = linear_rows(first, r)
    np.testing.assert_allclose(np.concatenate([got_W.ravel(), got_b]), mean, atol=1e-6)


@pytest.mark.parametrize("flag,message",
                         [("--fedmgda_epsilon=-0.1", "--fedmgda_epsilon must be >= 0"),
                          ("--fedmgda_iters=0", "--fedmgda_iters must be")])
def test_bad_settings_are_refused(tmp_path, capsys, flag, message):
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=fedmgda", flag,
                               f"--output_dir={tmp_path / 'o'}"], capsys)
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
