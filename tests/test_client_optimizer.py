"""Client optimizers (--client_optimizer) against NumPy loops written from their papers: Adam
(Kingma and Ba 2015, Algorithm 1, with bias correction), heavy-ball momentum and Adagrad (Duchi
et al. 2011; accumulator from 0.1 as optax's), each applied to g + lambda w (the paper's L2
term) with a state that starts afresh at every client's job; 3 rounds of FedAvg with partial
participation and two local epochs, at one and several lanes; sgd is the papers' step bit for
bit; bad settings are one line."""

import numpy as np
import pytest

from conftest import client_lists, linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import grad_mean_xent

ROUNDS, M, EPOCHS, L2, LR = 3, 6, 2, 1e-3, 0.02


class NumpyOptimizer:
    """One client job's optimizer state over the parameters [W, b]."""

    def __init__(self, name, shapes, beta=0.9, b1=0.9, b2=0.999, eps=1e-8):
        self.name, self.beta, self.b1, self.b2, self.eps = name, beta, b1, b2, eps
        self.t = 0
        self.m = [np.zeros(s) for s in shapes]
        self.v = [np.zeros(s) for s in shapes]
        self.acc = [np.full(s, 0.1) for s in shapes]

    def step(self, params, grads, lr):
        self.t += 1
        out = []
        for j, (p, g) in enumerate(zip(params, grads)):
            if self.name == "momentum":          # v <- beta v + g, w <- w - lr v
                self.m[j] = self.beta * self.m[j] + g
                out.append(p - lr * self.m[j])
            elif self.name == "adam":
                self.m[j] = self.b1 * self.m[j] + (1 - self.b1) * g
                self.v[j] = self.b2 * self.v[j] + (1 - self.b2) * g * g
                mhat = self.m[j] / (1 - self.b1 ** self.t)
                vhat = self.v[j] / (1 - self.b2 ** self.t)
                out.append(p - lr * mhat / (np.sqrt(vhat) + self.eps))
            elif self.name == "adagrad":         # s <- s + g^2, w <- w - lr g / sqrt(s + eps)
                self.acc[j] = self.acc[j] + g * g
                out.append(p - lr * g / np.sqrt(self.acc[j] + self.eps))
            else:
                out.append(p - lr * g)
        return out


def fedavg_rounds(xs, ys, W, b, name, seed, settings):
    n_all = np.array([len(y) for y in ys], np.float64)
    for t in range(ROUNDS):
        chosen = sample_clients(seed, t, len(xs), M)
        dW, db = np.zeros_like(W), np.zeros_like(b)
        for k in chosen:
            x, y, nk = xs[k], ys[k], len(ys[k])
            order = client_permutations(seed, t, int(k), nk, EPOCHS)
            opt = NumpyOptimizer(name, (W.shape, b.shape), **settings)   # fresh per job
            Wk, bk = W, b
            for e in range(EPOCHS):
                for s in range(0, nk, 8):
                    idx = order[e * nk:(e + 1) * nk][s:s + 8]
                    gW, gb = grad_mean_xent(Wk, bk, x[idx], y[idx])
                    Wk, bk = opt.step([Wk, bk], [gW + L2 * Wk, gb + L2 * bk], LR)
            dW += n_all[k] * (Wk - W)
            db += n_all[k] * (bk - b)
        total = n_all[chosen].sum()
        W, b = W + dW / total, b + db / total
    return W, b


# Adam's eps is set above float32's gradient noise: at eps = 1e-8 a coordinate whose gradient is
# 0 in float64 and 1e-10 in float32 moves by about +-lr (m / sqrt(v) = +-1), which no float32
# engine can match to 1e-5 (seen here: 1 coordinate of 600 off by 3e-5).
@pytest.mark.parametrize("name,settings,lanes", [
    ("adam", {"eps": 1e-6}, 3), ("adam", {"b1": 0.5, "b2": 0.9, "eps": 1e-3}, 1),
    ("momentum", {"beta": 0.8}, 3), ("adagrad", {"eps": 1e-6}, 2)])
def test_three_rounds_equal_the_papers_updates(tiny_synthetic, name, settings, lanes):
    flags = {"client_momentum": settings.get("beta", 0.9),
             "client_beta1": settings.get("b1", 0.9), "client_beta2": settings.get("b2", 0.999),
             "client_eps": settings.get("eps", 1e-8)}
    cfg = tiny_config(algorithm="fedavg", thetas=(), seeds=(1, 2), l2_reg=L2,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8, learning_rate=LR,
                      clients_per_step=lanes, client_optimizer=name, **flags)
    exp = build_experiment(cfg, tiny_synthetic)
    assert M < tiny_synthetic.train.num_clients
    state = run_rounds_history(exp, ROUNDS)[0]
    xs, ys = client_lists(tiny_synthetic.train)
    W0 = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes))
    for r, lab in enumerate(exp.replicas.labels):
        W, b = fedavg_rounds(xs, ys, W0, np.zeros(W0.shape[1]), name, lab.seed, settings)
        for got, want in zip(linear_rows(state.params, r), (W, b)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    W_sgd, _ = fedavg_rounds(xs, ys, W0, np.zeros(W0.shape[1]), "sgd", lab.seed, {})
    assert np.abs(W - W_sgd).max() > 1e-3          # the optimizer changed the model


def test_sgd_is_the_default_step_bit_for_bit(tiny_synthetic):
    import jax
    kw = dict(algorithm="fedavg", thetas=(), seeds=(1,), l2_reg=L2, local_epochs=EPOCHS)
    default = run_rounds_history(build_experiment(tiny_config(**kw), tiny_synthetic), 2)[0]
    sgd = run_rounds_history(build_experiment(tiny_config(client_optimizer="sgd", **kw),
                                              tiny_synthetic), 2)[0]
    for a, b in zip(jax.tree.leaves(default.params), jax.tree.leaves(sgd.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("flags,says", [
    (["--client_optimizer=lamb"], "client_optimizer"),
    (["--client_optimizer=adam", "--client_beta1=1.0"], "--client_beta1 must"),
    (["--client_optimizer=adagrad", "--client_eps=0"], "--client_eps must"),
])
def test_bad_client_optimizer_settings_are_one_line(tmp_path, capsys, flags, says):
    out = tmp_path / "x"
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=fedavg", "--num_rounds=1",
                               f"--output_dir={out}", *flags], capsys)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
