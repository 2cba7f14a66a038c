"""PropFair against a NumPy loop written from the paper (Zhang et al., TMLR 2023: each client
descends -log(1 - L/M) of its minibatch loss, continued linearly with slope 1/eps within eps of
M) and the authors' code (huawei-noah/Federated-Learning at 8d111ed, FairFL/algs/algorithms.py,
class PropFair: the same transform per minibatch, L/M beyond the margin by default; read, not
copied): 3 rounds, partial participation, two local epochs, both continuations and weightings,
one and several lanes, a server learning rate; the limit M -> infinity (FedAvg at a rescaled
rate, up to O(L/M)); the transform and the client update on hand-made inputs; bad flags."""

import math

import jax
import numpy as np
import pytest

from conftest import (client_job, client_lists, linear_rows, run_rounds_history, run_runner,
                      tiny_config)
from deltafl_jax import build_experiment
from deltafl_jax.algorithms.propfair import (PropFairHyper, PropFairOptions, gradient_scale,
                                             propfair, transformed_loss)
from deltafl_jax.algorithms.protocol import RoundContext
from deltafl_jax.sampling.plan import client_permutations, sample_clients
from numpy_reference import grad_mean_xent, softmax_xent

ROUNDS, M, EPOCHS = 3, 6, 2


class PropFair:
    """The paper's round for one replica, in float64, softmax regression [W, b]: each sampled
    client runs minibatch SGD from w_t on phi(L) of each minibatch's mean loss L (the step
    w <- w - lr (phi'(L) grad L + l2 w)); the server averages the local models with weights n_k
    (or 1) and steps w <- w + eta (average - w). ``branches`` counts the local steps taken
    inside (M - L >= eps) and beyond the margin, ``closest`` the smallest |M - L - eps|."""

    def __init__(self, xs, ys, base, eps, continuation, weighting):
        self.xs, self.ys, self.base, self.eps = xs, ys, base, eps
        self.continuation, self.weighting = continuation, weighting
        self.branches = {"inside": 0, "beyond": 0}
        self.closest = math.inf

    def phi_prime(self, L):
        gap = self.base - L
        self.closest = min(self.closest, abs(gap - self.eps))
        if gap >= self.eps:                           # the authors' test: M - L < eps is beyond
            self.branches["inside"] += 1
            return 1.0 / gap
        self.branches["beyond"] += 1
        return 1.0 / self.eps if self.continuation == "huber" else 1.0 / self.base

    def local(self, W, b, k, seed, t, lr, l2, batch):
        x, y = self.xs[k], self.ys[k]
        n = len(y)
        order = client_permutations(seed, t, int(k), n, EPOCHS)
        for e in range(EPOCHS):
            for s in range(0, n, batch):
                idx = order[e * n:(e + 1) * n][s:s + batch]
                scale = self.phi_prime(softmax_xent(W, b, x[idx], y[idx]).mean())
                gW, gb = grad_mean_xent(W, b, x[idx], y[idx])
                W = W - lr * (scale * gW + l2 * W)
                b = b - lr * (scale * gb + l2 * b)
        return W, b

    def round(self, W, b, seed, t, lr, l2, batch, eta=1.0):
        chosen = sample_clients(seed, t, len(self.xs), M)
        c = np.array([len(self.ys[k]) if self.weighting == "weighted" else 1.0
                      for k in chosen], np.float64)
        models = [self.local(W, b, k, seed, t, lr, l2, batch) for k in chosen]
        avg_W = sum(ck * Wk for ck, (Wk, _) in zip(c, models)) / c.sum()
        avg_b = sum(ck * bk for ck, (_, bk) in zip(c, models)) / c.sum()
        return W + eta * (avg_W - W), b + eta * (avg_b - b)


CASES = {   # continuation, weighting, lanes, server learning rates
    "huber, weighted, 1 lane": ("huber", "weighted", 1, (1.0,)),
    "huber, unweighted, 3 lanes, eta_s": ("huber", "unweighted", 3, (1.0, 0.5)),
    "reference, weighted, 4 lanes": ("reference", "weighted", 4, (1.0,)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_three_rounds_equal_the_paper(tiny_synthetic, case):
    """gamma = 0.02: beyond the margin the scale 1/eps = 5 multiplies the rate, and near it
    phi'' = 1/(M - L)^2 = 25; at gamma = 0.05 and M = 2 that is past SGD's stable regime on
    this data, where float32 rounding grows to 2e-5 in 3 rounds (the same loop, float32
    against float64), so the rate is kept below it."""
    continuation, weighting, lanes, etas = CASES[case]
    cfg = tiny_config(algorithm="propfair", thetas=(), seeds=(1, 2), l2_reg=1e-3,
                      clients_per_round=M, local_epochs=EPOCHS, batch_size=8,
                      clients_per_step=lanes, weighting=weighting, propfair_base=(2.0, 3.0),
                      propfair_epsilon=0.2, propfair_continuation=continuation,
                      server_lr=etas, learning_rate=0.02)
    exp = build_experiment(cfg, tiny_synthetic)
    state = run_rounds_history(exp, ROUNDS)[0]
    xs, ys = client_lists(tiny_synthetic.train)
    assert M < len(xs)                                     # partial participation
    assert len(exp.replicas.labels) == 2 * 2 * len(etas)
    counts = {"inside": 0, "beyond": 0}
    for r, lab in enumerate(exp.replicas.labels):
        ref = PropFair(xs, ys, lab.param_value, 0.2, continuation, weighting)
        eta = dict(lab.extra).get("server_lr", 1.0)
        W, b = np.zeros((xs[0].shape[1], tiny_synthetic.num_classes)), np.zeros(10)
        for t in range(ROUNDS):
            W, b = ref.round(W, b, lab.seed, t, cfg.learning_rate, cfg.l2_reg,
                             cfg.batch_size, eta)
        got_W, got_b = linear_rows(state.params, r)
        np.testing.assert_allclose(got_W, W, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got_b, b, atol=1e-5, rtol=1e-5)
        counts = {k: counts[k] + v for k, v in ref.branches.items()}
        if continuation == "reference":   # float32 and float64 take the same branch
            assert ref.closest > 1e-4
    assert counts["inside"] > 500 and counts["beyond"] > 20    # both branches were taken


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_large_base_is_fedavg_at_a_rescaled_rate(tiny_synthetic):
    """While L < M - eps, phi'(L) = 1/(M - L) = (1/M)(1 + L/(M - L)): a local step of PropFair
    at rate gamma M is FedAvg's step at rate gamma plus gamma L/(M - L) grad L. So (at l2 = 0)
    after 3 rounds the models differ by d(M) = c/M + O(1/M^2): M d(M) converges as M grows
    (here to within 2% from M = 1e3 to 1e4), d(M) itself tending to 0."""
    kw = dict(thetas=(), seeds=(1, 2), l2_reg=0.0, clients_per_round=M, local_epochs=EPOCHS,
              batch_size=8, clients_per_step=3)
    gamma = 0.05
    fedavg = run_rounds_history(build_experiment(tiny_config(
        algorithm="fedavg", learning_rate=gamma, **kw), tiny_synthetic), ROUNDS)[0]
    want = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(fedavg.params)])
    gaps = {}
    for base in (1e2, 1e3, 1e4):
        state = run_rounds_history(build_experiment(tiny_config(
            algorithm="propfair", propfair_base=(base,), learning_rate=gamma * base, **kw),
            tiny_synthetic), ROUNDS)[0]
        got = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(state.params)])
        gaps[base] = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert gaps[1e2] < 0.1
    assert gaps[1e4] < 1e-3
    scaled = {base: base * gap for base, gap in gaps.items()}
    assert abs(scaled[1e3] / scaled[1e2] - 1) < 0.1          # first order already at 1e2
    assert abs(scaled[1e4] / scaled[1e3] - 1) < 0.02


# ----------------------------------------------------------------------------- pure functions


def test_transform_by_hand():
    """M = 2, eps = 0.2: inside, phi'(L) = 1/(2 - L); the margin L = 1.8 is inside (1/0.2 = 5);
    beyond, 5 (huber) or 1/2 (reference). phi(1.8) = -log(0.1); huber continues it by the
    tangent, reference jumps to L/M = 0.9."""
    L = np.array([0.0, 1.0, 1.5, 1.8, 1.9, 3.0], np.float32)
    np.testing.assert_allclose(gradient_scale(L, 2.0, 0.2, "huber"),
                               [0.5, 1.0, 2.0, 5.0, 5.0, 5.0], rtol=1e-5)
    np.testing.assert_allclose(gradient_scale(L, 2.0, 0.2, "reference"),
                               [0.5, 1.0, 2.0, 5.0, 0.5, 0.5], rtol=1e-5)
    np.testing.assert_allclose(transformed_loss(L, 2.0, 0.2, "huber"),
                               [0.0, math.log(2), math.log(4), math.log(10),
                                math.log(10) + 0.5, math.log(10) + 6.0], rtol=1e-5)
    np.testing.assert_allclose(transformed_loss(L, 2.0, 0.2, "reference"),
                               [0.0, math.log(2), math.log(4), math.log(10), 0.95, 1.5],
                               rtol=1e-5)
    assert np.isnan(gradient_scale(np.float32(np.nan), 2.0, 0.2) * np.float32(np.nan))


@pytest.mark.parametrize("continuation", ["huber", "reference"])
def test_the_scale_is_the_transforms_derivative(continuation):
    """Central differences of phi (float64 NumPy from its closed form) against phi'(L) away from
    the margin; at the margin huber's phi and phi' are continuous, reference's jump."""
    M, eps, h = 3.0, 0.2, 1e-4

    def phi(L):
        if M - L >= eps:
            return -math.log(1 - L / M)
        return (-math.log(eps / M) + (L - M + eps) / eps if continuation == "huber"
                else L / M)

    for L in (0.1, 1.0, 2.5, 2.7, 2.9, 4.0, 7.5):
        slope = (phi(L + h) - phi(L - h)) / (2 * h)
        np.testing.assert_allclose(float(gradient_scale(np.float32(L), M, eps, continuation)),
                                   slope, rtol=1e-4)
        np.testing.assert_allclose(float(transformed_loss(np.float32(L), M, eps,
                                                          continuation)), phi(L), rtol=1e-5)
    edge = M - eps
    jump = abs(phi(edge + 1e-9) - phi(edge))
    step = abs(float(gradient_scale(np.float32(edge + 1e-3), M, eps, continuation))
               - float(gradient_scale(np.float32(edge), M, eps, continuation)))
    if continuation == "huber":
        assert jump < 1e-6 and step < 1e-3
    else:
        assert jump > 1.0 and step > 4.0        # 1/eps = 5 against 1/M = 1/3


PARAMS = {"w": np.array([[1.0, -2.0], [0.5, 3.0]], np.float32),
          "b": np.array([0.25, -1.0], np.float32)}




@pytest.mark.parametrize("continuation,total", [("huber", 0.5 * (1 + 2 + 5)),
                                                ("reference", 0.5 * (1 + 2 + 0.5))])
def test_client_update_by_hand(continuation, total):
    """Three SGD steps at gamma = 0.5, M = 2, eps = 0.2, on a minibatch whose gradient is -1
    everywhere and whose loss is the first bias b_0 (so the steps raise the loss): from
    b_0 = 1.0 the scales are 1/(2 - 1) = 1, then (b_0 = 1.5) 1/0.5 = 2, then (b_0 = 2.5,
    beyond the margin) 5 (huber) or 1/2 (reference); every parameter moves by 0.5 x their
    sum."""
    alg = propfair(PropFairOptions(propfair_continuation=continuation))
    start = {**PARAMS, "b": np.array([1.0, -1.0], np.float32)}
    job, hyper = client_job(0.5, steps=3), PropFairHyper(base=np.float32(2.0))
    minus = {n: -np.ones_like(v) for n, v in start.items()}
    state = alg.client_update.init((), (), start, hyper, job)
    for _ in range(3):
        state = alg.client_update.step(state, lambda p: (p["b"][0], minus), hyper, job)
    own, delta, out = alg.client_update.final(state, (), start, hyper, job)
    assert own == () and out is None
    for n in start:
        np.testing.assert_allclose(delta[n], np.full_like(start[n], total), rtol=1e-6)


def test_server_update_is_fedavgs():
    """The aggregate is FedAvg's: a_k = n_k / sum n (or 1/m), Delta = sum a_k u_k / sum a_k."""
    from deltafl_jax.algorithms import ClientFeedback
    sizes = np.array([10, 30], np.int32)
    for weighting, want in (("weighted", (10 * 1.0 + 30 * -2.0) / 40), ("unweighted", -0.5)):
        alg = propfair(PropFairOptions(weighting=weighting))
        assert not alg.uses_losses
        a = np.asarray(alg.client_weights(RoundContext((), np.full(2, np.nan), sizes, None, None,
                                                       None)))
        fb = ClientFeedback(
            losses=np.full(2, np.nan, np.float32), sizes=sizes, weights=a,
            delta_sum={n: np.full_like(v, a[0] * 1.0 + a[1] * -2.0) for n, v in PARAMS.items()},
            weight_sum=np.float32(a.sum()), job_sqnorm=np.zeros(2, np.float32),
            job_finite=np.ones(2, bool), job_trained=np.ones(2, bool),
            learning_rate=np.float32(0.1))
        delta, _, _ = alg.server_update((), PARAMS, fb, PropFairHyper(base=2.0))
        for n in PARAMS:
            np.testing.assert_allclose(delta[n], want, rtol=1e-6)


BAD = {
    "base below epsilon": (["--propfair_base=2,0.1"], "--propfair_base must exceed "
                                                      "--propfair_epsilon=0.2"),
    "epsilon above the default base": (["--propfair_epsilon=3"], "--propfair_base must exceed"),
    "zero epsilon": (["--propfair_epsilon=0"], "--propfair_epsilon must be a finite number > 0"),
    "nan epsilon": (["--propfair_epsilon=nan"], "--propfair_epsilon must be a finite number"),
    "negative base": (["--propfair_base=-1"], "--propfair_base must be >= 0"),
    "unknown continuation": (["--propfair_continuation=linear"], "propfair_continuation"),
    "dp with weights n_k": (["--dp_clip=1"], "--weighting=unweighted"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_flags_one_line_exit_2(tmp_path, capsys, case):
    argv, message = BAD[case]
    out = tmp_path / "o"
    code, err, _ = run_runner(["--dataset=synthetic", "--algorithm=propfair",
                               f"--output_dir={out}", *argv], capsys)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
