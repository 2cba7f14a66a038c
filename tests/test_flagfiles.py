"""Every experiments/*.flags file parses into valid configurations, and the paper flagfiles
carry the paper's settings (the authors' inputs, no bias, lambda per theta, every method of the
tables)."""

import glob
import os

import pytest

HERE = os.path.dirname(__file__)
EXPERIMENTS = os.path.join(os.path.dirname(HERE), "experiments")
FLAGFILES = sorted(glob.glob(os.path.join(EXPERIMENTS, "*.flags")))


# Flagfiles of other commands than experiments.run (tests/test_llm.py runs this one).
OTHER_COMMANDS = {"pretrain_shakespeare.flags": "experiments.pretrain"}


def plan(name, *extra):
    from experiments import run as runner
    runner.FLAGS.unparse_flags()
    runner.parse_flags_or_fail(["run", f"--flagfile={os.path.join(EXPERIMENTS, name)}", *extra])
    return runner.planned_configs()


def _local_base(path):
    """The --base_model folder a flagfile names when it is a local path (not a hub id to
    download), else None."""
    lines = [l.strip() for l in open(path) if l.strip().startswith("--")]
    if "--download_base_model" in lines:
        return None
    return next((l.split("=", 1)[1] for l in lines if l.startswith("--base_model=")), None)


@pytest.mark.parametrize("path", [p for p in FLAGFILES if os.path.basename(p) not in
                                  OTHER_COMMANDS], ids=os.path.basename)
def test_every_flagfile_gives_valid_configs(path, tmp_path):
    extra = []
    base = _local_base(path)
    if base is not None and not os.path.isdir(base):   # the base another command writes
        from llm_fixtures import tokenizer_folder       # (experiments.pretrain): a stand-in
        tokenizer_folder(str(tmp_path / "base"))        # with its config and tokenizer
        extra.append(f"--base_model={tmp_path / 'base'}")
    configs = plan(os.path.basename(path), *extra)
    assert configs and all(c.output_dir for c in configs)


def test_femnist_and_sent140_linear_use_the_authors_inputs_and_no_bias():
    for name, dataset in (("emnist_linear.flags", "femnist"),
                          ("sent140_linear.flags", "sent140"),
                          ("compare_emnist_linear.flags", "femnist"),
                          ("compare_sent140_linear.flags", "sent140")):
        for c in plan(name):
            assert c.data.dataset == dataset and c.data.normalize == "reference", name
            assert c.use_bias is False, name
    for name in ("emnist.flags", "emnist_cpu.flags", "compare_emnist.flags"):
        assert all(c.data.normalize == "reference" for c in plan(name))
    for name in ("sent140_lstm.flags", "shakespeare.flags", "shakespeare_cpu.flags",
                 "compare_shakespeare.flags", "compare_sent140_lstm.flags"):
        assert all(c.data.normalize == "none" for c in plan(name))


def test_emnist_linear_lambda_per_theta_is_the_reference_codes():
    (config,) = plan("emnist_linear.flags")
    assert config.thetas == (1.0, 0.8, 0.5, 0.1)
    assert config.l2_for(4) == (1e-9, 1e-7, 1e-7, 1e-7)   # FedAvg 1e-9, Delta-FL 1e-7


def test_comparisons_run_every_method_of_the_papers_tables():
    table_rows = {"deltafl", "fedavg", "fedavg_sub", "fedprox", "qffl", "afl_qffl", "afl",
                  "term"}
    for name, rounds, resampled in (("compare_emnist_linear.flags", 3000, True),
                                    ("compare_sent140_linear.flags", 1000, True),
                                    ("compare_emnist.flags", 1000, True),
                                    ("compare_sent140_lstm.flags", 600, True),
                                    ("compare_shakespeare.flags", 600, False)):
        configs = plan(name)
        assert {c.algorithm for c in configs} == table_rows, name
        assert {c.num_rounds for c in configs} == {rounds}
        assert {c.seeds for c in configs} == ({(s,) for s in range(1, 6)} if resampled
                                               else {(1, 2, 3, 4, 5)}), name
        qffl = next(c for c in configs if c.algorithm == "qffl")
        assert qffl.sweep("qffl_q") == (0.001, 0.01, 0.1, 1.0, 10.0)   # CISS Sec. V


def test_the_fedopt_comparison_runs_its_five_methods():
    configs = {c.method: c for c in plan("compare_fedopt_synthetic.flags")}
    assert list(configs) == ["fedavg", "fedavg+adam", "deltafl", "deltafl+adam", "scaffold"]
    for name, c in configs.items():
        plain = "+" not in name
        assert c.server.is_default == plain, name
        assert c.server_lr == ((1.0,) if plain else (0.01, 0.03, 0.1)), name
        assert c.output_dir.endswith(os.path.join("compare_fedopt_synthetic", name))
    assert configs["deltafl"].thetas == configs["deltafl+adam"].thetas == (0.5,)
    assert {c.seeds for c in configs.values()} == {(1, 2, 3)}


@pytest.mark.slow
def test_the_population_flagfile_is_informative(tmp_path, capsys):
    """The million-client example shows a tail that methods can differ on. Its
    settings at 4000 clients (generated on demand, on the host, 200 sampled per evaluation):
    the final p90 of the test error is well below 100%, while at the original benchmark's
    rho = 0 it is 100% for both methods."""
    import json
    from conftest import run_runner
    (config,) = plan("population.flags")
    assert config.data.synthetic.num_clients == 10 ** 6 and config.data.synthetic.shared > 0
    small = [f"--flagfile={os.path.join(EXPERIMENTS, 'population.flags')}",
             "--synthetic_num_clients=4000", "--synthetic_on_demand", "--client_data=host",
             "--eval_clients=200", "--num_rounds=100", "--tensorboard=no", "--nosave_models"]
    p90 = {}
    for shared in ("0.98", "0"):
        out = tmp_path / shared
        code, err, _ = run_runner([*small, f"--synthetic_shared={shared}",
                                   f"--output_dir={out}"], capsys)
        assert code == 0, err
        final = json.load(open(out / "summary.json"))["final"]
        p90[shared] = [f["test_error_p90"] for f in final.values()]
    assert max(p90["0.98"]) < 0.8, p90
    assert min(p90["0"]) == 1.0, p90
