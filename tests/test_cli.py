"""The runner: outputs of a tiny end-to-end run, and one line + exit code 2 on bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import run_runner

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "tiny.flags")
REPO = os.path.dirname(HERE)


def cli(argv, capsys):
    """Run experiments.run in-process; returns (exit code, stderr)."""
    return run_runner(argv, capsys)[:2]


def test_tiny_flagfile_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = cli([f"--flagfile={TINY}", f"--output_dir={out}"], capsys)
    assert code == 0, err
    records = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert len(records) == 2 * 2 * 2  # 2 evaluations x (2 thetas x 2 seeds)
    keys = {"round", "theta", "seed", "train_loss_mean", "test_error_mean", "test_loss_mean",
            "num_selected", "num_rejected"}
    keys |= {f"train_loss_p{p}" for p in (10, 20, 50, 60, 80, 90, 95)}
    keys |= {f"test_error_p{p}" for p in (10, 20, 50, 60, 80, 90, 95)}
    for r in records:
        assert keys <= set(r)
        assert r["train_loss_p10"] <= r["train_loss_p50"] <= r["train_loss_p95"]
        assert 0 <= r["test_error_p90"] <= 1
        assert 1 <= r["num_selected"] <= 4
    assert sorted({(r["theta"], r["seed"]) for r in records}) == [(0.5, 1), (0.5, 2),
                                                                (1.0, 1), (1.0, 2)]
    summary = json.load(open(out / "summary.json"))
    assert set(summary["final"]) == {"theta=1_seed=1", "theta=1_seed=2", "theta=0.5_seed=1",
                                     "theta=0.5_seed=2"}
    last = [r for r in records if r["round"] == 6 and r["theta"] == 0.5 and r["seed"] == 2][0]
    assert summary["final"]["theta=0.5_seed=2"]["test_error_p90"] == last["test_error_p90"]
    rounds = np.load(out / "rounds.npz")
    assert rounds["num_selected"].shape == (6, 4)
    clients = np.load(out / "clients.npz")
    assert clients["test_error"].shape == (4, len(clients["test_sizes"]))
    # The final per-client test errors reproduce the logged mean.
    r = list(clients["replica_keys"]).index("theta=0.5_seed=2")
    assert clients["test_error"][r].mean() == pytest.approx(last["test_error_mean"])

    import deltafl_jax
    served = deltafl_jax.load_model(str(out), theta=0.5, seed=2)
    from deltafl_jax import DataConfig, load_dataset
    data = load_dataset(DataConfig("synthetic", synthetic_num_clients=20,
                                   synthetic_max_examples=120, synthetic_shared=0.8))
    x, y = data.test.client(0)
    pred = np.asarray(served.predict(x)).argmax(1)
    W = np.asarray(served.params["Dense_0"]["kernel"])
    b = np.asarray(served.params["Dense_0"]["bias"])
    np.testing.assert_array_equal(pred, (x @ W + b).argmax(1))
    assert clients["test_error"][r][0] == pytest.approx(np.mean(pred != y))
    with pytest.raises(ValueError, match="several models match"):
        deltafl_jax.load_model(str(out), theta=0.5)

    # A second run into the same directory does not clobber it.
    before = open(out / "metrics.jsonl").read()
    code, err = cli([f"--flagfile={TINY}", f"--output_dir={out}"], capsys)
    assert code == 2 and "already holds results" in err
    assert open(out / "metrics.jsonl").read() == before


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def good_arrays(n=40):
    rng = np.random.default_rng(0)
    return dict(train_x=rng.normal(size=(n, 3)).astype(np.float32),
                train_y=rng.integers(0, 2, n), train_client=np.repeat(np.arange(4), n // 4),
                test_x=rng.normal(size=(n, 3)).astype(np.float32),
                test_y=rng.integers(0, 2, n), test_client=np.repeat(np.arange(4), n // 4))


def bad_inputs(tmp_path):
    nan = good_arrays()
    nan["train_x"][3, 1] = np.nan
    short = good_arrays()
    short["train_client"] = short["train_client"][:-1]
    missing = good_arrays()
    del missing["test_client"]
    floaty = good_arrays()
    floaty["train_y"] = floaty["train_y"] + 0.5
    not_npz = tmp_path / "junk.npz"
    not_npz.write_text("not a zip file")
    return {
        "theta zero": (["--thetas=0"], "--thetas must lie in (0, 1]"),
        "theta above one": (["--thetas=1.0,1.5"], "--thetas must lie in (0, 1]"),
        "theta negative": (["--thetas=-0.1"], "--thetas"),
        "theta not a number": (["--thetas=abc"], "--thetas must be a comma-separated list"),
        "m > clients": (["--clients_per_round=999"], "--clients_per_round=999 exceeds"),
        "unknown dataset": (["--dataset=mnsit"], "unknown dataset 'mnsit'"),
        "image dataset without --partition": (["--dataset=mnist"],
                                              "--dataset=mnist has no clients of its own"),
        "unknown model": (["--model=resnet"], "unknown model 'resnet'"),
        "unknown algorithm": (["--algorithm=sgd"], "unknown algorithm 'sgd'"),
        # An option with choices is an enum flag (its declared setting): absl refuses the value.
        "unknown filter": (["--filter=soft"], "--filter=soft: value should be one of "
                                              "<exact|reference>"),
        "missing npz": (["--dataset=npz", f"--data_path={tmp_path}/none.npz"], "no such file"),
        "not an npz": (["--dataset=npz", f"--data_path={not_npz}"], "not a readable .npz"),
        "npz missing array": (["--dataset=npz",
                               f"--data_path={write_npz(tmp_path / 'm.npz', **missing)}"],
                              "lacks the array(s) test_client"),
        "npz shapes": (["--dataset=npz", f"--data_path={write_npz(tmp_path / 's.npz', **short)}"],
                       "train_client must be 1-D with one id per row"),
        "npz NaN": (["--dataset=npz", f"--data_path={write_npz(tmp_path / 'n.npz', **nan)}"],
                    "train_x holds NaN or Inf"),
        "npz float labels": (["--dataset=npz",
                              f"--data_path={write_npz(tmp_path / 'f.npz', **floaty)}"],
                             "integer class labels"),
        "learning rate zero": (["--learning_rate=0"], "--learning_rate must be positive"),
        "learning rate NaN": (["--learning_rate=nan"], "--learning_rate must be a finite"),
        "batch size zero": (["--batch_size=0"], "--batch_size must be a positive integer"),
        "batch size text": (["--batch_size=ten"], "--batch_size"),
        "lr decay below one": (["--lr_decay=0.5"], "--lr_decay is the divisor"),
        "unknown flag": (["--lr=0.1"], "Unknown command line flag 'lr'"),
        "fedavg with thetas": (["--algorithm=fedavg", "--thetas=0.5"], "fedavg is Delta-FL at"),
        "bad seeds": (["--seeds=1,x"], "--seeds must be a comma-separated list of integers"),
        # A flag given on the command line that no method of the run reads.
        "option of another algorithm": (["--algorithm=deltafl_alt", "--quantile=secagg_mm"],
                                        "--quantile is read by --algorithm=deltafl, not by "
                                        "deltafl_alt"),
        "sweep of another algorithm": (["--qffl_q=0.1"], "--qffl_q is read by "
                                       "--algorithm=afl_qffl,qffl, not by deltafl"),
        "server setting not read": (["--server_optimizer=adam", "--server_lr=0.1",
                                     "--server_momentum=0.5"],
                                    "--server_momentum is read by --server_optimizer=momentum, "
                                    "not by the server step of deltafl+adam"),
        "adagrad has no beta2": (["--server_optimizer=adagrad", "--server_lr=0.1",
                                  "--server_beta2=0.9"], "--server_beta2 is read by "
                                 "--server_optimizer=adam,yogi"),
    }


def test_every_bad_input_exits_2_with_one_line_and_no_output(tmp_path, capsys):
    for name, (args, message) in bad_inputs(tmp_path).items():
        out = tmp_path / ("out_" + name.replace(" ", "_"))
        code, err = cli([f"--flagfile={TINY}", f"--output_dir={out}"] + args, capsys)
        assert code == 2, (name, err)
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1 and message in lines[0], (name, err)
        assert not out.exists(), name


def test_a_flagfile_may_set_flags_of_other_methods():
    """tiny.flags sets --thetas; run with --algorithm=qffl (which does not read it) it plans,
    and a flag that no method reads is refused only when given on the command line."""
    from experiments import run as runner
    runner.FLAGS.unparse_flags()
    runner.parse_flags_or_fail(["run", f"--flagfile={TINY}", "--algorithm=qffl",
                                "--output_dir=/tmp/unused"])
    assert [c.method for c in runner.planned_configs()] == ["qffl"]


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "experiments.run", f"--flagfile={TINY}",
                           "--thetas=2", f"--output_dir={out}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --thetas must lie in (0, 1], got 2.0"
    assert not out.exists()


def test_option_flags_come_from_the_specs_and_each_method_gets_its_own(tmp_path):
    """--filter & co. are generated from the specs' options groups (an enum for choices); with
    several methods each config holds the options its spec declares, and FedAvg (a fixed
    sweep) does not take Delta-FL's --thetas."""
    from deltafl_jax.algorithms import registry
    from experiments import cli as cli_lib
    from experiments import run as runner

    options = dict(registry.options())
    assert runner.FLAGS["filter"].default == options["filter"].flag_default == "exact"
    assert runner.FLAGS["filter"].help.endswith(options["filter"].help)
    assert list(runner.FLAGS["weighting"].parser.enum_values) == ["weighted", "unweighted"]
    assert runner.FLAGS["mm_iters"].value == 20
    runner.FLAGS.unparse_flags()
    try:
        runner.parse_flags_or_fail(["run", f"--flagfile={TINY}", f"--output_dir={tmp_path}",
                                    "--algorithm=deltafl,fedavg,fedavg_sub,qffl",
                                    "--filter=reference", "--weighting=unweighted"])
        configs = {c.algorithm: c for c in cli_lib.configs_from_flags()}
    finally:
        runner.FLAGS.unparse_flags()
    assert configs["deltafl"].options == {"filter": "reference", "weighting": "unweighted",
                                          "smoothing": 0.0, "quantile": "sort", "mm_iters": 20,
                                          "deltafl_participation": "none", "fedau_cap": 0}
    assert configs["fedavg"].options == {"weighting": "unweighted"}
    assert configs["fedavg_sub"].options == {"filter": "reference"}
    assert configs["qffl"].options == {}
    assert configs["deltafl"].thetas == (1.0, 0.5) and configs["fedavg"].thetas == ()
    assert configs["fedavg_sub"].thetas == (1.0, 0.5)
    assert configs["qffl"].output_dir == os.path.join(str(tmp_path), "qffl")


def test_help_has_a_usage_line_and_explains_flagfile(capsys):
    code, err, out = run_runner(["--help"], capsys)
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("usage: python -m experiments.run ") and "--flagfile" in first
    assert "--flagfile=FILE reads flags from FILE" in out
    # From the shell, the command's own example line from its docstring.
    shell = subprocess.run([sys.executable, "-m", "experiments.report", "--help"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.startswith("usage: python -m experiments.report RUN_DIR")


def test_the_start_up_line_counts_in_the_singular_and_the_plural(tmp_path, capsys):
    code, err, out = run_runner([f"--flagfile={TINY}", "--thetas=1.0", "--seeds=1",
                                 "--num_rounds=1", "--eval_every=1", "--clients_per_step=1",
                                 f"--output_dir={tmp_path / 'one'}"], capsys)
    assert code == 0, err
    line = [l for l in (out + err).splitlines() if l.startswith("deltafl_jax: synthetic")][0]
    assert "1 replica (1 seed)" in line and "1 client lane per step" in line, line
    code, err, out = run_runner([f"--flagfile={TINY}", "--num_rounds=1", "--eval_every=1",
                                 "--clients_per_step=2", f"--output_dir={tmp_path / 'two'}"],
                                capsys)
    assert code == 0, err
    line = [l for l in (out + err).splitlines() if l.startswith("deltafl_jax: synthetic")][0]
    assert "4 replicas (2 seeds)" in line and "2 client lanes per step" in line, line


def test_report_and_leaderboard_share_one_process():
    """Both commands define --out (absl's flags are global): imported in one process, in
    either order, each parses with its own default."""
    from experiments import leaderboard, report
    try:
        for _ in range(2):
            report.FLAGS.unparse_flags()
            report.parse_flags_or_fail(["report", "runs/x"])
            assert report.FLAGS.out is None
            leaderboard.FLAGS.unparse_flags()
            leaderboard.parse_flags_or_fail(["leaderboard"])
            assert leaderboard.FLAGS.out == "runs/leaderboard"
    finally:
        report.FLAGS.unparse_flags()
