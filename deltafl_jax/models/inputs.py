"""What a model reads of its dataset: numeric features or token ids, and whether a linear
model has a bias."""

from __future__ import annotations

from deltafl_jax.data import FederatedDataset
from deltafl_jax.models.model import ModelOptions

# The papers' datasets, whose linear models have no bias (App. C.1: w in R^{62x784}, w in R^50).
NO_BIAS_DATASETS = ("femnist", "sent140")


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
