"""The baselines (FedAvg-Sub, FedProx, q-FFL, AFL, Tilted-ERM) against independent NumPy loops
(numpy_baselines.py), their limit cases, sweeps, outputs and the multi-method runner."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_baselines as nb
from conftest import client_lists, linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import build_experiment, load_model, run_experiment
from deltafl_jax.algorithms.afl import project_simplex
from deltafl_jax.algorithms.fedavg_sub import random_subset
from experiments import run as runner

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(HERE)
ATOL, RTOL = 2e-5, 1e-4


def zeros():
    return np.zeros((60, 10)), np.zeros(10)


def assert_close(state_params, r, W, b, atol=ATOL, rtol=RTOL):
    got_W, got_b = linear_rows(state_params, r)
    np.testing.assert_allclose(got_W, W, atol=atol, rtol=rtol)
    np.testing.assert_allclose(got_b, b, atol=atol, rtol=rtol)


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- FedAvg-Sub


def test_random_subset_has_the_count_and_is_uniform():
    keys = jax.random.split(jax.random.key(0), 3000)
    sel = np.asarray(jax.vmap(lambda k: random_subset(k, 6, 2))(keys))
    assert (sel.sum(1) == 2).all()
    freq = sel.mean(0)  # each slot is in the subset with probability 2/6
    assert np.all(np.abs(freq - 1 / 3) < 0.04), freq
    pairs = {tuple(np.flatnonzero(s)) for s in sel}
    assert len(pairs) == 15  # every 2-subset of 6 occurs


@pytest.mark.parametrize("mode,filter", [("theta", "exact"), ("theta", "reference"),
                                         ("count", "exact")])
def test_fedavg_sub_equals_numpy(tiny_synthetic, mode, filter):
    kw = (dict(thetas=(0.7, 0.3)) if mode == "theta" else dict(fedavg_sub_clients=(2, 5)))
    cfg = tiny_config(algorithm="fedavg_sub", seeds=(1, 2), l2_reg=1e-3, clients_per_step=3,
                      filter=filter, **kw)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, 3)
    xs, ys = client_lists(tiny_synthetic.train)
    kept = set()
    for r, lab in enumerate(exp.replicas.labels):
        W, b = zeros()
        for t in range(3):
            if mode == "theta":
                W, b, k = nb.fedavg_sub_round(W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate,
                                              cfg.l2_reg, cfg.batch_size, theta=lab.theta,
                                              filter=filter)
            else:
                W, b, k = nb.fedavg_sub_round(W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate,
                                              cfg.l2_reg, cfg.batch_size,
                                              count=int(lab.param_value))
            assert int(hist[t]["num_selected"][r]) == k
            kept.add(k)
        assert_close(state.params, r, W, b)
    # Subsets of several sizes (at the zero initialisation all losses tie, and Delta-FL keeps
    # everyone in round 0).
    assert len(kept) > 1 and min(kept) < 6


# ----------------------------------------------------------------------------- FedProx


def test_fedprox_equals_numpy(tiny_synthetic):
    cfg = tiny_config(algorithm="fedprox", fedprox_mu=(0.5, 3.0), seeds=(1, 2), l2_reg=1e-3,
                      local_epochs=2, clients_per_step=4)
    exp = build_experiment(cfg, tiny_synthetic)
    state, _ = run_rounds_history(exp, 3)
    xs, ys = client_lists(tiny_synthetic.train)
    for r, lab in enumerate(exp.replicas.labels):
        W, b = zeros()
        W0, b0 = zeros()
        for t in range(3):
            W, b = nb.fedprox_round(W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate,
                                    cfg.l2_reg, lab.param_value, cfg.batch_size, epochs=2)
            W0, b0 = nb.fedprox_round(W0, b0, xs, ys, lab.seed, t, 6, cfg.learning_rate,
                                      cfg.l2_reg, 0.0, cfg.batch_size, epochs=2)
        assert_close(state.params, r, W, b)
        assert np.max(np.abs(W - W0)) > 100 * ATOL  # the proximal term mattered


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_fedprox_mu_zero_is_fedavg_bit_for_bit(tiny_synthetic):
    for lanes in (1, 3):
        prox = build_experiment(tiny_config(algorithm="fedprox", fedprox_mu=(0.0,), thetas=(),
                                            seeds=(1, 2), clients_per_step=lanes),
                                tiny_synthetic)
        avg = build_experiment(tiny_config(algorithm="fedavg", thetas=(), seeds=(1, 2),
                                           clients_per_step=lanes), tiny_synthetic)
        sp, _ = run_rounds_history(prox, 3)
        sa, _ = run_rounds_history(avg, 3)
        assert leaves_equal(sp.params, sa.params), lanes


@pytest.mark.parametrize("weighting,lanes", [("weighted", 1), ("unweighted", 3)])
def test_fedavg_skips_the_evaluation_and_equals_deltafl_theta_one(tiny_synthetic, weighting,
                                                                   lanes):
    """FedAvg does not evaluate the sampled clients at w_t (its weights do not depend on the losses), and its models are
    Delta-FL's at theta = 1 bit for bit (all losses finite here)."""
    avg = build_experiment(tiny_config(algorithm="fedavg", thetas=(), seeds=(1, 2),
                                       clients_per_step=lanes, weighting=weighting),
                           tiny_synthetic)
    dfl = build_experiment(tiny_config(algorithm="deltafl", thetas=(1.0,), seeds=(1, 2),
                                       clients_per_step=lanes, weighting=weighting),
                           tiny_synthetic)
    sa, ha = run_rounds_history(avg, 3)
    sd, hd = run_rounds_history(dfl, 3)
    assert leaves_equal(sa.params, sd.params)
    for ma, md in zip(ha, hd):
        assert int(ma["eval_real_examples"]) == 0 and int(ma["eval_trips"]) == 0
        assert int(md["eval_real_examples"]) > 0
        assert "sampled_loss_mean" not in ma and "eta" not in ma
        np.testing.assert_array_equal(ma["num_selected"], md["num_selected"])
        np.testing.assert_array_equal(ma["train_real_examples"], md["train_real_examples"])


# ----------------------------------------------------------------------------- q-FFL


def test_qffl_equals_numpy(tiny_synthetic):
    qs = (0.1, 1.0, 10.0)
    cfg = tiny_config(algorithm="qffl", qffl_q=qs, seeds=(1, 2), l2_reg=1e-3,
                      clients_per_step=4, learning_rate=0.1)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, 3)
    xs, ys = client_lists(tiny_synthetic.train)
    finals = {}
    for r, lab in enumerate(exp.replicas.labels):
        W, b = zeros()
        for t in range(3):
            W, b, _ = nb.qffl_round(W, b, xs, ys, lab.seed, t, 6, cfg.learning_rate,
                                    cfg.l2_reg, lab.param_value, cfg.batch_size)
        assert_close(state.params, r, W, b)
        finals[(lab.param_value, lab.seed)] = W
    # q changes the model: the larger q, the smaller the server step.
    assert np.max(np.abs(finals[(10.0, 1)] - finals[(0.1, 1)])) > 100 * ATOL
    step = {lab.param_value: hist[-1]["qffl_step"][r]
            for r, lab in enumerate(exp.replicas.labels) if lab.seed == 1}
    assert step[10.0] < step[1.0] < step[0.1] < 1.0


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_qffl_q_zero_is_the_n_weighted_average_of_local_models(tiny_synthetic):
    """q = 0: F^0 = 1 and h_k = L, so w - sum n_k L (w - w_k) / sum n_k L = sum n_k w_k /
    sum n_k, the FedAvg model (closed form checked on the local models, then against the
    engine's FedAvg)."""
    cfg = tiny_config(algorithm="qffl", qffl_q=(0.0,), seeds=(1,), clients_per_step=2)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, 2)
    xs, ys = client_lists(tiny_synthetic.train)
    W, b = zeros()
    for t in range(2):
        W_q, b_q, models = nb.qffl_round(W, b, xs, ys, 1, t, 6, cfg.learning_rate, 0.0, 0.0,
                                         cfg.batch_size)
        n = np.array([m[0] for m in models])
        W = sum(nk * Wk for nk, Wk, _ in models) / n.sum()
        b = sum(nk * bk for nk, _, bk in models) / n.sum()
        np.testing.assert_allclose(W_q, W, atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(b_q, b, atol=1e-12, rtol=1e-9)
        assert hist[t]["qffl_step"][0] == pytest.approx(1.0, abs=1e-6)
    assert_close(state.params, 0, W, b)
    avg = build_experiment(tiny_config(algorithm="fedavg", thetas=(), seeds=(1,),
                                       clients_per_step=2), tiny_synthetic)
    sa, _ = run_rounds_history(avg, 2)
    assert max_abs_diff(state.params, sa.params) < 1e-6


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_q_sweep_equals_separate_runs(tiny_synthetic):
    qs, seeds = (0.001, 0.1, 1.0, 10.0), (1, 2)
    joint = build_experiment(tiny_config(algorithm="qffl", qffl_q=qs, seeds=seeds,
                                         clients_per_step=1), tiny_synthetic)
    sj, _ = run_rounds_history(joint, 3)
    assert len(joint.replicas.labels) == 8
    for q in (0.001, 10.0):
        single = build_experiment(tiny_config(algorithm="qffl", qffl_q=(q,), seeds=seeds,
                                              clients_per_step=1), tiny_synthetic)
        ss, _ = run_rounds_history(single, 3)
        for s, seed in enumerate(seeds):
            r = [i for i, lab in enumerate(joint.replicas.labels)
                 if lab.param_value == q and lab.seed == seed]
            assert len(r) == 1
            for x, y in zip(jax.tree.leaves(sj.params), jax.tree.leaves(ss.params)):
                np.testing.assert_allclose(np.asarray(x)[r[0]], np.asarray(y)[s], atol=1e-6)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_afl_qffl_is_qffl_at_q_ten_bit_for_bit(tiny_synthetic):
    """afl_qffl is the papers' stand-in for AFL: q-FFL at q = 10, whatever --qffl_q says."""
    proxy = build_experiment(tiny_config(algorithm="afl_qffl", thetas=(), seeds=(1, 2),
                                         qffl_q=(0.5,), clients_per_step=2), tiny_synthetic)
    q10 = build_experiment(tiny_config(algorithm="qffl", qffl_q=(10.0,), thetas=(), seeds=(1, 2),
                                       clients_per_step=2), tiny_synthetic)
    assert [lab.param_value for lab in proxy.replicas.labels] == [10.0, 10.0]
    sp, hp = run_rounds_history(proxy, 3)
    sq, hq = run_rounds_history(q10, 3)
    assert leaves_equal(sp.params, sq.params)
    assert max_abs_diff(sp.params, jax.tree.map(jnp.zeros_like, sp.params)) > 0  # it moved
    for mp, mq in zip(hp, hq):
        np.testing.assert_array_equal(mp["qffl_step"], mq["qffl_step"])


# ----------------------------------------------------------------------------- AFL


def test_project_simplex_against_bisection():
    project = jax.jit(project_simplex)   # one program per length, not one per operation
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 50):
        for scale in (0.01, 1.0, 10.0):
            v = rng.normal(size=n) * scale
            got = np.asarray(project(jnp.asarray(v, jnp.float32)), np.float64)
            want = nb.project_simplex_bisection(v)
            np.testing.assert_allclose(got, want, atol=2e-6)
    # by hand: (0.5, 0.5) is on the simplex; (2, 0) projects to (1, 0); (1, 1, 1) to thirds.
    np.testing.assert_allclose(project(jnp.array([0.5, 0.5])), [0.5, 0.5])
    np.testing.assert_allclose(project(jnp.array([2.0, 0.0])), [1.0, 0.0])
    np.testing.assert_allclose(project(jnp.array([1.0, 1.0, 1.0])), [1 / 3] * 3,
                               rtol=1e-6)


def test_afl_equals_numpy(tiny_synthetic):
    cfg = tiny_config(algorithm="afl", afl_lambda_lr=(0.02, 0.2), seeds=(1, 2), l2_reg=1e-3,
                      clients_per_step=4, learning_rate=0.2)
    exp = build_experiment(cfg, tiny_synthetic)
    N = tiny_synthetic.train.num_clients
    assert exp.num_sampled == N and exp.run.work.local_steps == 1
    state, hist = run_rounds_history(exp, 4)
    served = exp.served_params(state)
    xs, ys = client_lists(tiny_synthetic.train)
    n = tiny_synthetic.train.sizes.astype(np.float64)
    lam_state = np.asarray(state.algo_state.lam, np.float64)
    for r, lab in enumerate(exp.replicas.labels):
        W, b = zeros()
        lam = n / n.sum()
        iterates = []
        for t in range(4):
            W, b, lam = nb.afl_round(W, b, lam, xs, ys, lab.seed, t, cfg.learning_rate,
                                     cfg.l2_reg, lab.param_value, cfg.batch_size)
            iterates.append((W, b))
        assert_close(state.params, r, W, b)
        np.testing.assert_allclose(lam_state[r], lam, atol=1e-5)
        W_bar = np.mean([w for w, _ in iterates], axis=0)
        b_bar = np.mean([v for _, v in iterates], axis=0)
        assert_close(served, r, W_bar, b_bar)           # the averaged iterate is served
        assert np.max(np.abs(W_bar - W)) > 100 * ATOL   # and differs from w_T
        if lab.param_value == 0.2:
            assert lam.max() > 2 * (n / n.sum()).max()  # lambda moved to the worst clients


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_afl_with_lambda_fixed_at_alpha_is_fedavg_on_one_step_updates(tiny_synthetic):
    N = tiny_synthetic.train.num_clients
    afl = build_experiment(tiny_config(algorithm="afl", afl_lambda_lr=(0.0,), seeds=(1, 2),
                                       clients_per_step=3), tiny_synthetic)
    fedavg = build_experiment(tiny_config(algorithm="fedavg", thetas=(), seeds=(1, 2),
                                          clients_per_round=N, local_steps=1,
                                          clients_per_step=3), tiny_synthetic)
    state_a, keys_a = afl.initial_state(), afl.keys()
    state_f, keys_f = fedavg.initial_state(), fedavg.keys()
    sums = None
    for t in range(4):
        state_a, _ = afl.round_fn(state_a, afl.round_data(t), keys_a)
        state_f, _ = fedavg.round_fn(state_f, fedavg.round_data(t), keys_f)
        assert max_abs_diff(state_a.params, state_f.params) < 1e-6
        host = jax.device_get(state_f.params)
        sums = host if sums is None else jax.tree.map(np.add, sums, host)
    alpha = tiny_synthetic.train.sizes / tiny_synthetic.train.sizes.sum()
    np.testing.assert_allclose(np.asarray(state_a.algo_state.lam)[0], alpha, rtol=1e-6)
    average = jax.tree.map(lambda s: s / 4.0, sums)
    assert max_abs_diff(afl.served_params(state_a), average) < 1e-6


# ----------------------------------------------------------------------------- Tilted-ERM


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_term_equals_numpy(tiny_synthetic):
    tilts = (0.5, 5.0, -2.0)
    cfg = tiny_config(algorithm="term", term_t=tilts, seeds=(1, 2), l2_reg=1e-3,
                      clients_per_step=4, learning_rate=0.1)
    exp = build_experiment(cfg, tiny_synthetic)
    state, hist = run_rounds_history(exp, 4)
    xs, ys = client_lists(tiny_synthetic.train)
    for r, lab in enumerate(exp.replicas.labels):
        W, b = zeros()
        E = None
        for t in range(4):
            W, b, E = nb.term_round(W, b, E, t == 0, xs, ys, lab.seed, t, 6,
                                    cfg.learning_rate, cfg.l2_reg, lab.param_value,
                                    cfg.batch_size)
            assert hist[t]["term_estimate"][r] == pytest.approx(E, rel=1e-4)
        assert_close(state.params, r, W, b)
    assert 0 < min(h["term_estimate"].min() for h in hist) < 0.9  # the tilt did something


def test_term_approaches_fedavg_as_t_goes_to_zero(tiny_synthetic):
    avg = build_experiment(tiny_config(algorithm="fedavg", thetas=(), seeds=(1,),
                                       clients_per_step=2, learning_rate=0.1), tiny_synthetic)
    sa, _ = run_rounds_history(avg, 3)
    tilts = (0.0, 1e-3, 1e-2, 1e-1, 1.0)
    exp = build_experiment(tiny_config(algorithm="term", term_t=tilts, seeds=(1,),
                                       clients_per_step=2, learning_rate=0.1), tiny_synthetic)
    st, _ = run_rounds_history(exp, 3)
    gap = {}
    for r, lab in enumerate(exp.replicas.labels):
        one = jax.tree.map(lambda a: np.asarray(a)[r:r + 1], st.params)
        gap[lab.param_value] = max_abs_diff(one, sa.params)
    assert gap[0.0] < 1e-6
    # The gap shrinks like t: each tenfold decrease of t divides it by at least 5, and the
    # weights e_k / E = 1 + t (F_k - mean F) + O(t^2) move the model by at most ~t of its size.
    assert gap[1e-3] < gap[1e-2] / 5 < gap[1e-1] / 25 < gap[1.0] / 125
    size = max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(sa.params))
    for t in (1e-3, 1e-2, 1e-1):
        assert gap[t] < 2 * t * size, (t, gap[t], size)


# ----------------------------------------------------------------------------- outputs


def test_outputs_are_keyed_by_the_swept_value(tiny_synthetic, tmp_path):
    out = str(tmp_path / "qffl")
    cfg = tiny_config(algorithm="qffl", qffl_q=(0.1, 1.0), seeds=(1, 2), output_dir=out,
                      save_models=True, eval_every=2, num_rounds=2)
    result = run_experiment(cfg, tiny_synthetic)
    summary = result.summary
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert {(r["param_name"], r["param_value"], r["seed"]) for r in records} == {
        ("qffl_q", q, s) for q in (0.1, 1.0) for s in (1, 2)}
    assert set(result.final) == {f"qffl_q={q}_seed={s}" for q in ("0.1", "1")
                                 for s in (1, 2)}
    served = load_model(out, qffl_q=1.0, seed=2)
    r = [lab for lab in summary["replicas"]].index(
        {"algorithm": "qffl", "theta": 1.0, "param_name": "qffl_q", "param_value": 1.0,
         "seed": 2})
    assert leaves_equal(served.params, jax.tree.map(lambda a: np.asarray(a)[r],
                                                    result.state.params))
    with pytest.raises(ValueError, match="several models match"):
        load_model(out, seed=2)


def test_afl_saves_and_evaluates_the_averaged_iterate(tiny_synthetic, tmp_path):
    out = str(tmp_path / "afl")
    cfg = tiny_config(algorithm="afl", afl_lambda_lr=(0.1,), seeds=(1,), output_dir=out,
                      save_models=True, eval_every=3, num_rounds=3, learning_rate=0.2)
    result = run_experiment(cfg, tiny_synthetic)
    state = result.state
    served = load_model(out, afl_lambda_lr=0.1, seed=1)
    avg = jax.tree.map(lambda a: np.asarray(a)[0], state.algo_state.avg)
    assert leaves_equal(served.params, avg)
    assert max_abs_diff(served.params, jax.tree.map(lambda a: np.asarray(a)[0],
                                                    state.params)) > 1e-4
    clients = np.load(os.path.join(out, "clients.npz"))
    x, y = tiny_synthetic.test.client(0)
    pred = np.asarray(served.predict(x)).argmax(1)
    assert clients["test_error"][0][0] == pytest.approx(np.mean(pred != y))
    assert result.summary["clients_per_round"] == tiny_synthetic.train.num_clients


# ----------------------------------------------------------------------------- runner


cli = run_runner  # (exit code, stderr, stdout)


# The Shakespeare flagfile on a tiny synthetic dataset (its client limits stay in force).
TINY_SYNTHETIC = ["--dataset=synthetic", "--synthetic_num_clients=20",
                  "--synthetic_max_examples=120", "--synthetic_shared=0.8", "--model=linear",
                  "--num_rounds=2", "--eval_every=1", "--clients_per_round=4", "--seeds=1,2",
                  "--batch_size=16", "--learning_rate=0.05"]


@pytest.mark.slow
def test_compare_flagfile_runs_every_method_into_its_own_directory(tmp_path, capsys):
    flagfile = os.path.join(REPO, "experiments", "compare_shakespeare_cpu.flags")
    out = tmp_path / "compare"
    code, err, stdout = cli([f"--flagfile={flagfile}", *TINY_SYNTHETIC, "--qffl_q=0,10",
                             f"--output_dir={out}"], capsys)
    assert code == 0, err
    methods = ["deltafl", "fedavg", "fedavg_sub", "fedprox", "qffl", "afl_qffl", "afl", "term"]
    assert sorted(os.listdir(out)) == sorted(methods)
    for name in methods:
        summary = json.load(open(out / name / "summary.json"))
        assert summary["config"]["algorithm"] == name
        assert {lab["algorithm"] for lab in summary["replicas"]} == {name}
        records = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
        assert len(records) == 2 * len(summary["replicas"])
        assert all(0 <= r["test_error_p90"] <= 1 for r in records)
    qffl = json.load(open(out / "qffl" / "summary.json"))
    assert set(qffl["final"]) == {"qffl_q=0_seed=1", "qffl_q=0_seed=2", "qffl_q=10_seed=1",
                                  "qffl_q=10_seed=2"}
    assert json.load(open(out / "afl" / "summary.json"))["clients_per_round"] == 10
    # q-FFL at q = 0 is FedAvg (same seeds, sampling and minibatches): same test errors.
    fedavg = json.load(open(out / "fedavg" / "summary.json"))
    for s in (1, 2):
        assert qffl["final"][f"qffl_q=0_seed={s}"]["test_error_mean"] == pytest.approx(
            fedavg["final"][f"theta=1_seed={s}"]["test_error_mean"], abs=1e-9)
    assert "Final test error per method" in stdout
    table = stdout.split("Final test error per method")[1]
    for name in methods:
        assert f"\n{name} " in table
    load_model(str(out / "term"), term_t=1.0, seed=1)  # a swept value of the flagfile


def test_compare_synthetic_flagfile_lists_every_method(capsys):
    flagfile = os.path.join(REPO, "experiments", "compare_synthetic.flags")
    runner.FLAGS.unparse_flags()
    runner.parse_flags_or_fail(["run", f"--flagfile={flagfile}"])
    configs = runner.configs_from_flags()
    names = [c.algorithm for c in configs]
    assert set(names) >= {"deltafl", "fedavg", "fedavg_sub", "fedprox", "qffl", "afl_qffl",
                          "afl", "term"}
    for c in configs:
        assert c.output_dir.endswith(os.path.join("compare_synthetic", c.algorithm))
        assert c.data.dataset == "synthetic"


BAD = {
    "unknown method in a list": (["--algorithm=deltafl,sgd"], "unknown algorithm 'sgd'"),
    "method twice": (["--algorithm=qffl,fedavg,qffl"], "--algorithm lists a method twice"),
    "negative mu": (["--algorithm=fedprox", "--fedprox_mu=0.1,-0.5"],
                    "--fedprox_mu must be >= 0, got -0.5"),
    "negative q": (["--algorithm=qffl", "--qffl_q=-1"], "--qffl_q must be >= 0, got -1.0"),
    "q not a number": (["--algorithm=qffl", "--qffl_q=one"],
                       "--qffl_q must be a comma-separated list of numbers"),
    "q twice": (["--algorithm=qffl", "--qffl_q=1,1"], "--qffl_q lists a value twice"),
    "t NaN": (["--algorithm=term", "--term_t=nan"], "--term_t must be finite numbers"),
    "negative lambda lr": (["--algorithm=afl", "--afl_lambda_lr=-0.1"],
                           "--afl_lambda_lr must be >= 0"),
    "sub count above m": (["--algorithm=fedavg_sub", "--fedavg_sub_clients=5"],
                          "--fedavg_sub_clients must be integers in [1, "
                          "--clients_per_round=4]"),
    "sub count zero": (["--algorithm=fedavg_sub", "--fedavg_sub_clients=0"],
                       "--fedavg_sub_clients must be integers"),
    # A bad value of a later method stops the run before the first one starts.
    "bad value of a later method": (["--algorithm=deltafl,fedprox", "--fedprox_mu=-1"],
                                    "--fedprox_mu must be >= 0"),
}


def test_bad_baseline_inputs_exit_2_with_one_line_and_no_output(tmp_path, capsys):
    for name, (args, message) in BAD.items():
        out = tmp_path / ("out_" + name.replace(" ", "_"))
        code, err, _ = cli([f"--flagfile={os.path.join(HERE, 'tiny.flags')}",
                            "--clients_per_round=4", f"--output_dir={out}"] + args, capsys)
        assert code == 2, (name, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], (name, err)
        assert not out.exists(), name
