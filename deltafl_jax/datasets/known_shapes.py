"""The known shape of a dataset that must be downloaded, so that ``--estimate`` can build,
compile and time its run offline: a stand-in :class:`~deltafl_jax.data.FederatedDataset` of the
dataset's clients, client sizes and example shape, holding constant examples.

    data, note = load_or_stand_in(config.data)   # the data when present, else the stand-in

The statistics are the long paper's Table 1 (App. C.1.1; the same table in
docs/guides/datasets.md), at the cut its flagfiles use:

- FEMNIST (``--dataset=femnist``, ``--min_client_examples=100``, half of the eligible writers):
  865 train and 865 test writers, 101 to 447 images each, median 179; 28 x 28 = 784 uint8
  pixels, 62 classes.

The client sizes are a deterministic spread of the table's median, minimum and maximum: the
normal quantiles (i + 1/2) / N, mapped to lo + (median - lo) * exp(s z) with s putting the
maximum three deviations out, rounded, clipped to [lo, hi], the smallest and largest set to lo
and hi. A stand-in's examples are constant (pixels of 1, labels cycling over the classes): the
compiled program, the plan's shapes and the local-step trips are those of the real data; what
the values change (nothing, for dense arithmetic) is not modelled. The run's client limits
(``--max_train_clients``, ``--max_examples_per_client``, ...) and normalisation apply to it as
to the real data.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Optional, Tuple

import numpy as np

from deltafl_jax.data import ClientData, FederatedDataset
from deltafl_jax.errors import DataError


@dataclasses.dataclass(frozen=True)
class KnownShape:
    """train_clients, test_clients: the number of clients of each split; median, lo, hi: the
    median, minimum and maximum client size; example_shape, dtype: one example's input;
    num_classes; x_scale: the loader's (None: none); source: where the figures come from."""

    train_clients: int
    test_clients: int
    median: int
    lo: int
    hi: int
    example_shape: Tuple[int, ...]
    dtype: str
    num_classes: int
    x_scale: Optional[float]
    source: str


KNOWN = {
    "femnist": KnownShape(train_clients=865, test_clients=865, median=179, lo=101, hi=447,
                          example_shape=(784,), dtype="uint8", num_classes=62,
                          x_scale=1.0 / 255.0,
                          source="the paper's Table 1: writers with >= 100 images, half of "
                                 "them, 865 / 865"),
}


def client_sizes(num_clients: int, median: int, lo: int, hi: int) -> np.ndarray:
    """`num_clients` sizes of the given median, minimum and maximum (module docstring)."""
    if not lo <= median <= hi or lo < 1:
        raise ValueError(f"need 1 <= lo <= median <= hi, got {lo}, {median}, {hi}")
    spread = np.log(max(hi - lo, 1) / max(median - lo, 1)) / 3.0
    normal = statistics.NormalDist()
    z = np.array([normal.inv_cdf((i + 0.5) / num_clients) for i in range(num_clients)])
    sizes = np.clip(np.round(lo + (median - lo) * np.exp(spread * z)), lo, hi).astype(np.int64)
    if num_clients >= 2:
        sizes[0], sizes[-1] = lo, hi
    return sizes


def _split(sizes: np.ndarray, shape: KnownShape) -> ClientData:
    total = int(sizes.sum())
    x = np.ones((total, *shape.example_shape), dtype=np.dtype(shape.dtype))
    y = (np.arange(total) % shape.num_classes).astype(np.int32)
    return ClientData(x=x, y=y, offsets=np.concatenate([[0], np.cumsum(sizes)]),
                      client_ids=np.arange(len(sizes)))


def stand_in(name: str) -> FederatedDataset:
    """The stand-in of dataset `name` at its known shape (KeyError when it has none)."""
    shape = KNOWN[name]
    return FederatedDataset(
        name=name,
        train=_split(client_sizes(shape.train_clients, shape.median, shape.lo, shape.hi), shape),
        test=_split(client_sizes(shape.test_clients, shape.median, shape.lo, shape.hi), shape),
        num_classes=shape.num_classes, x_scale=shape.x_scale,
        metadata={"source": f"stand-in of the known shape ({shape.source})"})


def load_or_stand_in(config) -> Tuple[FederatedDataset, Optional[str]]:
    """(data, note): the dataset of DataConfig `config` when it loads; when it does not (no
    prepared data and no source) and no ``--data_path`` was given, the stand-in of its known
    shape, with the client limits and normalisation applied, and a note saying so. Any other
    DataError is raised."""
    from deltafl_jax.datasets import limits, load_dataset, normalize
    try:
        return load_dataset(config), None
    except DataError as e:
        if config.dataset not in KNOWN or config.data_path:
            raise
        why = str(e)
    data = normalize.normalize(limits.apply_limits(stand_in(config.dataset), config),
                               config.normalize)
    shape = KNOWN[config.dataset]
    return data, (f"{config.dataset}'s known shape, not its data ({shape.source}; "
                  f"{data.train.num_clients} / {data.test.num_clients} clients of "
                  f"{shape.lo}-{shape.hi} examples): {why.splitlines()[0]}")


__all__ = ["KNOWN", "KnownShape", "client_sizes", "stand_in", "load_or_stand_in"]
