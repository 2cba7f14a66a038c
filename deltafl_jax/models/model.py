"""The model type: a Flax module plus the per-example loss and error that Delta-FL needs.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from deltafl_jax.models.conv import default_conv_impl
from deltafl_jax.models.conv_intercept import rewritten
from deltafl_jax.models.lane_preferences import LanePreferences
from deltafl_jax.models.precision import COMPUTE_DTYPES, mixed

Params = Any

LOSS_KINDS = ("softmax", "sigmoid", "squared", "sequence", "custom")
# How the recurrent layers run over the time steps (--rnn_impl; deltafl_jax.models.text).
RNN_IMPLS = ("scan", "pallas", "pallas_interpret")


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
      conv_impl: how the module's convolutions and max-poolings compute their gradients
        (:mod:`deltafl_jax.models.conv_intercept`): "im2col_wgrad", "winograd", "im2col" or
        "xla" (the module as it is); None: ``ModelOptions.conv_impl`` when
        :func:`~deltafl_jax.models.build_model` builds it, else
        :func:`~deltafl_jax.models.default_conv_impl` of the backend and ``lanes``.
      compute_dtype: the dtype of the forward and backward passes' matrix products and
        convolutions (:func:`deltafl_jax.models.precision.mixed`): "bfloat16" casts the
        float32 parameters and inputs for the module and its outputs back to float32; None
        and "float32" run the module as it is. None: ``ModelOptions.compute_dtype``
        (``--compute_dtype``) when :func:`~deltafl_jax.models.build_model` builds it.
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
    conv_impl: Optional[str] = None
    compute_dtype: Optional[str] = None

    def __post_init__(self):
        if self.loss_kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {self.loss_kind!r}")
        if (self.loss_kind == "custom") != (self.loss_fn is not None):
            raise ValueError(f"model {self.name!r}: a loss_fn goes with loss_kind='custom', "
                             f"and loss_kind='custom' needs one")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"model {self.name!r}: compute_dtype must be one of "
                             f"{', '.join(COMPUTE_DTYPES)} or None, got {self.compute_dtype!r}")

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
        """Outputs on raw (stored-dtype) inputs x: [B, ...] -> [B, ...], the module's
        convolutions and max-poolings on the fast path of ``conv_impl``
        (:func:`deltafl_jax.models.conv_intercept.rewritten`), its products in
        ``compute_dtype`` (:func:`deltafl_jax.models.precision.mixed`; float32 outputs)."""
        forward = mixed(lambda p, x: self.module.apply({"params": p}, x), self.compute_dtype)
        if self.conv_impl != "xla":   # "xla": the module as it is, nothing rewritten
            forward = rewritten(forward, self.conv_impl or default_conv_impl(
                preferences=self.lanes))
        return forward(params, self.preprocess(x))

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


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Model choices that do not come from the dataset."""

    conv_impl: Optional[str] = None  # None: chosen for the backend and the model
    conv_backend: Optional[str] = None  # that backend (--placement_backend); None: the running one
    mlp_hidden: tuple = (64,)
    cnn_hidden: int = 0
    use_bias: Optional[bool] = None  # linear models; None: linear_bias_default(dataset)
    llm: Any = None   # --model=llama: what is fine-tuned (deltafl_jax.models.llm.LLMSettings)
    compute_dtype: str = "float32"   # --compute_dtype (deltafl_jax.models.precision)
    rnn_impl: Optional[str] = None   # --rnn_impl (RNN_IMPLS); None: chosen for the backend

    def conv_impl_for(self, lanes: LanePreferences) -> str:
        """The convolutions of a model with these lane preferences: ``conv_impl`` (the flag),
        else :func:`~deltafl_jax.models.default_conv_impl` of ``conv_backend`` and the
        model."""
        return self.conv_impl or default_conv_impl(self.conv_backend, lanes)
