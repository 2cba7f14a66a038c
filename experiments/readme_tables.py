r"""Write or check the README's result tables from fresh runs (so they cannot go stale).

    python -m experiments.readme_tables --table=synthetic --run               # run, then check
    python -m experiments.readme_tables --table=synthetic --run --write       # run, then update
    python -m experiments.readme_tables --table=synthetic --run_dir=runs/synthetic --write

Each table of README.md named by ``<!-- table: NAME -->`` is made from the flagfile
``experiments/NAME.flags`` (:mod:`deltafl_jax.report.readme`; a flagfile with
``--client_holdout`` gives the personalised evaluation's table). ``--run`` trains it first into
a temporary directory (or ``--run_dir``). Without ``--write`` the command exits 1 and prints
both tables when the README differs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("table", "synthetic", "table name = flagfile experiments/<name>.flags")
flags.DEFINE_string("run_dir", None, "the run directory (default: a fresh run, with --run)")
flags.DEFINE_bool("run", False, "train the flagfile first")
flags.DEFINE_bool("write", False, "update README.md instead of checking it")
flags.DEFINE_string("readme", None, "README.md to read (default: the repository's)")

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


def main(argv) -> None:
    del argv
    from deltafl_jax.report import readme

    path = FLAGS.readme or os.path.join(REPO, "README.md")
    flagfile = os.path.join(REPO, "experiments", f"{FLAGS.table}.flags")
    with tempfile.TemporaryDirectory() as tmp:
        out = FLAGS.run_dir or os.path.join(tmp, FLAGS.table)
        if FLAGS.run:
            _run(flagfile, out)
        dirs = _run_dirs(out, _algorithm_order(flagfile)) if os.path.isdir(out) else []
        if not dirs:
            cli.fail(f"no finished run in {out}; pass --run or --run_dir")
        personal = "client_holdout" in open(flagfile).read()
        table = readme.render_personal(dirs) if personal else readme.render(dirs)
    text = open(path).read()
    try:
        old = readme.current(text, FLAGS.table)
    except KeyError as e:
        cli.fail(str(e.args[0]))
    if FLAGS.write:
        with open(path, "w") as f:
            f.write(readme.replace(text, FLAGS.table, table))
        print(f"updated the table '{FLAGS.table}' of {path}")
    elif old.strip() != table.strip():
        print(f"README table '{FLAGS.table}' differs from a fresh run:\n--- README\n{old}\n"
              f"--- fresh run\n{table}")
        sys.exit(1)
    else:
        print(f"README table '{FLAGS.table}' matches the run")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags_or_fail)
