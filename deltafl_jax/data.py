"""Federated data held compactly on the host.

A federated split is every client's examples concatenated into one flat array, with an
``offsets`` vector marking where each client starts (CSR layout). Nothing is padded on the
host; the engine builds fixed-size index streams into these arrays each round
(:mod:`deltafl_jax.sampling.plan`), so that ragged clients never cost padded work.

The weight of client k is alpha_k = n_k / sum_j n_j (paper, Sec. 2 and App. C), where n_k is
its number of examples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

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

    @property
    def feature_shape(self) -> Tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def x_dtype(self) -> np.dtype:
        return self.x.dtype

    @property
    def has_labels(self) -> bool:
        return self.y is not None

    def client(self, k: int):
        """(x_k, y_k) of client k, as views into the flat arrays."""
        lo, hi = self.offsets[k], self.offsets[k + 1]
        return self.x[lo:hi], (None if self.y is None else self.y[lo:hi])

    def rows(self, clients: Sequence[int]) -> np.ndarray:
        """[sum n_k] int64: the rows of `clients`, one client after another."""
        clients = np.asarray(clients, dtype=np.int64)
        starts, sizes = self.offsets[clients], self.sizes[clients]
        if sizes.size == 0:
            return np.zeros((0,), np.int64)
        within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        return np.repeat(starts, sizes) + within

    def gather(self, clients: Sequence[int]):
        """(x, y) of `clients`, one after another (y None without labels): what the device
        receives when the host keeps the split (``--client_data=host``)."""
        idx = self.rows(clients)
        return self.x[idx], (None if self.y is None else self.y[idx])

    def digest(self, h) -> None:
        """Feed every array of the split to the hashlib object `h` (the resume fingerprint)."""
        for a in (self.x, self.y, self.offsets):
            if a is not None:
                a = np.ascontiguousarray(a)
                h.update(str((a.dtype, a.shape)).encode())
                h.update(a.tobytes())

    def subset(self, clients: Sequence[int]) -> "ClientData":
        """A new split holding only `clients`, in the given order."""
        clients = np.asarray(clients, dtype=np.int64)
        idx = self.rows(clients)
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
class GeneratedClientData:
    """A split whose clients are generated when they are read, with the read interface of
    :class:`ClientData` (sizes, offsets, ids, :meth:`client`, :meth:`gather`, :meth:`subset`)
    but no flat arrays: client k's examples are a pure function of (the generator, its source
    id), so a population of 10^6 clients costs its sizes alone on the host. Such a split is
    kept on the host (``--client_data=host``): each round ships the sampled clients.

    Attributes:
      offsets: [num_clients + 1] int64, as in :class:`ClientData` (the sizes n_k).
      client_ids: [num_clients] int64: the generator's id of each client.
      generate: source id -> (x [n, *feature_shape], y [n] or None); must return exactly
        n_k examples, the same ones on every call.
      feature_shape, x_dtype, has_labels: what `generate` returns.
      recipe: the generator's parameters as text (the resume fingerprint hashes it).
      max_size: the most examples any client of the generator can have (None: unknown); the
        round buffer's capacity is then m x max_size, whatever the population.
    """

    offsets: np.ndarray
    client_ids: np.ndarray
    generate: Callable[[int], Tuple[np.ndarray, Optional[np.ndarray]]]
    feature_shape: Tuple[int, ...]
    x_dtype: np.dtype
    has_labels: bool
    recipe: str
    max_size: Optional[int] = None

    def __post_init__(self):
        offsets = np.asarray(self.offsets, np.int64)
        if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0:
            raise DataError("offsets must be a 1-D array from 0, with at least one client")
        if np.any(np.diff(offsets) <= 0):
            raise DataError(f"client {int(np.argmin(np.diff(offsets)))} has no examples")
        if len(self.client_ids) != offsets.size - 1:
            raise DataError(f"{len(self.client_ids)} client ids for {offsets.size - 1} clients")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "client_ids", np.asarray(self.client_ids, np.int64))

    num_clients = ClientData.num_clients
    sizes = ClientData.sizes
    num_examples = ClientData.num_examples

    def client(self, k: int):
        x, y = self.generate(int(self.client_ids[k]))
        n = int(self.offsets[k + 1] - self.offsets[k])
        return x[:n], (None if y is None else y[:n])

    def gather(self, clients: Sequence[int]):
        parts = [self.client(int(k)) for k in np.asarray(clients, np.int64)]
        if not parts:
            return (np.zeros((0,) + tuple(self.feature_shape), self.x_dtype),
                    np.zeros((0,), np.int32) if self.has_labels else None)
        x = np.concatenate([p[0] for p in parts])
        return x, (np.concatenate([p[1] for p in parts]) if self.has_labels else None)

    def subset(self, clients: Sequence[int]) -> "GeneratedClientData":
        clients = np.asarray(clients, dtype=np.int64)
        return dataclasses.replace(
            self, offsets=np.concatenate([[0], np.cumsum(self.sizes[clients])]),
            client_ids=self.client_ids[clients])

    def truncated(self, max_examples: int) -> "GeneratedClientData":
        """The first `max_examples` examples of each client."""
        sizes = np.minimum(self.sizes, max_examples)
        bound = max_examples if self.max_size is None else min(self.max_size, max_examples)
        return dataclasses.replace(self, offsets=np.concatenate([[0], np.cumsum(sizes)]),
                                   max_size=bound)

    def digest(self, h) -> None:
        h.update(self.recipe.encode())
        for a in (self.offsets, self.client_ids):
            h.update(np.ascontiguousarray(a).tobytes())


def is_generated(split) -> bool:
    """True for a split generated on demand (:class:`GeneratedClientData`)."""
    return isinstance(split, GeneratedClientData)


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
      holdout: every client's own held-out data (:class:`deltafl_jax.evaluation.holdout.HeldOut`), set
        aside by ``--client_holdout``; None: none.
      partition: how centralised data were split into these clients
        (:class:`deltafl_jax.datasets.partition.Partition`, written to ``partition.npz``);
        None: the dataset's own clients.
    """

    name: str
    train: ClientData
    test: ClientData
    num_classes: int
    x_scale: Optional[float] = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    holdout: Optional[Any] = None
    partition: Optional[Any] = None

    def __post_init__(self):
        if self.train.feature_shape != self.test.feature_shape:
            raise DataError(
                f"train inputs have shape {self.train.feature_shape} but test inputs "
                f"{self.test.feature_shape}")
        for split_name, split in (("train", self.train), ("test", self.test)):
            if is_generated(split):
                continue   # its generator's values are checked by its own tests
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
        return tuple(self.train.feature_shape)

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
