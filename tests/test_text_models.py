"""The text models gru, lstm and sent140_linear.

Shapes, a NumPy re-implementation of each forward pass (GRU / LSTM equations written out here,
mean of GloVe rows), the frozen table staying out of the parameters, and a few plain SGD steps
with jax.grad lowering the loss on a tiny batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.models import ModelOptions, build_model

V, L = 12, 30  # token vocabulary (with PAD=0, UNK=1) and stored tweet length


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def shakespeare_like(n=48, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, 53, (n, 20)).astype(np.uint8) for _ in range(3)]
    ys = [rng.integers(0, 53, n).astype(np.int32) for _ in range(3)]
    split = ClientData.from_clients(xs, ys)
    return FederatedDataset("shakespeare", split, split, 53, None, {"input_vocab_size": 53})


def sent140_like(seed=0):
    rng = np.random.default_rng(seed)
    table = np.concatenate([np.zeros((2, 50)), rng.normal(size=(V - 2, 50))]).astype(np.float32)
    xs, ys = [], []
    for _ in range(3):
        x = np.zeros((8, L), np.int32)
        for row in x:
            n = rng.integers(0, L)
            row[:n] = rng.integers(1, V, n)
        xs.append(x)
        ys.append(rng.integers(0, 2, 8).astype(np.int32))
    split = ClientData.from_clients(xs, ys)
    return FederatedDataset("sent140", split, split, 2, None,
                            {"embeddings": table, "pad_id": 0, "unk_id": 1})


def numpy_gru_logits(p, ids):
    emb = np.asarray(p["Embed_0"]["embedding"])[ids]
    g = jax.tree.map(np.asarray, p["GRUCell_0"])
    h = np.zeros((ids.shape[0], 128), np.float32)
    for t in range(ids.shape[1]):
        x = emb[:, t]
        r = sigmoid(x @ g["ir"]["kernel"] + g["ir"]["bias"] + h @ g["hr"]["kernel"])
        z = sigmoid(x @ g["iz"]["kernel"] + g["iz"]["bias"] + h @ g["hz"]["kernel"])
        n = np.tanh(x @ g["in"]["kernel"] + g["in"]["bias"]
                    + r * (h @ g["hn"]["kernel"] + g["hn"]["bias"]))
        h = (1 - z) * n + z * h
    return h @ np.asarray(p["Dense_0"]["kernel"]) + np.asarray(p["Dense_0"]["bias"])


def numpy_lstm_logit(p, vectors):
    g = jax.tree.map(np.asarray, p["OptimizedLSTMCell_0"])
    b, steps, _ = vectors.shape
    h = np.zeros((b, 50), np.float32)
    c = np.zeros((b, 50), np.float32)
    for t in range(steps):
        x = vectors[:, t]
        gate = {k: x @ g["i" + k]["kernel"] + h @ g["h" + k]["kernel"] + g["h" + k]["bias"]
                for k in "ifgo"}
        c = sigmoid(gate["f"]) * c + sigmoid(gate["i"]) * np.tanh(gate["g"])
        h = sigmoid(gate["o"]) * np.tanh(c)
    return (h @ np.asarray(p["Dense_0"]["kernel"]) + np.asarray(p["Dense_0"]["bias"]))[:, 0]


def sgd_lowers_loss(model, x, y, lr, steps=15):
    params = jax.jit(model.init)(jax.random.key(0))
    loss = jax.jit(lambda p: jnp.mean(model.losses(p, x, y)))
    grad = jax.grad(lambda p: jnp.mean(model.losses(p, x, y)))
    step = jax.jit(lambda p: jax.tree.map(lambda w, d: w - lr * d, p, grad(p)))
    before = float(loss(params))
    for _ in range(steps):
        params = step(params)
    after = float(loss(params))
    assert np.isfinite(after) and after < before - 0.05, (before, after)
    return params


# ----------------------------------------------------------------------------- gru


def test_gru_shapes():
    data = shakespeare_like()
    model = build_model("gru", data)
    params = jax.jit(model.init)(jax.random.key(1))
    assert params["Embed_0"]["embedding"].shape == (53, 8)
    assert params["GRUCell_0"]["hr"]["kernel"].shape == (128, 128)
    assert params["GRUCell_0"]["ir"]["kernel"].shape == (8, 128)
    assert params["Dense_0"]["kernel"].shape == (128, 53)
    assert model.loss_kind == "softmax"
    out = jax.jit(model.apply)(params, data.train.x[:5])
    assert out.shape == (5, 53)
    loss, err = jax.jit(model.losses_and_errors)(params, data.train.x[:5], data.train.y[:5])
    assert loss.shape == err.shape == (5,)


def test_gru_matches_numpy_equations():
    data = shakespeare_like()
    model = build_model("gru", data)
    params = jax.jit(model.init)(jax.random.key(2))
    ids = data.train.x[:5].astype(np.int64)   # the batch of test_gru_shapes: its program
    np.testing.assert_allclose(jax.jit(model.apply)(params, data.train.x[:5]),
                               numpy_gru_logits(params, ids), rtol=2e-4, atol=2e-5)


def test_gru_sgd_lowers_the_loss():
    data = shakespeare_like(n=8)
    model = build_model("gru", data)
    sgd_lowers_loss(model, data.train.x[:16], data.train.y[:16], lr=1.0)


# ----------------------------------------------------------------------------- lstm


def test_lstm_shapes_and_frozen_table():
    data = sent140_like()
    model = build_model("lstm", data)
    params = jax.jit(model.init)(jax.random.key(0))
    shapes = [a.shape for a in jax.tree.leaves(params)]
    assert (V, 50) not in shapes  # the GloVe table is not a parameter
    assert params["OptimizedLSTMCell_0"]["hi"]["kernel"].shape == (50, 50)
    assert params["OptimizedLSTMCell_0"]["ii"]["kernel"].shape == (50, 50)
    assert params["Dense_0"]["kernel"].shape == (50, 1)
    assert model.loss_kind == "sigmoid"
    assert jax.jit(model.apply)(params, data.train.x[:6]).shape == (6, 1)


def test_lstm_reads_the_first_25_tokens_like_numpy():
    data = sent140_like()
    table = data.metadata["embeddings"]
    model = build_model("lstm", data)
    params = jax.jit(model.init)(jax.random.key(3))
    apply = jax.jit(model.apply)
    x = data.train.x[:6]
    expected = numpy_lstm_logit(params, table[x[:, :25]])
    np.testing.assert_allclose(apply(params, x)[:, 0], expected, rtol=2e-4, atol=2e-5)
    # tokens after the 25th do not matter
    changed = x.copy()
    changed[:, 25:] = 5
    np.testing.assert_allclose(apply(params, changed), apply(params, x))


def test_lstm_pads_short_inputs_with_zero_vectors():
    data = sent140_like()
    model = build_model("lstm", data)
    params = jax.jit(model.init)(jax.random.key(4))
    short = np.array([[3, 4, 5]], np.int32)
    padded = np.zeros((1, 25), np.int32)
    padded[0, :3] = [3, 4, 5]
    apply = jax.jit(model.apply)   # one program per length, not one per operation
    np.testing.assert_allclose(apply(params, short), apply(params, padded), rtol=1e-6)


def test_lstm_sgd_lowers_the_loss_and_leaves_the_table():
    data = sent140_like()
    before = data.metadata["embeddings"].copy()
    model = build_model("lstm", data)
    sgd_lowers_loss(model, data.train.x[:16], data.train.y[:16], lr=1.0, steps=20)
    np.testing.assert_array_equal(model.module.table.array, before)


# ----------------------------------------------------------------------------- sent140_linear


def test_sent140_linear_is_zero_initialised_logistic_regression():
    data = sent140_like()
    # The paper's w in R^50 has no bias (App. C.1.2); --use_bias adds one.
    model = build_model("sent140_linear", data)
    params = jax.jit(model.init)(jax.random.key(0))
    assert {k: v.shape for k, v in params["Dense_0"].items()} == {"kernel": (50, 1)}
    biased = jax.jit(build_model("sent140_linear", data, ModelOptions(use_bias=True)).init)(
        jax.random.key(0))
    assert {k: v.shape for k, v in biased["Dense_0"].items()} == {"kernel": (50, 1),
                                                                   "bias": (1,)}
    assert all(float(np.abs(a).max()) == 0.0 for a in jax.tree.leaves(params))
    assert model.loss_kind == "sigmoid"
    # At w = 0 the loss is log 2 for every example.
    loss = jax.jit(model.losses)(params, data.train.x[:8], data.train.y[:8])
    np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)


def test_sent140_linear_scores_the_mean_vector_with_unknowns_as_zeros():
    data = sent140_like()
    table = data.metadata["embeddings"]
    model = build_model("sent140_linear", data, ModelOptions(use_bias=True))
    rng = np.random.default_rng(7)
    w = rng.normal(size=(50, 1)).astype(np.float32)
    params = {"Dense_0": {"kernel": jnp.asarray(w), "bias": jnp.asarray([0.25])}}
    # [word 3, UNK, word 7, PAD, PAD]: mean over 3 tokens, the unknown one counting as zero
    x = np.array([[3, 1, 7, 0, 0], [0, 0, 0, 0, 0], [5, 5, 0, 0, 0]], np.int32)
    means = np.stack([(table[3] + table[7]) / 3.0, np.zeros(50), table[5]])
    np.testing.assert_allclose(jax.jit(model.apply)(params, x)[:, 0], means @ w[:, 0] + 0.25,
                               rtol=1e-5, atol=1e-6)


def test_sent140_linear_sgd_lowers_the_loss():
    data = sent140_like()
    model = build_model("sent140_linear", data)
    sgd_lowers_loss(model, data.train.x, data.train.y, lr=2.0, steps=30)


def test_glove_models_need_embeddings():
    with pytest.raises(ValueError, match="GloVe"):
        build_model("lstm", FederatedDataset("x", sent140_like().train, sent140_like().train,
                                             2, None, {}))
