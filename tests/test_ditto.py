"""Ditto against a NumPy loop written from Algorithm 1 of Li et al. (ICML 2021) and the authors'
trainer (litian96/ditto 26d9b29, ``flearn/trainers/ditto.py``: on each local minibatch the
personal step v <- v - eta (grad F(v) + lambda (v - w_t)) and the global step
w <- w - eta grad F(w) on the same batch, v_k from w_0 kept across rounds), with this package's
uniform sampling and --weighting average (:class:`DittoRef`, float64, sharing with the engine
only the random draws of deltafl_jax.sampling.plan): partial participation, several local steps,
3 rounds, the personal models included; Ditto over Delta-FL (every sampled client updates v_k,
only the tail's global updates are averaged); the limit lambda -> its global model is FedAvg's."""

import jax
import numpy as np
import pytest

from conftest import client_lists, linear_rows, run_rounds_history, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import client_loss, exact_weights, grad_mean_xent

ROUNDS, M, EPOCHS, L2 = 3, 6, 2, 1e-3


class DittoRef:
    """Ditto for one replica: global model (W, b), personal models v_k (from w_0)."""

    def __init__(self, xs, ys, W0, b0, lam, weighting, theta=1.0):
        self.xs, self.ys, self.lam, self.weighting, self.theta = xs, ys, lam, weighting, theta
        self.v = [(W0.copy(), b0.copy()) for _ in xs]
        self.n = np.array([len(y) for y in ys], np.float64)

    def local(self, W, b, k, seed, t, lr, batch):
        """Both models through the client's minibatches; returns (w_k, v_k)."""
        x, y = self.xs[k], self.ys[k]
        nk = len(y)
        order = client_permutations(seed, t, int(k), nk, EPOCHS)
        (vW, vb), (gW0, gb0) = self.v[k], (W, b)
        wW, wb = W, b
        for e in range(EPOCHS):
            for s in range(0, nk, batch):
                idx = order[e * nk:(e + 1) * nk][s:s + batch]
                pW, pb = grad_mean_xent(vW, vb, x[idx], y[idx])
                vW = vW - lr * (pW + self.lam * (vW - gW0) + L2 * vW)
                vb = vb - lr * (pb + self.lam * (vb - gb0) + L2 * vb)
                qW, qb = grad_mean_xent(wW, wb, x[idx], y[idx])
                wW = wW - lr * (qW + L2 * wW)
                wb = wb - lr * (qb + L2 * wb)
        return (wW, wb), (vW, vb)

    def round(self, W, b, seed, t, lr, batch):
        chosen = sample_clients(seed, t, len(self.xs), M)
        n = self.n[chosen] if self.weighting == "weighted" else np.ones(len(chosen))
        if self.theta < 1.0:   # Delta-FL's filter on the losses at w_t (with the L2 term)
            F = np.array([client_loss(W, b, self.xs[k], self.ys[k], L2) for k in chosen])
            a = exact_weights(F, n, self.theta)
        else:
            a = n
        dW, db = np.zeros_like(W), np.zeros_like(b)
        for slot, k in enumerate(chosen):
            (wW, wb), self.v[k] = self.local(W, b, k, seed, t, lr, batch)   # every client
            dW += a[slot] * (wW - W)
            db += a[slot] * (wb - b)
        return W + dW / a.sum(), b + db / a.sum()


def personal_rows(state, r, k):
    p = jax.device_get(state.client_state.personal)["Dense_0"]
    return np.asarray(p["kernel"][r, k], np.float64), np.asarray(p["bias"][r, k], np.float64)


def check_against_reference(exp, state, data, weighting, theta_of):
    xs, ys = client_lists(data.train)
    W0 = np.zeros((xs[0].shape[1], data.num_classes))
    b0 = np.zeros(data.num_classes)
    moved = 0.0
    for r, lab in enumerate(exp.replicas.labels):
        lam = dict(lab.extra).get("ditto_lambda", lab.param_value)
        ref = DittoRef(xs, ys, W0, b0, lam, weighting, theta_of(lab))
        W, b = W0, b0
        for t in range(ROUNDS):
            W, b = ref.round(W, b, lab.seed, t, exp.config.learning_rate, exp.config.batch_size)
        for got, want in zip(linear_rows(state.params, r), (W, b)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        for k in range(data.train.num_clients):
            for got, want in zip(personal_rows(state, r, k), ref.v[k]):
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
            moved = max(moved, float(np.abs(ref.v[k][0] - W).max()))
    assert moved > 1e-3          # the personal models differ from the global one


@pytest.mark.parametrize("weighting,lanes", [("unweighted", 3), ("weighted", 1)])
def test_three_rounds_equal_the_papers_algorithm(tiny_synthetic, weighting, lanes):
    """Two lambdas x two seeds in one program, on vmapped lanes and on one unbatched lane."""
    cfg = tiny_config(algorithm="ditto", thetas=(), seeds=(1, 2), l2_reg=L2,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=lanes, weighting=weighting, ditto_lambda=(0.1, 1.0))
    exp = build_experiment(cfg, tiny_synthetic)
    assert M < tiny_synthetic.train.num_clients                 # partial participation
    state = run_rounds_history(exp, ROUNDS)[0]
    check_against_reference(exp, state, tiny_synthetic, weighting, lambda lab: 1.0)


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_ditto_over_deltafl_updates_every_sampled_personal_model(tiny_synthetic):
    """theta = 0.5: only the tail's global updates are averaged, but every sampled client
    steps its personal model."""
    cfg = tiny_config(algorithm="deltafl+ditto", thetas=(0.5,), seeds=(1,), l2_reg=L2,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=3, ditto_lambda=(1.0,))
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, ROUNDS)
    assert all(int(h["num_selected"][0]) < M for h in hist[1:])    # the filter dropped some
    check_against_reference(exp, state, tiny_synthetic, "weighted", lambda lab: lab.theta)


def test_the_global_model_is_fedavgs_bit_for_bit(tiny_synthetic):
    """The personal step never touches the global one: Ditto's w is FedAvg's."""
    kw = dict(thetas=(), seeds=(1,), l2_reg=L2, local_epochs=EPOCHS, clients_per_step=3)
    fedavg = run_rounds_history(build_experiment(tiny_config(algorithm="fedavg", **kw),
                                                 tiny_synthetic), ROUNDS)[0]
    ditto = run_rounds_history(build_experiment(
        tiny_config(algorithm="ditto", ditto_lambda=(1.0,), **kw), tiny_synthetic), ROUNDS)[0]
    for a, b in zip(jax.tree.leaves(fedavg.params), jax.tree.leaves(ditto.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pure_functions_on_hand_made_inputs():
    """The layer's client update on one client, by hand: v from its state, the proximal step,
    the base's step on the same gradient function, the update and the new state."""
    from deltafl_jax.algorithms.ditto import DittoClient, DittoHyper, ditto
    from deltafl_jax.algorithms.fedavg import fedavg
    from deltafl_jax.optimizers.client import ClientOptimizer
    from deltafl_jax.engine import ClientJob
    alg = ditto(fedavg())
    job = ClientJob(optimizer=ClientOptimizer().transformation(0.5, 0.0),
                    learning_rate=np.float32(0.5), l2=np.float32(0.0), steps=np.int32(1))
    w = {"a": np.array([1.0, 2.0], np.float32)}
    v = {"a": np.array([3.0, -1.0], np.float32)}
    hyper = DittoHyper(ditto_lambda=np.float32(2.0))
    own = alg.client_state_init(w, hyper)
    np.testing.assert_array_equal(own.personal["a"], w["a"])           # v_k = w_0
    step = alg.client_update.init((), DittoClient(base=(), personal=v), w, hyper, job)
    step = alg.client_update.step(step, lambda p: (0.0, {"a": p["a"] * 0 + 1.0}), hyper, job)
    new, update, out = alg.client_update.final(step, DittoClient(base=(), personal=v), w,
                                               hyper, job)
    # v' = v - 0.5 (1 + 2 (v - w)) = [3 - 0.5 * 5, -1 - 0.5 * (-5)] = [0.5, 1.5]
    np.testing.assert_allclose(new.personal["a"], [0.5, 1.5], rtol=1e-6)
    np.testing.assert_allclose(update["a"], [-0.5, -0.5], rtol=1e-6)   # w' - w = -0.5 * 1
    assert out is None
    np.testing.assert_array_equal(alg.client_model((), new, w, hyper)["a"], new.personal["a"])


def test_an_unknown_layer_or_two_optimizers_is_one_line(tmp_path, capsys):
    from conftest import run_runner
    for entry, says in (("deltafl+dito", "after '+'"), ("fedavg+adam+sgd", "after '+'")):
        code, err, _ = run_runner(["--dataset=synthetic", f"--algorithm={entry}",
                                   f"--output_dir={tmp_path / 'x'}"], capsys)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()
