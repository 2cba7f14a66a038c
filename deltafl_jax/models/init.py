"""Parameter initialisers that stay out of LAPACK.

Flax's recurrent cells initialise their recurrent kernels with ``orthogonal()``, which calls a
QR factorisation. On XLA:CPU with jaxlib 0.10.x the LAPACK kernels fan a batch out to the same
thread pool that runs the program's thunks and block until it is done; when the thunk executor
runs as many independent factorisations at once as the pool has threads (three recurrent kernels
on a 2-core machine suffice) every pool thread waits and the program deadlocks. Observed here
with the GRU's jitted, vmapped initialisation; later jaxlib releases build that parallel path out.

:func:`orthogonal` draws the same Gaussian matrix as ``jax.nn.initializers.orthogonal`` and
orthonormalises it by Gram-Schmidt (twice, for float32 accuracy) with matrix-vector products
only. Gram-Schmidt of A is the Q of A's QR factorisation with a positive diagonal of R, which
is exactly what the sign-corrected Flax/JAX initialiser returns, so the initial models are the
same (to float rounding) and uniformly distributed over orthogonal matrices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _orthonormal_columns(a):
    """Gram-Schmidt on the columns of a [n, k], n >= k (positive diagonal of R)."""
    k = a.shape[1]

    def body(j, q):
        v = lax.dynamic_index_in_dim(a, j, axis=1, keepdims=False)
        for _ in range(2):  # columns >= j of q are still zero, so this projects on q[:, :j]
            v = v - q @ (q.T @ v)
        return lax.dynamic_update_index_in_dim(q, v / jnp.linalg.norm(v), j, axis=1)

    return lax.fori_loop(0, k, body, jnp.zeros_like(a))


def orthogonal(scale: float = 1.0, column_axis: int = -1):
    """Drop-in for ``jax.nn.initializers.orthogonal`` without a QR factorisation."""

    def init(key, shape, dtype=jnp.float32):
        if len(shape) < 2:
            raise ValueError("orthogonal initialisation needs at least 2 dimensions")
        n_cols = shape[column_axis]
        n_rows = int(np.prod(shape)) // n_cols
        tall = (n_cols, n_rows) if n_rows < n_cols else (n_rows, n_cols)
        a = jax.random.normal(key, tall, dtype)
        q = _orthonormal_columns(a)
        if n_rows < n_cols:
            q = q.T
        q = jnp.reshape(q, tuple(np.delete(shape, column_axis)) + (n_cols,))
        return scale * jnp.moveaxis(q, -1, column_axis)

    return init
