"""Models: a Flax module plus the per-example loss and error that Delta-FL needs.

Every model gives per-example losses f(w; xi) so that the engine can form both the client
loss F_k(w) = mean_i f(w; xi_i) of Algorithm 2 (line 4) and minibatch SGD steps from one
definition. Losses (paper, App. C.1):

- "softmax": multinomial logistic loss -log p_y, error = 1[argmax != y];
- "sigmoid": binary logistic loss on one logit, error = 1[(logit > 0) != y];
- "squared": ||xi - w(x)||^2 for mean estimation (Fig. 3), error = the same squared loss;
- "sequence": next-token prediction on a sequence of ids x (StackOverflow, Reddi et al. 2021):
  the network reads x[:, :-1] and scores each next token x[:, 1:]; the loss of a sequence is the
  mean cross-entropy over its targets that are not padding, its error the fraction of wrong
  argmax predictions among the targets outside ``Model.error_ignore_ids`` (and padding)
  (:func:`sequence_losses_and_errors`).

- "custom": a model of your own, with its own per-example loss and error
  (``Model.loss_fn(outputs, x, y) -> (loss [B], error [B])``).

Models are looked up by name with :func:`build_model`. The text models (gru, lstm,
sent140_linear, lstm_nwp) live in :mod:`deltafl_jax.models.text` and resolve lazily.

Your own model (a Flax module with its loss and error) is a factory ``(data, options) ->
Model`` registered under a name with :func:`register_model` (``deltafl_jax.register_model``);
``--model=NAME`` (or ``ExperimentConfig(model=NAME)``) then trains it, and
``experiments.run --model_module=FILE_OR_MODULE`` imports the module that registers it. The
The documentation's *Your own model* guide (docs/guides/own-model.md) has the recipe; ``tests/test_custom_model.py`` trains one defined
outside the package.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.models.conv import conv2d, default_conv_impl, max_pool_2x2

Params = Any

LOSS_KINDS = ("softmax", "sigmoid", "squared", "sequence", "custom")


@dataclasses.dataclass(frozen=True)
class LanePreferences:
    """How the engine runs this model's client work, per backend (measured on a 2-core CPU,
    bench/README.md; on accelerators every sampled client gets a lane).

    cpu_lanes: client lanes per step on CPU.
    cpu_lane_mode: "vmap" (one batched step) or "unroll" (independent unbatched copies, for
      convolutions: a vmap over per-client weights is a grouped convolution, ~5x slower on
      XLA:CPU).
    cpu_eval_chunk / accelerator_eval_chunk: examples per evaluation work item.
    """

    cpu_lanes: int = 2
    cpu_lane_mode: str = "vmap"
    cpu_eval_chunk: int = 2048
    accelerator_eval_chunk: int = 1024

    def lanes(self, m: int, backend: str, devices: int = 1) -> int:
        """Lanes per device. On CPU, unrolled lanes are independent op streams that keep the
        host's cores busy; D > 1 host devices already do that, so each device then runs
        cpu_lanes // D of them (measured: ConvNet, 2 devices x 1 lane 10-16% faster than
        2 x 2, bench/README.md). Vmapped lanes batch one op and keep cpu_lanes."""
        if backend != "cpu":
            return m
        if self.cpu_lane_mode == "unroll":
            return min(m, max(1, self.cpu_lanes // max(1, devices)))
        return min(m, self.cpu_lanes)

    def lane_mode(self, backend: str) -> str:
        return self.cpu_lane_mode if backend == "cpu" else "vmap"

    def eval_chunk(self, backend: str) -> int:
        return self.cpu_eval_chunk if backend == "cpu" else self.accelerator_eval_chunk


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as the engine sees it.

    Attributes:
      name: registry name.
      module: Flax module; ``module.apply({"params": p}, x)`` gives the outputs.
      loss_kind: one of LOSS_KINDS.
      input_scale: float inputs are cast to float32 and multiplied by this (None: keep dtype).
      zero_init: initialise every parameter to zero (the reference code's linear models).
      example_shape: shape of one input, for initialisation.
      input_dtype: dtype of one input as stored on the host.
      lanes: how the engine should run its client work (:class:`LanePreferences`).
      pad_id: "sequence" models: the padding id, left out of the loss and the error.
      error_ignore_ids: "sequence" models: target ids left out of the error (e.g. EOS).
      loss_fn: "custom" models: ``loss_fn(outputs, x, y) -> (loss [B], error [B])``, the
        per-example loss f(w; xi) that local SGD differentiates and F_k averages, and the
        per-example error that the evaluations report (pure JAX, jit-able; x the raw inputs,
        y the labels, None for a dataset without labels).
      error_rate: the error is a misclassification rate, shown in % (None: every loss kind
        but "squared" is; a "custom" model says so here, default True).
    """

    name: str
    module: nn.Module
    loss_kind: str
    example_shape: tuple
    input_dtype: Any = np.float32
    input_scale: Optional[float] = None
    zero_init: bool = False
    lanes: LanePreferences = LanePreferences()
    pad_id: int = 0
    error_ignore_ids: tuple = ()
    loss_fn: Optional[Callable] = None
    error_rate: Optional[bool] = None

    def __post_init__(self):
        if self.loss_kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {self.loss_kind!r}")
        if (self.loss_kind == "custom") != (self.loss_fn is not None):
            raise ValueError(f"model {self.name!r}: a loss_fn goes with loss_kind='custom', "
                             f"and loss_kind='custom' needs one")

    @property
    def is_classifier(self) -> bool:
        """Whether the error is a misclassification rate (progress lines show it in %, and
        predict_labels applies); the mean-estimation model's error is its squared loss."""
        if self.error_rate is not None:
            return bool(self.error_rate)
        return self.loss_kind != "squared"

    def init(self, key) -> Params:
        x = jnp.zeros((1,) + tuple(self.example_shape), self.input_dtype)
        params = self.module.init(key, self.preprocess(x))["params"]
        if self.zero_init:
            params = jax.tree.map(jnp.zeros_like, params)
        return params

    def preprocess(self, x):
        if self.input_scale is None:
            return x
        return x.astype(jnp.float32) * jnp.float32(self.input_scale)

    def apply(self, params: Params, x):
        """Outputs on raw (stored-dtype) inputs x: [B, ...] -> [B, ...]."""
        return self.module.apply({"params": params}, self.preprocess(x))

    def losses_and_errors(self, params: Params, x, y):
        """Per-example (loss [B], error [B]) on a batch of raw inputs."""
        out = self.apply(params, x)
        if self.loss_kind == "softmax":
            logp = jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)
            loss = -jnp.take_along_axis(logp, y[:, None].astype(jnp.int32), axis=-1)[:, 0]
            err = (jnp.argmax(out, axis=-1) != y).astype(jnp.float32)
        elif self.loss_kind == "sigmoid":
            z = out.reshape(out.shape[0]).astype(jnp.float32)
            yf = y.astype(jnp.float32)
            # log(1 + e^z) - y z, stable for large |z|.
            loss = jnp.logaddexp(0.0, z) - yf * z
            err = ((z > 0).astype(jnp.float32) != yf).astype(jnp.float32)
        elif self.loss_kind == "sequence":
            loss, err = sequence_losses_and_errors(out, x, self.pad_id, self.error_ignore_ids)
        elif self.loss_kind == "custom":
            loss, err = self.loss_fn(out, x, y)
            loss = jnp.asarray(loss, jnp.float32).reshape(x.shape[0])
            err = jnp.asarray(err, jnp.float32).reshape(x.shape[0])
        else:  # squared
            target = self.preprocess(x).reshape(x.shape[0], -1)
            loss = jnp.sum(jnp.square(target - out.reshape(x.shape[0], -1)), axis=-1)
            err = loss
        return loss, err

    def losses(self, params: Params, x, y):
        return self.losses_and_errors(params, x, y)[0]


def sequence_losses_and_errors(logits, ids, pad_id: int = 0, error_ignore_ids=()):
    """Per-sequence (loss [B], error [B]) of next-token scores.

    logits: [B, T, V] scores of the tokens ids[:, 1:T+1]; ids: [B, T+1] the sequences.
    loss_b = mean over t with target != pad of -log softmax(logits[b, t])[target];
    error_b = the fraction of wrong argmax predictions over t with target != pad and target
    not in `error_ignore_ids` (0 when there is no such target). A sequence weighs the same
    whatever its length (one example = one sentence).
    """
    targets = ids[:, 1:].astype(jnp.int32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    kept = targets != pad_id
    count = jnp.maximum(kept.sum(axis=1), 1).astype(jnp.float32)
    loss = jnp.where(kept, nll, 0.0).sum(axis=1) / count
    scored = kept
    for token in error_ignore_ids:
        scored = scored & (targets != token)
    wrong = (jnp.argmax(logits, axis=-1) != targets) & scored
    err = wrong.sum(axis=1) / jnp.maximum(scored.sum(axis=1), 1).astype(jnp.float32)
    return loss, err.astype(jnp.float32)


# ----------------------------------------------------------------------------- modules


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


# ----------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Model choices that do not come from the dataset."""

    conv_impl: Optional[str] = None  # None: chosen for the backend
    mlp_hidden: tuple = (64,)
    cnn_hidden: int = 0
    use_bias: Optional[bool] = None  # linear models; None: linear_bias_default(dataset)


# The papers' datasets, whose linear models have no bias (App. C.1: w in R^{62x784}, w in R^50).
NO_BIAS_DATASETS = ("femnist", "sent140")
LINEAR_MODELS = ("linear", "sent140_linear")
REGRESSION_MODELS = ("mean",)   # their "error" is the squared loss (no accuracy)


def linear_bias(data: FederatedDataset, options: "ModelOptions") -> bool:
    """Whether a linear model has a bias: ``options.use_bias`` when set, else none for the
    papers' FEMNIST and Sent140 (their w has no bias) and a bias for every other dataset."""
    if options.use_bias is not None:
        return bool(options.use_bias)
    return data.name not in NO_BIAS_DATASETS


def is_token_data(data: FederatedDataset) -> bool:
    """Inputs are token ids (Shakespeare characters, Sent140 words), not numeric features."""
    meta = data.metadata or {}
    return "input_vocab_size" in meta or "embeddings" in meta


def numeric_features(data: FederatedDataset, name: str) -> None:
    """ValueError unless the inputs are numeric features (not token ids)."""
    if is_token_data(data):
        raise ValueError(f"model {name!r} needs numeric features, but {data.name} holds token "
                         f"ids; use gru (shakespeare), or lstm / sent140_linear (sent140)")


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


def _linear(data, opts):
    return Model("linear", Linear(_classes(data, "linear"), linear_bias(data, opts)), "softmax",
                 data.feature_shape, data.train.x_dtype, data.x_scale, zero_init=True)


def _cnn(data, opts):
    _image_shape(data)
    impl = opts.conv_impl or default_conv_impl()
    return Model("cnn", ConvNet(_classes(data, "cnn"), impl, opts.cnn_hidden), "softmax",
                 data.feature_shape, data.train.x_dtype, data.x_scale,
                 lanes=LanePreferences(cpu_lane_mode="unroll", cpu_eval_chunk=128))


def _mlp(data, opts):
    return Model("mlp", MLP(_classes(data, "mlp"), tuple(opts.mlp_hidden)), "softmax",
                 data.feature_shape, data.train.x_dtype, data.x_scale)


def _mean(data, opts):
    numeric_features(data, "mean")
    dim = int(np.prod(data.feature_shape))
    return Model("mean", Mean(dim), "squared", data.feature_shape, data.train.x_dtype,
                 data.x_scale)


MODELS: Dict[str, Callable[[FederatedDataset, ModelOptions], Model]] = {
    "linear": _linear,
    "cnn": _cnn,
    "mlp": _mlp,
    "mean": _mean,
}

# Resolved on first use: "module:function" taking (dataset, options) -> Model.
LAZY_MODELS: Dict[str, str] = {
    "gru": "deltafl_jax.models.text:gru",
    "lstm": "deltafl_jax.models.text:lstm",
    "sent140_linear": "deltafl_jax.models.text:sent140_linear",
    "lstm_nwp": "deltafl_jax.models.text:lstm_nwp",
}


def model_names():
    return sorted(set(MODELS) | set(LAZY_MODELS))


BUILT_IN = frozenset(MODELS) | frozenset(LAZY_MODELS)


def register_model(name: str, factory: Callable[[FederatedDataset, ModelOptions], Model],
                   replace: bool = False) -> None:
    """Make ``--model=name`` build ``factory(data, options)``: your own model, a
    :class:`Model` around a Flax module (e.g. ``loss_kind="custom"`` with its ``loss_fn``).
    Register it before the run (and before ``load_model`` of one of its runs, which rebuilds
    the network by name). ValueError for a built-in name, or a registered one unless
    `replace`."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"a model name is a non-empty string without surrounding spaces, got "
                         f"{name!r}")
    if name in BUILT_IN:
        raise ValueError(f"model {name!r} is built in; register yours under another name")
    if name in MODELS and not replace:
        raise ValueError(f"model {name!r} is registered already (pass replace=True)")
    if not callable(factory):
        raise ValueError(f"register_model({name!r}, ...): the factory must be callable")
    MODELS[name] = factory


def build_model(name: str, data: FederatedDataset, options: ModelOptions = ModelOptions()) -> Model:
    """The model `name` for `data`. Raises ValueError for an unknown name or a mismatch."""
    if name in MODELS:
        return MODELS[name](data, options)
    if name in LAZY_MODELS:
        module_name, fn_name = LAZY_MODELS[name].split(":")
        return getattr(importlib.import_module(module_name), fn_name)(data, options)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(model_names())}")
