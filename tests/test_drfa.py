"""DRFA against a NumPy loop written from Algorithm 1 of Deng, Kamani, Mahdavi (NeurIPS 2020)
(:func:`drfa_rounds`, float64): clients drawn with replacement by lambda, a snapshot after a
random step t' of the local period, the plain mean of the local models, a second uniform sample
evaluated at the snapshot average, lambda's projected ascent with v_i = (N/m) f_i; and the
``fedtorch`` variant against a loop written from the authors' centred FedTorch code
(``numpy_drfa_fedtorch``). The loops share with the engine only the random draws
(deltafl_jax.sampling.plan's streams and the replica's round key); partial participation, several local
steps, 3 rounds, both lane layouts. With gamma = 0 lambda stays uniform (paper)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import client_lists, linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.algorithms.drfa import SNAPSHOT_STREAM
from deltafl_jax.sampling.plan import client_permutations, sample_by_weights, sample_clients
from numpy_baselines import project_simplex_bisection
from numpy_drfa_fedtorch import Draws, fedtorch_drfa
from numpy_reference import client_loss, grad_mean_xent

ROUNDS, M, K, B, L2, LR = 3, 6, 3, 8, 1e-3, 0.05
PROBE_STREAM = 4   # deltafl_jax.sampling.plan's stream of the second sample (documented there)


def snapshot_step(seed, t):
    key = jax.random.fold_in(jax.random.key(np.uint32(seed)), t)
    u = float(jax.random.uniform(jax.random.fold_in(key, SNAPSHOT_STREAM)))
    return min(1 + int(np.floor(u * K)), K)


def local(W, b, x, y, seed, t, client, at):
    """K SGD steps in the plan's order; (final model, the model after `at` steps)."""
    n = len(y)
    order = client_permutations(seed, t, int(client), n, -(-(K * B) // n))
    snap = None
    for s in range(K):
        idx = order[s * B:(s + 1) * B]
        gW, gb = grad_mean_xent(W, b, x[idx], y[idx])
        W, b = W - LR * (gW + L2 * W), b - LR * (gb + L2 * b)
        if s + 1 == at:
            snap = (W, b)
    return (W, b), snap


def drfa_rounds(xs, ys, seed, gamma):
    N = len(xs)
    W, b = np.zeros((xs[0].shape[1], 10)), np.zeros(10)
    lam = np.full(N, 1.0 / N)
    for t in range(ROUNDS):
        chosen = sample_by_weights(seed, t, lam, M)
        a = np.full(M, 1.0 / M)
        at = snapshot_step(seed, t)
        dW, db, sW, sb = 0.0, 0.0, 0.0, 0.0
        for ak, k in zip(a, chosen):
            (Wk, bk), (Sk, sk) = local(W, b, xs[k], ys[k], seed, t, k, at)
            dW, db = dW + ak * (Wk - W), db + ak * (bk - b)
            sW, sb = sW + ak * (Sk - W), sb + ak * (sk - b)
        probe = np.sort(np.random.default_rng([seed, t, PROBE_STREAM]).choice(
            N, size=M, replace=False))
        v = np.zeros(N)
        for i in probe:
            v[i] += N / M * client_loss(W + sW, b + sb, xs[i], ys[i], L2)
        lam = project_simplex_bisection(lam + K * gamma * v)
        W, b = W + dW, b + db
    return W, b, lam


@pytest.mark.parametrize("lanes", [3, 1])
def test_three_rounds_equal_algorithm_1(tiny_synthetic, lanes):
    cfg = tiny_config(algorithm="drfa", thetas=(), seeds=(1, 2), l2_reg=L2, local_steps=K,
                      clients_per_round=M, batch_size=B, learning_rate=LR,
                      clients_per_step=lanes, drfa_lambda_lr=(0.0, 0.05))
    exp = build_experiment(cfg, tiny_synthetic)
    assert M < tiny_synthetic.train.num_clients                 # partial participation
    state, hist = run_rounds_history(exp, ROUNDS)
    xs, ys = client_lists(tiny_synthetic.train)
    lam_all = np.asarray(jax.device_get(state.algo_state.lam), np.float64)
    for r, lab in enumerate(exp.replicas.labels):
        W, b, lam = drfa_rounds(xs, ys, lab.seed, lab.param_value)
        for got, want in zip(linear_rows(state.params, r), (W, b)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lam_all[r], lam, atol=1e-5)
        if lab.param_value == 0.0:
            assert np.all(lam_all[r] == np.float32(1.0 / 12))     # gamma = 0: lambda stays
        else:
            assert lam.max() > 1.5 / 12                           # lambda moved


KF = 4       # FedTorch's k in {1..3}: snapshots after 0, 1 or 2 steps


def engine_draws(seed, train):
    """The engine's random draws of a replica with this seed, in numpy_drfa_fedtorch's terms:
    k = 1 + floor(u (K - 1)) from the client's u (``fold_in(round key, client)``)."""
    N = train.num_clients
    sizes = np.asarray(train.sizes)

    def k(t, c):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(np.uint32(seed)), t), int(c))
        u = float(jax.random.uniform(jax.random.fold_in(key, SNAPSHOT_STREAM)))
        return 1 + min(int(np.floor(u * (KF - 1))), KF - 2)

    return Draws(
        online=lambda t: sample_clients(seed, t, N, M),
        k=k,
        probe=lambda t: np.random.default_rng([seed, t, PROBE_STREAM]).choice(
            N, size=M, replace=False),
        order=lambda t, c: client_permutations(seed, t, int(c), int(sizes[c]),
                                               -(-(KF * B) // int(sizes[c]))))


@pytest.mark.parametrize("lanes", [3, 1])
def test_fedtorch_variant_equals_the_authors_centred_code(tiny_synthetic, lanes):
    """λ from n_k/n, uniform draws, updates weighted λ_k N/m, the plain mean of snapshots taken
    before a per-client step k in {1..K-1}, γ × 0.9 before every round, the first λ_i <= 1e-3
    raised: against numpy_drfa_fedtorch within 1e-5 (m = 6 of 12 clients, K = 4)."""
    cfg = tiny_config(algorithm="drfa", thetas=(), seeds=(1, 2), l2_reg=L2, local_steps=KF,
                      clients_per_round=M, batch_size=B, learning_rate=LR,
                      clients_per_step=lanes, drfa_lambda_lr=(0.0, 0.05, 0.5),
                      drfa_variant="fedtorch")
    exp = build_experiment(cfg, tiny_synthetic)
    train = tiny_synthetic.train
    assert M < train.num_clients and len(set(np.asarray(train.sizes).tolist())) > 1
    state, _ = run_rounds_history(exp, ROUNDS)
    xs, ys = client_lists(train)
    lam_all = np.asarray(jax.device_get(state.algo_state.lam), np.float64)
    raised = 0
    for r, lab in enumerate(exp.replicas.labels):
        W, b, lam = fedtorch_drfa(xs, ys, engine_draws(lab.seed, train), ROUNDS, M, KF, B, LR,
                                  L2, lab.param_value)
        for got, want in zip(linear_rows(state.params, r), (W, b)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lam_all[r], lam, atol=1e-5)
        raised += int(np.sum(np.isclose(lam, 1e-3 / np.sum(lam), rtol=0.2)) > 0
                      and np.any(lam == 0.0))
    assert raised > 0         # a run in which one weight was raised and others stayed at 0


def test_the_snapshot_is_the_model_after_t_prime_steps():
    """The client update by hand: with K = 4 steps and t' = 2, the output is the model after
    the second step, the update the model after the fourth."""
    from deltafl_jax.algorithms.drfa import snapshot_update
    from deltafl_jax.optimizers.client import ClientOptimizer
    from deltafl_jax.engine import ClientJob
    job = ClientJob(optimizer=ClientOptimizer().transformation(0.5, 0.0),
                    learning_rate=np.float32(0.5), l2=np.float32(0.0), steps=np.int32(4),
                    key=jax.random.key(0))
    w = {"a": np.zeros(2, np.float32)}
    step = snapshot_update.init((), (), w, None, job)._replace(at=np.int32(2))
    for s in range(4):         # gradients 1, 2, 3, 4: w = -0.5 (1 + ... + s)
        step = snapshot_update.step(step, lambda p, s=s: (0.0, {"a": np.full(2, s + 1.0)}),
                                    None, job)
    _, update, (snap, steps) = snapshot_update.final(step, (), w, None, job)
    np.testing.assert_allclose(snap["a"], [-1.5, -1.5])
    np.testing.assert_allclose(update["a"], [-5.0, -5.0])
    assert int(steps) == 4


def test_drfa_on_the_host_split_is_one_line(tmp_path, capsys):
    out = tmp_path / "x"
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=drfa", "--num_rounds=1",
                               "--client_data=host", f"--output_dir={out}"], capsys)
    assert code == 2 and "--client_data=device" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_draws_with_replacement_fit_the_round_streams():
    """Drawn with replacement, all m slots may be the largest client: the streams' bounds are
    m times its size (m distinct clients would bound them by the m largest, too short), and
    the round plan of such a draw fills them exactly."""
    from deltafl_jax.sampling.plan import LocalWork, capacities, make_round_plan
    from deltafl_jax.sampling import WeightedSampler
    sizes = np.array([3, 50, 7, 9, 4], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    work = LocalWork(batch_size=4, local_epochs=2, local_steps=None)
    m = 3
    caps = capacities(sizes, m, work, eval_chunk=1, with_replacement=True)
    assert caps.eval_len == m * 50
    assert caps.train_len == m * 2 * 50 + 4
    assert capacities(sizes, m, work, eval_chunk=1).eval_len == 50 + 9 + 7
    onto_largest = np.array([[0.0, 1.0, 0.0, 0.0, 0.0]])
    cohort = WeightedSampler(sizes.size, m, onto_largest[0]).cohort(1, 0)
    plan = make_round_plan([1], 0, offsets, m, work, caps, cohorts=[cohort])
    assert plan.clients.tolist() == [[1, 1, 1]]
    assert int(plan.eval_len[0]) == caps.eval_len
    np.testing.assert_array_equal(plan.eval_idx[0], np.tile(np.arange(3, 53), m))


def test_fedtorch_guard_raises_only_the_first_small_weight_and_k_is_before_a_step():
    """By hand: of the weights <= 1e-3 only the first is set to 1e-3, then lambda is
    renormalised (FedTorch's centred guard); k in {1..K-1} gives snapshots after 0..K-2 steps,
    w_t (0 steps) for K <= 2, each client its own draw."""
    from deltafl_jax.algorithms.drfa import fedtorch_snapshot_step, raise_first_small
    lam = np.array([0.5, 0.0, 0.4995, 0.0, 0.0005], np.float32)
    np.testing.assert_allclose(raise_first_small(jnp.asarray(lam)),
                               np.array([0.5, 1e-3, 0.4995, 0.0, 0.0005]) / 1.001, rtol=1e-6)
    np.testing.assert_array_equal(raise_first_small(jnp.float32([0.6, 0.4])),
                                  np.float32([0.6, 0.4]))
    key = jax.random.key(7)
    for steps, allowed in ((1, {0}), (2, {0}), (4, {0, 1, 2})):
        got = {int(fedtorch_snapshot_step(key, np.int32(c), np.int32(steps)))
               for c in range(40)}
        assert got == allowed, (steps, got)
