r"""Who finishes, and when: the synchronous rounds of FedAvg, FedNova and Delta-FL and
FedBuff's buffered asynchronous steps on the virtual clock, compared by virtual time
(docs/results/timing.md).

    python -m bench.timing_comparison --out=bench/results/timing_comparison_cpu.json
    python -m bench.timing_comparison --rounds=4 --seeds=1 --eval_every=2   # toy size
    python -m bench.timing_comparison --reuse    # read the runs already written again
    python -m bench.timing_comparison --reuse=no_deadline,partial_work  # run only the others
    python -m bench.timing_comparison --flagfiles=shakespeare --seeds=1 --virtual_hours=0.125

Every run is ``experiments/async_synthetic.flags`` (Synthetic(1, 0.5), 200 training clients,
softmax regression, m = 20, one local epoch, FedScale's lognormal device speeds, Markov
availability with p = 0.5), 3 seeds, each run until the same virtual time (``--virtual_hours``,
1 h: ``--stop_at_virtual_time``), in three synchronous settings and an asynchronous one, each
run by ``python -m experiments.run`` in its own process, one after another:

- ``no_deadline``: FedAvg and Delta-FL (theta 0.8, 0.5), no deadline and no over-selection
  (the flags' ``--round_deadline`` and ``--over_select`` removed): every round waits for its
  slowest client;
- ``deadline_overselect``: the flags as they are: ceil(1.3 x 20) = 26 online clients
  selected, the 20 first to finish within 3 virtual seconds kept;
- ``partial_work``: FedNova, FedAvg and Delta-FL with the 3 s deadline and
  ``--partial_work`` (no over-selection): a client past the deadline keeps the local steps
  it completed and uploaded by then;
- ``asynchronous``: FedBuff (C = 20 clients in flight, a server step at every K = 10
  updates, staleness weights 1/sqrt(1 + tau)) from ``experiments/async_synthetic_fedbuff.flags``
  (the same data, speeds and availability; no deadline, which FedBuff refuses). A round is a
  server step, so ``--rounds`` caps the steps. It drops nothing by deadline; the stale updates
  it drops (``--max_staleness``, unset in that flagfile: none) are read from rounds.npz
  (``dropped_updates``), with the updates aggregated (``num_selected``), per seed. Beside it,
  on the same flagfile and events, Delta-FL under buffered asynchrony
  (``--algorithm=deltafl_buffered``, theta 0.8 and 0.5: of each buffer, the updates whose loss
  at their base version is in the top theta share).

``--flagfiles=shakespeare`` runs the same four settings on
``experiments/async_shakespeare_cpu.flags`` and ``experiments/async_shakespeare_cpu_fedbuff.flags``
instead (the CPU cut of Shakespeare, GRU, m = 10, a 7 s deadline with ceil(1.3 x 10) = 13
selected; FedBuff C = 20, K = 10), writes its runs under bench/out/timing_runs_shakespeare and
its JSON, by default, to bench/out/timing_comparison_shakespeare_<backend>.json, with the two
flagfiles named in it.

What is read back, per method column (algorithm, theta) and seed, from each run's
metrics.jsonl (the test error's p90 and the virtual time at every evaluation) and clients.npz:

- the p90 at a fixed virtual time (``--at_hours``; default the earliest end of any run's
  clock, the budget, so every seed of every column has reached it), each seed's curve read as a step
  function (its last evaluation at or before that time);
- the virtual hours to reach a target p90 (``--target_p90``; default the highest p90 of the
  columns' means at the fixed time, so every column reaches it on average by then): each
  seed's first evaluation at or below the target (null when it never does);
- the drop rate by compute-speed quintile (:mod:`deltafl_jax.report.speed_drops`: rounds
  dropped over rounds selected, q1 the fastest fifth).

Writes JSON (``--out``, default bench/out/timing_comparison_<backend>.json) and prints the
table of docs/results/timing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

FLAGFILE = os.path.join("experiments", "async_synthetic.flags")
ASYNC_FLAGFILE = os.path.join("experiments", "async_synthetic_fedbuff.flags")
# --flagfiles: (synchronous flagfile, FedBuff's flagfile, evaluations every so many rounds
# per setting: about a virtual minute apart on Synthetic, where a round without deadline
# lasts about 7x one with and a FedBuff step about 1.2 virtual seconds; on Shakespeare a
# deadline round lasts 7 s, so every 10 rounds)
PAIRS = {
    "synthetic": (FLAGFILE, ASYNC_FLAGFILE, (3, 20, 20, 50)),
    "shakespeare": (os.path.join("experiments", "async_shakespeare_cpu.flags"),
                    os.path.join("experiments", "async_shakespeare_cpu_fedbuff.flags"),
                    (5, 10, 10, 25)),
}
# setting: (which flagfile of the pair, algorithms, flags changed (None: removed))
SETTING_RUNS = {
    "no_deadline": (0, "fedavg,deltafl", {"round_deadline": None, "over_select": None}),
    "deadline_overselect": (0, "fedavg,deltafl", {}),
    "partial_work": (0, "fednova,fedavg,deltafl", {"over_select": None, "partial_work": ""}),
    "asynchronous": (1, "fedbuff,deltafl_buffered", {"thetas": "0.8,0.5"}),
}


def settings_of(pair: str = "synthetic") -> dict:
    """setting: (flagfile, algorithms, flags changed, evaluations every so many rounds)."""
    files, every = PAIRS[pair][:2], PAIRS[pair][2]
    return {name: (files[which], algorithms, changes, every[i])
            for i, (name, (which, algorithms, changes)) in enumerate(SETTING_RUNS.items())}


SETTINGS = settings_of()
METHOD_DIRS = ("fedavg", "deltafl", "fednova", "fedbuff", "deltafl_buffered")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flagfiles", default="synthetic", choices=sorted(PAIRS),
                   help="the pair of flagfiles the settings run: synthetic "
                        "(async_synthetic*.flags) or shakespeare (async_shakespeare_cpu*.flags)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which settings to run")
    p.add_argument("--virtual_hours", type=float, default=1.0,
                   help="every run ends at this virtual time (--stop_at_virtual_time)")
    p.add_argument("--rounds", type=int, default=5000,
                   help="--num_rounds, a cap that the virtual time ends first")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--eval_every", type=int, default=None,
                   help="evaluate every so many rounds (default: per setting, about a "
                        "virtual minute apart)")
    p.add_argument("--runs_dir", default=None,
                   help="where the runs are written (default, git-ignored: "
                        "bench/out/timing_runs, or timing_runs_shakespeare)")
    p.add_argument("--reuse", nargs="?", const="all", default="",
                   help="read the runs of these settings (comma-separated; bare: all) "
                        "already in --runs_dir instead of running them")
    p.add_argument("--at_hours", type=float, default=None)
    p.add_argument("--target_p90", type=float, default=None, help="a fraction, e.g. 0.6")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.runs_dir is None:
        args.runs_dir = os.path.join("bench", "out", "timing_runs" + (
            "" if args.flagfiles == "synthetic" else f"_{args.flagfiles}"))
    named = args.settings.split(",") + ([] if args.reuse in ("", "all") else
                                         args.reuse.split(","))
    unknown = [s for s in named if s not in SETTINGS]
    if unknown:
        p.error(f"unknown setting {unknown[0]!r} (known: {', '.join(SETTINGS)})")
    return args


def flagfile_flags(path: str = FLAGFILE) -> dict:
    """{name: value} of a flagfile's ``--name=value`` lines ('' for a bare ``--name``)."""
    out = {}
    for line in open(path):
        line = line.strip()
        if line.startswith("--"):
            name, _, value = line[2:].partition("=")
            out[name] = value
    return out


def command(setting: str, args, run_dir: str) -> list:
    """The run's command line; a single algorithm's run is written to its method folder
    under `run_dir`, as the runs of several algorithms write theirs."""
    pair = getattr(args, "flagfiles", "synthetic")
    flagfile, algorithms, changes, every = settings_of(pair)[setting]
    flags = flagfile_flags(flagfile)
    out_dir = run_dir if "," in algorithms else os.path.join(run_dir, algorithms)
    flags.update({"algorithm": algorithms, "seeds": args.seeds,
                  "eval_every": str(args.eval_every or every), "output_dir": out_dir,
                  "num_rounds": str(args.rounds),
                  "stop_at_virtual_time": f"{3600 * args.virtual_hours:g}",
                  "save_models": "false", "checkpoint_every": "0"})
    for name, value in changes.items():
        if value is None:
            flags.pop(name, None)
        else:
            flags[name] = value
    return [sys.executable, "-m", "experiments.run"] + [
        f"--{k}" if v == "" else f"--{k}={v}" for k, v in flags.items()]


def seed_curves(run_dir: str) -> dict:
    """{(method dir, algorithm, theta): {seed: (virtual seconds [E], p90 [E])}}."""
    out = {}
    for method in METHOD_DIRS:
        path = os.path.join(run_dir, method, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        for line in open(path):
            rec = json.loads(line)
            if "test_error_p90" not in rec:
                continue
            key = (method, rec["algorithm"], float(rec.get("theta", 1.0)))
            t, v = out.setdefault(key, {}).setdefault(int(rec["seed"]), ([], []))
            t.append(float(rec["virtual_time"]))
            v.append(float(rec["test_error_p90"]))
    return {k: {s: (np.asarray(t), np.asarray(v)) for s, (t, v) in seeds.items()}
            for k, seeds in out.items()}


def value_at(times, values, at: float) -> float:
    """The step function's value at `at`: the last evaluation at or before it (NaN before
    the first)."""
    i = int(np.searchsorted(times, at, side="right")) - 1
    return float(values[i]) if i >= 0 else float("nan")


def hours_to(times, values, target: float):
    """Virtual hours of the first evaluation at or below `target`, or None."""
    hit = np.flatnonzero(values <= target)
    return float(times[hit[0]] / 3600.0) if hit.size else None


def drops(run_dir: str, method: str, theta: float):
    """([5] mean ms per example by quintile, [S, 5] drop rates) of one column, or None."""
    from deltafl_jax.report.io import read_run
    from deltafl_jax.report.speed_drops import column_drop_rates
    from deltafl_jax.report.tables import columns
    run = read_run(os.path.join(run_dir, method))
    for col in columns([run]):
        thetas = {float(run.labels[r].theta) for r in col.replicas}
        if thetas == {theta}:   # theta 1 for the methods without one
            got = column_drop_rates(col)
            return None if got is None else (1000 * got[0], got[1])
    return None


ASYNC_FIELDS = ("updates_aggregated", "updates_kept", "stale_updates_dropped",
                "staleness_mean", "update_share_by_speed_quintile")


def async_counts(run_dir: str, method: str, theta: float = 1.0) -> dict:
    """Per seed of an asynchronous run's column (its replicas at `theta`): the updates
    aggregated (buffered) and the stale updates dropped (summed over its server steps,
    rounds.npz), the updates its filter kept (buffered Delta-FL's ``kept_updates``; None for
    a rule without a filter), the mean staleness of the updates aggregated (steps), and the
    share of the updates aggregated from each compute-speed quintile (q1 the fastest fifth,
    clients.npz ``train_updates_aggregated``); every field None for a synchronous run."""
    from deltafl_jax.report.io import read_run
    from deltafl_jax.report.speed_drops import run_per_example_s, speed_quintiles
    out = dict.fromkeys(ASYNC_FIELDS)
    path = os.path.join(run_dir, method, "rounds.npz")
    if not os.path.exists(path):
        return out
    run = read_run(os.path.join(run_dir, method))
    mine = np.asarray([float(label.theta) == theta for label in run.labels])
    with np.load(path) as r:
        if "dropped_updates" not in r:
            return out
        taken = np.asarray(r["num_selected"], np.float64)[:, mine]
        out["updates_aggregated"] = taken.sum(axis=0).astype(int).tolist()
        out["stale_updates_dropped"] = np.asarray(r["dropped_updates"])[:, mine].sum(axis=0) \
            .astype(int).tolist()
        out["staleness_mean"] = ((np.asarray(r["staleness_mean"])[:, mine] * taken).sum(axis=0)
                                 / taken.sum(axis=0)).tolist()
        if "kept_updates" in r:
            out["updates_kept"] = np.asarray(r["kept_updates"])[:, mine].sum(axis=0) \
                .astype(int).tolist()
    x = run_per_example_s(run)
    if x is not None:
        q = speed_quintiles(x)
        u = np.atleast_2d(np.asarray(run.clients["train_updates_aggregated"], np.float64))[mine]
        by_quintile = np.stack([u[:, q == j].sum(axis=1) for j in range(5)], axis=1)
        out["update_share_by_speed_quintile"] = \
            (by_quintile / u.sum(axis=1, keepdims=True)).tolist()
    return out


def method_name(algorithm: str, theta: float) -> str:
    """'FedAvg', 'FedNova', 'Δ-FL, θ = 0.5': the spec's display name, and its swept θ."""
    from deltafl_jax.algorithms import registry
    spec = registry.get(algorithm)
    return spec.display_name + (f", θ = {theta:g}" if spec.reporting.names_value else "")


def analyse(run_dirs: dict, at_hours, target) -> dict:
    curves = {s: seed_curves(d) for s, d in run_dirs.items()}
    ends = [float(t[-1]) for c in curves.values() for seeds in c.values()
            for t, _ in seeds.values()]
    at = at_hours * 3600.0 if at_hours is not None else min(ends)
    rows, row_seeds = [], []
    for setting, cols in curves.items():
        for (method, algorithm, theta), seeds in cols.items():
            p90_at = [value_at(t, v, at) for t, v in seeds.values()]
            got = drops(run_dirs[setting], method, theta)
            counts = async_counts(run_dirs[setting], method, theta)
            row_seeds.append(seeds)
            rows.append({"setting": setting, "method": method_name(algorithm, theta),
                         "algorithm": algorithm, "theta": theta, "seeds": sorted(seeds),
                         "p90_at_fixed_time": p90_at,
                         "final_virtual_hours": [float(t[-1] / 3600) for t, _ in
                                                 seeds.values()],
                         "final_p90": [float(v[-1]) for _, v in seeds.values()],
                         "drop_rate_by_speed_quintile":
                             None if got is None else got[1].tolist(),
                         "quintile_ms_per_example": None if got is None else got[0].tolist(),
                         **counts})
    if target is None:
        means = [np.mean(r["p90_at_fixed_time"]) for r in rows]
        target = float(np.nanmax(means)) if np.any(np.isfinite(means)) else float("nan")
    for row, seeds in zip(rows, row_seeds):
        row["hours_to_target"] = [hours_to(t, v, target) for t, v in seeds.values()]
    return {"fixed_virtual_hours": at / 3600.0, "target_p90": target, "rows": rows}


def _mean_text(values, scale=1.0, digits=1) -> str:
    v = [x for x in values if x is not None and np.isfinite(x)]
    if not v:
        return "not reached"
    text = f"{scale * np.mean(v):.{digits}f} ± {scale * np.std(v):.{digits}f}"
    return text + (f" ({len(v)} of {len(values)} seeds)" if len(v) < len(values) else "")


def table(result: dict) -> list:
    """The markdown rows of docs/results/timing.md."""
    lines = [f"| setting | method | hours to p90 ≤ {100 * result['target_p90']:.1f}% | "
             f"p90 at {result['fixed_virtual_hours']:.2f} h (%) | final p90 (%) | "
             "virtual hours of the run | dropped q1 (fastest) | q2 | q3 | q4 | q5 (slowest) |",
             "|---|---|---|---|---|---|" + "---|" * 5]
    for r in result["rows"]:
        d = r["drop_rate_by_speed_quintile"]
        cells = ["—"] * 5 if d is None else [f"{100 * x:.1f}" for x in np.nanmean(d, axis=0)]
        lines.append(f"| {r['setting']} | {r['method']} | "
                     f"{_mean_text(r['hours_to_target'], digits=2)} | "
                     f"{_mean_text(r['p90_at_fixed_time'], 100)} | "
                     f"{_mean_text(r['final_p90'], 100)} | "
                     f"{_mean_text(r['final_virtual_hours'], digits=2)} | "
                     + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    from bench.common import backend_name, emit, machine
    settings = args.settings.split(",")
    reuse = set(settings if args.reuse == "all" else args.reuse.split(","))
    run_dirs, commands, seconds = {}, {}, {}
    for setting in settings:
        run_dir = os.path.join(args.runs_dir, setting)
        cmd = command(setting, args, run_dir)
        run_dirs[setting], commands[setting] = run_dir, shlex.join(cmd[1:])
        if setting not in reuse:
            t0 = time.perf_counter()
            subprocess.run(cmd + ["--overwrite"], check=True, stdout=subprocess.DEVNULL)
            seconds[setting] = round(time.perf_counter() - t0, 1)
            print(f"timing_comparison: {setting} in {seconds[setting]} s", file=sys.stderr,
                  flush=True)
    result = {"benchmark": "timing_comparison", "machine": machine(),
              "load_average": os.getloadavg(), "commands": commands,
              "wall_seconds": seconds,
              **analyse(run_dirs, args.at_hours, args.target_p90)}
    if args.flagfiles != "synthetic":
        result["flagfiles"] = list(PAIRS[args.flagfiles][:2])
    result["table"] = table(result)
    infix = "" if args.flagfiles == "synthetic" else f"{args.flagfiles}_"
    emit(result, args.out, name=f"timing_comparison_{infix}{backend_name()}",
         summary=result["table"])


if __name__ == "__main__":
    main()
