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

The centralised image datasets (``cifar10``, ``cifar100``, ``fashion_mnist``, ``mnist``) have a
known shape of their source splits (:data:`KNOWN_CENTRALISED`: images per split, image shape,
classes; the authors' published counts). Their stand-in is the centralised arrays (pixels of 1,
labels cycling over the classes, so every class holds the same number of examples, as CIFAR's
and Fashion-MNIST's do), split into clients by the run's own ``--partition``: the client sizes
of a label-skewed partition are drawn as on the real data, from the same per-class counts.
MNIST's classes are not balanced (5,421 to 6,742 training images), so its stand-in's client
sizes follow the balanced counts instead.
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


@dataclasses.dataclass(frozen=True)
class CentralisedShape:
    """train, test: the images of each source split; image_shape: one image (uint8, NHWC);
    num_classes; source: where the figures come from."""

    train: int
    test: int
    image_shape: Tuple[int, ...]
    num_classes: int
    source: str


KNOWN_CENTRALISED = {
    "cifar10": CentralisedShape(50000, 10000, (32, 32, 3), 10,
                                "Krizhevsky 2009: 50,000 / 10,000 images of 32 x 32 x 3, 10 "
                                "classes of 5,000 / 1,000"),
    "cifar100": CentralisedShape(50000, 10000, (32, 32, 3), 100,
                                 "Krizhevsky 2009: 50,000 / 10,000 images of 32 x 32 x 3, 100 "
                                 "classes of 500 / 100"),
    "fashion_mnist": CentralisedShape(60000, 10000, (28, 28, 1), 10,
                                      "Xiao et al. 2017: 60,000 / 10,000 images of 28 x 28, 10 "
                                      "classes of 6,000 / 1,000"),
    "mnist": CentralisedShape(60000, 10000, (28, 28, 1), 10,
                              "LeCun et al. 1998: 60,000 / 10,000 images of 28 x 28, 10 "
                              "classes (balanced in the stand-in)"),
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


def centralised_stand_in(name: str):
    """The centralised stand-in of `name` (:data:`KNOWN_CENTRALISED`; KeyError when it has
    none): constant pixels, labels cycling over the classes."""
    from deltafl_jax.datasets.centralised import Centralised
    shape = KNOWN_CENTRALISED[name]

    def split(n):
        return (np.ones((n, *shape.image_shape), np.uint8),
                (np.arange(n) % shape.num_classes).astype(np.int32))

    (train_x, train_y), (test_x, test_y) = split(shape.train), split(shape.test)
    return Centralised(name=name, train_x=train_x, train_y=train_y, test_x=test_x,
                       test_y=test_y, num_classes=shape.num_classes,
                       metadata={"source": f"stand-in of the known shape ({shape.source})"})


def _centralised_or_stand_in(config) -> Tuple[FederatedDataset, Optional[str]]:
    """A centralised image dataset partitioned by the run's flags: its data when they load,
    else (no ``--data_path``) its stand-in's, with a note."""
    from deltafl_jax.datasets import (limits, load_centralised, load_dataset, normalize, npz,
                                      partition)
    try:
        return load_dataset(config), None
    except DataError as e:
        if config.data_path or config.partitioner.method == "none":
            raise
        try:   # only a missing source falls back: a partition error on real data is raised
            load_centralised(config.dataset, None, config.resolved_data_dir)
        except DataError:
            pass
        else:
            raise
        why = str(e)
    shape = KNOWN_CENTRALISED[config.dataset]
    data = npz.partitioned_images(centralised_stand_in(config.dataset), config)
    data = normalize.normalize(partition.kept(limits.apply_limits(data, config)),
                               config.normalize)
    return data, (f"{config.dataset}'s known shape, not its data ({shape.source}; "
                  f"{data.train.num_clients} / {data.test.num_clients} clients by "
                  f"--partition={config.partitioner.method}): {why.splitlines()[0]}")


def load_or_stand_in(config) -> Tuple[FederatedDataset, Optional[str]]:
    """(data, note): the dataset of DataConfig `config` when it loads; when it does not (no
    prepared data and no source) and no ``--data_path`` was given, the stand-in of its known
    shape, with the client limits and normalisation applied, and a note saying so. Any other
    DataError is raised."""
    from deltafl_jax.datasets import limits, load_dataset, normalize
    if config.dataset in KNOWN_CENTRALISED:
        return _centralised_or_stand_in(config)
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


__all__ = ["KNOWN", "KNOWN_CENTRALISED", "CentralisedShape", "KnownShape", "centralised_stand_in",
           "client_sizes", "stand_in", "load_or_stand_in"]
