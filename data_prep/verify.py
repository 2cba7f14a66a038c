r"""Check a prepared dataset byte for byte: every file's size and sha256 against its checksums.

    python -m data_prep.verify --dataset=shakespeare [--data_dir=...] [--min_client_examples=K]
    python -m data_prep.verify --dataset=tfds:cifar10

Opening a prepared dataset (:func:`deltafl_jax.datasets.prepared.open_prepared`) compares only
the files' presence and sizes with the ``checksums.json`` written at preparation, so it costs
O(metadata) however large the records; the full sha256 pass runs at preparation, after a failed
read, and here. This command checks every prepared config of the dataset under ``--data_dir``
(only ``min<K>`` with ``--min_client_examples=K``), prints one line per file (``ok`` or
``DAMAGED`` with the reason) and a verdict.

Exit code 0 when every file matches; 2 with one line on stderr when a file is damaged or missing
or nothing is prepared (it names the command that prepares the dataset again).
"""

from __future__ import annotations

import os
import sys

from absl import app, logging

from experiments import cli

cli.define_data_flags()


def _targets(name: str, data_dir: str):
    """(config, directory) pairs to check: all prepared configs, or the one of the flag."""
    from deltafl_jax.datasets import prepared

    if cli.FLAGS["min_client_examples"].present:
        config = prepared.config_name(cli.FLAGS.min_client_examples)
        path = prepared.dataset_path(data_dir, name, config)
        return [(config, path)] if os.path.isdir(path) else []
    return prepared.config_dirs(data_dir, name)


def main(argv) -> None:
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax.datasets import CENTRALISED, PREPARABLE, cache, centralised_key, prepared

    name = cli.FLAGS.dataset
    if not cli.FLAGS["dataset"].present or (name not in PREPARABLE and not centralised_key(name)):
        cli.fail(f"--dataset must be one of {', '.join(sorted(PREPARABLE) + sorted(CENTRALISED))}")
    data_dir = cli.data_config_from_flags().resolved_data_dir
    if centralised_key(name):
        from deltafl_jax.datasets import centralised
        targets = prepared.config_dirs(data_dir, centralised.storage_key(name))
    else:
        targets = _targets(name, data_dir)
    if not targets:
        cli.fail(f"{name}: nothing prepared under {data_dir}; run python -m data_prep.prepare "
                 f"--dataset={name}")
    damaged = []
    for config, path in targets:
        for entry, problem in cache.check_files(path, full=True):
            where = f"{config}/{prepared.VERSION}/{entry}"
            if problem is None:
                print(f"ok       {where} ({os.path.getsize(os.path.join(path, entry))} bytes)")
            else:
                print(f"DAMAGED  {where}: {problem}")
                if path not in dict(damaged):
                    damaged.append((path, f"{entry} {problem}"))
    sys.stdout.flush()
    if damaged:
        path, reason = damaged[0]
        more = f" (and {len(damaged) - 1} more damaged config(s))" if len(damaged) > 1 else ""
        cli.fail(str(prepared.DamagedDataset(name, path, reason)) + more)
    print(f"{name}: {len(targets)} prepared config(s) under {data_dir}: every file matches its "
          f"size and sha256")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags_or_fail)
