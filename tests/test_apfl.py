"""APFL against a NumPy loop written from FedJAX's ``fedjax/algorithms/apfl.py`` (google/fedjax
at c57ee19; read, not copied) and Algorithm 1 of Deng, Kamani, Mahdavi (2020): partial
participation, several local steps, 3 rounds, every client's v_k, alpha_k and the model it is
served, with both mixings and both v-gradients, on one and several lanes; alpha fixed at 0 is
FedAvg bit for bit; the pure client update and client model on hand-made inputs."""

import jax
import numpy as np
import pytest

from conftest import client_job, client_lists, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import grad_mean_xent

ROUNDS, M, EPOCHS = 3, 6, 2


class APFL:
    """FedJAX's APFL for one replica, in float64, for a softmax regression [W, b].

    A client's state is created at its first round from the global model (v = w_t, alpha =
    alpha0); each step takes, at the step's start, v_bar = alpha v + (1 - alpha) w, the
    gradients g_w = grad f(w) and g = grad f(v_bar) on the same minibatch, then
    w <- w - lr (g_w + l2 w), v <- v - lr (g' + l2 v) with g' = g (FedJAX) or alpha g (the
    paper), alpha <- clip(alpha - lr_alpha <v - w, g>, 0, 1) per leaf (FedJAX) or with one
    alpha and the inner product over the whole model (the paper). The server: the n_k- (or
    uniformly) weighted mean of the w_k.
    """

    def __init__(self, xs, ys, alpha0, mixing, v_gradient, weighting):
        self.xs, self.ys = xs, ys
        self.alpha0, self.mixing, self.v_gradient = alpha0, mixing, v_gradient
        self.n = np.array([len(y) for y in ys], np.float64)
        self.weights = self.n if weighting == "weighted" else np.ones(len(xs))
        self.state = {}                                    # k -> (v, alpha)

    def alphas(self, alpha):
        return alpha if self.mixing == "leaf" else [alpha, alpha]

    def local(self, wt, k, seed, t, lr, l2, batch, lr_alpha):
        x, y = self.xs[k], self.ys[k]
        nk = len(y)
        order = client_permutations(seed, t, int(k), nk, EPOCHS)
        default = ([p.copy() for p in wt],
                   [self.alpha0, self.alpha0] if self.mixing == "leaf" else self.alpha0)
        v, alpha = self.state.get(int(k), default)
        w = [p.copy() for p in wt]
        for e in range(EPOCHS):
            for s in range(0, nk, batch):
                idx = order[e * nk:(e + 1) * nk][s:s + batch]
                a = self.alphas(alpha)
                vbar = [aj * vj + (1 - aj) * wj for aj, vj, wj in zip(a, v, w)]
                gw = grad_mean_xent(w[0], w[1], x[idx], y[idx])
                g = grad_mean_xent(vbar[0], vbar[1], x[idx], y[idx])
                inner = [np.sum((vj - wj) * gj) for vj, wj, gj in zip(v, w, g)]
                if self.mixing == "leaf":
                    alpha = [float(np.clip(al - lr_alpha * i, 0, 1))
                             for al, i in zip(alpha, inner)]
                else:
                    alpha = float(np.clip(alpha - lr_alpha * sum(inner), 0, 1))
                gv = g if self.v_gradient == "fedjax" else [aj * gj for aj, gj in zip(a, g)]
                w = [wj - lr * (gj + l2 * wj) for wj, gj in zip(w, gw)]
                v = [vj - lr * (gj + l2 * vj) for vj, gj in zip(v, gv)]
        self.state[int(k)] = (v, alpha)
        return w

    def round(self, wt, seed, t, m, lr, l2, batch, lr_alpha):
        chosen = sample_clients(seed, t, len(self.xs), m)
        ws = [self.local(wt, k, seed, t, lr, l2, batch, lr_alpha) for k in chosen]
        a = self.weights[chosen]
        return [sum(ak * w[j] for ak, w in zip(a, ws)) / a.sum() for j in range(2)]

    def served(self, k, w):
        """alpha v + (1 - alpha) w for a client that trained, else w."""
        if k not in self.state:
            return w
        v, alpha = self.state[k]
        return [aj * vj + (1 - aj) * wj for aj, vj, wj in zip(self.alphas(alpha), v, w)]


def rows(tree, *index):
    """[W, b] of a {'Dense_0': {'kernel', 'bias'}} tree at `index` (replica, client)."""
    p = jax.device_get(tree)["Dense_0"]
    return [np.asarray(p["kernel"][index], np.float64), np.asarray(p["bias"][index], np.float64)]


def at(tree, *index):
    return jax.tree.map(lambda a: np.asarray(a)[index], jax.device_get(tree))


@pytest.mark.parametrize("mixing,v_gradient,weighting,lanes", [
    ("leaf", "fedjax", "weighted", 1), ("model", "paper", "unweighted", 3),
    ("leaf", "paper", "weighted", 4)])
def test_three_rounds_equal_fedjax_loop(tiny_synthetic, mixing, v_gradient, weighting, lanes):
    lr_scale = 4.0
    cfg = tiny_config(algorithm="apfl", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=lanes, weighting=weighting, apfl_alpha=(0.25, 0.75),
                      apfl_alpha_lr=lr_scale, apfl_mixing=mixing, apfl_v_gradient=v_gradient)
    exp = build_experiment(cfg, tiny_synthetic)
    state = run_rounds_history(exp, ROUNDS)[0]
    train = tiny_synthetic.train
    xs, ys = client_lists(train)
    W0 = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes))
    assert M < train.num_clients and len(exp.replicas.labels) == 4
    alg = exp.algorithm
    for r, lab in enumerate(exp.replicas.labels):
        ref = APFL(xs, ys, lab.param_value, mixing, v_gradient, weighting)
        w = [W0, np.zeros(W0.shape[1])]
        for t in range(ROUNDS):
            w = ref.round(w, lab.seed, t, M, cfg.learning_rate, cfg.l2_reg, cfg.batch_size,
                          lr_scale * cfg.learning_rate)
        for got, want in zip(rows(state.params, r), w):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        moved = 0.0
        for k in range(train.num_clients):
            client = at(state.client_state, r, k)
            assert float(client.seen) == float(k in ref.state)
            served = alg.client_model((), client, at(state.params, r),
                                      at(exp.replicas.hyper, r))
            for got, want in zip(rows({"Dense_0": served["Dense_0"]}), ref.served(k, w)):
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
            if k in ref.state:
                v, alpha = ref.state[k]
                for got, want in zip(rows(client.v), v):
                    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
                got_a = (client.alpha if mixing == "model"
                         else [client.alpha["Dense_0"]["kernel"], client.alpha["Dense_0"]["bias"]])
                np.testing.assert_allclose(np.asarray(got_a, np.float64), alpha, atol=1e-5)
                moved = max(moved, float(np.max(np.abs(np.asarray(alpha) - lab.param_value))))
        assert moved > 1e-3                                  # alpha was learnt


def test_alpha_fixed_at_zero_is_fedavg_bit_for_bit(tiny_synthetic):
    kw = dict(thetas=(), seeds=(1, 2), l2_reg=1e-3, local_epochs=EPOCHS, clients_per_step=3)
    fedavg = run_rounds_history(build_experiment(tiny_config(algorithm="fedavg", **kw),
                                                 tiny_synthetic), ROUNDS)[0]
    apfl = run_rounds_history(build_experiment(
        tiny_config(algorithm="apfl", apfl_alpha=(0.0,), apfl_alpha_lr=0.0, **kw),
        tiny_synthetic), ROUNDS)[0]
    for a, b in zip(jax.tree.leaves(fedavg.params), jax.tree.leaves(apfl.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.any(np.asarray(jax.tree.leaves(apfl.client_state.alpha)))


@pytest.mark.parametrize("bad,flag", [(["--apfl_alpha=1.5"], "--apfl_alpha"),
                                      (["--apfl_alpha_lr=-1"], "--apfl_alpha_lr"),
                                      (["--apfl_mixing=layer"], "--apfl_mixing"),
                                      (["--dp_clip=1", "--weighting=unweighted"], "private")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, bad, flag):
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=apfl",
                               f"--output_dir={tmp_path / 'o'}", *bad], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err


# ----------------------------------------------------------------------------- pure functions

W = {"k": np.array([[1.0, -2.0], [0.5, 3.0]], np.float32), "b": np.array([0.25, -1.0], np.float32)}
V = {"k": np.array([[0.0, 1.0], [2.0, -1.0]], np.float32), "b": np.array([1.0, 0.5], np.float32)}
C = {"k": np.array([[0.5, 0.5], [-1.0, 1.0]], np.float32), "b": np.array([0.0, 2.0], np.float32)}


def quadratic(p):
    """f(p) = 0.5 ||p - C||^2: gradient p - C."""
    g = jax.tree.map(lambda x, c: x - c, p, C)
    return 0.0, g




@pytest.mark.parametrize("mixing,v_gradient", [("leaf", "fedjax"), ("model", "paper")])
def test_one_step_by_hand(mixing, v_gradient):
    """One step at gamma = 0.1, alpha lr 0.2 x gamma, on f = 0.5 ||p - C||^2, from w_t = W and
    a client that has trained (v = V, alpha 0.3 on the kernel and 0.6 on the bias, or 0.3):
    v_bar = a V + (1 - a) W; w' = W - 0.1 (W - C); v' = V - 0.1 g' with g = v_bar - C (times a
    for the paper); alpha' = clip(a - 0.02 <V - W, g>) per leaf or summed."""
    from deltafl_jax.algorithms.apfl import APFLClient, APFLHyper, APFLOptions, apfl
    alg = apfl(APFLOptions(apfl_alpha_lr=0.2, apfl_mixing=mixing, apfl_v_gradient=v_gradient))
    hyper = APFLHyper(alpha0=np.float32(0.5))
    a = ({"k": np.float32(0.3), "b": np.float32(0.6)} if mixing == "leaf" else np.float32(0.3))
    client = APFLClient(v=V, alpha=a, seen=np.float32(1.0))
    job = client_job(0.1, steps=1)
    st = alg.client_update.init((), client, W, hyper, job)
    st = alg.client_update.step(st, quadratic, hyper, job)
    new, delta, out = alg.client_update.final(st, client, W, hyper, job)
    assert out is None and float(new.seen) == 1.0
    al = a if mixing == "leaf" else {"k": a, "b": a}
    g = {n: al[n] * V[n] + (1 - al[n]) * W[n] - C[n] for n in W}
    inner = {n: float(np.sum((V[n] - W[n]) * g[n])) for n in W}
    for n in W:
        np.testing.assert_allclose(delta[n], -0.1 * (W[n] - C[n]), rtol=1e-6, atol=1e-7)
        gv = g[n] if v_gradient == "fedjax" else al[n] * g[n]
        np.testing.assert_allclose(new.v[n], V[n] - 0.1 * gv, rtol=1e-6, atol=1e-7)
    if mixing == "leaf":
        for n in W:
            np.testing.assert_allclose(new.alpha[n], np.clip(a[n] - 0.02 * inner[n], 0, 1),
                                       rtol=1e-6)
    else:
        np.testing.assert_allclose(new.alpha, np.clip(a - 0.02 * sum(inner.values()), 0, 1),
                                   rtol=1e-6)


def test_alpha_is_clipped_to_the_unit_interval_and_a_new_client_starts_from_w():
    """A client never sampled (seen = 0) starts v from w_t: v_bar = w, so v and w take the
    same step and <v - w, g> = 0 (alpha keeps 0.5). With a large alpha step from a client
    whose v is far from w, alpha hits the clip: 1 - huge * positive -> 0."""
    from deltafl_jax.algorithms.apfl import APFLClient, APFLHyper, APFLOptions, apfl
    hyper = APFLHyper(alpha0=np.float32(0.5))
    alg = apfl(APFLOptions(apfl_alpha_lr=1e4))
    fresh = alg.client_state_init(W, hyper)
    assert float(fresh.seen) == 0.0 and all(float(x) == 0.5 for x in jax.tree.leaves(fresh.alpha))
    stale = APFLClient(v=V, alpha=fresh.alpha, seen=fresh.seen)   # a v that must be ignored
    job = client_job(0.1, steps=1)
    st = alg.client_update.step(alg.client_update.init((), stale, W, hyper, job), quadratic,
                                hyper, job)
    new, delta, _ = alg.client_update.final(st, stale, W, hyper, job)
    for n in W:
        np.testing.assert_array_equal(new.v[n], np.asarray(W[n]) + np.asarray(delta[n]))
        assert float(new.alpha[n]) == 0.5
    # v far from w along the gradient at v_bar: <V' - W, g> > 0 and alpha clips at 0.
    far = APFLClient(v={n: W[n] + 10.0 for n in W}, alpha=fresh.alpha, seen=np.float32(1.0))
    st = alg.client_update.step(alg.client_update.init((), far, W, hyper, job),
                                lambda p: (0.0, {n: np.ones_like(W[n]) for n in W}), hyper, job)
    new, _, _ = alg.client_update.final(st, far, W, hyper, job)
    assert all(float(x) == 0.0 for x in jax.tree.leaves(new.alpha))


def test_client_model_and_a_diverged_client():
    """client_model: alpha v + (1 - alpha) w for a client that trained, w for one never
    sampled; a client whose v is not finite returns a NaN update (the engine then drops it
    and keeps its state)."""
    from deltafl_jax.algorithms.apfl import APFLClient, APFLHyper, APFLOptions, apfl
    hyper = APFLHyper(alpha0=np.float32(0.5))
    for mixing, a in (("leaf", {"k": np.float32(0.25), "b": np.float32(1.0)}),
                      ("model", np.float32(0.25))):
        alg = apfl(APFLOptions(apfl_mixing=mixing))
        al = a if mixing == "leaf" else {"k": a, "b": a}
        got = alg.client_model((), APFLClient(v=V, alpha=a, seen=np.float32(1.0)), W, hyper)
        for n in W:
            np.testing.assert_allclose(got[n], al[n] * V[n] + (1 - al[n]) * W[n], rtol=1e-6)
        got = alg.client_model((), APFLClient(v=V, alpha=a, seen=np.float32(0.0)), W, hyper)
        for n in W:
            np.testing.assert_array_equal(got[n], W[n])
    assert alg.adapt_step is None
    job = client_job(0.1, steps=1)
    bad = APFLClient(v={"k": np.full((2, 2), np.inf, np.float32), "b": V["b"]},
                     alpha=np.float32(0.5), seen=np.float32(1.0))
    st = alg.client_update.step(alg.client_update.init((), bad, W, hyper, job), quadratic,
                                hyper, job)
    _, delta, _ = alg.client_update.final(st, bad, W, hyper, job)
    assert all(np.isnan(np.asarray(d)).all() for d in jax.tree.leaves(delta))
