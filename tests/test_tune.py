"""The tuning protocol (App. C.2.2): each grid trained as one vmapped program equals separate
runs of the runner's own configurations; lambda is scored on held-out training clients; the CLI
picks the argmin recomputed here with NumPy and writes a flagfile that experiments.run accepts;
bad input exits with code 2 and one line."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import run_command, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.studies import tuning
from experiments import tune

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "tiny.flags")
REPO = os.path.dirname(HERE)


def run_with_rates(exp, num_rounds):
    state, keys = exp.initial_state(), exp.keys()
    rates = []
    for t in range(num_rounds):
        state, metrics = exp.round_fn(state, exp.round_data(t), keys)
        rates.append(np.asarray(metrics["learning_rate"]))
    return state, np.stack(rates)


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]


@pytest.mark.slow
def test_lr_grid_in_one_program_equals_separate_runs(tiny_synthetic):
    base = tiny_config(algorithm="fedavg", thetas=(), seeds=(1, 2), num_rounds=4,
                       lr_decay_every=2, clients_per_step=1)
    lrs, decays = (0.02, 0.1), (1.0, 4.0)
    replicas = tuning.lr_grid_replicas(base, lrs, decays)
    assert replicas.size == 2 * 2 * 2
    joint, joint_rates = run_with_rates(build_experiment(base, tiny_synthetic, replicas), 4)
    finals = {}
    for lr in lrs:
        for c in decays:
            rs = [r for r, lab in enumerate(replicas.labels)
                  if dict(lab.extra) == {"learning_rate": lr, "lr_decay": c}]
            assert [replicas.labels[r].seed for r in rs] == [1, 2]
            # The runner's own configuration for this grid value (both seeds).
            single, rates = run_with_rates(build_experiment(
                dataclasses.replace(base, learning_rate=lr, lr_decay=c), tiny_synthetic), 4)
            for x, y in zip(leaves(joint), leaves(single)):
                np.testing.assert_allclose(x[rs], y, atol=1e-6)
            want = np.array([[lr / c ** (t // 2)] * 2 for t in range(4)])
            np.testing.assert_allclose(joint_rates[:, rs], want, rtol=1e-6)
            np.testing.assert_allclose(rates, want, rtol=1e-6)
            finals[(lr, c)] = leaves(single)[0]
    assert not np.allclose(finals[(0.1, 1.0)], finals[(0.1, 4.0)], atol=1e-4)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_grids_train_with_the_runs_server_optimizer(tiny_synthetic):
    """The grids' replicas take the run's server step: FedAdam's lr grid at --server_lr=0.02
    equals the runner's FedAdam at each learning rate."""
    base = tiny_config(algorithm="fedavg", thetas=(), seeds=(1,), num_rounds=2,
                       server_optimizer="adam", server_lr=(0.02,), clients_per_step=1)
    replicas = tuning.lr_grid_replicas(base, (0.02, 0.1), (1.0,))
    np.testing.assert_allclose(replicas.server_lr, 0.02)
    joint, _ = run_with_rates(build_experiment(base, tiny_synthetic, replicas), 2)
    single, _ = run_with_rates(build_experiment(dataclasses.replace(base, learning_rate=0.1),
                                            tiny_synthetic), 2)
    for x, y in zip(leaves(joint), leaves(single)):
        np.testing.assert_allclose(x[1:], y, atol=1e-6)
    l2 = tuning.l2_grid_replicas(base, (1.0, 0.5), (1e-3,))
    np.testing.assert_allclose(l2.server_lr, 0.02)


def test_validation_split_holds_out_half_the_training_clients(tiny_synthetic):
    val = tuning.validation_split(tiny_synthetic, seed=0)
    train_ids, val_ids = list(val.train.client_ids), list(val.test.client_ids)
    original = list(tiny_synthetic.train.client_ids)
    assert len(train_ids) == len(val_ids) == len(original) // 2
    assert set(train_ids).isdisjoint(val_ids) and set(train_ids) | set(val_ids) == set(original)
    for k, cid in enumerate(val_ids):
        x_val, y_val = val.test.client(k)
        x_orig, y_orig = tiny_synthetic.train.client(original.index(cid))
        np.testing.assert_array_equal(x_val, x_orig)
        np.testing.assert_array_equal(y_val, y_orig)
    other = tuning.validation_split(tiny_synthetic, seed=1)
    assert set(other.test.client_ids) != set(val_ids)


def numpy_linear_errors(params, split):
    """Per-client misclassification rate of a softmax-linear model, in NumPy."""
    W = np.asarray(params["Dense_0"]["kernel"], np.float64)
    b = np.asarray(params["Dense_0"]["bias"], np.float64)
    errs = []
    for k in range(split.num_clients):
        x, y = split.client(k)
        errs.append(np.mean((x.astype(np.float64) @ W + b).argmax(1) != y))
    return np.array(errs)


def lower_p90_unweighted(values):
    v = np.sort(values)
    return v[-(-len(v) * 9 // 10) - 1]


@pytest.mark.slow
def test_l2_grid_in_one_program_equals_separate_runs_and_scores_validation_clients(
        tiny_synthetic):
    base = tiny_config(thetas=(1.0, 0.5), seeds=(1, 2), num_rounds=3, clients_per_step=1)
    val = tuning.validation_split(tiny_synthetic, seed=0)
    l2s = (1e-1, 1e-4)
    replicas = tuning.l2_grid_replicas(base, (1.0, 0.5), l2s)
    joint, _ = run_with_rates(build_experiment(base, val, replicas), 3)
    for lam in l2s:
        single, _ = run_with_rates(build_experiment(dataclasses.replace(base, l2_reg=lam), val), 3)
        # The runner's replicas: theta 1.0 seeds 1, 2, then theta 0.5 seeds 1, 2.
        for i, (theta, seed) in enumerate([(1.0, 1), (1.0, 2), (0.5, 1), (0.5, 2)]):
            (r,) = [r for r, lab in enumerate(replicas.labels)
                    if (lab.theta, dict(lab.extra)["l2_reg"], lab.seed) == (theta, lam, seed)]
            for x, y in zip(leaves(joint), leaves(single)):
                np.testing.assert_allclose(x[r], y[i], atol=1e-6)

    # The tuner's scores are the p90 of the error on the validation clients.
    summary = tuning.run_grid(base, val, replicas)
    got = tuning.scores(replicas, summary.final, "test_error_p90")
    params = jax.device_get(summary.state.params)
    assert len(got) == 4
    for s in got:
        want = []
        for seed in (1, 2):
            (r,) = [r for r, lab in enumerate(replicas.labels)
                    if (lab.theta, dict(lab.extra)["l2_reg"], lab.seed) ==
                    (s.point["theta"], s.point["l2_reg"], seed)]
            one = jax.tree.map(lambda a: a[r], params)
            want.append(lower_p90_unweighted(numpy_linear_errors(one, val.test)))
        np.testing.assert_allclose(s.values, want, atol=1e-6)


def test_best_skips_diverged_values_and_breaks_ties_by_grid_order():
    mk = lambda lr, vals: tuning.Score(point={"learning_rate": lr}, seeds=[1, 2], values=vals)
    grid = [mk(0.1, [0.5, float("nan")]), mk(0.2, [0.3, 0.5]), mk(0.3, [0.5, 0.3]),
            mk(0.4, [0.6, 0.6])]
    assert tuning.best(grid).point["learning_rate"] == 0.2
    assert tuning.best([mk(0.1, [float("inf"), 1.0])]) is None


def cli(argv, capsys):
    """experiments.tune in-process (conftest.run_command): (exit code, stderr, stdout)."""
    return run_command(tune, argv, capsys)


def grid_means(run_dir, score):
    """Grid key without the seed -> mean over seeds of score(replica index, arrays)."""
    z = np.load(os.path.join(run_dir, "clients.npz"))
    by_point = {}
    for r, key in enumerate(z["replica_keys"]):
        point = str(key).rsplit("_seed=", 1)[0]
        by_point.setdefault(point, []).append(score(r, z))
    return {k: float(np.mean(v)) for k, v in by_point.items()}


def test_what_each_step_tunes_is_the_specs_decision():
    """Step 2 tunes lambda of the specs whose replicas are Delta-FL at their theta (per theta
    of the run, FedAvg at 1); step 3 tunes a swept value marked tuned (a baseline's q, mu, t,
    ...), never Delta-FL's theta."""
    delta = tiny_config(thetas=(1.0, 0.5))
    assert tuning.l2_thetas(delta, True) == (1.0, 0.5)
    assert tuning.l2_thetas(delta, False) == (1.0,)
    assert tuning.l2_thetas(tiny_config(thetas=()), True) == (1.0, 0.8, 0.5, 0.1)
    fedavg = tiny_config(algorithm="fedavg", thetas=())
    qffl = tiny_config(algorithm="qffl", thetas=(), qffl_q=(0.1, 1.0))
    assert tuning.tunes_l2(delta) and tuning.tunes_l2(fedavg) and not tuning.tunes_l2(qffl)
    assert tuning.l2_thetas(fedavg, True) == (1.0,) and tuning.l2_thetas(qffl, True) == (1.0,)
    for config in (delta, fedavg, tiny_config(algorithm="deltafl_alt", eta_every=(1, 2))):
        assert tuning.param_sweep(config) is None, config.algorithm
    spec, sweep, values = tuning.param_sweep(qffl)
    assert (spec.name, sweep.flag, values) == ("qffl", "qffl_q", (0.1, 1.0))
    assert tuning.param_sweep(tiny_config(algorithm="qffl", thetas=(), qffl_q=(1.0,))) is None
    spec, sweep, values = tuning.param_sweep(tiny_config(algorithm="fedavg_sub",
                                                         thetas=(1.0, 0.5, 0.2)))
    assert (sweep.flag, values) == ("thetas", (0.5, 0.2))      # FedAvg-Sub's count levels
    with pytest.raises(tuning.TuningError, match="--tune_l2 tunes the runs of deltafl, fedavg"):
        tuning.check(qffl, None, (), (), (1e-3,), tune_lr=False, tune_l2=True)


@pytest.mark.slow
def test_cli_picks_the_argmin_and_writes_a_flagfile_the_runner_accepts(tmp_path, capsys):
    out = tmp_path / "tune"
    code, err, stdout = cli([f"--flagfile={TINY}", f"--output_dir={out}", "--num_rounds=9",
                             "--lr_grid=0.02,0.3", "--lr_decay_grid=1,2",
                             "--lr_decay_every=3", "--l2_grid=3,1e-4"], capsys)
    assert code == 0, err
    assert "wrote" in stdout

    # Learning rate: the smallest terminal alpha-weighted train loss, mean over seeds.
    lr_means = grid_means(out / "lr_grid", lambda r, z: np.sum(
        z["train_loss"][r] * z["train_sizes"]) / np.sum(z["train_sizes"]))
    order = [f"theta=1_learning_rate={lr:g}_lr_decay={c:g}" for lr in (0.02, 0.3) for c in (1, 2)]
    assert sorted(lr_means) == sorted(order)
    best_lr = min(order, key=lambda k: (lr_means[k], order.index(k)))
    # Lambda: the smallest p90 error over the validation clients, per theta.
    l2_means = grid_means(out / "l2_grid",
                          lambda r, z: lower_p90_unweighted(z["test_error"][r]))
    z = np.load(out / "l2_grid" / "clients.npz")
    assert len(z["test_sizes"]) + len(z["train_sizes"]) == 10      # tiny.flags: 10 train
    chosen_l2 = {}
    for theta in ("1", "0.5"):
        keys = [f"theta={theta}_l2_reg={lam:g}" for lam in (3, 1e-4)]
        chosen_l2[float(theta)] = (3.0, 1e-4)[min(range(2), key=lambda i: (l2_means[keys[i]], i))]

    record = json.load(open(out / "tuning.json"))
    # The recorded scores are these means (the argmin rule itself: test_best_... above).
    for sc in record["lr_scores"]:
        key = (f"theta=1_learning_rate={sc['point']['learning_rate']:g}_"
               f"lr_decay={sc['point']['lr_decay']:g}")
        assert np.mean(sc["values"]) == pytest.approx(lr_means[key], rel=1e-6)
    for sc in record["l2_scores"]:
        key = f"theta={sc['point']['theta']:g}_l2_reg={sc['point']['l2_reg']:g}"
        assert np.mean(sc["values"]) == pytest.approx(l2_means[key], rel=1e-6)
    assert len(record["lr_scores"]) == 4 and len(record["l2_scores"]) == 4
    assert (f"theta=1_learning_rate={record['learning_rate']:g}_"
            f"lr_decay={record['lr_decay']:g}") == best_lr
    assert {float(k): v for k, v in record["l2"].items()} == chosen_l2
    assert "10th percentile" in open(record["flagfiles"][0]).read()

    # Every flagfile runs as written (a fresh process knows only the runner's flags).
    runs_thetas = []
    for path in record["flagfiles"]:
        lines = [l for l in open(path).read().splitlines() if l.startswith("--")]
        flags = dict(l[2:].split("=", 1) for l in lines)
        assert float(flags["learning_rate"]) == record["learning_rate"]
        assert float(flags["lr_decay"]) == record["lr_decay"]
        assert flags["lr_decay_every"] == "3" and flags["num_rounds"] == "9"
        thetas = [float(t) for t in flags["thetas"].split(",")]
        runs_thetas += thetas
        assert [chosen_l2[t] for t in thetas] == [float(v) for v in flags["l2_reg"].split(",")]
    assert sorted(runs_thetas) == [0.5, 1.0]
    path = record["flagfiles"][0]
    proc = subprocess.run([sys.executable, "-m", "experiments.run", f"--flagfile={path}",
                           "--num_rounds=2", "--eval_every=2", "--nosave_models"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run_dir = [l for l in open(path).read().splitlines() if l.startswith("--output_dir=")][0]
    summary = json.load(open(os.path.join(run_dir.split("=", 1)[1], "summary.json")))
    assert summary["config"]["learning_rate"] == record["learning_rate"]
    want_l2 = [float(v) for v in [l for l in open(path).read().splitlines()
                                  if l.startswith("--l2_reg=")][0][9:].split(",")]
    assert np.atleast_1d(summary["config"]["l2_reg"]).tolist() == want_l2

    # A second tuning into the same directory is refused.
    code, err, _ = cli([f"--flagfile={TINY}", f"--output_dir={out}"], capsys)
    assert code == 2 and "already holds tuning results" in err


@pytest.mark.parametrize("args,message", [
    (["--lr_grid=abc"], "--lr_grid must be a comma-separated list of numbers"),
    (["--lr_grid=0.1,0.1"], "--lr_grid lists a value twice"),
    (["--lr_decay_grid=0.5,1", "--lr_decay_every=2"], "--lr_decay_grid values must be finite "
                                                      "and >= 1"),
    (["--l2_grid=-1"], "--l2_grid values must be finite and >= 0"),
    (["--clients_per_round=8"], "exceeds the 5 clients of the half of the training clients"),
    (["--tune_l2=maybe"], "--tune_l2"),
    (["--thetas=1.5"], "--thetas must lie in (0, 1]"),
    (["--notune_lr", "--tune_l2=no"], "nothing to tune"),
    (["--server_optimizer=adam", "--server_lr=0.01,0.1"], "give one --server_lr"),
    (["--weighting=unweighted", "--quantile=secagg_mm", "--dp_clip=1"],
     "the tuner trains without client-level DP"),
])
def test_bad_input_exits_2_with_one_line_and_trains_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "tune"
    code, err, _ = cli([f"--flagfile={TINY}", f"--output_dir={out}"] + args, capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists()
