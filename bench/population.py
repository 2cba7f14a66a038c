r"""Population scale: s/round, build time, evaluation time, peak host memory and device bytes
as the population grows from 10^3 to 10^6 clients, with the clients kept on the host.

    python -m bench.population                       # N = 10^3 .. 10^6 (about 15 min, 2 cores)
    python -m bench.population --sizes=1000,1000000 --rounds=10

Synthetic(1, 1) with rho = 0.98, softmax regression, m = 100 clients per round, Delta-FL at
theta in {1, 0.5} (one seed), batch 10, one local epoch, learning rate 0.02, and
``--eval_clients=1000``. Every population is generated on demand (the same generator at every
N, so the client sizes follow one distribution) and kept on the host
(``--client_data=host``): each round ships the sampled clients' examples. One more row runs
N = 10^3 as the default does, both splits on the device (the sequential generator).

A second table runs the FEMNIST-shaped bench data (:func:`bench.common.femnist_like_dataset`:
865 writers of FEMNIST's Table 1 sizes, 28x28 uint8 images, held in memory) with the splits on
the device and on the host, for softmax regression at m = 100 and the ConvNet at m = 10
(``--femnist_models``): the cost of shipping each round's clients instead of indexing a
device-resident split. The two modes run in one process, their rounds interleaved (each with
its own prefetch), so that the machine's load affects both alike.

Each row runs in its own process, one after another (its peak RSS is its own): build
(generation of the population's sizes, the experiment, compiles), one warm-up round, then
``--rounds`` timed rounds as the run loop does them (round t+1's buffer is built on the host
while the device runs round t), then one warm-up and ``--evals`` timed evaluations. s/round
is the median; the work of a round depends on which clients are sampled, so each row also
gives the seconds per 1000 trained examples. Device bytes are the footprint the start-up line
shows (:mod:`deltafl_jax.run.placement`). Writes JSON (``--out``, default
bench/results/population_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000,10000,100000,1000000", help="populations N")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per population")
    p.add_argument("--evals", type=int, default=2, help="timed evaluations per population")
    p.add_argument("--eval_clients", type=int, default=1000)
    p.add_argument("--clients", type=int, default=100, help="m, clients per round")
    p.add_argument("--femnist_models", default="linear:100,cnn:10",
                   help="MODEL:m pairs of the FEMNIST-shaped host/device table ('' to skip)")
    p.add_argument("--no_device_row", action="store_true",
                   help="skip the N = 10^3 row with the splits on the device")
    p.add_argument("--out", default=None)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: one row, as JSON
    return p.parse_args(argv)


def _config(n: int, mode: str, args):
    from deltafl_jax import DataConfig, ExperimentConfig
    data = DataConfig(dataset="synthetic", synthetic_num_clients=n, synthetic_alpha=1.0,
                      synthetic_beta=1.0, synthetic_shared=0.98,
                      synthetic_on_demand=mode == "host")
    return ExperimentConfig(data=data, model="linear", algorithm="deltafl", thetas=(1.0, 0.5),
                            seeds=(1,), num_rounds=10 ** 6, clients_per_round=args.clients,
                            batch_size=10, learning_rate=0.02, save_models=False,
                            client_data=mode, eval_clients=args.eval_clients)


def _femnist_config(model: str, m: int, mode: str):
    from deltafl_jax import DataConfig, ExperimentConfig
    return ExperimentConfig(data=DataConfig("npz"), model=model, algorithm="deltafl",
                            thetas=(1.0, 0.5), seeds=(1,), num_rounds=10 ** 6,
                            clients_per_round=m, batch_size=16 if model == "cnn" else 10,
                            learning_rate=0.02, save_models=False, client_data=mode,
                            eval_clients=0)


def _timed_rounds(exp, state, keys, rounds: int):
    """(per-round seconds, trained examples per round), the loop's prefetch pattern."""
    from deltafl_jax.engine.mesh import tree_to_host
    times, examples = [], []
    pending = exp.round_data(1)
    for t in range(1, rounds + 1):
        t0 = time.perf_counter()
        state, metrics = exp.round_fn(state, pending, keys)
        pending = exp.round_data(t + 1)
        metrics = tree_to_host(metrics)
        times.append(time.perf_counter() - t0)
        examples.append(int(metrics["train_real_examples"]))
    return state, times, examples


def _row(n: int, mode: str, args) -> dict:
    """One population, measured in this process."""
    import jax
    import numpy as np

    from bench.common import peak_rss_mb
    from deltafl_jax.datasets import load_dataset
    from deltafl_jax.run.experiment import build_experiment

    t0 = time.perf_counter()
    config = _config(n, mode, args)
    data = load_dataset(config.data)
    exp = build_experiment(config, data)
    state, keys = exp.initial_state(), exp.keys()
    state, _ = exp.round_fn(state, exp.round_data(0), keys)   # compiles
    jax.block_until_ready(state)
    build_s = time.perf_counter() - t0
    state, times, examples = _timed_rounds(exp, state, keys, args.rounds)
    params = exp.served_params(state)
    exp.summarize(exp.evaluate(params, 0))                    # compiles the evaluation
    eval_times = []
    for e in range(args.evals):
        t1 = time.perf_counter()
        exp.summarize(exp.evaluate(params, e + 1))
        eval_times.append(time.perf_counter() - t1)
    fp = exp.program.footprint
    return {"clients": n, "model": config.training.model, "m": config.training.clients_per_round,
            "client_data": exp.placement.client_data,
            "generated_on_demand": mode == "host", "eval_clients": exp.evaluator.eval_clients,
            "build_s": round(build_s, 3), "s_per_round": float(np.median(times)),
            "round_s": [round(t, 4) for t in times],
            "s_per_1000_trained_examples": float(1000 * np.sum(times) / np.sum(examples)),
            "trained_examples_per_round": float(np.mean(examples)),
            "eval_s": float(np.median(eval_times)), "peak_rss_mb": round(peak_rss_mb(), 1),
            "device_bytes": int(fp.total), "device_data_bytes": int(fp.data)}


def _femnist_pair(model: str, m: int, rounds: int) -> list:
    """Device and host modes of one FEMNIST-shaped setting, rounds interleaved."""
    import jax
    import numpy as np

    from bench.common import femnist_like_dataset
    from deltafl_jax.engine.mesh import tree_to_host
    from deltafl_jax.run.experiment import build_experiment

    data = femnist_like_dataset(flat=model == "linear", num_test_clients=100)
    modes = ("device", "host")
    exps = {k: build_experiment(_femnist_config(model, m, k), data) for k in modes}
    state, keys, pending, times = {}, {}, {}, {k: [] for k in modes}
    for k, exp in exps.items():
        keys[k] = exp.keys()
        state[k], _ = exp.round_fn(exp.initial_state(), exp.round_data(0), keys[k])
        jax.block_until_ready(state[k])
        pending[k] = exp.round_data(1)
    for t in range(1, rounds + 1):
        for k, exp in exps.items():
            t0 = time.perf_counter()
            state[k], metrics = exp.round_fn(state[k], pending[k], keys[k])
            pending[k] = exp.round_data(t + 1)
            tree_to_host(metrics)
            times[k].append(time.perf_counter() - t0)
    return [{"model": model, "m": m, "client_data": k, "s_per_round": float(np.median(v)),
             "round_s": [round(x, 4) for x in v],
             "device_bytes": int(exps[k].program.footprint.total),
             "device_data_bytes": int(exps[k].program.footprint.data)} for k, v in times.items()]


def _run_row(n, mode: str, argv):
    cmd = [sys.executable, "-m", "bench.population", *argv, f"--row={n}:{mode}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.row:
        n, mode = args.row.split(":")
        if n == "femnist":   # MODEL-m: both modes
            model, m = mode.split("-")
            print(json.dumps(_femnist_pair(model, int(m), args.rounds)))
        else:
            print(json.dumps(_row(int(n), mode, args)))
        return
    from bench.common import backend_name, emit, machine
    passed = [a for a in argv if not a.startswith("--out")]
    plan = [(int(n), "host") for n in args.sizes.split(",")]
    if not args.no_device_row:
        plan.insert(0, (min(n for n, _ in plan), "device"))
    rows = []
    for n, mode in plan:
        rows.append(_run_row(n, mode, passed))
        print(f"population: N={n} {mode}: {rows[-1]['s_per_round']:.3f} s/round, "
              f"eval {rows[-1]['eval_s']:.2f} s, build {rows[-1]['build_s']:.1f} s, "
              f"RSS {rows[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    femnist = []
    for pair in filter(None, args.femnist_models.split(",")):
        model, m = pair.split(":")
        pair = _run_row("femnist", f"{model}-{m}", passed)
        femnist.extend(pair)
        print(f"population: FEMNIST-shaped {model} m={m}: device {pair[0]['s_per_round']:.3f}, "
              f"host {pair[1]['s_per_round']:.3f} s/round", file=sys.stderr, flush=True)
    host = [r for r in rows if r["client_data"] == "host"]
    small, large = host[0], host[-1]
    result = {"benchmark": "population", "machine": machine(), "settings": {
        "dataset": "synthetic(1, 1), rho = 0.98", "model": "linear", "m": args.clients,
        "thetas": [1.0, 0.5], "eval_clients": args.eval_clients, "timed_rounds": args.rounds},
        "rows": rows,
        "ratios": {
            "s_per_round_largest_over_smallest": large["s_per_round"] / small["s_per_round"],
            "s_per_1000_examples_largest_over_smallest":
                large["s_per_1000_trained_examples"] / small["s_per_1000_trained_examples"],
            "device_bytes_largest_over_smallest": large["device_bytes"] / small["device_bytes"],
            "largest_peak_rss_gb": large["peak_rss_mb"] / 1024,
            "femnist_host_over_device": {
                f"{d['model']}, m = {d['m']}": h["s_per_round"] / d["s_per_round"]
                for d, h in zip(femnist[::2], femnist[1::2])}},
        "femnist_rows": femnist}
    emit(result, args.out, name=f"population_{backend_name()}")


if __name__ == "__main__":
    main()
