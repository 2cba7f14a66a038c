r"""The paper's Table 1 row of a dataset: classes, train/test clients, points per train client.

    python -m data_prep.stats --dataset=shakespeare --json
    python -m data_prep.stats --dataset=npz --data_path=mine.npz --partition=dirichlet \
        --dirichlet_alpha=0.3 --num_clients=100 --histogram

Loads the dataset exactly as the runner does (:func:`deltafl_jax.load_dataset`, preparing it on
first use, with the runner's data flags from ``experiments/cli.py``) and prints
:meth:`deltafl_jax.FederatedDataset.stats`: with ``--json`` exactly one JSON object with the
keys ``num_classes, num_train_clients, num_test_clients, median_examples, min_examples,
max_examples``; otherwise one readable line. The paper's Table 1 (delta-fl-long.md) is:

    EMNIST       62 classes, 865 / 865 clients, median 179,  min 101, max 447
    Sent140       2 classes, 438 / 439 clients, median 69,   min 51,  max 549
    Shakespeare  53 classes, 544 / 545 clients, median 1288, min 101, max 66963

Data split by ``--partition`` also get, for each split, the partition's size statistics and its
label histogram's (classes per client, the mean total-variation distance of a client's labels
from the split's; :func:`deltafl_jax.datasets.partition.split_stats`), under the key
``partition`` with ``--json``; ``--histogram`` adds the clients x classes counts.

A missing source prints one line and exits with code 2.
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from experiments import cli

cli.define_data_flags()
flags.DEFINE_bool("json", False, "print one JSON object")
flags.DEFINE_bool("histogram", False, "with --partition: print every client's label counts too")


def _partition_stats(data) -> dict:
    from deltafl_jax.datasets.partition import split_stats

    out = {}
    for name, split in (("train", data.train), ("test", data.test)):
        out[name] = split_stats(split, data.num_classes)
        if not cli.FLAGS.histogram:
            out[name].pop("label_histogram", None)
    return out


def _print_partition(part: dict) -> None:
    for name, s in part.items():
        line = (f"  {name}: {s['clients']} clients, {s['examples']} examples; size mean "
                f"{s['size_mean']:.1f} std {s['size_std']:.1f} min {s['size_min']} median "
                f"{s['size_median']:g} max {s['size_max']}")
        if "classes_per_client_mean" in s:
            line += (f"; classes per client mean {s['classes_per_client_mean']:.2f} min "
                     f"{s['classes_per_client_min']} max {s['classes_per_client_max']}; label "
                     f"TV distance from the split's mean {s['label_tv_distance_mean']:.3f}")
        print(line, flush=True)
        for k, row in enumerate(s.get("label_histogram", [])):
            print(f"    client {k}: {' '.join(str(v) for v in row)}", flush=True)


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
    part = _partition_stats(data) if data.partition is not None else None
    if cli.FLAGS.json:
        print(json.dumps(stats if part is None else {**stats, "partition": part}), flush=True)
        return
    print(f"{data.name}: {stats['num_classes']} classes, {stats['num_train_clients']} train "
          f"/ {stats['num_test_clients']} test clients; examples per train client: median "
          f"{stats['median_examples']}, min {stats['min_examples']}, max "
          f"{stats['max_examples']}", flush=True)
    if part is not None:
        print("partition:", flush=True)
        _print_partition(part)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags_or_fail)
