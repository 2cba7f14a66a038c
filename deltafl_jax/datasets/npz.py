"""A user's own federated data from one .npz file (``--dataset=npz --data_path=FILE.npz``).

The file holds six arrays (README.md, "Your own data"):

- ``train_x`` [N, ...] inputs (any numeric dtype; floats must be finite),
- ``train_y`` [N] integer labels 0..C-1 (absent for ``--model=mean``),
- ``train_client`` [N] integer client id of each example,
- ``test_x``, ``test_y``, ``test_client`` likewise, for clients that do not train,

and optionally a scalar ``x_scale`` by which inputs are multiplied after a cast to float32
(e.g. 1/255 for uint8 pixels). A client's examples need not be contiguous; they are grouped
by id (in order of first appearance within the id's rows), clients sorted by id. The number of
classes is max(y) + 1 over both splits.

Centralised data: without ``train_client`` and ``test_client`` the file is split into clients
by ``--partition`` (:mod:`deltafl_jax.datasets.partition`): the train split into
``--num_clients`` training clients, the test split into as many test clients of its own (unseen
devices) with the same partitioner and a seed of its own. ``--partition`` on a file that has
client columns is refused (its clients are the user's).
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from deltafl_jax.data import ClientData, DataError, FederatedDataset
from deltafl_jax.datasets import centralised, partition as partitioning

REQUIRED = ("train_x", "train_client", "test_x", "test_client")
CLIENT_COLUMNS = ("train_client", "test_client")


def _check_split(x, y, split: str, path: str) -> None:
    """DataError naming the array when a split's inputs or labels are not usable."""
    if y is not None:
        if y.ndim != 1 or len(y) != len(x):
            raise DataError(f"{path}: {split}_y must be 1-D with one label per row of {split}_x "
                            f"({len(x)} rows), got shape {y.shape}")
        if np.issubdtype(y.dtype, np.floating):
            if not np.all(np.isfinite(y)) or not np.all(y == np.round(y)):
                raise DataError(f"{path}: {split}_y must hold integer class labels")
        elif not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: {split}_y must hold integer class labels, got {y.dtype}")
        if y.size and y.min() < 0:
            raise DataError(f"{path}: {split}_y holds a negative label ({y.min()})")
    if len(x) == 0:
        raise DataError(f"{path}: {split}_x has no rows")
    if np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)):
        raise DataError(f"{path}: {split}_x holds NaN or Inf")
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        raise DataError(f"{path}: {split}_x must be numeric, got {x.dtype}")


def _group(x, y, client, split: str, path: str) -> ClientData:
    if client.ndim != 1 or len(client) != len(x):
        raise DataError(f"{path}: {split}_client must be 1-D with one id per row of {split}_x "
                        f"({len(x)} rows), got shape {client.shape}")
    if not np.issubdtype(client.dtype, np.integer):
        raise DataError(f"{path}: {split}_client must hold integer client ids, got {client.dtype}")
    _check_split(x, y, split, path)
    order = np.argsort(client, kind="stable")
    ids, counts = np.unique(client[order], return_counts=True)
    return ClientData(x=x[order], y=None if y is None else y[order].astype(np.int32),
                      offsets=np.concatenate([[0], np.cumsum(counts)]), client_ids=ids)


def _client_columns(arrays, path: str, config) -> bool:
    """Whether the file has its own clients; DataError when it has one column of the two, or
    none and no ``--partition`` (or both and ``--partition``)."""
    has = [k in arrays for k in CLIENT_COLUMNS]
    if has[0] != has[1]:
        absent = CLIENT_COLUMNS[has.index(False)]
        raise DataError(f"{path} lacks the array(s) {absent} (give both train_client and "
                        f"test_client, or neither and --partition to split the data into "
                        f"clients)")
    if has[0] and config.partitioner.method != "none":
        raise DataError(f"--partition={config.partitioner.method}: {path} has its own clients "
                        f"(train_client, test_client); drop --partition or those arrays")
    if not has[0] and config.partitioner.method == "none":
        raise DataError(f"{path} has no train_client/test_client arrays: pass "
                        f"--partition=iid|dirichlet|shards|pathological|inner_dirichlet|size "
                        f"to split it into clients")
    return has[0]


def _partitioned(arrays, path: str, config):
    """(train, test, Partition) of a file without client columns, split by ``--partition``."""
    xs, ys = (arrays["train_x"], arrays["test_x"]), (arrays.get("train_y"), arrays.get("test_y"))
    for split, x, y in zip(("train", "test"), xs, ys):
        _check_split(x, y, split, path)
    return partition_arrays(xs, ys, config)


def partition_arrays(xs, ys, config):
    """(train, test, Partition): the centralised splits xs = (train_x, test_x), ys = (train_y,
    test_y) (None: no labels) split into clients by ``--partition``."""
    part = partitioning.partition_splits(ys[0], ys[1], partitioning.spec_of(config),
                                         len(xs[0]), len(xs[1]))
    splits = []
    for x, y, parts in zip(xs, ys, (part.train, part.test)):
        x, y, offsets = partitioning.split_data(x, y, parts)
        splits.append(ClientData(x=x, y=None if y is None else y.astype(np.int32),
                                 offsets=offsets, client_ids=np.arange(len(parts))))
    return splits[0], splits[1], part


def load_partitioned_images(config) -> FederatedDataset:
    """A centralised image dataset (:mod:`deltafl_jax.datasets.centralised`: ``mnist``,
    ``fashion_mnist``, ``cifar10``, ``cifar100``, ``tfds:NAME``) from the cache (prepared from
    ``--data_path`` on first use; no download at run time), split into train and test clients
    by ``--partition``; pixels are uint8, seen by the model as pixel / 255."""
    if config.partitioner.method == "none":
        raise DataError(f"--dataset={config.dataset} has no clients of its own: give "
                        f"--partition=iid|dirichlet|shards|pathological|inner_dirichlet|size")
    c = centralised.load_centralised(config.dataset, config.data_path, config.resolved_data_dir)
    return partitioned_images(c, config)


def partitioned_images(c, config) -> FederatedDataset:
    """Centralised arrays `c` (:class:`deltafl_jax.datasets.centralised.Centralised`) split into
    train and test clients by ``--partition``; pixels are uint8, seen as pixel / 255."""
    train, test, part = partition_arrays((c.train_x, c.test_x), (c.train_y, c.test_y), config)
    return FederatedDataset(name=config.dataset, train=train, test=test,
                            num_classes=c.num_classes, x_scale=1.0 / 255.0,
                            metadata={"source": c.metadata.get("source")}, partition=part)


def load_npz(config) -> FederatedDataset:
    path = config.data_path
    if not path:
        raise DataError("--dataset=npz needs --data_path=FILE.npz")
    if not os.path.isfile(path):
        raise DataError(f"--data_path={path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"--data_path={path} is not a readable .npz file ({e})") from None
    own_clients = _client_columns(arrays, path, config)
    required = REQUIRED if own_clients else ("train_x", "test_x")
    missing = [k for k in required if k not in arrays]
    if missing:
        raise DataError(f"{path} lacks the array(s) {', '.join(missing)} (needs train_x, "
                        f"train_client, test_x, test_client, and train_y, test_y for labels)")
    has_y = ("train_y" in arrays, "test_y" in arrays)
    if has_y[0] != has_y[1]:
        raise DataError(f"{path}: give both train_y and test_y, or neither")
    train_x, test_x = arrays["train_x"], arrays["test_x"]
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DataError(f"{path}: train_x rows have shape {train_x.shape[1:]} but test_x rows "
                        f"{test_x.shape[1:]}")
    part = None
    if own_clients:
        train = _group(train_x, arrays.get("train_y"), arrays["train_client"], "train", path)
        test = _group(test_x, arrays.get("test_y"), arrays["test_client"], "test", path)
    else:
        train, test, part = _partitioned(arrays, path, config)
    num_classes = 0
    if has_y[0]:
        num_classes = int(max(train.y.max(), test.y.max())) + 1
    x_scale = None
    if "x_scale" in arrays:
        x_scale = float(np.asarray(arrays["x_scale"]).reshape(()))
        if not np.isfinite(x_scale) or x_scale <= 0:
            raise DataError(f"{path}: x_scale must be a positive number, got {x_scale}")
    return FederatedDataset(name="npz", train=train, test=test, num_classes=num_classes,
                            x_scale=x_scale, metadata={"path": os.path.abspath(path)},
                            partition=part)
