r"""How the round scales across devices: the work dealt to each device, the balance, the trips
on the critical path, and s/round, for D = 1, 2, 4, 8.

    python -m bench.scaling                          # 8 fake CPU devices (XLA flag set here)
    python -m bench.scaling --platform=gpu --devices=1,2,4,8   # real devices (see README)

At m = 100 of 865 FEMNIST-sized clients (:mod:`bench.common`) and R = 4 replicas (theta = 1,
0.8, 0.5, 0.1; one seed), for each D it reports, per round and averaged over the timed rounds:

- each device's jobs, loop trips and real examples (``device_train_*`` of the round metrics);
- the imbalance, max / mean of the per-device trips;
- the trips on the critical path: evaluation trips + training trips of the busiest device,
  the sequential loop steps that bound an accelerator's latency;
- s/round (median). On fake CPU devices the D "devices" share the machine's cores, so s/round
  does not fall with D there; the trips do, and they are what a real mesh runs in parallel.

Writes JSON (``--out``, default bench/results/scaling_cpu.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--platform", default="cpu", help="cpu: fake devices; gpu / tpu: real")
    p.add_argument("--model", default="linear", choices=("linear", "cnn"))
    p.add_argument("--clients", type=int, default=100, help="m, clients per round")
    p.add_argument("--num_clients", type=int, default=865,
                   help="clients in the population (fewer: a smoke run)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    p.add_argument("--lanes", type=int, default=None, help="--clients_per_step per device")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _measure(data, model, m, D, rounds, lanes):
    import jax
    import numpy as np

    from deltafl_jax import DataConfig, ExperimentConfig, build_experiment

    cfg = ExperimentConfig(data=DataConfig("npz"), model=model, thetas=(1.0, 0.8, 0.5, 0.1),
                           seeds=(1,), clients_per_round=m, batch_size=16 if model == "cnn"
                           else 10, learning_rate=0.05, devices=D, clients_per_step=lanes,
                           output_dir=None, save_models=False, verbose=False)
    exp = build_experiment(cfg, data)
    state, keys = exp.initial_state(), exp.keys()
    times, per_round = [], []
    for t in range(rounds + 1):
        t0 = time.perf_counter()
        state, met = exp.round_fn(state, exp.round_data(t), keys)
        met = jax.tree.map(np.asarray, jax.device_get(met))
        if t:
            times.append(time.perf_counter() - t0)
            per_round.append(met)
    trips = np.stack([m_["device_train_trips"] for m_ in per_round]).astype(float)
    return {
        "devices": D, "lanes_per_device": exp.lanes, "s_per_round": statistics.median(times),
        "device_jobs": np.mean([m_["device_train_jobs"] for m_ in per_round], 0).tolist(),
        "device_trips": trips.mean(0).tolist(),
        "device_examples": np.mean([m_["device_train_examples"] for m_ in per_round],
                                   0).tolist(),
        "imbalance": float(np.mean(trips.max(1) / trips.mean(1))),
        "critical_path_trips": float(np.mean([int(m_["eval_trips"]) + int(m_["train_trips"])
                                              for m_ in per_round])),
        "train_trips": float(np.mean([int(m_["train_trips"]) for m_ in per_round])),
        "eval_trips": float(np.mean([int(m_["eval_trips"]) for m_ in per_round])),
        "kept_jobs": float(np.mean([int(np.sum(m_["num_selected"])) for m_ in per_round])),
    }


def main(argv=None):
    args = _parse(argv)
    devices = [int(d) for d in args.devices.split(",")]
    if args.platform == "cpu":
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={max(devices)}")
    import jax
    from bench import paths
    from bench.common import emit, femnist_like_dataset, machine

    data = femnist_like_dataset(num_clients=args.num_clients, flat=args.model == "linear")
    rows = []
    for D in devices:
        row = _measure(data, args.model, args.clients, D, args.rounds, args.lanes)
        rows.append(row)
        print(f"D={D}: {row['s_per_round']:.3f} s/round, critical path "
              f"{row['critical_path_trips']:.0f} trips, imbalance {row['imbalance']:.3f}, "
              f"trips per device {[round(t) for t in row['device_trips']]}", flush=True)
    out = args.out or paths.default_out(f"scaling_{jax.default_backend()}")
    emit({"benchmark": "scaling", "model": args.model, "clients_per_round": args.clients,
          "replicas": 4, "platform": args.platform, "machine": machine(), "rows": rows}, out)


if __name__ == "__main__":
    sys.exit(main())
