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


class CompileTimer:
    """Seconds JAX spends tracing, lowering and compiling while active (from jax.monitoring)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        import jax
        self.seconds = 0.0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, name, duration, **kwargs):
        if self.active and name in self.EVENTS:
            self.seconds += duration

    def __enter__(self):
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False
        return False


def forward_flops_per_example(model) -> float:
    """FLOPs of one example's forward pass, from XLA's cost analysis of the model alone."""
    import jax
    import jax.numpy as jnp

    params = model.init(jax.random.key(0))
    x = jnp.zeros((64,) + tuple(model.example_shape), model.input_dtype)
    cost = jax.jit(model.apply).lower(params, x).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost["flops"]) / 64


def gemm_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Measured float32 GEMM rate (n x n times n x n): the practical roof of this machine."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(a))
    best = min(median_time(lambda: jax.block_until_ready(f(a)), repeats))
    return 2 * n ** 3 / best / 1e9


def critical_path(metrics, placement) -> Dict:
    """Mean per round of the sequential steps of the engine's loops (the critical path that
    predicts accelerator latency): evaluation trips (chunks of `eval_chunk` examples on
    `eval_lanes` lanes) plus the local-SGD steps of the busiest lane, and the while-loop
    trips that run the latter (`unroll` steps per trip). `metrics`: the rounds' metrics."""
    import numpy as np

    def mean(values):
        return float(np.mean([float(np.sum(v)) for v in values]))

    unroll = max(1, int(getattr(placement, "unroll", 1)))
    if all("eval_trips" in m for m in metrics):   # the busiest device's trips
        eval_steps = mean(m["eval_trips"] for m in metrics)
    else:
        eval_steps = mean(m["eval_padded_examples"] for m in metrics) / (
            placement.eval_lanes * placement.eval_chunk)
    train_steps = mean(m["train_trips"] for m in metrics)
    loop_trips = mean(-(-int(m["train_trips"]) // unroll) for m in metrics)
    return {"eval_steps": eval_steps, "train_steps": train_steps,
            "critical_path_steps": eval_steps + train_steps, "unroll": unroll,
            "train_loop_trips": loop_trips,
            "critical_path_loop_trips": eval_steps + loop_trips}
