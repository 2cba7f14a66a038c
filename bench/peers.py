r"""The engine against the simulator a user would pick instead, side by side on one dataset.

    python -m bench.peers [--models=cnn,linear] [--rounds=5] [--out=bench/results/peers_cpu.json]

1. For each peer, a pinned virtual environment is created once under ``--cache_dir``
   (default ``~/.cache/deltafl_jax/peers``, or ``$DELTAFL_PEERS_CACHE``) with pip from the
   package index; the next runs reuse it (a marker file records the pins and ``pip freeze``).
2. One FEMNIST-shaped dataset (865 clients, sizes 101-447, median ~179, 28x28 pixels, 62
   classes: ``bench.common.femnist_like_dataset``) and the clients sampled in each round are
   exported to an npz file, with the order in which the engine visits each client's examples,
   that the peer's own script reads (``bench/peer_fedjax.py``, ``bench/peer_drjax.py``).
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

Each peer's padded/real example ratio (the examples its round computes against the sampled
clients' real ones) is in the JSON next to the engine's.

Peers: FedJAX 0.0.17 (google/fedjax, its last release) on jax 0.4.30 with dm-haiku; DrJAX
0.2.1 (google-research/drjax) on the engine's jax 0.10.2 with Flax 0.12.8 and optax 0.2.8,
FedAvg as one ``drjax.program`` per round over the m clients padded to the largest client's
batches. DrJAX trains the engine's own minibatches, so its first round is checked against the
engine's FedAvg at a tenth of the timed learning rate (at the timed rate the ConvNet's local
SGD amplifies float rounding, see CHECK_LR): the largest absolute difference of the two
models after round 0 is in the JSON (``peer_checks``, with the difference at the timed rate
beside it), and the script exits 2 (after writing the JSON) when it exceeds 1e-5.
Flower and pfl-research are not timed; bench/README.md says why.
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
flags.DEFINE_list("peers", ["fedjax", "drjax"], "peers to time")
flags.DEFINE_list("engine_devices", ["1", "2"], "run the engine on each of these device "
                  "counts (on a CPU, D > 1 splits the host into D devices: --devices=D)")
flags.DEFINE_integer("rounds", 5, "timed rounds per model (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed rounds first (compilation)")
flags.DEFINE_integer("clients", 100, "m, sampled clients per round")
flags.DEFINE_integer("num_clients", 865, "clients in the population")
flags.DEFINE_string("cache_dir", None, "where the peers' virtual environments live")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/peers_<backend>.json)")
flags.DEFINE_integer("gemm_n", 2048, "matrix size of the GEMM-peak measurement")
flags.DEFINE_string("peer_jax_extra", "", "install the peers' pinned jax with this extra (cuda12, "
                    "tpu) so that they run on the accelerator too; empty: CPU jax")
FLAGS = flags.FLAGS

LR = 0.05
SEED = 1
BATCH = {"cnn": 16, "linear": 10}
HERE = os.path.dirname(os.path.abspath(__file__))
CHECK_TOL = 1e-5   # a checked peer's first-round model against the engine's FedAvg
# The checked rate: at LR the ConvNet's local SGD amplifies float rounding (the order of a
# sum) into ReLU / max-pool switches, so two correct implementations, and the engine's own
# two convolution paths, differ by ~1e-4 after a round; at LR / 10 they agree to ~1e-7.
# The check at LR is reported too (``at_timed_rate``), without a tolerance.
CHECK_LR = LR / 10

# Pins: FedJAX 0.0.17 declares no upper bounds; these are the releases of its dependencies
# that work with jax 0.4.30 (haiku 0.0.12 and optax 0.2.3 predate jax 0.4.31, numpy < 2 as
# haiku 0.0.12 expects). jaxlib 0.4.30 has cp39-cp312 wheels.
PEERS = {
    "fedjax": {
        "pins": ["fedjax==0.0.17", "jax==0.4.30", "jaxlib==0.4.30", "dm-haiku==0.0.12",
                 "optax==0.2.3", "chex==0.1.86", "numpy==1.26.4", "scipy==1.13.1"],
        "script": "peer_fedjax.py",
    },
    # DrJAX 0.2.1 asks only jax >= 0.4.24; its venv holds the engine's own jax, jaxlib, flax,
    # optax and numpy releases, so both sides run the same XLA.
    "drjax": {
        "pins": ["drjax==0.2.1", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8",
                 "optax==0.2.8", "numpy==2.4.6", "absl-py==2.5.1"],
        "script": "peer_drjax.py",
        "checked": True,   # trains the engine's minibatches: its round 0 is compared
        "devices": True,   # also runs on each of --engine_devices host devices (a mesh)
    },
}


def cache_dir() -> str:
    return (FLAGS.cache_dir or os.environ.get("DELTAFL_PEERS_CACHE")
            or os.path.join(os.path.expanduser("~"), ".cache", "deltafl_jax", "peers"))


def peer_pins(name: str, extra: str = "") -> list:
    """The peer's pins, its jax pin with `extra` (``jax[cuda12]==0.4.30``) when one is given."""
    pins = PEERS[name]["pins"]
    if not extra:
        return list(pins)
    return [f"jax[{extra}]=={p.split('==', 1)[1]}" if p.startswith("jax==") else p for p in pins]


def ensure_venv(name: str) -> dict:
    """The peer's pinned venv (created on first use). Returns its python and what it holds."""
    pins = peer_pins(name, FLAGS.peer_jax_extra)
    tag = f"py{sys.version_info.major}{sys.version_info.minor}" + (
        f"-{FLAGS.peer_jax_extra}" if FLAGS.peer_jax_extra else "")
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
    """The training split as the peer stores it (float32 NHWC pixels in [0, 1]), the clients
    sampled in each round and the order in which the engine visits their examples (one epoch:
    ``order[t]`` lays the sampled clients' permutations end to end, -1 after the last; the
    DrJAX peer trains these minibatches, FedJAX shuffles on its own); returns the clients
    [rounds, m]."""
    from deltafl_jax.sampling.plan import client_permutations, sample_clients

    tr = data.train
    clients = np.stack([sample_clients(SEED, t, tr.num_clients, FLAGS.clients)
                        for t in range(rounds)])
    sizes = np.diff(tr.offsets)
    order = np.full((rounds, int(np.sort(sizes)[::-1][:FLAGS.clients].sum())), -1, np.int32)
    for t in range(rounds):
        perms = [client_permutations(SEED, t, int(k), int(sizes[k]), 1) for k in clients[t]]
        flat = np.concatenate(perms)
        order[t, :len(flat)] = flat
    x = (tr.x.reshape(-1, 28, 28, 1).astype(np.float32) * np.float32(data.x_scale))
    np.savez(path, x=x, y=tr.y.astype(np.int32), offsets=tr.offsets.astype(np.int64),
             clients=clients.astype(np.int32), order=order)
    return clients


class Peer:
    """A peer's script in its own process, one round per request."""

    def __init__(self, name: str, python: str, data_path: str, model: str, devices: int = 1):
        script = os.path.join(HERE, PEERS[name]["script"])
        cmd = [python, script, f"--data={data_path}", f"--model={model}",
               f"--batch_size={BATCH[model]}", f"--learning_rate={LR}"]
        if devices > 1:
            cmd.append(f"--devices={devices}")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.versions = json.loads(self._expect("READY"))
        self.rounds = []   # each round's DONE record

    def _expect(self, word: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(word + " "):
                return line[len(word) + 1:]
        raise RuntimeError(f"the peer exited (code {self.proc.wait()}) before {word}")

    def round(self, t: int) -> float:
        self.proc.stdin.write(f"round {t}\n")
        done = json.loads(self._expect("DONE"))
        self.rounds.append(done)
        return float(done["seconds"])

    def check(self, t: int, learning_rate: float, start: str, out: str) -> None:
        """Round t at `learning_rate` from the model in `start` (npz), the new model written
        to `out`."""
        self.proc.stdin.write(f"check {t} {learning_rate!r} {start} {out}\n")
        self._expect("DONE")

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        finally:
            self.proc.wait(timeout=60)


def engine_runner(data, model: str, algorithm: str, theta: float, devices: int = 1,
                  learning_rate: float = LR):
    """A closure running round t of the engine on `devices` devices; it keeps the per-round
    metrics."""
    import jax

    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment

    cfg = ExperimentConfig(
        data=DataConfig("femnist_like"), model=model, algorithm=algorithm, thetas=(theta,),
        seeds=(SEED,), num_rounds=FLAGS.warmup + FLAGS.rounds, clients_per_round=FLAGS.clients,
        batch_size=BATCH[model], learning_rate=learning_rate, output_dir=None, save_models=False,
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

    padded = mean("train_padded_examples") + mean("eval_padded_examples")
    real = mean("train_real_examples") + mean("eval_real_examples")
    return {**critical_path(mets, exp.placement), "clients_trained": mean("num_selected"),
            "train_examples": mean("train_real_examples"),
            "eval_examples": mean("eval_real_examples"),
            "train_padded_over_real": mean("train_padded_examples") / mean("train_real_examples"),
            "padded_over_real": padded / real}


# The engine's parameter names and the peers' Flax names (``nn.Conv`` layers in order).
ENGINE_TO_PEER = {"kernel_32": "Conv_0/kernel", "bias_32": "Conv_0/bias",
                  "kernel_64": "Conv_1/kernel", "bias_64": "Conv_1/bias"}


def peer_params(params) -> dict:
    """One replica's engine parameters as {peer name: array}."""
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        out[ENGINE_TO_PEER.get(name, name)] = np.asarray(leaf)
    return out


def round_difference(peer, name: str, learning_rate: float, start: dict, engine_after: dict,
                     work_dir: str) -> dict:
    """The peer's round 0 at `learning_rate` from the engine's initial model against the
    engine's FedAvg model after round 0 at that rate (same clients, examples and minibatches):
    the largest absolute difference and the engine's largest update."""
    start_path = os.path.join(work_dir, f"{name}_check_start.npz")
    out_path = os.path.join(work_dir, f"{name}_check_after.npz")
    np.savez(start_path, **start)
    peer.check(0, learning_rate, start_path, out_path)
    with np.load(out_path) as f:
        after = {k: f[k] for k in f.files}
    if set(after) != set(engine_after):
        raise RuntimeError(f"{name}'s parameters {sorted(after)} are not the engine's "
                           f"{sorted(engine_after)}")
    diff = max(float(np.max(np.abs(after[k] - engine_after[k]))) for k in after)
    update = max(float(np.max(np.abs(engine_after[k] - start[k]))) for k in after)
    return {"learning_rate": learning_rate, "max_abs_diff": diff,
            "max_abs_engine_update": update}


def check_first_round(peer, name: str, start: dict, engine_after: dict, timed_after: dict,
                      work_dir: str) -> dict:
    """Round 0 checked at CHECK_LR (``engine_after``: the engine's model after it), and
    reported at the timed rate LR (``timed_after``)."""
    checked = round_difference(peer, name, CHECK_LR, start, engine_after, work_dir)
    timed = round_difference(peer, name, LR, start, timed_after, work_dir)
    return {"round": 0, **checked, "tolerance": CHECK_TOL,
            "agrees": checked["max_abs_diff"] <= CHECK_TOL, "at_timed_rate": timed}


def start_peers(model: str, data_path: str, peer_pythons: dict) -> dict:
    """The peers' processes by label: one per peer, or one per engine device count for a peer
    that runs on several devices (labelled '<name>_<d>dev')."""
    peers = {}
    for name, info in peer_pythons.items():
        for d in (engine_device_counts() if PEERS[name].get("devices") else [1]):
            peers[name if d == 1 else f"{name}_{d}dev"] = Peer(name, info["python"], data_path,
                                                                model, d)
    return peers


def make_runners(peers: dict, data, model: str) -> dict:
    """Round functions by timing key: the peers', then the engine's FedAvg and Delta-FL 0.5 at
    each engine device count."""
    from bench.common import CompileTimer

    compile_timer = CompileTimer()
    runners = {peer_key(name): p.round for name, p in peers.items()}
    with compile_timer:
        for d in engine_device_counts():
            tag = "" if d == 1 else f"_{d}dev"
            runners[f"engine_fedavg{tag}"] = engine_runner(data, model, "fedavg", 1.0, d)
            runners[f"engine_deltafl_0.5{tag}"] = engine_runner(data, model, "deltafl", 0.5, d)
    return runners


def first_replica(runner) -> dict:
    """The first replica of an engine runner's current global model, by peer name."""
    import jax

    return peer_params(jax.tree.map(lambda a: a[0], jax.device_get(runner.store["state"].params)))


def rotating_rounds(model: str, runners: dict, reference):
    """The warmup and timed rounds, each running every method once in an order that rotates by
    one per round. Returns the timed seconds per method, the load average around each run and,
    when `reference` names an engine runner, its model before and after round 0 (else None)."""
    names = list(runners)
    times = {k: [] for k in names}
    loads = []
    start = engine_after = None
    if reference is not None:
        start = first_replica(runners[reference])
    for t in range(FLAGS.warmup + FLAGS.rounds):
        order = names[t % len(names):] + names[:t % len(names)]
        for name in order:
            before = os.getloadavg()[0]
            dt = runners[name](t)
            if name == reference and t == 0:
                engine_after = first_replica(runners[reference])
            if t >= FLAGS.warmup:
                times[name].append(dt)
            loads.append({"round": t, "method": name, "load1_before": before,
                          "load1_after": os.getloadavg()[0]})
        print(f"# {model} round {t}: " + ", ".join(
            f"{k} {times[k][-1] if times[k] else float('nan'):.3f}s" for k in names),
            file=sys.stderr, flush=True)
    return times, loads, start, engine_after


def engine_work(runners: dict, med: dict):
    """Each engine runner's critical path, work and placement (``trips``) with its GFLOP per
    round and GFLOP/s at its median time `med`; and the model's forward FLOPs per example."""
    from bench.common import forward_flops_per_example

    engines = [k for k in runners if k.startswith("engine")]
    fwd = forward_flops_per_example(runners[engines[0]].experiment.model)
    work = {}
    for k in engines:
        tr = trips(runners[k], FLAGS.warmup)
        gflop = fwd * (tr["eval_examples"] + 3 * tr["train_examples"]) / 1e9
        work[k] = {**tr, "round_gflop": gflop, "gflops": gflop / med[k],
                   "placement": vars(runners[k].experiment.placement)}
    return work, fwd


def time_model(model: str, data, data_path: str, peer_pythons: dict) -> dict:
    """Alternate the peers' FedAvg, the engine's FedAvg and Delta-FL 0.5 round by round."""
    from bench.common import median

    peers = start_peers(model, data_path, peer_pythons)
    runners = make_runners(peers, data, model)
    checked = [n for n in peers if PEERS[n.split("_")[0]].get("checked")]
    reference = next((k for k in runners if k.startswith("engine_fedavg")), None)
    if checked and reference is None:
        raise app.UsageError("checking a peer needs the engine's FedAvg: --engine_devices")
    times, loads, start, engine_after = rotating_rounds(model, runners,
                                                        reference if checked else None)
    checks = {}
    if checked:   # the engine's round 0 at the checked rate (a separate, untimed experiment)
        slow = engine_runner(data, model, "fedavg", 1.0, 1, learning_rate=CHECK_LR)
        slow(0)
        check_after = first_replica(slow)
        checks = {n: check_first_round(peers[n], n, start, check_after, engine_after,
                                       os.path.dirname(data_path)) for n in checked}
    for p in peers.values():
        p.close()
    med = {k: median(v) for k, v in times.items()}
    out = {"model": model, "batch_size": BATCH[model], "m": FLAGS.clients,
           "learning_rate": LR, "local_epochs": 1, "rounds_timed": FLAGS.rounds,
           "warmup": FLAGS.warmup, "order": "rotating", "s_per_round": med,
           "round_times_s": times, "load": loads,
           "load1_mean": float(np.mean([l["load1_before"] for l in loads])),
           "peer_versions": {n: p.versions for n, p in peers.items() if n in PEERS},
           "peer_examples": {n: peer_examples(p.rounds[FLAGS.warmup:])
                             for n, p in peers.items()},
           "peer_checks": checks}
    for name in peers:
        peer = med[peer_key(name)]
        out[f"speedup_vs_{name}"] = {k: peer / med[k] for k in med if k.startswith("engine")}
    out["engine"], out["forward_flops_per_example"] = engine_work(runners, med)
    return out


def peer_key(label: str) -> str:
    """The timing key of a peer process: 'drjax' -> 'drjax_fedavg', 'drjax_2dev' ->
    'drjax_fedavg_2dev' (as the engine's 'engine_fedavg_2dev')."""
    name, _, tag = label.partition("_")
    return f"{name}_fedavg" + (f"_{tag}" if tag else "")


def peer_examples(rounds) -> dict:
    """Mean examples a peer computed and real ones per timed round, and their ratio."""
    padded = float(np.mean([r["padded_examples"] for r in rounds]))
    real = float(np.mean([r["real_examples"] for r in rounds]))
    out = {"padded_examples": padded, "real_examples": real, "padded_over_real": padded / real}
    if all("host_s" in r for r in rounds):
        out["host_prep_s_median"] = float(np.median([r["host_s"] for r in rounds]))
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
    from bench.common import (backend_name, emit, femnist_like_dataset, gemm_peak_gflops,
                              machine)

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
    emit(result, FLAGS.out, name=f"peers_{backend_name()}")
    bad = [f"{model}: {name}'s model after round 0 differs from the engine's FedAvg by "
           f"{c['max_abs_diff']:.3g} (tolerance {c['tolerance']:g})"
           for model, res in result["models"].items()
           for name, c in res["peer_checks"].items() if not c["agrees"]]
    if bad:
        print("; ".join(bad), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
