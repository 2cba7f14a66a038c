r"""The engine against pfl-research on pfl-research's own CIFAR-10 benchmark, round by round.

    python -m bench.peer_pfl --pfl_python=.venv-pfl/bin/python [--rounds=3] [--warmup=1]
        [--engines=default,devices=1,devices=2] [--out=bench/results/peer_pfl_cpu.json]

The configuration is pfl-research's ``benchmarks/image_classification/configs/baseline.yaml``
(CIFAR-10 IID, ``simple_cnn``, FedAvg): 1000 users of 50 images (the 50,000 CIFAR-10 training
images, ``mean_datapoints_per_user: 50`` constant), cohort 50, one local epoch of batch 10 at
local learning rate 0.1, central SGD at learning rate 1, users weighted equally. The images are
random and CIFAR-shaped (32 x 32 x 3, 10 classes): a round's work does not depend on the
pixels. Neither side has dropout (the engine's local step draws no masks).

Sides, each a process of its own that runs one round per request (``peer_common.serve``):

- ``pfl``: ``bench/peer_pfl_worker.py`` in the python given by ``--pfl_python`` (a venv with
  ``pfl`` and PyTorch; this repository's venv needs neither), pfl's own simulation
  (``FederatedAveraging.run`` over a ``SimulatedBackend``; see that file);
- ``engine_<flags>``: this engine through :func:`deltafl_jax.build_experiment`, configured as
  the command line would be by ``--model=pfl_cnn --algorithm=fedavg --clients_per_round=50
  --batch_size=10 --learning_rate=0.1 --local_epochs=1`` plus each entry of ``--engines``
  (``default``: no placement flag, so, as the command line does on a CPU, one host device per
  core; ``devices=1``; ``devices=2``; several flags joined by ``+``, e.g.
  ``devices=2+clients_per_step=2``; ``xla=--flag=v,--flag2=w`` adds XLA flags to that side's
  process). A process's host devices are set in its XLA_FLAGS before
  JAX starts (``--xla_force_host_platform_device_count``), as the command line sets them. A
  round is timed from the host's round plan (``round_data``) to the new model on the host.

Rounds alternate: in round t every side runs its round t, in an order that rotates every round
so no side always runs right after another; ``os.getloadavg()`` is recorded around each. The
figure per side is the median of ``--rounds`` rounds after ``--warmup`` (compilation; pfl's
round 0 also evaluates its cohort before and after training, which later rounds do not).
``speedup_vs_pfl`` divides those medians; ``speedup_vs_pfl_paired`` is the median over the
timed rounds t of pfl's round t over the engine's round t, two rounds run one after the
other: the 2-core machine's speed shifts by up to 25% between spells of a few rounds, and one
side's median can fall in one spell and the other's in another.

Work per round, counted on both sides: the FLOPs of one training example's forward and
backward pass times the examples trained in the round (2500). pfl's count is PyTorch's own
``FlopCounterMode`` on a training step; the engine's are the matrix products and convolutions
of the jaxpr of the loss's gradient (:func:`bench.common.jaxpr_matmul_flops`), once for the
network as written with XLA's VALID convolutions (the same network: it must equal pfl's count;
the script exits 2 after writing the JSON when they differ by more than 1%) and once as the
engine's program writes it (with ``--conv_impl=im2col_wgrad`` 6% more than the network's: the
input gradients, full convolutions, count their zero border, and the first layer's is in the
program, though XLA drops it; with ``--conv_impl=winograd`` about half). GFLOP/s is the
network's FLOPs per round over s/round; the fraction of the GEMM peak divides it by the
fastest float32 GEMM measured in this run (numpy, jax and torch, 2048 x 2048).

``--profile_repeats=N`` times the parts of one local step of ``pfl_cnn`` (each a jitted loop
of 5 steps, since XLA:CPU's kernels differ inside a loop; the minimum and median of N calls in
wall and in CPU milliseconds, the parts interleaved) with the convolutions of ``--conv_impl=im2col_wgrad`` and
``winograd``; ``--profile_only`` times only those.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("pfl_python", None, "python of a venv holding pfl and torch (empty: time "
                    "the engine only)")
flags.DEFINE_list("pfl_threads", ["0"], "one pfl side per entry, with torch on that many "
                  "threads (0: torch's default, one per core)")
flags.DEFINE_list("engines", ["default", "devices=1", "devices=2"],
                  "engine configurations: 'default' or flag=value joined by '+'")
flags.DEFINE_integer("rounds", 3, "timed rounds (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed rounds first (compilation)")
flags.DEFINE_integer("num_clients", 1000, "users in the population")
flags.DEFINE_integer("client_size", 50, "images per user")
flags.DEFINE_integer("cohort", 50, "users trained per round")
flags.DEFINE_integer("batch_size", 10, "local minibatch size")
flags.DEFINE_float("learning_rate", 0.1, "local learning rate")
flags.DEFINE_integer("side", 32, "image side (32: CIFAR)")
flags.DEFINE_integer("gemm_n", 2048, "matrix size of the GEMM-peak measurements")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/peer_pfl_<backend>.json)")
flags.DEFINE_integer("profile_repeats", 0, "time the pieces of one local step of pfl_cnn this "
                     "many times each (median; 0: no profile)")
flags.DEFINE_bool("profile_only", False, "time only the pieces of a local step "
                  "(--profile_repeats calls each), no rounds")
flags.DEFINE_enum("role", "bench", ["bench", "engine"], "internal: 'engine' is one engine side")
flags.DEFINE_string("engine_flags", "", "internal: the engine side's flags")
FLAGS = flags.FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHANNELS, CLASSES, SEED = 3, 10, 1
FLOP_TOLERANCE = 0.01   # the two sides' counts of the same network's FLOPs
XLA_ENTRY = "xla"       # --engines=xla=--flag=v,--flag2=w: XLA flags of that side's process


def engine_settings(entry: str) -> dict:
    """'devices=2+clients_per_step=2' -> {'devices': 2, 'clients_per_step': 2}; 'default' ->
    {}."""
    out = {}
    for part in ([] if entry in ("", "default") else entry.split("+")):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise app.UsageError(f"--engines: {part!r} is not flag=value")
        for cast in (int, float):
            try:
                out[name] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[name] = {"true": True, "false": False}.get(value, value)
    return out


def user_flags(settings: dict) -> str:
    """The command line that configures the same engine run."""
    base = {"model": "pfl_cnn", "algorithm": "fedavg", "clients_per_round": FLAGS.cohort,
            "batch_size": FLAGS.batch_size, "learning_rate": FLAGS.learning_rate,
            "local_epochs": 1}
    return " ".join(f"--{k}={v}" for k, v in {**base, **settings}.items())


def cifar_like_dataset():
    """`--num_clients` clients of `--client_size` random side x side x 3 images, 10 classes
    (bench.common.cifar_like_dataset, seed 0)."""
    from bench.common import cifar_like_dataset as generate
    return generate(FLAGS.num_clients, FLAGS.client_size, FLAGS.side, CHANNELS, CLASSES)


def matmul_flops_list(jaxpr) -> list:
    """The FLOPs of each matrix product and convolution of a forward jaxpr, in order."""
    from bench.common import jaxpr_matmul_flops
    out = []
    for eqn in jaxpr.eqns:
        one = type(jaxpr)(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, [eqn])
        flops = jaxpr_matmul_flops(one)
        if flops:
            out.append(flops)
    return out


def network_train_flops(model, batch: int) -> float:
    """FLOPs of one training example's forward and backward pass, counted as PyTorch's
    ``FlopCounterMode`` counts them: each matrix product or convolution of the forward pass
    (the jaxpr of the network with XLA's convolutions) once forward, once for its weight
    gradient and once for its input gradient, except the first layer's input gradient, which
    no SGD step computes."""
    import jax
    import jax.numpy as jnp

    params = model.init(jax.random.key(0))
    x = jnp.zeros((batch,) + tuple(model.example_shape), jnp.float32)
    layers = matmul_flops_list(jax.make_jaxpr(model.apply)(params, x).jaxpr)
    return (3 * sum(layers) - layers[0]) / batch


def executed_train_flops(model, batch: int) -> float:
    """Matrix-product and convolution FLOPs of the mean cross-entropy's gradient (parameters
    only, as an SGD step) as the model computes it (every product counted whole, the zeros of a
    padded convolution included), per example."""
    import jax
    import jax.numpy as jnp

    from bench.common import jaxpr_matmul_flops

    params = model.init(jax.random.key(0))
    x = jnp.zeros((batch,) + tuple(model.example_shape), jnp.float32)
    y = jnp.zeros((batch,), jnp.int32)

    def loss(p):
        logits = model.apply(p, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    return jaxpr_matmul_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr) / batch


def engine_side() -> None:
    """One engine configuration, serving rounds on stdin (peer_common.serve)."""
    import jax

    from bench.common import gemm_peak_gflops
    from bench.peer_common import serve
    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment
    from deltafl_jax.models import ModelOptions, build_model

    settings = engine_settings(FLAGS.engine_flags)
    settings.pop(XLA_ENTRY, None)   # in this process's XLA_FLAGS already (start_sides)
    data = cifar_like_dataset()
    cfg = ExperimentConfig(
        data=DataConfig("npz"), model="pfl_cnn", algorithm="fedavg", seeds=(SEED,),
        num_rounds=10000, clients_per_round=FLAGS.cohort, batch_size=FLAGS.batch_size,
        learning_rate=FLAGS.learning_rate, local_epochs=1, output_dir=None, save_models=False,
        verbose=False, **settings)
    exp = build_experiment(cfg, data)
    network = build_model("pfl_cnn", data, ModelOptions(conv_impl="xla"))
    extra = {"placement": vars(exp.placement), "jax_devices": jax.local_device_count(),
             "parameters": int(sum(np.size(a) for a in
                                   jax.tree.leaves(network.init(jax.random.key(0))))),
             "network_flops_per_example": network_train_flops(network, FLAGS.batch_size),
             "engine_flops_per_example": executed_train_flops(exp.model, FLAGS.batch_size),
             "jax_gemm_gflops": gemm_peak_gflops(FLAGS.gemm_n)}
    state, keys = exp.initial_state(), exp.keys()
    for _, t, _ in serve(("jax", "jaxlib", "flax", "numpy"), extra):
        t0, c0 = time.perf_counter(), time.process_time()
        rd = exp.round_data(t)
        t1 = time.perf_counter()
        state, met = exp.round_fn(state, rd, keys)
        met = jax.device_get(met)
        dt = time.perf_counter() - t0
        trained = int(np.sum(met["train_real_examples"]))
        print("DONE " + json.dumps({"round": t, "seconds": dt, "host_plan_s": t1 - t0,
                                    "cpu_s": time.process_time() - c0,
                                    "real_examples": trained,
                                    "padded_examples": int(np.sum(met["train_padded_examples"])),
                                    "eval_examples": int(np.sum(met["eval_real_examples"]))}),
              flush=True)


PROFILE_STEPS = 5           # steps per timed call: XLA:CPU's kernels differ inside a loop
PROFILE_IMPLS = ("im2col_wgrad", "winograd")


def scanned(step, carry, xs):
    """(jit of a lax.scan of `step(carry, x) -> carry` over xs' leading axis, its carry)."""
    from jax import lax
    import jax
    return jax.jit(lambda c: lax.scan(lambda c, x: (step(c, x), None), c, xs)[0]), (carry,)


def _sgd(loss):
    import jax
    return lambda p, x: jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, x))


def network_pieces(impl: str, xs, ys, params) -> dict:
    """The whole local step of pfl_cnn with convolutions `impl` and its forward pass, and each
    convolution alone (its bias and ReLU included) with the gradients a step needs: conv1 its
    weight gradient, conv2 its weight and input gradients."""
    import jax
    import jax.numpy as jnp

    from deltafl_jax.models.conv import conv_winograd
    from deltafl_jax.models.image import PflCNN
    from deltafl_jax.models.image_conv import conv_valid

    net = PflCNN(CLASSES, conv_impl=impl)

    def loss(p, xy):
        logp = jax.nn.log_softmax(net.apply(p, xy[0]))
        return -jnp.mean(jnp.take_along_axis(logp, xy[1][:, None], 1))

    def block(a, w, b):
        return jnp.sum(jnp.square(jax.nn.relu(conv_valid(a, w, impl) + b)))

    def block_tile2(a, w, b):
        return jnp.sum(jnp.square(jax.nn.relu(conv_winograd(a, w, ((0, 0), (0, 0)), 2) + b)))

    pp = params["params"]
    h1 = jax.nn.relu(conv_valid(xs[0], pp["conv1_kernel"], "xla"))
    c1 = (pp["conv1_kernel"], pp["conv1_bias"])
    c2 = (pp["conv2_kernel"], pp["conv2_bias"])
    sub = lambda a, g: jax.tree.map(lambda u, v: u - 1e-6 * v, a, g)
    out = {} if impl != "winograd" else {
        # the same block by F(2x2, 3x3), the library's other tile (conv.WINOGRAD_TILES)
        "conv2_forward_both_grads_winograd_tile2": scanned(
            lambda c, _: sub(c, jax.grad(block_tile2, (0, 1, 2))(*c)), (h1,) + c2, xs)}
    return {
        **out,
        f"sgd_step_{impl}": scanned(_sgd(loss), params, (xs, ys)),
        f"forward_{impl}": scanned(lambda p, xy: jax.tree.map(
            lambda a: a + 0.0 * jnp.mean(net.apply(p, xy[0])), p), params, (xs, ys)),
        f"conv1_forward_weight_grad_{impl}": scanned(
            lambda c, x: sub(c, jax.grad(block, (1, 2))(x, *c)), c1, xs),
        f"conv2_forward_{impl}": scanned(
            lambda c, _: (c[0] + 0.0 * block(*c), c[1], c[2]), (h1,) + c2, xs),
        f"conv2_forward_weight_grad_{impl}": scanned(
            lambda c, _: (c[0],) + sub(c[1:], jax.grad(block, (1, 2))(*c)), (h1,) + c2, xs),
        f"conv2_forward_both_grads_{impl}": scanned(
            lambda c, _: sub(c, jax.grad(block, (0, 1, 2))(*c)), (h1,) + c2, xs),
    }


def head_pieces(side: int, xs, ys, params) -> dict:
    """The parts of a step after the convolutions: the 2 x 2 max-pool and its gradient; the
    dense layers, the softmax cross-entropy and their gradients (the pool's output's too);
    the SGD update of every parameter."""
    import jax
    import jax.numpy as jnp

    from deltafl_jax.models.conv import max_pool_2x2

    batch, hw = xs.shape[1], side - 4
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((batch, hw, hw, 64)), jnp.float32)
    pp = params["params"]
    dense = {k: pp[k] for k in ("dense1", "dense2")}

    def head(d, h, y):
        z = jax.nn.relu(h @ d["dense1"]["kernel"] + d["dense1"]["bias"])
        z = z @ d["dense2"]["kernel"] + d["dense2"]["bias"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], 1))

    h = max_pool_2x2(a).reshape(batch, -1)
    grads = jax.tree.map(lambda v: 1e-3 * v, params)
    return {
        "pool_forward_and_grad": scanned(lambda c, _: c - 1e-6 * jax.grad(
            lambda v: jnp.sum(jnp.square(max_pool_2x2(v))))(c), a, xs),
        "dense_and_loss_forward_and_grads": scanned(lambda c, y: (
            lambda g: (jax.tree.map(lambda u, v: u - 0.1 * v, c[0], g[0]), c[1] - g[1]))(
            jax.grad(head, (0, 1))(c[0], c[1], y)), (dense, h), ys),
        "sgd_update_all_parameters": scanned(
            lambda p, _: jax.tree.map(lambda u, g: u - 0.1 * g, p, grads), params, xs),
    }


def step_pieces(side: int, batch: int) -> dict:
    """{name: (jitted function, arguments)}: the pieces of pfl_cnn's local SGD step on `batch`
    images, each a loop of PROFILE_STEPS steps, one client, one device."""
    import jax
    import jax.numpy as jnp

    from deltafl_jax.models.image import PflCNN

    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((PROFILE_STEPS, batch, side, side, CHANNELS)),
                     jnp.float32)
    ys = jnp.asarray(rng.integers(0, CLASSES, (PROFILE_STEPS, batch)), jnp.int32)
    params = PflCNN(CLASSES).init(jax.random.key(0), xs[0])
    out = head_pieces(side, xs, ys, params)
    for impl in PROFILE_IMPLS:
        out.update(network_pieces(impl, xs, ys, params))
    return out


def profile_step(side: int, batch: int, repeats: int) -> dict:
    """Milliseconds per step of each piece (:func:`step_pieces`), outside the engine's lanes:
    {name: {"min": ..., "median": ..., "cpu_min": ..., "cpu_median": ...}} over `repeats`
    calls, the pieces interleaved; "min" and "median" are wall time, "cpu_" the process's CPU
    time (every thread's), which moves less with other work on a shared machine."""
    import jax

    pieces = step_pieces(side, batch)
    for fn, args in pieces.values():
        jax.block_until_ready(fn(*args))
    wall = {name: [] for name in pieces}
    cpu = {name: [] for name in pieces}
    for _ in range(repeats):
        for name, (fn, args) in pieces.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            wall[name].append(1e3 * (time.perf_counter() - t0) / PROFILE_STEPS)
            cpu[name].append(1e3 * (time.process_time() - c0) / PROFILE_STEPS)
    return {name: {"min": float(np.min(wall[name])), "median": float(np.median(wall[name])),
                   "cpu_min": float(np.min(cpu[name])), "cpu_median": float(np.median(cpu[name]))}
            for name in pieces}


def start_sides() -> dict:
    """The pfl side (with --pfl_python) and one engine side per --engines entry."""
    from bench import peer_common
    from deltafl_jax.engine.mesh import HOST_DEVICES_FLAG, default_host_devices

    sides = {}
    if FLAGS.pfl_python:
        if not os.path.exists(FLAGS.pfl_python):
            raise app.UsageError(f"--pfl_python={FLAGS.pfl_python} does not exist")
        for threads in (int(n) for n in FLAGS.pfl_threads):
            sides["pfl" + (f"_threads{threads}" if threads else "")] = peer_common.Side(
                [FLAGS.pfl_python, os.path.join(HERE, "peer_pfl_worker.py"),
                 f"--num_clients={FLAGS.num_clients}", f"--client_size={FLAGS.client_size}",
                 f"--cohort={FLAGS.cohort}", f"--batch_size={FLAGS.batch_size}",
                 f"--learning_rate={FLAGS.learning_rate}", f"--side={FLAGS.side}",
                 f"--torch_threads={threads}"])
    common = [f"--{k}={getattr(FLAGS, k)}" for k in
              ("num_clients", "client_size", "cohort", "batch_size", "learning_rate", "side",
               "gemm_n")]
    for entry in FLAGS.engines:
        settings = engine_settings(entry)
        devices = settings.get("devices", default_host_devices())
        env = dict(os.environ)   # this side's host devices, whatever the caller's flags say
        kept = [f for f in env.get("XLA_FLAGS", "").split()
                if not f.startswith(HOST_DEVICES_FLAG)]
        extra = [f for f in str(settings.get(XLA_ENTRY, "")).split(",") if f]
        env["XLA_FLAGS"] = " ".join(kept + extra + [f"{HOST_DEVICES_FLAG}={int(devices)}"])
        sides[f"engine_{entry}"] = peer_common.Side(
            [sys.executable, "-m", "bench.peer_pfl", "--role=engine", f"--engine_flags={entry}",
             *common], env, cwd=REPO)
    return sides


def numpy_gemm_gflops(n: int, repeats: int = 5) -> float:
    a = np.ones((n, n), np.float32)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def summarise(sides: dict, times: dict, peaks: dict) -> dict:
    """s/round, work, GFLOP/s and the share of the GEMM peak per side, and the ratios."""
    peak = max(peaks.values())
    med = {k: float(np.median(v)) for k, v in times.items()}
    rows = {}
    for name, side in sides.items():
        timed = side.rounds[FLAGS.warmup:]
        examples = float(np.mean([r["real_examples"] for r in timed]))
        per_example = side.info.get("train_flops_per_example",
                                    side.info.get("network_flops_per_example"))
        gflop = per_example * examples / 1e9
        rows[name] = {"s_per_round": med[name], "round_times_s": times[name],
                      "train_examples_per_round": examples,
                      "network_gflop_per_round": gflop, "gflops": gflop / med[name],
                      "fraction_of_gemm_peak": gflop / med[name] / peak,
                      "info": side.info}
        if "engine_flops_per_example" in side.info:
            rows[name]["engine_executed_gflop_per_round"] = (
                side.info["engine_flops_per_example"] * examples / 1e9)
            rows[name]["host_plan_s_median"] = float(np.median([r["host_plan_s"]
                                                                for r in timed]))
        if all("cpu_s" in r for r in timed):   # the process's CPU seconds over its wall time
            rows[name]["cpu_s_median"] = float(np.median([r["cpu_s"] for r in timed]))
            rows[name]["cores_busy_median"] = float(np.median([r["cpu_s"] / r["seconds"]
                                                               for r in timed]))
    pfl = [k for k in med if k.startswith("pfl")]
    pairs = [(p, k) for p in pfl for k in med if k.startswith("engine")]
    ratios = {f"{p}_over_{k}": med[p] / med[k] for p, k in pairs}
    paired = {f"{p}_over_{k}": float(np.median(np.divide(times[p], times[k])))
              for p, k in pairs}
    return {"sides": rows, "s_per_round": med, "speedup_vs_pfl": ratios,
            "speedup_vs_pfl_paired": paired, "gemm_peak_gflops": peak}


def flop_check(rows: dict) -> list:
    """The sides' counts of the network's FLOPs per example must agree."""
    counts = {k: r["info"].get("train_flops_per_example", r["info"].get(
        "network_flops_per_example")) for k, r in rows.items()}
    lo, hi = min(counts.values()), max(counts.values())
    if hi > lo * (1 + FLOP_TOLERANCE):
        return [f"the sides count different FLOPs per training example: {counts}"]
    return []


def bench() -> None:
    from bench import peer_common
    from bench.common import backend_name, emit, gemm_peak_gflops, machine

    if FLAGS.rounds < 1 or FLAGS.warmup < 0:
        raise app.UsageError("--rounds must be >= 1 and --warmup >= 0")
    for entry in FLAGS.engines:
        engine_settings(entry)
    result = {"benchmark": "peer_pfl", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
              "loadavg_start": os.getloadavg(),
              "configuration": {"num_clients": FLAGS.num_clients,
                                "client_size": FLAGS.client_size, "cohort": FLAGS.cohort,
                                "local_epochs": 1, "batch_size": FLAGS.batch_size,
                                "local_learning_rate": FLAGS.learning_rate,
                                "central_learning_rate": 1.0,
                                "image": [FLAGS.side, FLAGS.side, CHANNELS],
                                "classes": CLASSES, "dropout": False,
                                "rounds_timed": FLAGS.rounds, "warmup": FLAGS.warmup},
              "engine_command_lines": {f"engine_{e}": user_flags(engine_settings(e))
                                       for e in FLAGS.engines}}
    sides = start_sides()
    try:
        times, loads = peer_common.alternate(sides, FLAGS.warmup, FLAGS.rounds)
    finally:
        for side in sides.values():
            side.close()
    peaks = {"numpy": numpy_gemm_gflops(FLAGS.gemm_n), "jax": gemm_peak_gflops(FLAGS.gemm_n)}
    for name in (k for k in sides if k.startswith("pfl")):
        peaks[f"torch_{name}"] = sides[name].info["torch_gemm_gflops"]
    result.update(summarise(sides, times, peaks))
    result["gemm_gflops"] = peaks
    result["load"] = loads
    result["load1_mean"] = float(np.mean([r["load1_before"] for r in loads]))
    if FLAGS.profile_repeats:
        result["profile_ms"] = profile_step(FLAGS.side, FLAGS.batch_size, FLAGS.profile_repeats)
        for name in (k for k in sides if k.startswith("pfl")):
            result["profile_ms"][f"torch_sgd_step_{name}"] = 1e3 * sides[name].info[
                "torch_step_s"]
    result["loadavg_end"] = os.getloadavg()
    emit(result, FLAGS.out, name=f"peer_pfl_{backend_name()}")
    bad = flop_check(result["sides"])
    if bad:
        print("; ".join(bad), file=sys.stderr)
        sys.exit(2)


def profile_only() -> None:
    from bench.common import backend_name, emit, gemm_peak_gflops, machine

    result = {"benchmark": "peer_pfl_profile", "machine": machine(),
              "date": time.strftime("%Y-%m-%d"), "loadavg_start": os.getloadavg(),
              "steps_per_call": PROFILE_STEPS, "repeats": FLAGS.profile_repeats,
              "batch_size": FLAGS.batch_size,
              "profile_ms": profile_step(FLAGS.side, FLAGS.batch_size,
                                         max(FLAGS.profile_repeats, 1)),
              "gemm_gflops": {"jax": gemm_peak_gflops(FLAGS.gemm_n),
                              "numpy": numpy_gemm_gflops(FLAGS.gemm_n)},
              "loadavg_end": os.getloadavg()}
    emit(result, FLAGS.out, name=f"peer_pfl_profile_{backend_name()}")


def main(argv):
    del argv
    if FLAGS.profile_only:
        profile_only()
    elif FLAGS.role == "engine":
        engine_side()
    else:
        bench()


if __name__ == "__main__":
    app.run(main)
