"""The convolutions and pooling of the image models (:mod:`deltafl_jax.models.image`), each
written so that its weight gradient goes through the fast SAME path of
:mod:`deltafl_jax.models.conv` on the CPU.

XLA:CPU's own weight-gradient convolution is slow inside the lanes' loops (see
:mod:`deltafl_jax.models.conv`), and :func:`~deltafl_jax.models.conv.conv2d` covers SAME
padding at stride 1 only. The other convolutions the image models need are that convolution
followed by a slice, exactly (the same sums over the same pixels):

- VALID, odd k: the SAME output with (k - 1) / 2 rows and columns cropped at each border;
- k x k at stride 2 with padding (k - 1) / 2 on each side (PyTorch's ``padding=1`` for 3 x 3,
  the ResNets' downsampling convolution): the SAME output at the even rows and columns;
- 1 x 1 at stride 2 (the ResNets' projection shortcut): the input at the even rows and columns
  times the [C_in, C_out] kernel, a matrix product.

The first two compute the full-resolution output and throw part of it away (for 3 x 3 VALID
on 32 x 32 about 14% more multiplies; for stride 2 four times the forward multiplies of that
layer); ``bench/image_convs.py`` measured them in lanes against XLA's own VALID and strided
convolutions (docs/guides/own-model.md quotes the ratios). ``impl="xla"`` keeps XLA's
convolutions and plain autodiff, the better choice where the backend's convolution gradients
are fast (GPU cuDNN, TPU).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from deltafl_jax.models.conv import conv2d

_DN = ("NHWC", "HWIO", "NHWC")


def conv_same(x, w, impl: str):
    """SAME, stride 1 (:func:`deltafl_jax.models.conv.conv2d`)."""
    return conv2d(x, w, impl)


def conv_valid(x, w, impl: str):
    """VALID, stride 1, odd kernel: out[b, i, j] = sum_{di, dj, c} x[b, i + di, j + dj, c]
    w[di, dj, c]."""
    kh, kw = w.shape[:2]
    if impl == "xla":
        return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=_DN)
    if kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"conv_valid: the SAME path needs an odd kernel, got {kh}x{kw}")
    ph, pw = (kh - 1) // 2, (kw - 1) // 2
    y = conv2d(x, w, impl)
    return y[:, ph:y.shape[1] - ph, pw:y.shape[2] - pw, :]


def conv_stride2(x, w, impl: str):
    """k x k (odd), stride 2, padding (k - 1) / 2 on each side: out[b, i] reads input rows
    2i - (k - 1)/2 .. 2i + (k - 1)/2 (zeros outside), output size ceil(H / 2)."""
    kh, kw = w.shape[:2]
    if impl == "xla":
        pads = (((kh - 1) // 2,) * 2, ((kw - 1) // 2,) * 2)
        return lax.conv_general_dilated(x, w, (2, 2), pads, dimension_numbers=_DN)
    return conv2d(x, w, impl)[:, ::2, ::2, :]


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
