r"""Command-line front end of the papers' tuning protocol (:mod:`deltafl_jax.studies.tuning`).

    python -m experiments.tune --flagfile=experiments/synthetic.flags --output_dir=DIR \
        [--lr_grid=0.05,0.1,0.2] [--lr_decay_grid=1,2,4,8] [--l2_grid=1e-3,...,1e-8] \
        [--tune_l2=auto|yes|no] [--l2_per_theta] [--tune_param=auto|yes|no]
        [--validation_seed=0]

Reads the runner's flags (``experiments/cli.py``) plus the grids below, calls
:func:`deltafl_jax.studies.tuning.tune`, and writes the winners as one flagfile. Bad input prints one
line and exits with code 2 before anything is trained.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List

from absl import app, flags, logging

from deltafl_jax.algorithms import registry
from deltafl_jax.studies.tuning import (LINEAR_MODELS, PAPER_DECAYS, PAPER_L2, TuningError,
                                        TuningPlan, best, check, default_lr_grid, l2_per_theta,
                                        l2_thetas, param_sweep, scores_markdown, tune, tunes_l2)
from experiments import cli

FLAGS = flags.FLAGS
cli.define_experiment_flags()
flags.DEFINE_list("lr_grid", [], "gamma_0 values; empty: --learning_rate x 1/4, 1/2, 1, 2, 4")
flags.DEFINE_list("lr_decay_grid", [str(c) for c in PAPER_DECAYS],
                  "divisors c >= 1 of the rate every --lr_decay_every rounds (the paper's "
                  "factors 1/c = 1, 1/2, 1/4, 1/8); ignored when --lr_decay_every=0")
flags.DEFINE_bool("tune_lr", True, "grid-search the learning rate for FedAvg")
flags.DEFINE_list("l2_grid", [f"{v:g}" for v in PAPER_L2], "lambda values")
flags.DEFINE_enum("tune_l2", "auto", ["auto", "yes", "no"],
                  "tune lambda on held-out training clients (auto: linear models only)")
flags.DEFINE_bool("l2_per_theta", True, "choose lambda separately for each theta (paper); "
                  "else FedAvg's lambda for all")
flags.DEFINE_enum("tune_param", "auto", ["auto", "yes", "no"],
                  "tune a baseline's swept parameter (--qffl_q, --fedprox_mu, --term_t, "
                  "--afl_lambda_lr, FedAvg-Sub's --thetas / --fedavg_sub_clients) on held-out "
                  "training clients by the 90th percentile (auto: when the first --algorithm "
                  "is a baseline sweeping at least two values)")
flags.DEFINE_integer("validation_seed", 0, "seed of the split of the training clients into "
                     "training and validation halves")

HEADER = [
    "# Tuned by python -m experiments.tune (App. C.2.2): learning rate = smallest terminal",
    "# alpha-weighted train loss of FedAvg; lambda = smallest 90th percentile of the test",
    "# misclassification error on held-out training clients (the paper's text also says",
    "# '10th percentile' once; this follows Sec. 5). --l2_reg lists lambda per theta.",
    "# A baseline's swept parameter (q, mu, t, gamma_lambda): smallest validation p90.",
    "# Scores: tuning.md.",
]
TUNER_FLAGS = ("overwrite",)


def _flag_lines(overrides: Dict[str, str]) -> List[str]:
    """The runner's flags as given (flagfile or command line) with `overrides`."""
    lines = []
    for name in cli.DEFINED:
        flag = FLAGS[name]
        if name in overrides:
            lines.append(f"--{name}={overrides[name]}")
        elif name in TUNER_FLAGS:
            continue
        elif flag.present and flag.serialize():
            lines.append(flag.serialize())
    return lines


def _inputs():
    """The configuration and grids from the flags; TuningError / UsageError when bad."""
    out_dir = FLAGS.output_dir
    if not out_dir:
        raise TuningError("--output_dir is required (where the grids and tuned.flags go)")
    config = dataclasses.replace(cli.config_from_flags(), output_dir=out_dir)
    cli.check_flags_read([config])
    lr_grid = (cli.floats("lr_grid", FLAGS.lr_grid) if FLAGS.lr_grid
               else default_lr_grid(config))
    decay_grid = cli.floats("lr_decay_grid", FLAGS.lr_decay_grid)
    l2_grid = cli.floats("l2_grid", FLAGS.l2_grid)
    tune_l2 = {"yes": True, "no": False}.get(
        FLAGS.tune_l2, config.training.model in LINEAR_MODELS and tunes_l2(config))
    tune_param = {"yes": True, "no": False}.get(FLAGS.tune_param,
                                                 param_sweep(config) is not None)
    if not FLAGS.tune_lr and not tune_l2 and not tune_param:
        raise TuningError("nothing to tune: --notune_lr, --tune_l2="
                          f"{FLAGS.tune_l2} and --tune_param={FLAGS.tune_param} (model "
                          f"{config.training.model}, algorithm {config.algorithm})")
    check_out(out_dir)
    return config, lr_grid, decay_grid, l2_grid, tune_l2, tune_param


MARKER = "deltafl_tune.json"   # the folder is a tuning's (deltafl_jax.outputs.directory.mark_command_dir)
TUNING_ENTRIES = {"lr_grid", "l2_grid", "param_grid", "tuned.flags", "tuning.json", "tuning.md"}


def _tuning_before_markers(path: str, names) -> bool:
    """A folder a tuning wrote before it was marked: its entries and nothing else."""
    return bool(names) and set(names) <= TUNING_ENTRIES


def check_out(out_dir: str) -> None:
    """TuningError when --output_dir is a folder of other files, or holds tuning results
    (without --overwrite); ConfigError when another process holds it
    (:mod:`deltafl_jax.run.lock`)."""
    from deltafl_jax.outputs.directory import command_dir_state
    from deltafl_jax.run.lock import check_free
    state = command_dir_state(out_dir, MARKER, _tuning_before_markers)
    if state.kind == "other":
        shown = ", ".join(state.foreign[:4]) + (
            f" and {len(state.foreign) - 4} more" if len(state.foreign) > 4 else "")
        raise TuningError(f"--output_dir={out_dir} is not a folder of experiments.tune (it "
                          f"holds {shown} and no {MARKER}); choose a new or empty folder, so "
                          f"that no file of yours is replaced")
    check_free(out_dir)
    taken = [p for p in ("lr_grid", "l2_grid", "param_grid", "tuned.flags", "tuning.json")
             if os.path.exists(os.path.join(out_dir, p))]
    if taken and not FLAGS.overwrite:
        raise TuningError(f"--output_dir={out_dir} already holds tuning results "
                          f"({', '.join(taken)}); pass --overwrite or choose another directory")


def _write_flagfile(config, result, out_dir: str) -> str:
    thetas = l2_thetas(config, True)     # the run's thetas (1.0 for FedAvg)
    lams = l2_per_theta(result, thetas, config.l2_for(1)[0])
    overrides = {"learning_rate": repr(result.learning_rate), "lr_decay": repr(result.lr_decay),
                 "l2_reg": ",".join(repr(float(v)) for v in lams),
                 "output_dir": os.path.join(out_dir, "run")}
    spec = registry.get(config.algorithm)
    if spec.grid.tunes_l2 and not spec.grid.fixed_sweep:   # --l2_reg: lambda per swept value
        overrides[spec.sweep.flag] = ",".join(repr(float(t)) for t in thetas)
    chosen = [f"# theta {t:g}: lambda = {v:g}" for t, v in zip(thetas, lams)]
    if result.param_flag is not None:
        overrides[result.param_flag] = repr(result.param_value)
        overrides["algorithm"] = config.algorithm
        overrides["l2_reg"] = repr(float(result.param_l2))
        chosen = [f"# --{result.param_flag} = {result.param_value:g} (smallest validation p90)"]
    path = os.path.join(out_dir, "tuned.flags")
    with open(path, "w") as f:
        f.write("\n".join(HEADER + chosen + _flag_lines(overrides)) + "\n")
    return path


def _write_scores(config, result, out_dir: str, flagfile: str) -> None:
    chosen_lr = [best(result.lr_scores)] if result.lr_scores else []
    chosen_l2 = [best([s for s in result.l2_scores if s.point["theta"] == t])
                 for t in sorted({s.point["theta"] for s in result.l2_scores}, reverse=True)]
    md = ["# Tuning (App. C.2.2)", ""] + [f"- {n}" for n in result.notes] + [
        f"- learning rate: --learning_rate={result.learning_rate:g} "
        f"--lr_decay={result.lr_decay:g} --lr_decay_every={config.training.lr_decay_every}",
        "- lambda per theta: " + (", ".join(f"θ={t:g}: {l:g}" for t, l in result.l2.items())
                                  or "not tuned"),
        f"- flagfile: {os.path.basename(flagfile)}", ""]
    md += scores_markdown("Learning rate (FedAvg, all training clients)", result.lr_scores,
                          chosen_lr, "terminal α-weighted train loss", False)
    md += scores_markdown("Lambda (validation clients)", result.l2_scores, chosen_l2,
                          "p90 test error on validation clients (%)", True)
    md += scores_markdown(f"--{result.param_flag} (validation clients)", result.param_scores,
                          [best(result.param_scores)] if result.param_scores else [],
                          "p90 test error on validation clients (%)", True)
    with open(os.path.join(out_dir, "tuning.md"), "w") as f:
        f.write("\n".join(md))
    record = {
        "learning_rate": result.learning_rate, "lr_decay": result.lr_decay,
        "lr_decay_every": config.training.lr_decay_every,
        "l2": {f"{t:g}": l for t, l in result.l2.items()},
        "lr_scores": [dataclasses.asdict(s) for s in result.lr_scores],
        "l2_scores": [dataclasses.asdict(s) for s in result.l2_scores],
        "param": ({"flag": result.param_flag, "value": result.param_value,
                   "l2_reg": result.param_l2} if result.param_flag else None),
        "param_scores": [dataclasses.asdict(s) for s in result.param_scores],
        "validation_seed": FLAGS.validation_seed, "notes": result.notes,
        "flagfiles": [flagfile],
    }
    with open(os.path.join(out_dir, "tuning.json"), "w") as f:
        json.dump(record, f, indent=2)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax import ConfigError, DataError
    from deltafl_jax.run.lock import locked

    try:
        cli.start_backend()   # XLA flags (--devices on a CPU, --deterministic) come first
        cli.import_model_module()
        inputs = _inputs()
        out_dir = inputs[0].output.output_dir
        # The folder is this process's until it ends (its grids lock their own folders).
        with locked(out_dir, log=lambda s: print(s, flush=True)):
            check_out(out_dir)   # as it is now that it is ours
            flagfile = _tune_and_write(*inputs)
    except (TuningError, cli.UsageError, ConfigError, DataError) as e:
        cli.fail(str(e))
        return
    print(f"wrote {flagfile}: python -m experiments.run --flagfile={flagfile}", flush=True)


def _tune_and_write(config, lr_grid, decay_grid, l2_grid, tune_l2, tune_param) -> str:
    """Load the data, check the grids, tune, and write tuned.flags, tuning.md and
    tuning.json; returns the flagfile's path."""
    from deltafl_jax import load_dataset
    from deltafl_jax.outputs.directory import mark_command_dir
    data = load_dataset(config.data)
    check(config, data, lr_grid, decay_grid, l2_grid, FLAGS.tune_lr, tune_l2, tune_param)
    if config.training.clients_per_round > data.train.num_clients:
        raise TuningError(f"--clients_per_round={config.training.clients_per_round} exceeds the "
                          f"{data.train.num_clients} training clients of {data.name}")
    mark_command_dir(config.output.output_dir, MARKER, "experiments.tune")   # made, and ours
    plan = TuningPlan(lr_grid=lr_grid, decay_grid=decay_grid, l2_grid=l2_grid,
                      tune_lr=FLAGS.tune_lr, tune_l2=tune_l2, per_theta=FLAGS.l2_per_theta,
                      validation_seed=FLAGS.validation_seed, tune_param=tune_param)
    result = tune(config, data, plan, out_dir=config.output.output_dir,
                  log=lambda s: print(s, flush=True))
    flagfile = _write_flagfile(config, result, config.output.output_dir)
    _write_scores(config, result, config.output.output_dir, flagfile)
    return flagfile


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags_or_fail)
