r"""The paper's Table 1 row of a dataset: classes, train/test clients, points per train client.

    python -m data_prep.stats --dataset=shakespeare --json

Loads the dataset exactly as the runner does (:func:`deltafl_jax.load_dataset`, preparing it on
first use) and prints :meth:`deltafl_jax.FederatedDataset.stats`: with ``--json`` exactly one
JSON object with the keys ``num_classes, num_train_clients, num_test_clients, median_examples,
min_examples, max_examples``; otherwise one readable line. The paper's Table 1
(delta-fl-long.md) is:

    EMNIST       62 classes, 865 / 865 clients, median 179,  min 101, max 447
    Sent140       2 classes, 438 / 439 clients, median 69,   min 51,  max 549
    Shakespeare  53 classes, 544 / 545 clients, median 1288, min 101, max 66963

A missing source prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser():
    parser = argparse.ArgumentParser(prog="python -m data_prep.stats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data_path", default=None, help="raw source (see data_prep.prepare)")
    parser.add_argument("--data_dir", default=None, help="prepared-dataset cache")
    parser.add_argument("--data_seed", type=int, default=0, help="seed of the client split")
    parser.add_argument("--min_client_examples", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from deltafl_jax.data import DataError
    from deltafl_jax.datasets import DataConfig, load_dataset

    config = DataConfig(dataset=args.dataset, data_path=args.data_path, data_dir=args.data_dir,
                        data_seed=args.data_seed, min_client_examples=args.min_client_examples)
    try:
        stats = load_dataset(config).stats()
    except DataError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"{args.dataset}: {stats['num_classes']} classes, {stats['num_train_clients']} / "
              f"{stats['num_test_clients']} clients, median {stats['median_examples']:g}, "
              f"min {stats['min_examples']}, max {stats['max_examples']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
