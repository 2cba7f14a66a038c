"""The convolutions and pooling of the image models (:mod:`deltafl_jax.models.image`), each
on the fast path of :func:`deltafl_jax.models.conv.conv_general` (the forward convolution XLA's
own, the weight gradient an im2col product, the input gradient an ordinary convolution), the
path that every ``nn.Conv`` of a model of one's own takes as well
(:mod:`deltafl_jax.models.conv_intercept`):

- :func:`conv_same`: SAME, stride 1;
- :func:`conv_valid`: VALID, stride 1;
- :func:`conv_stride2`: k x k at stride 2 with padding (k - 1) / 2 on each side (PyTorch's
  ``padding=1`` for 3 x 3, the ResNets' downsampling convolution);
- :func:`conv1x1_stride2`: 1 x 1 at stride 2 (the ResNets' projection shortcut): the input at
  the even rows and columns times the [C_in, C_out] kernel, a matrix product.

``bench/image_convs.py`` measures them in lanes against XLA's own convolutions
(docs/reference/models.md quotes the ratios). ``impl="xla"`` keeps XLA's convolutions and plain
autodiff, the better choice where the backend's convolution gradients are fast (TPU);
``impl="im2col"`` computes the forward pass as a matrix product too.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from deltafl_jax.models.conv import conv2d, conv_fast, conv_patches_kept, im2col_forward

_DN = ("NHWC", "HWIO", "NHWC")


def conv_padded(x, w, strides, pads, impl: str):
    """NHWC x HWIO convolution with explicit (lo, hi) `pads` per spatial axis on the path of
    `impl`: "xla", "im2col", "im2col_wgrad", "winograd" (3 x 3 at stride 1; the others as
    "im2col_wgrad") or "patches_kept" (a first layer's, :func:`input_layer_impl`)."""
    if impl == "xla":
        return lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=_DN)
    if impl == "im2col":
        return im2col_forward(x, w, strides, pads)
    if impl == "patches_kept":
        return conv_patches_kept(x, w, tuple(strides), tuple(tuple(p) for p in pads))
    return conv_fast(x, w, tuple(strides), tuple(pads), (1, 1), 1, impl)


def input_layer_impl(impl: str) -> str:
    """The path for a network's first convolution, whose input, the data, needs no gradient:
    "patches_kept" (:func:`deltafl_jax.models.conv.conv_patches_kept`) where `impl` is
    "winograd". Winograd's F(m x m, 3 x 3) saves multiplies in all three products, but a first
    layer computes two of them, over 1-3 input channels (the transformed products
    [tiles, C] x [C, O] at C = 3), while one im2col product for each (k*k*C = 27 wide) runs at
    full width. Measured on the 2-core CPU, a loop of local steps of pfl-research's CNN: 6.41
    ms a step with its first layer on XLA's forward convolution and the im2col weight gradient
    against 7.07 ms with both layers on Winograd; the forward pass as the im2col product
    whose patches the weight gradient reuses was faster again (its first layer alone 0.69
    against 1.05 ms a step, docs/benchmarks/pfl-research.md)."""
    return "patches_kept" if impl == "winograd" else impl


def conv_same(x, w, impl: str):
    """SAME, stride 1 (:func:`deltafl_jax.models.conv.conv2d`)."""
    return conv2d(x, w, impl)


def conv_valid(x, w, impl: str):
    """VALID, stride 1: out[b, i, j] = sum_{di, dj, c} x[b, i + di, j + dj, c] w[di, dj, c]."""
    return conv_padded(x, w, (1, 1), ((0, 0), (0, 0)), impl)


def conv_stride2(x, w, impl: str):
    """k x k, stride 2, padding (k - 1) // 2 on each side: out[b, i] reads input rows
    2i - (k - 1)/2 .. 2i + (k - 1)/2 (zeros outside)."""
    kh, kw = w.shape[:2]
    return conv_padded(x, w, (2, 2), (((kh - 1) // 2,) * 2, ((kw - 1) // 2,) * 2), impl)


def conv1x1_stride2(x, w):
    """1 x 1, stride 2: x at the even rows and columns times w [1, 1, C_in, C_out]."""
    return jnp.einsum("bhwc,co->bhwo", x[:, ::2, ::2, :], w[0, 0])


def max_pool_3x3_stride2_same(x):
    """3 x 3 max pooling at stride 2 with XLA's SAME padding (-inf; for even H one row after,
    none before), the TensorFlow tutorial's pooling, as the maximum of nine strided slices: its
    gradient is a select per slice rather than ``reduce_window``'s select-and-scatter."""
    b, h, w, c = x.shape
    oh, ow = (h + 1) // 2, (w + 1) // 2
    ph, pw = max((oh - 1) * 2 + 3 - h, 0), max((ow - 1) * 2 + 3 - w, 0)
    xp = jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)),
                 constant_values=-jnp.inf)
    out = None
    for i in range(3):
        for j in range(3):
            s = xp[:, i:i + 2 * oh - 1:2, j:j + 2 * ow - 1:2, :]
            out = s if out is None else jnp.maximum(out, s)
    return out


def local_response_norm(x, radius: int = 4, bias: float = 1.0, alpha: float = 0.001 / 9.0,
                        beta: float = 0.75):
    """TensorFlow's ``tf.nn.lrn`` over the channels (the tutorial's settings by default):
    x_c / (bias + alpha * sum_{|c' - c| <= radius} x_{c'}^2) ** beta."""
    sq = jnp.square(x)
    c = x.shape[-1]
    padded = jnp.pad(sq, ((0, 0),) * (x.ndim - 1) + ((radius, radius),))
    window = sum(padded[..., d:d + c] for d in range(2 * radius + 1))
    return x / jnp.power(bias + alpha * window, beta)
