r"""The cost of a FedBuff server step of K jobs against a synchronous FedAvg round of K clients.

    python -m bench.fedbuff_step [--shapes=linear,cnn] [--buffer_size=10] [--repeats=7] \
        [--out=bench/results/fedbuff_step_cpu.json]

Both on the same FEMNIST-like population, model, batch and lanes: the FedAvg round is the
experiment's jitted round (``--algorithm=fedavg``, m = K); the FedBuff step is
:class:`deltafl_jax.asynchronous.run.BufferedRun`'s (C = 2K jobs in flight, lognormal job
times), the host's event simulation and plan included, as the round's plan is. The two are
timed interleaved, one of each in turn after a warm-up; the JSON (``--out``, by default the
git-ignored ``bench/out/fedbuff_step.json``) holds each shape's medians, their ratio, every
timing and the machine's load average before and after.
"""

from __future__ import annotations

import time

from absl import app, flags

flags.DEFINE_list("shapes", ["linear", "cnn"], "model shapes to time")
flags.DEFINE_integer("buffer_size", 10, "K: the FedBuff buffer, and FedAvg's m")
flags.DEFINE_integer("num_clients", 200, "training clients")
flags.DEFINE_integer("repeats", 7, "timed steps of each (interleaved)")
flags.DEFINE_integer("lanes", 2, "clients_per_step of both")
flags.DEFINE_string("out", None, "the JSON (default bench/out/fedbuff_step.json)")
FLAGS = flags.FLAGS

SHAPES = {"linear": dict(model="linear", batch_size=10, flat=True),
          "cnn": dict(model="cnn", batch_size=16, flat=False)}


def time_shape(shape: str) -> dict:
    import jax
    import numpy as np

    from bench.common import femnist_like_dataset, median
    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment, engine
    from deltafl_jax.algorithms.buffered.fedbuff import RULE
    from deltafl_jax.asynchronous.run import BufferedRun
    from deltafl_jax.asynchronous.step import init_buffered_state
    from deltafl_jax.asynchronous.scheduler import AsyncSettings

    spec, K = SHAPES[shape], FLAGS.buffer_size
    data = femnist_like_dataset(FLAGS.num_clients, seed=0, flat=spec["flat"])
    cfg = ExperimentConfig(data=DataConfig("femnist_like"), model=spec["model"],
                           algorithm="fedavg", thetas=(), seeds=(1,), num_rounds=100,
                           clients_per_round=K, batch_size=spec["batch_size"],
                           learning_rate=0.05, clients_per_step=FLAGS.lanes, output_dir=None,
                           save_models=False, verbose=False)
    exp = build_experiment(cfg, data)
    place = exp.placement
    local = engine.LocalSGDConfig(batch_size=cfg.training.batch_size, lanes=place.lanes,
                                  lane_mode=place.lane_mode, unroll=place.unroll,
                                  branchless=place.branchless, order_lanes=place.order_lanes,
                                  optimizer=cfg.client.transformation)
    speeds = np.random.default_rng(0).lognormal(0.0, 1.0, FLAGS.num_clients)
    run = BufferedRun(exp.model, exp.replicas, local, rule=RULE, seeds=(1,),
                      settings=AsyncSettings(2 * K, K, None), offsets=data.train.offsets,
                      work=exp.run.work, seconds=lambda ids: speeds[ids])
    sync_state, keys = exp.initial_state(), exp.keys()
    async_state = init_buffered_state(sync_state.params, run.schedulers[0].V)
    x, y = jax.device_put(data.train.x), jax.device_put(data.train.y)
    sync_t, async_t, t = [], [], [0]

    def sync_round():
        nonlocal sync_state
        sync_state, m = exp.round_fn(sync_state, exp.round_data(t[0]), keys)
        jax.block_until_ready(sync_state.params)

    def async_step():
        nonlocal async_state
        async_state, m = run.step(async_state, x, y, keys)
        jax.block_until_ready(async_state.ring)

    for _ in range(2):   # compile and warm up
        sync_round(), async_step()
        t[0] += 1
    for _ in range(FLAGS.repeats):
        for fn, out in ((sync_round, sync_t), (async_step, async_t)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        t[0] += 1
    return {"fedavg_round_s": median(sync_t), "fedbuff_step_s": median(async_t),
            "ratio": median(async_t) / median(sync_t), "K": K, "lanes": place.lanes,
            "backend": jax.default_backend(), "fedavg_round_times_s": sync_t,
            "fedbuff_step_times_s": async_t}


def main(argv):
    del argv
    import os

    from bench.common import emit, machine
    load_before = os.getloadavg()[0]
    shapes = {shape: time_shape(shape) for shape in FLAGS.shapes}
    result = {"benchmark": "fedbuff_step", "machine": machine(), "buffer_size": FLAGS.buffer_size,
              "num_clients": FLAGS.num_clients, "repeats": FLAGS.repeats,
              "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
              "shapes": shapes}
    emit(result, FLAGS.out, summary=[
        f"{k}: FedBuff step {v['fedbuff_step_s']:.4g} s, FedAvg round {v['fedavg_round_s']:.4g} s,"
        f" ratio {v['ratio']:.3f}" for k, v in shapes.items()])


if __name__ == "__main__":
    app.run(main)
