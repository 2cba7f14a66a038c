r"""The cost of the virtual clock on a synchronous run: s/round with ``--client_speed=lognormal``
and no deadline (the clock alone: it only measures, the cohorts and models are the same)
against ``--client_speed=none``, the two runs' rounds interleaved in one process.

    python -m bench.virtual_clock --out=bench/results/virtual_clock_cpu.json
    python -m bench.virtual_clock --models=linear:5 --rounds=2        # toy size

Per model (``--models``, MODEL:m pairs; linear and the ConvNet at small size by default), the
bench data of :func:`bench.common.femnist_like_dataset` (865 writers, splits on the device),
Delta-FL theta in {1, 0.5}, one seed, m clients a round, one local epoch: two experiments that
differ only by ``--client_speed``, built in one process (its own per model). Every round is
timed as the run loop does it: round t on the device, round t+1's plan made on the host
meanwhile (with the clock: each selected client's job time and who finishes,
:meth:`deltafl_jax.sampling.timeline.VirtualClock.select`) and put on the device, round t's
metrics read back, then round t counted (with the clock: its virtual end and each client's
rounds selected and dropped, :meth:`~deltafl_jax.sampling.timeline.VirtualClock.count`). The
parts: ``plan`` (cohort, clock and round plan), ``ship`` (the plan and examples put on the
device), ``wait`` (blocked on the device after the host's work), ``count``. s/round and each
part are medians over ``--rounds`` timed rounds after one warm-up round (which compiles); the
rounds alternate (none, clock, none, clock, ...), so that the machine's load affects both
alike; the ratio is of the medians, with the median, min and max of the per-round ratios.
Writes JSON (``--out``, default bench/out/virtual_clock_<backend>.json), with the load average
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import SteppedRun

PARTS = ("plan", "ship", "count", "wait")
SPEEDS = ("none", "lognormal")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="linear:100,cnn:10", help="MODEL:m pairs")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per row")
    p.add_argument("--cnn_rounds", type=int, default=None,
                   help="timed rounds of the ConvNet rows (default: --rounds)")
    p.add_argument("--out", default=None)
    p.add_argument("--pair", default=None, help=argparse.SUPPRESS)  # internal: one pair, JSON
    return p.parse_args(argv)


def _config(model: str, m: int, client_speed: str):
    from deltafl_jax import DataConfig, ExperimentConfig
    from deltafl_jax.sampling.speeds import TimingSettings
    return ExperimentConfig(data=DataConfig("npz"), model=model, algorithm="deltafl",
                            thetas=(1.0, 0.5), seeds=(1,), num_rounds=10 ** 6,
                            clients_per_round=m, batch_size=16 if model == "cnn" else 10,
                            learning_rate=0.02, save_models=False, client_data="device",
                            eval_clients=0, timing=TimingSettings(client_speed=client_speed))


class _Timed(SteppedRun):
    """One experiment stepped round by round as the run loop does, each part timed, and the
    clock's virtual time at the end of every round."""

    def __init__(self, exp):
        super().__init__(exp, extras=("virtual_time",))

    def step(self, t: int) -> None:
        _, counted = super().step(t)
        vt = counted.get("virtual_time")
        self.parts["virtual_time"].append(None if vt is None else float(vt[0]))

    def row(self, **labels) -> dict:
        from bench.common import median
        p = self.parts
        return {**labels, "s_per_round": median(p["round"]),
                **{f"{k}_s": median(p[k]) for k in PARTS},
                "host_s": self.host_s(("plan", "ship", "count")),
                "round_s": [round(x, 5) for x in p["round"]],
                "trained_examples": p["trained_examples"],
                "virtual_time_end": p["virtual_time"][-1]}


def _pair(model: str, m: int, rounds: int) -> dict:
    from bench.common import femnist_like_dataset, peak_rss_mb
    from deltafl_jax.run.experiment import build_experiment
    data = femnist_like_dataset(flat=model == "linear", num_test_clients=100)
    timed = {s: _Timed(build_experiment(_config(model, m, s), data)) for s in SPEEDS}
    for t in range(1, rounds + 1):
        for tm in timed.values():
            tm.step(t)
    rows = [tm.row(model=model, m=m, client_speed=s) for s, tm in timed.items()]
    return {"rows": rows, "peak_rss_mb": round(peak_rss_mb(), 1)}


def _run_pair(spec: str, argv) -> dict:
    cmd = [sys.executable, "-m", "bench.virtual_clock", *argv, f"--pair={spec}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _paired(a: dict, b: dict) -> dict:
    """The per-round ratios of interleaved rows a / b: their median, min and max."""
    import numpy as np
    r = np.asarray(a["round_s"]) / np.asarray(b["round_s"])
    return {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max())}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.pair:
        model, m = args.pair.split("-")
        rounds = args.cnn_rounds if model == "cnn" and args.cnn_rounds else args.rounds
        print(json.dumps(_pair(model, int(m), rounds)))
        return
    from bench.common import backend_name, emit, machine
    passed = [a for a in argv if not a.startswith("--out")]
    result = {"benchmark": "virtual_clock", "machine": machine(),
              "load_average_before": os.getloadavg(),
              "settings": {"models": args.models, "rounds": args.rounds,
                           "cnn_rounds": args.cnn_rounds or args.rounds,
                           "algorithm": "deltafl, thetas (1.0, 0.5), one seed, one local "
                                        "epoch; clock: --client_speed=lognormal, no deadline"},
              "pairs": [], "ratios": {}}
    for pair in filter(None, args.models.split(",")):
        model, m = pair.split(":")
        got = _run_pair(f"{model}-{m}", passed)
        plain, clocked = got["rows"]
        key = f"{model}, m = {m}"
        result["pairs"].append(got)
        result["ratios"][f"clock_over_none ({key})"] = \
            clocked["s_per_round"] / plain["s_per_round"]
        result["ratios"][f"clock_over_none_per_round ({key})"] = _paired(clocked, plain)
        print(f"virtual_clock: {key}: none {plain['s_per_round']:.4f}, clock "
              f"{clocked['s_per_round']:.4f} s/round", file=sys.stderr, flush=True)
    result["load_average_after"] = os.getloadavg()
    emit(result, args.out, name=f"virtual_clock_{backend_name()}")


if __name__ == "__main__":
    main()
