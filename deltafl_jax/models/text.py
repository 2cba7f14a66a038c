"""The papers' text models: a character GRU for Shakespeare, an LSTM and a logistic regression on
frozen GloVe vectors for Sent140 (delta-fl-long.md, App. C.1.2 and C.1.3; reference-notes.md,
"Hyper-parameters"), and the word LSTM of StackOverflow next-word prediction (Reddi et al. 2021).

- ``gru``: embedding of the 53 character classes into 8 dimensions, one GRU layer of 128 units
  over the 20-character window, and a dense layer from its last state to the 53 scores
  (multinomial logistic loss, "softmax").
- ``lstm``: the first 25 token ids of a tweet, looked up in the frozen GloVe table, one LSTM layer
  of 50 units (the embedding size), and a dense layer from the state after the 25th step to one
  logit (binary logistic loss, "sigmoid"). As in the reference code, shorter tweets are padded
  with zero vectors up to 25 steps and the output is read after the last step.
- ``sent140_linear``: logistic regression, w in R^50 (no bias on sent140 unless ``--use_bias``,
  as the paper), on the mean GloVe vector of the tweet's tokens (unknown words count in the
  mean as zero vectors; padding does not count), zero-initialised like the reference code's
  linear models. With ``--normalize`` the mean vectors are computed (and normalised) at load
  time (:mod:`deltafl_jax.datasets.normalize`) and the model reads them directly.

- ``lstm_nwp``: StackOverflow next-word prediction (Reddi et al. 2021, App. C; TFF's
  ``create_recurrent_model``): embedding of the 10,004 ids into 96 dimensions, one LSTM layer of
  670 units over the 20 input tokens, a dense layer to 96 units and a dense layer to the 10,004
  scores at every step (4,050,748 parameters with V = 10,000). Loss kind "sequence"
  (:func:`deltafl_jax.models.model.sequence_losses_and_errors`): a sentence's loss is the mean
  cross-entropy over its targets that are not padding; its error is the fraction of wrong
  predictions over its targets that are neither padding nor EOS. OOV targets count (a
  prediction of OOV on an OOV target is right): this lies between TFF's
  ``accuracy_with_oov`` (masks padding only) and ``accuracy_no_oov_or_eos`` (masks padding,
  EOS and OOV). TFF's Keras loss averages over all unmasked tokens of a batch (the mask of
  ``mask_zero`` on the inputs, which also keeps the step whose input is EOS and target padding);
  here padding targets are left out and each sentence weighs the same. Initialisation follows
  Keras' defaults where Flax allows: embedding uniform in [-0.05, 0.05], Glorot-uniform kernels,
  orthogonal recurrent kernels, zero biases (Keras' unit forget bias of 1 is not reproduced).

The GloVe table (``FederatedDataset.metadata["embeddings"]`` of :mod:`deltafl_jax.datasets.sent140`)
is a constant of the model, held by :class:`FrozenTable`, never a parameter: it gets no
gradient, no SGD step, no L2 penalty and no aggregation.
"""

from __future__ import annotations

from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from deltafl_jax.data import FederatedDataset
from deltafl_jax.datasets.normalize import MEAN_EMBEDDING
from deltafl_jax.models.inputs import is_token_data, linear_bias
from deltafl_jax.models.lane_preferences import LanePreferences
from deltafl_jax.models.model import Model, ModelOptions
from deltafl_jax.models.recurrent import (check_rnn_impl, default_rnn_impl, gru_sequence,
                                          lstm_sequence)
from deltafl_jax.models.init import orthogonal  # Flax's default would call LAPACK (see init.py)

GRU_EMBED_DIM = 8
GRU_HIDDEN = 128
LSTM_HIDDEN = 50
LSTM_MAX_TOKENS = 25
NWP_EMBED_DIM = 96
NWP_HIDDEN = 670


class FrozenTable:
    """A read-only float32 matrix held by a module as a constant.

    Hashed and compared by identity, so modules (and jitted functions closing over them) that
    hold it stay cheap to hash; the matrix enters the computation as a constant.
    """

    def __init__(self, array):
        array = np.array(array, dtype=np.float32)
        array.flags.writeable = False
        self.array = array

    @property
    def shape(self):
        return self.array.shape

    def __repr__(self):
        return f"FrozenTable(shape={self.array.shape})"


class CharGRU(nn.Module):
    """Character embedding -> GRU -> dense scores of the next character."""

    num_classes: int
    vocab_size: int
    embed_dim: int = GRU_EMBED_DIM
    hidden: int = GRU_HIDDEN
    rnn_impl: str = "scan"

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(self.vocab_size, self.embed_dim)(ids.astype(jnp.int32))
        if self.rnn_impl == "scan":
            cell = nn.GRUCell(self.hidden, recurrent_kernel_init=orthogonal())
            last = nn.RNN(cell, return_carry=True)(h)[0]
        else:
            last = _gru_layer(h, self.hidden, nn.initializers.lecun_normal(),
                              self.rnn_impl)[:, -1]
        return nn.Dense(self.num_classes)(last)


class GloveLSTM(nn.Module):
    """Frozen GloVe vectors of the first `max_tokens` ids -> LSTM -> one logit."""

    table: FrozenTable
    hidden: int = LSTM_HIDDEN
    max_tokens: int = LSTM_MAX_TOKENS
    rnn_impl: str = "scan"

    @nn.compact
    def __call__(self, ids):
        ids = ids[:, : self.max_tokens].astype(jnp.int32)
        # ids beyond the stored length are padding (a zero vector, like PAD and UNK).
        vectors = jnp.asarray(self.table.array)[ids]
        if vectors.shape[1] < self.max_tokens:
            vectors = jnp.pad(vectors, ((0, 0), (0, self.max_tokens - vectors.shape[1]), (0, 0)))
        if self.rnn_impl == "scan":
            cell = nn.OptimizedLSTMCell(self.hidden, recurrent_kernel_init=orthogonal())
            (_, h), _ = nn.RNN(cell, return_carry=True)(vectors)
        else:
            h = _lstm_layer(vectors, self.hidden, nn.initializers.lecun_normal(),
                            self.rnn_impl)[:, -1]
        return nn.Dense(1)(h)


class MeanGloveLogistic(nn.Module):
    """Logistic regression <w, mean GloVe vector> (+ b with `use_bias`); padding ids are left
    out of the mean."""

    table: FrozenTable
    pad_id: int = 0
    use_bias: bool = True

    @nn.compact
    def __call__(self, ids):
        ids = ids.astype(jnp.int32)
        vectors = jnp.asarray(self.table.array)[ids]  # [B, L, 50]
        mask = (ids != self.pad_id).astype(vectors.dtype)[..., None]
        count = jnp.maximum(mask.sum(axis=1), 1.0)
        mean = (vectors * mask).sum(axis=1) / count
        return nn.Dense(1, use_bias=self.use_bias)(mean)


class FeatureLogistic(nn.Module):
    """Logistic regression <w, x> (+ b) on float features: Sent140's mean GloVe vectors once
    ``--normalize`` has computed (and normalised) them at load time."""

    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, use_bias=self.use_bias)(x.reshape(x.shape[0], -1))


def _embeddings(data: FederatedDataset, name: str) -> FrozenTable:
    table = data.metadata.get("embeddings") if data.metadata else None
    if table is None and (data.metadata or {}).get("features") == MEAN_EMBEDDING:
        raise ValueError(f"model {name!r} reads token ids, but --normalize="
                         f"{data.metadata.get('normalize')} turned {data.name} into mean GloVe "
                         f"vectors (for sent140_linear); pass --normalize=none")
    if table is None:
        raise ValueError(f"model {name!r} needs a dataset with GloVe token ids (sent140), got "
                         f"{data.name}")
    _token_ids(data, name, int(np.asarray(table).shape[0]))
    return FrozenTable(table)


def _token_ids(data: FederatedDataset, name: str, vocab: int) -> None:
    """ValueError unless the inputs are integer token ids below `vocab`."""
    x = data.train.x
    if not np.issubdtype(x.dtype, np.integer) or not is_token_data(data):
        raise ValueError(f"model {name!r} needs token ids (shakespeare for gru, sent140 for "
                         f"lstm / sent140_linear), got {x.dtype} features of shape "
                         f"{tuple(data.feature_shape)} from {data.name}")
    for split in (data.train, data.test):
        if split.x.size and (int(split.x.max()) >= vocab or int(split.x.min()) < 0):
            raise ValueError(f"model {name!r}: token ids of {data.name} must lie in "
                             f"[0, {vocab}), got [{int(split.x.min())}, {int(split.x.max())}]")


def _check_classes(data: FederatedDataset, name: str, expected: Optional[int] = None):
    if data.num_classes < 2 or (expected is not None and data.num_classes != expected):
        want = f"{expected} classes" if expected else "a classification dataset"
        raise ValueError(f"model {name!r} needs {want}, got {data.num_classes} classes")


# Four vmapped lanes on CPU: the recurrent models' small matrix products gain from batching a
# few clients (measured, bench/README.md).
RECURRENT_LANES = LanePreferences(cpu_lanes=4)


class WordLSTM(nn.Module):
    """Next-word LSTM: ids [B, T+1] -> scores [B, T, vocab] of ids[:, 1:] from ids[:, :-1]."""

    vocab_size: int
    embed_dim: int = NWP_EMBED_DIM
    hidden: int = NWP_HIDDEN
    rnn_impl: str = "scan"

    @nn.compact
    def __call__(self, ids):
        inputs = ids[:, :-1].astype(jnp.int32)
        h = nn.Embed(self.vocab_size, self.embed_dim,
                     embedding_init=_symmetric_uniform(0.05))(inputs)
        glorot = nn.initializers.xavier_uniform()
        if self.rnn_impl == "scan":
            cell = nn.OptimizedLSTMCell(self.hidden, kernel_init=glorot,
                                        recurrent_kernel_init=orthogonal())
            h = nn.RNN(cell)(h)
        else:
            h = _lstm_layer(h, self.hidden, glorot, self.rnn_impl)
        h = nn.Dense(self.embed_dim, kernel_init=glorot)(h)
        return nn.Dense(self.vocab_size, kernel_init=glorot)(h)


class _DenseParams(nn.Module):
    """The kernel [in, features] (and bias [features]) an ``nn.Dense`` at this path would
    declare, with the same names, shapes and initial values, without applying it."""

    features: int
    use_bias: bool
    kernel_init: Callable

    @nn.compact
    def __call__(self, in_features: int):
        kernel = self.param("kernel", self.kernel_init, (in_features, self.features),
                            jnp.float32)
        if not self.use_bias:
            return kernel, None
        return kernel, self.param("bias", nn.initializers.zeros_init(), (self.features,),
                                  jnp.float32)


class _CellParams(nn.Module):
    """The parameters of Flax's ``nn.GRUCell`` (gates "rzn": ir, iz, in with biases, hr, hz
    without, hn with) or ``nn.OptimizedLSTMCell`` (gates "ifgo": ii, ... without biases, hi, ...
    with), joined: w_i [D, G*H], the bias of the input projection [G*H] (the GRU's input-side
    biases; the LSTM's h-side ones, which only add), w_h [H, G*H], and the GRU's b_hn [H]."""

    hidden: int
    kernel_init: Callable
    gates: str

    @nn.compact
    def __call__(self, in_features: int):
        gru = self.gates == "rzn"
        made = {}
        for gate in self.gates:
            made["i" + gate] = _DenseParams(self.hidden, gru, self.kernel_init,
                                            name="i" + gate)(in_features)
            made["h" + gate] = _DenseParams(self.hidden, not gru or gate == "n", orthogonal(),
                                            name="h" + gate)(self.hidden)
        join = lambda side, k: jnp.concatenate(  # noqa: E731
            [made[side + g][k] for g in self.gates], axis=-1)
        b_hn = made["hn"][1] if gru else None
        return join("i", 0), join("i" if gru else "h", 1), join("h", 0), b_hn


def _gru_layer(x, hidden: int, kernel_init, impl: str):
    """x [B, T, D] -> the GRU's states [B, T, H] by :func:`gru_sequence`, its parameters
    where ``nn.RNN(nn.GRUCell(...))`` keeps them (``GRUCell_0``); called inside a compact
    ``__call__``. The input projection of every step is one product."""
    w_i, b_i, w_h, b_hn = _CellParams(hidden, kernel_init, "rzn",
                                      name="GRUCell_0")(x.shape[-1])
    x = x.astype(w_i.dtype)   # the parameters' dtype: bf16 under --compute_dtype=bfloat16
    xp = jnp.dot(x, w_i) + b_i.astype(x.dtype)       # [B, T, 3H]
    h0 = jnp.zeros((x.shape[0], hidden), jnp.float32)
    return gru_sequence(xp, w_h.astype(x.dtype), b_hn, h0, impl)


def _lstm_layer(x, hidden: int, kernel_init, impl: str):
    """x [B, T, D] -> the LSTM's hidden states [B, T, H] by :func:`lstm_sequence`, its
    parameters where ``nn.RNN(nn.OptimizedLSTMCell(...))`` keeps them
    (``OptimizedLSTMCell_0``); Flax's h-side biases are added to the input projection."""
    w_i, b_h, w_h, _ = _CellParams(hidden, kernel_init, "ifgo",
                                   name="OptimizedLSTMCell_0")(x.shape[-1])
    x = x.astype(w_i.dtype)   # GloVe rows are float32 constants: computed in the weights' dtype
    xp = jnp.dot(x, w_i) + b_h.astype(x.dtype)       # [B, T, 4H]
    zeros = jnp.zeros((x.shape[0], hidden), jnp.float32)
    return lstm_sequence(xp, w_h.astype(x.dtype), zeros, zeros, impl)


def _rnn_impl(options: ModelOptions) -> str:
    """``--rnn_impl``, else the backend's default; ValueError when it cannot run there."""
    impl = options.rnn_impl or default_rnn_impl(options.conv_backend)
    check_rnn_impl(impl, options.conv_backend)
    return impl


def _symmetric_uniform(limit: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -limit, limit)
    return init


def gru(data: FederatedDataset, options: ModelOptions) -> Model:
    """Shakespeare's GRU (embedding 8, GRU 128, dense to the classes)."""
    _check_classes(data, "gru")
    vocab = int((data.metadata or {}).get("input_vocab_size", data.num_classes))
    _token_ids(data, "gru", vocab)
    module = CharGRU(num_classes=data.num_classes, vocab_size=vocab, rnn_impl=_rnn_impl(options))
    return Model("gru", module, "softmax", data.feature_shape, data.train.x_dtype,
                 lanes=RECURRENT_LANES)


def lstm(data: FederatedDataset, options: ModelOptions) -> Model:
    """Sent140's LSTM (frozen GloVe-50, hidden 50, first 25 tokens, one logit)."""
    _check_classes(data, "lstm", 2)
    module = GloveLSTM(table=_embeddings(data, "lstm"), rnn_impl=_rnn_impl(options))
    return Model("lstm", module, "sigmoid", data.feature_shape, data.train.x_dtype,
                 lanes=RECURRENT_LANES)


def sent140_linear(data: FederatedDataset, options: ModelOptions) -> Model:
    """Sent140's logistic regression on the mean GloVe vector (w in R^50; a bias only with
    --use_bias, see :func:`deltafl_jax.models.inputs.linear_bias`; zero init), from the token
    ids, or from the mean vectors themselves when ``--normalize`` computed them at load time."""
    _check_classes(data, "sent140_linear", 2)
    bias = linear_bias(data, options)
    if (data.metadata or {}).get("features") == MEAN_EMBEDDING:
        return Model("sent140_linear", FeatureLogistic(use_bias=bias), "sigmoid",
                     data.feature_shape, data.train.x_dtype, zero_init=True)
    pad_id = int(data.metadata.get("pad_id", 0))
    return Model("sent140_linear", MeanGloveLogistic(table=_embeddings(data, "sent140_linear"),
                                                     pad_id=pad_id, use_bias=bias), "sigmoid",
                 data.feature_shape, data.train.x_dtype, zero_init=True)


def lstm_nwp(data: FederatedDataset, options: ModelOptions) -> Model:
    """StackOverflow's next-word LSTM (embedding 96, LSTM 670, dense 96, dense to the ids)."""
    meta = data.metadata or {}
    if meta.get("task") != "next_word_prediction":
        raise ValueError(f"model 'lstm_nwp' needs a next-word prediction dataset "
                         f"(stackoverflow), got {data.name}")
    vocab = int(meta["input_vocab_size"])
    _token_ids(data, "lstm_nwp", vocab)
    module = WordLSTM(vocab_size=vocab, rnn_impl=_rnn_impl(options))
    return Model("lstm_nwp", module, "sequence", data.feature_shape, data.train.x_dtype,
                 lanes=RECURRENT_LANES, pad_id=int(meta["pad_id"]),
                 error_ignore_ids=(int(meta["eos_id"]),))
