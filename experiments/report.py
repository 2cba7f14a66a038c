r"""Write the papers' tables and figures for finished runs.

    python -m experiments.report RUN_DIR [RUN_DIR ...] --out=DIR [--percentile=lower|linear]
        [--best]

Writes into DIR: ``report.md`` (Table 2 = 90th percentile and Table 3 = mean of the per-client
test misclassification error in %, mean +- std over seeds, plus the alpha-weighted train-loss
mean and 90th percentile; Sec. 5 of the long paper), the PNG figures of Sec. 5 and App. C.3
(Fig. 4 histograms, Fig. 5 scatter, Figs. 6-11 curves, Fig. 16 clients kept per round) and the
per-client values as CSV. Several run directories put their methods side by side; a directory
of runs (e.g. ``runs/``) stands for the runs in it. Runs that are missing, still in progress
or incomplete are skipped with one line on stderr. The library is :mod:`deltafl_jax.report`
(runs read through :class:`deltafl_jax.outputs.directory.RunReader`); this file only reads flags. Bad
input prints one line and exits with code 2. DIR must be absent, empty, or a report's folder
(its :data:`MARKER`): a folder of other files is refused, never written over.
"""

from __future__ import annotations

import contextlib
import os
import sys

from absl import app, flags, logging

from experiments import command
from experiments.command import fail

FLAGS = flags.FLAGS
# The report's mark on its --out folder: a later report may write into it again.
MARKER = "deltafl_report.json"

if "out" not in FLAGS:   # experiments.leaderboard defines --out too; one process may import both
    flags.DEFINE_string("out", None, "directory for report.md, the figures and the CSV files")
flags.DEFINE_enum("percentile", "lower", ["lower", "linear"],
                  "lower: weighted lower quantile (train losses alpha-weighted); linear: "
                  "NumPy's linear interpolation, unweighted, as the reference scripts")
flags.DEFINE_integer("dpi", 110, "resolution of the PNG figures")
flags.DEFINE_bool("best", False, "tables and figures show each baseline (q-FFL, FedProx, "
                  "TERM, AFL, FedAvg-Sub) at its best swept value by the test 90th percentile, "
                  "marked with a dagger, as the papers' tables; the CSV files keep every value")


def check_out(out: str, run_paths) -> None:
    """--out may not be a run, nor lie inside one, reported or not (a run's folder holds only
    what a run writes, docs/reference/outputs.md: the run could not be rerun or continued
    there; :func:`deltafl_jax.outputs.directory.enclosing_run`), nor be a folder that is not a
    report's: it must be absent, empty, or one this command wrote before (it carries
    :data:`MARKER`), so that nobody's files are replaced."""
    from deltafl_jax.outputs.directory import command_dir_state, enclosing_run
    target = os.path.realpath(out)
    for path in run_paths:
        root = os.path.realpath(path)
        if target == root or target.startswith(root + os.sep):
            fail(f"--out={out} is inside the run {path}; write the report beside it (a run's "
                 f"folder holds only what a run writes)")
    run = enclosing_run(out)
    if run == target:
        fail(f"--out={out} is a run of deltafl_jax; write the report elsewhere")
    if run is not None:
        fail(f"--out={out} is inside the run {run}; write the report beside it (a run's "
             f"folder holds only what a run writes)")
    state = command_dir_state(out, MARKER)
    if state.kind == "other":
        shown = ", ".join(state.foreign[:4]) + (
            f" and {len(state.foreign) - 4} more" if len(state.foreign) > 4 else "")
        fail(f"--out={out} is not a folder of experiments.report (it holds {shown} and no "
             f"{MARKER}); choose a new or empty folder, so that no file of yours is replaced")


def write(runs, skipped, warn):
    """The report into --out; its marker first, so that the folder is the report's from the
    start (removed again, with the folder made for it, when the report fails)."""
    from deltafl_jax.outputs.directory import mark_command_dir
    from deltafl_jax.report import write_report
    out_dir = os.path.abspath(FLAGS.out)
    made, p = [], out_dir
    while not os.path.isdir(p) and p != os.path.dirname(p):
        made.append(p)
        p = os.path.dirname(p)
    marker = os.path.join(out_dir, MARKER)
    fresh = not os.path.exists(marker)
    try:
        mark_command_dir(out_dir, MARKER, "experiments.report")
        return write_report(runs, FLAGS.out, percentile=FLAGS.percentile, skipped=skipped,
                            dpi=FLAGS.dpi, log=warn, best=FLAGS.best)
    except BaseException:
        if fresh:
            with contextlib.suppress(OSError):
                os.remove(marker)
        for d in made:                      # deepest first; only those left empty
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


def parse_flags_or_fail(argv):
    """The command line's flags (experiments.command), --out's default this command's own
    (no default: it is required) whichever command defined the flag."""
    FLAGS.set_default("out", None)
    return command.parse_flags_or_fail(argv)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    paths = argv[1:]
    if not paths:
        fail("no run directory given (usage: python -m experiments.report RUN_DIR [RUN_DIR "
             "...] --out=DIR)")
    if not FLAGS.out:
        fail("--out is required (the directory for report.md and the figures)")
    if os.path.exists(FLAGS.out) and not os.path.isdir(FLAGS.out):
        fail(f"--out={FLAGS.out} exists and is not a directory")
    if FLAGS.dpi < 10:
        fail(f"--dpi must be at least 10, got {FLAGS.dpi}")
    from deltafl_jax.report import load   # reads the runs without importing JAX or matplotlib

    def warn(line):
        print(line, file=sys.stderr, flush=True)

    runs, skipped = load(paths, log=warn)
    if not runs:
        fail(f"no complete run among {' '.join(paths)} (see the lines above)")
    check_out(FLAGS.out, [run.path for run in runs])
    import matplotlib
    matplotlib.use("Agg")
    try:   # written beside --out and moved in at the end: a failure leaves no folder
        out = write(runs, skipped, warn)
    except OSError as e:
        fail(f"--out={FLAGS.out} cannot be written ({e.strerror or e})")
    print(f"wrote {out['report']} ({len(runs)} run(s), {len(out['figures'])} figure(s), "
          f"{len(out['csv'])} CSV file(s); {len(skipped)} skipped)", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags_or_fail)
