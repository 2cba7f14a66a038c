"""The tfds format of a prepared dataset: tensorflow-datasets ``array_record`` files with one
record per client, written and read back without TensorFlow.

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
import logging
import os
import shutil
import tempfile
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

VERSION = "1.0.0"
SPLIT = "clients"

# A feature spec maps a record field to (shape, dtype); the first dimension of a per-client
# array is the client's number of examples, so it is None.
FeatureSpec = Mapping[str, Tuple[Tuple[Optional[int], ...], Any]]


def tfds_module():
    """Import tensorflow_datasets without its progress bars."""
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    tfds.disable_progress_bar()
    return tfds


@contextlib.contextmanager
def quiet():
    """Silence tfds while it works: its info/warning logs (absl) and the "Downloading and
    preparing" lines it prints on stdout, which stays for the callers' own output
    (data_prep.stats --json prints exactly one JSON object there). The absl level is restored
    afterwards. tfds' temporary folders (``tempfile.mkdtemp("tfds")`` in
    ``DatasetInfo.initialize_from_bucket``, which it never removes) go into a folder of our own,
    removed on the way out with whatever it holds; the temporary directory is restored."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    before = tempfile.tempdir
    scratch = tempfile.mkdtemp(prefix="deltafl_tfds_")
    tempfile.tempdir = scratch
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            yield
    finally:
        tempfile.tempdir = before
        shutil.rmtree(scratch, ignore_errors=True)
        logger.setLevel(level)


def builder_name(name: str) -> str:
    return f"deltafl_{name}"


def dataset_path(data_dir: str, name: str, config: str) -> str:
    return os.path.join(data_dir, builder_name(name), config, VERSION)


def _features(spec: FeatureSpec):
    tfds = tfds_module()
    fields = {"index": tfds.features.Scalar(dtype=np.int64), "client_id": tfds.features.Text()}
    for key, (shape, dtype) in spec.items():
        fields[key] = tfds.features.Tensor(shape=tuple(shape), dtype=np.dtype(dtype),
                                           encoding=tfds.features.Encoding.BYTES)
    return tfds.features.FeaturesDict(fields)


def builder_class(name: str, spec: FeatureSpec, clients: Sequence[Mapping],
                  meta: Mapping[str, Any], side: Mapping[str, np.ndarray], description: str):
    """The tfds builder class of dataset `name` that writes one record per client, and the
    side arrays."""
    tfds = tfds_module()
    features = _features(spec)
    version = VERSION

    class _ClientRecords(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """One record per client; see the module docstring of deltafl_jax.datasets.tfds_format."""

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
    # which needs importlib_resources (etils >= 1.10 does not install it).
    _ClientRecords.code_path = None
    return _ClientRecords


def build(records_class, data_dir: str, name: str, config: str) -> str:
    """Have tfds write the dataset of `records_class` (:func:`builder_class`) as config
    `config` under `data_dir`; returns its directory."""
    tfds = tfds_module()
    with quiet():
        builder = records_class(data_dir=data_dir,
                                config=tfds.core.BuilderConfig(name=config),
                                file_format="array_record")
        builder.download_and_prepare(
            download_dir=os.path.join(data_dir, "downloads"),
            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return dataset_path(data_dir, name, config)


def read_info(path: str) -> Tuple[dict, int]:
    """(metadata, number of records) of the dataset directory `path`, from tfds' files."""
    tfds = tfds_module()
    with quiet():
        info = tfds.builder_from_directory(path).info
    return dict(info.metadata or {}), int(info.splits[SPLIT].num_examples)


def read_records(path: str, name: str, config: str, indices: Optional[Sequence[int]]):
    """[(index, decoded record)] at `indices` (all by default), through tfds.data_source."""
    tfds = tfds_module()
    data_dir = os.path.dirname(os.path.dirname(os.path.dirname(path)))
    with quiet():
        source = tfds.data_source(f"{builder_name(name)}/{config}:{VERSION}",
                                  split=SPLIT, data_dir=data_dir, download=False)
    if indices is None:
        indices = range(len(source))
    indices = [int(i) for i in indices]
    records = source.__getitems__(indices) if indices else []
    return list(zip(indices, records))
