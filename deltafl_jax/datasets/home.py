"""Where prepared datasets live (:func:`default_data_dir`): a leaf of :mod:`deltafl_jax.datasets`
that the dataset modules import, so that none of them imports the package that registers them
(the package re-exports it)."""

from __future__ import annotations

import os


def default_data_dir() -> str:
    """Where prepared datasets live: $DELTAFL_DATA, else ~/.cache/deltafl_jax."""
    return os.environ.get("DELTAFL_DATA") or os.path.join(
        os.path.expanduser("~"), ".cache", "deltafl_jax")
