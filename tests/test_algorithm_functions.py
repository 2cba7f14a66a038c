"""Each algorithm's pure functions on hand-made inputs, without the engine (no jit, no round):
build the :class:`FederatedAlgorithm` from its factory, call ``client_weights`` and
``server_update`` on a hand-made :class:`ClientFeedback` (the sums that the engine would
report, computed here in NumPy) and compare with values worked out by hand or from the papers'
formulas written in NumPy.

The contract: ``server_update(state, params, feedback, hyper) -> (Delta, state, metrics)``
with Delta the aggregate step that the round applies as w + Delta."""

import jax
import numpy as np
import pytest

from conftest import client_job, tiny_config
from deltafl_jax.algorithms import ClientFeedback, registry
from deltafl_jax.algorithms.afl import AFLHyper, afl
from deltafl_jax.algorithms.deltafl import DeltaFLHyper, DeltaFLOptions, deltafl
from deltafl_jax.algorithms.deltafl_alt import DeltaFLAltHyper, DeltaFLAltOptions, deltafl_alt
from deltafl_jax.algorithms.fedavg import FedAvgOptions, fedavg
from deltafl_jax.algorithms.fedavg_sub import FedAvgSubHyper, FedAvgSubOptions, fedavg_sub
from deltafl_jax.algorithms.fedprox import FedProxHyper, fedprox
from deltafl_jax.algorithms.protocol import RoundContext
from deltafl_jax.algorithms.qffl import QFFLHyper, qffl
from deltafl_jax.algorithms.term import TERMHyper, term

# Two leaves; every client's update w_k - w is a pytree like it.
PARAMS = {"w": np.array([[1.0, -2.0], [0.5, 3.0]], np.float32),
          "b": np.array([0.25, -1.0], np.float32)}
# Four clients: losses F_k and sizes n_k (alpha_k = n_k / 100).
LOSSES = np.array([1.0, 4.0, 2.0, 3.0], np.float32)
SIZES = np.array([10, 20, 30, 40], np.int32)
KEY = jax.random.PRNGKey(0)


def update(k):
    """Client k's update w_k - w (distinct, hand-chosen numbers)."""
    return {"w": np.array([[k + 1.0, -1.0], [0.5 * k, 2.0 - k]], np.float32),
            "b": np.array([0.1 * (k + 1), -0.2 * k], np.float32)}




def feedback(weights, losses=LOSSES, sizes=SIZES, finite=None, learning_rate=0.1,
             clients=None):
    """What the engine reports after training the clients with a_k > 0 (module docstring of
    deltafl_jax/algorithms/protocol.py): the a_k-weighted sum of the finite updates, their weight,
    each trained client's squared update norm and flags."""
    a = np.asarray(weights, np.float64)
    m = a.shape[0]
    trained = a > 0
    finite = trained if finite is None else trained & np.asarray(finite)
    ups = [update(k) for k in range(m)]
    delta_sum = {name: sum((a[k] * ups[k][name].astype(np.float64) for k in range(m)
                            if finite[k]), np.zeros_like(PARAMS[name], np.float64))
                 .astype(np.float32) for name in PARAMS}
    sqnorm = np.array([sum(float(np.sum(np.square(ups[k][n]))) for n in PARAMS)
                       if trained[k] else 0.0 for k in range(m)], np.float32)
    return ClientFeedback(
        losses=np.asarray(losses, np.float32), sizes=np.asarray(sizes, np.int32),
        weights=a.astype(np.float32), delta_sum=delta_sum,
        weight_sum=np.float32(np.sum(a[finite])), job_sqnorm=sqnorm, job_finite=finite,
        job_trained=trained, learning_rate=np.float32(learning_rate),
        clients=np.arange(m, dtype=np.int32) if clients is None else np.asarray(clients))


def average(weights, finite=None):
    """sum_k a_k (w_k - w) / sum_k a_k over the finite updates, in float64."""
    a = np.asarray(weights, np.float64)
    ok = a > 0 if finite is None else (a > 0) & np.asarray(finite)
    return {n: sum(a[k] * update(k)[n].astype(np.float64) for k in range(len(a)) if ok[k])
            / a[ok].sum() for n in PARAMS}


def assert_tree_close(got, want, rtol=1e-6, atol=1e-7):
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_allclose(np.asarray(got[n], np.float64), want[n], rtol=rtol,
                                   atol=atol, err_msg=n)


def as_np(x):
    return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------- Delta-FL


def test_deltafl_exact_filter_keeps_the_tail_and_a_boundary_fraction():
    """theta = 0.5, alpha = (.1, .2, .3, .4): sorted losses 1, 2, 3, 4 carry alpha .1, .3, .4,
    .2, cumulative .1, .4, .8, 1: eta (the lower 0.5-quantile) = 3. The client above eta
    (F = 4, alpha .2) keeps all its weight; the boundary client (F = 3, alpha .4) the
    remaining theta - .2 = .3, a fraction 3/4 of its alpha; the others none. Normalised:
    pi = (0, .4, 0, .6)."""
    alg = deltafl(DeltaFLOptions(), thetas=(0.5,))
    hyper = DeltaFLHyper(theta=np.float32(0.5))
    state = alg.init(PARAMS, hyper)
    weights = alg.client_weights(RoundContext(state, LOSSES, SIZES, hyper, KEY, np.arange(4)))
    np.testing.assert_allclose(as_np(weights), [0.0, 0.4, 0.0, 0.6], rtol=1e-6, atol=0)
    delta, _, metrics = alg.server_update(state, PARAMS, feedback(weights), hyper)
    assert float(metrics["eta"]) == 3.0
    assert_tree_close(delta, average([0.0, 0.4, 0.0, 0.6]))
    assert alg.uses_losses


def test_deltafl_reference_filter_keeps_every_client_at_or_above_eta_at_full_weight():
    alg = deltafl(DeltaFLOptions(filter="reference"), thetas=(0.5,))
    hyper = DeltaFLHyper(theta=np.float32(0.5))
    weights = alg.client_weights(RoundContext((), LOSSES, SIZES, hyper, KEY, np.arange(4)))
    np.testing.assert_array_equal(as_np(weights), [0.0, 20.0, 0.0, 40.0])   # n_k, F_k >= 3
    delta, _, metrics = alg.server_update((), PARAMS, feedback(weights), hyper)
    assert float(metrics["eta"]) == 3.0
    assert_tree_close(delta, average([0.0, 20.0, 0.0, 40.0]))


def test_deltafl_at_theta_one_averages_every_client_with_alpha():
    alg = deltafl(thetas=(1.0,))
    weights = alg.client_weights(RoundContext((), LOSSES, SIZES, DeltaFLHyper(np.float32(1.0)),
                                              KEY, np.arange(4)))
    np.testing.assert_allclose(as_np(weights), [0.1, 0.2, 0.3, 0.4], rtol=1e-6)


def test_deltafl_unweighted_is_the_quantile_of_the_plain_losses():
    """alpha_k = 1/4, theta = 0.6: cumulative .25, .5, .75, 1 over the sorted losses: eta = 2
    (the first to reach .4). F = 3 and F = 4 take .25 each; F = 2 the remaining .1 of
    theta = .6, a fraction .4 of its .25. Normalised by .6: (0, 5/12, 1/6, 5/12)."""
    alg = deltafl(DeltaFLOptions(weighting="unweighted"), thetas=(0.6,))
    hyper = DeltaFLHyper(theta=np.float32(0.6))
    weights = alg.client_weights(RoundContext((), LOSSES, SIZES, hyper, KEY, np.arange(4)))
    np.testing.assert_allclose(as_np(weights), [0.0, 5 / 12, 1 / 6, 5 / 12], rtol=1e-5)
    _, _, metrics = alg.server_update((), PARAMS, feedback(weights), hyper)
    assert float(metrics["eta"]) == 2.0


def test_the_spec_passes_the_configs_options_to_the_factory():
    spec = registry.get("deltafl")
    config = tiny_config(thetas=(0.5,), filter="reference")
    assert spec.options_for(config) == DeltaFLOptions(filter="reference")
    alg = spec.make(config, None)
    weights = alg.client_weights(RoundContext((), LOSSES, SIZES, DeltaFLHyper(np.float32(0.5)),
                                              KEY, np.arange(4)))
    np.testing.assert_array_equal(as_np(weights), [0.0, 20.0, 0.0, 40.0])


# ----------------------------------------------------------------------------- FedAvg family


@pytest.mark.parametrize("weighting,want", [("weighted", [0.1, 0.2, 0.3, 0.4]),
                                            ("unweighted", [0.25, 0.25, 0.25, 0.25])])
def test_fedavg_weights_are_alpha_over_its_sum_and_need_no_loss(weighting, want):
    alg = fedavg(FedAvgOptions(weighting=weighting))
    assert not alg.uses_losses
    hyper = DeltaFLHyper(theta=np.float32(1.0))
    nan = np.full(4, np.nan, np.float32)      # the round does not evaluate F_k(w_t)
    weights = alg.client_weights(RoundContext((), nan, SIZES, hyper, KEY, np.arange(4)))
    np.testing.assert_allclose(as_np(weights), want, rtol=1e-6)
    delta, state, metrics = alg.server_update((), PARAMS, feedback(weights, losses=nan), hyper)
    assert_tree_close(delta, average(want))
    assert state == () and dict(metrics) == {}


def test_fedavg_drops_a_client_whose_update_is_not_finite():
    alg = fedavg()
    weights = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    fb = feedback(weights, finite=[True, False, True, True])
    delta, _, _ = alg.server_update((), PARAMS, fb, DeltaFLHyper(np.float32(1.0)))
    assert_tree_close(delta, average(weights, finite=[True, False, True, True]))


def test_fedprox_is_fedavg_with_the_proximal_term():
    alg = fedprox()
    hyper = FedProxHyper(mu=np.float32(0.5))
    weights = alg.client_weights(RoundContext((), LOSSES, SIZES, hyper, KEY, np.arange(4)))
    np.testing.assert_allclose(as_np(weights), [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    # Its client update: from w_t, one step to w, then a second step from w with the
    # minibatch gradient g: w' = w - gamma (g + mu (w - w_t)), the gradient of
    # F_k + (mu/2)||w - w_t||^2; the update is w' - w_t.
    job = client_job(0.1, steps=2)
    g = {"w": np.ones((2, 2), np.float32), "b": np.array([2.0, -1.0], np.float32)}
    d = update(1)
    step = alg.client_update.init((), (), PARAMS, hyper, job)
    step = alg.client_update.step(step, lambda p: (0.0, {n: -d[n] / 0.1 for n in p}), hyper,
                                  job)
    step = alg.client_update.step(step, lambda p: (0.0, g), hyper, job)
    _, u, out = alg.client_update.final(step, (), PARAMS, hyper, job)
    assert out is None
    for n in PARAMS:   # first step: w = w_t + d; second: w - 0.1 (g + 0.5 d)
        assert_tree_close({n: u[n]}, {n: d[n] - 0.1 * (g[n] + 0.5 * d[n])})


def test_fedavg_sub_averages_a_random_subset_of_the_given_size():
    alg = fedavg_sub("count")
    hyper = FedAvgSubHyper(theta=np.float32(1.0), clients=np.float32(2.0))
    key = jax.random.PRNGKey(3)
    weights = as_np(alg.client_weights(RoundContext((), LOSSES, SIZES, hyper, key, np.arange(4))))
    # The subset: the 2 slots with the smallest uniform draws of the key, at weight n_k.
    draws = np.asarray(jax.random.uniform(key, (4,)))
    chosen = np.sort(np.argsort(draws, kind="stable")[:2])
    np.testing.assert_array_equal(np.flatnonzero(weights), chosen)
    np.testing.assert_array_equal(weights[chosen], SIZES[chosen])
    delta, _, metrics = alg.server_update((), PARAMS, feedback(weights), hyper)
    assert int(metrics["subset_size"]) == 2
    assert_tree_close(delta, average(weights))


@pytest.mark.parametrize("filter,count", [("exact", 2), ("reference", 3)])
def test_fedavg_sub_keeps_as_many_clients_as_deltafls_filter(filter, count):
    """Equal sizes, theta = 0.5: eta = 2 (cumulative .25, .5); F = 3, 4 fill theta exactly, so
    the exact filter gives the tied F = 2 nothing (2 clients) and the reference filter keeps
    it (3 clients)."""
    alg = fedavg_sub("theta", FedAvgSubOptions(filter=filter), thetas=(0.5,))
    sizes = np.full(4, 10, np.int32)
    hyper = FedAvgSubHyper(theta=np.float32(0.5), clients=np.float32(0.0))
    weights = as_np(alg.client_weights(RoundContext((), LOSSES, sizes, hyper, KEY, np.arange(4))))
    assert int(np.sum(weights > 0)) == count
    assert set(weights[weights > 0]) == {10.0}     # the subset is averaged with n_k


# ----------------------------------------------------------------------------- q-FFL


def qffl_step_numpy(losses, sizes, lr, q):
    """q-FedAvg's server step (Li et al., ICLR 2020, Algorithm 3) with the clients' n_k:
    Delta w_k = L (w - w_k), h_k = q F_k^(q-1) ||Delta w_k||^2 + L F_k^q, L = 1 / lr,
    w' = w - sum_k n_k F_k^q Delta w_k / sum_k n_k h_k. Returns (w' - w, the step relative to
    the plain n_k-average: L sum n_k F_k^q / sum n_k h_k)."""
    F = np.asarray(losses, np.float64) + 1e-10
    n = np.asarray(sizes, np.float64)
    L = 1.0 / lr
    dw = [{k: -L * update(i)[k].astype(np.float64) for k in PARAMS} for i in range(len(F))]
    sq = np.array([sum(np.sum(d[k] ** 2) for k in PARAMS) for d in dw])
    h = q * F ** (q - 1) * sq + L * F ** q
    step = {k: -sum(n[i] * F[i] ** q * dw[i][k] for i in range(len(F))) / np.sum(n * h)
            for k in PARAMS}
    return step, L * np.sum(n * F ** q) / np.sum(n * h)


@pytest.mark.parametrize("q", [0.0, 2.0])
def test_qffl_step_is_the_papers_formula(q):
    losses = np.array([0.5, 1.0, 2.0], np.float32)
    sizes = np.array([10, 20, 30], np.int32)
    alg = qffl()
    hyper = QFFLHyper(q=np.float32(q))
    weights = as_np(alg.client_weights(RoundContext((), losses, sizes, hyper, KEY, np.arange(3))))
    # a_k = n_k (F_k / F_max)^q
    np.testing.assert_allclose(weights, sizes * (losses / 2.0) ** q, rtol=1e-6)
    delta, _, metrics = alg.server_update((), PARAMS, feedback(weights, losses, sizes), hyper)
    want, step = qffl_step_numpy(losses, sizes, 0.1, q)
    assert_tree_close(delta, want, rtol=1e-5)
    assert float(metrics["qffl_step"]) == pytest.approx(step, rel=1e-5)
    if q == 0.0:   # q = 0 is FedAvg: the n_k-average of the updates, a step of 1
        assert_tree_close(delta, average(sizes), rtol=1e-5)
        assert step == pytest.approx(1.0)


# ----------------------------------------------------------------------------- TERM


def test_term_tilts_the_weights_and_keeps_a_running_estimate():
    t = 1.0
    alg = term()
    hyper = TERMHyper(t=np.float32(t))
    state = alg.init(PARAMS, hyper)
    n = SIZES.astype(np.float64)

    def tilted(losses, shift):
        e = np.exp(t * (np.asarray(losses, np.float64) - shift))
        return e, np.sum(n * e) / np.sum(n)

    # Round 0: E is this round's n-weighted mean of e_k = exp(t (F_k - max F)).
    e0, mean0 = tilted(LOSSES, 4.0)
    weights = as_np(alg.client_weights(RoundContext(state, LOSSES, SIZES, hyper, KEY,
                                                    np.arange(4))))
    np.testing.assert_allclose(weights, n * e0 / mean0, rtol=1e-5)
    delta, state, metrics = alg.server_update(state, PARAMS, feedback(weights), hyper)
    assert float(metrics["term_estimate"]) == pytest.approx(mean0, rel=1e-6)
    assert int(state.rounds) == 1
    want = {k: sum(weights[i] * update(i)[k] for i in range(4)) / n.sum() for k in PARAMS}
    assert_tree_close(delta, want, rtol=1e-5)

    # Round 1: E <- E / 2 + mean / 2; a client whose update was rejected leaves sum n_k.
    losses = np.array([2.0, 0.5, 1.5, 1.0], np.float32)
    e1, mean1 = tilted(losses, 2.0)
    estimate = 0.5 * mean0 + 0.5 * mean1
    weights = as_np(alg.client_weights(RoundContext(state, losses, SIZES, hyper, KEY,
                                                    np.arange(4))))
    np.testing.assert_allclose(weights, n * e1 / estimate, rtol=1e-5)
    finite = [True, True, False, True]
    delta, state, metrics = alg.server_update(state, PARAMS,
                                              feedback(weights, losses, finite=finite), hyper)
    assert float(metrics["term_estimate"]) == pytest.approx(estimate, rel=1e-6)
    want = {k: sum(weights[i] * update(i)[k] for i in (0, 1, 3)) / (n.sum() - n[2])
            for k in PARAMS}
    assert_tree_close(delta, want, rtol=1e-5)


def test_term_with_a_negative_tilt_shifts_by_the_smallest_loss():
    alg = term()
    hyper = TERMHyper(t=np.float32(-2.0))
    weights = as_np(alg.client_weights(RoundContext(alg.init(PARAMS, hyper), LOSSES, SIZES, hyper,
                                                    KEY, np.arange(4))))
    e = np.exp(-2.0 * (LOSSES.astype(np.float64) - 1.0))
    n = SIZES.astype(np.float64)
    np.testing.assert_allclose(weights, n * e / (np.sum(n * e) / n.sum()), rtol=1e-5)


# ----------------------------------------------------------------------------- AFL


def project_simplex_numpy(v):
    """Euclidean projection onto the simplex by bisection on tau: sum max(v - tau, 0) = 1."""
    lo, hi = np.min(v) - 1.0, np.max(v)
    for _ in range(200):
        tau = 0.5 * (lo + hi)
        lo, hi = (tau, hi) if np.sum(np.maximum(v - tau, 0.0)) > 1.0 else (lo, tau)
    return np.maximum(v - 0.5 * (lo + hi), 0.0)


def test_afl_projects_lambda_and_serves_the_average_of_its_iterates():
    """lambda_0 = (.2, .3, .5); losses (1, .2, .4) at gamma_lambda = 2 give v = (2.2, .7, 1.3),
    whose projection drops the middle client: tau = (2.2 + 1.3 - 1) / 2 = 1.25, lambda =
    (.95, 0, .05)."""
    alg = afl(np.array([20, 30, 50]))
    hyper = AFLHyper(lambda_lr=np.float32(2.0))
    state = alg.init(PARAMS, hyper)
    clients = np.array([0, 1, 2], np.int32)
    np.testing.assert_allclose(as_np(state.lam), [0.2, 0.3, 0.5], rtol=1e-6)
    assert_tree_close(alg.eval_params(state, PARAMS), PARAMS)        # w_0 before a round
    losses = np.array([1.0, 0.2, 0.4], np.float32)
    weights = as_np(alg.client_weights(RoundContext(state, losses, np.array([20, 30, 50]), hyper,
                                                    KEY, clients)))
    np.testing.assert_allclose(weights, [0.2, 0.3, 0.5], rtol=1e-6)   # lambda_k
    fb = feedback(weights, losses, np.array([20, 30, 50]), clients=clients)
    delta, state, metrics = alg.server_update(state, PARAMS, fb, hyper)
    assert_tree_close(delta, average(weights), rtol=1e-6)
    np.testing.assert_allclose(as_np(state.lam), [0.95, 0.0, 0.05], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(as_np(state.lam), project_simplex_numpy(
        np.array([0.2, 0.3, 0.5]) + 2.0 * losses.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert int(metrics["afl_lambda_support"]) == 2
    assert float(metrics["afl_lambda_max"]) == pytest.approx(0.95, rel=1e-6)
    w1 = {k: (PARAMS[k] + average(weights)[k]).astype(np.float32) for k in PARAMS}
    assert_tree_close(alg.eval_params(state, w1), w1, rtol=1e-6)     # avg of w_1 = w_1

    # Round 2: the client with lambda = 0 gets no weight; the served model is (w_1 + w_2)/2.
    weights = as_np(alg.client_weights(RoundContext(state, losses, np.array([20, 30, 50]), hyper,
                                                    KEY, clients)))
    np.testing.assert_allclose(weights, [0.95, 0.0, 0.05], rtol=1e-5, atol=1e-7)
    fb = feedback(weights, losses, np.array([20, 30, 50]), clients=clients)
    delta, state, _ = alg.server_update(state, w1, fb, hyper)
    w2 = {k: w1[k] + average(weights)[k] for k in PARAMS}
    assert_tree_close(delta, average(weights), rtol=1e-5)
    assert_tree_close(alg.eval_params(state, w2), {k: (w1[k] + w2[k]) / 2 for k in PARAMS},
                      rtol=1e-5, atol=1e-6)


def test_afl_lambda_stays_on_the_simplex_when_every_client_keeps_weight():
    """lambda_0 = (.2, .3, .5), losses (1, .2, .4), gamma = .5: v = (.7, .4, .7), tau =
    (1.8 - 1) / 3: lambda = (13/30, 4/30, 13/30)."""
    alg = afl(np.array([20, 30, 50]))
    hyper = AFLHyper(lambda_lr=np.float32(0.5))
    state = alg.init(PARAMS, hyper)
    losses = np.array([1.0, 0.2, 0.4], np.float32)
    fb = feedback(np.asarray(state.lam), losses, np.array([20, 30, 50]),
                  clients=np.arange(3, dtype=np.int32))
    _, state, _ = alg.server_update(state, PARAMS, fb, hyper)
    np.testing.assert_allclose(as_np(state.lam), [13 / 30, 4 / 30, 13 / 30], rtol=1e-5)


# ----------------------------------------------------------------------------- deltafl_alt


def test_deltafl_alt_holds_eta_between_refreshes():
    alg = deltafl_alt(DeltaFLAltOptions(), thetas=(0.5,))
    hyper = DeltaFLAltHyper(theta=np.float32(0.5), eta_every=np.float32(3.0))
    state = alg.init(PARAMS, hyper)

    def round_(state, losses):
        weights = as_np(alg.client_weights(RoundContext(state, losses, SIZES, hyper, KEY,
                                                        np.arange(4))))
        delta, state, metrics = alg.server_update(state, PARAMS, feedback(weights, losses),
                                                  hyper)
        return weights, delta, state, {k: float(v) for k, v in metrics.items()}

    # Round 0 refreshes: Delta-FL's round (exact weights of the hand case, eta = 3).
    weights, _, state, met = round_(state, LOSSES)
    np.testing.assert_allclose(weights, [0.0, 0.4, 0.0, 0.6], rtol=1e-6)
    assert met == {"eta": 3.0, "eta_refreshed": 1.0, "empty_round": 0.0}
    # Round 1 holds eta = 3: the clients with F_k > 3, strictly, at full n_k.
    losses = np.array([3.5, 2.5, 3.0, 5.0], np.float32)
    weights, delta, state, met = round_(state, losses)
    np.testing.assert_array_equal(weights, [10.0, 0.0, 0.0, 40.0])
    assert met == {"eta": 3.0, "eta_refreshed": 0.0, "empty_round": 0.0}
    assert_tree_close(delta, average(weights), rtol=1e-6)
    # Round 2: no loss above the held eta: an empty round, w unchanged.
    weights, delta, state, met = round_(state, np.array([1.0, 3.0, 2.0, 0.5], np.float32))
    assert not weights.any() and met["empty_round"] == 1.0 and met["eta"] == 3.0
    assert all(not np.asarray(d).any() for d in jax.tree.leaves(delta))
    # Round 3 = 0 mod 3 refreshes eta from its own losses: sorted 0.5, 1, 2, 4 carry alpha
    # .4, .3, .1, .2, cumulative .4, .7: eta = 1.
    _, _, state, met = round_(state, np.array([2.0, 4.0, 1.0, 0.5], np.float32))
    assert met == {"eta": 1.0, "eta_refreshed": 1.0, "empty_round": 0.0}
    assert int(state.rounds) == 4


# ----------------------------------------------------------------------------- SCAFFOLD


def test_scaffold_client_update_is_option_two():
    """init keeps c - c_k; each step adds it to the gradient before the optimizer; final gives
    the update y_k - w_t, c_k+ = c_k - c + (w_t - y_k) / (K gamma) and Delta c_k = c_k+ - c_k
    (Algorithm 1, option II), here with K = 1 step at gamma = 0.1 and numbers chosen by hand."""
    from deltafl_jax.algorithms.scaffold import ScaffoldState, scaffold
    alg = scaffold(SIZES)
    c = {"w": np.full((2, 2), 0.5, np.float32), "b": np.array([1.0, -1.0], np.float32)}
    ck = {"w": np.array([[0.1, 0.2], [0.3, 0.4]], np.float32), "b": np.zeros(2, np.float32)}
    job = client_job(0.1, steps=1)
    step = alg.client_update.init(ScaffoldState(c=c), ck, PARAMS, None, job)
    np.testing.assert_allclose(step.context["w"], [[0.4, 0.3], [0.2, 0.1]], rtol=1e-6)
    grads = {"w": np.ones((2, 2), np.float32), "b": np.array([2.0, 3.0], np.float32)}
    step = alg.client_update.step(step, lambda p: (0.0, grads), None, job)
    new, delta, out = alg.client_update.final(step, ck, PARAMS, None, job)
    np.testing.assert_allclose(delta["b"], -0.1 * np.array([3.0, 2.0]), rtol=1e-6)
    for n in PARAMS:                                 # (w_t - y_k) / (K gamma) = -delta / 0.1
        np.testing.assert_allclose(delta[n], -0.1 * (grads[n] + c[n] - ck[n]), rtol=1e-5)
        want = ck[n] - c[n] - delta[n] / 0.1
        np.testing.assert_allclose(new[n], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[n], want - ck[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weighting", ["weighted", "unweighted"])
def test_scaffold_server_update_skips_a_client_with_a_non_finite_update(weighting):
    """Clients 0, 1, 3 trained, client 1's update was not finite (its Delta c_k is NaN): Delta
    is the average of clients 0 and 3, and c <- c + sum over them of alpha_k Delta c_k, with
    alpha_k = n_k / n over all N training clients (weighted) or 1 / N (unweighted)."""
    from deltafl_jax.algorithms.scaffold import ScaffoldOptions, ScaffoldState, scaffold
    train_sizes = np.array([10, 20, 30, 40, 100], np.int32)        # N = 5 training clients
    alg = scaffold(train_sizes, ScaffoldOptions(weighting=weighting))
    clients = np.array([4, 0, 2, 1], np.int32)                     # the m = 4 sampled ones
    a = np.asarray(alg.client_weights(RoundContext((), LOSSES, train_sizes[clients], None, KEY,
                                                   clients)))
    n = train_sizes[clients].astype(np.float64)
    np.testing.assert_allclose(a, (n if weighting == "weighted" else np.ones(4)) /
                               (n.sum() if weighting == "weighted" else 4), rtol=1e-6)
    a = a * np.array([1, 1, 0, 1])                                 # client slot 2 did not train
    finite = np.array([True, False, True, True])
    fb = feedback(a, sizes=train_sizes[clients], finite=finite, clients=clients)
    dc = [update(k + 5) for k in range(4)]
    dc[1] = {n_: np.full_like(v, np.nan) for n_, v in dc[1].items()}
    outputs = {n_: np.stack([d[n_] for d in dc]) for n_ in PARAMS}
    c0 = {n_: np.full_like(v, 0.5) for n_, v in PARAMS.items()}
    delta, state, metrics = alg.server_update(ScaffoldState(c=c0), PARAMS,
                                              fb._replace(client_outputs=outputs), None)
    want = average(a, finite)
    alpha = (train_sizes / train_sizes.sum() if weighting == "weighted"
             else np.full(5, 0.2))[clients]
    for n_ in PARAMS:
        np.testing.assert_allclose(delta[n_], want[n_], rtol=1e-5)
        c_want = c0[n_] + alpha[0] * dc[0][n_] + alpha[3] * dc[3][n_]
        np.testing.assert_allclose(state.c[n_], c_want, rtol=1e-5)
    assert np.isfinite(float(metrics["control_variate_norm"]))
