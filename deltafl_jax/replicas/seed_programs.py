"""Seeds that are different datasets: ``--resample_writers_per_seed``.

The authors repeat each experiment with 5 seeds, each "with a different sampling of train and
test devices" (CISS 2021, Sec. V): the seed draws FEMNIST's 50% writer subsample and the 50/50
train/test split anew. Replicas of one compiled program share one dataset (their client arrays
and shapes), so such seeds cannot be replicas of one program. The simplest correct design,
used here: **one program per seed**. :func:`seed_programs` turns a configuration into one
configuration per seed, each with

- ``seeds = (s,)``: the seed still drives client sampling, shuffling and initialisation;
- ``data.data_seed = seed_data_seed(data_seed, s)`` (= s for the default ``--data_seed=0``),
  which draws the writer subsample, the split and the client limits of that seed;
- ``output_dir = <output_dir>/seed_<s>``: an ordinary run directory.

The swept values (theta, q, ...) of one seed still train together in that seed's program. The
report (``python -m experiments.report <output_dir>``) finds the ``seed_<s>`` runs and puts
their replicas in the same table cells (mean +- std over seeds, each seed on its own clients);
its per-client figures pool the clients of every seed. Without the flag, nothing changes: one
program, every seed on the dataset of ``--data_seed``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List

SEED_STRIDE = 2 ** 31   # seeds are < 2^31 (config check), so (data_seed, seed) -> one integer


def seed_data_seed(data_seed: int, seed: int) -> int:
    """The data seed of seed `seed`: data_seed * 2^31 + seed (just the seed for data_seed 0)."""
    return int(data_seed) * SEED_STRIDE + int(seed)


def seed_dir(output_dir: str, seed: int) -> str:
    return os.path.join(output_dir, f"seed_{int(seed)}")


def seed_programs(config) -> List:
    """One configuration per seed when ``config.data.resample_writers_per_seed`` (module
    docstring), else ``[config]``."""
    if not config.data.resample_writers_per_seed:
        return [config]
    out = []
    for s in config.training.seeds:
        data = dataclasses.replace(config.data,
                                   data_seed=seed_data_seed(config.data.data_seed, s))
        where = config.output.output_dir
        out.append(dataclasses.replace(
            config, data=data, training=dataclasses.replace(config.training, seeds=(s,)),
            output=dataclasses.replace(config.output,
                                       output_dir=seed_dir(where, s) if where else None)))
    return out
