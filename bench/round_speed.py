r"""Time one Delta-FL round of the real engine at several client parallelisms.

    python -m bench.round_speed --json [--out=bench/results/round_speed_cpu.json]

Two shapes, both a theta = 0.5 round with m sampled clients of FEMNIST-like sizes (median 179,
min 101, max 447), one local epoch:

- ``cnn``: the paper's EMNIST ConvNet, batch 16, m = 100;
- ``linear``: softmax regression on 784 pixels, batch 10, m = 100.

For every ``--clients_per_step`` value tried, a fresh subprocess builds the experiment, times
the first round (compile + run; the compile seconds are JAX's own trace/lower/compile events)
and then the median of ``--rounds`` rounds, and reports real
and padded examples per second (evaluation and training together), their ratio, the share
of local training spent on kept clients, and the peak resident memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_list("shapes", ["cnn", "linear"], "shapes to time")
flags.DEFINE_list("cnn_lanes", ["1", "2", "4"], "clients_per_step values for the CNN")
flags.DEFINE_list("linear_lanes", ["1", "2", "4", "16", "100"], "clients_per_step for linear")
flags.DEFINE_integer("clients", 100, "m, sampled clients per round")
flags.DEFINE_integer("num_clients", 865, "training clients in the population")
flags.DEFINE_integer("rounds", 5, "timed rounds after the first (median reported)")
flags.DEFINE_bool("json", True, "print one JSON object")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/round_speed_<backend>.json)")
flags.DEFINE_string("_one", None, "internal: run one setting 'shape:lanes' and print JSON")
FLAGS = flags.FLAGS

SHAPES = {
    "cnn": dict(model="cnn", batch_size=16, learning_rate=0.05, flat=False),
    "linear": dict(model="linear", batch_size=10, learning_rate=0.05, flat=True),
}


def run_one(shape: str, lanes: int) -> dict:
    import jax
    import numpy as np

    from bench.common import (CompileTimer, critical_path, femnist_like_dataset, median,
                              peak_rss_mb)
    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment

    spec = SHAPES[shape]
    data = femnist_like_dataset(FLAGS.num_clients, seed=0, flat=spec["flat"])
    cfg = ExperimentConfig(
        data=DataConfig("femnist_like"), model=spec["model"], thetas=(0.5,), seeds=(1,),
        num_rounds=FLAGS.rounds + 1, clients_per_round=FLAGS.clients,
        batch_size=spec["batch_size"], learning_rate=spec["learning_rate"],
        clients_per_step=lanes, output_dir=None, save_models=False, verbose=False)
    exp = build_experiment(cfg, data)
    state, keys = exp.initial_state(), exp.keys()

    def one_round(t, state):
        state, met = exp.round_fn(state, exp.round_data(t), keys)
        return state, jax.device_get(met)

    t0 = time.perf_counter()
    with CompileTimer() as compile_timer:
        state, met = one_round(0, state)
    first = time.perf_counter() - t0
    times, mets = [], []
    for t in range(1, FLAGS.rounds + 1):
        t0 = time.perf_counter()
        state, met = one_round(t, state)
        times.append(time.perf_counter() - t0)
        mets.append(met)
    per_round = median(times)

    def total(key):
        return float(np.mean([float(np.sum(m[key])) for m in mets]))

    real = total("eval_real_examples") + total("train_real_examples")
    padded = total("eval_padded_examples") + total("train_padded_examples")
    kept = total("kept_examples") * (cfg.training.local_epochs)
    return {
        "shape": shape, "clients_per_step": exp.lanes, "eval_chunk": exp.eval_chunk,
        "compile_s": compile_timer.seconds, "first_round_s": first,
        "s_per_round": per_round, "round_times_s": times,
        "real_examples_per_s": real / per_round, "padded_examples_per_s": padded / per_round,
        "padded_over_real": padded / real,
        "eval_padded_over_real": total("eval_padded_examples") / total("eval_real_examples"),
        "train_padded_over_real": total("train_padded_examples") / total("train_real_examples"),
        "trained_over_kept": total("train_real_examples") / kept,
        "clients_kept_per_round": total("num_selected"),
        "critical_path": critical_path(mets, exp.placement),
        "loadavg": os.getloadavg(),
        "peak_rss_mb": peak_rss_mb(),
    }


def main(argv):
    del argv
    if FLAGS._one:
        shape, lanes = FLAGS._one.split(":")
        print("RESULT " + json.dumps(run_one(shape, int(lanes))), flush=True)
        return
    from bench.common import emit, femnist_like_sizes, machine

    sizes = femnist_like_sizes(FLAGS.num_clients, 0)
    result = {"benchmark": "round_speed", "machine": machine(),
              "date": time.strftime("%Y-%m-%d"),
              "population": {"num_clients": FLAGS.num_clients, "m": FLAGS.clients,
                             "median": float(sorted(sizes)[len(sizes) // 2]),
                             "min": int(sizes.min()), "max": int(sizes.max())},
              "theta": 0.5, "local_epochs": 1, "shapes": {}}
    for shape in FLAGS.shapes:
        lanes_list = FLAGS.cnn_lanes if shape == "cnn" else FLAGS.linear_lanes
        result["shapes"][shape] = {}
        for lanes in lanes_list:
            cmd = [sys.executable, "-m", "bench.round_speed", f"--_one={shape}:{lanes}",
                   f"--clients={FLAGS.clients}", f"--num_clients={FLAGS.num_clients}",
                   f"--rounds={FLAGS.rounds}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                result["shapes"][shape][str(lanes)] = {"error": proc.stderr.strip()[-2000:]}
                continue
            result["shapes"][shape][str(lanes)] = json.loads(line[0][len("RESULT "):])
            print(f"# {shape} clients_per_step={lanes}: "
                  f"{result['shapes'][shape][str(lanes)]['s_per_round']:.3f} s/round",
                  file=sys.stderr, flush=True)
    emit(result, FLAGS.out, name=f"round_speed_{result['machine']['backend']}")


if __name__ == "__main__":
    app.run(main)
