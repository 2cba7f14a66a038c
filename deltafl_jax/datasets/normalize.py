"""Input normalisation (``--normalize``), applied once when a dataset is loaded.

- ``none``: inputs as the dataset stores them (the engine scales uint8 pixels by ``x_scale``).
- ``reference``: the authors' code (``models/main.py`` of simplicial-fl, whose
  ``std_train = data['mean']``): every feature j becomes (x_j - mu_j) / mu_j, where mu_j is the
  mean of feature j over all the examples of **the split being normalised**: the training
  clients' examples for the training split, the test clients' own examples for the test split.
  It divides by the mean, not by a standard deviation. A feature whose |mu_j| is tiny (below
  ``TINY_RELATIVE`` times the largest |mu| of its split) is blown up by 1/|mu_j|; this happens
  as in the authors' code, with one warning line. A feature whose mean is exactly 0 is only
  centred (divided by 1), where the authors' code would produce NaN.
- ``standard``: z-scoring with the training statistics, (x_j - mu_j) / sd_j for both splits,
  mu and sd (ddof = 0) over all the training examples; a constant feature is only centred.

Only float features are normalised, never token ids:

- uint8 pixels with ``x_scale`` (FEMNIST) are first scaled (x * x_scale in float32, what the
  engine would see) and the result is stored as float32 host arrays, ``x_scale = None``;
- Sent140 stores token ids; its only float features are the mean GloVe vector of each tweet
  (the input of ``sent140_linear``). With ``reference`` or ``standard`` those [n, 50] vectors are
  computed here (mean over the non-padding tokens, unknown words as zero vectors, exactly what
  ``sent140_linear`` computes from the ids) and normalised; the dataset then holds float
  features (``metadata["features"] == "mean_embedding"``), which ``sent140_linear`` reads
  directly. The LSTM needs the token ids and refuses such data.
- Shakespeare's character ids have no float features: any normalisation is refused.

The statistics are kept in the dataset's metadata (``normalize_train_shift`` /
``normalize_train_scale``, and ``normalize_test_*``), and saved with the models, so a served
model can be fed inputs normalised the same way.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Iterator, Optional, Tuple

import numpy as np

from deltafl_jax.data import ClientData, DataError, FederatedDataset, is_generated

METHODS = ("none", "reference", "standard")
MEAN_EMBEDDING = "mean_embedding"   # metadata["features"] of Sent140 as mean GloVe vectors
TINY_RELATIVE = 1e-3                # |mu_j| < this x max_j |mu_j| is "tiny" (reference)
CHUNK = 1 << 15                     # rows converted to float64 at a time

ToFloat = Callable[[np.ndarray], np.ndarray]   # stored rows [c, ...] -> float64 [c, d]


def check_method(method: str) -> None:
    if method not in METHODS:
        raise DataError(f"unknown --normalize={method!r}; choose one of {', '.join(METHODS)}")


def pixel_features(x_scale: Optional[float]) -> ToFloat:
    """Stored rows -> float64 [c, d]: x cast to float32 and times float32(x_scale), as the
    engine preprocesses them, then widened (the statistics are summed in float64)."""
    def convert(rows):
        f = np.asarray(rows).astype(np.float32)
        if x_scale is not None:
            f = f * np.float32(x_scale)
        return f.reshape(len(f), -1).astype(np.float64)
    return convert


def mean_embedding_features(table: np.ndarray, pad_id: int) -> ToFloat:
    """Token-id rows [c, L] -> [c, D] the mean of the table rows of the non-padding ids (a row
    of padding only is the zero vector)."""
    table = np.asarray(table, dtype=np.float64)

    def convert(ids):
        ids = np.asarray(ids, dtype=np.int64)
        mask = (ids != pad_id).astype(np.float64)
        total = np.einsum("cl,cld->cd", mask, table[ids])
        return total / np.maximum(mask.sum(axis=1), 1.0)[:, None]
    return convert


def _chunks(x: np.ndarray, to_float: ToFloat) -> Iterator[Tuple[int, np.ndarray]]:
    for lo in range(0, len(x), CHUNK):
        yield lo, to_float(x[lo:lo + CHUNK])


def feature_mean(x: np.ndarray, to_float: ToFloat) -> np.ndarray:
    """Per-feature mean over all rows of x, in float64."""
    total = None
    for _, f in _chunks(x, to_float):
        total = f.sum(axis=0) if total is None else total + f.sum(axis=0)
    return total / len(x)


def feature_std(x: np.ndarray, to_float: ToFloat, mean: np.ndarray) -> np.ndarray:
    """Per-feature standard deviation (ddof = 0) over all rows of x, in float64."""
    total = np.zeros_like(mean)
    for _, f in _chunks(x, to_float):
        total += np.square(f - mean).sum(axis=0)
    return np.sqrt(total / len(x))


def transform(split: ClientData, to_float: ToFloat, shift: np.ndarray, scale: np.ndarray,
              keep_shape: bool) -> ClientData:
    """The split with x = float32((x - shift) / scale), feature by feature; `keep_shape`
    gives x its stored shape back (images), else x is [n, d]."""
    out = np.empty((len(split.x), shift.size), np.float32)
    for lo, f in _chunks(split.x, to_float):
        out[lo:lo + len(f)] = ((f - shift) / scale).astype(np.float32)
    if keep_shape:
        out = out.reshape((len(out),) + tuple(split.x.shape[1:]))
    return dataclasses.replace(split, x=out)


def divisor(values: np.ndarray) -> np.ndarray:
    """The values, with exact zeros replaced by 1 (that feature is only centred)."""
    return np.where(values == 0.0, 1.0, values)


def tiny_means(mean: np.ndarray) -> np.ndarray:
    """Mask of the features whose |mean| is below TINY_RELATIVE x the largest |mean|."""
    a = np.abs(mean)
    return a < TINY_RELATIVE * a.max() if a.size and a.max() > 0 else np.ones(a.shape, bool)


def tiny_warning(name: str, means) -> Optional[str]:
    """One line about the features that `reference` divides by a tiny mean, or None."""
    parts, smallest = [], np.inf
    for split, mean in means:
        tiny = tiny_means(mean)
        if tiny.any():
            parts.append(f"{int(tiny.sum())} of {tiny.size} in the {split} split")
            nonzero = np.abs(mean[tiny & (mean != 0)])
            smallest = min(smallest, float(nonzero.min()) if nonzero.size else np.inf)
    if not parts:
        return None
    blow = (f"; the smallest nonzero |mean| is {smallest:.3g}, so its feature is multiplied by "
            f"{1 / smallest:.3g}" if np.isfinite(smallest) else "")
    return (f"deltafl_jax: warning: --normalize=reference divides each feature of {name} by its "
            f"mean, as the authors' code; features with |mean| < {TINY_RELATIVE:g} x the "
            f"largest |mean|: {', '.join(parts)}{blow} (a zero mean is only centred)")


def features_of(data: FederatedDataset) -> Tuple[ToFloat, dict]:
    """How to read the dataset's float features, and the metadata of the result; DataError for
    token ids without float features."""
    meta = dict(data.metadata or {})
    if "embeddings" in meta:
        table = meta.pop("embeddings")
        meta["features"] = MEAN_EMBEDDING
        return mean_embedding_features(table, int(meta.get("pad_id", 0))), meta
    if "input_vocab_size" in meta:
        raise DataError(f"--normalize applies to float features; {data.name} holds token ids "
                        f"(pass --normalize=none)")
    return pixel_features(data.x_scale), meta


def normalize(data: FederatedDataset, method: str,
              warn: Optional[Callable[[str], None]] = None) -> FederatedDataset:
    """The dataset with normalised float inputs (module docstring); `method` "none" returns it
    unchanged. `warn` receives the one-line warning of ``reference`` (default: stderr)."""
    check_method(method)
    if method == "none":
        return data
    if is_generated(data.train):
        raise DataError(f"--normalize={method} needs the whole split in memory, but {data.name}'s "
                        f"clients are generated on demand; pass --normalize=none")
    to_float, meta = features_of(data)
    mu_train = feature_mean(data.train.x, to_float)
    if method == "reference":
        mu_test = feature_mean(data.test.x, to_float)
        stats = {"train": (mu_train, divisor(mu_train)), "test": (mu_test, divisor(mu_test))}
        line = tiny_warning(data.name, (("train", mu_train), ("test", mu_test)))
        if line is not None:
            (warn or (lambda s: print(s, file=sys.stderr, flush=True)))(line)
    else:
        sd = divisor(feature_std(data.train.x, to_float, mu_train))
        stats = {"train": (mu_train, sd), "test": (mu_train, sd)}
    for split, (shift, scale) in stats.items():
        meta[f"normalize_{split}_shift"] = shift.astype(np.float32)
        meta[f"normalize_{split}_scale"] = scale.astype(np.float32)
    meta["normalize"] = method
    keep = meta.get("features") != MEAN_EMBEDDING
    return dataclasses.replace(
        data, train=transform(data.train, to_float, *stats["train"], keep),
        test=transform(data.test, to_float, *stats["test"], keep), x_scale=None, metadata=meta)
