r"""r conformity levels (or seeds) in one compiled program against r separate programs.

    python -m bench.theta_sweep --json [--model=linear] [--axis=theta] [--out=...]

For r in ``--r`` (1, 2, 4, 8), the same Delta-FL round (m FEMNIST-like clients, batch 10 or
16, one local epoch) is timed (a) as ONE program training r replicas, the theta values
1.0, 0.8, 0.5, 0.1, 0.9, 0.7, 0.3, 0.2 (or r seeds at theta = 0.5 with ``--axis=seed``), and
(b) as r separate programs of one replica each, run one after the other, as a user without
the replica vmap would. It reports seconds per round of both, their ratio, and the number of
XLA backend compilations each needed (from ``jax.monitoring``).

The joint program's work is the sum of the separate programs' work (the lane executor trains
each replica's kept clients only), so the ratio measures what one program saves: dispatch,
loop overhead, and r - 1 compilations.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

flags.DEFINE_enum("model", "linear", ["linear", "cnn"], "model shape")
flags.DEFINE_enum("axis", "theta", ["theta", "seed"], "what the replicas sweep")
flags.DEFINE_list("r", ["1", "2", "4", "8"], "replica counts")
flags.DEFINE_integer("clients", 100, "m, sampled clients per round")
flags.DEFINE_integer("num_clients", 865, "clients in the population")
flags.DEFINE_integer("rounds", 5, "timed rounds after the first (median reported)")
flags.DEFINE_integer("clients_per_step", None, "engine lanes (default: the backend's)")
flags.DEFINE_bool("json", True, "print one JSON object")
flags.DEFINE_string("out", None, "also write the JSON here")
FLAGS = flags.FLAGS

THETAS = (1.0, 0.8, 0.5, 0.1, 0.9, 0.7, 0.3, 0.2)


class CompileCounter:
    """Counts XLA backend compilations while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, duration, **kwargs):
        if self.active and name == self.EVENT:
            self.count += 1

    def measure(self, fn):
        self.count, self.active = 0, True
        try:
            out = fn()
        finally:
            self.active = False
        return out, self.count


def time_program(data, thetas, seeds, counter):
    """(seconds per round (median), seconds of build + first round, compilations of the
    round program (counted during the rounds; eager set-up work is not counted))."""
    import jax

    from bench.common import median
    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment

    bs = 16 if FLAGS.model == "cnn" else 10
    cfg = ExperimentConfig(
        data=DataConfig("femnist_like"), model=FLAGS.model, thetas=tuple(thetas),
        seeds=tuple(seeds), num_rounds=FLAGS.rounds + 1, clients_per_round=FLAGS.clients,
        batch_size=bs, learning_rate=0.05, clients_per_step=FLAGS.clients_per_step,
        output_dir=None, save_models=False, verbose=False)

    t0 = time.perf_counter()
    exp = build_experiment(cfg, data)
    state, keys = exp.initial_state(), exp.keys()
    plans = [exp.round_data(t) for t in range(FLAGS.rounds + 1)]
    jax.block_until_ready((state, plans))
    t_build = time.perf_counter() - t0

    def rounds():
        nonlocal state
        times = []
        for t in range(FLAGS.rounds + 1):
            t0 = time.perf_counter()
            state, met = exp.round_fn(state, plans[t], keys)
            jax.device_get(met)
            times.append(time.perf_counter() - t0)
        return times

    times, compiles = counter.measure(rounds)
    return median(times[1:]), t_build + times[0], compiles


def main(argv):
    del argv
    from bench.common import emit, femnist_like_dataset, machine

    data = femnist_like_dataset(FLAGS.num_clients, seed=0, flat=FLAGS.model == "linear")
    counter = CompileCounter()
    rows = []
    for r in (int(v) for v in FLAGS.r):
        if FLAGS.axis == "theta":
            sets = [((th,), (1,)) for th in THETAS[:r]]
            joint = (THETAS[:r], (1,))
        else:
            sets = [((0.5,), (s,)) for s in range(1, r + 1)]
            joint = ((0.5,), tuple(range(1, r + 1)))
        j_round, j_first, j_comp = time_program(data, *joint, counter)
        sep = [time_program(data, th, sd, counter) for th, sd in sets]
        s_round = float(np.sum([s[0] for s in sep]))
        row = {
            "r": r, "joint_s_per_round": j_round, "separate_s_per_round_total": s_round,
            "separate_s_per_round_each": [s[0] for s in sep],
            "ratio_joint_over_separate": j_round / s_round,
            "ratio_joint_over_r_times_mean_one": j_round / (r * s_round / r),
            "joint_build_and_first_round_s": j_first,
            "separate_build_and_first_round_s_total": float(np.sum([s[1] for s in sep])),
            "joint_compiles": j_comp, "separate_compiles": int(np.sum([s[2] for s in sep])),
        }
        rows.append(row)
        print(f"# r={r}: joint {j_round:.3f}s/round vs separate {s_round:.3f}s/round "
              f"(ratio {row['ratio_joint_over_separate']:.2f}); compiles {j_comp} vs "
              f"{row['separate_compiles']}", flush=True)
    emit({"benchmark": "theta_sweep", "model": FLAGS.model, "axis": FLAGS.axis,
          "m": FLAGS.clients, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
          "rows": rows}, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
