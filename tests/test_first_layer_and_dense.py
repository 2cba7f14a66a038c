"""The two CPU paths of pfl-research's CNN besides Winograd's convolutions
(``--conv_impl=winograd``): the first layer as one im2col product whose patches its weight
gradient reuses (``conv.conv_patches_kept``), and the dense layer whose weight gradient is a
sum of the minibatch's outer products (``models.dense``), each against XLA's convolution or
matrix product under autodiff and against NumPy in float64."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from deltafl_jax.models.conv import conv_patches_kept
from deltafl_jax.models.dense import OUTER_MAX_BATCH, dense_outer_grad
from deltafl_jax.models.image import PflCNN

DN = ("NHWC", "HWIO", "NHWC")

# (input [B, H, W, C], kernel [kh, kw, C, O], strides, ((lo, hi), (lo, hi)))
CASES = {
    "valid_3x3": ((2, 9, 8, 3), (3, 3, 3, 5), (1, 1), ((0, 0), (0, 0))),
    "same_3x3": ((2, 7, 7, 3), (3, 3, 3, 4), (1, 1), ((1, 1), (1, 1))),
    "stride2_5x5": ((1, 11, 10, 2), (5, 5, 2, 3), (2, 2), ((2, 2), (2, 1))),
    "asymmetric": ((3, 6, 9, 1), (3, 2, 1, 6), (1, 2), ((0, 2), (1, 0))),
}


def assert_close(got, ref, rtol=1e-5):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * float(np.max(np.abs(ref))))


@pytest.mark.parametrize("case", sorted(CASES))
def test_patches_kept_equals_xla_convolution_and_its_gradients(case):
    xs, ks, strides, pads = CASES[case]
    rng = np.random.default_rng(len(case))
    x = jnp.asarray(rng.normal(size=xs), jnp.float32)
    w = jnp.asarray(rng.normal(size=ks), jnp.float32)

    def xla(a, b):
        return lax.conv_general_dilated(a, b, strides, pads, dimension_numbers=DN)

    def kept(a, b):
        return conv_patches_kept(a, b, strides, pads)

    def both(a, b):   # one program: values and the gradients of a weighted sum
        out = []
        for f in (xla, kept):
            y, vjp = jax.vjp(f, a, b)
            out.append((y,) + vjp(jnp.cos(y)))
        return out

    ref, got = jax.jit(both)(x, w)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert_close(g, r)


def np_dense_grads(h, k, b, dz):
    """float64: y = h k + b; dh = dz k^T, dk = h^T dz, db = sum_b dz."""
    h, k, dz = (np.asarray(a, np.float64) for a in (h, k, dz))
    return h @ k + np.asarray(b, np.float64), dz @ k.T, h.T @ dz, dz.sum(0)


@pytest.mark.parametrize("batch", [1, 10, OUTER_MAX_BATCH + 1])
def test_dense_outer_grad_equals_the_matrix_products(batch):
    """Values and the three gradients equal NumPy's float64 products and XLA's dense layer
    under autodiff, whether the batch takes the outer products (<= OUTER_MAX_BATCH) or the
    matrix product."""
    rng = np.random.default_rng(batch)
    h, k = rng.normal(size=(batch, 37)), rng.normal(size=(37, 6))
    b, dz = rng.normal(size=6), rng.normal(size=(batch, 6))
    args = [jnp.asarray(a, jnp.float32) for a in (h, k, b)]

    def both(h, k, b, dz):
        out = []
        for f in (dense_outer_grad, lambda h, k, b: h @ k + b):
            y, vjp = jax.vjp(f, h, k, b)
            out.append((y,) + vjp(dz))
        return out

    got, xla = jax.jit(both)(*args, jnp.asarray(dz, jnp.float32))
    for g, x, r in zip(got, xla, np_dense_grads(h, k, b, dz)):
        assert_close(g, r)
        assert_close(g, x)


def products_of_shape(hlo: str, shape) -> list:
    dims = ",".join(str(d) for d in shape)
    return re.findall(rf"= f32\[{dims}\]\{{[\d,]*\}} dot\(", hlo)


def test_outer_grad_is_fused_into_the_sgd_update():
    """In an SGD step (kernel - lr * gradient) of a small batch no matrix product makes the
    [N, M] weight gradient: XLA computes it inside the update's elementwise pass. With a batch
    over OUTER_MAX_BATCH, the matrix product is there (the check can fail)."""
    n, m = 48, 8

    def step_hlo(batch):
        def step(k, b, h):
            g = jax.grad(lambda k: jnp.sum(jnp.tanh(dense_outer_grad(h, k, b))))(k)
            return k - 0.1 * g

        args = (jnp.ones((n, m)), jnp.zeros((m,)), jnp.ones((batch, n)))
        return jax.jit(step).lower(*args).compile().as_text()

    assert products_of_shape(step_hlo(10), (n, m)) == []
    assert products_of_shape(step_hlo(OUTER_MAX_BATCH + 1), (n, m))


def test_pfl_cnn_keeps_its_parameters_on_every_path():
    """The CPU path's dense layer has nn.Dense's parameters: the same names and shapes, so
    models and checkpoints move between paths."""
    x = jnp.ones((2, 12, 12, 3), jnp.float32)
    shapes = [jax.tree.map(jnp.shape, jax.eval_shape(PflCNN(10, conv_impl=impl).init,
                                                     jax.random.key(0), x))
              for impl in ("winograd", "xla")]
    assert shapes[0] == shapes[1]
