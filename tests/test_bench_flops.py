"""bench.common's FLOP count: 2 x the multiply-adds of every matrix product and convolution,
a scan's body once per step, against counts by hand."""

import jax
import jax.numpy as jnp
from jax import lax

from bench.common import forward_flops_per_example, jaxpr_matmul_flops
from deltafl_jax.models import ModelOptions, build_model
from tests.test_models import image_dataset


def flops(f, *args):
    return jaxpr_matmul_flops(jax.make_jaxpr(f)(*args).jaxpr)


def test_matmul_and_conv_by_hand():
    a, b = jnp.ones((3, 5)), jnp.ones((5, 7))
    assert flops(jnp.matmul, a, b) == 2 * 3 * 5 * 7
    x, w = jnp.ones((2, 9, 8, 3)), jnp.ones((5, 5, 3, 4))
    conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert flops(conv, x, w) == 2 * (2 * 9 * 8 * 4) * (5 * 5 * 3)
    # strided VALID: the output's positions, each k*k*cin multiply-adds
    conv2 = lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID",
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
    assert flops(conv2, x, w) == 2 * (2 * 3 * 2 * 4) * (5 * 5 * 3)


def test_scan_counts_its_body_per_step_and_jit_is_entered():
    w = jnp.ones((4, 4))

    def rnn(h, xs):
        return lax.scan(lambda h, x: (jnp.tanh(h @ w + x), h), h, xs)[0]

    h, xs = jnp.ones((2, 4)), jnp.ones((11, 2, 4))
    assert flops(rnn, h, xs) == 11 * 2 * 2 * 4 * 4
    assert flops(jax.jit(rnn), h, xs) == 11 * 2 * 2 * 4 * 4


def test_the_papers_convnet_by_hand():
    """conv 5x5 1->32 at 28x28, conv 5x5 32->64 at 14x14 (SAME), dense 7*7*64 -> 62
    (XLA:GPU's cost analysis of the compiled model counted 0.43 MFLOP of these 21.7)."""
    model = build_model("cnn", image_dataset(), ModelOptions(conv_impl="xla"))
    want = 2 * (28 * 28 * 32 * 25 * 1 + 14 * 14 * 64 * 25 * 32 + 7 * 7 * 64 * 62)
    assert forward_flops_per_example(model) == want
    im2col = build_model("cnn", image_dataset(), ModelOptions(conv_impl="im2col"))
    assert forward_flops_per_example(im2col) == want
