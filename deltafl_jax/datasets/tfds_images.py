"""Image-classification datasets of tensorflow-datasets (``--dataset=tfds:NAME``) as arrays.

Any tfds dataset whose features hold an ``image`` (:class:`tfds.features.Image` of a fixed
height, width and channel count, uint8) and a ``label`` (:class:`tfds.features.ClassLabel`) and
whose splits include ``train`` and ``test``: ``cifar10``, ``cifar100``, ``mnist``,
``fashion_mnist``, ``emnist/balanced``, ``svhn_cropped``, ``kmnist``... Other features (CIFAR-10's
``id``, CIFAR-100's ``coarse_label``) are ignored. NAME may carry a config and a version, as tfds
spells them (``emnist/balanced``, ``mnist:3.0.1``).

Where the examples come from, without network unless asked:

1. a copy tfds has already prepared in the ``array_record`` format, read through
   ``tfds.data_source`` (no TensorFlow needed), in ``--data_path`` (a tfds ``data_dir``), else in
   ``<data_dir>/raw/tfds/`` (where ``--download`` puts it), else in tfds' own default
   (``$TFDS_DATA_DIR``, ``~/tensorflow_datasets``); a copy in tfds' default ``tfrecord``
   format is not read (that needs TensorFlow);
2. with ``--download`` only: tfds downloads the authors' files and prepares them into
   ``--data_path`` when given, else ``<data_dir>/raw/tfds/``. tfds' builders of these datasets need TensorFlow to do that
   (``tf.io.gfile``, ``tf.image.encode_png``); without it the error says so and names the
   route that needs none (``--dataset=cifar10 --download``, :mod:`deltafl_jax.datasets.centralised`).

The examples keep tfds' order (its preparation shuffles them by a hash of their keys: the same
order on every machine for one tfds version), which is not the order of the published files.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Dict, Optional, Tuple

import numpy as np

from deltafl_jax.datasets import cache
from deltafl_jax.datasets.tfds_format import quiet, tfds_module
from deltafl_jax.errors import DataError

PREFIX = "tfds:"
_NAME = re.compile(r"^[a-z][a-z0-9_]*(/[a-z0-9_.\-]+)?(:\d+\.\d+\.\d+)?$")
RAW_SUBDIR = os.path.join("raw", "tfds")
SPLITS = ("train", "test")


def tfds_name(name: str) -> str:
    """NAME of ``tfds:NAME``; DataError when it is not spelled as a tfds dataset."""
    bare = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if not _NAME.match(bare):
        raise DataError(f"--dataset={name}: not a tensorflow-datasets name (tfds:NAME, "
                        f"tfds:NAME/CONFIG or tfds:NAME:VERSION, e.g. tfds:cifar10)")
    return bare


def _builder(name: str, data_dir: Optional[str], file_format: Optional[str] = None):
    """tfds' builder of `name` (a prepared copy in `data_dir` keeps its own file format unless
    `file_format` is given); DataError when tfds does not know the name."""
    tfds = tfds_module()
    kwargs = {"file_format": file_format} if file_format else {}
    try:
        with quiet():
            return tfds.builder(name, data_dir=data_dir, **kwargs)
    except tfds.core.registered.DatasetNotFoundError:
        raise DataError(f"tensorflow-datasets has no dataset {name!r} (see "
                        f"https://www.tensorflow.org/datasets/catalog)") from None
    except ModuleNotFoundError as err:
        raise DataError(f"tfds:{name}: tensorflow-datasets needs {err.name} to load this "
                        f"dataset's definition") from None
    except (ValueError, KeyError, AssertionError) as err:  # an unknown config or version
        raise DataError(f"tfds:{name}: {str(err).splitlines()[0]}") from None


def image_spec(name: str, builder) -> Tuple[Tuple[int, int, int], int, Tuple[str, ...]]:
    """((height, width, channels), number of classes, class names) of an image-classification
    builder; DataError naming what is missing otherwise."""
    tfds = tfds_module()
    features = builder.info.features
    keys = sorted(features.keys()) if hasattr(features, "keys") else []
    image, label = (features[k] if k in keys else None for k in ("image", "label"))
    if not isinstance(image, tfds.features.Image) or not isinstance(
            label, tfds.features.ClassLabel):
        raise DataError(f"tfds:{name} is not an image-classification dataset (its features are "
                        f"{', '.join(keys) or 'not a dict'}; needs an image and a class label)")
    shape = tuple(image.shape)
    if len(shape) != 3 or any(d is None for d in shape):
        raise DataError(f"tfds:{name}: its images have no fixed size ({shape}); only datasets "
                        f"of fixed-size images are supported")
    if np.dtype(image.np_dtype) != np.uint8:
        raise DataError(f"tfds:{name}: its images are {np.dtype(image.np_dtype)}, not uint8")
    names = tuple(label.names) if label.names else ()
    return tuple(int(d) for d in shape), int(label.num_classes), names


def _split_arrays(builder, name: str, split: str, shape) -> Tuple[np.ndarray, np.ndarray]:
    try:
        with quiet():
            source = builder.as_data_source(split=split)
    except (KeyError, ValueError) as err:
        raise DataError(f"tfds:{name} has no {split!r} split ({str(err).splitlines()[0]})") \
            from None
    n = len(source)
    images = np.empty((n,) + tuple(shape), dtype=np.uint8)
    labels = np.empty((n,), dtype=np.int32)
    for i in range(n):  # one record at a time: tfds decodes each image on its own anyway
        example = source[i]
        images[i] = example["image"]
        labels[i] = int(example["label"])
    return images, labels


def prepared_builder(name: str, data_dirs) -> Tuple[Optional[object], Optional[str]]:
    """(the builder of the first of `data_dirs` that holds `name` prepared as array_record,
    else None; a data_dir holding it in another format, else None)."""
    other = None
    for data_dir in data_dirs:
        if data_dir is None or not os.path.isdir(data_dir):
            continue
        builder = _builder(name, data_dir)
        if not builder.is_prepared():
            continue
        formats = [str(getattr(f, "value", f)) for f in builder.info.available_file_formats()]
        if "array_record" in formats:
            return builder, None
        other = other or data_dir
    return None, other


def download_and_prepare(name: str, raw_dir: str):
    """Have tfds download and prepare `name` as array_record under `raw_dir`; DataError (one
    line) when it cannot (no TensorFlow, no network), removing `raw_dir` if it made it."""
    tfds = tfds_module()
    made = not os.path.exists(raw_dir)
    builder = _builder(name, raw_dir, "array_record")
    try:
        with quiet():
            builder.download_and_prepare(
                download_dir=os.path.join(raw_dir, "downloads"),
                download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    except ModuleNotFoundError as err:
        why = (f"tensorflow-datasets needs {err.name} to download and prepare it (pip install "
               f"tensorflow)")
        _failed(raw_dir, made, name, why)
    except Exception as err:  # pylint: disable=broad-except  # network and tfds errors vary
        _failed(raw_dir, made, name, f"could not download it ({str(err).splitlines()[0]})")
    return builder


def _failed(raw_dir: str, made: bool, name: str, why: str):
    if made:
        shutil.rmtree(raw_dir, ignore_errors=True)
    files = " (or the published files: --dataset=" + name + " --download)" if name in (
        "cifar10", "cifar100", "mnist", "fashion_mnist") else ""
    raise DataError(f"tfds:{name}: {why}; prepare it with tfds on a machine that can and pass "
                    f"--data_path=ITS_TFDS_DATA_DIR{files}")


def read(name: str, data_path: Optional[str], data_dir: str,
         download: bool) -> Tuple[Dict[str, Tuple[np.ndarray, np.ndarray]], dict]:
    """({"train": (x, y), "test": (x, y)}, metadata) of tfds' `name` (module docstring)."""
    raw_dir = os.path.join(data_dir, RAW_SUBDIR)
    tfds = tfds_module()
    dirs = [data_path] if data_path else [raw_dir, os.fspath(tfds.core.constants.DATA_DIR)]
    spec = image_spec(name, _builder(name, None))  # the definition alone: no file is read
    builder, other = prepared_builder(name, dirs)
    if builder is None and download:
        builder = download_and_prepare(name, data_path or raw_dir)
    if builder is None:
        where = data_path or " or ".join(d for d in dirs if d)
        found = f" (the copy in {other} is not array_record, which tfds reads without " \
                f"TensorFlow)" if other else ""
        raise DataError(f"tfds:{name}: not prepared as array_record in {where}{found}; run "
                        f"python -m data_prep.prepare --dataset=tfds:{name} --download")
    arrays = {split: _split_arrays(builder, name, split, spec[0]) for split in SPLITS}
    metadata = {"num_classes": spec[1], "label_names": list(spec[2]), "image_shape": list(spec[0]),
                "tfds_version": str(builder.info.version),
                "source": os.path.abspath(data_path) if data_path else os.fspath(
                    builder.data_dir),
                "source_files": cache.file_facts(files_under(os.fspath(builder.data_dir)))}
    return arrays, metadata


def files_under(folder: str):
    """Every file below `folder` (tfds' prepared copy of one version of a dataset: the files
    it was read from), absolute; none when it is not a folder."""
    return [os.path.abspath(os.path.join(here, f)) for here, _, files in os.walk(folder)
            for f in files]
