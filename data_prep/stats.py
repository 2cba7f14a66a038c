r"""The paper's Table 1 row of a dataset: classes, train/test clients, points per train client.

    python -m data_prep.stats --dataset=shakespeare --json

Loads the dataset exactly as the runner does (:func:`deltafl_jax.load_dataset`, preparing it on
first use, with the runner's data flags from ``experiments/cli.py``) and prints
:meth:`deltafl_jax.FederatedDataset.stats`: with ``--json`` exactly one JSON object with the
keys ``num_classes, num_train_clients, num_test_clients, median_examples, min_examples,
max_examples``; otherwise one readable line. The paper's Table 1 (delta-fl-long.md) is:

    EMNIST       62 classes, 865 / 865 clients, median 179,  min 101, max 447
    Sent140       2 classes, 438 / 439 clients, median 69,   min 51,  max 549
    Shakespeare  53 classes, 544 / 545 clients, median 1288, min 101, max 66963

A missing source prints one line and exits with code 2.
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from experiments import cli

cli.define_data_flags()
flags.DEFINE_bool("json", False, "print one JSON object")


def main(argv) -> None:
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax.datasets import load_dataset
    from deltafl_jax.errors import DataError

    try:
        data = load_dataset(cli.data_config_from_flags())
    except (DataError, cli.UsageError) as err:
        cli.fail(str(err))
    stats = data.stats()
    if cli.FLAGS.json:
        print(json.dumps(stats), flush=True)
    else:
        print(f"{data.name}: {stats['num_classes']} classes, {stats['num_train_clients']} train "
              f"/ {stats['num_test_clients']} test clients; examples per train client: median "
              f"{stats['median_examples']}, min {stats['min_examples']}, max "
              f"{stats['max_examples']}", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags_or_fail)
