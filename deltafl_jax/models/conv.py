"""2-D convolutions whose weight gradient is an im2col matrix product, for any padding, stride,
kernel dilation and feature-group count.

Why: on XLA:CPU the weight-gradient convolution that autodiff emits for `lax.conv` runs about
15x slower inside a loop (`lax.scan`/`while_loop`, jax issue #12868): measured here, 155 ms
against 8 ms for the im2col product below, per batch of 16 FEMNIST images. The forward pass is
XLA's own convolution, unchanged; only the backward pass is rewritten. For a convolution of an
NHWC input x (padded by p to x_pad) with an HWIO kernel w, strides s, kernel dilation d:

    y[b, h, w, o]  = sum_{i, j, c} x_pad[b, s h + d i, s w + d j, c] w[i, j, c, o]
    dW[i, j, c, o] = sum_{b, h, w} x_pad[b, s h + d i, s w + d j, c] dy[b, h, w, o]

computed as one matrix product of the (k*k*C, B*H_out*W_out) patch matrix with dy reshaped to
(B*H_out*W_out, O) (with G feature groups, G such products, each over its C/G input and O/G
output channels). The input gradient is a stride-1 convolution of dy, dilated by the stride
(s - 1 zeros between rows and columns) and padded by (d (k - 1) - p_lo, d (k - 1) - p_hi +
the rows the forward pass's stride skipped), with the spatially flipped kernel whose in/out
channels are swapped: XLA:CPU runs it on its ordinary convolution path, where autodiff's
transposed convolution (the same sums, written with swapped kernel dimension numbers) measured
4.7x slower for pfl-research's 3x3 VALID layer. The results equal the autodiff gradients to
float rounding (tests/test_models.py, tests/test_conv_intercept.py).

On a GPU the same holds for lanes: vmapped over the clients, autodiff's weight gradient is a
grouped convolution with one group per lane, and the im2col product is a batched matrix
product. Measured on one H100 (jax 0.11.2, the EMNIST ConvNet's run of 20 replicas, m = 100,
100 lanes; bench/results/conv_impl_gpu.json): 0.91 s a round with the im2col weight gradient,
1.70 s with XLA's (cuDNN's) convolutions, 1.67 s with every pass an im2col product
(:func:`conv2d_im2col`, whose evaluation is 5x slower).

`impl="xla"` keeps plain autodiff, the default on TPU, where it is unmeasured.
:mod:`deltafl_jax.models.conv_intercept` routes every ``flax.linen.Conv`` of a model through
:func:`conv_general`.
"""

from __future__ import annotations

import functools
from typing import Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_DN = ("NHWC", "HWIO", "NHWC")

Pads = Tuple[Tuple[int, int], Tuple[int, int]]


def explicit_pads(padding: Union[str, Sequence], kernel_shape, strides, dilation,
                  in_shape) -> Pads:
    """(lo, hi) pairs for the two spatial axes of `padding` ("SAME", "VALID" or pairs),
    as XLA computes them for the dilated kernel."""
    if isinstance(padding, str):
        eff = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilation)]
        return tuple(tuple(int(v) for v in p)
                     for p in lax.padtype_to_pads(in_shape, eff, strides, padding))
    return tuple((int(lo), int(hi)) for lo, hi in padding)


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_DN)


def _out_size(n, k, s, d, pad):
    return (n + pad[0] + pad[1] - (d * (k - 1) + 1)) // s + 1


def _forward(x, w, strides, padding, dilation, groups):
    return lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation,
                                    dimension_numbers=_DN, feature_group_count=groups)


def _pad(x, pads):
    """Zero padding by (lo, hi) per axis; negative values crop."""
    return lax.pad(x, jnp.zeros((), x.dtype), tuple((lo, hi, 0) for lo, hi in pads))


def _patches_t(x, kshape, strides, pads: Pads, dilation, out_hw):
    """[kh*kw*C, B*H_out*W_out] patch matrix of an NHWC input: row (i, j, c), column (b, h, w)
    holds x_pad[b, s h + d i, s w + d j, c]."""
    b, _, _, c = x.shape
    (kh, kw), (sh, sw), (dh, dw), (oh, ow) = kshape, strides, dilation, out_hw
    xt = _pad(jnp.transpose(x, (3, 0, 1, 2)), ((0, 0), (0, 0)) + tuple(pads))
    cols = [xt[:, :, dh * i:dh * i + sh * (oh - 1) + 1:sh, dw * j:dw * j + sw * (ow - 1) + 1:sw]
            for i in range(kh) for j in range(kw)]
    return jnp.stack(cols, axis=0).reshape(kh * kw * c, b * oh * ow)


def _weight_grad(x, dy, kshape, strides, pads, dilation, groups):
    """dW [kh, kw, C/G, O] as im2col products (module docstring)."""
    kh, kw = kshape
    c, cout = x.shape[-1], dy.shape[-1]
    cols = _patches_t(x, kshape, strides, pads, dilation, dy.shape[1:3])
    if groups == 1:
        return (cols @ dy.reshape(-1, cout)).reshape(kh, kw, c, cout)
    cg, og = c // groups, cout // groups
    cols = cols.reshape(kh * kw, groups, cg, -1).transpose(1, 0, 2, 3).reshape(groups, -1,
                                                                               cols.shape[-1])
    dyg = dy.reshape(-1, groups, og).transpose(1, 0, 2)
    dw = jnp.matmul(cols, dyg)                                   # [G, kh*kw*C/G, O/G]
    return dw.reshape(groups, kh, kw, cg, og).transpose(1, 2, 3, 0, 4).reshape(kh, kw, cg, cout)


def _transposed_kernel(w, groups):
    """The flipped kernel with in/out channels swapped within each group: [kh, kw, O/G, C]."""
    kh, kw, cg, cout = w.shape
    og = cout // groups
    wf = jnp.flip(w, (0, 1))
    if groups == 1:
        return wf.swapaxes(2, 3)
    return wf.reshape(kh, kw, cg, groups, og).transpose(0, 1, 4, 3, 2).reshape(
        kh, kw, og, groups * cg)


def _input_grad(dy, w, in_hw, strides, pads: Pads, dilation, groups):
    """dX: dy dilated by the stride, padded, convolved (stride 1) with the transposed kernel."""
    kh, kw = w.shape[:2]
    edges = []
    for n, k, s, d, (lo, _), o in zip(in_hw, (kh, kw), strides, dilation, pads, dy.shape[1:3]):
        before = d * (k - 1) - lo
        edges.append((before, n + d * (k - 1) - ((o - 1) * s + 1) - before, s - 1))
    if all(lo >= 0 and hi >= 0 and s == 0 for lo, hi, s in edges):
        pad = tuple((lo, hi) for lo, hi, _ in edges)
    else:
        dy = lax.pad(dy, jnp.zeros((), dy.dtype), ((0, 0, 0),) + tuple(edges) + ((0, 0, 0),))
        pad = ((0, 0), (0, 0))
    return lax.conv_general_dilated(dy, _transposed_kernel(w, groups), (1, 1), pad,
                                    rhs_dilation=dilation, dimension_numbers=_DN,
                                    feature_group_count=groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def conv_general(x, w, strides=(1, 1), padding: Pads = ((0, 0), (0, 0)), dilation=(1, 1),
                 groups: int = 1):
    """NHWC x HWIO convolution (explicit (lo, hi) `padding`, `strides`, kernel `dilation`,
    `groups` feature groups): XLA's forward, the backward pass of the module docstring."""
    return _forward(x, w, strides, padding, dilation, groups)


def _general_fwd(x, w, strides, padding, dilation, groups):
    return _forward(x, w, strides, padding, dilation, groups), (x, w)


def _general_bwd(strides, padding, dilation, groups, res, dy):
    x, w = res
    dx = _input_grad(dy, w, x.shape[1:3], strides, padding, dilation, groups)
    dw = _weight_grad(x, dy, w.shape[:2], strides, padding, dilation, groups)
    return dx.astype(x.dtype), dw.astype(w.dtype)


conv_general.defvjp(_general_fwd, _general_bwd)


# Winograd's minimal filtering F(2x2, 3x3) (Lavin & Gray 2016, eq. 8):
#     Y = A^T [ (G g G^T) * (B^T d B) ] A
# for a 4 x 4 input tile d (tiles 2 apart), a 3 x 3 kernel g and a 2 x 2 output tile Y.
# Summed over the input channels, the elementwise product is one matrix product per tile
# position (xi, nu) of the 16: M[xi nu] = V[xi nu] @ U[xi nu], V [tiles, C], U [C, O].
_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
_G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])


def _weighted(coefs, parts):
    """sum_k coefs[k] parts[k] over the nonzero coefficients (+-1 without a multiply)."""
    terms = [p if c == 1 else -p if c == -1 else float(c) * p
             for c, p in zip(np.ravel(coefs).tolist(), parts) if c != 0]
    return functools.reduce(lambda a, b: a + b, terms)


def _sandwich(left, parts, right):
    """left P right^T for a matrix P of equal-shape arrays parts[r][s]: the
    left.shape[0] * right.shape[0] positions (a, b) row-major, stacked on a new leading axis.
    Each position is its own sum of parts (its nonzero coefficients only) and the stack a
    plain concatenation: XLA:CPU runs a loop fusion per position and a copy. Sums computed in
    stages (rows, then columns) share their first stage between positions, which XLA fuses
    into the concatenation, and a fused concatenation measured slower on XLA:CPU."""
    flat = [p for row in parts for p in row]
    return jnp.stack([_weighted(np.outer(left[a], right[b]), flat)
                      for a in range(left.shape[0]) for b in range(right.shape[0])])


def _tile_grid(x, pads: Pads):
    """x zero-padded by `pads` and then at the high end to whole 2 x 2 output tiles:
    (x_pad, (out_h, out_w), (tiles_h, tiles_w))."""
    _, h, wd, _ = x.shape
    (plo, phi), (qlo, qhi) = pads
    oh, ow = h + plo + phi - 2, wd + qlo + qhi - 2
    th, tw = (oh + 1) // 2, (ow + 1) // 2
    xp = _pad(x, ((0, 0), (plo, 2 * th + 2 - h - plo), (qlo, 2 * tw + 2 - wd - qlo), (0, 0)))
    return xp, (oh, ow), (th, tw)


def _input_tiles(x, pads: Pads):
    """V = B^T d B for every 4 x 4 tile d (stride 2) of the padded input: [16, B*th*tw, C],
    the first axis the tile position (xi, nu) row-major."""
    xp, out_hw, (th, tw) = _tile_grid(x, pads)
    d = [[xp[:, i:i + 2 * th - 1:2, j:j + 2 * tw - 1:2, :] for j in range(4)] for i in range(4)]
    v = _sandwich(_BT, d, _BT)
    return v.reshape(16, x.shape[0] * th * tw, x.shape[-1]), out_hw, (th, tw)


def _kernel_tiles(w):
    """U = G g G^T of a [3, 3, C, O] kernel: [16, C, O]."""
    return _sandwich(_G, [[w[i, j] for j in range(3)] for i in range(3)], _G)


def _kernel_tiles_transpose(du):
    """dw = G^T dU G: the [16, C, O] gradient of the kernel tiles back to [3, 3, C, O]."""
    dw = _sandwich(_G.T, [[du[4 * xi + nu] for nu in range(4)] for xi in range(4)], _G.T)
    return dw.reshape((3, 3) + du.shape[1:])


def _output_tiles(m, batch, out_hw, tiles_hw):
    """Y = A^T M A for every tile: [16, B*th*tw, O] -> [B, out_h, out_w, O]."""
    (oh, ow), (th, tw) = out_hw, tiles_hw
    cout = m.shape[-1]
    y = _sandwich(_AT, [[m[4 * xi + nu] for nu in range(4)] for xi in range(4)], _AT)
    y = y.reshape(2, 2, batch, th, tw, cout).transpose(2, 3, 0, 4, 1, 5)
    return y.reshape(batch, 2 * th, 2 * tw, cout)[:, :oh, :ow, :]


def _output_tiles_transpose(dy, tiles_hw):
    """dM = A dY A^T for every 2 x 2 tile of dy [B, out_h, out_w, O]: [16, B*th*tw, O]."""
    b, oh, ow, cout = dy.shape
    th, tw = tiles_hw
    t = _pad(dy, ((0, 0), (0, 2 * th - oh), (0, 2 * tw - ow), (0, 0)))
    t = t.reshape(b, th, 2, tw, 2, cout)
    dm = _sandwich(_AT.T, [[t[:, :, i, :, j, :] for j in range(2)] for i in range(2)], _AT.T)
    return dm.reshape(16, b * th * tw, cout)


_BATCHED = (((2,), (1,)), ((0,), (0,)))      # [16, T, C] x [16, C, O] -> [16, T, O]


def _tiles_major(v):
    """V [16, T, C] transposed to [16, C, T] in memory, so that the weight gradient
    V^T dM is the same batched product as the forward pass's ([16, C, T] x [16, T, O]). XLA
    would otherwise fold the transpose into the product's dimension numbers, a product that
    contracts the leading axis of both operands, which XLA:CPU runs on its Eigen kernel rather
    than the YNNPACK one of the forward products (a round of pfl_cnn on 2 host devices: 4%
    less CPU time this way, docs/benchmarks/pfl-research.md). The barrier keeps the
    transposed copy; the values are the same."""
    return lax.optimization_barrier(jnp.swapaxes(v, 1, 2))


def _winograd_forward(x, w, pads: Pads):
    v, out_hw, tiles_hw = _input_tiles(x, pads)
    m = lax.dot_general(v, _kernel_tiles(w), _BATCHED)
    return _output_tiles(m, x.shape[0], out_hw, tiles_hw)


def winograd_applies(kernel_shape, strides, dilation, groups) -> bool:
    """Whether :func:`conv_winograd` computes this convolution: a 3 x 3 kernel at stride 1,
    no kernel dilation, one feature group (any padding)."""
    return (tuple(kernel_shape) == (3, 3) and tuple(strides) == (1, 1)
            and tuple(dilation) == (1, 1) and groups == 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def conv_winograd(x, w, pads: Pads = ((0, 0), (0, 0))):
    """NHWC x HWIO 3 x 3 stride-1 convolution with explicit (lo, hi) `pads` by Winograd's
    F(2x2, 3x3) (the comment above): 16 matrix products [tiles, C] x [C, O], 2.25x fewer
    multiplies than the direct convolution's. Its backward pass, the transpose of each step:
    dM = A dY A^T for every output tile; the weight gradient G^T (sum over tiles of V^T dM) G,
    16 products [C, tiles] x [tiles, O]; the input gradient dM U^T (16 products [tiles, O] x
    [O, C]) taken back through the input tiles' transform (B dV B^T added into the input
    pixels each tile read), over the same tiles as the forward pass."""
    return _winograd_forward(x, w, pads)


def _winograd_fwd(x, w, pads):
    return _winograd_forward(x, w, pads), (x, w)


def _input_tiles_transpose(dv, x_shape, pads: Pads, tiles_hw):
    """The transpose of :func:`_input_tiles`: dV [16, B*th*tw, C], the gradient of the tiles
    V = B^T d B, to the gradient of x. Each tile's dd = B dV B^T is added into the 4 x 4
    input pixels it read, tiles 2 apart, so pixel (2T + a, 2U + b) of the padded input gets
    sum over p, q in {0, 1} of dd of tile (T - p, U - q) at (2p + a, 2q + b); the padding is
    then cropped (and a cropped border padded back with zeros)."""
    b, h, wd, c = x_shape
    th, tw = tiles_hw
    (plo, _), (qlo, _) = pads
    z = dv.reshape(4, 4, b, th, tw, c)
    parities = []
    for a in range(2):
        for bb in range(2):
            coefs, parts = [], []
            for p_, q_, xi, nu in np.ndindex(2, 2, 4, 4):
                coefs.append(_BT[xi, 2 * p_ + a] * _BT[nu, 2 * q_ + bb])
                parts.append(_pad(z[xi, nu], ((0, 0), (p_, 1 - p_), (q_, 1 - q_), (0, 0))))
            parities.append(_weighted(coefs, parts))
    dxp = jnp.stack(parities).reshape(2, 2, b, th + 1, tw + 1, c).transpose(2, 3, 0, 4, 1, 5)
    dxp = dxp.reshape(b, 2 * th + 2, 2 * tw + 2, c)
    return _pad(dxp, ((0, 0), (-plo, plo + h - 2 * th - 2), (-qlo, qlo + wd - 2 * tw - 2),
                      (0, 0)))


def _winograd_bwd(pads, res, dy):
    """dM = A dY A^T is shared by both gradients: dW = G^T (V^T dM) G, and dx the transpose
    of the input tiles' transform of dV = dM U^T."""
    x, w = res
    v, _, tiles_hw = _input_tiles(x, pads)
    dm = _output_tiles_transpose(dy, tiles_hw)
    du = lax.dot_general(_tiles_major(v), dm, _BATCHED)
    dv = lax.dot_general(dm, _kernel_tiles(jnp.swapaxes(w, 2, 3)), _BATCHED)
    dx = _input_tiles_transpose(dv, x.shape, pads, tiles_hw)
    return dx.astype(x.dtype), _kernel_tiles_transpose(du).astype(w.dtype)


conv_winograd.defvjp(_winograd_fwd, _winograd_bwd)


def conv_fast(x, w, strides=(1, 1), padding: Pads = ((0, 0), (0, 0)), dilation=(1, 1),
              groups: int = 1, impl: str = "im2col_wgrad"):
    """:func:`conv_winograd` where `impl` is "winograd" and :func:`winograd_applies`,
    :func:`conv_general` otherwise."""
    if impl == "winograd" and winograd_applies(w.shape[:2], strides, dilation, groups):
        return conv_winograd(x, w, tuple(tuple(p) for p in padding))
    return conv_general(x, w, tuple(strides), tuple(tuple(p) for p in padding),
                        tuple(dilation), groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv_patches_kept(x, w, strides=(1, 1), padding: Pads = ((0, 0), (0, 0))):
    """NHWC x HWIO convolution as one im2col product (:func:`im2col_forward`) whose patch
    matrix the backward pass keeps: the weight gradient is patches^T dy, with no second patch
    matrix built; the input gradient is :func:`conv_general`'s. For a network's first layer,
    whose input is the data: its input gradient is never read, and XLA drops it. On the
    2-core CPU (pfl-research's CNN, a loop of its first layer's forward pass and weight
    gradient, one core): 0.69 ms a step against 1.05 ms for XLA's forward convolution with
    :func:`conv_general`'s im2col weight gradient."""
    return _patches_kept_fwd(x, w, strides, padding)[0]


def _patches_kept_fwd(x, w, strides, padding):
    cols = _patches(x, w.shape[:2], strides, padding, (1, 1))         # [B, H_out, W_out, K]
    y = cols @ w.reshape(-1, w.shape[-1])
    return y, (cols.reshape(-1, cols.shape[-1]), x, w)


def _patches_kept_bwd(strides, padding, res, dy):
    cols, x, w = res
    dw = lax.dot_general(cols, dy.reshape(-1, dy.shape[-1]), (((0,), (0,)), ((), ())))
    dx = _input_grad(dy, w, x.shape[1:3], strides, padding, (1, 1), 1)
    return dx.astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


conv_patches_kept.defvjp(_patches_kept_fwd, _patches_kept_bwd)


def _same_pads(k):
    # XLA's SAME padding for stride 1: (k - 1) // 2 before, the rest after.
    return (k - 1) // 2, k - 1 - (k - 1) // 2


def conv2d_im2col_wgrad(x, w):
    """SAME, stride-1 NHWC x HWIO convolution with an im2col weight gradient."""
    kh, kw = w.shape[:2]
    return conv_general(x, w, (1, 1), (_same_pads(kh), _same_pads(kw)), (1, 1), 1)


def im2col_forward(x, w, strides=(1, 1), padding: Pads = None, dilation=(1, 1)):
    """One group's convolution as one matrix product of the [B, H_out, W_out, kh*kw*C] patches
    with the [kh*kw*C, O] kernel; autodiff makes both gradients matrix products too. Vmapped
    over lanes (one kernel per client), the three are batched matrix products, where the
    backend's convolution would be a grouped convolution with one group per lane. `padding`
    None: SAME."""
    kh, kw, c, cout = w.shape
    if padding is None:
        padding = (_same_pads(kh), _same_pads(kw))
    cols = _patches(x, (kh, kw), strides, padding, dilation)
    return cols @ w.reshape(kh * kw * c, cout)


def _patches(x, kshape, strides, padding: Pads, dilation):
    """[B, H_out, W_out, kh*kw*C] patches of an NHWC input: entry (b, h, w, (i, j, c)) is
    x_pad[b, s h + d i, s w + d j, c]."""
    _, h, wd, _ = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kshape, strides, dilation
    oh = _out_size(h, kh, sh, dh, padding[0])
    ow = _out_size(wd, kw, sw, dw, padding[1])
    xp = _pad(x, ((0, 0),) + tuple(padding) + ((0, 0),))
    return jnp.concatenate([xp[:, dh * i:dh * i + sh * (oh - 1) + 1:sh,
                               dw * j:dw * j + sw * (ow - 1) + 1:sw, :]
                            for i in range(kh) for j in range(kw)], axis=-1)


def conv2d_im2col(x, w):
    """SAME, stride-1 NHWC x HWIO convolution, every pass a matrix product
    (:func:`im2col_forward`)."""
    return im2col_forward(x, w)


CONV_IMPLS = ("im2col_wgrad", "winograd", "im2col", "xla")


def conv2d(x, w, impl: str = "im2col_wgrad"):
    """SAME, stride-1 convolution. impl: "im2col_wgrad" (fast in CPU loops), "winograd"
    (:func:`conv_winograd` for 3 x 3 kernels, "im2col_wgrad" for others), "im2col" (every
    pass a matrix product) or "xla" (the backend's convolutions)."""
    if impl == "xla":
        return _conv(x, w)
    if impl in ("im2col_wgrad", "winograd"):
        kh, kw = w.shape[:2]
        return conv_fast(x, w, (1, 1), (_same_pads(kh), _same_pads(kw)), impl=impl)
    if impl == "im2col":
        return conv2d_im2col(x, w)
    if impl == "patches_kept":   # a first layer's (image_conv.input_layer_impl)
        kh, kw = w.shape[:2]
        return conv_patches_kept(x, w, (1, 1), (_same_pads(kh), _same_pads(kw)))
    raise ValueError(f"unknown conv impl {impl!r}; expected one of {', '.join(CONV_IMPLS)}")


def max_pool_2x2(x):
    """2x2/stride-2 max pooling by reshape; its gradient is an elementwise select, which
    XLA:CPU runs 3-4x faster than the select-and-scatter of `reduce_window`."""
    b, h, w, c = x.shape
    if h % 2 or w % 2:
        x = x[:, : h - h % 2, : w - w % 2, :]
        b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def default_conv_impl(backend: str | None = None, preferences=None) -> str:
    """The convolutions of a model left to the backend (`backend` None: the one running): on
    CPU the model's own measured choice (``preferences.cpu_conv_impl``, a
    :class:`~deltafl_jax.models.LanePreferences`: Winograd for pfl-research's CNN) or the
    im2col weight gradient; im2col weight gradient on GPU (see module docstring); the backend's
    own on TPU, where it is unmeasured."""
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return "xla"
    if backend == "cpu" and preferences is not None and preferences.cpu_conv_impl:
        return preferences.cpu_conv_impl
    return "im2col_wgrad"
