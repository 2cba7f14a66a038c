"""A dense layer whose weight gradient, for a minibatch of a few examples, is the sum of the
examples' outer products, written as elementwise operations.

Why: a local SGD step reads and writes a large dense kernel W [N, M] several times: the
forward product h W, the input gradient dz W^T, the weight gradient h^T dz (a matrix product
over the B examples of the minibatch, written out as a new [N, M] array) and the update
W - lr dW (reads both, writes W). With B small (pfl-research's benchmark: B = 10, W of
12,544 x 128, 6.4 MB) these passes are bound by memory, not arithmetic. Written as
dW = sum_b h_b (x) dz_b, the weight gradient is elementwise in (i, j), so XLA fuses it into
the optimizer's elementwise update: one pass reads W and writes the new W, and dW is never
stored. On the 2-core CPU, one core, a loop of pfl-research's dense layer with its ReLU, both
gradients and the SGD update: 1.41 ms a step against 1.80 ms with the matrix product
(docs/benchmarks/pfl-research.md). The sum runs over b = 0 .. B-1 in order, a different
rounding from the matrix product's (equal to float32 rounding,
tests/test_first_layer_and_dense.py); the forward pass
and the input gradient are the usual products.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

# Up to this many examples a minibatch's weight gradient is the sum of outer products.
OUTER_MAX_BATCH = 32


def outer_sum(h, dz):
    """h^T dz for h [B, N], dz [B, M]: the sum of the B outer products h_b (x) dz_b in order
    where B <= OUTER_MAX_BATCH (elementwise, so XLA fuses it into its consumer), the matrix
    product otherwise."""
    if h.shape[0] <= OUTER_MAX_BATCH:
        acc = jnp.promote_types(jnp.result_type(h, dz), jnp.float32)  # bfloat16: float32 sums
        return functools.reduce(lambda a, b: a + b, [
            h[i][:, None].astype(acc) * dz[i][None, :].astype(acc) for i in range(h.shape[0])])
    return h.T @ dz


@jax.custom_vjp
def dense_outer_grad(h, kernel, bias):
    """h [B, N] @ kernel [N, M] + bias [M], with the weight gradient of the module docstring
    (:func:`outer_sum`)."""
    return h @ kernel + bias


def _fwd(h, kernel, bias):
    return h @ kernel + bias, (h, kernel)


def _bwd(res, dz):
    h, kernel = res
    return dz @ kernel.T, outer_sum(h, dz).astype(kernel.dtype), jnp.sum(dz, axis=0)


dense_outer_grad.defvjp(_fwd, _bwd)


@jax.custom_vjp
def matmul_outer_grad(h, kernel):
    """h [B, N] @ kernel [N, M], the weight gradient by :func:`outer_sum`: what
    :mod:`deltafl_jax.models.conv_intercept` computes a model's own ``nn.Dense`` products with
    under ``--conv_impl=winograd``."""
    return h @ kernel


def _matmul_fwd(h, kernel):
    return h @ kernel, (h, kernel)


def _matmul_bwd(res, dz):
    h, kernel = res
    return (dz @ kernel.T).astype(h.dtype), outer_sum(h, dz).astype(kernel.dtype)


matmul_outer_grad.defvjp(_matmul_fwd, _matmul_bwd)


class OuterGradDense(nn.Module):
    """``nn.Dense`` (the same parameters: ``kernel`` [N, M], ``bias`` [M]) on [B, N] inputs,
    its weight gradient by :func:`dense_outer_grad`."""

    features: int
    kernel_init: nn.initializers.Initializer = nn.linear.default_kernel_init
    bias_init: nn.initializers.Initializer = nn.initializers.zeros

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
        bias = self.param("bias", self.bias_init, (self.features,))
        return dense_outer_grad(x, kernel, bias)
