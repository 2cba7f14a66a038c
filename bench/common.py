"""Shared pieces of the benchmarks: FEMNIST-, Shakespeare- and Sent140-like clients, timing,
memory, JSON output.

FEMNIST after the paper's preprocessing has 865 training writers with median 179, min 101 and
max 447 images (Table 1). :func:`femnist_like_sizes` draws sizes with that shape: a lognormal
around 179 truncated to [101, 447] (writers below 100 images are dropped in LEAF). The pixels
are synthetic uint8 images, so the benchmarks need no download.

Shakespeare (544 train / 545 test roles, median 1288, min 101, max 66963 windows) and Sent140
(438 / 439 users, median 69, min 51, max 549 tweets) get sizes of the same median, min and max
(:func:`table1_sizes`), and inputs of the shapes and dtypes their loaders produce (the window
of :mod:`deltafl_jax.datasets.shakespeare`, the GloVe ids and table of
:mod:`deltafl_jax.datasets.sent140`), with random ids: same work, no download.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np

from bench.paths import OUT_DIR, default_out  # noqa: F401  (re-exported)
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


SHAKESPEARE_TABLE1 = dict(train=544, test=545, median=1288, lo=101, hi=66963)
SENT140_TABLE1 = dict(train=438, test=439, median=69, lo=51, hi=549)
SENT140_VOCABULARY = 20000   # GloVe rows kept for the users' words (an assumed size)


def table1_sizes(num_clients: int, median: int, lo: int, hi: int, seed: int = 0) -> np.ndarray:
    """Client sizes of a given median, min and max: lo + (median - lo) * lognormal(0, s), the
    spread s putting hi three deviations out (the largest of a few hundred draws), draws
    above hi redrawn, then the smallest and largest pinned to lo and hi."""
    rng = np.random.default_rng(seed)
    sigma = np.log((hi - lo) / (median - lo)) / 3.0
    out = []
    while len(out) < num_clients:
        s = np.round(lo + (median - lo) * rng.lognormal(0.0, sigma, size=4 * num_clients))
        out.extend(s[s <= hi].astype(int).tolist())
    sizes = np.asarray(out[:num_clients])
    if num_clients >= 2:
        sizes[np.argmin(sizes)] = lo
        sizes[np.argmax(sizes)] = hi
    return sizes


def _split(sizes, x_fn, y_fn):
    total = int(sizes.sum())
    return ClientData(x=x_fn(total), y=y_fn(total),
                      offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                      client_ids=np.arange(len(sizes)))


def shakespeare_like_dataset(num_clients: int = 544, num_test_clients: int = 545,
                             seed: int = 0) -> FederatedDataset:
    """Windows of WINDOW character ids (uint8, as the loader's) -> the next character, in
    clients of Shakespeare's Table 1 sizes."""
    from deltafl_jax.datasets import shakespeare as sh
    rng = np.random.default_rng(seed)
    t = SHAKESPEARE_TABLE1
    x = lambda n: rng.integers(0, sh.NUM_CLASSES, size=(n, sh.WINDOW), dtype=np.uint8)
    y = lambda n: rng.integers(0, sh.NUM_CLASSES, size=n).astype(np.int32)
    splits = [_split(table1_sizes(n, t["median"], t["lo"], t["hi"], seed + i), x, y)
              for i, n in enumerate((num_clients, num_test_clients))]
    return FederatedDataset("shakespeare_like", *splits, num_classes=sh.NUM_CLASSES,
                            metadata={"input_vocab_size": sh.NUM_CLASSES})


def sent140_like_dataset(num_clients: int = 438, num_test_clients: int = 439, seed: int = 0,
                         vocabulary: int = SENT140_VOCABULARY) -> FederatedDataset:
    """Tweets as int32 GloVe ids (PAD after a random length, as the loader's) of the tokens the
    LSTM reads, a random float32 table of EMBED_DIM columns, binary labels, in clients of
    Sent140's Table 1 sizes."""
    from deltafl_jax.datasets import sent140 as s140
    from deltafl_jax.models.text import LSTM_MAX_TOKENS
    rng = np.random.default_rng(seed)
    t = SENT140_TABLE1

    def x(n):
        ids = rng.integers(s140.UNK_ID, vocabulary, size=(n, LSTM_MAX_TOKENS)).astype(np.int32)
        length = rng.integers(1, LSTM_MAX_TOKENS + 1, size=n)
        ids[np.arange(LSTM_MAX_TOKENS)[None, :] >= length[:, None]] = s140.PAD_ID
        return ids

    y = lambda n: rng.integers(0, s140.NUM_CLASSES, size=n).astype(np.int32)
    splits = [_split(table1_sizes(n, t["median"], t["lo"], t["hi"], seed + i), x, y)
              for i, n in enumerate((num_clients, num_test_clients))]
    table = rng.normal(0, 0.4, size=(vocabulary, s140.EMBED_DIM)).astype(np.float32)
    table[[s140.PAD_ID, s140.UNK_ID]] = 0.0
    return FederatedDataset("sent140_like", *splits, num_classes=s140.NUM_CLASSES,
                            metadata={"embeddings": table, "pad_id": s140.PAD_ID,
                                      "unk_id": s140.UNK_ID, "max_tokens": LSTM_MAX_TOKENS,
                                      "vocabulary_size": vocabulary})


def cifar_like_dataset(num_clients: int = 1000, client_size: int = 50, side: int = 32,
                       channels: int = 3, classes: int = 10, seed: int = 0) -> FederatedDataset:
    """pfl-research's CIFAR-10 benchmark's shape with random pixels: `num_clients` clients of
    `client_size` uint8 side x side x channels images (scaled by 1/255 as the CIFAR loaders'),
    `classes` labels; two test clients (a timed round does not evaluate)."""
    rng = np.random.default_rng(seed)

    def split(clients):
        n = clients * client_size
        return ClientData(
            x=rng.integers(0, 256, (n, side, side, channels), dtype=np.uint8),
            y=rng.integers(0, classes, n).astype(np.int32),
            offsets=np.arange(clients + 1, dtype=np.int64) * client_size,
            client_ids=np.arange(clients))

    return FederatedDataset("cifar_like", split(num_clients), split(2), num_classes=classes,
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


SUMMARY_LINES = 20   # one screen


def _scalar_text(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _flat(value, key: str, lines: List[str]) -> None:
    """One line per scalar of `value` ('a.b: 1.23'); a list of scalars on one line; a list of
    records one line each (their first scalar fields)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(v, f"{key}.{k}" if key else str(k), lines)
    elif isinstance(value, (list, tuple)):
        if all(not isinstance(v, (dict, list, tuple)) for v in value):
            shown = ", ".join(_scalar_text(v) for v in value[:6])
            lines.append(f"{key}: [{shown}{', ...' if len(value) > 6 else ''}]")
        else:
            for i, v in enumerate(value):
                if isinstance(v, dict):
                    fields = [f"{k}={_scalar_text(x)}" for k, x in v.items()
                              if not isinstance(x, (dict, list, tuple))][:6]
                    lines.append(f"{key}[{i}]: " + ", ".join(fields))
                else:
                    _flat(v, f"{key}[{i}]", lines)
    else:
        lines.append(f"{key}: {_scalar_text(value)}")


def summary_lines(result: Dict, limit: int = SUMMARY_LINES) -> List[str]:
    """A one-screen summary of a benchmark's JSON: its scalars, at most `limit` lines (the
    machine's description left out; the JSON file has everything)."""
    lines: List[str] = []
    _flat({k: v for k, v in result.items() if k != "machine"}, "", lines)
    if len(lines) > limit:
        lines = lines[:limit - 1] + [f"... {len(lines) - limit + 1} more lines in the JSON"]
    return lines


def emit(result: Dict, out: str = None, name: str = None, summary: List[str] = None,
         print_json: bool = False) -> str:
    """Write the JSON to `out` (default :func:`default_out` of `name`, else of
    ``result["benchmark"]``), print a one-screen summary (`summary`, else
    :func:`summary_lines`) and the path; the whole JSON on stdout too with `print_json`.
    Returns the path written."""
    text = json.dumps(result, indent=2, sort_keys=False)
    from bench import paths   # looked up at call time (tests redirect OUT_DIR)
    path = out or paths.default_out(name or str(result.get("benchmark", "bench")))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")
    if print_json:
        print(text)
    lines = summary if summary is not None else summary_lines(result)
    print("\n".join(lines + [f"wrote {path}"]), flush=True)
    return path


def backend_name() -> str:
    import jax
    return jax.default_backend()


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
    """FLOPs of one example's forward pass: 2 x the multiply-adds of its matrix products and
    convolutions (:func:`jaxpr_matmul_flops`), a scan's body counted once per step. Counted
    from the program, not from XLA's cost analysis of the compiled model, which counts a while
    loop's body once (a recurrent model's one character, not its sequence) and, on a GPU, no
    convolution at all (they compile to library calls)."""
    import jax

    # Shapes only: tracing needs no parameter values (nothing is compiled or run).
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((64,) + tuple(model.example_shape), model.input_dtype)
    return jaxpr_matmul_flops(jax.make_jaxpr(model.apply)(params, x).jaxpr) / 64


def _sub_jaxprs(params):
    """The jaxprs a higher-order primitive holds in its params (closed or open)."""
    for v in params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            inner = getattr(j, "jaxpr", j)
            if hasattr(inner, "eqns"):
                yield inner


def jaxpr_matmul_flops(jaxpr) -> float:
    """2 x the multiply-adds of every dot_general and conv_general_dilated in `jaxpr`, through
    nested calls; a scan's body times its length, a cond's costliest branch. Elementwise work
    is not counted."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name, p = eqn.primitive.name, eqn.params
        out = math.prod(eqn.outvars[0].aval.shape) if eqn.outvars else 0
        if name == "dot_general":
            (lhs_c, _), _ = p["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * out * math.prod(lhs[i] for i in lhs_c)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            spec = p["dimension_numbers"].rhs_spec   # (out features, in features, spatial...)
            total += 2.0 * out * rhs[spec[1]] * math.prod(rhs[i] for i in spec[2:])
        elif name == "scan":
            total += p["length"] * jaxpr_matmul_flops(p["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(jaxpr_matmul_flops(b.jaxpr) for b in p["branches"])
        else:
            total += sum(jaxpr_matmul_flops(j) for j in _sub_jaxprs(p))
    return total


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


class SteppedRun:
    """One experiment stepped round by round as the run loop does, each of a round's host parts
    timed: ``online`` (the participation's online sets, when the run tracks them), ``plan``
    (round t+1's plan), ``ship`` (its data to the device), ``wait`` (round t's metrics back)
    and ``count`` (the host's count of round t), and ``round`` (all of it). ``extras`` names
    per-round values a subclass appends itself (:meth:`step` returns round t's metrics and
    count)."""

    PARTS = ("online", "plan", "ship", "count", "wait")

    def __init__(self, exp, extras=()):
        import jax
        self.exp, self.keys = exp, exp.keys()
        self.state, _ = exp.round_fn(exp.initial_state(), exp.round_data(0), self.keys)
        jax.block_until_ready(self.state)   # compiles
        exp.count_round(0)
        self.pending = exp.round_data(1)
        self.parts = {k: [] for k in self.PARTS + ("round", "trained_examples") + tuple(extras)}

    def step(self, t: int):
        """Round t (its data already on the device), round t+1's host work meanwhile:
        (round t's metrics on the host, its count)."""
        from deltafl_jax.engine.mesh import tree_to_host
        exp, clock = self.exp, time.perf_counter
        t0 = clock()
        self.state, metrics = exp.round_fn(self.state, self.pending, self.keys)
        t1 = clock()
        if exp.participation is not None:
            exp.participation.online(t + 1)
        t2 = clock()
        plan = exp.round_plan(t + 1)
        t3 = clock()
        self.pending = exp.program.store.round_data(plan)
        t4 = clock()
        metrics = tree_to_host(metrics)
        t5 = clock()
        counted = exp.count_round(t)
        t6 = clock()
        for k, v in (("online", t2 - t1), ("plan", t3 - t2), ("ship", t4 - t3),
                     ("count", t6 - t5), ("wait", t5 - t4), ("round", t6 - t0),
                     ("trained_examples", int(metrics["train_real_examples"]))):
            self.parts[k].append(v)
        return metrics, counted

    def host_s(self, parts=("online", "plan", "ship", "count")) -> float:
        """The median over rounds of the host's parts of a round."""
        p = self.parts
        return median([sum(p[k][i] for k in parts) for i in range(len(p["round"]))])
