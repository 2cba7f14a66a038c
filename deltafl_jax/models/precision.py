"""Mixed precision: the ``--compute_dtype`` of a run's forward and backward passes.

``float32`` (the default) leaves every model as it is: nothing is cast, and every result of an
earlier version is unchanged bit for bit. ``bfloat16`` runs the matrix products and the
convolutions in bfloat16 while everything the algorithms own stays float32: the parameters
(the master copy that local SGD updates), the optimizer states, the aggregation, the
superquantile, clipping and DP noise (Micikevicius et al. 2018, "Mixed Precision Training",
Sec. 3: a float32 master copy of the weights, products in half precision; bfloat16 keeps
float32's exponent range, so no loss scaling is needed).

The cast policy (:func:`mixed`, which :meth:`deltafl_jax.models.Model.apply` runs every model
through, built in or one's own): the float32 parameters and the preprocessed float32 inputs
are cast to bfloat16 for the module; a Flax method interceptor casts every float32 array that
enters or leaves a submodule's method (a frozen float32 table's rows entering a recurrent
layer, a constant made inside a module), so that Flax's layers, whose ``dtype=None`` follows
their inputs and parameters, compute in bfloat16; the outputs are cast back to float32 before
any loss. The casts are differentiable, so the gradients reach the float32 parameters as
float32. Normalisation layers keep their statistics in float32 (Flax computes them in at
least float32). ``--model=llama`` sets its own ``dtype`` instead
(:func:`deltafl_jax.models.llm.llama_model`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError

COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtype of the models' matrix products and convolutions (``config.precision``).

    Attributes:
      compute_dtype: float32 | bfloat16 (parameters, optimizer states and the aggregation stay
        float32 either way).
    """

    compute_dtype: str = setting(
        "float32", "dtype of the models' matrix products and convolutions: float32 | bfloat16 "
        "(parameters, optimizer states, the aggregation, the superquantile, clipping and DP "
        "noise stay float32)", choices=COMPUTE_DTYPES)

    def check(self) -> None:
        """ConfigError naming the flag of a bad setting."""
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"--compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                              f"got {self.compute_dtype!r}")


def compute_dtype_of(name: Optional[str]):
    """The JAX dtype of a ``compute_dtype`` name; None for float32 and None (nothing cast)."""
    if name in (None, "float32"):
        return None
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {name!r}; expected one of "
                         f"{', '.join(COMPUTE_DTYPES)}")
    return jnp.bfloat16


def _is_float32_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray)) and leaf.dtype == np.float32


def cast_floats(tree, dtype):
    """`tree` with its float32 arrays cast to `dtype` (integers, other floats, keys and
    everything that is not an array left as they are)."""
    return jax.tree.map(lambda a: a.astype(dtype) if _is_float32_array(a) else a, tree)


def to_float32(tree):
    """`tree` with its low-precision floating arrays (bfloat16, float16) cast to float32."""
    def up(a):
        if (isinstance(a, (jax.Array, np.ndarray)) and jnp.issubdtype(a.dtype, jnp.floating)
                and jnp.finfo(a.dtype).bits < 32):
            return a.astype(jnp.float32)
        return a
    return jax.tree.map(up, tree)


def _carried(out, args):
    """`out`'s first part in the dtypes of the first argument where `out` is (carry, y) of a
    scanned step: a pair whose first part has the first argument's structure and shapes."""
    if not (args and isinstance(out, tuple) and len(out) == 2):
        return None
    new, old = jax.tree.leaves(out[0]), jax.tree.leaves(args[0])
    if (jax.tree.structure(out[0]) != jax.tree.structure(args[0])
            or not all(isinstance(a, jax.Array) and isinstance(b, (jax.Array, np.ndarray))
                       and a.shape == b.shape and jnp.issubdtype(a.dtype, jnp.floating)
                       == jnp.issubdtype(b.dtype, jnp.floating) for a, b in zip(new, old))):
        return None
    return jax.tree.map(lambda a, b: a.astype(b.dtype), out[0], args[0])


def _interceptor(dtype):
    """A Flax method interceptor: every float32 array that enters or leaves a module's method
    (its arguments, keyword arguments and results) in `dtype`, so that arrays a module makes
    itself and hands to a submodule (a frozen float32 table's rows) are in `dtype` before the
    submodule's products see them. One exception, for scans (``nn.RNN``, ``nn.scan``): a
    step ``(carry, x) -> (carry', y)`` returns carry' in the dtypes its carry came in (a
    scan's carry keeps one type, and ``nn.RNN`` makes the initial one float32 outside any
    method); it is cast again as it enters the next step, so the products stay in `dtype`."""
    def intercept(next_fun, args, kwargs, context):
        del context
        out = next_fun(*cast_floats(args, dtype), **cast_floats(kwargs, dtype))
        carry = _carried(out, args)
        if carry is not None:
            return carry, cast_floats(out[1], dtype)
        return cast_floats(out, dtype)
    return intercept


def mixed(forward: Callable, compute_dtype: Optional[str]) -> Callable:
    """`forward(params, x)` (a Flax module's apply on preprocessed inputs) in `compute_dtype`:
    for bfloat16, the float32 parameters and inputs cast to bfloat16, every float32 array
    crossing a module boundary cast too (:func:`_interceptor`), and the floating outputs cast
    back to float32. The casts are differentiable: the gradient of a bfloat16 copy reaches the
    float32 parameter as float32 (the master copy; Micikevicius et al. 2018, Sec. 3.1).
    Normalisation layers keep their statistics in float32 (Flax computes them in at least
    float32). float32 and None: `forward` itself, nothing cast."""
    dtype = compute_dtype_of(compute_dtype)
    if dtype is None:
        return forward

    def run(params, x):
        with nn.intercept_methods(_interceptor(dtype)):
            out = forward(cast_floats(params, dtype), cast_floats(x, dtype))
        return to_float32(out)

    return run
