"""FEMNIST: handwritten characters grouped by writer, from LEAF json or TensorFlow Federated files.

The paper's first task (delta-fl-long.md, Sec. 5 (a), App. C.1.1, Table 1) with the rules of
reference-notes.md ("Data preparation"):

- one client per writer; writers with >= ``min_client_examples`` images (default 100) are kept;
- a seeded subsample of ``writer_fraction`` of those writers (default 50%: the paper keeps 1730
  of them; 1.0 keeps every writer of one's own LEAF subset), drawn with ``data_seed`` when
  loading, then a 50/50 split by writer (865/865) with ``data_seed``. The authors redraw both
  for each of their 5 seeds ("a different sampling of train and test devices", CISS Sec. V):
  ``--resample_writers_per_seed`` does the same (:mod:`deltafl_jax.replicas.seed_programs`);
- x: the 28x28 image as 784 pixels in LEAF's convention (background = 1.0, ink near 0.0), stored
  as uint8 round(255 * pixel) with ``x_scale = 1/255``, so the engine sees pixel/255 in [0, 1];
- y: 0-61; 0-9 are the digits, 10-35 the upper-case letters, 36-61 the lower-case letters.

Three source formats are read, and the same writers give identical client arrays in each:

1. LEAF json (a file or a directory, see :func:`deltafl_jax.datasets.leaf.json_files`):
   ``user_data[writer] = {"x": [[784 floats], ...], "y": [int, ...]}``.
2. TFF h5 (older TensorFlow Federated, ``fed_emnist_train.h5`` and ``fed_emnist_test.h5``):
   ``/examples/<writer>/pixels`` float32 [n, 28, 28] (1.0 = background) and
   ``/examples/<writer>/label`` int32 [n]. A writer's train examples come before its test ones.
3. TFF SQLite (newer TensorFlow Federated, ``emnist_all.sqlite``): a table
   ``examples(split_name, client_id, serialized_example_proto)`` whose rows of the splits
   ``all_train`` then ``all_test`` (in rowid order) are serialized ``tf.train.Example`` protos
   with ``pixels`` (float list of 784) and ``label`` (int64 list of 1). The protos are parsed
   here from the protobuf wire format (:func:`parse_example`), so TensorFlow is not needed.

TFF's images are LEAF's, reshaped to 28x28 in row-major order; flattening them back gives LEAF's
784-vector. TFF splits each writer's images into train and test; here they are joined again,
because the papers split by writer, not by image.

Download. ``python -m data_prep.prepare --dataset=femnist --download`` (and only that) fetches
TensorFlow Federated's public file

    https://storage.googleapis.com/tff-datasets-public/emnist_all.sqlite.lzma

(about 170 MB; 4.7 GB once decompressed): the SQLite database above, holding the 3,400 writers
of LEAF's FEMNIST that have at least 2 images (671,585 train and 77,483 test images), splits
``all_*`` (62 classes) and ``digits_only_*``. It is saved under ``<data_dir>/raw/femnist/`` and
decompressed there. LEAF's own json is built by LEAF's ``preprocess.sh`` from the NIST Special
Database 19; it cannot be downloaded ready-made.
"""

from __future__ import annotations

import glob
import os
import sqlite3
import struct
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.data import DataError, FederatedDataset, split_clients
from deltafl_jax.datasets import archives, leaf, prepared

NAME = "femnist"
NUM_CLASSES = 62
NUM_PIXELS = 784
DEFAULT_MIN_CLIENT_EXAMPLES = 100
WRITER_FRACTION = 0.5
TFF_URL = "https://storage.googleapis.com/tff-datasets-public/emnist_all.sqlite.lzma"
TFF_SPLITS = ("all_train", "all_test")
RAW_SUBDIR = os.path.join("raw", "femnist")

Clients = Dict[str, Tuple[np.ndarray, np.ndarray]]


# ----------------------------------------------------------------------------- pixels


def pixels_to_uint8(pixels) -> np.ndarray:
    """[n, 784] uint8 round(255 * p) of float pixels in [0, 1] ([n, 28, 28] or [n, 784])."""
    p = np.asarray(pixels, dtype=np.float32)
    p = p.reshape(p.shape[0], -1) if p.ndim > 1 else p.reshape(1, -1)
    if p.shape[1] != NUM_PIXELS:
        raise DataError(f"femnist: images must have {NUM_PIXELS} pixels, got {p.shape[1]}")
    if p.size and (not np.all(np.isfinite(p)) or p.min() < -1e-3 or p.max() > 1 + 1e-3):
        raise DataError("femnist: pixels must lie in [0, 1] (1.0 = background)")
    return np.clip(np.rint(p * 255.0), 0, 255).astype(np.uint8)


def _labels(y) -> np.ndarray:
    y = np.asarray(y).reshape(-1)
    if y.size and (y.min() < 0 or y.max() >= NUM_CLASSES):
        raise DataError(f"femnist: labels must lie in [0, {NUM_CLASSES}), got {y.min()}..{y.max()}")
    return y.astype(np.int32)


class _Writers:
    """Collects each writer's chunks of examples, in the order they are read."""

    def __init__(self):
        self.chunks: Dict[str, List[Tuple[np.ndarray, np.ndarray]]] = {}

    def add(self, writer: str, x: np.ndarray, y: np.ndarray):
        if len(x) != len(y):
            raise DataError(f"femnist: writer {writer} has {len(x)} images and {len(y)} labels")
        if len(x):
            self.chunks.setdefault(str(writer), []).append((x, y))

    def result(self) -> Clients:
        return {w: (np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]))
                for w, chunks in sorted(self.chunks.items())}


# ----------------------------------------------------------------------------- tf.train.Example


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise DataError("truncated protobuf varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DataError("protobuf varint longer than 10 bytes")


def _fields(buf: bytes) -> Iterator[Tuple[int, int, object]]:
    """(field number, wire type, value) of each field of one protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:  # varint
            value, pos = _varint(buf, pos)
        elif wire == 1:  # 64-bit
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:  # length-delimited
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:  # 32-bit
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise DataError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise DataError("truncated protobuf message")
        yield field, wire, value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _parse_feature(buf: bytes):
    """A tf.train.Feature: bytes_list (1), float_list (2) or int64_list (3) of field 1 values."""
    for kind, _, payload in _fields(buf):
        if kind == 1:
            return [bytes(v) for f, _, v in _fields(payload) if f == 1]
        chunks = []
        for field, wire, value in _fields(payload):
            if field != 1:
                continue
            if kind == 2 and wire == 2:  # packed floats
                chunks.append(np.frombuffer(value, dtype="<f4"))
            elif kind == 2 and wire == 5:
                chunks.append(np.array(struct.unpack("<f", value), dtype="<f4"))
            elif kind == 3 and wire == 2:  # packed varints
                values, pos = [], 0
                while pos < len(value):
                    v, pos = _varint(value, pos)
                    values.append(_signed64(v))
                chunks.append(np.array(values, dtype=np.int64))
            elif kind == 3 and wire == 0:
                chunks.append(np.array([_signed64(value)], dtype=np.int64))
        if kind == 2:
            return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
        if kind == 3:
            return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    return np.zeros((0,), np.float32)


def parse_example(buf: bytes) -> Dict[str, object]:
    """Parse a serialized tf.train.Example into {feature name: values}.

    The wire format (tensorflow/core/example/{example,feature}.proto): Example.features (field 1)
    is a Features message whose map<string, Feature> feature (field 1) is a list of entries
    {key (1): string, value (2): Feature}. float and int64 lists are packed or not.
    Floats come back as float32 arrays, int64 as int64 arrays, bytes as lists of bytes.
    """
    out: Dict[str, object] = {}
    for field, wire, features in _fields(bytes(buf)):
        if field != 1 or wire != 2:
            continue
        for entry_field, entry_wire, entry in _fields(features):
            if entry_field != 1 or entry_wire != 2:
                continue
            key, feature = "", b""
            for f, _, v in _fields(entry):
                if f == 1:
                    key = bytes(v).decode("utf-8")
                elif f == 2:
                    feature = v
            out[key] = _parse_feature(feature)
    return out


# ----------------------------------------------------------------------------- readers


def read_leaf(files: Sequence[str]) -> Clients:
    writers = _Writers()
    for writer, x, y in leaf.read_users(files):
        if len(x):
            writers.add(writer, pixels_to_uint8(np.asarray(x, dtype=np.float32)), _labels(y))
    return writers.result()


def read_tff_h5(files: Sequence[str]) -> Clients:
    import h5py  # pylint: disable=g-import-not-at-top

    writers = _Writers()
    for file in files:
        with h5py.File(file, "r") as f:
            if "examples" not in f:
                raise DataError(f"{file} is not a TFF EMNIST h5 file (no /examples group)")
            group = f["examples"]
            for writer in sorted(group):
                writers.add(writer, pixels_to_uint8(group[writer]["pixels"][()]),
                            _labels(group[writer]["label"][()]))
    return writers.result()


def read_tff_sqlite(file: str) -> Clients:
    writers: Dict[str, Tuple[List[np.ndarray], List[int]]] = {}
    connection = sqlite3.connect(f"file:{os.path.abspath(file)}?mode=ro", uri=True)
    try:
        for split in TFF_SPLITS:
            rows = connection.execute(
                "SELECT client_id, serialized_example_proto FROM examples "
                "WHERE split_name = ? ORDER BY rowid", (split,))
            for writer, blob in rows:
                example = parse_example(blob)
                if "pixels" not in example or "label" not in example:
                    raise DataError(f"{file}: a row of {writer} lacks 'pixels' or 'label'")
                images, labels = writers.setdefault(str(writer), ([], []))
                images.append(pixels_to_uint8(example["pixels"][None])[0])  # 4x less memory
                labels.append(int(np.asarray(example["label"]).reshape(-1)[0]))
    except sqlite3.DatabaseError as err:
        raise DataError(f"{file} is not a TFF SQLite database ({err})") from None
    finally:
        connection.close()
    if not writers:
        raise DataError(f"{file}: no rows in splits {', '.join(TFF_SPLITS)}")
    out = _Writers()
    for writer, (images, labels) in writers.items():
        out.add(writer, np.stack(images), _labels(labels))
    return out.result()


def _h5_order(files: Sequence[str]) -> List[str]:
    full = [f for f in files if "digitsonly" not in os.path.basename(f)] or list(files)
    rank = lambda f: (0 if "train" in os.path.basename(f) else 1, os.path.basename(f))
    return sorted(full, key=rank)


def detect_source(path: str) -> Tuple[str, List[str]]:
    """(format, files) of a FEMNIST source: "sqlite", "lzma", "h5" or "leaf"."""
    if os.path.isdir(path):
        found = lambda *pats: sorted(f for p in pats for f in glob.glob(
            os.path.join(path, "**", p), recursive=True))
        if found("*.sqlite", "*.db"):
            return "sqlite", found("*.sqlite", "*.db")[:1]
        if found("*.h5", "*.hdf5"):
            return "h5", _h5_order(found("*.h5", "*.hdf5"))
        if found("*.sqlite.lzma"):
            return "lzma", found("*.sqlite.lzma")[:1]
        files = leaf.json_files(path)
        if files:
            return "leaf", files
        raise DataError(f"femnist: no emnist_all.sqlite, fed_emnist_*.h5 or LEAF json in {path}")
    if not os.path.exists(path):
        raise DataError(f"femnist: --data_path={path} does not exist")
    lower = path.lower()
    if lower.endswith(".lzma"):
        return "lzma", [path]
    if lower.endswith((".h5", ".hdf5")):
        return "h5", [path]
    if lower.endswith(".json"):
        return "leaf", [path]
    with open(path, "rb") as f:
        if f.read(16) == b"SQLite format 3\x00":
            return "sqlite", [path]
    raise DataError(f"femnist: cannot tell the format of {path} (expected .sqlite, .h5 or .json)")


def decompress(file: str, out_dir: str) -> str:
    """Decompress a .sqlite.lzma into out_dir (once); returns the .sqlite path."""
    return archives.decompress_lzma(file, out_dir, "femnist")


def read_source(path: str, data_dir: str) -> Clients:
    """{writer: (x uint8 [n, 784], y int32 [n])} of any supported source, writers sorted."""
    fmt, files = detect_source(path)
    if fmt == "lzma":
        fmt, files = "sqlite", [decompress(files[0], os.path.join(data_dir, RAW_SUBDIR))]
    if fmt == "sqlite":
        return read_tff_sqlite(files[0])
    if fmt == "h5":
        return read_tff_h5(files)
    return read_leaf(files)


# ----------------------------------------------------------------------------- download


def download(data_dir: str, url: str = TFF_URL, timeout: float = 60.0) -> str:
    """Fetch TFF's emnist_all.sqlite.lzma into <data_dir>/raw/femnist and decompress it."""
    out_dir = os.path.join(data_dir, RAW_SUBDIR)
    file = archives.fetch(url, out_dir, "femnist",
                          f"--source=/path/to/{os.path.basename(url)}", timeout)
    return decompress(file, out_dir)


# ----------------------------------------------------------------------------- prepare / load


def missing_source_message(data_dir: str) -> str:
    raw = os.path.join(data_dir, RAW_SUBDIR)
    return (f"femnist: no prepared data and no source: pass --data_path=/path/to/emnist_all.sqlite "
            f"(TFF SQLite; fed_emnist_train.h5 or a LEAF json directory also work) or put it in "
            f"{raw}/, or run python -m data_prep.prepare --dataset=femnist --download")


def default_source(data_dir: str) -> Optional[str]:
    """<data_dir>/raw/femnist when it holds a readable source, else None."""
    raw = os.path.join(data_dir, RAW_SUBDIR)
    if not os.path.isdir(raw):
        return None
    try:
        detect_source(raw)
    except DataError:
        return None
    return raw


def prepare(config, min_client_examples: Optional[int] = None,
            source: Optional[str] = None) -> str:
    """Read the source, keep writers with enough images and write the prepared dataset."""
    k = prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES) if min_client_examples is None else int(min_client_examples)
    data_dir = config.resolved_data_dir
    source = source or config.data_path or default_source(data_dir)
    if source is None:
        raise DataError(missing_source_message(data_dir))
    source = os.path.abspath(source)
    writers = read_source(source, data_dir)
    clients = [{"client_id": w, "x": x, "y": y} for w, (x, y) in writers.items() if len(y) >= k]
    if not clients:
        raise DataError(f"femnist: no writer in {source} has >= {k} images")
    metadata = {
        "source": source,
        "min_client_examples": k,
        "pixel_convention": "uint8 round(255 * p), LEAF's p in [0, 1] with background 1.0",
        "label_map": "0-9 digits, 10-35 upper case, 36-61 lower case",
    }
    return prepared.write(
        data_dir, NAME, prepared.config_name(k),
        spec={"x": ((None, NUM_PIXELS), np.uint8), "y": ((None,), np.int32)},
        clients=clients, metadata=metadata,
        description="FEMNIST by writer (LEAF / TFF), one record per writer.")


def subsample_writers(num_writers: int, seed: int, fraction: float = WRITER_FRACTION) -> np.ndarray:
    """Sorted positions of a seeded `fraction` of the writers (at least 2 are kept)."""
    n_keep = min(num_writers, max(2, int(round(fraction * num_writers))))
    rng = np.random.default_rng([seed, 1])
    return np.sort(rng.permutation(num_writers)[:n_keep])


def load(config) -> FederatedDataset:
    """Load (preparing on first use when a source is at hand), subsample and split the writers."""
    k = prepared.min_client_examples(config, DEFAULT_MIN_CLIENT_EXAMPLES)
    data_dir = config.resolved_data_dir
    source = os.path.abspath(config.data_path) if config.data_path else None
    info = prepared.open_or_prepare(data_dir, NAME, k, lambda: prepare(config, k), source)
    eligible = np.flatnonzero(info.sizes >= k)
    if eligible.size < 2:
        raise DataError(f"femnist: only {eligible.size} writer(s) have >= {k} images")
    fraction = float(config.writer_fraction)
    if not 0.0 < fraction <= 1.0:
        raise DataError(f"--writer_fraction must lie in (0, 1], got {fraction}")
    chosen = eligible[subsample_writers(eligible.size, config.data_seed, fraction)]
    data = prepared.to_client_data(prepared.read(info, NAME, chosen))
    train, test = split_clients(data, config.data_seed)
    return FederatedDataset(
        name=NAME, train=train, test=test, num_classes=NUM_CLASSES, x_scale=1.0 / 255.0,
        metadata={"source": info.metadata.get("source"), "prepared": info.path,
                  "min_client_examples": k, "writer_fraction": fraction,
                  "eligible_writers": int(eligible.size)})
