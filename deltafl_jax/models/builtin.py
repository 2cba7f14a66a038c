"""The built-in models on numeric features: softmax regression (``linear``), the papers'
ConvNet (``cnn``), a small ReLU network (``mlp``) and mean estimation (``mean``); each a Flax
module and its factory ``(data, options) -> Model``. The text models are in
:mod:`deltafl_jax.models.text`."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.models.conv import conv2d, max_pool_2x2
from deltafl_jax.models.inputs import linear_bias, numeric_features
from deltafl_jax.models.lane_preferences import LanePreferences
from deltafl_jax.models.model import Model

# The dense networks (linear, mlp, mean) have no convolution or max-pooling: their forward
# pass runs as it is, never traced for a rewrite (Model.conv_impl, models.conv_intercept).
DENSE = "xla"


class Linear(nn.Module):
    """Softmax regression: scores <w_c, x> (+ b_c with `use_bias`). The paper's model
    (App. C.1.1) has w in R^{62 x 784} and no bias."""

    num_outputs: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_outputs, use_bias=self.use_bias)(x.reshape(x.shape[0], -1))


class ConvNet(nn.Module):
    """The paper's ConvNet (App. C.1.1): conv5x5-32, ReLU, maxpool 2, conv5x5-64, ReLU,
    maxpool 2, dense to the class scores."""

    num_outputs: int
    conv_impl: str = "im2col_wgrad"
    hidden: int = 0  # the reference code adds a 1024-unit dense layer; the paper has none

    @nn.compact
    def __call__(self, x):
        if x.ndim == 2:  # flat 784 pixels
            side = int(round(np.sqrt(x.shape[-1])))
            x = x.reshape(x.shape[0], side, side, 1)
        elif x.ndim == 3:
            x = x[..., None]
        for feats in (32, 64):
            kernel = self.param("kernel_%d" % feats, nn.initializers.lecun_normal(),
                                (5, 5, x.shape[-1], feats))
            bias = self.param("bias_%d" % feats, nn.initializers.zeros, (feats,))
            x = max_pool_2x2(nn.relu(conv2d(x, kernel, self.conv_impl) + bias))
        x = x.reshape(x.shape[0], -1)
        if self.hidden:
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_outputs)(x)


class MLP(nn.Module):
    """A small ReLU network for synthetic data."""

    num_outputs: int
    hidden: tuple = (64,)

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for h in self.hidden:
            x = nn.relu(nn.Dense(h)(x))
        return nn.Dense(self.num_outputs)(x)


class Mean(nn.Module):
    """Mean estimation: the model is a point w; the output is w for every input (Fig. 3)."""

    dim: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.zeros, (self.dim,))
        return jnp.broadcast_to(w, (x.shape[0], self.dim))


def _classes(data: FederatedDataset, name: str) -> int:
    if data.num_classes < 2:
        raise ValueError(f"model {name!r} needs a labelled classification dataset with at least "
                         f"2 classes, got {data.num_classes}")
    numeric_features(data, name)
    return data.num_classes


def _image_shape(data: FederatedDataset) -> None:
    """The ConvNet needs square images: [H, W], [H, W, C], or H*W flat pixels."""
    shape = tuple(data.feature_shape)
    side = int(round(np.sqrt(shape[0]))) if len(shape) == 1 else 0
    if not (len(shape) in (2, 3) or (len(shape) == 1 and side * side == shape[0])):
        raise ValueError(f"model 'cnn' needs image inputs ([H, W], [H, W, C] or H*W flat "
                         f"pixels), got features of shape {shape} from {data.name}")


def linear(data, opts):
    return Model("linear", Linear(_classes(data, "linear"), linear_bias(data, opts)), "softmax",
                 data.feature_shape, data.train.x_dtype, data.x_scale, zero_init=True,
                 conv_impl=DENSE)


def cnn(data, opts):
    _image_shape(data)
    lanes = LanePreferences(cpu_lane_mode="unroll", cpu_eval_chunk=128)
    net = ConvNet(_classes(data, "cnn"), opts.conv_impl_for(lanes), opts.cnn_hidden)
    return Model("cnn", net, "softmax", data.feature_shape, data.train.x_dtype, data.x_scale,
                 lanes=lanes)


def mlp(data, opts):
    return Model("mlp", MLP(_classes(data, "mlp"), tuple(opts.mlp_hidden)), "softmax",
                 data.feature_shape, data.train.x_dtype, data.x_scale, conv_impl=DENSE)


def mean(data, opts):
    numeric_features(data, "mean")
    dim = int(np.prod(data.feature_shape))
    return Model("mean", Mean(dim), "squared", data.feature_shape, data.train.x_dtype,
                 data.x_scale, conv_impl=DENSE)
