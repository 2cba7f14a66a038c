r"""The engine against the simulator a user would pick instead, side by side on one dataset.

    python -m bench.peers [--models=cnn,linear] [--rounds=5] [--out=bench/results/peers_cpu.json]

1. For each peer, a pinned virtual environment is created once under ``--cache_dir``
   (default ``~/.cache/deltafl_jax/peers``, or ``$DELTAFL_PEERS_CACHE``) with pip from the
   package index; the next runs reuse it (a marker file records the pins and ``pip freeze``).
2. One FEMNIST-shaped dataset (865 clients, sizes 101-447, median ~179, 28x28 pixels, 62
   classes: ``bench.common.femnist_like_dataset``) and the clients sampled in each round are
   exported to an npz file that the peer's own script reads (``bench/peer_fedjax.py``).
3. Per model (the paper's ConvNet, batch 16; softmax regression, batch 10; m = 100, one local
   epoch, lr 0.05), three things are timed round by round, alternating (the order rotates
   every round so no method always runs right after another): the peer's own FedAvg in its
   own process, the engine's FedAvg (``--algorithm=fedavg``, theta = 1) and the engine's
   Delta-FL at theta = 0.5. Each figure is the median of ``--rounds`` rounds after
   ``--warmup`` rounds; ``os.getloadavg()`` is recorded around every round because the
   machine is shared.

Besides s/round, the JSON gives the engine's trips on the critical path per round: the
sequential steps of its loops (evaluation steps + local-SGD steps of the busiest lane) and the
``while_loop`` trips that run them (a trip runs ``unroll`` steps), which is what predicts
latency on an accelerator, where every trip is a launch; and, for the ConvNet, the engine's
share of this machine's measured GEMM peak.

Peers: FedJAX 0.0.17 (google/fedjax, its last release) on jax 0.4.30 with dm-haiku. Flower and
pfl-research are not timed; bench/README.md says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

flags.DEFINE_list("models", ["cnn", "linear"], "models to time (cnn, linear)")
flags.DEFINE_list("peers", ["fedjax"], "peers to time")
flags.DEFINE_list("engine_devices", ["1", "2"], "run the engine on each of these device "
                  "counts (on a CPU, D > 1 splits the host into D devices: --devices=D)")
flags.DEFINE_integer("rounds", 5, "timed rounds per model (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed rounds first (compilation)")
flags.DEFINE_integer("clients", 100, "m, sampled clients per round")
flags.DEFINE_integer("num_clients", 865, "clients in the population")
flags.DEFINE_string("cache_dir", None, "where the peers' virtual environments live")
flags.DEFINE_string("out", "bench/results/peers_cpu.json", "write the JSON here")
flags.DEFINE_integer("gemm_n", 2048, "matrix size of the GEMM-peak measurement")
FLAGS = flags.FLAGS

LR = 0.05
SEED = 1
BATCH = {"cnn": 16, "linear": 10}
HERE = os.path.dirname(os.path.abspath(__file__))

# Pins: FedJAX 0.0.17 declares no upper bounds; these are the releases of its dependencies
# that work with jax 0.4.30 (haiku 0.0.12 and optax 0.2.3 predate jax 0.4.31, numpy < 2 as
# haiku 0.0.12 expects). jaxlib 0.4.30 has cp39-cp312 wheels.
PEERS = {
    "fedjax": {
        "pins": ["fedjax==0.0.17", "jax==0.4.30", "jaxlib==0.4.30", "dm-haiku==0.0.12",
                 "optax==0.2.3", "chex==0.1.86", "numpy==1.26.4", "scipy==1.13.1"],
        "script": "peer_fedjax.py",
    },
}


def cache_dir() -> str:
    return (FLAGS.cache_dir or os.environ.get("DELTAFL_PEERS_CACHE")
            or os.path.join(os.path.expanduser("~"), ".cache", "deltafl_jax", "peers"))


def ensure_venv(name: str) -> dict:
    """The peer's pinned venv (created on first use). Returns its python and what it holds."""
    pins = PEERS[name]["pins"]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = os.path.join(cache_dir(), f"{name}-{tag}")
    marker = os.path.join(root, "deltafl_peer.json")
    python = os.path.join(root, "bin", "python")
    if os.path.exists(marker):
        with open(marker) as f:
            info = json.load(f)
        if info.get("pins") == pins:
            return info
    print(f"# creating the {name} venv under {root} (once)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", root], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *pins], check=True)
    freeze = subprocess.run([python, "-m", "pip", "freeze"], check=True, capture_output=True,
                            text=True).stdout.split()
    info = {"python": python, "pins": pins, "freeze": freeze,
            "created_s": round(time.perf_counter() - t0, 1),
            "created": time.strftime("%Y-%m-%d %H:%M")}
    with open(marker, "w") as f:
        json.dump(info, f, indent=1)
    return info


def export_dataset(data, model: str, rounds: int, path: str) -> np.ndarray:
    """The training split as the peer stores it (float32 NHWC pixels in [0, 1]) and the clients
    sampled in each round; returns those clients [rounds, m]."""
    from deltafl_jax.plan import sample_clients

    tr = data.train
    clients = np.stack([sample_clients(SEED, t, tr.num_clients, FLAGS.clients)
                        for t in range(rounds)])
    x = (tr.x.reshape(-1, 28, 28, 1).astype(np.float32) * np.float32(data.x_scale))
    np.savez(path, x=x, y=tr.y.astype(np.int32), offsets=tr.offsets.astype(np.int64),
             clients=clients.astype(np.int32))
    return clients


class Peer:
    """A peer's script in its own process, one round per request."""

    def __init__(self, name: str, python: str, data_path: str, model: str):
        script = os.path.join(HERE, PEERS[name]["script"])
        cmd = [python, script, f"--data={data_path}", f"--model={model}",
               f"--batch_size={BATCH[model]}", f"--learning_rate={LR}"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.versions = json.loads(self._expect("READY"))

    def _expect(self, word: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(word + " "):
                return line[len(word) + 1:]
        raise RuntimeError(f"the peer exited (code {self.proc.wait()}) before {word}")

    def round(self, t: int) -> float:
        self.proc.stdin.write(f"round {t}\n")
        return float(json.loads(self._expect("DONE"))["seconds"])

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        finally:
            self.proc.wait(timeout=60)


def engine_runner(data, model: str, algorithm: str, theta: float, devices: int = 1):
    """A closure running round t of the engine on `devices` devices; it keeps the per-round
    metrics."""
    import jax

    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment

    cfg = ExperimentConfig(
        data=DataConfig("femnist_like"), model=model, algorithm=algorithm, thetas=(theta,),
        seeds=(SEED,), num_rounds=FLAGS.warmup + FLAGS.rounds, clients_per_round=FLAGS.clients,
        batch_size=BATCH[model], learning_rate=LR, output_dir=None, save_models=False,
        verbose=False, devices=devices)
    exp = build_experiment(cfg, data)
    st = {"state": exp.initial_state(), "keys": exp.keys(), "metrics": []}

    def run(t: int) -> float:
        rd = exp.round_data(t)
        t0 = time.perf_counter()
        st["state"], met = exp.round_fn(st["state"], rd, st["keys"])
        met = jax.device_get(met)
        dt = time.perf_counter() - t0
        st["metrics"].append(met)
        return dt

    run.experiment, run.store = exp, st
    return run


def trips(run, warmup: int) -> dict:
    """The engine's critical path per round (``bench.common.critical_path``) and its work."""
    from bench.common import critical_path

    exp, mets = run.experiment, run.store["metrics"][warmup:]

    def mean(key):
        return float(np.mean([float(np.sum(m[key])) for m in mets]))

    return {**critical_path(mets, exp.placement), "clients_trained": mean("num_selected"),
            "train_examples": mean("train_real_examples"),
            "eval_examples": mean("eval_real_examples")}


def time_model(model: str, data, data_path: str, peer_pythons: dict) -> dict:
    """Alternate the peers' FedAvg, the engine's FedAvg and Delta-FL 0.5 round by round."""
    from bench.common import CompileTimer, forward_flops_per_example, median

    peers = {name: Peer(name, info["python"], data_path, model)
             for name, info in peer_pythons.items()}
    compile_timer = CompileTimer()
    runners = {f"{name}_fedavg": p.round for name, p in peers.items()}
    with compile_timer:
        for d in engine_device_counts():
            tag = "" if d == 1 else f"_{d}dev"
            runners[f"engine_fedavg{tag}"] = engine_runner(data, model, "fedavg", 1.0, d)
            runners[f"engine_deltafl_0.5{tag}"] = engine_runner(data, model, "deltafl", 0.5, d)
    names = list(runners)
    times = {k: [] for k in names}
    loads = []
    for t in range(FLAGS.warmup + FLAGS.rounds):
        order = names[t % len(names):] + names[:t % len(names)]
        for name in order:
            before = os.getloadavg()[0]
            dt = runners[name](t)
            if t >= FLAGS.warmup:
                times[name].append(dt)
            loads.append({"round": t, "method": name, "load1_before": before,
                          "load1_after": os.getloadavg()[0]})
        print(f"# {model} round {t}: " + ", ".join(
            f"{k} {times[k][-1] if times[k] else float('nan'):.3f}s" for k in names),
            file=sys.stderr, flush=True)
    for p in peers.values():
        p.close()
    med = {k: median(v) for k, v in times.items()}
    out = {"model": model, "batch_size": BATCH[model], "m": FLAGS.clients,
           "learning_rate": LR, "local_epochs": 1, "rounds_timed": FLAGS.rounds,
           "warmup": FLAGS.warmup, "order": "rotating", "s_per_round": med,
           "round_times_s": times, "load": loads,
           "load1_mean": float(np.mean([l["load1_before"] for l in loads])),
           "peer_versions": {n: p.versions for n, p in peers.items()}}
    for name in peers:
        peer = med[f"{name}_fedavg"]
        out[f"speedup_vs_{name}"] = {k: peer / med[k] for k in med if k.startswith("engine")}
    out["engine"] = {}
    engines = [k for k in runners if k.startswith("engine")]
    fwd = forward_flops_per_example(runners[engines[0]].experiment.model)
    for k in engines:
        tr = trips(runners[k], FLAGS.warmup)
        gflop = fwd * (tr["eval_examples"] + 3 * tr["train_examples"]) / 1e9
        out["engine"][k] = {**tr, "round_gflop": gflop, "gflops": gflop / med[k],
                            "placement": vars(runners[k].experiment.placement)}
    out["forward_flops_per_example"] = fwd
    return out


def engine_device_counts():
    try:
        counts = [int(d) for d in FLAGS.engine_devices]
    except ValueError:
        raise app.UsageError(f"--engine_devices must be integers, got {FLAGS.engine_devices}")
    if not counts or min(counts) < 1:
        raise app.UsageError(f"--engine_devices must be >= 1, got {FLAGS.engine_devices}")
    return counts


def main(argv):
    del argv
    from deltafl_jax.engine.mesh import host_device_flags   # before JAX starts its backend
    os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""),
                                                max(engine_device_counts()))
    from bench.common import emit, femnist_like_dataset, gemm_peak_gflops, machine

    t0 = time.perf_counter()
    venvs = {name: ensure_venv(name) for name in FLAGS.peers}
    venv_s = time.perf_counter() - t0
    data = femnist_like_dataset(FLAGS.num_clients, seed=0)
    sizes = data.train.sizes
    data_dir = os.path.join(cache_dir(), "data")
    os.makedirs(data_dir, exist_ok=True)
    data_path = os.path.join(data_dir, f"femnist_like_{FLAGS.num_clients}_m{FLAGS.clients}.npz")
    export_dataset(data, "cnn", FLAGS.warmup + FLAGS.rounds, data_path)
    result = {"benchmark": "peers", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
              "loadavg_start": os.getloadavg(),
              "population": {"num_clients": FLAGS.num_clients, "m": FLAGS.clients,
                             "median": float(np.median(sizes)), "min": int(sizes.min()),
                             "max": int(sizes.max()), "classes": data.num_classes},
              "peers": {n: {"pins": v["pins"], "freeze": v["freeze"],
                            "venv_created_s": v["created_s"]} for n, v in venvs.items()},
              "venv_setup_s_this_run": venv_s, "models": {}}
    for model in FLAGS.models:
        result["models"][model] = time_model(model, data, data_path, venvs)
    peak = gemm_peak_gflops(FLAGS.gemm_n)
    result["gemm_peak_gflops"] = peak
    for res in result["models"].values():
        for k, e in res["engine"].items():
            e["fraction_of_gemm_peak"] = e["gflops"] / peak
    result["loadavg_end"] = os.getloadavg()
    emit(result, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
