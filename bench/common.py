"""Shared pieces of the benchmarks: FEMNIST-like clients, timing, memory, JSON output.

FEMNIST after the paper's preprocessing has 865 training writers with median 179, min 101 and
max 447 images (Table 1). :func:`femnist_like_sizes` draws sizes with that shape: a lognormal
around 179 truncated to [101, 447] (writers below 100 images are dropped in LEAF). The pixels
are synthetic uint8 images, so the benchmarks need no download.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np

from deltafl_jax import ClientData, FederatedDataset

FEMNIST_MEDIAN, FEMNIST_MIN, FEMNIST_MAX = 179, 101, 447


def femnist_like_sizes(num_clients: int, seed: int = 0) -> np.ndarray:
    """Client sizes with FEMNIST's median, min and max (rejection sampling, then the
    smallest and largest client pinned to 101 and 447)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < num_clients:
        s = np.round(rng.lognormal(np.log(FEMNIST_MEDIAN), 0.32, size=4 * num_clients))
        out.extend(s[(s >= FEMNIST_MIN) & (s <= FEMNIST_MAX)].astype(int).tolist())
    sizes = np.asarray(out[:num_clients])
    if num_clients >= 2:
        sizes[np.argmin(sizes)] = FEMNIST_MIN
        sizes[np.argmax(sizes)] = FEMNIST_MAX
    return sizes


def femnist_like_dataset(num_clients: int = 865, seed: int = 0, flat: bool = False,
                         num_test_clients: int = 2) -> FederatedDataset:
    """Synthetic 28x28 uint8 images (1.0 = background after x_scale, as LEAF) in FEMNIST-like
    clients, 62 classes."""
    rng = np.random.default_rng(seed)

    def split(n_clients, seed_):
        sizes = femnist_like_sizes(n_clients, seed_)
        total = int(sizes.sum())
        shape = (total, 784) if flat else (total, 28, 28)
        x = rng.integers(0, 256, size=shape, dtype=np.uint8)
        y = rng.integers(0, 62, size=total).astype(np.int32)
        return ClientData(x=x, y=y, offsets=np.concatenate([[0], np.cumsum(sizes)]),
                          client_ids=np.arange(n_clients))

    return FederatedDataset("femnist_like", split(num_clients, seed),
                            split(num_test_clients, seed + 1), num_classes=62,
                            x_scale=1 / 255)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def median_time(fn: Callable[[], None], repeats: int) -> List[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def emit(result: Dict, out: str = None) -> None:
    """Print one JSON object; also write it to `out` if given."""
    text = json.dumps(result, indent=2, sort_keys=False)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")


def machine() -> Dict:
    import jax
    import platform
    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": str(getattr(dev, "device_kind", dev)),
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "jax": jax.__version__, "platform": platform.platform()}


median = statistics.median
