"""Models: shapes, losses against NumPy, and the CPU convolution against autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from deltafl_jax import ClientData, FederatedDataset
from deltafl_jax.models import ModelOptions, build_model
from deltafl_jax.models.conv import conv2d, max_pool_2x2


def image_dataset(n=4, classes=62):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(n, 28, 28)).astype(np.uint8)
    y = rng.integers(0, classes, size=n).astype(np.int32)
    split = ClientData(x=x, y=y, offsets=np.array([0, n]), client_ids=np.array([0]))
    return FederatedDataset("img", split, split, num_classes=classes, x_scale=1 / 255)


@pytest.mark.parametrize("impl", ["im2col_wgrad", "im2col"])
@pytest.mark.parametrize("k,cin,cout", [(5, 1, 32), (5, 32, 64), (3, 4, 2), (4, 3, 5)])
def test_im2col_weight_gradient_equals_autodiff(k, cin, cout, impl):
    rng = np.random.default_rng(k + cin)
    x = rng.normal(size=(3, 9, 7, cin)).astype(np.float32)   # inputs made on the host
    w = rng.normal(size=(k, k, cin, cout)).astype(np.float32)
    target = jnp.asarray(rng.normal(size=(3, 9, 7, cout)).astype(np.float32))

    def loss(impl):
        return lambda x, w: jnp.sum(jnp.sin(conv2d(x, w, impl)) * target)

    @jax.jit   # one program, not one compile per operation run eagerly
    def both(x, w):
        return ((conv2d(x, w, impl), conv2d(x, w, "xla")),
                jax.grad(loss(impl), argnums=(0, 1))(x, w),
                jax.grad(loss("xla"), argnums=(0, 1))(x, w))

    (out, ref), (gx, gw), (rx, rw) = both(x, w)
    # sums of k*k*cin terms of size ~1: float32 rounding reaches ~1e-5 of sqrt(800)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    # float32 rounding of sums of ~200-800 terms: relative to the gradient's scale
    np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-5 * float(np.abs(rw).max()) + 1e-4)
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-5 * float(np.abs(rx).max()) + 1e-4)


def test_max_pool_matches_numpy():
    x = np.random.default_rng(1).normal(size=(2, 6, 4, 3)).astype(np.float32)
    ref = x.reshape(2, 3, 2, 2, 2, 3).max(axis=(2, 4))
    np.testing.assert_array_equal(max_pool_2x2(jnp.asarray(x)), ref)
    ref_rw = lax.reduce_window(x, -np.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    np.testing.assert_array_equal(ref, ref_rw)


@pytest.mark.slow   # a long end-to-end check: CI's second step
def test_cnn_is_the_papers_convnet_and_both_impls_agree():
    data = image_dataset()
    a = build_model("cnn", data, ModelOptions(conv_impl="im2col_wgrad"))
    b = build_model("cnn", data, ModelOptions(conv_impl="xla"))
    params = a.init(jax.random.key(0))
    shapes = {k: v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    sizes = sorted(int(np.prod(s)) for s in shapes.values())
    # conv 5x5x1x32 + 32, conv 5x5x32x64 + 64, dense 7*7*64 x 62 + 62 (App. C.1.1)
    assert sizes == sorted([800, 32, 51200, 64, 3136 * 62, 62])
    x, y = data.train.x, data.train.y
    assert a.apply(params, x).shape == (4, 62)
    ga = jax.grad(lambda p: a.losses(p, x, y).mean())(params)
    gb = jax.grad(lambda p: b.losses(p, x, y).mean())(params)
    for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)


def test_losses_against_numpy():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 7)).astype(np.float32)
    y = rng.integers(0, 3, size=5).astype(np.int32)
    split = ClientData(x=x, y=y, offsets=np.array([0, 5]), client_ids=np.array([0]))
    data = FederatedDataset("t", split, split, num_classes=3)
    model = build_model("mlp", data, ModelOptions(mlp_hidden=(4,)))
    params = jax.jit(model.init)(jax.random.key(1))
    logits = np.asarray(jax.jit(model.apply)(params, x), np.float64)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    loss, err = jax.jit(model.losses_and_errors)(params, x, y)
    np.testing.assert_allclose(loss, -logp[np.arange(5), y], rtol=1e-5)
    np.testing.assert_array_equal(err, (logits.argmax(1) != y).astype(np.float32))
    # Linear: zero initialisation (reference code), loss log C.
    lin = build_model("linear", data)
    p0 = jax.jit(lin.init)(jax.random.key(0))
    assert all(np.all(np.asarray(v) == 0) for v in jax.tree.leaves(p0))
    np.testing.assert_allclose(jax.jit(lin.losses)(p0, x, y), np.log(3), rtol=1e-6)
    # Mean estimation: the squared distance to the point w.
    mean_split = ClientData(x=x[:, :2], y=None, offsets=np.array([0, 5]),
                            client_ids=np.array([0]))
    mean_model = build_model("mean", FederatedDataset("m", mean_split, mean_split, 0))
    w = {"w": jnp.asarray([0.5, -1.0])}
    np.testing.assert_allclose(jax.jit(mean_model.losses)(w, x[:, :2], None),
                               ((x[:, :2] - [0.5, -1.0]) ** 2).sum(1), rtol=1e-5)


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="unknown model 'nope'.*cnn"):
        build_model("nope", image_dataset())
    with pytest.raises(ValueError, match="classification"):
        split = ClientData(x=np.zeros((2, 2), np.float32), y=None, offsets=np.array([0, 2]),
                           client_ids=np.array([0]))
        build_model("linear", FederatedDataset("m", split, split, 0))


@pytest.mark.parametrize("shape", [(128, 128), (50, 200), (200, 50), (3, 4, 5)])
def test_orthogonal_init_equals_jax_qr_initialiser_without_lapack(shape):
    from deltafl_jax.models.init import orthogonal
    key = jax.random.key(7)
    init = jax.jit(orthogonal(), static_argnums=1)
    ours = init(key, shape)
    ref = jax.jit(jax.nn.initializers.orthogonal(), static_argnums=1)(key, shape)   # by QR
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    lowered = init.lower(key, shape).as_text()
    assert "lapack" not in lowered.lower()


def test_no_model_initialisation_calls_lapack(tmp_path):
    """jaxlib 0.10's CPU LAPACK kernels can deadlock XLA's thread pool when several run at
    once; the replicas' jitted, vmapped initialisation must not contain any."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from llm_fixtures import tiny_base
    from test_text_models import sent140_like, shakespeare_like
    from deltafl_jax.models import model_names

    # --model=llama: a tiny pretrained base and stored token sequences (its LoRA adapters are
    # what the replicas initialise).
    base = str(tmp_path / "base")
    vocab = tiny_base(base).get_vocab_size()
    tokens = ClientData(x=np.arange(12, dtype=np.int32).reshape(2, 6) % vocab, y=None,
                        offsets=np.array([0, 2]), client_ids=np.array([0]))
    text = FederatedDataset("text:rows", tokens, tokens, vocab, metadata={
        "task": "causal_lm", "base_model": base, "input_vocab_size": vocab})

    words = ClientData(x=np.array([[6, 1, 2, 7, 0], [6, 3, 7, 0, 0]], np.int32), y=None,
                       offsets=np.array([0, 2]), client_ids=np.array(["u"]))
    next_word = FederatedDataset("stackoverflow", words, words, 8, metadata={
        "task": "next_word_prediction", "input_vocab_size": 8, "pad_id": 0, "eos_id": 7})
    datasets = {"gru": shakespeare_like(), "lstm": sent140_like(),
                "sent140_linear": sent140_like(), "mean": None, "lstm_nwp": next_word,
                "llama": text}
    for name in model_names():
        data = datasets.get(name, image_dataset())
        if name == "mean":
            split = ClientData(x=np.zeros((2, 2), np.float32), y=None, offsets=np.array([0, 2]),
                               client_ids=np.array([0]))
            data = FederatedDataset("m", split, split, 0)
        model = build_model(name, data)
        keys = jax.vmap(jax.random.key)(jnp.arange(3, dtype=jnp.uint32))
        text = jax.jit(jax.vmap(model.init)).lower(keys).as_text().lower()
        assert "lapack" not in text, name
