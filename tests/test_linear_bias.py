"""--use_bias: the paper's linear models have no bias.

App. C.1.1: "We train parameters w in R^{62x784} ... the score of each class c is the dot
product <w_c, x>"; App. C.1.2: "the parameter vector w is of dimension 50"; the L2 term is
(lambda/2)||w||^2. The NumPy oracle (tests/numpy_reference.py, b=None) follows that text; the
bias stays on by default for the other datasets (the golden flagfile's Synthetic).
"""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import run_runner, tiny_config
from numpy_reference import client_loss, delta_fl_round
from deltafl_jax import ConfigError, build_experiment
from deltafl_jax.data import FederatedDataset
from deltafl_jax.models import ModelOptions, build_model


def params_of(model):
    return {k: v.shape for k, v in model.init(jax.random.key(0))["Dense_0"].items()}


def test_default_bias_depends_on_the_dataset(tiny_synthetic):
    femnist_like = dataclasses.replace(tiny_synthetic, name="femnist")
    assert params_of(build_model("linear", tiny_synthetic)) == {"kernel": (60, 10),
                                                                 "bias": (10,)}
    assert params_of(build_model("linear", femnist_like)) == {"kernel": (60, 10)}
    assert params_of(build_model("linear", femnist_like, ModelOptions(use_bias=True))) == {
        "kernel": (60, 10), "bias": (10,)}
    assert params_of(build_model("linear", tiny_synthetic, ModelOptions(use_bias=False))) == {
        "kernel": (60, 10)}


@pytest.mark.parametrize("filter", ["exact", "reference"])
def test_round_without_bias_equals_the_papers_model_in_numpy(tiny_synthetic, filter):
    cfg = tiny_config(filter=filter, thetas=(1.0, 0.5), seeds=(1, 2), l2_reg=1e-2,
                      use_bias=False, learning_rate=0.05)
    exp = build_experiment(cfg, tiny_synthetic)
    state, keys = exp.initial_state(), exp.keys()
    for t in range(3):
        state, _ = exp.round_fn(state, exp.round_data(t), keys)
    params = jax.device_get(state.params)["Dense_0"]
    assert set(params) == {"kernel"}
    split = tiny_synthetic.train
    xs = [split.client(k)[0].astype(np.float64) for k in range(split.num_clients)]
    ys = [split.client(k)[1] for k in range(split.num_clients)]
    for r, lab in enumerate(exp.replicas.labels):
        W, b = np.zeros((60, 10)), None
        for t in range(3):
            W, b, _, _ = delta_fl_round(W, b, xs, ys, lab.seed, t, cfg.clients_per_round,
                                        lab.theta, filter, cfg.learning_rate, cfg.l2_reg,
                                        cfg.batch_size)
        np.testing.assert_allclose(np.asarray(params["kernel"][r], np.float64), W, atol=2e-5,
                                   rtol=1e-4)
    # The evaluated training loss is F_k(w) + (lambda/2)||w||^2 with w = W only.
    losses = exp.evaluate(state.params)["train_loss"]
    W = np.asarray(params["kernel"][0], np.float64)
    want = [client_loss(W, None, xs[k], ys[k], cfg.l2_reg) for k in range(len(xs))]
    np.testing.assert_allclose(losses[0], want, rtol=1e-4, atol=1e-5)


def test_use_bias_is_for_linear_models_only(tiny_synthetic):
    with pytest.raises(ConfigError, match="use_bias"):
        tiny_config(model="mlp", use_bias=False)
    tiny_config(model="linear", use_bias=True)


@pytest.mark.slow
def test_the_flag_and_its_default_on_the_command_line(tmp_path, capsys):
    base = ["--dataset=synthetic", "--synthetic_num_clients=8", "--num_rounds=1",
            "--clients_per_round=2", "--thetas=1", "--eval_every=1"]
    code, err, _ = run_runner(base + ["--nouse_bias", f"--output_dir={tmp_path / 'a'}"], capsys)
    assert code in (0, None), err
    from deltafl_jax import load_model
    assert set(load_model(str(tmp_path / "a"), theta=1.0, seed=1).params["Dense_0"]) == {
        "kernel"}
    code, err, _ = run_runner(base + [f"--output_dir={tmp_path / 'b'}"], capsys)
    assert set(load_model(str(tmp_path / "b"), theta=1.0, seed=1).params["Dense_0"]) == {
        "kernel", "bias"}
    code, err, _ = run_runner(base + ["--model=mlp", "--use_bias",
                                      f"--output_dir={tmp_path / 'c'}"], capsys)
    assert code == 2 and "--use_bias" in err and len(err.strip().splitlines()) == 1


def test_a_saved_femnist_like_model_reloads_without_bias(tiny_synthetic, tmp_path):
    from deltafl_jax import load_model, run_experiment
    data = FederatedDataset("femnist", tiny_synthetic.train, tiny_synthetic.test, 10)
    cfg = tiny_config(output_dir=str(tmp_path / "run"), save_models=True, thetas=(1.0,))
    run_experiment(cfg, data)
    served = load_model(str(tmp_path / "run"), theta=1.0, seed=1)
    assert set(served.params["Dense_0"]) == {"kernel"}
