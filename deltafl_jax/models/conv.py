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


# Winograd's minimal filtering F(m x m, 3 x 3) (Lavin & Gray 2016, eqs. 8 and 12):
#     Y = A^T [ (G g G^T) * (B^T d B) ] A
# for an n x n input tile d (n = m + 2, tiles m apart), a 3 x 3 kernel g and an m x m output
# tile Y. Summed over the input channels, the elementwise product is one matrix product per
# tile position (xi, nu) of the n^2: M[xi nu] = V[xi nu] @ U[xi nu], V [tiles, C], U [C, O].
# The direct convolution's 9 m^2 multiplies per output tile and channel pair become n^2:
# 2.25x fewer at m = 2 (16 products), 4x at m = 4 (36 products, the Toom-Cook points
# 0, +-1, +-2 and infinity: Lavin & Gray's F(4x4, 3x3)). The transforms are sums with
# small integer (or 1/4, 1/6, 1/12, 1/24) coefficients: in float32 the relative error of the
# m = 4 weight gradient measured 1e-5 for pfl-research's second layer, against 3-5e-6 for
# XLA's direct convolution and 8e-7 for m = 2 (docs/benchmarks/pfl-research.md).
_WINOGRAD = {   # m: (B^T [n, n], G [n, 3], A^T [m, n])
    2: (np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]),
        np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]]),
        np.array([[1, 1, 1, 0], [0, 1, -1, -1]])),
    4: (np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                  [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]),
        np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                  [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]),
        np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0],
                  [0, 1, -1, 8, -8, 1]])),
}
WINOGRAD_TILES = tuple(_WINOGRAD)
# The output tile of --conv_impl=winograd: m = 4 took pfl-research's second layer (forward
# and both gradients, one core) from 7.3 to 5.0 ms a step against m = 2
# (docs/benchmarks/pfl-research.md).
WINOGRAD_TILE = 4


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


def _tile_grid(x, pads: Pads, m: int):
    """x zero-padded by `pads` and then at the high end to whole m x m output tiles:
    (x_pad, (out_h, out_w), (tiles_h, tiles_w))."""
    _, h, wd, _ = x.shape
    (plo, phi), (qlo, qhi) = pads
    oh, ow = h + plo + phi - 2, wd + qlo + qhi - 2
    th, tw = -(-oh // m), -(-ow // m)
    xp = _pad(x, ((0, 0), (plo, m * th + 2 - h - plo), (qlo, m * tw + 2 - wd - qlo), (0, 0)))
    return xp, (oh, ow), (th, tw)


def _input_tiles(x, pads: Pads, m: int):
    """V = B^T d B for every n x n tile d (stride m) of the padded input: [n^2, B*th*tw, C],
    the first axis the tile position (xi, nu) row-major."""
    bt = _WINOGRAD[m][0]
    n = m + 2
    xp, out_hw, (th, tw) = _tile_grid(x, pads, m)
    d = [[xp[:, i:i + m * (th - 1) + 1:m, j:j + m * (tw - 1) + 1:m, :] for j in range(n)]
         for i in range(n)]
    v = _sandwich(bt, d, bt)
    return v.reshape(n * n, x.shape[0] * th * tw, x.shape[-1]), out_hw, (th, tw)


def _kernel_matrix(m: int):
    """G (x) G, [n^2, 9]: U = G g G^T of every (input, output) channel pair as one product."""
    g = _WINOGRAD[m][1]
    return np.kron(g, g)


def _kernel_tiles(w, m: int):
    """U = G g G^T of a [3, 3, C, O] kernel: [n^2, C, O], one [n^2, 9] x [9, C*O] product
    (36 small loop fusions at m = 4 measured 0.36 ms a step, on one core, the product less)."""
    k = _kernel_matrix(m)
    return jnp.dot(jnp.asarray(k, w.dtype), w.reshape(9, -1)).reshape((-1,) + w.shape[2:])


def _kernel_tiles_transpose(du, m: int):
    """dw = G^T dU G: the [n^2, C, O] gradient of the kernel tiles back to [3, 3, C, O]."""
    k = _kernel_matrix(m)
    return jnp.dot(jnp.asarray(k.T, du.dtype), du.reshape(k.shape[0], -1)).reshape(
        (3, 3) + du.shape[1:])


def _output_tiles(mm, batch, out_hw, tiles_hw, m: int):
    """Y = A^T M A for every tile: [n^2, B*th*tw, O] -> [B, out_h, out_w, O]."""
    at = _WINOGRAD[m][2]
    n = m + 2
    (oh, ow), (th, tw) = out_hw, tiles_hw
    cout = mm.shape[-1]
    y = _sandwich(at, [[mm[n * xi + nu] for nu in range(n)] for xi in range(n)], at)
    y = y.reshape(m, m, batch, th, tw, cout).transpose(2, 3, 0, 4, 1, 5)
    return y.reshape(batch, m * th, m * tw, cout)[:, :oh, :ow, :]


def _output_tiles_transpose(dy, tiles_hw, m: int):
    """dM = A dY A^T for every m x m tile of dy [B, out_h, out_w, O]: [n^2, B*th*tw, O]."""
    at = _WINOGRAD[m][2]
    b, oh, ow, cout = dy.shape
    th, tw = tiles_hw
    t = _pad(dy, ((0, 0), (0, m * th - oh), (0, m * tw - ow), (0, 0)))
    t = t.reshape(b, th, m, tw, m, cout)
    dm = _sandwich(at.T, [[t[:, :, i, :, j, :] for j in range(m)] for i in range(m)], at.T)
    return dm.reshape((m + 2) ** 2, b * th * tw, cout)


_BATCHED = (((2,), (1,)), ((0,), (0,)))      # [n^2, T, C] x [n^2, C, O] -> [n^2, T, O]


def _tiles_major(v):
    """V [n^2, T, C] transposed to [n^2, C, T] in memory, so that the weight gradient
    V^T dM is the same batched product as the forward pass's ([n^2, C, T] x [n^2, T, O]). XLA
    would otherwise fold the transpose into the product's dimension numbers, a product that
    contracts the leading axis of both operands, which XLA:CPU runs on its Eigen kernel rather
    than the YNNPACK one of the forward products (a round of pfl_cnn on 2 host devices: 4%
    less CPU time this way, docs/benchmarks/pfl-research.md). The barrier keeps the
    transposed copy; the values are the same."""
    return lax.optimization_barrier(jnp.swapaxes(v, 1, 2))


def _winograd_forward(x, w, pads: Pads, m: int):
    v, out_hw, tiles_hw = _input_tiles(x, pads, m)
    mm = lax.dot_general(v, _kernel_tiles(w, m), _BATCHED)
    return _output_tiles(mm, x.shape[0], out_hw, tiles_hw, m)


def winograd_applies(kernel_shape, strides, dilation, groups) -> bool:
    """Whether :func:`conv_winograd` computes this convolution: a 3 x 3 kernel at stride 1,
    no kernel dilation, one feature group (any padding)."""
    return (tuple(kernel_shape) == (3, 3) and tuple(strides) == (1, 1)
            and tuple(dilation) == (1, 1) and groups == 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv_winograd(x, w, pads: Pads = ((0, 0), (0, 0)), tile: int = WINOGRAD_TILE):
    """NHWC x HWIO 3 x 3 stride-1 convolution with explicit (lo, hi) `pads` by Winograd's
    F(m x m, 3 x 3), m = `tile` (2 or 4; the comment above): (m + 2)^2 matrix products
    [tiles, C] x [C, O]. Its backward pass, the transpose of each step: dM = A dY A^T for
    every output tile; the weight gradient G^T (sum over tiles of V^T dM) G, (m + 2)^2
    products [C, tiles] x [tiles, O]; the input gradient dM U^T ((m + 2)^2 products
    [tiles, O] x [O, C]) taken back through the input tiles' transform (B dV B^T added into
    the input pixels each tile read), over the same tiles as the forward pass."""
    return _winograd_forward(x, w, pads, tile)


def _winograd_fwd(x, w, pads, tile):
    return _winograd_forward(x, w, pads, tile), (x, w)


def _input_tiles_transpose(dv, x_shape, pads: Pads, tiles_hw, m: int):
    """The transpose of :func:`_input_tiles`: dV [n^2, B*th*tw, C], the gradient of the tiles
    V = B^T d B, to the gradient of x. Each tile's dd = B dV B^T is added into the n x n input
    pixels it read, tiles m apart (n = m + 2 <= 2m), so pixel (mT + a, mU + b) of the padded
    input gets the sum over p, q in {0, 1} of dd[mp + a, mq + b] of tile (T - p, U - q),
    where mp + a < n and mq + b < n; the padding is then cropped (and a cropped border padded
    back with zeros). Each dd[r, s] is one sum over dV and the shift of a tile (T - p) one pad
    of that sum: padding the n^2 parts of dV instead measured 2 ms a step at m = 4 (one core,
    pfl-research's second layer) against 0.35 ms."""
    bt = _WINOGRAD[m][0]
    n = m + 2
    b, h, wd, c = x_shape
    th, tw = tiles_hw
    (plo, _), (qlo, _) = pads
    z = dv.reshape(n * n, b, th, tw, c)
    parities = []
    for a in range(m):
        for bb in range(m):
            parts = []
            for p_, q_ in np.ndindex(2, 2):
                r, s_ = m * p_ + a, m * q_ + bb
                if r < n and s_ < n:
                    dd = _weighted(np.outer(bt[:, r], bt[:, s_]), list(z))
                    parts.append(_pad(dd, ((0, 0), (p_, 1 - p_), (q_, 1 - q_), (0, 0))))
            parities.append(functools.reduce(lambda u, v: u + v, parts))
    dxp = jnp.stack(parities).reshape(m, m, b, th + 1, tw + 1, c).transpose(2, 3, 0, 4, 1, 5)
    dxp = dxp.reshape(b, m * th + m, m * tw + m, c)
    return _pad(dxp, ((0, 0), (-plo, plo + h - m * th - m), (-qlo, qlo + wd - m * tw - m),
                      (0, 0)))


def _winograd_bwd(pads, tile, res, dy):
    """dM = A dY A^T is shared by both gradients: dW = G^T (V^T dM) G, and dx the transpose
    of the input tiles' transform of dV = dM U^T."""
    x, w = res
    v, _, tiles_hw = _input_tiles(x, pads, tile)
    dm = _output_tiles_transpose(dy, tiles_hw, tile)
    du = lax.dot_general(_tiles_major(v), dm, _BATCHED)
    dv = lax.dot_general(dm, jnp.swapaxes(_kernel_tiles(w, tile), 1, 2), _BATCHED)
    dx = _input_tiles_transpose(dv, x.shape, pads, tiles_hw, tile)
    return dx.astype(x.dtype), _kernel_tiles_transpose(du, tile).astype(w.dtype)


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
