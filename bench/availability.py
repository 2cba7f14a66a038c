r"""The cost of client availability: s/round with ``--availability`` against the fixed sampler
over every client, and with ``markov`` availability at N = 10^3 against 10^6 and 2 x 10^6
generated clients, each comparison's rounds interleaved in one process.

    python -m bench.availability --out=bench/results/availability_cpu.json
    python -m bench.availability --models=linear:100 --rounds=3 --sizes=1000,100000

The comparisons run one after another, each in its own process (its peak RSS is its own; the
markov process holds every population at once, so its peak bounds the largest one's):

- **bernoulli, FEMNIST-shaped, per model** (``--models``, MODEL:m pairs): the bench data of
  :func:`bench.common.femnist_like_dataset` (865 writers held in memory, splits on the device),
  Delta-FL theta in {1, 0.5}, the fixed sampler over every client (``--availability=always``)
  against ``--availability=bernoulli --availability_p=P`` (``--bernoulli_p``, high enough that
  at least m of the 865 are online in every round, so both draw m clients).
- **markov, generated populations** (``--sizes``, each N against the smallest): Synthetic(1, 1)
  with rho = 0.98, N generated clients (half of them training clients, as
  :mod:`bench.population` counts them), generated on demand and kept on the host
  (``--client_data=host``), softmax regression, ``--eval_clients=1000``,
  m = ``--clients``, ``--availability=markov --availability_p=P`` (``--markov_p``) with the
  default off -> on probability: every round draws one step of N two-state chains, the fixed
  sampler's m among the online, and counts each client's online and sampled rounds.

Every round is timed as the run loop does it (round t+1's online set, cohort, plan and buffer are
made on the host while the device runs round t; round t's metrics are then read back and the
round counted in the participation record), and split into its host part: ``online`` (the
availability model's draw of round t+1), ``plan`` (the sampler's cohort among them and the round
plan), ``ship`` (the buffer packed, when the host keeps the split, and put on the device),
``count`` (round t's participation counts); and ``wait``: the time left blocked on the device
after the host's work (the device part the host work did not hide). s/round and each part are
medians over ``--rounds`` timed rounds after one warm-up round (which compiles). The rounds of a
comparison alternate (A, B, A, B, ...), so that the machine's load affects all alike; the
ratios are of the medians, and (``_per_round``) the median, min and max of the per-round
ratios, round t of one row against round t of the other. Writes JSON
(``--out``, default bench/out/availability_<backend>.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.common import SteppedRun

PARTS = ("online", "plan", "ship", "count", "wait")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="linear:100,cnn:10",
                   help="MODEL:m pairs of the bernoulli comparison ('' to skip)")
    p.add_argument("--bernoulli_p", type=float, default=0.5,
                   help="--availability_p of the bernoulli rows")
    p.add_argument("--sizes", default="1000,1000000,2000000",
                   help="the generated populations N of the markov comparison, each against "
                        "the smallest ('' to skip)")
    p.add_argument("--markov_p", type=float, default=0.5,
                   help="--availability_p of the markov rows (stationary on-probability)")
    p.add_argument("--clients", type=int, default=100, help="m of the markov comparison")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per row")
    p.add_argument("--cnn_rounds", type=int, default=None,
                   help="timed rounds of the ConvNet rows (default: --rounds)")
    p.add_argument("--out", default=None)
    p.add_argument("--pair", default=None, help=argparse.SUPPRESS)  # internal: one pair, JSON
    return p.parse_args(argv)


def _online(model: str, p: float):
    from deltafl_jax.sampling.availability import AvailabilitySettings
    return AvailabilitySettings(model=model, p=p)


def _femnist_config(model: str, m: int, availability: str, p: float):
    from deltafl_jax import DataConfig, ExperimentConfig
    return ExperimentConfig(data=DataConfig("npz"), model=model, algorithm="deltafl",
                            thetas=(1.0, 0.5), seeds=(1,), num_rounds=10 ** 6,
                            clients_per_round=m, batch_size=16 if model == "cnn" else 10,
                            learning_rate=0.02, save_models=False, client_data="device",
                            eval_clients=0, online=_online(availability, p))


def _synthetic_config(n: int, m: int, p: float):
    from deltafl_jax import DataConfig, ExperimentConfig
    data = DataConfig(dataset="synthetic", synthetic_num_clients=n, synthetic_alpha=1.0,
                      synthetic_beta=1.0, synthetic_shared=0.98, synthetic_on_demand=True)
    return ExperimentConfig(data=data, model="linear", algorithm="deltafl", thetas=(1.0, 0.5),
                            seeds=(1,), num_rounds=10 ** 6, clients_per_round=m,
                            batch_size=10, learning_rate=0.02, save_models=False,
                            client_data="host", eval_clients=1000,
                            online=_online("markov", p))


class _Timed(SteppedRun):
    """One experiment stepped round by round as the run loop does, each part timed, and the
    number of clients online in every round."""

    def __init__(self, exp):
        if exp.algorithm.probe is not None or exp.algorithm.sampling is not None:
            raise ValueError("bench.availability times algorithms without a probe or a "
                             "state-driven sampler")
        super().__init__(exp, extras=("online_clients",))

    def step(self, t: int) -> None:
        _, counted = super().step(t)
        self.parts["online_clients"].append(int(counted["num_online"][0]) if counted else
                                            self.exp.data.train.num_clients)

    def row(self, **labels) -> dict:
        import numpy as np
        from bench.common import median
        p = self.parts
        fp = self.exp.program.footprint
        return {**labels, "s_per_round": median(p["round"]),
                "host_s": self.host_s(), **{f"{k}_s": median(p[k]) for k in PARTS},
                "round_s": [round(x, 4) for x in p["round"]],
                "s_per_1000_trained_examples":
                    float(1000 * np.sum(p["round"]) / np.sum(p["trained_examples"])),
                "trained_examples_per_round": float(np.mean(p["trained_examples"])),
                "online_clients_per_round": float(np.mean(p["online_clients"])),
                "device_bytes": int(fp.total)}


def _interleaved(exps: dict, rounds: int) -> dict:
    """Rounds of every experiment alternated; {label: _Timed}."""
    timed = {k: _Timed(e) for k, e in exps.items()}
    for t in range(1, rounds + 1):
        for tm in timed.values():
            tm.step(t)
    return timed


def _bernoulli_pair(model: str, m: int, p: float, rounds: int) -> dict:
    from bench.common import femnist_like_dataset, peak_rss_mb
    from deltafl_jax.run.experiment import build_experiment
    data = femnist_like_dataset(flat=model == "linear", num_test_clients=100)
    exps = {a: build_experiment(_femnist_config(model, m, a, p), data)
            for a in ("always", "bernoulli")}
    timed = _interleaved(exps, rounds)
    rows = [tm.row(model=model, m=m, availability=a,
                   availability_p=1.0 if tm.exp.config.online.chosen.everyone else p,
                   clients=data.train.num_clients, train_clients=data.train.num_clients)
            for a, tm in timed.items()]
    return {"rows": rows, "peak_rss_mb": round(peak_rss_mb(), 1)}


def _markov_pair(sizes, m: int, p: float, rounds: int) -> dict:
    from bench.common import peak_rss_mb
    from deltafl_jax.datasets import load_dataset
    from deltafl_jax.run.experiment import build_experiment
    exps = {}
    for n in sizes:
        config = _synthetic_config(n, m, p)
        exps[n] = build_experiment(config, load_dataset(config.data))
    timed = _interleaved(exps, rounds)
    rows = [tm.row(model="linear", m=m, availability="markov", availability_p=p, clients=n,
                   train_clients=tm.exp.data.train.num_clients) for n, tm in timed.items()]
    return {"rows": rows, "peak_rss_mb": round(peak_rss_mb(), 1)}


def _run_pair(spec: str, argv) -> dict:
    cmd = [sys.executable, "-m", "bench.availability", *argv, f"--pair={spec}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _one_pair(args) -> dict:
    kind, _, what = args.pair.partition(":")
    if kind == "femnist":   # always against bernoulli on a FEMNIST-like dataset
        model, m = what.split("-")
        rounds = args.cnn_rounds if model == "cnn" and args.cnn_rounds else args.rounds
        return _bernoulli_pair(model, int(m), args.bernoulli_p, rounds)
    return _markov_pair([int(n) for n in what.split("-")], args.clients, args.markov_p,
                        args.rounds)


def _ratio(a: dict, b: dict, key: str = "s_per_round") -> float:
    return a[key] / b[key]


def _paired(a: dict, b: dict) -> dict:
    """The per-round ratios of interleaved rows a / b (round t of a against round t of b):
    their median, min and max."""
    import numpy as np
    r = np.asarray(a["round_s"]) / np.asarray(b["round_s"])
    return {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max())}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.pair:
        print(json.dumps(_one_pair(args)))
        return
    from bench.common import backend_name, emit, machine
    passed = [a for a in argv if not a.startswith("--out")]
    result = {"benchmark": "availability", "machine": machine(),
              "settings": {"models": args.models, "bernoulli_p": args.bernoulli_p,
                           "sizes": args.sizes, "markov_p": args.markov_p,
                           "markov_m": args.clients, "rounds": args.rounds,
                           "cnn_rounds": args.cnn_rounds or args.rounds,
                           "algorithm": "deltafl, thetas (1.0, 0.5), one seed"},
              "bernoulli": [], "ratios": {}}
    for pair in filter(None, args.models.split(",")):
        model, m = pair.split(":")
        got = _run_pair(f"femnist:{model}-{m}", passed)
        fixed, bern = got["rows"]
        key = f"{model}, m = {m}"
        result["bernoulli"].append(got)
        result["ratios"][f"bernoulli_over_fixed ({key})"] = _ratio(bern, fixed)
        result["ratios"][f"bernoulli_over_fixed_per_round ({key})"] = _paired(bern, fixed)
        print(f"availability: {key}: fixed {fixed['s_per_round']:.3f}, bernoulli "
              f"{bern['s_per_round']:.3f} s/round", file=sys.stderr, flush=True)
    if args.sizes:
        sizes = sorted(int(n) for n in args.sizes.split(","))
        got = _run_pair("synthetic:" + "-".join(map(str, sizes)), passed)
        result["markov"] = got
        small = got["rows"][0]
        for row in got["rows"][1:]:
            n = row["clients"]
            result["ratios"][f"markov_N{n}_over_N{small['clients']}"] = _ratio(row, small)
            result["ratios"][f"markov_N{n}_over_N{small['clients']}_per_round"] = _paired(
                row, small)
            result["ratios"][f"markov_per_example_N{n}_over_N{small['clients']}"] = _ratio(
                row, small, "s_per_1000_trained_examples")
        result["ratios"]["markov_peak_rss_gb"] = got["peak_rss_mb"] / 1024
        print("availability: markov " + ", ".join(
            f"N={r['clients']} {r['s_per_round']:.3f}" for r in got["rows"])
            + f" s/round, RSS {got['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    emit(result, args.out, name=f"availability_{backend_name()}")


if __name__ == "__main__":
    main()
