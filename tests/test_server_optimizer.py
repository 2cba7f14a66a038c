"""The server step as an optax transformation of the pseudo-gradient (Reddi et al. 2021,
Algorithm 2): FedAvgM, FedAdam, FedYogi, FedAdagrad against NumPy written from the paper
(numpy_fedopt.py), the --server_lr sweep as replicas, the default step, and the refusals."""


import jax
import numpy as np
import pytest

import numpy_fedopt as nf
from conftest import linear_rows, run_rounds_history, run_runner, tiny_config
from deltafl_jax import DataConfig, build_experiment, load_dataset, load_model, run_experiment
from deltafl_jax.errors import ConfigError
from deltafl_jax.optimizers.server import ServerOptimizer

SIZES = (6, 9, 12, 7, 10)           # five training clients; one full batch of 16 covers each
FEATURES, CLASSES = 4, 3


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
    """Five training and two test clients of a 3-class problem, in the npz format."""
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(CLASSES, FEATURES)) * 2.0

    def split(sizes, first_id):
        y = np.concatenate([rng.integers(0, CLASSES, n) for n in sizes])
        x = centers[y] + rng.normal(size=(len(y), FEATURES))
        c = np.concatenate([np.full(n, first_id + i) for i, n in enumerate(sizes)])
        return x.astype(np.float32), y.astype(np.int32), c.astype(np.int32)

    path = str(tmp_path_factory.mktemp("npz") / "tiny.npz")
    tx, ty, tc = split(SIZES, 0)
    vx, vy, vc = split((5, 8), 100)
    np.savez(path, train_x=tx, train_y=ty, train_client=tc, test_x=vx, test_y=vy,
             test_client=vc)
    return path


def fedopt_config(path, **kw):
    return tiny_config(data=DataConfig("npz", data_path=path), algorithm="fedavg", thetas=(),
                       clients_per_round=len(SIZES), batch_size=16, local_epochs=1,
                       learning_rate=0.5, **kw)


@pytest.mark.parametrize("kind,kw", [
    ("adam", dict(server_beta1=0.9, server_beta2=0.99, server_eps=1e-3)),
    ("yogi", dict(server_beta1=0.8, server_beta2=0.95, server_eps=1e-2)),
    ("adagrad", dict(server_beta1=0.9, server_eps=1e-2)),
    ("momentum", dict(server_momentum=0.7)),
    ("sgd", {}),
])
def test_three_rounds_equal_reddi_algorithm_2(tiny_npz, kind, kw):
    """Full participation, one full-batch local step, the linear model's zero init: the
    engine's models after 3 rounds equal Algorithm 2 in float64 within 1e-5, for two server
    learning rates trained as replicas of one program."""
    etas = (0.05, 0.2) if kind != "sgd" else (0.5, 2.0)
    cfg = fedopt_config(tiny_npz, server_optimizer=kind, server_lr=etas, **kw)
    exp = build_experiment(cfg, load_dataset(cfg.data))
    state = run_rounds_history(exp, 3)[0]
    data = exp.data
    xs = [data.train.client(k)[0].astype(np.float64) for k in range(data.train.num_clients)]
    ys = [data.train.client(k)[1] for k in range(data.train.num_clients)]
    for r, lab in enumerate(exp.replicas.labels):
        eta = dict(lab.extra)["server_lr"]
        opt = nf.FedOpt(kind, eta, beta1=cfg.server_beta1, beta2=cfg.server_beta2,
                        tau=cfg.server_eps, momentum=cfg.server_momentum)
        x = [np.zeros((FEATURES, CLASSES)), np.zeros(CLASSES)]
        for _ in range(3):
            x = opt.step(x, list(nf.full_batch_round(x[0], x[1], xs, ys, cfg.learning_rate)))
        got = list(linear_rows(state.params, r))
        for g, want in zip(got, x):
            np.testing.assert_allclose(g, want, atol=1e-5, rtol=1e-5)
        assert np.max(np.abs(x[0])) > 1e-2          # the models moved


@pytest.mark.slow
def test_server_lr_list_crossed_with_theta_equals_separate_runs(tiny_synthetic):
    """--thetas=1,0.5 x --server_lr=0.01,0.03 x 2 seeds: 8 replicas, labelled by server_lr;
    those of eta = 0.03 equal the run of that learning rate alone."""
    kw = dict(thetas=(1.0, 0.5), seeds=(1, 2), server_optimizer="adam", l2_reg=1e-3)
    joint = build_experiment(tiny_config(server_lr=(0.01, 0.03), **kw), tiny_synthetic)
    keys = [lab.key() for lab in joint.replicas.labels]
    assert keys[:3] == ["theta=1_server_lr=0.01_seed=1", "theta=1_server_lr=0.01_seed=2",
                        "theta=1_server_lr=0.03_seed=1"]
    assert len(keys) == 8
    sj = run_rounds_history(joint, 2)[0]
    for eta in (0.03,):
        alone = build_experiment(tiny_config(server_lr=(eta,), **kw), tiny_synthetic)
        assert all("server_lr" not in lab.key() for lab in alone.replicas.labels)
        sa = run_rounds_history(alone, 2)[0]
        rows = [i for i, lab in enumerate(joint.replicas.labels)
                if dict(lab.extra)["server_lr"] == eta]
        for a, b in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sj.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b)[rows], rtol=1e-6,
                                       atol=1e-7)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_default_step_has_no_optimizer_state_and_sgd_at_one_is_the_average(tiny_synthetic):
    """The default (sgd, eta = 1) keeps no optimizer state; sgd's optax form at eta = 1 (a
    replica of a --server_lr=1,0.5 sweep) gives the same models up to rounding, and eta = 0.5
    half the step."""
    kw = dict(thetas=(1.0, 0.5), seeds=(1,), l2_reg=1e-3)
    plain = build_experiment(tiny_config(**kw), tiny_synthetic)
    sp = run_rounds_history(plain, 1)[0]
    assert jax.tree.leaves(sp.server_opt_state) == []
    swept = build_experiment(tiny_config(server_lr=(1.0, 0.5), **kw), tiny_synthetic)
    ss = run_rounds_history(swept, 1)[0]
    w0 = jax.tree.leaves(plain.initial_state().params)
    for p, s, z in zip(jax.tree.leaves(sp.params), jax.tree.leaves(ss.params), w0):
        p, s, z = np.asarray(p), np.asarray(s), np.asarray(z)
        np.testing.assert_allclose(s[[0, 2]], p, rtol=1e-6, atol=1e-7)      # eta = 1
        np.testing.assert_allclose(s[[1, 3]] - z, 0.5 * (p - z), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("flags,needle", [
    (["--server_lr=0"], "--server_lr must be a finite number > 0"),
    (["--server_lr=0.1,0.1"], "--server_lr lists a value twice"),
    (["--server_optimizer=adam", "--server_beta2=1"], "--server_beta2 must be"),
    (["--server_optimizer=adam", "--server_eps=0"], "--server_eps must be"),
    (["--server_optimizer=lamb"], "server_optimizer"),
    (["--algorithm=afl", "--server_optimizer=adam"], "--algorithm=afl takes no"),
    (["--algorithm=afl", "--server_lr=0.5"], "--algorithm=afl takes no"),
])
def test_bad_server_flags_exit_2_with_one_line(tmp_path, capsys, flags, needle):
    out = tmp_path / "out"
    code, err, _ = run_runner(["--dataset=synthetic", "--synthetic_num_clients=10",
                               f"--output_dir={out}", *flags], capsys)
    assert code == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert not out.exists()


def test_server_optimizer_check_names_the_flag():
    with pytest.raises(ConfigError, match="--server_momentum"):
        ServerOptimizer(name="momentum", momentum=-0.1).check()
    assert ServerOptimizer().is_default and ServerOptimizer().transformation() is None
    assert not ServerOptimizer(learning_rates=(0.5,)).is_default


@pytest.mark.slow
def test_swept_run_serves_each_model_by_its_server_lr(tiny_synthetic, tmp_path):
    out = str(tmp_path / "run")
    cfg = tiny_config(thetas=(1.0, 0.5), seeds=(1, 2), server_optimizer="adam",
                      server_lr=(0.01, 0.03), output_dir=out, save_models=True)
    result = run_experiment(cfg, tiny_synthetic, log=lambda s: None)
    r = list(result.final).index("theta=0.5_server_lr=0.03_seed=1")
    model = load_model(out, theta=0.5, server_lr=0.03, seed=1)
    want = jax.tree.map(lambda a: np.asarray(a)[r], result.served)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(model.params), want)
    with pytest.raises(ValueError, match="several models match"):
        load_model(out, theta=0.5, seed=1)


def test_the_start_line_names_the_server_optimizer(tiny_synthetic):
    from deltafl_jax.run.callbacks import RunContext
    from deltafl_jax.run.progress import Progress
    lines = []
    cfg = tiny_config(thetas=(0.5,), server_optimizer="yogi", server_lr=(0.02,))
    exp = build_experiment(cfg, tiny_synthetic)
    Progress(lines.append, bar=False).on_run_start(RunContext(view=exp.view(), num_rounds=1))
    assert ("with server Yogi, server_lr=0.02, server_beta1=0.9, server_beta2=0.99, "
            "server_eps=0.001") in lines[0]


TINY_RUN = ["--dataset=synthetic", "--synthetic_num_clients=20", "--synthetic_max_examples=60",
            "--num_rounds=3", "--eval_every=3", "--clients_per_round=4", "--seeds=1,2",
            "--tensorboard=no"]


@pytest.mark.slow
def test_method_entries_name_their_server_optimizer(tmp_path, capsys):
    """--algorithm=fedavg,fedavg+adam,deltafl+yogi: the entry with a '+' runs with that
    optimizer at --server_lr (as the single-method run with --server_optimizer does, bit for
    bit), the plain entry with the plain step; the report names them FedAvg, FedAdam and
    'Δ-FL, θ = 0.5, server Yogi'."""
    import json
    from deltafl_jax.report import method_label
    out = tmp_path / "multi"
    code, err, _ = run_runner([*TINY_RUN, "--algorithm=fedavg,fedavg+adam,deltafl+yogi",
                               "--thetas=0.5", "--server_lr=0.03", f"--output_dir={out}"],
                              capsys)
    assert code == 0, err
    alone = tmp_path / "alone"
    code, err, _ = run_runner([*TINY_RUN, "--algorithm=fedavg", "--server_optimizer=adam",
                               "--server_lr=0.03", f"--output_dir={alone}"], capsys)
    assert code == 0, err
    names = {}
    for entry, (opt, lrs) in {"fedavg": ("sgd", [1.0]), "fedavg+adam": ("adam", [0.03]),
                              "deltafl+yogi": ("yogi", [0.03])}.items():
        summary = json.load(open(out / entry / "summary.json"))
        assert (summary["config"]["server_optimizer"], summary["config"]["server_lr"]) == \
            (opt, lrs)
        names[entry] = {method_label(r, summary["config"]) for r in summary["replicas"]}
    assert names == {"fedavg": {"FedAvg"}, "fedavg+adam": {"FedAdam, η_s = 0.03"},
                     "deltafl+yogi": {"Δ-FL, θ = 0.5, server Yogi, η_s = 0.03"}}
    for seed in (1, 2):
        ma = load_model(str(out / "fedavg+adam"), seed=seed)
        mb = load_model(str(alone), seed=seed)
        jax.tree.map(np.testing.assert_array_equal, ma.params, mb.params)


@pytest.mark.parametrize("flags,needle", [
    (["--algorithm=fedavg+lamb"], "after '+' come at most one layer"),
    (["--algorithm=fedavg,fedavg+adam", "--server_optimizer=adam"],
     "--server_optimizer cannot be combined"),
    (["--algorithm=afl+adam"], "--algorithm=afl takes no"),
])
def test_bad_method_entries_exit_2(tmp_path, capsys, flags, needle):
    code, err, _ = run_runner([*TINY_RUN, f"--output_dir={tmp_path / 'o'}", *flags], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "o").exists()


def test_a_round_that_no_client_reaches_moves_nothing(tiny_synthetic):
    """FedAvgM after two rounds (v != 0), then a round whose weights are all zero (nobody
    trains): the model and the optimizer's state stay as they were (the momentum is not
    applied to a Delta of zeros), and server_step_norm is 0; a normal round moves both."""
    from deltafl_jax import engine, rounds
    exp = build_experiment(tiny_config(algorithm="fedavg", thetas=(), server_optimizer="momentum",
                                       server_lr=(0.5,)), tiny_synthetic)
    state = run_rounds_history(exp, 2)[0]
    nobody = exp.algorithm._replace(
        client_weights=lambda ctx: 0.0 * ctx.sizes.astype(np.float32))
    local = engine.LocalSGDConfig(batch_size=exp.config.batch_size, lanes=exp.lanes)
    empty_round = jax.jit(rounds.build_round_fn(exp.model, nobody, exp.replicas, local,
                                                exp.eval_chunk, 1, exp.num_sampled,
                                                exp.program.server_tx))
    before = jax.device_get(state)
    after, metrics = empty_round(state, exp.round_data(2), exp.keys())
    for a, b in zip(jax.tree.leaves(jax.device_get(after.params)) +
                    jax.tree.leaves(jax.device_get(after.server_opt_state)),
                    jax.tree.leaves(before.params) + jax.tree.leaves(before.server_opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(metrics["num_selected"]) == 0)
    assert np.all(np.asarray(metrics["server_step_norm"]) == 0)
    moved, met = exp.round_fn(after, exp.round_data(2), exp.keys())
    assert np.all(np.asarray(met["server_step_norm"]) > 0)
