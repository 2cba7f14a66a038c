"""The image-classification networks of the federated literature, as built-in models.

- ``fedavg_cnn``: the CIFAR-10 network of McMahan et al. 2017 (FedAvg), which the paper takes
  from the TensorFlow CIFAR-10 tutorial ("two convolutional layers followed by two fully
  connected layers and then a linear transformation layer to produce logits, for a total of
  about 10^6 parameters"): conv 5x5-64 (SAME) + ReLU, max-pool 3x3/2 (SAME), local response
  normalisation; conv 5x5-64 (SAME) + ReLU, local response normalisation, max-pool 3x3/2
  (SAME); dense 384 + ReLU, dense 192 + ReLU, dense to the classes. On the paper's 24 x 24
  crops it has 1,068,298 parameters for 10 classes; on whole 32 x 32 CIFAR images the first
  dense layer reads 8 * 8 * 64 features (1,756,426 parameters).
- ``pfl_cnn``: pfl-research's CIFAR-10 benchmark CNN (``benchmarks/model/pytorch/cnn.py``,
  ``simple_cnn``): conv 3x3-32 (VALID) + ReLU, conv 3x3-64 (VALID) + ReLU, max-pool 2x2, dense
  128 + ReLU, dense to the classes; Glorot-uniform kernels, zero biases; 1,626,442 parameters on
  32 x 32 x 3 images and 10 classes. pfl-research's dropout (0.25 after the pool, 0.5 after
  the dense layer) is left out: the engine's local step draws no dropout masks.
- ``resnet18_gn``: ResNet-18 for 32 x 32 images (He et al. 2016's CIFAR stem: a 3x3-64
  convolution, no max-pool) with every BatchNorm replaced by GroupNorm (Wu & He 2018), the
  non-IID standard of Hsieh et al. 2020: stages of 64, 128, 256, 512 channels, two basic
  blocks each (3x3 conv, GN, ReLU, 3x3 conv, GN, plus the shortcut, ReLU), the first block of
  stages 2-4 at stride 2 with a 1x1 stride-2 convolution and GN on the shortcut; global average
  pooling and a dense layer to the classes. Convolutions have no bias; 11,173,962 parameters for
  10 classes (GN's scale and offset are BatchNorm's learnable parameters).

  **GroupNorm with 2 groups.** BatchNorm normalises with the statistics of the minibatch in
  training and with running averages in evaluation; in this engine a client's minibatches
  are its own label-skewed examples, and running statistics would be state that FedAvg
  averages without meaning (the server's model would be evaluated with a mixture of the
  clients' statistics). GroupNorm normalises each example by itself, over groups of channels,
  so training and evaluation compute the same function and nothing but parameters is
  averaged. Two groups per layer, Hsieh et al.'s choice (their GroupNorm AlexNet has 2 groups,
  and the authors found 2 groups best for their GroupNorm ResNet-20): each
  group then spans half the channels, so its statistics are averages over 32 x 32 x 32 values
  at the first stage and still 4 x 4 x 256 at the last, where Wu & He's 32 groups (chosen for
  ImageNet's 224 x 224 inputs) leave 4 x 4 x 16. ``ResNetGN(groups=...)`` takes another
  count.

Every convolution goes through :mod:`deltafl_jax.models.image_conv` (the fast path of
:func:`deltafl_jax.models.conv.conv_general`), which keeps XLA:CPU's
weight gradients out of the lanes' loops; the models run unrolled lanes on CPU like ``cnn``.
With ``--conv_impl=winograd`` (``pfl_cnn``'s default on CPU) a network's first convolution,
whose input is the data and needs no gradient, is one im2col product whose patches its weight
gradient reuses (:func:`~deltafl_jax.models.image_conv.input_layer_impl`); the other 3 x 3
stride-1 layers run Winograd's F(4x4, 3x3); and ``pfl_cnn``'s dense1 takes its weight gradient
as a sum of outer products fused into the update (:mod:`deltafl_jax.models.dense`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.models.conv import max_pool_2x2
from deltafl_jax.models.dense import OuterGradDense
from deltafl_jax.models.image_conv import (conv1x1_stride2, conv_same, conv_stride2, conv_valid,
                                           input_layer_impl, local_response_norm,
                                           max_pool_3x3_stride2_same)
from deltafl_jax.models.inputs import numeric_features
from deltafl_jax.models.lane_preferences import LanePreferences
from deltafl_jax.models.model import Model, ModelOptions

GN_GROUPS = 2
GN_EPSILON = 1e-5


def as_images(x):
    """[B, H, W, C] from [B, H, W, C], [B, H, W] (one channel) or [B, H*W] (square, one
    channel)."""
    if x.ndim == 2:
        side = int(round(np.sqrt(x.shape[-1])))
        return x.reshape(x.shape[0], side, side, 1)
    if x.ndim == 3:
        return x[..., None]
    return x


class FedAvgCNN(nn.Module):
    """McMahan et al. 2017's CIFAR CNN (the TensorFlow tutorial's network; module docstring)."""

    num_outputs: int
    conv_impl: str = "im2col_wgrad"

    @nn.compact
    def __call__(self, x):
        x = as_images(x)
        for i in (1, 2):
            kernel = self.param(f"conv{i}_kernel", nn.initializers.truncated_normal(5e-2),
                                (5, 5, x.shape[-1], 64))
            bias = self.param(f"conv{i}_bias", nn.initializers.constant(0.0 if i == 1 else 0.1),
                              (64,))
            x = nn.relu(conv_same(x, kernel, self.conv_impl) + bias)
            if i == 1:
                x = local_response_norm(max_pool_3x3_stride2_same(x))
            else:
                x = max_pool_3x3_stride2_same(local_response_norm(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(384, name="local3")(x))
        x = nn.relu(nn.Dense(192, name="local4")(x))
        return nn.Dense(self.num_outputs, name="logits")(x)


class PflCNN(nn.Module):
    """pfl-research's CIFAR-10 benchmark CNN, without its dropout (module docstring)."""

    num_outputs: int
    conv_impl: str = "im2col_wgrad"

    @nn.compact
    def __call__(self, x):
        x = as_images(x)
        glorot = nn.initializers.xavier_uniform()
        for i, feats in ((1, 32), (2, 64)):
            kernel = self.param(f"conv{i}_kernel", glorot, (3, 3, x.shape[-1], feats))
            bias = self.param(f"conv{i}_bias", nn.initializers.zeros, (feats,))
            impl = input_layer_impl(self.conv_impl) if i == 1 else self.conv_impl
            x = nn.relu(conv_valid(x, kernel, impl) + bias)
        x = max_pool_2x2(x).reshape(x.shape[0], -1)
        # on the CPU path (winograd) the large dense1's weight gradient is elementwise, fused
        # into the update (deltafl_jax.models.dense)
        dense = OuterGradDense if self.conv_impl == "winograd" else nn.Dense
        x = nn.relu(dense(128, kernel_init=glorot, name="dense1")(x))
        return nn.Dense(self.num_outputs, kernel_init=glorot, name="dense2")(x)


class BasicBlockGN(nn.Module):
    """x -> relu(GN(conv3x3(relu(GN(conv3x3_s(x))))) + shortcut(x)); the shortcut is x, or
    GN(conv1x1_s(x)) when the stride or the width changes."""

    features: int
    stride: int
    groups: int
    conv_impl: str

    def kernel(self, name, k, cin):
        return self.param(name, nn.initializers.he_normal(), (k, k, cin, self.features))

    def norm(self, name):
        return nn.GroupNorm(num_groups=self.groups, epsilon=GN_EPSILON, name=name)

    @nn.compact
    def __call__(self, x):
        cin = x.shape[-1]
        k1 = self.kernel("conv1", 3, cin)
        y = conv_stride2(x, k1, self.conv_impl) if self.stride == 2 else \
            conv_same(x, k1, self.conv_impl)
        y = nn.relu(self.norm("gn1")(y))
        y = self.norm("gn2")(conv_same(y, self.kernel("conv2", 3, self.features),
                                       self.conv_impl))
        if self.stride != 1 or cin != self.features:
            k = self.kernel("shortcut", 1, cin)
            x = conv1x1_stride2(x, k) if self.stride == 2 else \
                jnp.einsum("bhwc,co->bhwo", x, k[0, 0])
            x = self.norm("shortcut_gn")(x)
        return nn.relu(y + x)


class ResNetGN(nn.Module):
    """ResNet with GroupNorm for small images (module docstring): a 3x3 stem, stages of
    `blocks` basic blocks of `widths` channels (stride 2 from the second stage on), global
    average pooling, a dense layer. ResNet-18: widths (64, 128, 256, 512), blocks (2, 2, 2, 2)."""

    num_outputs: int
    widths: Sequence[int] = (64, 128, 256, 512)
    blocks: Sequence[int] = (2, 2, 2, 2)
    groups: int = GN_GROUPS
    conv_impl: str = "im2col_wgrad"

    @nn.compact
    def __call__(self, x):
        x = as_images(x)
        stem = self.param("stem", nn.initializers.he_normal(),
                          (3, 3, x.shape[-1], self.widths[0]))
        x = conv_same(x, stem, input_layer_impl(self.conv_impl))
        x = nn.relu(nn.GroupNorm(num_groups=self.groups, epsilon=GN_EPSILON, name="stem_gn")(x))
        for s, (width, count) in enumerate(zip(self.widths, self.blocks)):
            for b in range(count):
                stride = 2 if s > 0 and b == 0 else 1
                x = BasicBlockGN(width, stride, self.groups, self.conv_impl,
                                 name=f"stage{s + 1}_block{b + 1}")(x)
        return nn.Dense(self.num_outputs, name="dense")(x.mean(axis=(1, 2)))


# Unrolled lanes on CPU, as for the ConvNet (a vmap over per-client kernels is a grouped
# convolution); smaller evaluation chunks for the larger activations.
IMAGE_LANES = LanePreferences(cpu_lane_mode="unroll", cpu_eval_chunk=128)
# pfl-research's CNN on CPU by Winograd (then F(2x2, 3x3), now F(4x4, 3x3)): on the quiet 2-core
# CPU its round took 1.13-1.21 s against 1.42-1.61 s with the im2col weight gradient
# (bench.peer_pfl, 2026-11-27, docs/benchmarks/pfl-research.md). ResNet-18-GN's round was no
# faster by F(2x2, 3x3) (3.50-3.73 s against 3.33-3.48 s, bench.resnet_profile); by F(4x4, 3x3)
# it took 25.9 s against 34.9-38.2 s (the flagfile's round with 2 clients of all their images,
# 2026-11-27, docs/benchmarks/resnet.md).
PFL_LANES = dataclasses.replace(IMAGE_LANES, cpu_conv_impl="winograd")
RESNET_LANES = LanePreferences(cpu_lane_mode="unroll", cpu_eval_chunk=64,
                               accelerator_eval_chunk=512, cpu_conv_impl="winograd")


def _image_classes(data: FederatedDataset, name: str) -> int:
    """The class count; ValueError unless the inputs are images ([H, W], [H, W, C] or H*W
    square) of a classification dataset."""
    numeric_features(data, name)
    shape = tuple(data.feature_shape)
    side = int(round(np.sqrt(shape[0]))) if len(shape) == 1 else 0
    if not (len(shape) in (2, 3) or (len(shape) == 1 and side * side == shape[0])):
        raise ValueError(f"model {name!r} needs image inputs ([H, W], [H, W, C] or H*W flat "
                         f"pixels), got features of shape {shape} from {data.name}")
    if data.num_classes < 2:
        raise ValueError(f"model {name!r} needs a labelled classification dataset with at least "
                         f"2 classes, got {data.num_classes}")
    return data.num_classes


def _build(name, module_cls, lanes, data: FederatedDataset, options: ModelOptions) -> Model:
    classes = _image_classes(data, name)
    return Model(name, module_cls(classes, conv_impl=options.conv_impl_for(lanes)), "softmax", data.feature_shape,
                 data.train.x_dtype, data.x_scale, lanes=lanes)


def fedavg_cnn(data: FederatedDataset, options: ModelOptions) -> Model:
    """McMahan et al. 2017's CIFAR CNN."""
    return _build("fedavg_cnn", FedAvgCNN, IMAGE_LANES, data, options)


def pfl_cnn(data: FederatedDataset, options: ModelOptions) -> Model:
    """pfl-research's CIFAR-10 benchmark CNN."""
    return _build("pfl_cnn", PflCNN, PFL_LANES, data, options)


def resnet18_gn(data: FederatedDataset, options: ModelOptions) -> Model:
    """ResNet-18 with GroupNorm (2 groups), CIFAR stem."""
    return _build("resnet18_gn", ResNetGN, RESNET_LANES, data, options)
