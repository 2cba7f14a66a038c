"""Federated data held compactly on the host.

A federated split is every client's examples concatenated into one flat array, with an
``offsets`` vector marking where each client starts (CSR layout). Nothing is padded on the
host; the engine builds fixed-size index streams into these arrays each round
(:mod:`deltafl_jax.plan`), so that ragged clients never cost padded work.

The weight of client k is alpha_k = n_k / sum_j n_j (paper, Sec. 2 and App. C), where n_k is
its number of examples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from deltafl_jax.errors import DataError


@dataclasses.dataclass(frozen=True)
class ClientData:
    """One split (train or test) of a federated dataset, in CSR layout.

    Attributes:
      x: [total_examples, *feature_shape] inputs, in their compact source dtype
        (uint8 pixels, int32 tokens, float32 features).
      y: [total_examples] int32 labels, or None for label-free tasks (mean estimation).
      offsets: [num_clients + 1] int64; client k owns rows offsets[k]:offsets[k+1].
      client_ids: [num_clients] the source's client names (str or int), for reports.
    """

    x: np.ndarray
    y: Optional[np.ndarray]
    offsets: np.ndarray
    client_ids: np.ndarray

    def __post_init__(self):
        offsets = np.asarray(self.offsets)
        if offsets.ndim != 1 or offsets.size < 2:
            raise DataError("offsets must be a 1-D array with at least one client")
        if offsets[0] != 0 or offsets[-1] != len(self.x):
            raise DataError(
                f"offsets must run from 0 to len(x)={len(self.x)}, got {offsets[0]}..{offsets[-1]}")
        sizes = np.diff(offsets)
        if np.any(sizes <= 0):
            raise DataError(f"client {int(np.argmin(sizes))} has no examples")
        if self.y is not None and len(self.y) != len(self.x):
            raise DataError(f"y has {len(self.y)} rows but x has {len(self.x)}")
        if len(self.client_ids) != sizes.size:
            raise DataError(
                f"{len(self.client_ids)} client ids for {sizes.size} clients")
        object.__setattr__(self, "offsets", offsets.astype(np.int64))

    @property
    def num_clients(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def sizes(self) -> np.ndarray:
        """[num_clients] int64 example counts n_k."""
        return np.diff(self.offsets)

    @property
    def num_examples(self) -> int:
        return int(self.offsets[-1])

    def client(self, k: int):
        """(x_k, y_k) of client k, as views into the flat arrays."""
        lo, hi = self.offsets[k], self.offsets[k + 1]
        return self.x[lo:hi], (None if self.y is None else self.y[lo:hi])

    def subset(self, clients: Sequence[int]) -> "ClientData":
        """A new split holding only `clients`, in the given order."""
        clients = np.asarray(clients, dtype=np.int64)
        idx = np.concatenate([np.arange(self.offsets[k], self.offsets[k + 1]) for k in clients])
        sizes = self.sizes[clients]
        return ClientData(
            x=self.x[idx],
            y=None if self.y is None else self.y[idx],
            offsets=np.concatenate([[0], np.cumsum(sizes)]),
            client_ids=np.asarray(self.client_ids)[clients],
        )

    @classmethod
    def from_clients(cls, xs: Sequence[np.ndarray], ys: Optional[Sequence[np.ndarray]],
                     client_ids: Optional[Sequence[Any]] = None) -> "ClientData":
        """Concatenate per-client arrays into the CSR layout."""
        if len(xs) == 0:
            raise DataError("no clients")
        sizes = [len(a) for a in xs]
        x = np.concatenate(xs, axis=0)
        y = None if ys is None else np.concatenate(ys, axis=0)
        ids = np.arange(len(xs)) if client_ids is None else np.asarray(client_ids)
        return cls(x=x, y=y, offsets=np.concatenate([[0], np.cumsum(sizes)]), client_ids=ids)


@dataclasses.dataclass(frozen=True)
class FederatedDataset:
    """A train split and a test split of disjoint clients, and how to read their inputs.

    Attributes:
      name: dataset name, e.g. "synthetic" or "shakespeare".
      train, test: the two splits.
      num_classes: number of labels (0 for regression tasks).
      x_scale: inputs are multiplied by this on the device after a cast to float32
        (1/255 for uint8 pixels); None keeps the dtype (token ids stay integers).
      metadata: free-form facts for reports (source file, preparation rules, ...).
    """

    name: str
    train: ClientData
    test: ClientData
    num_classes: int
    x_scale: Optional[float] = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.train.x.shape[1:] != self.test.x.shape[1:]:
            raise DataError(
                f"train inputs have shape {self.train.x.shape[1:]} but test inputs "
                f"{self.test.x.shape[1:]}")
        for split_name, split in (("train", self.train), ("test", self.test)):
            if np.issubdtype(split.x.dtype, np.floating) and not np.all(np.isfinite(split.x)):
                raise DataError(f"{split_name} inputs hold NaN or Inf")
            if split.y is not None and self.num_classes > 0:
                if np.issubdtype(split.y.dtype, np.floating):
                    raise DataError(f"{split_name} labels must be integers")
                if split.y.size and (split.y.min() < 0 or split.y.max() >= self.num_classes):
                    raise DataError(
                        f"{split_name} labels must lie in [0, {self.num_classes}), got "
                        f"{split.y.min()}..{split.y.max()}")

    @property
    def feature_shape(self):
        return tuple(self.train.x.shape[1:])

    def stats(self) -> dict:
        """The columns of the paper's Table 1 (points per train client)."""
        sizes = self.train.sizes
        return {
            "num_classes": int(self.num_classes),
            "num_train_clients": int(self.train.num_clients),
            "num_test_clients": int(self.test.num_clients),
            "median_examples": float(np.median(sizes)),
            "min_examples": int(sizes.min()),
            "max_examples": int(sizes.max()),
        }


def split_clients(data: ClientData, seed: int, train_fraction: float = 0.5):
    """Split the clients of `data` at random into (train, test), as LEAF does (50/50 by user).

    With an odd number of clients the test split gets the extra client, as in the paper's
    Table 1 (438/439 for Sent140, 544/545 for Shakespeare).
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(data.num_clients)
    n_train = int(np.floor(train_fraction * data.num_clients))
    if n_train < 1 or n_train >= data.num_clients:
        raise DataError(f"cannot split {data.num_clients} clients into train and test")
    return data.subset(np.sort(order[:n_train])), data.subset(np.sort(order[n_train:]))
