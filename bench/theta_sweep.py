r"""r conformity levels (or seeds) in one compiled program against r separate programs.

    python -m bench.theta_sweep --json [--model=linear] [--axis=theta] [--out=...]

For r in ``--r`` (1, 2, 4, 8), the same Delta-FL round (m FEMNIST-like clients, batch 10 or
16, one local epoch) is timed (a) as ONE program training r replicas, the theta values
1.0, 0.8, 0.5, 0.1, 0.9, 0.7, 0.3, 0.2 (or r seeds at theta = 0.5 with ``--axis=seed``), and
(b) as r separate programs of one replica each, as a user without the replica vmap would run
them. All r + 1 programs are built first; their timed rounds are then interleaved (joint,
separate 1, ..., separate r, joint, ...), so that the machine's drift hits both sides alike.
It reports seconds per round of both (medians), their ratio, the seconds to build and run the
first round (compilation included), and the number of XLA backend compilations each needed
(from ``jax.monitoring``).

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
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/theta_sweep_<backend>.json)")
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


class Program:
    """One compiled Delta-FL program over its replicas, built with its round inputs; its
    rounds are run one at a time by :meth:`step`, so that several programs can be timed
    interleaved (A B A B ...)."""

    def __init__(self, data, thetas, seeds, counter):
        import jax

        from deltafl_jax import DataConfig, ExperimentConfig, build_experiment

        bs = 16 if FLAGS.model == "cnn" else 10
        cfg = ExperimentConfig(
            data=DataConfig("femnist_like"), model=FLAGS.model, thetas=tuple(thetas),
            seeds=tuple(seeds), num_rounds=FLAGS.rounds + 1, clients_per_round=FLAGS.clients,
            batch_size=bs, learning_rate=0.05, clients_per_step=FLAGS.clients_per_step,
            output_dir=None, save_models=False, verbose=False)
        self.counter, self.compiles, self.times = counter, 0, []
        t0 = time.perf_counter()
        self.exp = build_experiment(cfg, data)
        self.state, self.keys = self.exp.initial_state(), self.exp.keys()
        self.plans = [self.exp.round_data(t) for t in range(FLAGS.rounds + 1)]
        jax.block_until_ready((self.state, self.plans))
        build_s = time.perf_counter() - t0
        self.first_s = build_s + self.step(0)  # build + the first round, compilation included

    def step(self, t):
        """Runs round t; returns its seconds and counts the compilations it caused."""
        import jax

        def run():
            t0 = time.perf_counter()
            self.state, met = self.exp.round_fn(self.state, self.plans[t], self.keys)
            jax.device_get(met)
            return time.perf_counter() - t0

        seconds, compiles = self.counter.measure(run)
        self.compiles += compiles
        self.times.append(seconds)
        return seconds

    def s_per_round(self):
        from bench.common import median
        return median(self.times[1:])


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
        programs = [Program(data, *joint, counter)]
        programs += [Program(data, th, sd, counter) for th, sd in sets]
        for t in range(1, FLAGS.rounds + 1):  # interleaved: joint, separate 1..r, joint, ...
            for program in programs:
                program.step(t)
        j, sep = programs[0], programs[1:]
        j_round = j.s_per_round()
        s_each = [p.s_per_round() for p in sep]
        s_round = float(np.sum(s_each))
        j_comp = j.compiles
        row = {
            "r": r, "joint_s_per_round": j_round, "separate_s_per_round_total": s_round,
            "separate_s_per_round_each": s_each,
            "ratio_joint_over_separate": j_round / s_round,
            "joint_build_and_first_round_s": j.first_s,
            "separate_build_and_first_round_s_total": float(np.sum([p.first_s for p in sep])),
            "joint_compiles": j_comp, "separate_compiles": int(np.sum([p.compiles for p in sep])),
        }
        rows.append(row)
        print(f"# r={r}: joint {j_round:.3f}s/round vs separate {s_round:.3f}s/round "
              f"(ratio {row['ratio_joint_over_separate']:.2f}); compiles {j_comp} vs "
              f"{row['separate_compiles']}", flush=True)
    emit({"benchmark": "theta_sweep", "model": FLAGS.model, "axis": FLAGS.axis,
          "m": FLAGS.clients, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
          "rows": rows}, FLAGS.out, name=f"theta_sweep_{machine()['backend']}")


if __name__ == "__main__":
    app.run(main)
