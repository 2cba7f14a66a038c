r"""Write or check the documentation's result tables from fresh runs (so they cannot go stale).

    python -m experiments.readme_tables --table=synthetic --run               # run, then check
    python -m experiments.readme_tables --table=synthetic --run --write       # run, then update
    python -m experiments.readme_tables --table=synthetic --run_dir=runs/synthetic --write

Each table named by ``<!-- table: NAME -->`` is made from the flagfile
``experiments/NAME.flags`` (:mod:`deltafl_jax.report.readme`; a flagfile with
``--client_holdout`` gives the personalised evaluation's table). It lives in whichever pages
hold its markers: README.md and the documentation site's pages (docs/, :mod:`experiments.pages`),
or the one page ``--readme`` names. ``--run`` trains it first into a temporary directory (or
``--run_dir``); without ``--run``, ``--run_dir`` names a finished run that is read as it is
(the README's main job's folder, for instance), and the command says which it did. Without
``--write`` the command compares the numbers and the column and row names (the run's, without
the options that every run of the table shares: :mod:`deltafl_jax.report.readme`), and when a
page differs it exits 1, says which of the two differ and prints both tables.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments import cli, pages

FLAGS = flags.FLAGS
flags.DEFINE_string("table", "synthetic", "table name = flagfile experiments/<name>.flags")
flags.DEFINE_string("run_dir", None, "the run directory: with --run, where to train; without, "
                    "a finished run to read as it is (default: a temporary folder, with --run)")
flags.DEFINE_bool("run", False, "train the flagfile first")
flags.DEFINE_bool("write", False, "update the pages instead of checking them")
flags.DEFINE_string("readme", None, "the Markdown page to read (default: every page of the "
                    "repository, README.md and docs/, that holds the table's markers)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(flagfile: str, out: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "experiments.run", f"--flagfile={flagfile}",
                           f"--output_dir={out}", "--overwrite", "--tensorboard=no"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        cli.fail(f"the run of {flagfile} failed: {proc.stderr.strip().splitlines()[-1:]}")


def _algorithm_order(flagfile: str):
    """The methods of the flagfile's --algorithm, in its order."""
    for line in open(flagfile):
        if line.startswith("--algorithm="):
            return [a.strip() for a in line.strip().split("=", 1)[1].split(",")]
    return []


def _run_dirs(root: str, order=()):
    """The run directory, or its per-algorithm subdirectories (a multi-method flagfile), in
    the flagfile's order of methods."""
    if os.path.exists(os.path.join(root, "summary.json")):
        return [root]
    names = [d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "summary.json"))]
    rank = {name: i for i, name in enumerate(order)}
    return [os.path.join(root, d) for d in sorted(names, key=lambda d: (rank.get(d, 99), d))]


def source_text(flagfile: str, out: str, ran: bool, temporary: bool) -> str:
    """What the command read: a run it made now, or an existing folder."""
    flags_name = os.path.relpath(flagfile, REPO)
    if ran:
        return f"ran {flags_name} into {'a temporary folder' if temporary else out}"
    return f"read the finished run in {out}, not re-run"


def main(argv) -> None:
    del argv
    from deltafl_jax.report import readme

    marker = f"<!-- table: {FLAGS.table} -->"
    paths = [FLAGS.readme] if FLAGS.readme else pages.pages_holding(marker)
    if not paths:
        cli.fail(f"no page of README.md or docs/ holds '{marker}'")
    flagfile = os.path.join(REPO, "experiments", f"{FLAGS.table}.flags")
    with tempfile.TemporaryDirectory() as tmp:
        out = FLAGS.run_dir or os.path.join(tmp, FLAGS.table)
        if FLAGS.run:
            _run(flagfile, out)
        dirs = _run_dirs(out, _algorithm_order(flagfile)) if os.path.isdir(out) else []
        if not dirs:
            cli.fail(f"no finished run in {out}; pass --run or --run_dir")
        text = open(flagfile).read()
        if "--availability=" in text and "--availability=always" not in text:
            table = readme.render_availability(dirs)
        elif "client_holdout" in text:
            table = readme.render_personal(dirs)
        else:
            table = readme.render(dirs)
        source = source_text(flagfile, out, FLAGS.run, FLAGS.run_dir is None)
    differs = False
    for path in paths:
        text = open(path).read()
        try:
            old = readme.current(text, FLAGS.table)
        except KeyError as e:
            cli.fail(f"{os.path.relpath(path, REPO)}: {e.args[0]}")
        name = os.path.relpath(path, REPO)
        what = readme.difference(old, table)
        if FLAGS.write:
            with open(path, "w") as f:
                f.write(readme.replace(text, FLAGS.table, table))
            print(f"updated the table '{FLAGS.table}' of {name} ({source})")
        elif what or old.strip() != table.strip():
            print(f"table '{FLAGS.table}' of {name} differs from the run ({source}): "
                  f"{what or 'the layout'} differ\n--- {name}\n{old}\n--- the run\n{table}")
            differs = True
        else:
            print(f"table '{FLAGS.table}' of {name} matches the run ({source})")
    if differs:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags_or_fail)
