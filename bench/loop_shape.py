r"""The shape of the local-SGD loop body, timed side by side: minibatch steps per while trip
(``unroll``) and conds against masked selects (``branchless``).

    python -m bench.loop_shape --model=linear --algorithm=fedavg --shapes=1,4,8,b1,b4 \
        [--out=bench/results/loop_shape_linear_cpu.json]

A shape is ``K`` (K steps per trip, lax.cond bookkeeping) or ``bK`` (the same, branchless).
Every shape gets its own jitted round (``rounds.build_round_fn`` with that
``LocalSGDConfig``) on the same FEMNIST-like clients; the rounds run interleaved, the order
reversed every other round, and the JSON holds each shape's median wall and CPU seconds, the
while-loop trips of its training loop, and a hash of the final models (every shape must train
bit-identical models: the shape changes no arithmetic).
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
from absl import app, flags

flags.DEFINE_enum("model", "linear", ["cnn", "linear"], "model")
flags.DEFINE_enum("algorithm", "fedavg", ["fedavg", "deltafl"], "fedavg (theta 1) or deltafl 0.5")
flags.DEFINE_list("shapes", ["1", "4", "8", "b1"], "K or bK (branchless)")
flags.DEFINE_integer("rounds", 9, "rounds, the first untimed")
flags.DEFINE_integer("clients", 100, "m")
flags.DEFINE_integer("num_clients", 865, "clients in the population")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/loop_shape_<model>_<backend>.json)")
FLAGS = flags.FLAGS


def build(shape: str, data):
    import jax

    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment, rounds
    from deltafl_jax.algorithms import registry

    fixed = registry.get(FLAGS.algorithm).grid.fixed_sweep   # fedavg: theta = 1, its only value
    cfg = ExperimentConfig(
        data=DataConfig("femnist_like"), model=FLAGS.model, algorithm=FLAGS.algorithm,
        thetas=() if fixed else (0.5,), seeds=(1,),
        num_rounds=FLAGS.rounds, clients_per_round=FLAGS.clients,
        batch_size=16 if FLAGS.model == "cnn" else 10, learning_rate=0.05, output_dir=None,
        save_models=False, verbose=False)
    exp = build_experiment(cfg, data)
    branchless = shape.startswith("b")
    unroll = int(shape[1:] if branchless else shape)
    place = exp.placement
    from deltafl_jax.engine import LocalSGDConfig
    local = LocalSGDConfig(cfg.training.batch_size, place.lanes, place.lane_mode, unroll=unroll,
                           branchless=branchless)
    fn = jax.jit(rounds.build_round_fn(exp.model, exp.algorithm, exp.replicas, local,
                                       place.eval_chunk, place.eval_lanes, exp.num_sampled),
                 donate_argnums=(0,))
    return {"exp": exp, "fn": fn, "state": exp.initial_state(), "keys": exp.keys(),
            "unroll": unroll, "wall": [], "cpu": [], "trips": []}


def main(argv):
    del argv
    import jax

    from bench.common import emit, femnist_like_dataset, machine, median

    data = femnist_like_dataset(FLAGS.num_clients, seed=0)
    runs = {s: build(s, data) for s in FLAGS.shapes}
    loads = []
    for t in range(FLAGS.rounds):
        for s in (FLAGS.shapes if t % 2 == 0 else FLAGS.shapes[::-1]):
            r = runs[s]
            rd = r["exp"].round_data(t)
            loads.append(os.getloadavg()[0])
            c0, t0 = time.process_time(), time.perf_counter()
            r["state"], met = r["fn"](r["state"], rd, r["keys"])
            met = jax.device_get(met)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if t > 0:
                r["wall"].append(wall)
                r["cpu"].append(cpu)
                r["trips"].append(int(met["train_trips"]))
    out = {"benchmark": "loop_shape", "model": FLAGS.model, "algorithm": FLAGS.algorithm,
           "machine": machine(), "date": time.strftime("%Y-%m-%d"),
           "load1_mean": float(np.mean(loads)), "load1_max": float(np.max(loads)), "shapes": {}}
    base = median(runs[FLAGS.shapes[0]]["wall"])
    for s, r in runs.items():
        leaves = jax.tree.leaves(r["state"].params)
        steps = float(np.mean(r["trips"]))
        out["shapes"][s] = {
            "unroll": r["unroll"], "branchless": s.startswith("b"),
            "s_per_round": median(r["wall"]), "cpu_s_per_round": median(r["cpu"]),
            "relative_to_first": median(r["wall"]) / base, "train_steps": steps,
            "train_loop_trips": float(np.mean([-(-k // r["unroll"]) for k in r["trips"]])),
            "params_sha1": hashlib.sha1(b"".join(np.asarray(x).tobytes()
                                                 for x in leaves)).hexdigest()[:12],
            "round_times_s": r["wall"]}
    emit(out, FLAGS.out, name=f"loop_shape_{FLAGS.model}_{jax.default_backend()}")


if __name__ == "__main__":
    app.run(main)
