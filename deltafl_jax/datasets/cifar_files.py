"""CIFAR-10 and CIFAR-100 from the python archives their authors publish.

Krizhevsky's page ("The CIFAR-10 dataset", www.cs.toronto.edu/~kriz/cifar.html) publishes
``cifar-10-python.tar.gz`` (folder ``cifar-10-batches-py/``: ``data_batch_1`` ... ``data_batch_5``
then ``test_batch``) and ``cifar-100-python.tar.gz`` (folder ``cifar-100-python/``: ``train``
and ``test``). Each member is a Python 2 pickle of a dict whose ``data`` is a uint8 numpy array
[n, 3072], each row one 32x32 image stored channel by channel (1024 red values, then green, then
blue, each row-major), and whose labels are a list of ints: ``labels`` (CIFAR-10, 0-9) or
``fine_labels`` (CIFAR-100, 0-99; ``coarse_labels`` are the 20 superclasses, not used here).
Images come back as [n, 32, 32, 3] (NHWC), train and test in the files' order.

Why a restricted unpickler. Unpickling calls whatever importable function the pickle names, so a
tampered or mislabelled archive could run arbitrary code (``os.system``) the moment it is read.
:class:`RestrictedUnpickler` resolves only the few globals that a pickled numpy array needs
(``numpy.core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype``; for batches pickled
again by Python 3, ``numpy.core.numeric._frombuffer`` and ``_codecs.encode``, with which it
pickles bytes; numpy 2's ``numpy._core`` spellings too) and refuses any other with a
:class:`~deltafl_jax.errors.DataError`; dicts, lists, strings and numbers need no global at all.

The source (``--data_path``) is the archive itself, a folder holding it, or a folder holding the
extracted batches (their folder or the batch files directly).
"""

from __future__ import annotations

import codecs
import importlib
import io
import os
import pickle
import tarfile
import zlib
from typing import Callable, Dict, List, Tuple

import numpy as np

from deltafl_jax.errors import DataError


def _numpy_function(module: str, name: str):
    """numpy's array reconstructor `name` of `module` (numpy._core.* since numpy 2, numpy.core.*
    before); a loader, called only when a pickle names it."""
    def load():
        for prefix in ("numpy._core.", "numpy.core."):
            try:
                return getattr(importlib.import_module(prefix + module), name)
            except (ImportError, AttributeError):
                continue
        raise DataError(f"this numpy has no {module}.{name} to read the pickle with")
    return load


_ALLOWED = {
    (f"numpy.{core}.{module}", name): _numpy_function(module, name)
    for core in ("core", "_core")
    for module, name in (("multiarray", "_reconstruct"), ("numeric", "_frombuffer"))}
_ALLOWED.update({
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: codecs.encode,
})


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays and plain containers only (module docstring)."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]()
        raise DataError(f"refusing to unpickle {module}.{name}: a CIFAR batch holds only numpy "
                        f"arrays and lists")


def load_pickle(raw: bytes, where: str) -> dict:
    """The dict of one CIFAR batch (keys as str), read with :class:`RestrictedUnpickler`."""
    try:
        obj = RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except DataError as err:
        raise DataError(f"{where}: {err}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            AttributeError) as err:
        raise DataError(f"{where} is not a CIFAR python batch ({err})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where} is not a CIFAR python batch (a {type(obj).__name__}, not a "
                        f"dict)")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def batch_arrays(batch: dict, label_key: str, num_classes: int,
                 where: str) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 32, 32, 3], labels int32 [n]) of one unpickled CIFAR batch."""
    data, labels = batch.get("data"), batch.get(label_key)
    if not isinstance(data, np.ndarray) or labels is None:
        raise DataError(f"{where} lacks 'data' (a numpy array) or {label_key!r}")
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{where}: 'data' must be uint8 [n, 3072], got {data.dtype} "
                        f"{data.shape}")
    labels = np.asarray(labels)
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{where}: {label_key!r} must hold {len(data)} integer labels, got "
                        f"{labels.dtype} {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{where}: labels must lie in [0, {num_classes}), got "
                        f"{labels.min()}..{labels.max()}")
    images = data.reshape(len(data), 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels.astype(np.int32)


def _from_archive(archive: str, wanted: List[str]) -> Dict[str, bytes]:
    """{member base name: bytes} of the members of the .tar.gz `archive` named in `wanted`."""
    found: Dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                base = os.path.basename(member.name)
                if member.isfile() and base in wanted and base not in found:
                    found[base] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        raise DataError(f"{archive} is not a complete tar archive ({err}); download it "
                        f"again") from None
    missing = [w for w in wanted if w not in found]
    if missing:
        raise DataError(f"{archive} lacks {', '.join(missing)}")
    return found


def _from_folder(folder: str, wanted: List[str], sub: str) -> Dict[str, bytes]:
    for where in (os.path.join(folder, sub), folder):
        if all(os.path.isfile(os.path.join(where, w)) for w in wanted):
            out = {}
            for w in wanted:
                with open(os.path.join(where, w), "rb") as f:
                    out[w] = f.read()
            return out
    raise DataError(f"{folder}: no {sub} batches ({', '.join(wanted)})")


def member_reader(source: str, archive: str, sub: str) -> Callable[[List[str]], Dict[str, bytes]]:
    """A function giving the raw bytes of the named batches from `source`: the archive (the
    file, or `archive` inside the folder `source`), else the extracted batches (in
    `source`/`sub`/ or `source`/)."""
    if os.path.isfile(source):
        return lambda wanted: _from_archive(source, wanted)
    if os.path.isfile(os.path.join(source, archive)):
        return lambda wanted: _from_archive(os.path.join(source, archive), wanted)
    if not os.path.isdir(source):
        raise DataError(f"--data_path={source} does not exist")
    return lambda wanted: _from_folder(source, wanted, sub)


def read_cifar(source: str, archive: str, sub: str, splits: Dict[str, List[str]],
               label_key: str, num_classes: int) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """{split: (images, labels)} of a CIFAR source; `splits` names each split's batches, read
    and concatenated in that order."""
    read = member_reader(source, archive, sub)
    raw = read([b for batches in splits.values() for b in batches])
    out = {}
    for split, batches in splits.items():
        parts = [batch_arrays(load_pickle(raw[b], f"{source}:{b}"), label_key, num_classes,
                              f"{source}:{b}") for b in batches]
        out[split] = (np.concatenate([p[0] for p in parts]),
                      np.concatenate([p[1] for p in parts]))
    return out
