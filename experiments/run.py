r"""Train Delta-FL (or a baseline) for every theta x seed in one compiled program.

    python -m experiments.run --flagfile=experiments/synthetic.flags [--flag=value ...]

With ``--estimate`` the run is built, compiled and timed for a few rounds and one
evaluation, and one block with its projected wall-clock, compile time and device memory is
printed (:mod:`deltafl_jax.run.estimate`); nothing is written to ``--output_dir``.

``--algorithm`` may list several methods (``--algorithm=deltafl,fedavg,qffl``): they run one
after another on the same data, each in its own compiled program, into
``<output_dir>/<entry>/``, and a table of the final test errors closes the run. An entry
``NAME+OPTIMIZER`` (``fedavg+adam``) runs NAME with that server optimizer at ``--server_lr``
into ``<output_dir>/NAME+OPTIMIZER/``. With
``--resample_writers_per_seed`` each seed is its own dataset and its own program, written to
``.../seed_<s>/`` (:mod:`deltafl_jax.replicas.seed_programs`).

The flags are declared in ``experiments/cli.py``; this file turns them into frozen
:class:`deltafl_jax.ExperimentConfig`s and calls :func:`deltafl_jax.run_experiment`. Bad input
prints one line naming the problem to stderr and exits with code 2, before any output
directory is created.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()   # --estimate counts the process's start-up in its build time

import signal  # noqa: E402
import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from experiments.backend import import_model_module, start_backend
from experiments.cli import define_experiment_flags
from experiments.command import FLAGS, fail, parse_flags_or_fail
from experiments.configs import UsageError, configs_from_flags

define_experiment_flags()
flags.DEFINE_bool("estimate", False, "build the run, compile it, time a few rounds and one "
                  "evaluation, print the projected wall-clock of the whole run, the compile time "
                  "and the device memory, and exit without writing anything")
flags.DEFINE_integer("estimate_rounds", 5, "--estimate: rounds timed after compiling")


def stop_exit_code(reason: str) -> int:
    """128 + the signal that stopped the run, as shells report it (1 for another reason)."""
    return 128 + signal.Signals[reason].value if reason in signal.Signals.__members__ else 1


def comparison_lines(results):
    """Rows 'method, swept value (and further coordinates, e.g. server_lr): mean and p90 of
    the final per-client test error, each the mean over seeds' of a multi-method run.
    results: [(method, RunResult)], the method being the --algorithm entry (``fedavg+adam``);
    the results of one method's per-seed programs (--resample_writers_per_seed) are pooled."""
    from deltafl_jax.replicas.labels import ReplicaLabel
    from deltafl_jax.run.progress import coordinates, error_table

    finals = {}
    for name, result in results:
        for d in result.summary["replicas"]:
            label = ReplicaLabel.from_json(d)
            row = " ".join(p for p in (name, coordinates(label, theta="theta")) if p)
            finals.setdefault(row, []).append(result.final[label.key()])
    return error_table(list(finals.items()), "method", classify=classifies(results))


def classifies(results) -> bool:
    """Whether the runs' 'error' is a misclassification rate (a dataset with classes; the
    Gaussian toy's mean estimation has none and its 'error' is the squared loss)."""
    return all(r.summary.get("dataset", {}).get("num_classes", 1) != 0 for _, r in results)


def planned_configs():
    """Every program to run: one per method of --algorithm, and with
    --resample_writers_per_seed one per seed of each (deltafl_jax.replicas.seed_programs), ordered so
    that programs on the same data run one after another (each dataset is loaded once)."""
    configs = configs_from_flags()
    if any(c.data.resample_writers_per_seed for c in configs):
        from deltafl_jax.replicas.seed_programs import seed_programs
        configs = [g for c in configs for g in seed_programs(c)]
    order = {}
    for c in configs:
        order.setdefault(c.data, len(order))
    return sorted(configs, key=lambda c: order[c.data])


def estimate(configs) -> None:
    """--estimate: each program built and timed as it would run (the data loaded once per
    dataset, as the run does; a dataset that is not here, at its known shape), one block each,
    and their sum for several; nothing written."""
    from deltafl_jax.datasets.known_shapes import load_or_stand_in
    from deltafl_jax.run.estimate import estimate_run, total_lines

    if FLAGS.estimate_rounds < 1:
        raise UsageError(f"--estimate_rounds must be at least 1, got {FLAGS.estimate_rounds}")
    estimates, data, loaded, note = [], None, None, None
    t0 = STARTED   # the first program's build includes the start-up (imports, backend)
    for config in configs:
        if config.data != loaded:
            data, loaded = None, config.data   # free the previous seed's data first
            data, note = load_or_stand_in(config.data)   # the data, else its known shape
        estimates.append(estimate_run(config, data, FLAGS.estimate_rounds, log=_log,
                                      load_s=time.perf_counter() - t0, data_note=note or ""))
        t0 = time.perf_counter()
    lines = [line for e in estimates for line in e.lines()]
    if len(estimates) > 1:
        lines += total_lines(estimates)
    print("\n".join(lines), flush=True)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv):
    logging.set_verbosity(logging.WARNING)  # keep jax's backend probing out of the output
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])!r} (flags look like --name=value)")
    from deltafl_jax import ConfigError, DataError, load_dataset, run_experiment
    from deltafl_jax.run import check_output_dir, check_output_parents

    results = []
    try:
        start_backend()
        import_model_module()   # its register_model calls, before --model is resolved
        configs = planned_configs()
        if FLAGS.estimate:
            estimate(configs)
            return
        # Refuse before anything runs: a folder that is not this run's, a finished run that
        # cannot be continued, a stopped run of other settings.
        check_output_parents(FLAGS.output_dir, [c.output.output_dir for c in configs])
        for config in configs:
            check_output_dir(config.output.output_dir, config.output.overwrite, config)
        data, loaded = None, None
        for config in configs:
            if config.data != loaded:
                data, loaded = None, config.data   # free the previous seed's data first
                data = load_dataset(config.data)
            results.append((config.method, run_experiment(config, data)))
            if results[-1][1].stopped:
                sys.exit(stop_exit_code(results[-1][1].stop_reason))
    except (UsageError, ConfigError, DataError) as e:
        fail(str(e))
    except OSError as e:   # the disk is full, or the output dir cannot be written
        fail(f"cannot write the results to --output_dir={FLAGS.output_dir}: {e}")
    except MemoryError:   # e.g. --synthetic_num_clients=1e11: the data does not fit the host
        fail("the host ran out of memory making the data or the run: fewer or smaller clients "
             "(--synthetic_num_clients, --toy_examples_per_client), --client_data=host, or "
             "--estimate to see what a run holds")
    if len(configs) > 1 and configs[0].output.verbose:
        what = "test error" if classifies(results) else "test loss"
        print("\n".join(["", f"Final {what} per method (mean over seeds):"]
                        + comparison_lines(results)), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags_or_fail)
