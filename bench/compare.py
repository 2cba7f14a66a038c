r"""One Delta-FL round three ways, interleaved in one process: the engine, a per-client PyTorch
loop, and a per-client JAX loop.

    python -m bench.compare --model=cnn --json [--out=bench/results/compare_cnn_cpu.json]

The round (theta = 0.5, exact filter) samples m = 100 of 865 FEMNIST-like clients (median 179,
min 101, max 447 images of synthetic pixels), computes every sampled client's loss on its whole
data, keeps the tail, runs one epoch of SGD (batch 16, or 10 for the linear model) on each kept
client and averages the kept models. The three implementations are timed A B C A B C ... on the
same sampled clients, so machine noise hits all of them alike:

- ``engine``: deltafl_jax's jitted round at its default setting for the backend;
- ``torch``: the way a reference implementation is written (the authors' code is PyTorch): a
  Python loop over the sampled clients, F_k under no_grad, then for each kept client a copy of
  the global model and a loop of minibatch SGD steps, then the weighted average;
- ``jax_loop``: a per-client loop in the FedJAX style: plain Flax layers, a jitted SGD step on
  fixed-size masked batches and a jitted masked evaluation, driven from Python.

``--methods`` picks which of the three to time; the PyTorch loop needs the ``bench`` extra
(without torch, asking for it is one line on stderr and exit code 2). Each time is the median
over ``--rounds`` rounds after ``--warmup`` rounds. The JSON also holds
the engine's padded/real example ratio, trained/kept ratio, compile time and peak memory.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import numpy as np
from absl import app, flags

flags.DEFINE_enum("model", "cnn", ["cnn", "linear"], "model shape")
flags.DEFINE_integer("clients", 100, "m, sampled clients per round")
flags.DEFINE_integer("num_clients", 865, "clients in the population")
flags.DEFINE_integer("rounds", 5, "timed rounds (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed rounds first (compilation)")
flags.DEFINE_float("theta", 0.5, "conformity level")
flags.DEFINE_list("methods", ["engine", "torch", "jax_loop"], "what to time")
flags.DEFINE_integer("clients_per_step", None, "engine lanes (default: the backend's)")
flags.DEFINE_string("torch_device", "cpu", "where the PyTorch loop runs: cpu, or cuda for the "
                    "GPU column (each round copies its clients' data there, inside the clock)")
flags.DEFINE_bool("json", False, "also print the whole JSON on stdout")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/compare_<model>_<backend>.json)")
FLAGS = flags.FLAGS

LR = 0.05
SEED = 1


def batch_size(model):
    return 16 if model == "cnn" else 10


def tail_weights_np(F, n, theta):
    """Exact superquantile weights (greedy from the largest loss), as a reference loop would."""
    caps = n / (theta * n.sum())
    pi = np.zeros_like(F)
    mass = 0.0
    for k in np.argsort(-F, kind="stable"):
        take = min(caps[k], max(0.0, 1.0 - mass))
        pi[k], mass = take, mass + take
    return pi


# ----------------------------------------------------------------------------- torch loop


def make_torch(model_name, num_classes=62):
    import torch
    from torch import nn

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    if model_name == "cnn":
        net = nn.Sequential(
            nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(7 * 7 * 64, num_classes))
    else:
        net = nn.Linear(784, num_classes)
    return net.to(FLAGS.torch_device)


def torch_round(net, data, clients, theta, rng):
    import torch
    import torch.nn.functional as F

    B = batch_size(FLAGS.model)
    global_state = {k: v.clone() for k, v in net.state_dict().items()}
    xs, ys = [], []
    dev = FLAGS.torch_device
    for k in clients:
        x, y = data.train.client(int(k))
        xs.append(torch.from_numpy(x.reshape(len(x), -1).astype(np.float32) / 255.0).to(dev))
        ys.append(torch.from_numpy(y.astype(np.int64)).to(dev))
    losses = []
    with torch.no_grad():
        for x, y in zip(xs, ys):
            losses.append(float(F.cross_entropy(net(x), y)))
    n = np.array([len(y) for y in ys], np.float64)
    pi = tail_weights_np(np.array(losses), n, theta)
    acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
    total, trained = 0.0, 0
    for slot in np.nonzero(pi > 0)[0]:
        net.load_state_dict(global_state)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        x, y = xs[slot], ys[slot]
        order = torch.from_numpy(rng.permutation(len(y))).to(FLAGS.torch_device)
        for s in range(0, len(y), B):
            idx = order[s:s + B]
            opt.zero_grad()
            F.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
        trained += len(y)
        with torch.no_grad():
            for k, v in net.state_dict().items():
                acc[k] += pi[slot] * (v - global_state[k])
        total += pi[slot]
    net.load_state_dict({k: global_state[k] + acc[k] / total for k in global_state})
    if FLAGS.torch_device.startswith("cuda"):
        torch.cuda.synchronize()   # the round ends when the GPU's queued work does
    return int(np.sum(pi > 0)), trained


# ----------------------------------------------------------------------------- jax loop


def make_jax_loop(model_name, num_classes=62):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x.reshape(x.shape[0], 28, 28, 1)
            x = nn.max_pool(nn.relu(nn.Conv(32, (5, 5), padding="SAME")(x)), (2, 2), (2, 2))
            x = nn.max_pool(nn.relu(nn.Conv(64, (5, 5), padding="SAME")(x)), (2, 2), (2, 2))
            return nn.Dense(num_classes)(x.reshape(x.shape[0], -1))

    module = CNN() if model_name == "cnn" else nn.Dense(num_classes)
    params = module.init(jax.random.key(0), jnp.zeros((1, 784)))["params"]

    def masked_loss(p, x, y, mask):
        logits = module.apply({"params": p}, x.astype(jnp.float32) / 255.0)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    @jax.jit
    def step(p, x, y, mask):
        g = jax.grad(masked_loss)(p, x, y, mask)
        return jax.tree.map(lambda a, b: a - LR * b, p, g)

    @jax.jit
    def loss_sum(p, x, y, mask):
        return masked_loss(p, x, y, mask) * jnp.sum(mask)

    return params, step, loss_sum


def jax_loop_round(state, data, clients, theta, rng):
    import jax

    params, step, loss_sum = state["params"], state["step"], state["loss_sum"]
    B = batch_size(FLAGS.model)
    E = 256  # evaluation batch, padded and masked (FedJAX pads batches to one shape)
    xs, ys = [], []
    for k in clients:
        x, y = data.train.client(int(k))
        xs.append(x.reshape(len(x), -1))
        ys.append(y)

    def padded(x, y, idx, size):
        xb = np.zeros((size, x.shape[1]), x.dtype)
        yb = np.zeros((size,), np.int32)
        xb[:len(idx)], yb[:len(idx)] = x[idx], y[idx]
        mask = np.zeros((size,), np.float32)
        mask[:len(idx)] = 1
        return xb, yb, mask

    losses = []
    for x, y in zip(xs, ys):
        total = 0.0
        for s in range(0, len(y), E):
            total += float(loss_sum(params, *padded(x, y, np.arange(s, min(s + E, len(y))), E)))
        losses.append(total / len(y))
    n = np.array([len(y) for y in ys], np.float64)
    pi = tail_weights_np(np.array(losses), n, theta)
    acc = jax.tree.map(lambda a: np.zeros(a.shape, np.float64), params)
    tot, trained = 0.0, 0
    for slot in np.nonzero(pi > 0)[0]:
        x, y = xs[slot], ys[slot]
        order = rng.permutation(len(y))
        p = params
        for s in range(0, len(y), B):
            p = step(p, *padded(x, y, order[s:s + B], B))
        trained += len(y)
        acc = jax.tree.map(lambda a, w, w0: a + pi[slot] * (np.asarray(w) - np.asarray(w0)),
                           acc, p, params)
        tot += pi[slot]
    state["params"] = jax.tree.map(lambda w0, a: w0 + (a / tot).astype(np.float32), params, acc)
    jax.block_until_ready(state["params"])
    return int(np.sum(pi > 0)), trained


# ----------------------------------------------------------------------------- main


def check_methods(methods) -> None:
    """One line on stderr and exit code 2 for a method that is unknown or cannot run here."""
    bad = [m for m in methods if m not in ("engine", "torch", "jax_loop")]
    message = None
    if bad or not methods:
        message = (f"--methods must list engine, torch and/or jax_loop; got "
                   f"{','.join(methods) or 'nothing'}")
    elif "torch" in methods and importlib.util.find_spec("torch") is None:
        message = ("torch is not installed: pip install -e '.[bench]' for the PyTorch loop, "
                   "or pass --methods=engine,jax_loop")
    if message:
        print(f"compare: error: {message}", file=sys.stderr)
        sys.exit(2)


def experiment_config():
    """The engine's configuration of the compared round (the flags, at the fixed LR and SEED)."""
    from deltafl_jax import DataConfig, ExperimentConfig

    return ExperimentConfig(
        data=DataConfig("femnist_like"), model=FLAGS.model, thetas=(FLAGS.theta,),
        seeds=(SEED,), num_rounds=FLAGS.warmup + FLAGS.rounds, clients_per_round=FLAGS.clients,
        batch_size=batch_size(FLAGS.model), learning_rate=LR,
        clients_per_step=FLAGS.clients_per_step, output_dir=None, save_models=False,
        verbose=False)


def engine_timer(data, compile_timer):
    """The engine's experiment, its state (metrics of each round under "mets") and a function
    that runs round t of it, under `compile_timer`."""
    import jax

    from deltafl_jax import build_experiment

    exp = build_experiment(experiment_config(), data)
    eng = {"state": exp.initial_state(), "keys": exp.keys()}

    def engine_round(t):
        with compile_timer:
            eng["state"], met = exp.round_fn(eng["state"], exp.round_data(t), eng["keys"])
            met = jax.device_get(met)
        eng.setdefault("mets", []).append(met)

    return exp, eng, engine_round


def loop_timers(data):
    """Functions that run round t of the PyTorch and the JAX per-client loops, for those of the
    two that --methods names."""
    from deltafl_jax.sampling.plan import sample_clients

    timers = {}
    if "torch" in FLAGS.methods:
        net = make_torch(FLAGS.model)
        rng_t = np.random.default_rng(0)

        def torch_timed(t):
            clients = sample_clients(SEED, t, data.train.num_clients, FLAGS.clients)
            torch_round(net, data, clients, FLAGS.theta, rng_t)

        timers["torch"] = torch_timed
    if "jax_loop" in FLAGS.methods:
        p, s, l = make_jax_loop(FLAGS.model)
        jl = {"params": p, "step": s, "loss_sum": l}
        rng_j = np.random.default_rng(0)

        def jax_timed(t):
            clients = sample_clients(SEED, t, data.train.num_clients, FLAGS.clients)
            jax_loop_round(jl, data, clients, FLAGS.theta, rng_j)

        timers["jax_loop"] = jax_timed
    return timers


def time_rounds(timers):
    """Runs the timers interleaved, round by round, printing each round's times; returns the
    timed rounds' seconds per timer (the warmup rounds are left out)."""
    times = {k: [] for k in timers}
    first = {}
    for t in range(FLAGS.warmup + FLAGS.rounds):
        for name, fn in timers.items():
            t0 = time.perf_counter()
            fn(t)
            dt = time.perf_counter() - t0
            if t < FLAGS.warmup:
                first.setdefault(name, dt)
            else:
                times[name].append(dt)
        print(f"# round {t}: " + ", ".join(f"{k} {v[-1] if v else first[k]:.2f}s"
                                           for k, v in times.items()), flush=True)
    return times


def timing_result(times, med):
    """The JSON's settings, machine and per-method median seconds per round and speedups."""
    import jax

    from bench.common import machine

    return {"model": FLAGS.model, "backend": jax.default_backend(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d"), "loadavg": os.getloadavg(), "theta": FLAGS.theta,
            "m": FLAGS.clients,
            "batch_size": batch_size(FLAGS.model), "rounds_timed": FLAGS.rounds,
            "torch_device": FLAGS.torch_device if "torch" in FLAGS.methods else None,
            "engine_s_per_round": med.get("engine"),
            "torch_loop_s_per_round": med.get("torch"),
            "jax_loop_s_per_round": med.get("jax_loop"),
            "speedup_vs_torch": (med["torch"] / med["engine"]
                                 if "torch" in med and "engine" in med else None),
            "speedup_vs_jax_loop": (med["jax_loop"] / med["engine"]
                                    if "jax_loop" in med and "engine" in med else None),
            "round_times_s": times}


def engine_result(exp, mets, seconds_per_round, compile_s):
    """The engine's padding and work figures over the timed rounds' metrics `mets`."""
    from bench.common import critical_path, forward_flops_per_example, gemm_peak_gflops

    def total(key):
        return float(np.mean([float(np.sum(m[key])) for m in mets]))

    real = total("eval_real_examples") + total("train_real_examples")
    padded = total("eval_padded_examples") + total("train_padded_examples")
    # Work of a round: a forward pass per evaluated example, ~3 (forward + backward) per
    # trained example; the roof is the measured GEMM rate of this machine.
    fwd = forward_flops_per_example(exp.model)
    flops = fwd * (total("eval_real_examples") + 3 * total("train_real_examples"))
    peak = gemm_peak_gflops()
    return {
        "padded_over_real": padded / real,
        "trained_over_kept": total("train_real_examples") / total("kept_examples"),
        "compile_s": compile_s,
        "clients_per_step": exp.lanes,
        "engine_clients_kept_per_round": total("num_selected"),
        "forward_flops_per_example": fwd,
        "round_gflop": flops / 1e9,
        "engine_gflops": flops / 1e9 / seconds_per_round,
        "gemm_peak_gflops": peak,
        "engine_fraction_of_gemm_peak": flops / 1e9 / seconds_per_round / peak,
        "flop_limit_s_per_round": flops / 1e9 / peak,
        "critical_path": critical_path(mets, exp.placement),
    }


def main(argv):
    del argv
    check_methods(FLAGS.methods)
    from bench.common import (CompileTimer, backend_name, emit, femnist_like_dataset, median,
                              peak_rss_mb)

    data = femnist_like_dataset(FLAGS.num_clients, seed=0, flat=FLAGS.model == "linear")
    timers = {}
    compile_timer = CompileTimer()
    if "engine" in FLAGS.methods:
        exp, eng, timers["engine"] = engine_timer(data, compile_timer)
    timers.update(loop_timers(data))

    times = time_rounds(timers)
    med = {k: median(v) for k, v in times.items()}
    result = timing_result(times, med)
    if "engine" in timers:
        result.update(engine_result(exp, eng["mets"][FLAGS.warmup:], med["engine"],
                                    compile_timer.seconds))
    result["peak_rss_mb"] = peak_rss_mb()
    emit(result, FLAGS.out, name=f"compare_{FLAGS.model}_{backend_name()}",
         print_json=FLAGS.json)


if __name__ == "__main__":
    app.run(main)
