"""Data augmentation of the local steps' minibatches (``--augment``).

``crop_flip``: the CIFAR augmentation of He et al. 2016 that the federated image benchmarks
use: each image is padded with 4 zero pixels on every side, a window of the original size is
cropped at an offset (dy, dx) drawn uniformly from {0, ..., 8}^2, and the crop is mirrored left
to right with probability 1/2. Zero is the stored pixel value 0 (black), as torchvision's
``RandomCrop(32, padding=4)`` pads before any normalisation.

The engine applies it inside the jitted local step to the raw minibatch, with the step's key:
``fold_in(fold_in(round key, client), local step)``, where the round key is the replica's
``fold_in(seed key, round)`` (:class:`deltafl_jax.engine.client.ClientJob`). The draws thus
depend on the seed, the round, the client and the step within its job, not on the lane or the
device that runs it, so a run is deterministic, the same on any number of devices, and resumes
bit for bit. :func:`crop_flip_draws` folds its own stream into that key. Evaluation reads the
images as stored.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from deltafl_jax.data import FederatedDataset
from deltafl_jax.models.inputs import is_token_data

AUGMENTS = ("none", "crop_flip")
AUGMENT_STREAM = 0xA06   # folded into a step's key for the augmentation's draws
CROP_PAD = 4


def crop_flip_draws(key, batch: int, pad: int = CROP_PAD):
    """The draws of one minibatch: offsets dy, dx in {0, ..., 2 pad} and flip in {False,
    True}, [batch] each, from ``fold_in(key, AUGMENT_STREAM)``."""
    k_y, k_x, k_f = jax.random.split(jax.random.fold_in(key, AUGMENT_STREAM), 3)
    dy = jax.random.randint(k_y, (batch,), 0, 2 * pad + 1, dtype=jnp.int32)
    dx = jax.random.randint(k_x, (batch,), 0, 2 * pad + 1, dtype=jnp.int32)
    flip = jax.random.bernoulli(k_f, 0.5, (batch,))
    return dy, dx, flip


def crop_flip(x, key, pad: int = CROP_PAD):
    """Padded random crop and horizontal flip of a minibatch x [B, H, W, C] (any dtype)."""
    b, h, w = x.shape[:3]
    dy, dx, flip = crop_flip_draws(key, b, pad)
    xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad)) + ((0, 0),) * (x.ndim - 3))

    def one(img, oy, ox):
        return lax.dynamic_slice(img, (oy, ox) + (0,) * (img.ndim - 2), (h, w) + img.shape[2:])

    crops = jax.vmap(one)(xp, dy, dx)
    mask = flip.reshape((b,) + (1,) * (x.ndim - 1))
    return jnp.where(mask, crops[:, :, ::-1], crops)


def image_layout(example_shape) -> Optional[tuple]:
    """The [H, W, C] of one example stored as [H, W, C], [H, W] or H*W square pixels; None for
    other features."""
    shape = tuple(int(s) for s in example_shape)
    if len(shape) == 3:
        return shape
    if len(shape) == 2:
        return shape + (1,)
    side = int(round(np.sqrt(shape[0]))) if len(shape) == 1 else 0
    return (side, side, 1) if len(shape) == 1 and side * side == shape[0] else None


def augmentation(name: str, data: FederatedDataset) -> Optional[Callable]:
    """``(x [B, ...], key) -> x``, the augmentation `name` of `data`'s examples (None for
    "none"). ValueError for an unknown name, or inputs that are not images."""
    if name == "none":
        return None
    if name not in AUGMENTS:
        raise ValueError(f"--augment must be one of {', '.join(AUGMENTS)}, got {name!r}")
    layout = None if is_token_data(data) else image_layout(data.feature_shape)
    if layout is None:
        raise ValueError(f"--augment={name} needs image inputs ([H, W], [H, W, C] or H*W flat "
                         f"pixels), got {'token ids' if is_token_data(data) else 'features'} "
                         f"of shape {tuple(data.feature_shape)} from {data.name}")

    def augment(x, key):
        shape = x.shape
        return crop_flip(x.reshape((shape[0],) + layout), key).reshape(shape)

    return augment
