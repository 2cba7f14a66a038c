"""Where the benchmarks write their JSON (no imports beyond the standard library, so that a
driver such as :mod:`bench.before_after` can use it without loading JAX).

Unless ``--out`` names a path, a benchmark writes ``bench/out/<name>.json``, which git ignores:
running a benchmark leaves a clone clean. The figures committed in ``bench/results/`` are
written with an explicit ``--out=bench/results/NAME.json``.
"""

from __future__ import annotations

import os

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def default_out(name: str) -> str:
    """``bench/out/<name>.json`` (:data:`OUT_DIR`, git-ignored)."""
    return os.path.join(OUT_DIR, f"{name}.json")
