"""Pytree helpers of the engine, for pytrees with a leading lane or replica axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sqnorm(tree):
    """sum of squares of every leaf, in float32 (||w||^2 of a model)."""
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def tree_all_finite(tree):
    """[] bool: no leaf holds NaN or Inf."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def select_tree(pred, on_true, on_false):
    """Per-lane select: pred [c] picks between two pytrees with leading dim c."""
    def sel(a, b):
        p = pred.reshape(pred.shape + (1,) * (a.ndim - 1))
        return jnp.where(p, a, b)
    return jax.tree.map(sel, on_true, on_false)


def gather_rows(tree, rows):
    """tree with leading dim R, rows [c] -> pytree with leading dim c."""
    return jax.tree.map(lambda a: jnp.take(a, rows, axis=0), tree)

