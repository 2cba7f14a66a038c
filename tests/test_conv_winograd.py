"""Winograd's F(m x m, 3 x 3) convolution, m = 2 and 4 (deltafl_jax.models.conv.conv_winograd,
``--conv_impl=winograd``, m = 4): its values and both gradients against XLA's direct convolution
under autodiff and against a NumPy direct convolution, for VALID, SAME, asymmetric and cropping
paddings and output sizes odd and even; its float32 error at pfl-research's second layer
against a float64 NumPy convolution, beside XLA's; every ``nn.Conv`` of a model routed to it (3 x 3 at stride 1) or
to the im2col path (anything else) under vmapped lanes; and pfl-research's CNN trained without
any convolution in its gradient."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from deltafl_jax.models.conv import (WINOGRAD_TILE, WINOGRAD_TILES, conv2d, conv_winograd,
                                     winograd_applies)
from deltafl_jax.models.conv_intercept import equations, rewritten
from deltafl_jax.models.image import PflCNN, ResNetGN

DN = ("NHWC", "HWIO", "NHWC")

# (batch, height, width, in channels, out channels, ((lo, hi), (lo, hi)))
SHAPES = {
    "valid_even_out": (2, 10, 8, 5, 6, ((0, 0), (0, 0))),
    "valid_odd_out": (3, 9, 7, 4, 3, ((0, 0), (0, 0))),
    "same": (2, 7, 6, 3, 8, ((1, 1), (1, 1))),
    "asymmetric": (1, 6, 9, 4, 5, ((2, 0), (0, 1))),
    "crop": (2, 8, 7, 3, 4, ((-1, 2), (1, -1))),
}


def assert_close(got, ref, rtol=1e-5):
    """Equal within float32 rounding of sums of this size: relative to the largest entry."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * scale)


def sample(case, seed=0):
    b, h, w, c, o, pads = SHAPES[case]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(b, h, w, c)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(3, 3, c, o)) / np.sqrt(9 * c), jnp.float32)
    return x, k, pads


# --conv_impl=winograd's tile in the fast suite, the library's other (m = 2) with CI's slow step
TILES = [t if t == WINOGRAD_TILE else pytest.param(t, marks=pytest.mark.slow)
         for t in WINOGRAD_TILES]


# Two shapes in the fast suite at the default tile, every other pair with CI's slow step.
FAST_CASES = {"valid_even_out", "crop"}


@pytest.mark.parametrize("tile,case", [
    (t, c) if t == WINOGRAD_TILE and c in FAST_CASES else
    pytest.param(t, c, marks=pytest.mark.slow)
    for t in WINOGRAD_TILES for c in sorted(SHAPES)])
def test_values_and_gradients_equal_xla_direct_convolution(case, tile):
    x, k, pads = sample(case)

    def loss(conv):
        return jax.value_and_grad(lambda a, b: jnp.sum(jnp.sin(conv(a, b))), (0, 1))

    direct = lambda a, b: lax.conv_general_dilated(a, b, (1, 1), pads, dimension_numbers=DN)
    ours = lambda a, b: conv_winograd(a, b, pads, tile)

    @jax.jit   # one program per case, not one per function compared
    def both(a, b):
        return (ours(a, b), loss(ours)(a, b)), (direct(a, b), loss(direct)(a, b))

    got, ref = both(x, k)
    assert_close(got[0], ref[0])
    for r, g in zip(jax.tree.leaves(ref[1]), jax.tree.leaves(got[1])):
        assert_close(g, r)


def numpy_conv(x, k, pads):
    """y[b, h, w, o] = sum_{i, j, c} x_pad[b, h + i, w + j, c] k[i, j, c, o], in float64."""
    (plo, phi), (qlo, qhi) = pads
    xp = np.pad(x, ((0, 0), (max(plo, 0), max(phi, 0)), (max(qlo, 0), max(qhi, 0)), (0, 0)))
    xp = xp[:, max(-plo, 0):xp.shape[1] - max(-phi, 0), max(-qlo, 0):xp.shape[2] - max(-qhi, 0)]
    oh, ow = xp.shape[1] - 2, xp.shape[2] - 2
    return sum(np.einsum("bhwc,co->bhwo", xp[:, i:i + oh, j:j + ow], k[i, j])
               for i in range(3) for j in range(3))


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("case", ["valid_odd_out", "crop"])
def test_values_and_weight_gradient_equal_numpy(case, tile):
    """The forward pass against a NumPy direct convolution; the weight gradient of
    sum(y * r) is the correlation of the padded input with r (sum over b, h, w of
    x_pad[b, h + i, w + j, c] r[b, h, w, o])."""
    x, k, pads = sample(case, seed=1)
    x64, k64 = np.asarray(x, np.float64), np.asarray(k, np.float64)
    y = numpy_conv(x64, k64, pads)
    r = np.random.default_rng(2).normal(size=y.shape)

    @jax.jit   # the values and the weight gradient in one program
    def values_and_weight_gradient(a, b):
        conv = lambda b: conv_winograd(a, b, pads, tile)
        return conv(b), jax.grad(lambda b: jnp.sum(conv(b) * jnp.asarray(r, jnp.float32)))(b)

    got, dw = values_and_weight_gradient(x, k)
    assert_close(got, y)
    (plo, phi), (qlo, qhi) = pads
    eye = np.eye(k.shape[2])
    # the weight gradient's (i, j, c, o) entry is the convolution's output for a unit kernel
    want = np.stack([np.stack([np.einsum("bhwc,bhwo->co", numpy_conv(
        x64, np.pad(eye[None, None], ((i, 2 - i), (j, 2 - j), (0, 0), (0, 0))), pads), r)
        for j in range(3)]) for i in range(3)])
    assert_close(dw, want)


def numpy_weight_gradient(x, r, pads):
    """dW[i, j, c, o] = sum_{b, h, w} x_pad[b, h + i, w + j, c] r[b, h, w, o], in float64
    (non-negative pads)."""
    xp = np.pad(x, ((0, 0),) + tuple(pads) + ((0, 0),))
    oh, ow = r.shape[1:3]
    return np.stack([np.stack([np.einsum("bhwc,bhwo->co", xp[:, i:i + oh, j:j + ow], r)
                               for j in range(3)]) for i in range(3)])


@pytest.mark.slow   # a float64 reference at full size: CI's second step
def test_float32_error_at_pfl_researchs_second_layer():
    """At pfl-research's second layer (batch 10, 30 x 30 x 32 -> 28 x 28 x 64, VALID), the
    float32 error of the output and of the weight gradient of sum(y * r), relative to the
    largest entry of a float64 NumPy reference. F(2x2, 3x3) is as accurate as XLA's direct
    convolution (measured 3e-7 and 8e-7, XLA 6-8e-7 and 3-5e-6); F(4x4, 3x3)'s larger
    transform coefficients cost about a decimal digit of the output (measured 4-8e-6, 10x
    XLA's) and less of the weight gradient (1.1-1.3e-5, 4x XLA's)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(10, 30, 30, 32)).astype(np.float32)
    k = (rng.normal(size=(3, 3, 32, 64)) / np.sqrt(288)).astype(np.float32)
    r = rng.normal(size=(10, 28, 28, 64)).astype(np.float32)
    pads = ((0, 0), (0, 0))
    x64, k64, r64 = (a.astype(np.float64) for a in (x, k, r))
    want = (numpy_conv(x64, k64, pads), numpy_weight_gradient(x64, r64, pads))

    def error(conv):
        got = jax.jit(lambda a, b: (conv(a, b), jax.grad(lambda b: jnp.sum(conv(a, b) * r))(b)))(
            x, k)
        return [float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))
                for g, w in zip(got, want)]

    direct = error(lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "VALID",
                                                         dimension_numbers=DN))
    assert max(direct) < 1e-5, direct
    assert all(g < 2 * d for g, d in zip(error(lambda a, b: conv_winograd(a, b, pads, 2)),
                                         direct))
    four = error(lambda a, b: conv_winograd(a, b, pads, 4))
    assert max(four) < 3e-5, four


def test_applies_to_three_by_three_stride_one_only():
    assert winograd_applies((3, 3), (1, 1), (1, 1), 1)
    assert not winograd_applies((5, 5), (1, 1), (1, 1), 1)
    assert not winograd_applies((3, 3), (2, 2), (1, 1), 1)
    assert not winograd_applies((3, 3), (1, 1), (2, 2), 1)
    assert not winograd_applies((3, 3), (1, 1), (1, 1), 2)


class ConvNet(nn.Module):
    """nn.Conv (one setting), ReLU, a second 3 x 3 SAME nn.Conv."""

    settings: dict

    @nn.compact
    def __call__(self, x):
        s = dict(self.settings)
        kernel = s.pop("kernel_size", (3, 3))
        x = nn.relu(nn.Conv(6, kernel, **s)(x))
        return nn.Conv(5, (3, 3), padding="SAME")(x)


LAYERS = {"valid": dict(padding="VALID"), "same": dict(padding="SAME"),
          "stride2": dict(padding=1, strides=2), "five_by_five": dict(kernel_size=(5, 5)),
          "groups2": dict(padding="SAME", feature_group_count=2)}


# Two layers in the fast suite, the rest with CI's slow step (a compile each).
FAST_LAYERS = {"valid", "stride2"}


@pytest.mark.parametrize("layer", [c if c in FAST_LAYERS else
                                   pytest.param(c, marks=pytest.mark.slow)
                                   for c in sorted(LAYERS)])
def test_nn_conv_in_vmapped_lanes_equals_flax(layer):
    """Every nn.Conv through the intercept with impl="winograd" (Winograd where it applies,
    the im2col path otherwise) against Flax's own layers under autodiff, two lanes of their
    own models."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 3, 9, 8, 4)), jnp.float32)
    module = ConvNet(LAYERS[layer])

    def grads(impl, lanes, x):
        def loss(q, xb):
            return jnp.sum(jnp.sin(rewritten(module.apply, impl)(q, xb)))
        return jax.vmap(jax.value_and_grad(loss, (0, 1)))(lanes, x)

    @jax.jit   # the initialisation and both lanes' gradients in one program
    def both(x):
        p = module.init(jax.random.key(0), x[0])
        lanes = jax.tree.map(lambda a: jnp.stack([a, -0.7 * a]), p)
        return grads("xla", lanes, x), grads("winograd", lanes, x)

    ref, got = both(x)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert_close(g, r)


def test_conv2d_same_winograd_equals_xla_and_keeps_other_kernels():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 7, 7, 3)), jnp.float32)
    both = jax.jit(lambda x, k: (conv2d(x, k, "winograd"), conv2d(x, k, "xla")))   # one program
    for size in (3, 5):
        k = jnp.asarray(rng.normal(size=(size, size, 3, 4)), jnp.float32)
        assert_close(*both(x, k))




def test_pfl_cnn_step_convolves_nothing_and_equals_xla():
    """pfl-research's CNN with conv_impl="winograd": the loss and every gradient of a batch
    equal XLA's convolutions and dense layers under autodiff. The second layer runs Winograd's
    products; the first, whose input is the data, one im2col product whose patches its weight
    gradient reuses (``input_layer_impl``: its input gradient is in the jaxpr, and XLA drops
    it: nothing reads it); dense1's weight gradient is a sum of outer products
    (``deltafl_jax.models.dense``). So the gradient's program has no convolution at all."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 12, 10, 3)), jnp.float32)
    y = jnp.asarray([1, 0, 4])
    p = jax.jit(PflCNN(5, conv_impl="xla").init)(jax.random.key(1), x)

    def loss_of(impl):
        def loss(q):
            z = PflCNN(5, conv_impl=impl).apply(q, x)
            return jnp.mean(jax.nn.logsumexp(z, axis=1) - z[jnp.arange(3), y])
        return loss

    hlo = jax.jit(jax.grad(loss_of("winograd"))).lower(p).compile().as_text()
    assert " convolution(" not in hlo
    assert " dot(" in hlo
    ref, got = jax.jit(lambda q: (jax.value_and_grad(loss_of("xla"))(q),    # one program
                                  jax.value_and_grad(loss_of("winograd"))(q)))(p)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert_close(g, r)


def test_weight_gradient_products_contract_as_the_forward_products():
    """Every batched product of the weight gradient contracts the minor axis of its first
    operand and the middle axis of its second ([36, C, T] x [36, T, O]), the layout of the
    forward pass's products, not the leading tile axis of both ([36, T, C] x [36, T, O]),
    which XLA:CPU runs on a slower kernel (docs/benchmarks/pfl-research.md); the values are
    the NumPy reference's (test above)."""
    x, k, pads = sample("valid_even_out")
    r = jnp.ones((2, 8, 6, 6), jnp.float32)
    grad = jax.jit(jax.grad(lambda b: jnp.sum(conv_winograd(x, b, pads) * r)))
    hlo = grad.lower(k).compile().as_text()
    products = [line for line in hlo.splitlines() if " dot(" in line and "lhs_batch_dims" in line]
    assert products
    for line in products:
        assert "lhs_contracting_dims={2}" in line and "rhs_contracting_dims={1}" in line, line


def test_input_gradient_products_run_over_the_output_tiles():
    """Both gradients start from the same dM = A dY A^T over the output's 4 x 4 tiles: the
    input gradient is dM U^T ([36, T, O] x [36, O, C]) taken back through the input tiles'
    transform, so every product of the gradient runs over the output's T tiles, none over the
    more tiles of the output gradient padded by 2 (the full convolution with the flipped
    kernel); its values are the direct convolution's (tests above)."""
    x, k, pads = sample("valid_even_out")
    r = jnp.ones((2, 8, 6, 6), jnp.float32)
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(conv_winograd(a, b, pads) * r), (0, 1)))
    hlo = grad.lower(x, k).compile().as_text()
    shapes = {tuple(int(n) for n in m.split(","))
              for m in re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} dot\(", hlo)}
    batched = {s for s in shapes if len(s) == 3}      # the kernel's transforms are [36 or 9, C*O]
    assert WINOGRAD_TILE == 4
    tiles = 2 * 2 * 2                 # batch 2, output 8 x 6: 2 x 2 tiles of 4 x 4
    assert batched == {(36, 5, 6), (36, tiles, 5)}, shapes


def test_resnet_stem_is_a_patch_product_and_the_inner_layers_run_winograd():
    """ResNet-GN with conv_impl="winograd": its forward pass convolves only in the stride-2
    layer (4 channels, not Winograd's); the stem, whose input is the images, is one im2col
    product (``input_layer_impl``), and every 3 x 3 stride-1 layer inside the blocks is
    Winograd's products."""
    x = jnp.ones((2, 8, 8, 3), jnp.float32)
    net = ResNetGN(5, widths=(4, 8), blocks=(1, 1), groups=2, conv_impl="winograd")
    p = jax.jit(net.init)(jax.random.key(0), x)
    convs = [e for e in equations(jax.make_jaxpr(net.apply)(p, x).jaxpr)
             if e.primitive.name == "conv_general_dilated"]
    assert [(e.invars[0].aval.shape[-1], e.params["window_strides"]) for e in convs] == [
        (4, (2, 2))]
