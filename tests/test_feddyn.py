"""FedDyn against a NumPy loop written from the authors' code (alpemreacar/FedDyn at 48a19fa,
``utils_methods.py`` ``train_FedDyn`` and ``utils_general.py`` ``train_feddyn_mdl``; read, not
copied) and Algorithm 1 of Acar et al. (the h-state form, checked against the code's form in
the reference itself): partial participation, several local steps, 3 rounds, every client's
g_k, on one and several lanes; the limit alpha = 0; the pure client and server updates on
hand-made inputs; and (slow) a SIGKILL resume and 2 and 4 fake devices."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import client_job, client_lists, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.algorithms.protocol import RoundContext
from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import grad_mean_xent

ROUNDS, M, EPOCHS = 3, 6, 2


class FedDyn:
    """The authors' FedDyn loop for one replica, in float64, for a softmax regression [W, b].

    g[k] is the code's ``local_param_list[k]`` (init 0). A sampled client trains from theta_t
    with the gradient grad l + alpha (theta - theta_t + g_k) (the code's linear term
    alpha <theta, g_k - theta_t> and weight decay alpha; plus the run's l2 as its weight
    decay), through SGD or SGD with momentum; then g_k += theta_k - theta_t. The server:
    theta = sum_S c_k theta_k / sum_S c_k + sum_all c_k g_k / sum_all c_k, c_k = 1 (the code,
    whose clients all get the same alpha when their sizes are equal, and the paper) or n_k.
    With c_k = 1 it also runs the paper's form, h <- h - (alpha/N) sum_S (theta_k - theta_t),
    theta = mean_S theta_k - h / alpha, and records the largest gap between the two forms.
    """

    def __init__(self, xs, ys, alpha, weighting, shapes, momentum=None, scaling="none"):
        self.xs, self.ys, self.alpha, self.momentum = xs, ys, alpha, momentum
        self.N = len(xs)
        n = np.array([len(y) for y in ys], np.float64)
        # The code's alpha_coef / weight_list[k], weight_list = n / sum(n) * N (scaling=size).
        self.alpha_k = alpha / (n / n.sum() * self.N) if scaling == "size" else np.full(
            self.N, float(alpha))
        self.c = n if weighting == "weighted" else np.ones(self.N)
        self.g = [[np.zeros(s) for s in shapes] for _ in range(self.N)]
        self.h = [np.zeros(s) for s in shapes]
        self.form_gap = 0.0

    def local(self, theta, k, seed, t, lr, l2, batch, epochs):
        x, y = self.xs[k], self.ys[k]
        nk = len(y)
        order = client_permutations(seed, t, int(k), nk, epochs)
        w = [p.copy() for p in theta]
        vel = [np.zeros_like(p) for p in theta]
        for e in range(epochs):
            for s in range(0, nk, batch):
                idx = order[e * nk:(e + 1) * nk][s:s + batch]
                gl = grad_mean_xent(w[0], w[1], x[idx], y[idx])
                for j in range(2):
                    grad = gl[j] + self.alpha_k[k] * (w[j] - theta[j] + self.g[k][j]) + l2 * w[j]
                    if self.momentum is not None:
                        vel[j] = self.momentum * vel[j] + grad
                        grad = vel[j]
                    w[j] = w[j] - lr * grad
        return w

    def round(self, theta, seed, t, m, lr, l2, batch, epochs):
        chosen = sample_clients(seed, t, self.N, m)
        models = {}
        for k in chosen:
            models[int(k)] = self.local(theta, k, seed, t, lr, l2, batch, epochs)
            self.g[k] = [g + w - p for g, w, p in zip(self.g[k], models[int(k)], theta)]
        cs = np.array([self.c[k] for k in models])
        mean = [sum(c * w[j] for c, w in zip(cs, models.values())) / cs.sum() for j in range(2)]
        G = [sum(self.c[k] * self.g[k][j] for k in range(self.N)) / self.c.sum()
             for j in range(2)]
        new = [a + b for a, b in zip(mean, G)]
        if self.alpha > 0 and np.all(self.c == 1):   # Algorithm 1's h-state
            self.h = [h - self.alpha / self.N * sum(w[j] - theta[j] for w in models.values())
                      for j, h in enumerate(self.h)]
            paper = [a - h / self.alpha for a, h in zip(mean, self.h)]
            self.form_gap = max(self.form_gap, *(np.max(np.abs(p - q))
                                                 for p, q in zip(paper, new)))
        return new


def rows(tree, *index):
    """[W, b] of a {'Dense_0': {'kernel', 'bias'}} tree at `index` (replica, client)."""
    p = jax.device_get(tree)["Dense_0"]
    return [np.asarray(p["kernel"][index], np.float64), np.asarray(p["bias"][index], np.float64)]


@pytest.mark.parametrize("weighting,lanes,optimizer,scaling", [
    ("unweighted", 1, "sgd", "none"), ("weighted", 3, "sgd", "none"),
    ("unweighted", 4, "momentum", "none"), ("unweighted", 3, "sgd", "size"),
    ("weighted", 1, "momentum", "size")])
def test_three_rounds_equal_the_authors_loop(tiny_synthetic, weighting, lanes, optimizer,
                                             scaling):
    alphas = (0.1, 1.0)
    cfg = tiny_config(algorithm="feddyn", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=lanes, weighting=weighting, feddyn_alpha=alphas,
                      client_optimizer=optimizer, client_momentum=0.5,
                      feddyn_alpha_scaling=scaling)
    exp = build_experiment(cfg, tiny_synthetic)
    state = run_rounds_history(exp, ROUNDS)[0]
    train = tiny_synthetic.train
    xs, ys = client_lists(train)
    shapes = [(xs[0].shape[1], tiny_synthetic.num_classes), (tiny_synthetic.num_classes,)]
    assert M < train.num_clients                            # partial participation
    assert len(exp.replicas.labels) == 4
    for r, lab in enumerate(exp.replicas.labels):
        ref = FedDyn(xs, ys, lab.param_value, weighting, shapes,
                     momentum=0.5 if optimizer == "momentum" else None, scaling=scaling)
        if scaling == "size":                       # unequal sizes: alpha_k differs per client
            assert np.ptp(ref.alpha_k) > 0.1 * lab.param_value
        theta = [np.zeros(s) for s in shapes]
        for t in range(ROUNDS):
            theta = ref.round(theta, lab.seed, t, M, cfg.learning_rate, cfg.l2_reg,
                              cfg.batch_size, EPOCHS)
        for got, want in zip(rows(state.params, r), theta):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        G = [sum(ref.c[k] * ref.g[k][j] for k in range(ref.N)) / ref.c.sum() for j in range(2)]
        for got, want in zip(rows(state.algo_state.G, r), G):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        for k in range(train.num_clients):
            for got, want in zip(rows(state.client_state, r, k), ref.g[k]):
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        assert np.max(np.abs(G[0])) > 1e-3                 # the h-state moved the model
        assert ref.form_gap < 1e-9                         # the code's form is the paper's
        untouched = set(range(ref.N)) - {int(k) for t in range(ROUNDS)
                                         for k in sample_clients(lab.seed, t, ref.N, M)}
        assert all(not np.any(ref.g[k][0]) for k in untouched)


def test_alpha_zero_trains_fedavgs_local_models_and_adds_the_h_term(tiny_synthetic):
    """At alpha = 0 the regulariser adds exact zeros: the sampled clients' local models are
    FedAvg's, so FedDyn's first step is FedAvg's Delta plus G_1 = sum_S c_k u_k / sum_all c_k,
    i.e. (1 + sum_S c_k / sum_all c_k) Delta_FedAvg: not FedAvg (G keeps every client's
    accumulated updates), whatever alpha's size."""
    kw = dict(thetas=(), seeds=(1,), l2_reg=1e-3, local_epochs=EPOCHS, clients_per_step=3,
              weighting="weighted")
    avg = run_rounds_history(build_experiment(tiny_config(algorithm="fedavg", **kw),
                                              tiny_synthetic), 1)[0]
    exp = build_experiment(tiny_config(algorithm="feddyn", feddyn_alpha=(0.0,), **kw),
                           tiny_synthetic)
    dyn = run_rounds_history(exp, 1)[0]
    n = np.asarray(tiny_synthetic.train.sizes, np.float64)
    chosen = sample_clients(1, 0, len(n), M)
    scale = 1.0 + n[chosen].sum() / n.sum()
    for a, d in zip(rows(avg.params, 0), rows(dyn.params, 0)):   # w_0 = 0
        np.testing.assert_allclose(d, scale * a, rtol=1e-5, atol=1e-7)
    # Each sampled g_k is that client's FedAvg update; their n-weighted mean is FedAvg's Delta.
    g = [rows(dyn.client_state, 0, int(k)) for k in chosen]
    for j in range(2):
        mean = sum(n[k] * gk[j] for k, gk in zip(chosen, g)) / n[chosen].sum()
        np.testing.assert_allclose(mean, rows(avg.params, 0)[j], rtol=1e-5, atol=1e-7)


def test_feddyn_refuses_a_negative_alpha_and_dp(tmp_path, capsys):
    for bad in (["--feddyn_alpha=-0.1"], ["--dp_clip=1", "--weighting=unweighted"]):
        code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=feddyn",
                                   f"--output_dir={tmp_path / 'o'}", *bad], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- pure functions

PARAMS = {"w": np.array([[1.0, -2.0], [0.5, 3.0]], np.float32),
          "b": np.array([0.25, -1.0], np.float32)}




def test_client_update_by_hand():
    """Two SGD steps at gamma = 0.5, alpha = 2, l2 = 0.1, from theta_t = PARAMS with
    g_k = 0.25 everywhere, on a constant loss gradient 1: each step is
    theta <- theta - 0.5 (1 + 2 (theta - theta_t + 0.25) + 0.1 theta). Step 1:
    theta_1 = theta_t - 0.5 (1.5 + 0.1 theta_t) = 0.95 theta_t - 0.75; step 2 from it."""
    from deltafl_jax.algorithms.feddyn import FedDynHyper, feddyn
    alg = feddyn(np.array([10, 20, 30]))
    gk = {n: np.full_like(v, 0.25) for n, v in PARAMS.items()}
    job, hyper = client_job(0.5, steps=2, l2=0.1), FedDynHyper(alpha=np.float32(2.0))
    ones = {n: np.ones_like(v) for n, v in PARAMS.items()}
    state = alg.client_update.init((), gk, PARAMS, hyper, job)
    for _ in range(2):
        state = alg.client_update.step(state, lambda p: (0.0, ones), hyper, job)
    new, delta, out = alg.client_update.final(state, gk, PARAMS, hyper, job)
    assert out is None
    for n, t in PARAMS.items():
        t = t.astype(np.float64)
        th1 = 0.95 * t - 0.75
        th2 = th1 - 0.5 * (1.0 + 2.0 * (th1 - t + 0.25) + 0.1 * th1)
        np.testing.assert_allclose(delta[n], th2 - t, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(new[n], 0.25 + th2 - t, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weighting", ["weighted", "unweighted"])
def test_server_update_by_hand(weighting):
    """N = 4 training clients of sizes 10, 20, 30, 40; clients 3 and 1 sampled with updates
    u_3 = 1, u_1 = -2 everywhere (client 2 sampled too, its update not finite); G = 0.5.
    weighted: G' = 0.5 + (40 - 40) / 100 = 0.5 and Delta = (40 - 40) / 60 + G' = 0.5;
    unweighted: G' = 0.5 + (1 - 2) / 4 = 0.25, Delta = (1 - 2) / 2 + 0.25 = -0.25."""
    from deltafl_jax.algorithms import ClientFeedback
    from deltafl_jax.algorithms.feddyn import FedDynHyper, FedDynOptions, FedDynState, feddyn
    sizes = np.array([10, 20, 30, 40], np.int32)
    alg = feddyn(sizes, FedDynOptions(weighting=weighting))
    clients = np.array([3, 1, 2], np.int32)
    a = np.asarray(alg.client_weights(RoundContext((), np.full(3, np.nan), sizes[clients], None,
                                                   None, clients)))
    np.testing.assert_array_equal(a, sizes[clients] if weighting == "weighted" else np.ones(3))
    u = [1.0, -2.0]
    fb = ClientFeedback(
        losses=np.full(3, np.nan, np.float32), sizes=sizes[clients], weights=a,
        delta_sum={n: np.full_like(v, a[0] * u[0] + a[1] * u[1]) for n, v in PARAMS.items()},
        weight_sum=np.float32(a[0] + a[1]), job_sqnorm=np.zeros(3, np.float32),
        job_finite=np.array([True, True, False]), job_trained=np.ones(3, bool),
        learning_rate=np.float32(0.1), clients=clients)
    state = FedDynState(G={n: np.full_like(v, 0.5) for n, v in PARAMS.items()})
    delta, state, metrics = alg.server_update(state, PARAMS, fb, FedDynHyper(alpha=0.01))
    G, d = (0.5, 0.5) if weighting == "weighted" else (0.25, -0.25)
    for n in PARAMS:
        np.testing.assert_allclose(state.G[n], G, rtol=1e-6)
        np.testing.assert_allclose(delta[n], d, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(metrics["feddyn_state_norm"]), G * np.sqrt(6), rtol=1e-6)
    # No finite update: the model stays (Delta = 0), G unchanged.
    empty = fb._replace(delta_sum={n: np.zeros_like(v) for n, v in PARAMS.items()},
                        weight_sum=np.float32(0.0), job_finite=np.zeros(3, bool))
    delta, state2, _ = alg.server_update(state, PARAMS, empty, FedDynHyper(alpha=0.01))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(delta))
    for n in PARAMS:
        np.testing.assert_array_equal(state2.G[n], state.G[n])


# ----------------------------------------------------------------------------- slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESUME = ("--algorithm=feddyn", "--feddyn_alpha=0.01,0.1")


@pytest.mark.slow
def test_sigkill_then_rerun_is_bit_identical(tmp_path, monkeypatch):
    """tests/resume.flags without its --thetas (FedDyn does not read it), 2 alphas x 2 seeds,
    killed at a random checkpoint and rerun: every output equal to the uninterrupted run's."""
    import test_resume
    from test_resume import assert_same_outputs, run, start_and_kill
    flags = tmp_path / "resume.flags"
    flags.write_text("".join(l for l in open(test_resume.FLAGS)
                             if not l.startswith("--thetas")))
    monkeypatch.setattr(test_resume, "FLAGS", str(flags))
    whole = str(tmp_path / "whole")
    proc = run(whole, *RESUME)
    assert proc.returncode == 0, proc.stderr
    out = str(tmp_path / "run")
    proc = start_and_kill(out, signal.SIGKILL, *RESUME)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(out, "summary.json"))
    resumed = run(out, *RESUME)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout
    assert_same_outputs(out, whole)


DEVICES_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, numpy as np
sys.path.insert(0, {tests!r})
from conftest import tiny_config
from deltafl_jax import DataConfig, build_experiment, load_dataset
data = load_dataset(DataConfig("synthetic", synthetic_num_clients=40, synthetic_max_examples=200,
                               synthetic_alpha=1.0, synthetic_beta=0.5, synthetic_shared=0.98))
for D in (1, 2, 4):
    cfg = tiny_config(algorithm="feddyn", thetas=(), feddyn_alpha=(0.01, 0.1), seeds=(1, 2),
                      num_rounds=5, clients_per_round=8, batch_size=10, learning_rate=0.05,
                      local_epochs=2, devices=D)
    exp = build_experiment(cfg, data)
    state, keys = exp.initial_state(), exp.keys()
    for t in range(5):
        state, met = exp.round_fn(state, exp.round_data(t), keys)
    leaves = jax.tree.leaves((state.params, state.algo_state, state.client_state))
    print(json.dumps({{"devices": D, "trained": np.asarray(met["train_real_examples"]).tolist(),
                      "leaves": [np.asarray(x).ravel().tolist() for x in leaves]}}), flush=True)
"""


@pytest.mark.slow
def test_two_and_four_devices_agree_with_one():
    """5 rounds at a stable rate (gamma = 0.05, alpha = 0.01 and 0.1), 40 clients, m = 8,
    on 1, 2 and 4 fake CPU devices: the models, G and every g_k within 1e-5 (relative)."""
    proc = subprocess.run([sys.executable, "-c",
                           DEVICES_SCRIPT.format(tests=os.path.join(REPO, "tests"))],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["devices"]: r for r in map(json.loads, (l for l in proc.stdout.splitlines()
                                                      if l.startswith("{")))}
    assert sorted(runs) == [1, 2, 4]
    for D in (2, 4):
        assert runs[D]["trained"] == runs[1]["trained"]
        for a, b in zip(runs[1]["leaves"], runs[D]["leaves"]):
            a, b = np.asarray(a), np.asarray(b)
            assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(a), 1e-12), D
