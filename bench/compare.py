r"""One Delta-FL round three ways, interleaved in one process: the engine, a per-client PyTorch
loop, and a per-client JAX loop.

    python -m bench.compare --model=cnn|linear|gru|lstm --json [--out=PATH]

The round (theta = 0.5, exact filter) samples m clients, computes every sampled client's loss on
its whole data, keeps the tail, runs one epoch of SGD on each kept client and averages the kept
models. The workloads (:data:`WORKLOADS`):

- ``cnn`` / ``linear``: m = 100 of 865 FEMNIST-like clients (median 179, min 101, max 447
  images of synthetic pixels), batch 16 (the ConvNet of App. C.1.1) or 10 (softmax
  regression), learning rate 0.05;
- ``gru``: ``experiments/shakespeare.flags``' round on m = 100 of 544 Shakespeare-like clients
  (Table 1's sizes: median 1288, min 101, max 66,963 windows of 20 character ids, 53
  classes; :func:`bench.common.shakespeare_like_dataset`), embedding 8, GRU 128, dense to the
  53 classes, batch 16, learning rate 0.1 (delta-fl-long.md App. C.1.3, C.2.2);
- ``lstm``: ``experiments/sent140_lstm.flags``' round on m = 50 of 438 Sent140-like clients
  (median 69, min 51, max 549 tweets of 25 GloVe ids; :func:`bench.common.sent140_like_dataset`),
  the frozen GloVe-50 table, LSTM 50, one logit, sigmoid loss, batch 10, learning rate 2.0
  (App. C.1.2, C.2.2).

``--clients`` and ``--num_clients`` shrink a workload for a CPU, ``--max_client_size`` caps
every client's examples (for tests: Shakespeare's largest client has 66,963 windows). The
three implementations are timed A B C A B C ... on the same sampled clients, so machine noise
hits all of them alike:

- ``engine``: deltafl_jax's jitted round at its default setting for the backend;
- ``torch``: the way a reference implementation is written (the authors' code is PyTorch): a
  Python loop over the sampled clients, F_k under no_grad, then for each kept client a copy of
  the global model and a loop of minibatch SGD steps, then the weighted average. The recurrent
  models are ``torch.nn.GRU`` / ``torch.nn.LSTM`` (batch_first; cuDNN's fused kernels on
  CUDA). Their gate equations are Flax's ``GRUCell`` / ``OptimizedLSTMCell``'s (the GRU's
  reset gate multiplies W_hn h + b_hn on both sides); torch adds a second, redundant bias to
  each gate (b_hr, b_hz for the GRU; b_hh beside b_ih for the LSTM): 256 and 200 more
  parameters, the same function class and the same matrix products;
- ``jax_loop``: a per-client loop in the FedJAX style: plain Flax layers, a jitted SGD step on
  fixed-size masked batches and a jitted masked evaluation, driven from Python.

``--methods`` picks which of the three to time; the PyTorch loop needs the ``bench`` extra
(without torch, asking for it is one line on stderr and exit code 2). Each time is the median
over ``--rounds`` rounds after ``--warmup`` rounds. The JSON also holds
the engine's padded/real example ratio, trained/kept ratio, compile time and peak memory, and
the load average before and after the run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time

import numpy as np
from absl import app, flags

flags.DEFINE_enum("model", "cnn", ["cnn", "linear", "gru", "lstm"], "the workload "
                  "(WORKLOADS: model, clients, batch size, learning rate)")
flags.DEFINE_integer("clients", None, "m, sampled clients per round (default the workload's: "
                     "100, or 50 for lstm)")
flags.DEFINE_integer("num_clients", None, "clients in the population (default the workload's: "
                     "865 FEMNIST-like, 544 Shakespeare-like, 438 Sent140-like)")
flags.DEFINE_integer("max_client_size", None, "cap every client at this many examples (the "
                     "first ones; default: none, Table 1's sizes)")
flags.DEFINE_integer("rounds", 5, "timed rounds (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed rounds first (compilation)")
flags.DEFINE_float("theta", 0.5, "conformity level")
flags.DEFINE_list("methods", ["engine", "torch", "jax_loop"], "what to time")
flags.DEFINE_integer("clients_per_step", None, "engine lanes (default: the backend's)")
flags.DEFINE_string("torch_device", "cpu", "where the PyTorch loop runs: cpu, or cuda for the "
                    "GPU column (each round copies its clients' data there, inside the clock)")
flags.DEFINE_integer("torch_threads", None, "torch.set_num_threads for the PyTorch loop (default "
                     "the machine's cores; 1 keeps a loaded CPU from stalling torch's OpenMP "
                     "threads)")
flags.DEFINE_bool("json", False, "also print the whole JSON on stdout")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/compare_<model>_<backend>.json)")
FLAGS = flags.FLAGS

SEED = 1


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model's round: batch size, learning rate, population and m (the flagfile's for the
    recurrent models), and the engine's name of the synthetic data."""

    batch: int
    lr: float
    population: int
    m: int
    dataset: str
    flagfile: str = ""


WORKLOADS = {
    "cnn": Workload(16, 0.05, 865, 100, "femnist_like"),
    "linear": Workload(10, 0.05, 865, 100, "femnist_like"),
    "gru": Workload(16, 0.1, 544, 100, "shakespeare_like", "experiments/shakespeare.flags"),
    "lstm": Workload(10, 2.0, 438, 50, "sent140_like", "experiments/sent140_lstm.flags"),
}


def workload():
    return WORKLOADS[FLAGS.model]


def batch_size(model):
    return WORKLOADS[model].batch


def sampled_m():
    return FLAGS.clients if FLAGS.clients is not None else workload().m


def population():
    return FLAGS.num_clients if FLAGS.num_clients is not None else workload().population


def tail_weights_np(F, n, theta):
    """Exact superquantile weights (greedy from the largest loss), as a reference loop would."""
    caps = n / (theta * n.sum())
    pi = np.zeros_like(F)
    mass = 0.0
    for k in np.argsort(-F, kind="stable"):
        take = min(caps[k], max(0.0, 1.0 - mass))
        pi[k], mass = take, mass + take
    return pi


def capped(data, cap):
    """`data` with every client cut to its first `cap` examples."""
    from deltafl_jax import ClientData

    def split(s):
        sizes = np.minimum(np.diff(s.offsets), cap)
        rows = np.concatenate([np.arange(o, o + n) for o, n in zip(s.offsets[:-1], sizes)])
        return ClientData(x=s.x[rows], y=s.y[rows], client_ids=s.client_ids,
                          offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    return dataclasses.replace(data, train=split(data.train), test=split(data.test))


def workload_data(model, num_clients, cap=None):
    """The synthetic clients of `model`'s workload (bench.common), capped at `cap` examples."""
    from bench import common

    if model in ("cnn", "linear"):
        data = common.femnist_like_dataset(num_clients, seed=0, flat=model == "linear")
    elif model == "gru":
        data = common.shakespeare_like_dataset(num_clients, 2, seed=0)
    else:
        data = common.sent140_like_dataset(num_clients, 2, seed=0)
    return data if cap is None else capped(data, cap)


# ----------------------------------------------------------------------------- torch loop


def torch_recurrent(model_name, data):
    """torch.nn.GRU / torch.nn.LSTM networks of the recurrent workloads (cuDNN's on CUDA)."""
    import torch
    from torch import nn

    class CharGRU(nn.Module):   # ids [B, 20] -> scores [B, 53]
        def __init__(self, classes, vocab):
            super().__init__()
            self.embed = nn.Embedding(vocab, 8)
            self.rnn = nn.GRU(8, 128, batch_first=True)
            self.out = nn.Linear(128, classes)

        def forward(self, ids):
            return self.out(self.rnn(self.embed(ids))[1][-1])   # h_n of the last layer

    class GloveLSTM(nn.Module):   # ids [B, 25] -> one logit [B, 1]
        def __init__(self, table):
            super().__init__()
            # The frozen GloVe table: a buffer (no gradient), left out of the state averaged.
            self.register_buffer("table", torch.from_numpy(table), persistent=False)
            self.rnn = nn.LSTM(table.shape[1], 50, batch_first=True)
            self.out = nn.Linear(50, 1)

        def forward(self, ids):
            return self.out(self.rnn(self.table[ids[:, :25]])[1][0][-1])

    if model_name == "gru":
        vocab = int(data.metadata.get("input_vocab_size", data.num_classes))
        return CharGRU(data.num_classes, vocab)
    return GloveLSTM(np.asarray(data.metadata["embeddings"], np.float32))


def make_torch(model_name, data, num_classes=62):
    import torch
    from torch import nn

    torch.set_num_threads(FLAGS.torch_threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    if model_name == "cnn":
        net = nn.Sequential(
            nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(7 * 7 * 64, num_classes))
    elif model_name == "linear":
        net = nn.Linear(784, num_classes)
    else:
        net = torch_recurrent(model_name, data)
    return net.to(FLAGS.torch_device)


def torch_client(x, y):
    """One client's (inputs, labels) as torch tensors on --torch_device: pixels as float32 in
    [0, 1], token ids as int64; float32 labels for the sigmoid loss."""
    import torch

    if FLAGS.model in ("cnn", "linear"):
        x = x.reshape(len(x), -1).astype(np.float32) / 255.0
    else:
        x = x.astype(np.int64)
    y = y.astype(np.float32 if FLAGS.model == "lstm" else np.int64)
    return (torch.from_numpy(x).to(FLAGS.torch_device),
            torch.from_numpy(y).to(FLAGS.torch_device))


def torch_loss(logits, y):
    """Mean softmax cross-entropy, or the sigmoid loss of the one-logit LSTM."""
    import torch.nn.functional as F

    if FLAGS.model == "lstm":
        return F.binary_cross_entropy_with_logits(logits[:, 0], y)
    return F.cross_entropy(logits, y)


def torch_round(net, data, clients, theta, rng):
    import torch

    B = batch_size(FLAGS.model)
    global_state = {k: v.clone() for k, v in net.state_dict().items()}
    xs, ys = zip(*(torch_client(*data.train.client(int(k))) for k in clients))
    losses = []
    with torch.no_grad():
        for x, y in zip(xs, ys):
            losses.append(float(torch_loss(net(x), y)))
    n = np.array([len(y) for y in ys], np.float64)
    pi = tail_weights_np(np.array(losses), n, theta)
    acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
    total, trained = 0.0, 0
    for slot in np.nonzero(pi > 0)[0]:
        net.load_state_dict(global_state)
        opt = torch.optim.SGD(net.parameters(), lr=workload().lr)
        x, y = xs[slot], ys[slot]
        order = torch.from_numpy(rng.permutation(len(y))).to(FLAGS.torch_device)
        for s in range(0, len(y), B):
            idx = order[s:s + B]
            opt.zero_grad()
            torch_loss(net(x[idx]), y[idx]).backward()
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


def flax_module(model_name, data, num_classes=62):
    """The model in plain Flax layers (nn.GRUCell / nn.OptimizedLSTMCell under nn.RNN for the
    recurrent ones) and how its raw inputs enter it."""
    import flax.linen as nn
    import jax.numpy as jnp

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x.reshape(x.shape[0], 28, 28, 1)
            x = nn.max_pool(nn.relu(nn.Conv(32, (5, 5), padding="SAME")(x)), (2, 2), (2, 2))
            x = nn.max_pool(nn.relu(nn.Conv(64, (5, 5), padding="SAME")(x)), (2, 2), (2, 2))
            return nn.Dense(num_classes)(x.reshape(x.shape[0], -1))

    class CharGRU(nn.Module):   # ids [B, 20] -> scores [B, 53]
        @nn.compact
        def __call__(self, ids):
            vocab = int(data.metadata.get("input_vocab_size", data.num_classes))
            h = nn.Embed(vocab, 8)(ids)
            return nn.Dense(data.num_classes)(nn.RNN(nn.GRUCell(128), return_carry=True)(h)[0])

    table = np.asarray((data.metadata or {}).get("embeddings", np.zeros((1, 1))), np.float32)

    class GloveLSTM(nn.Module):   # ids [B, 25] -> one logit [B, 1]
        @nn.compact
        def __call__(self, ids):
            v = jnp.asarray(table)[ids[:, :25]]   # the frozen table, a constant
            return nn.Dense(1)(nn.RNN(nn.OptimizedLSTMCell(50), return_carry=True)(v)[0][1])

    if model_name in ("cnn", "linear"):
        module = CNN() if model_name == "cnn" else nn.Dense(num_classes)
        return module, lambda x: x.astype(jnp.float32) / 255.0
    module = CharGRU() if model_name == "gru" else GloveLSTM()
    return module, lambda x: x.astype(jnp.int32)


def make_jax_loop(model_name, data):
    import jax
    import jax.numpy as jnp
    import optax

    module, inputs = flax_module(model_name, data)
    width = int(np.prod(data.train.x.shape[1:]))
    params = module.init(jax.random.key(0), inputs(jnp.zeros((1, width))))["params"]
    lr = WORKLOADS[model_name].lr

    def masked_loss(p, x, y, mask):
        logits = module.apply({"params": p}, inputs(x))
        if model_name == "lstm":
            ce = optax.sigmoid_binary_cross_entropy(logits[:, 0], y.astype(jnp.float32))
        else:
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    @jax.jit
    def step(p, x, y, mask):
        g = jax.grad(masked_loss)(p, x, y, mask)
        return jax.tree.map(lambda a, b: a - lr * b, p, g)

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
    """The engine's configuration of the compared round (the flags, the workload's batch size
    and learning rate, SEED)."""
    from deltafl_jax import DataConfig, ExperimentConfig

    return ExperimentConfig(
        data=DataConfig(workload().dataset), model=FLAGS.model, thetas=(FLAGS.theta,),
        seeds=(SEED,), num_rounds=FLAGS.warmup + FLAGS.rounds, clients_per_round=sampled_m(),
        batch_size=batch_size(FLAGS.model), learning_rate=workload().lr,
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
        return float(np.sum(met["num_selected"])), float(np.sum(met["train_real_examples"]))

    return exp, eng, engine_round


def loop_timers(data):
    """Functions that run round t of the PyTorch and the JAX per-client loops, for those of the
    two that --methods names."""
    from deltafl_jax.sampling.plan import sample_clients

    timers = {}
    if "torch" in FLAGS.methods:
        net = make_torch(FLAGS.model, data)
        rng_t = np.random.default_rng(0)

        def torch_timed(t):
            clients = sample_clients(SEED, t, data.train.num_clients, sampled_m())
            return torch_round(net, data, clients, FLAGS.theta, rng_t)

        timers["torch"] = torch_timed
    if "jax_loop" in FLAGS.methods:
        p, s, l = make_jax_loop(FLAGS.model, data)
        jl = {"params": p, "step": s, "loss_sum": l}
        rng_j = np.random.default_rng(0)

        def jax_timed(t):
            clients = sample_clients(SEED, t, data.train.num_clients, sampled_m())
            return jax_loop_round(jl, data, clients, FLAGS.theta, rng_j)

        timers["jax_loop"] = jax_timed
    return timers


def time_rounds(timers):
    """Runs the timers interleaved, round by round, printing each round's times; returns the
    timed rounds' seconds per timer (the warmup rounds are left out) and their work: the mean
    clients kept and examples trained per timed round."""
    times = {k: [] for k in timers}
    work = {k: [] for k in timers}
    first = {}
    for t in range(FLAGS.warmup + FLAGS.rounds):
        for name, fn in timers.items():
            t0 = time.perf_counter()
            done = fn(t)
            dt = time.perf_counter() - t0
            if t < FLAGS.warmup:
                first.setdefault(name, dt)
            else:
                times[name].append(dt)
                work[name].append(done)
        print(f"# round {t}: " + ", ".join(f"{k} {v[-1] if v else first[k]:.2f}s"
                                           for k, v in times.items()), flush=True)
    return times, {k: {"kept_clients": float(np.mean([w[0] for w in v])),
                       "trained_examples": float(np.mean([w[1] for w in v]))}
                   for k, v in work.items()}


def examples_per_round(data):
    """The sampled clients' examples in each timed round (every method samples the same)."""
    from deltafl_jax.sampling.plan import sample_clients

    sizes = np.diff(data.train.offsets)
    return [int(sizes[sample_clients(SEED, t, data.train.num_clients, sampled_m())].sum())
            for t in range(FLAGS.warmup, FLAGS.warmup + FLAGS.rounds)]


def timing_result(times, med):
    """The JSON's settings, machine and per-method median seconds per round and speedups."""
    import jax

    from bench.common import machine

    return {"model": FLAGS.model, "backend": jax.default_backend(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d"), "loadavg": os.getloadavg(), "theta": FLAGS.theta,
            "m": sampled_m(), "num_clients": population(),
            "max_client_size": FLAGS.max_client_size, "learning_rate": workload().lr,
            "flagfile": workload().flagfile or None,
            "batch_size": batch_size(FLAGS.model), "rounds_timed": FLAGS.rounds,
            "torch_device": FLAGS.torch_device if "torch" in FLAGS.methods else None,
            "torch_threads": ((FLAGS.torch_threads or os.cpu_count())
                              if "torch" in FLAGS.methods else None),
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
    from bench.common import CompileTimer, backend_name, emit, median, peak_rss_mb

    load_start = os.getloadavg()
    data = workload_data(FLAGS.model, population(), FLAGS.max_client_size)
    timers = {}
    compile_timer = CompileTimer()
    if "engine" in FLAGS.methods:
        exp, eng, timers["engine"] = engine_timer(data, compile_timer)
    timers.update(loop_timers(data))

    times, work = time_rounds(timers)
    med = {k: median(v) for k, v in times.items()}
    result = timing_result(times, med)
    if "engine" in timers:
        result.update(engine_result(exp, eng["mets"][FLAGS.warmup:], med["engine"],
                                    compile_timer.seconds))
    result["peak_rss_mb"] = peak_rss_mb()
    result["loadavg_start"] = load_start
    result["sampled_examples_per_round"] = examples_per_round(data)
    result["work_per_round"] = work
    emit(result, FLAGS.out, name=f"compare_{FLAGS.model}_{backend_name()}",
         print_json=FLAGS.json)


if __name__ == "__main__":
    app.run(main)
