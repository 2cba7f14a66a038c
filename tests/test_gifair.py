"""GIFAIR-FL against a NumPy loop written from the paper (Yue, Nouiehed, Al Kontar 2023: the
objective sum p_k F_k + lambda sum_{i<j} |F_i - F_j| = sum (p_k + lambda r_k) F_k) and the
FairFL benchmark's reweighting of the aggregation weights: 3 rounds, partial participation,
two local epochs, both weightings, c swept in one program; its limit c = 0 is FedAvg."""

import jax
import numpy as np
import pytest

from conftest import client_lists, linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.algorithms.gifair import gifair_weights, rank_signs
from numpy_baselines import _local, _sampled

ROUNDS, M, EPOCHS = 3, 6, 2
TIE = 1e-5   # losses this close (relative) are tied: float32 cannot order them


def paper_weights(F, n, c, weighting):
    """p_k + c lambda_max r_k with r_k = #{j: F_j < F_k} - #{j: F_j > F_k} (a double loop) and
    lambda_max = min p / (m - 1). In round 1 every F_k is log 10 (the zero model): all tied."""
    p = n / n.sum() if weighting == "weighted" else np.full(len(F), 1.0 / len(F))
    r = np.zeros(len(F))
    for k in range(len(F)):
        for j in range(len(F)):
            if abs(F[j] - F[k]) > TIE * max(abs(F[j]), abs(F[k])):   # else tied
                r[k] += 1 if F[j] < F[k] else -1
    return p + c * (p.min() / (len(F) - 1)) * r


def gifair_round(W, b, xs, ys, seed, t, m, lr, l2, batch, epochs, c, weighting):
    chosen, n, F = _sampled(W, b, xs, ys, seed, t, m, l2)
    a = paper_weights(F, n, c, weighting)
    dW, db = np.zeros_like(W), np.zeros_like(b)
    for ak, k in zip(a, chosen):
        if ak <= 0:
            continue
        Wk, bk = _local(W, b, xs, ys, k, seed, t, lr, l2, batch, epochs)
        dW += ak * (Wk - W)
        db += ak * (bk - b)
    return W + dW / a.sum(), b + db / a.sum(), a


def test_weights_hand_case():
    F = np.array([0.3, 0.1, 0.3, 0.9], np.float32)
    signs = jax.jit(rank_signs)                 # one program per length, not one per operation
    weights = jax.jit(gifair_weights, static_argnums=3)
    np.testing.assert_array_equal(signs(F), [0.0, -3.0, 0.0, 3.0])   # a tie: equal r
    n = np.array([10, 20, 30, 40])
    # p = 0.1, 0.2, 0.3, 0.4; lambda_max = 0.1 / 3; c = 1: 0.1, 0.1, 0.3, 0.5
    np.testing.assert_allclose(weights(F, n, 1.0, "weighted"), [0.1, 0.1, 0.3, 0.5],
                               rtol=1e-6)
    np.testing.assert_allclose(weights(F, n, 0.5, "unweighted"),
                               0.25 + 0.5 * (0.25 / 3) * np.array([0, -3, 0, 3]), rtol=1e-6)
    nan = np.array([0.2, np.nan, 0.1], np.float32)
    np.testing.assert_array_equal(signs(nan), [0.0, 2.0, -2.0])       # NaN: the largest


@pytest.mark.parametrize("weighting,lanes", [("weighted", 3), ("unweighted", 1)])
def test_three_rounds_equal_the_paper(tiny_synthetic, weighting, lanes):
    cfg = tiny_config(algorithm="gifair", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=lanes, weighting=weighting, gifair_coeff=(0.5, 1.0))
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, ROUNDS)
    xs, ys = client_lists(tiny_synthetic.train)
    assert M < len(xs)                                     # partial participation
    spread = 0.0
    for r, lab in enumerate(exp.replicas.labels):
        W, b = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes)), np.zeros(10)
        for t in range(ROUNDS):
            W, b, a = gifair_round(W, b, xs, ys, lab.seed, t, M, cfg.learning_rate,
                                   cfg.l2_reg, cfg.batch_size, EPOCHS, lab.param_value,
                                   weighting)
            spread = max(spread, a.max() - a.min())
        got_W, got_b = linear_rows(state.params, r)
        np.testing.assert_allclose(got_W, W, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got_b, b, atol=1e-5, rtol=1e-5)
    assert spread > 0.1            # the reweighting moved the weights far from p_k


def test_coefficient_zero_is_fedavg(tiny_synthetic):
    kw = dict(thetas=(), seeds=(1, 2), l2_reg=1e-3, local_epochs=EPOCHS, clients_per_step=3)
    fedavg = run_rounds_history(build_experiment(tiny_config(algorithm="fedavg", **kw),
                                                 tiny_synthetic), ROUNDS)[0]
    zero = run_rounds_history(build_experiment(
        tiny_config(algorithm="gifair", gifair_coeff=(0.0,), **kw), tiny_synthetic), ROUNDS)[0]
    for a, b in zip(jax.tree.leaves(fedavg.params), jax.tree.leaves(zero.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_coefficient_above_one_is_refused(tmp_path, capsys):
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=gifair",
                               "--gifair_coeff=0.5,2", f"--output_dir={tmp_path / 'o'}"],
                              capsys)
    assert code == 2 and "--gifair_coeff must be in [0, 1]" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
