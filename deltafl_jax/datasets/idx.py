"""MNIST and Fashion-MNIST from the IDX files their authors publish, parsed by hand.

The IDX format (LeCun, Cortes and Burges, "THE MNIST DATABASE of handwritten digits", the page
that publishes the files; Fashion-MNIST keeps the same format and file names):

- a 4-byte magic number: two zero bytes, a type code (``0x08`` unsigned byte, ``0x09`` signed
  byte, ``0x0B`` short, ``0x0C`` int, ``0x0D`` float, ``0x0E`` double) and the number of
  dimensions;
- one big-endian unsigned 32-bit size per dimension;
- the values, big-endian, in row-major order (the last dimension changes fastest).

Images are ``0x00000803`` (2051: unsigned bytes, 3 dimensions: count, rows, columns) and labels
``0x00000801`` (2049: unsigned bytes, 1 dimension). A folder holds four files,
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte``, each gzip-compressed (``.gz``, as published) or not; gzip is told
from the file's first two bytes, not from its name.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from typing import Optional, Tuple

import numpy as np

from deltafl_jax.errors import DataError

_TYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
          0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_GZIP_MAGIC = b"\x1f\x8b"
SPLITS = (("train", "train"), ("test", "t10k"))


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:
        raise DataError(f"{path} is not a complete gzip file ({err}); download it again") from None


def parse_idx(raw: bytes, path: str = "<bytes>") -> np.ndarray:
    """The array held by the IDX bytes `raw` (native byte order); DataError naming `path` when
    the magic number, the sizes or the length of the data are wrong."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _TYPES:
        magic = raw[:4].hex() or "nothing"
        raise DataError(f"{path} is not an IDX file (magic number 0x{magic}; expected "
                        f"0x0000 then a type code and the number of dimensions)")
    dtype, ndim = _TYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: IDX header truncated ({len(raw)} bytes, needs {header})")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != want:
        raise DataError(f"{path}: IDX data of shape {shape} needs {want} bytes after the header, "
                        f"the file has {len(raw) - header}")
    values = np.frombuffer(raw, dtype=dtype, count=want // dtype.itemsize, offset=header)
    return values.reshape(shape).astype(dtype.newbyteorder("="))


def read_idx(path: str, magic: Optional[int] = None) -> np.ndarray:
    """The array of the IDX file `path` (gzip-compressed or not); when `magic` is given, the
    file's magic number must be it (2051 for images, 2049 for labels)."""
    raw = _read_bytes(path)
    if magic is not None and raw[:4] != struct.pack(">I", magic):
        raise DataError(f"{path} is not an IDX file of MNIST's format (magic number "
                        f"0x{raw[:4].hex() or 'nothing'}, expected 0x{magic:08x})")
    return parse_idx(raw, path)


def find_file(folder: str, stem: str) -> str:
    """`folder`/`stem`.gz or `folder`/`stem`; DataError naming both when neither exists."""
    for name in (stem + ".gz", stem):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise DataError(f"{folder} lacks {stem}.gz (or {stem}): the IDX files of MNIST / "
                    f"Fashion-MNIST as published")


def read_split(folder: str, prefix: str, num_classes: int) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, rows, cols, 1], labels int32 [n]) of the IDX pair `prefix`-images /
    `prefix`-labels in `folder` (prefix "train" or "t10k")."""
    images_path = find_file(folder, f"{prefix}-images-idx3-ubyte")
    labels_path = find_file(folder, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(images_path, 2051), read_idx(labels_path, 2049)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(f"{images_path}: expected unsigned-byte images of 3 dimensions, got "
                        f"{images.dtype} of shape {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataError(f"{labels_path}: expected unsigned-byte labels of 1 dimension, got "
                        f"{labels.dtype} of shape {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{folder}: {len(images)} {prefix} images but {len(labels)} labels")
    if labels.size and int(labels.max()) >= num_classes:
        raise DataError(f"{labels_path}: label {int(labels.max())} is not below {num_classes}")
    return images[..., None], labels.astype(np.int32)
