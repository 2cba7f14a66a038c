r"""What a personalised method costs per round: Ditto (two models per local step) against FedAvg
on the same clients, rounds interleaved in one process.

    python -m bench.personal_cost [--models=linear,cnn] [--rounds=6] [--clients=20] \
        [--out=bench/results/personal_cost_cpu.json]   # default: bench/out/personal_cost.json

On FEMNIST-shaped data (``bench.common.femnist_like_dataset``: 865 writers of FEMNIST's sizes,
synthetic pixels), one local epoch, lr 0.05, seed 1: softmax regression (batch 10) and the
paper's ConvNet (batch 16), m = ``--clients``. For each model the script builds FedAvg,
Ditto (lambda = 1) and Ditto over Delta-FL (theta = 0.5: every sampled client steps its
personal model, the tail alone its global one), and, for comparison, the per-client-state
methods FedDyn (alpha = 0.01) and SCAFFOLD, one replica each; it compiles each with one
untimed round, then runs round t of every method one after another, the order rotating every
round, and reports the median seconds per round (the round's metrics on the host) and each
method's ratio to FedAvg's. The methods sample the same clients and minibatches (one seed), so
the ratio is the cost of the extra model work. Writes JSON to ``--out`` and prints a table.
"""

from __future__ import annotations

import time

from absl import app, flags

flags.DEFINE_list("models", ["linear", "cnn"], "models to time (linear, cnn)")
flags.DEFINE_integer("rounds", 6, "timed rounds per method (median reported)")
flags.DEFINE_integer("clients", 20, "m, sampled clients per round")
flags.DEFINE_integer("num_clients", 865, "clients in the population")
flags.DEFINE_string("out", None, "write the JSON here (default: the git-ignored "
                    "bench/out/personal_cost.json)")
FLAGS = flags.FLAGS

METHODS = (("fedavg", {}), ("ditto", {"ditto_lambda": (1.0,)}),
           ("deltafl+ditto", {"ditto_lambda": (1.0,)}), ("feddyn", {"feddyn_alpha": (0.01,)}), ("scaffold", {}))


def _config(model: str, algorithm: str, sweeps):
    from deltafl_jax import DataConfig, ExperimentConfig
    thetas = (0.5,) if algorithm.startswith("deltafl") else ()
    return ExperimentConfig(
        data=DataConfig("femnist_like"), model=model, algorithm=algorithm, thetas=thetas,
        seeds=(1,), num_rounds=FLAGS.rounds + 2, clients_per_round=FLAGS.clients,
        batch_size=16 if model == "cnn" else 10, learning_rate=0.05, output_dir=None,
        save_models=False, verbose=False, sweeps=sweeps)


def measure(model: str):
    import jax
    import numpy as np

    from bench.common import femnist_like_dataset
    from deltafl_jax.algorithms import registry
    from deltafl_jax.engine.mesh import tree_to_host
    from deltafl_jax.run.experiment import build_experiment

    data = femnist_like_dataset(FLAGS.num_clients, flat=model == "linear")
    methods = [(a, s) for a, s in METHODS if registry.find(a) is not None]
    exps = {a: build_experiment(_config(model, a, s), data) for a, s in methods}
    state, keys, pending, times, work = {}, {}, {}, {a: [] for a in exps}, {a: [] for a in exps}
    for a, exp in exps.items():
        keys[a] = exp.keys()
        state[a], _ = exp.round_fn(exp.initial_state(), exp.round_data(0), keys[a])
        jax.block_until_ready(state[a])
        pending[a] = exp.round_data(1)
    order = list(exps)
    for t in range(1, FLAGS.rounds + 1):
        for a in order[t % len(order):] + order[:t % len(order)]:
            exp = exps[a]
            t0 = time.perf_counter()
            state[a], metrics = exp.round_fn(state[a], pending[a], keys[a])
            metrics = tree_to_host(metrics)
            times[a].append(time.perf_counter() - t0)
            work[a].append(int(metrics["train_real_examples"]))
            pending[a] = exp.round_data(t + 1)
    base = float(np.median(times["fedavg"]))
    return [{"model": model, "algorithm": a, "m": FLAGS.clients,
             "s_per_round": float(np.median(v)), "round_s": [round(x, 4) for x in v],
             "ratio_to_fedavg": float(np.median(v)) / base,
             "trained_examples_per_round": float(np.mean(work[a]))}
            for a, v in times.items()]


def main(argv):
    del argv
    from bench.common import emit, machine
    rows = [row for model in FLAGS.models for row in measure(model)]
    table = ["| model | method | s/round | / FedAvg |", "|---|---|---|---|"] + [
        f"| {r['model']} | {r['algorithm']} | {r['s_per_round']:.4f} | "
        f"{r['ratio_to_fedavg']:.2f} |" for r in rows]
    emit({"benchmark": "personal_cost", "machine": machine(), "rounds": FLAGS.rounds,
          "rows": rows}, FLAGS.out, summary=table)


if __name__ == "__main__":
    app.run(main)
