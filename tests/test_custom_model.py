"""A model of one's own: a Flax module defined outside the package, with its own
per-example loss and error, registered with deltafl_jax.register_model, trains through the
Python API and through ``experiments.run --model_module`` (the documentation's recipe, docs/guides/own-model.md, as written).
Checked against NumPy: one FedAvg round of the model (its loss's gradient, full-batch local
steps, the n_k-weighted average) and the per-client losses and errors the evaluation reports."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltafl_jax
from conftest import run_runner
from deltafl_jax import ExperimentConfig, DataConfig, load_model, run_experiment
from deltafl_jax.models import MODELS, build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------
# The model, defined here, outside the package: a linear map without bias, trained on the
# squared distance of its scores to the one-hot label (least-squares classification).


class ScoresNoBias(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes, use_bias=False)(x.reshape(x.shape[0], -1))


def least_squares(scores, x, y):
    """Per example: 1/2 ||s - e_y||^2, and the misclassification 1[argmax s != y]."""
    target = jax.nn.one_hot(y, scores.shape[-1])
    return (0.5 * jnp.sum(jnp.square(scores - target), axis=-1),
            (jnp.argmax(scores, axis=-1) != y).astype(jnp.float32))


def least_squares_model(data, options):
    return deltafl_jax.Model(name="ls_linear_test", module=ScoresNoBias(data.num_classes),
                             loss_kind="custom", loss_fn=least_squares,
                             example_shape=data.feature_shape, input_dtype=data.train.x_dtype,
                             zero_init=True)


@pytest.fixture(scope="module", autouse=True)
def registered():
    deltafl_jax.register_model("ls_linear_test", least_squares_model, replace=True)
    yield
    MODELS.pop("ls_linear_test", None)


def numpy_losses(W, xs, ys):
    """Per client: (mean 1/2 ||x W - e_y||^2, mean misclassification), in float64."""
    out = []
    for x, y in zip(xs, ys):
        s = x @ W
        e = np.eye(W.shape[1])[y]
        out.append((np.mean(0.5 * np.sum((s - e) ** 2, axis=1)),
                    np.mean(np.argmax(s, axis=1) != y)))
    return np.array(out)


def test_a_model_defined_outside_the_package_trains_through_the_python_api(tiny_synthetic,
                                                                          tmp_path):
    data = tiny_synthetic
    xs = [data.train.client(k)[0].astype(np.float64) for k in range(data.train.num_clients)]
    ys = [data.train.client(k)[1] for k in range(data.train.num_clients)]
    n = np.array([len(y) for y in ys], np.float64)
    lr = 0.002
    config = ExperimentConfig(data=DataConfig("synthetic"), model="ls_linear_test",
                              algorithm="deltafl", thetas=(1.0,), seeds=(1,), num_rounds=1,
                              clients_per_round=data.train.num_clients, local_epochs=1,
                              batch_size=int(n.max()), learning_rate=lr, eval_every=1,
                              output_dir=str(tmp_path / "run"), verbose=False,
                              tensorboard=False)
    result = run_experiment(config, data=data)

    # One FedAvg round from w_0 = 0, every client one full-batch step on its own loss:
    # grad_W = X^T (X W - E) / n_k; the server averages the local models with weights n_k.
    W0 = np.zeros((xs[0].shape[1], data.num_classes))
    local = [W0 - lr * x.T @ (x @ W0 - np.eye(data.num_classes)[y]) / len(y)
             for x, y in zip(xs, ys)]
    W1 = sum(nk * w for nk, w in zip(n, local)) / n.sum()
    got = np.asarray(result.served["Dense_0"]["kernel"][0], np.float64)
    np.testing.assert_allclose(got, W1, rtol=2e-5, atol=1e-7)

    # The evaluation used the model's own loss and error (clients.npz, metrics.jsonl).
    clients = np.load(tmp_path / "run" / "clients.npz")
    want = numpy_losses(got, xs, ys)
    np.testing.assert_allclose(clients["train_loss"][0], want[:, 0], rtol=1e-5)
    np.testing.assert_allclose(clients["train_error"][0], want[:, 1], atol=1e-6)
    (record,) = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert record["train_loss_mean"] == pytest.approx(want[:, 0] @ (n / n.sum()), rel=1e-5)
    assert record["train_loss_mean"] < 0.5   # 1/2 ||0 - e_y||^2 = 1/2 at w_0 = 0

    # Served by name, once registered, like a built-in model.
    served = load_model(str(tmp_path / "run"), theta=1.0, seed=1)
    x = xs[0][:5].astype(np.float32)
    np.testing.assert_array_equal(served.predict_labels(x), np.argmax(x @ got, axis=1))


def test_registration_refuses_taken_names():
    with pytest.raises(ValueError, match="built in"):
        deltafl_jax.register_model("linear", least_squares_model)
    with pytest.raises(ValueError, match="registered already"):
        deltafl_jax.register_model("ls_linear_test", least_squares_model)
    with pytest.raises(ValueError, match="loss_kind='custom'"):
        deltafl_jax.Model(name="x", module=ScoresNoBias(3), loss_kind="softmax",
                          loss_fn=least_squares, example_shape=(4,))
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        build_model("nope", None)


def readme_recipe():
    """The documentation's `# my_models.py` block (docs/guides/own-model.md), as written."""
    text = open(os.path.join(REPO, "docs", "guides", "own-model.md")).read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if b.startswith("# my_models.py")]
    return block


TINY = ["--dataset=synthetic", "--synthetic_num_clients=24", "--synthetic_max_examples=80",
        "--synthetic_shared=0.8", "--thetas=1,0.5", "--seeds=1", "--num_rounds=12",
        "--clients_per_round=6", "--batch_size=16", "--learning_rate=0.05", "--eval_every=4",
        "--tensorboard=no"]


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_the_readmes_recipe_trains_through_experiments_run(tmp_path, capsys):
    path = tmp_path / "my_models.py"
    path.write_text(readme_recipe())
    out = tmp_path / "run"
    try:
        code, err, stdout = run_runner([*TINY, f"--model_module={path}", "--model=two_layer",
                                        f"--output_dir={out}"], capsys)
        assert code == 0, err
        assert "model two_layer" in stdout and "test err mean" in stdout
        recs = [json.loads(l) for l in open(out / "metrics.jsonl")]
        first, last = ([r for r in recs if r["round"] == t and r["theta"] == 1.0][0]
                       for t in (4, 12))
        assert last["train_loss_mean"] < first["train_loss_mean"]
        # The reported losses are the recipe's hinge loss of the saved network (NumPy).
        data = deltafl_jax.load_dataset(DataConfig("synthetic", synthetic_num_clients=24,
                                                   synthetic_max_examples=80,
                                                   synthetic_shared=0.8))
        clients = np.load(out / "clients.npz")
        keys = list(clients["replica_keys"])
        for theta in (1.0, 0.5):
            p = load_model(str(out), theta=theta, seed=1).params
            r = keys.index(f"theta={theta:g}_seed=1")
            for k in range(data.train.num_clients):
                x, y = data.train.client(k)
                x = x.astype(np.float64)
                h = np.maximum(x @ np.asarray(p["Dense_0"]["kernel"], np.float64)
                               + np.asarray(p["Dense_0"]["bias"], np.float64), 0.0)
                s = h @ np.asarray(p["Dense_1"]["kernel"], np.float64) + \
                    np.asarray(p["Dense_1"]["bias"], np.float64)
                wrong = 1.0 - np.eye(s.shape[1])[y]
                loss = np.max(s + wrong, axis=1) - s[np.arange(len(y)), y]
                assert clients["train_loss"][r, k] == pytest.approx(loss.mean(), rel=1e-4)
                assert clients["train_error"][r, k] == pytest.approx(
                    np.mean(np.argmax(s, axis=1) != y), abs=1e-6)
    finally:
        MODELS.pop("two_layer", None)
    # A module that cannot be imported: one line, exit code 2.
    code, err, _ = run_runner([*TINY, f"--model_module={tmp_path / 'absent.py'}",
                               "--model=two_layer", f"--output_dir={tmp_path / 'x'}"], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and lines == [f"error: --model_module={tmp_path / 'absent.py'}: no such "
                                   f"file"]
    assert not (tmp_path / "x").exists()
