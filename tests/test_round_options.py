"""Delta-FL's round options against independent NumPy computations from the papers
(numpy_options.py): --smoothing (eqs. 5-7, Property 9, Prop. 4), --quantile=secagg_mm
(Algorithm 3, App. B.1) and --weighting=unweighted (the 2022 paper)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_options as no
from conftest import client_lists, linear_rows, run_rounds_history, tiny_config
from numpy_reference import client_loss, exact_weights, reference_weights
from deltafl_jax import FederatedDataset, build_experiment
from deltafl_jax.data import ClientData
from deltafl_jax.errors import ConfigError
from deltafl_jax.privacy.secagg import mm_quantile
from deltafl_jax.superquantile import (smoothed_eta, smoothed_superquantile,
                                       smoothed_tail_weights, superquantile, tail_weights)

ATOL, RTOL = 2e-5, 1e-4


run = run_rounds_history


def close(state, r, W, b, atol=ATOL, rtol=RTOL):
    got_W, got_b = linear_rows(state.params, r)
    np.testing.assert_allclose(got_W, W, atol=atol, rtol=rtol)
    np.testing.assert_allclose(got_b, b, atol=atol, rtol=rtol)


def equal_sized(data, n):
    def cut(split):
        return ClientData.from_clients([split.client(k)[0][:n] for k in range(split.num_clients)],
                                       [split.client(k)[1][:n] for k in range(split.num_clients)])
    return FederatedDataset(data.name, cut(data.train), cut(data.test), data.num_classes)


# ----------------------------------------------------------------------------- smoothing


@pytest.mark.slow
def test_smoothed_eta_and_value_match_property_9_by_bisection():
    rng = np.random.default_rng(0)
    eta_of = jax.jit(smoothed_eta)
    value_of = jax.jit(smoothed_superquantile)
    weights_of = jax.jit(smoothed_tail_weights)
    exact_of = jax.jit(superquantile)
    for _ in range(200):
        m = int(rng.integers(2, 15))
        x = np.round(rng.normal(size=m), int(rng.integers(1, 4))).astype(np.float32)  # ties
        w = rng.integers(1, 60, size=m).astype(np.float32)
        theta = float(rng.choice([1.0, 0.9, 2 / 3, 0.5, 0.2, 0.05]))
        nu = float(rng.choice([1e-2, 0.1, 0.5, 2.0]))
        want_value = no.smoothed_objective(x, w, theta, nu)[0]
        got_eta = float(eta_of(x, w, theta, nu))
        # eta may be any point of the minimising interval: compare h(eta), not eta.
        h_got = got_eta + np.sum(w / w.sum() * no.g_nu(x - got_eta, nu)) / theta
        assert h_got == pytest.approx(want_value, rel=1e-5, abs=1e-5)
        assert float(value_of(x, w, theta, nu)) == pytest.approx(want_value, rel=1e-5,
                                                                 abs=1e-5)
        pi = np.asarray(weights_of(x, w, theta, nu))
        np.testing.assert_allclose(pi, no.smoothed_weights(x, w, theta, nu), atol=2e-5)
        # Property 8: 0 <= F_{theta,nu} - F_theta <= nu / (2 theta).
        gap = want_value - float(exact_of(x, w, theta))
        assert -1e-5 <= gap <= nu / (2 * theta) + 1e-5


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_nu_to_zero_recovers_the_exact_filter():
    rng = np.random.default_rng(1)
    for _ in range(100):
        x = rng.permutation(12).astype(np.float32) * 0.1 + rng.normal(size=12).astype(
            np.float32) * 0.01
        w = rng.integers(1, 60, size=12).astype(np.float32)
        for theta in (0.9, 0.5, 0.1):
            exact = np.asarray(tail_weights(x, w, theta))
            for nu in (1e-2, 1e-3):   # below the smallest gap between losses
                np.testing.assert_allclose(np.asarray(smoothed_tail_weights(x, w, theta, nu)),
                                           exact, atol=1e-4)
            assert np.abs(np.asarray(smoothed_tail_weights(x, w, theta, 1.0)) - exact).max() > 1e-2


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_small_nu_round_equals_exact_filter_round(tiny_synthetic):
    """nu = 1e-3 is below the gaps between the sampled losses: the same clients train, with
    the same weights up to float32 (the boundary client's fraction (F - eta) / nu carries
    ulp(F) / nu ~ 2e-4 relative error); nu = 1 changes the weights."""
    def params(**kw):
        exp = build_experiment(tiny_config(thetas=(0.8, 0.3), l2_reg=1e-3, **kw),
                               tiny_synthetic)
        state, hist = run(exp, 4)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.params)]), hist
    exact, he = params()
    small, hs = params(smoothing=1e-3)
    large, _ = params(smoothing=1.0)
    assert [list(h["num_selected"]) for h in hs] == [list(h["num_selected"]) for h in he]
    assert np.max(np.abs(small - exact)) < 5e-5
    assert np.max(np.abs(large - exact)) > 100 * np.max(np.abs(small - exact))


def test_smoothed_round_equals_numpy(tiny_synthetic):
    nu = 0.2
    cfg = tiny_config(thetas=(0.7, 0.3), seeds=(1, 2), l2_reg=1e-3, smoothing=nu,
                      clients_per_step=3)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run(exp, 3)
    xs, ys = client_lists(tiny_synthetic.train)
    for r, lab in enumerate(exp.replicas.labels):
        W, b = np.zeros((60, 10)), np.zeros(10)
        for t in range(3):
            W, b, F, a = no.weighted_round(
                W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate, cfg.l2_reg, cfg.batch_size,
                lambda F, n: no.smoothed_weights(F, n, lab.theta, nu))
        close(state, r, W, b)
        assert int(hist[-1]["num_selected"][r]) == int(np.sum(a > 0))
    assert 0 < int(np.min(hist[-1]["num_selected"])) < 6


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_smoothed_full_participation_is_gradient_descent_to_a_stationary_point(tiny_synthetic):
    """Prop. 4 (a), (c), (d) with nu = 2 delta theta: all N clients every round (m = N), one
    full-batch local step (a gradient step on F_{theta,nu}, by Danskin), a strongly convex
    objective (softmax regression + L2): F_{theta,nu}(w_t) decreases, its gradient goes to 0,
    and F_theta(w_T) lies within delta of F_{theta,nu}(w_T)."""
    theta, delta, l2 = 0.5, 0.5, 0.1
    nu = 2 * delta * theta
    data = tiny_synthetic
    N = data.train.num_clients
    cfg = tiny_config(thetas=(theta,), smoothing=nu, clients_per_round=N, batch_size=128,
                      l2_reg=l2, learning_rate=0.05)
    exp = build_experiment(cfg, data)
    xs, ys = client_lists(data.train)
    n = data.train.sizes.astype(np.float64)
    state, keys = exp.initial_state(), exp.keys()
    values, grads = [], []
    for t in range(301):
        W, b = linear_rows(state.params, 0)
        F = np.array([client_loss(W, b, xs[k], ys[k], l2) for k in range(N)])
        values.append(no.smoothed_objective(F, n, theta, nu)[0])
        gW, gb = no.full_gradient(W, b, xs, ys, l2, no.smoothed_weights(F, n, theta, nu))
        grads.append(np.sqrt(np.sum(gW ** 2) + np.sum(gb ** 2)))
        state, _ = exp.round_fn(state, exp.round_data(t), keys)
    values, grads = np.asarray(values), np.asarray(grads)
    assert np.all(np.diff(values) <= 1e-6), np.max(np.diff(values))
    assert grads[-1] < 0.01 * grads[0], (grads[0], grads[-1])
    exact = float(superquantile(F.astype(np.float32), n.astype(np.float32), theta))
    assert -1e-4 <= values[-1] - exact <= delta + 1e-4


# ----------------------------------------------------------------------------- secure aggregation


def test_mm_iterates_are_eq_17():
    """Float32 MM against eq. 17 in float64. A step taken from mu_t at distance d of some
    x_k carries a relative error ~ ulp(x) / d (beta_k = alpha_k / d): the cases whose float64
    trajectory passes within 1e-3 of a loss are compared loosely."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(100, 10)).astype(np.float32)
    w = rng.integers(1, 60, size=(100, 10)).astype(np.float32)
    tau = rng.choice([0.1, 0.2, 0.5, 0.8, 0.9], size=100)
    mm = jax.jit(jax.vmap(lambda x, w, t, k: mm_quantile(x, w, t, k)[0], (0, 0, 0, None)),
                 static_argnums=3)
    got = {k: np.asarray(mm(x, w, tau.astype(np.float32), k)) for k in (1, 2, 3, 5)}
    assert all(mm_quantile(x[0], w[0], 0.5, k)[1] == k + 1 for k in (1, 5))
    loose = 0
    for i in range(100):
        path = [no.mm_quantile(x[i], w[i], float(tau[i]), k) for k in range(6)]
        near = min(np.min(np.abs(x[i] - mu)) for mu in path[:-1]) < 1e-3
        loose += near
        for k in got:
            assert float(got[k][i]) == pytest.approx(path[k], rel=1e-2 if near else 1e-4,
                                                     abs=1e-5), (i, k)
    assert loose < 15


def test_a_smoothing_below_the_losses_float32_resolution_warns_once(tiny_synthetic, capsys):
    """nu below 8 float32 steps of log C cannot be resolved by losses near log C: the boundary
    client's fraction is lost there (weights off by percents), while a nu well above it gives
    the exact filter's weights (NumPy's greedy LP) back. Such a nu warns, one line, at build."""
    from deltafl_jax.algorithms.deltafl import smoothing_warning
    scale = np.float32(np.log(10.0))
    floor = 8 * float(np.nextafter(scale, np.float32(np.inf)) - scale)      # 8 ulps, 1.9e-6
    assert smoothing_warning(0.0, 10) is None
    assert smoothing_warning(1.01 * floor, 10) is None
    line = smoothing_warning(0.99 * floor, 10)
    assert line is not None and "\n" not in line and "--smoothing" in line
    rng = np.random.default_rng(0)
    losses = (2.0 + 0.3 * rng.standard_normal(10)).astype(np.float32)
    n = rng.integers(20, 80, 10).astype(np.float64)
    want = exact_weights(losses.astype(np.float64), n, 0.35)

    weights_of = jax.jit(smoothed_tail_weights)   # one program, not one per operation

    def smoothed(nu):
        w = np.asarray(weights_of(losses, n.astype(np.float32), 0.35, nu), np.float64)
        return w / w.sum()
    assert np.abs(smoothed(1e-7) - want).max() > 0.05          # below the floor: lost
    assert np.abs(smoothed(1e-4) - want).max() < 1e-3          # well above it: the exact LP
    capsys.readouterr()
    build_experiment(tiny_config(smoothing=1e-7), tiny_synthetic)
    err = capsys.readouterr().err
    assert err.count("--smoothing=1e-07 is below") == 1, err
    build_experiment(tiny_config(smoothing=1e-4), tiny_synthetic)
    assert "--smoothing" not in capsys.readouterr().err


def test_mm_converges_to_the_weighted_quantile_as_k_grows():
    """Near the quantile x_j, mu - x_j shrinks by |2 tau - c_{j-1} - c_j| / alpha_j per step
    (c: normalised cumulative weights): fast when tau is inside x_j's jump, slow at its
    edges, so the error falls with K case by case and the last cases converge late."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(100, 20)).astype(np.float32)
    w = rng.integers(1, 60, size=(100, 20)).astype(np.float32)
    tau = rng.choice([0.1, 0.5, 0.7, 0.9], size=100).astype(np.float32)
    want = np.array([no.lower_quantile(*case) for case in zip(x, w, tau)])
    mm = jax.jit(jax.vmap(lambda x, w, t, k: mm_quantile(x, w, t, k)[0], (0, 0, 0, None)),
                 static_argnums=3)
    errors = {k: np.abs(np.asarray(mm(x, w, tau, k), np.float64) - want)
              for k in (1, 5, 20, 100, 1000)}
    medians = [np.median(e) for e in errors.values()]
    within = [np.mean(e < 1e-4) for e in errors.values()]
    assert medians[0] > medians[1] > medians[2] > medians[3] > 0.0, medians
    assert medians[3] < 1e-6 and within[3] > 0.85, (medians, within)
    assert within[4] >= 0.99 and errors[1000].max() < 1e-3, (within, errors[1000].max())


def warm_start(exp, data, rounds=2):
    """exp's initial state with every replica at w = FedAvg after `rounds` rounds (seed 1).

    At the zero initialisation every loss is log 10: in float64 they tie exactly, MM stops
    at once on eta = log 10 and no client passes the strict filter F_k > eta (w would never
    move), while in float32 summation noise lets some pass. Starting from distinct losses
    compares the algorithm rather than that noise."""
    avg = build_experiment(tiny_config(algorithm="fedavg", thetas=(), l2_reg=1e-3), data)
    state, _ = run(avg, rounds)
    size = exp.replicas.size
    params = jax.tree.map(lambda a: jnp.repeat(a[:1], size, axis=0), state.params)
    return exp.initial_state().replace(params=params), linear_rows(state.params, 0)


@pytest.mark.parametrize("weighting", ["weighted", "unweighted"])
@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_secagg_round_equals_numpy(tiny_synthetic, weighting):
    K = 6
    cfg = tiny_config(thetas=(0.8, 0.4), l2_reg=1e-3, quantile="secagg_mm", mm_iters=K,
                      weighting=weighting, clients_per_step=3)
    exp = build_experiment(cfg, tiny_synthetic)
    state, (W0, b0) = warm_start(exp, tiny_synthetic)
    keys, hist = exp.keys(), []
    for t in range(2, 6):
        state, metrics = exp.round_fn(state, exp.round_data(t), keys)
        hist.append(jax.device_get(metrics))
    xs, ys = client_lists(tiny_synthetic.train)
    for r, lab in enumerate(exp.replicas.labels):
        W, b = W0, b0
        for i, t in enumerate(range(2, 6)):
            def rule(F, n):
                alpha = n if weighting == "weighted" else np.ones_like(n)
                eta = no.mm_quantile(F, alpha, 1.0 - lab.theta, K)
                return np.where(F > eta, alpha, 0.0)
            W, b, F, a = no.weighted_round(W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate,
                                           cfg.l2_reg, cfg.batch_size, rule)
            assert int(hist[i]["num_selected"][r]) == int(np.sum(a > 0)), (r, t)
            assert int(hist[i]["secagg_calls"][r]) == K + 2
        close(state, r, W, b)


# ----------------------------------------------------------------------------- unweighted


@pytest.mark.slow
def test_unweighted_with_equal_sizes_equals_weighted(tiny_synthetic):
    data = equal_sized(tiny_synthetic, 50)
    for filter in ("exact", "reference"):
        kw = dict(thetas=(1.0, 0.6, 0.3), seeds=(1, 2), l2_reg=1e-3, filter=filter)
        sw, hw = run(build_experiment(tiny_config(**kw), data), 3)
        su, hu = run(build_experiment(tiny_config(weighting="unweighted", **kw), data), 3)
        for x, y in zip(jax.tree.leaves(sw.params), jax.tree.leaves(su.params)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-6)
        assert [list(h["num_selected"]) for h in hw] == [list(h["num_selected"]) for h in hu]


@pytest.mark.parametrize("filter", ["exact", "reference"])
def test_unweighted_round_equals_numpy(tiny_synthetic, filter):
    """The 2022 paper's Algorithm 1: the (1 - alpha)-quantile Q of the unweighted losses,
    pi_i = I(F_i >= Q) (reference) or the LP's tail weights with alpha_k = 1/N (exact), and
    w+ = sum pi_i w_i / sum pi_i."""
    cfg = tiny_config(thetas=(1.0, 0.5, 0.2), seeds=(1, 2), l2_reg=1e-3, filter=filter,
                      weighting="unweighted", algorithm="deltafl")
    exp = build_experiment(cfg, tiny_synthetic)
    state, _ = run(exp, 3)
    xs, ys = client_lists(tiny_synthetic.train)
    weights = exact_weights if filter == "exact" else reference_weights
    for r, lab in enumerate(exp.replicas.labels):
        W, b = np.zeros((60, 10)), np.zeros(10)
        for t in range(3):
            W, b, _, _ = no.weighted_round(
                W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate, cfg.l2_reg, cfg.batch_size,
                lambda F, n: weights(F, np.ones_like(n), lab.theta))
        close(state, r, W, b)


def test_unweighted_fedavg_is_the_uniform_average(tiny_synthetic):
    cfg = tiny_config(algorithm="fedavg", thetas=(), l2_reg=1e-3, weighting="unweighted")
    state, _ = run(build_experiment(cfg, tiny_synthetic), 3)
    xs, ys = client_lists(tiny_synthetic.train)
    W, b = np.zeros((60, 10)), np.zeros(10)
    for t in range(3):
        W, b, _, _ = no.weighted_round(W, b, xs, ys, 1, t, 6, cfg.learning_rate, cfg.l2_reg,
                                       cfg.batch_size, lambda F, n: np.ones_like(n))
    close(state, 0, W, b)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kw,flag", [
    (dict(smoothing=-0.1), "smoothing"), (dict(smoothing=float("nan")), "smoothing"),
    (dict(quantile="median"), "quantile"), (dict(mm_iters=0), "mm_iters"),
    (dict(weighting="uniform"), "weighting"),
    (dict(smoothing=0.1, quantile="secagg_mm"), "smoothing"),
    (dict(smoothing=0.1, filter="reference"), "filter"),
    (dict(quantile="secagg_mm", filter="reference"), "filter")])
def test_bad_round_options_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        tiny_config(**kw)


@pytest.mark.slow
def test_flags_reach_the_run_and_secagg_calls_are_a_rounds_column(tmp_path, capsys):
    from conftest import run_runner
    tiny = os.path.join(os.path.dirname(__file__), "tiny.flags")
    out = tmp_path / "secagg"
    code, err, _ = run_runner([f"--flagfile={tiny}", f"--output_dir={out}", "--thetas=0.5",
                               "--quantile=secagg_mm", "--mm_iters=7",
                               "--weighting=unweighted"], capsys)
    assert code == 0, err
    with open(out / "summary.json") as f:
        config = json.load(f)["config"]
    assert (config["options"]["quantile"], config["options"]["mm_iters"],
            config["options"]["weighting"]) == ("secagg_mm", 7, "unweighted")
    with np.load(out / "rounds.npz") as r:
        assert (r["secagg_calls"] == 9).all() and r["secagg_calls"].shape[0] == 6
    code, err, _ = run_runner([f"--flagfile={tiny}", f"--output_dir={tmp_path / 'smooth'}",
                               "--smoothing=0.05"], capsys)
    assert code == 0, err
    code, err, _ = run_runner([f"--flagfile={tiny}", f"--output_dir={tmp_path / 'bad'}",
                               "--smoothing=0.05", "--filter=reference"], capsys)
    assert code == 2 and "--filter" in err


# ----------------------------------------------------------------------------- declared in the specs


def test_each_option_is_declared_once_and_shared_by_the_specs_that_read_it():
    import dataclasses
    from deltafl_jax.algorithms import registry
    from deltafl_jax.algorithms.options import option_flags

    declared = {name: {flag.name: flag for flag in option_flags(registry.get(name).options_type)}
                for name in registry.names()}
    assert list(declared["deltafl"]) == ["filter", "weighting", "smoothing", "quantile",
                                         "mm_iters", "deltafl_participation", "fedau_cap"]
    assert list(declared["fedavg"]) == ["weighting"]
    assert list(declared["fedavg_sub"]) == ["filter"]
    assert list(declared["deltafl_alt"]) == ["filter", "weighting"]
    assert list(declared["fedprox"]) == list(declared["scaffold"]) == ["weighting"]
    assert declared["qffl"] == declared["term"] == declared["afl"] == {}
    # One declaration per flag, the one the registry hands to the command line.
    options = dict(registry.options())
    for name, opts in declared.items():
        for flag, option in opts.items():
            assert option == options[flag], (name, flag)
    # Its default is the options dataclass's default.
    for name in ("deltafl", "fedavg", "fedavg_sub", "deltafl_alt"):
        made = registry.get(name).options_type()
        for f in dataclasses.fields(made):
            assert getattr(made, f.name) == options[f.name].flag_default


def test_two_specs_declaring_one_flag_differently_is_a_type_error():
    import dataclasses
    from deltafl_jax.algorithms import registry
    from deltafl_jax.algorithms.deltafl import FILTER

    other = dataclasses.replace(FILTER, default="reference")

    @dataclasses.dataclass(frozen=True)
    class Clash:
        filter: str = other.field()

    spec = dataclasses.replace(registry.get("fedavg_sub"), name="clash", options_type=Clash)
    with pytest.raises(TypeError, match="--filter is declared differently by deltafl's options "
                                        "and by clash's options .flag_default 'exact' against "
                                        "'reference'"):
        registry.collect_options(list(registry.SPECS.values()) + [spec])
    same = dataclasses.replace(registry.get("fedavg_sub"), name="same")
    assert registry.collect_options(list(registry.SPECS.values()) + [same]) == \
        registry.options()

    @dataclasses.dataclass(frozen=True)
    class Plain:
        filter: str = "exact"            # not a declared setting

    with pytest.raises(TypeError, match=r"Plain.filter must be made by declared.setting\(\)"):
        dataclasses.replace(registry.get("fedavg_sub"), name="plain", options_type=Plain)


def test_an_option_no_spec_declares_is_one_line_and_other_specs_options_are_ignored():
    from deltafl_jax import ExperimentConfig
    with pytest.raises(ConfigError, match="unknown option.*colour"):
        ExperimentConfig(data=tiny_config().data, options={"colour": "red"}, output_dir="x")
    with pytest.raises(ConfigError, match="unknown --filter='soft'"):
        tiny_config(filter="soft")
    # FedProx declares no option: Delta-FL's are accepted (a shared flagfile) and not read.
    cfg = tiny_config(algorithm="fedprox", thetas=(), smoothing=0.1, filter="reference")
    assert cfg.options == {"smoothing": 0.1, "filter": "reference"}


def test_the_resume_fingerprint_names_a_changed_option_by_its_flag(tiny_synthetic):
    from deltafl_jax.run.resume import fingerprint, fingerprint_diff

    plain = fingerprint(tiny_config(), tiny_synthetic)
    assert plain["filter"] == "exact" and "options" not in plain
    assert fingerprint_diff(plain, fingerprint(tiny_config(filter="exact"), tiny_synthetic)) == []
    changed = fingerprint(tiny_config(filter="reference", mm_iters=5), tiny_synthetic)
    assert fingerprint_diff(plain, changed) == ["filter", "mm_iters"]
    # Only the run's algorithm's options count: FedAvg reads --weighting alone.
    fedavg = dict(algorithm="fedavg", thetas=())
    assert fingerprint_diff(fingerprint(tiny_config(**fedavg), tiny_synthetic),
                            fingerprint(tiny_config(filter="reference", **fedavg),
                                        tiny_synthetic)) == []
