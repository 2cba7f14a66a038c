"""A 2-D convolution whose weight gradient is an im2col matrix product.

Why: on XLA:CPU the weight-gradient convolution that autodiff emits for `lax.conv` runs about
15x slower inside a loop (`lax.scan`/`while_loop`, jax issue #12868): measured here, 155 ms
against 8 ms for the im2col product below, per batch of 16 FEMNIST images. The forward pass and
the input gradient are ordinary convolutions and stay fast, so only the weight gradient is
rewritten:

    dW[i, j, c, o] = sum_{b, h, w} x_pad[b, h + i, w + j, c] * dy[b, h, w, o]

computed as one matrix product of the (k*k*C, B*H*W) patch matrix with dy reshaped to
(B*H*W, O). The result equals the autodiff gradient to float rounding
(tests/test_models.py checks this).

On a GPU the same holds for lanes: vmapped over the clients, autodiff's weight gradient is a
grouped convolution with one group per lane, and the im2col product is a batched matrix
product. Measured on one H100 (jax 0.11.2, the EMNIST ConvNet's run of 20 replicas, m = 100,
100 lanes; bench/results/conv_impl_gpu.json): 0.91 s a round with the im2col weight gradient,
1.70 s with XLA's (cuDNN's) convolutions, 1.67 s with every pass an im2col product
(:func:`conv2d_im2col`, whose evaluation is 5x slower).

`impl="xla"` keeps plain autodiff, the default on TPU, where it is unmeasured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_DN = ("NHWC", "HWIO", "NHWC")


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_DN)


def _same_pads(k):
    # XLA's SAME padding for stride 1: (k - 1) // 2 before, the rest after.
    return (k - 1) // 2, k - 1 - (k - 1) // 2


def _patches_t(x, kh, kw):
    """[kh*kw*C, B*H*W] patch matrix of an NHWC input, SAME padding, stride 1."""
    b, h, w, c = x.shape
    (ph0, ph1), (pw0, pw1) = _same_pads(kh), _same_pads(kw)
    xt = jnp.pad(jnp.transpose(x, (3, 0, 1, 2)), ((0, 0), (0, 0), (ph0, ph1), (pw0, pw1)))
    cols = [xt[:, :, i:i + h, j:j + w] for i in range(kh) for j in range(kw)]
    return jnp.stack(cols, axis=0).reshape(kh * kw * c, b * h * w)


@jax.custom_vjp
def conv2d_im2col_wgrad(x, w):
    """SAME, stride-1 NHWC x HWIO convolution with an im2col weight gradient."""
    return _conv(x, w)


def _fwd(x, w):
    return _conv(x, w), (x, w)


def _bwd(res, dy):
    x, w = res
    kh, kw, cin, cout = w.shape
    # Input gradient: the transposed convolution, i.e. a SAME convolution of dy with the
    # spatially flipped kernel whose in/out channels are swapped. For even kernels the
    # SAME padding is asymmetric, so pad explicitly with the mirrored split.
    (ph0, ph1), (pw0, pw1) = _same_pads(kh), _same_pads(kw)
    w_t = jnp.flip(w, (0, 1)).swapaxes(2, 3)
    dx = lax.conv_general_dilated(dy, w_t, (1, 1), ((ph1, ph0), (pw1, pw0)),
                                  dimension_numbers=_DN)
    dw = _patches_t(x, kh, kw) @ dy.reshape(-1, cout)
    return dx, dw.reshape(kh, kw, cin, cout).astype(w.dtype)


conv2d_im2col_wgrad.defvjp(_fwd, _bwd)


def conv2d_im2col(x, w):
    """SAME, stride-1 NHWC x HWIO convolution as one matrix product of the [B, H, W, kh*kw*C]
    patches with the [kh*kw*C, O] kernel; autodiff makes both gradients matrix products too.
    Vmapped over lanes (one kernel per client), the three are batched matrix products, where
    the backend's convolution would be a grouped convolution with one group per lane."""
    b, h, wd, c = x.shape
    kh, kw, _, cout = w.shape
    (ph0, ph1), (pw0, pw1) = _same_pads(kh), _same_pads(kw)
    xp = jnp.pad(x, ((0, 0), (ph0, ph1), (pw0, pw1), (0, 0)))
    cols = jnp.concatenate([xp[:, i:i + h, j:j + wd, :] for i in range(kh) for j in range(kw)],
                           axis=-1)
    return cols @ w.reshape(kh * kw * c, cout)


CONV_IMPLS = ("im2col_wgrad", "im2col", "xla")


def conv2d(x, w, impl: str = "im2col_wgrad"):
    """SAME, stride-1 convolution. impl: "im2col_wgrad" (fast in CPU loops), "im2col" (every
    pass a matrix product) or "xla" (the backend's convolutions)."""
    if impl == "xla":
        return _conv(x, w)
    if impl == "im2col_wgrad":
        return conv2d_im2col_wgrad(x, w)
    if impl == "im2col":
        return conv2d_im2col(x, w)
    raise ValueError(f"unknown conv impl {impl!r}; expected one of {', '.join(CONV_IMPLS)}")


def max_pool_2x2(x):
    """2x2/stride-2 max pooling by reshape; its gradient is an elementwise select, which
    XLA:CPU runs 3-4x faster than the select-and-scatter of `reduce_window`."""
    b, h, w, c = x.shape
    if h % 2 or w % 2:
        x = x[:, : h - h % 2, : w - w % 2, :]
        b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def default_conv_impl(backend: str | None = None) -> str:
    """im2col weight gradient on CPU and GPU (see module docstring); the backend's own on TPU,
    where it is unmeasured."""
    backend = backend or jax.default_backend()
    return "xla" if backend == "tpu" else "im2col_wgrad"
