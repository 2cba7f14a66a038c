r"""How soon each command answers, in two source trees, interleaved on one machine.

    python -m bench.command_start --before=PATH [--after=.] [--repeats=5] \
        [--cases=run_bad_flag,prepare_no_source] [--out=bench/results/command_start_cpu.json]

Each case is one command line that a user may type and that ends at once: a misspelt flag,
a value of the wrong type, ``--help``, a refused setting, a refused folder, a missing data
source (:data:`CASES`). It is run as ``python -m ...`` in each tree (``cwd`` and
``PYTHONPATH`` set to the tree, whose ``deltafl_jax`` is checked to be the one imported),
``--repeats`` times, the two trees alternating and the order swapping every repeat. A run's
CPU seconds are its user + system time (``resource.getrusage(RUSAGE_CHILDREN)``, which moves
less with the load than the wall time does); each figure is the median over the repeats. The
exit code and the output (the trees' paths replaced) must be the same in both trees, or the
script fails (exit 2) after writing its JSON. Writes JSON to ``--out`` (default the git-ignored
``bench/out/command_start.json``) and prints a markdown table. Errors are one line on stderr
with exit code 2.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app, flags

from bench.paths import default_out

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--dataset=synthetic", "--synthetic_num_clients=16", "--synthetic_max_examples=60",
        "--model=linear", "--seeds=1", "--clients_per_round=3", "--tensorboard=no"]
# name -> (what it is, the command line after `python -m`); {tmp} is a fresh empty folder.
CASES = {
    "run_bad_flag": ("a misspelt flag", ["experiments.run", "--num_round=5"]),
    "run_bad_value": ("a value of the wrong type", ["experiments.run", "--num_rounds=many"]),
    "run_help": ("--help", ["experiments.run", "--help"]),
    "run_bad_setting": ("a setting out of range (the configuration's check)",
                        ["experiments.run", *TINY, "--thetas=2", "--output_dir={tmp}/out"]),
    "run_refused_folder": ("an --output_dir of other files",
                           ["experiments.run", *TINY, "--output_dir=/usr"]),
    "tune_bad_flag": ("a misspelt flag", ["experiments.tune", "--num_round=5"]),
    "leaderboard_bad_flag": ("a misspelt flag", ["experiments.leaderboard", "--num_round=5"]),
    "report_bad_flag": ("a misspelt flag", ["experiments.report", "--outt={tmp}/r"]),
    "report_no_run": ("no run in the folders given",
                      ["experiments.report", "{tmp}/none", "--out={tmp}/r"]),
    "prepare_bad_flag": ("a misspelt flag", ["data_prep.prepare", "--datset=femnist"]),
    "prepare_no_source": ("a dataset whose source is missing",
                          ["data_prep.prepare", "--dataset=femnist", "--data_dir={tmp}/d"]),
    "stats_no_source": ("a dataset whose source is missing",
                        ["data_prep.stats", "--dataset=sent140", "--data_dir={tmp}/d"]),
}

flags.DEFINE_string("before", None, "the older source tree (a checkout or a git worktree)")
flags.DEFINE_string("after", None, "the newer tree (default: the tree holding this script)")
flags.DEFINE_list("cases", list(CASES), f"which cases: {', '.join(CASES)}")
flags.DEFINE_integer("repeats", 5, "runs per tree and case (median reported)")
flags.DEFINE_string("out", None, "write the JSON here (default the git-ignored "
                    "bench/out/command_start.json)")
FLAGS = flags.FLAGS


class Fail(Exception):
    """A one-line error: printed on stderr, exit code 2."""


def package_of(tree: str) -> str:
    """The deltafl_jax that `python` imports in `tree`; Fail when it is another tree's."""
    proc = subprocess.run([sys.executable, "-c", "import deltafl_jax; print(deltafl_jax.__file__)"],
                          cwd=tree, env=dict(os.environ, PYTHONPATH=tree), capture_output=True,
                          text=True)
    path = proc.stdout.strip()
    if proc.returncode != 0 or not os.path.realpath(path).startswith(os.path.realpath(tree)):
        raise Fail(f"{tree}: python imports deltafl_jax from {path or proc.stderr.strip()!r}, "
                   f"not from the tree")
    return path


def once(tree: str, argv, scratch: str):
    """(exit code, CPU seconds, wall seconds, output with the paths replaced) of one run."""
    argv = [a.replace("{tmp}", scratch) for a in argv]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=tree, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=tree))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = (proc.stdout + "\n--stderr--\n" + proc.stderr).replace(tree, "<tree>")
    return proc.returncode, cpu, wall, text.replace(scratch, "<tmp>")


def measure(trees, names, repeats: int, scratch_root: str):
    """Every case of `names`, both trees interleaved; {case: its row}."""
    rows = {}
    for name in names:
        what, argv = CASES[name]
        runs = {k: [] for k in trees}
        seen = {}
        for i in range(repeats):
            for k in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                scratch = os.path.join(scratch_root, f"{name}_{k}_{i}")
                os.makedirs(scratch)
                code, cpu, wall, text = once(trees[k], argv, scratch)
                runs[k].append((cpu, wall))
                seen[k] = (code, text)
        rows[name] = {"what": what, "command": "python -m " + " ".join(argv),
                      "exit_code": {k: seen[k][0] for k in trees},
                      "same_output": seen["before"] == seen["after"],
                      **{k: {"cpu_s": statistics.median(c for c, _ in v),
                             "wall_s": statistics.median(w for _, w in v),
                             "cpu_s_all": [round(c, 4) for c, _ in v]} for k, v in runs.items()}}
    return rows


def table(rows) -> str:
    lines = ["| case | command | exit | CPU s before | CPU s after | ratio | wall s before | "
             "wall s after |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        b, a = r["before"], r["after"]
        lines.append(f"| {name} | `{r['command']}` | {r['exit_code']['after']} | "
                     f"{b['cpu_s']:.2f} | {a['cpu_s']:.2f} | "
                     f"{b['cpu_s'] / max(a['cpu_s'], 1e-3):.1f}x | {b['wall_s']:.2f} | "
                     f"{a['wall_s']:.2f} |")
    return "\n".join(lines)


def run(argv) -> int:
    import tempfile
    if len(argv) > 1:
        raise Fail(f"unexpected arguments {' '.join(argv[1:])!r}")
    if not FLAGS.before or not os.path.isdir(FLAGS.before):
        raise Fail(f"--before must name a source tree, got {FLAGS.before!r}")
    unknown = [c for c in FLAGS.cases if c not in CASES]
    if unknown:
        raise Fail(f"unknown --cases {', '.join(unknown)}; choose among {', '.join(CASES)}")
    if FLAGS.repeats < 1:
        raise Fail(f"--repeats must be at least 1, got {FLAGS.repeats}")
    trees = {"before": os.path.abspath(FLAGS.before), "after": os.path.abspath(FLAGS.after or HERE)}
    packages = {k: package_of(t) for k, t in trees.items()}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        rows = measure(trees, FLAGS.cases, FLAGS.repeats, scratch)
    out = {"trees": trees, "packages": packages, "repeats": FLAGS.repeats,
           "load_average_before": load, "load_average_after": os.getloadavg(),
           "python": sys.version.split()[0], "cases": rows}
    path = FLAGS.out or default_out("command_start")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(table(rows))
    differ = [n for n, r in rows.items()
              if not r["same_output"] or len(set(r["exit_code"].values())) > 1]
    if differ:
        raise Fail(f"the trees answer differently in {', '.join(differ)} (see {path})")
    return 0


def main(argv):
    try:
        sys.exit(run(argv))
    except Fail as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
