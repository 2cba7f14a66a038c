"""Centralised image-classification data: ``train_x, train_y, test_x, test_y`` before any split
into clients (``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100`` and ``tfds:NAME``).

Images are uint8 [n, height, width, channels] (NHWC; MNIST's have one channel), labels int32
[n] in [0, num_classes), train and test as their source splits them. Two routes:

- ``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``: the files their authors publish, in
  the folder ``--data_path`` names (else ``<data_dir>/raw/<name>/``): MNIST's and Fashion-MNIST's
  IDX files (:mod:`.idx`), CIFAR's python archives (:mod:`.cifar_files`), in the files' order.
  ``--download`` (and only that) first fetches those files from the addresses in
  :data:`PUBLISHED` into ``<data_dir>/raw/<name>/``; no TensorFlow is needed.
- ``tfds:NAME``: any image-classification dataset of tensorflow-datasets (:mod:`.tfds_images`).

Either is prepared once into the cache of prepared datasets (:mod:`.prepared`: array_record files
under ``<data_dir>/deltafl_<key>/centralised/``, checksummed, installed with one rename), in
records of :data:`CHUNK` examples, ``train/00000``, ``train/00001``, ... then ``test/...``; the
next load reads that copy and parses nothing. The copy is keyed by its source: the folder (or
archive, or tfds copy) it was prepared from, and what the files read there held, their size,
modification time and sha256 (``source_files`` of its metadata, :func:`deltafl_jax.datasets.cache
.file_facts`). A load checks the files it would read (``--data_path``'s, else those the copy was
prepared from) against them and prepares the copy again, saying so in one line, when
``--data_path`` names another source or a file changed (:func:`deltafl_jax.datasets.cache
.source_change`: every file is hashed; a new modification time over the same bytes is no change).
A source that is no longer there leaves the copy in use. A copy prepared before sources were
recorded is checked against its source by parsing it once per load (kept when the arrays are
equal); ``python -m data_prep.prepare`` prepares it again with the record.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from deltafl_jax.datasets import archives, cache, cifar_files, idx, prepared, tfds_images
from deltafl_jax.datasets.home import default_data_dir
from deltafl_jax.errors import DamagedDataset, DataError

CONFIG = "centralised"
CHUNK = 4096
SPLITS = ("train", "test")
Arrays = Dict[str, Tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Published:
    """How the authors publish one dataset: its reader ("idx" or "cifar"), classes and files."""

    reader: str
    num_classes: int
    urls: Tuple[str, ...]
    page: str


_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
_KRIZ = "https://www.cs.toronto.edu/~kriz/"
_FASHION = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_MNIST = "https://storage.googleapis.com/cvdf-datasets/mnist/"  # the mirror tfds uses
PUBLISHED: Dict[str, Published] = {
    "mnist": Published("idx", 10, tuple(_MNIST + f for f in _MNIST_FILES),
                       "http://yann.lecun.com/exdb/mnist/"),
    "fashion_mnist": Published("idx", 10, tuple(_FASHION + f for f in _MNIST_FILES),
                               "https://github.com/zalandoresearch/fashion-mnist"),
    "cifar10": Published("cifar", 10, (_KRIZ + "cifar-10-python.tar.gz",),
                         _KRIZ + "cifar.html"),
    "cifar100": Published("cifar", 100, (_KRIZ + "cifar-100-python.tar.gz",),
                          _KRIZ + "cifar.html"),
}
CIFAR_LAYOUT = {  # archive, its folder, {split: batches}, label key
    "cifar10": ("cifar-10-python.tar.gz", "cifar-10-batches-py",
                {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
                "labels"),
    "cifar100": ("cifar-100-python.tar.gz", "cifar-100-python",
                 {"train": ["train"], "test": ["test"]}, "fine_labels"),
}


@dataclasses.dataclass(frozen=True)
class Centralised:
    """One centralised dataset (module docstring); `metadata` holds its source and shapes."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    metadata: Mapping


def is_centralised(name: str) -> bool:
    return name in PUBLISHED or name.startswith(tfds_images.PREFIX)


def storage_key(name: str) -> str:
    """The cache's dataset name of `name`: lower-case letters, digits and underscores."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def raw_dir(data_dir: str, name: str) -> str:
    return os.path.join(data_dir, "raw", name)


def _check(name: str) -> None:
    if name.startswith(tfds_images.PREFIX):
        tfds_images.tfds_name(name)
    elif name not in PUBLISHED:
        raise DataError(f"{name!r} is not a centralised image dataset (choose "
                        f"{', '.join(sorted(PUBLISHED))} or tfds:NAME)")


# ----------------------------------------------------------------------------- the files


def missing_files_message(name: str, data_dir: str) -> str:
    spec = PUBLISHED[name]
    files = ", ".join(os.path.basename(u) for u in spec.urls)
    return (f"{name}: no prepared data and no source: pass --data_path=DIR holding {files} "
            f"(from {spec.page}) or put them in {raw_dir(data_dir, name)}/, or run python -m "
            f"data_prep.prepare --dataset={name} --download")


def download_files(name: str, data_dir: str, timeout: float = 60.0) -> str:
    """Fetch the published files of `name` into <data_dir>/raw/<name>/ (each once); returns
    that folder. On failure the folders it made are removed again (files fetched before the
    failure stay, so a second try resumes)."""
    out_dir = raw_dir(data_dir, name)
    made = [d for d in (data_dir, os.path.dirname(out_dir), out_dir) if not os.path.exists(d)]
    try:
        for url in PUBLISHED[name].urls:
            archives.fetch(url, out_dir, name, f"--data_path=FOLDER_WITH_{os.path.basename(url)}",
                           timeout)
    except DataError:
        for folder in reversed(made):
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
        raise
    return out_dir


def read_files(name: str, source: str) -> Arrays:
    """{split: (images, labels)} of the published files of `name` at `source`."""
    spec = PUBLISHED[name]
    if not os.path.exists(source):
        raise DataError(f"{name}: --data_path={source} does not exist")
    if spec.reader == "idx":
        if not os.path.isdir(source):
            raise DataError(f"{name}: --data_path must be the folder holding the IDX files, not "
                            f"the file {source}")
        return {split: idx.read_split(source, prefix, spec.num_classes)
                for split, prefix in idx.SPLITS}
    archive, sub, batches, label_key = CIFAR_LAYOUT[name]
    return cifar_files.read_cifar(source, archive, sub, batches, label_key, spec.num_classes)


def source_files(name: str, source: str) -> List[str]:
    """The files a preparation of `name` (a published dataset) reads from `source`: MNIST's and
    Fashion-MNIST's four IDX files (:func:`deltafl_jax.datasets.idx.find_file`), CIFAR's archive
    (`source` itself, or in the folder) or its extracted batches (:mod:`.cifar_files`)."""
    spec = PUBLISHED[name]
    if spec.reader == "idx":
        return [idx.find_file(source, f"{prefix}-{kind}")
                for _, prefix in idx.SPLITS for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")]
    archive, sub, batches, _ = CIFAR_LAYOUT[name]
    if os.path.isfile(source):
        return [source]
    if os.path.isfile(os.path.join(source, archive)):
        return [os.path.join(source, archive)]
    wanted = [b for split in SPLITS for b in batches[split]]
    for where in (os.path.join(source, sub), source):
        if all(os.path.isfile(os.path.join(where, w)) for w in wanted):
            return [os.path.join(where, w) for w in wanted]
    raise DataError(f"{source}: no {sub} batches ({', '.join(wanted)})")


def _file_source(name: str, data_path: Optional[str], data_dir: str, download: bool) -> str:
    if data_path:
        return os.path.abspath(data_path)
    if download:
        return download_files(name, data_dir)
    if os.path.isdir(raw_dir(data_dir, name)):
        return raw_dir(data_dir, name)
    raise DataError(missing_files_message(name, data_dir))


def read_source(name: str, data_path: Optional[str], data_dir: str,
                download: bool = False) -> Tuple[Arrays, dict]:
    """(arrays, metadata) of `name` from its source (module docstring), parsed now."""
    _check(name)
    if name.startswith(tfds_images.PREFIX):
        return tfds_images.read(tfds_images.tfds_name(name), data_path, data_dir, download)
    source = _file_source(name, data_path, data_dir, download)
    arrays = read_files(name, source)
    metadata = {"num_classes": PUBLISHED[name].num_classes, "source": source,
                "image_shape": list(arrays["train"][0].shape[1:]),
                "source_files": cache.file_facts(source_files(name, source))}
    return arrays, metadata


# ----------------------------------------------------------------------------- the cache


def write_cache(name: str, data_dir: str, arrays: Arrays, metadata: Mapping) -> str:
    """Write `arrays` as the prepared dataset of `name` (records of CHUNK examples)."""
    shapes = {arrays[s][0].shape[1:] for s in SPLITS}
    if len(shapes) != 1:
        raise DataError(f"{name}: train images are {arrays['train'][0].shape[1:]} but test images "
                        f"{arrays['test'][0].shape[1:]}")
    records, counts = [], {}
    for split in SPLITS:
        x, y = arrays[split]
        if len(x) == 0:
            raise DataError(f"{name}: the {split} split has no example")
        starts = range(0, len(x), CHUNK)
        counts[split] = len(starts)
        records += [{"client_id": f"{split}/{i:05d}", "x": x[s:s + CHUNK], "y": y[s:s + CHUNK]}
                    for i, s in enumerate(starts)]
    meta = dict(metadata, dataset=name, split_records=counts,
                split_sizes={s: int(len(arrays[s][1])) for s in SPLITS})
    spec = {"x": ((None,) + tuple(shapes.pop()), np.uint8), "y": ((None,), np.int32)}
    what = (f"{meta['split_sizes']['train']} train and {meta['split_sizes']['test']} test "
            f"images, centralised: --partition splits them into clients")
    return prepared.write(data_dir, storage_key(name), CONFIG, spec, records, meta,
                          description=f"{name}: centralised images, {CHUNK} per record.",
                          what=what)


def open_cached(name: str, data_dir: str, source: Optional[str]) -> Optional[Centralised]:
    """The cached `name` (None when absent, damaged, of another dataset or, when `source` is
    given, prepared from another source)."""
    key = storage_key(name)
    if not prepared.is_prepared(data_dir, key, CONFIG):
        return None
    try:
        info = prepared.open_prepared(data_dir, key, CONFIG)
    except DamagedDataset as err:
        print(f"deltafl_jax: warning: the prepared {name} at {err.path} is damaged "
              f"({err.reason}); rebuilding it", file=sys.stderr, flush=True)
        return None
    meta = info.metadata
    if meta.get("dataset") != name or (source is not None and meta.get("source") != source):
        return None
    records = prepared.read(info, key)
    out = {}
    for split in SPLITS:
        part = [r for r in records if r["client_id"].startswith(split + "/")]
        out[split] = (np.concatenate([r["x"] for r in part]),
                      np.concatenate([r["y"] for r in part]).astype(np.int32))
    return Centralised(name=name, train_x=out["train"][0], train_y=out["train"][1],
                       test_x=out["test"][0], test_y=out["test"][1],
                       num_classes=int(meta["num_classes"]),
                       metadata=dict(meta, prepared=info.path))


def _given_source(name: str, data_path: Optional[str]) -> Optional[str]:
    return os.path.abspath(data_path) if data_path else None


def prepare_into(name: str, data_path: Optional[str], data_dir: str,
                 download: bool = False) -> str:
    """Parse `name`'s source and write it into the cache under `data_dir`; its directory."""
    arrays, metadata = read_source(name, data_path, data_dir, download)
    return write_cache(name, data_dir, arrays, metadata)


def _legacy_change(c: Centralised, source: Optional[str], data_dir: str) -> Optional[str]:
    """For a copy prepared before sources were recorded: parse `source` again and compare its
    arrays with the copy's (None when equal, or when the source cannot be read)."""
    if not source or not os.path.exists(source):
        return None
    try:
        arrays, _ = read_source(c.name, source, data_dir)
    except DataError:
        return None
    same = all(np.array_equal(a, b) for a, b in (
        (arrays["train"][0], c.train_x), (arrays["train"][1], c.train_y),
        (arrays["test"][0], c.test_x), (arrays["test"][1], c.test_y)))
    return None if same else f"{source} holds other images or labels"


def stale(c: Centralised, given: Optional[str], data_dir: str) -> Optional[str]:
    """Why the cached copy `c` no longer holds what its source does (a few words), None when
    it does or when its source is not there to check (module docstring). The source is `given`
    (``--data_path``, absolute), else the one `c` was prepared from."""
    meta = c.metadata
    source = given or meta.get("source")
    recorded = meta.get("source_files")
    if recorded is None:
        return _legacy_change(c, source, data_dir)
    if c.name in PUBLISHED:
        try:
            files = source_files(c.name, source)
        except DataError:   # the source is gone (or incomplete): the copy stays in use
            return None
    else:
        files = list(recorded)
        if not all(os.path.isfile(f) for f in files):
            return None
    return cache.source_change(recorded, files)


def load_centralised(name: str, data_path: Optional[str] = None,
                     cache_dir: Optional[str] = None, download: bool = False) -> Centralised:
    """`name` as centralised arrays: from the cache under `cache_dir` (default: $DELTAFL_DATA,
    else ~/.cache/deltafl_jax) when it is there and its source still holds what it was
    prepared from (:func:`stale`), else parsed from its source and cached first (one line on
    stderr says why when the source changed). `download` lets a missing source be fetched (the
    only network access)."""
    _check(name)
    data_dir = cache_dir or default_data_dir()
    given = _given_source(name, data_path)
    cached = open_cached(name, data_dir, given)
    if cached is not None:
        why = stale(cached, given, data_dir)
        if why is None:
            return cached
        if name in PUBLISHED:
            data_path = data_path or cached.metadata.get("source")
        print(f"deltafl_jax: the source of the prepared {name} changed since it was prepared "
              f"({why}); preparing it again", file=sys.stderr, flush=True)
    prepare_into(name, data_path, data_dir, download)
    cached = open_cached(name, data_dir, None)
    if cached is None:
        raise DataError(f"{name}: the prepared copy under {data_dir} cannot be read back")
    return cached


def prepare(config, download: bool = False) -> str:
    """``python -m data_prep.prepare --dataset=NAME``: parse the source again and cache it."""
    _check(config.dataset)
    return prepare_into(config.dataset, config.data_path, config.resolved_data_dir, download)
