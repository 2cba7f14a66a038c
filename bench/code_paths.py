r"""How many of the package's files a reader walks: the files whose code runs (a) while one
round is traced, the round's compute path, and (b) from the command line to the end of a tiny
run, a configuration's whole path.

    python -m bench.code_paths [--out=FILE]

Counts the distinct source files under deltafl_jax/ and experiments/ with a function called
(``sys.setprofile``), out of all such files: (a) while ``jax.jit(round_fn).lower`` traces one
round of tests/tiny.flags' experiment, (b) while ``experiments.run`` runs tests/tiny.flags for
one round with outputs. Figures for the issue that split the Experiment hub (before/after) are
in bench/README.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("deltafl_jax", "experiments")


def _ours(filename: str):
    rel = os.path.relpath(os.path.abspath(filename), ROOT)
    return rel if rel.split(os.sep)[0] in PACKAGES and rel.endswith(".py") else None


class _Files:
    def __init__(self):
        self.files = set()

    def __call__(self, frame, event, arg):
        if event == "call":
            rel = _ours(frame.f_code.co_filename)
            if rel:
                self.files.add(rel)

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        return False


def _tiny_argv(out_dir):
    return ["run", f"--flagfile={os.path.join(ROOT, 'tests', 'tiny.flags')}", "--num_rounds=1",
            "--eval_every=1", f"--output_dir={out_dir}", "--overwrite"]


def round_path():
    import jax
    from experiments import cli, run as runner
    from deltafl_jax import build_experiment, load_dataset
    runner.FLAGS.unparse_flags()
    with tempfile.TemporaryDirectory() as out:
        runner.parse_flags_or_fail(_tiny_argv(out))
        config = cli.config_from_flags()
        exp = build_experiment(config, load_dataset(config.data))
    state, data, keys = exp.initial_state(), exp.round_data(0), exp.keys()
    with _Files() as seen:
        jax.jit(exp.round_fn).lower(state, data, keys)
    return seen.files


def config_path():
    from experiments import run as runner
    runner.FLAGS.unparse_flags()
    with tempfile.TemporaryDirectory() as out, _Files() as seen:
        rest = runner.parse_flags_or_fail(_tiny_argv(out))
        runner.main(rest)
    return seen.files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    total = sorted(f for pkg in PACKAGES for f in
                   (os.path.relpath(x, ROOT) for x in glob.glob(os.path.join(ROOT, pkg, "**",
                                                                            "*.py"),
                                                               recursive=True))
                   if not f.endswith("__init__.py") or os.path.getsize(os.path.join(ROOT, f)))
    rnd, cfg = round_path(), config_path()
    result = {"package_files": len(total), "round_path_files": len(rnd),
              "config_path_files": len(cfg), "round_path": sorted(rnd),
              "config_path": sorted(cfg)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
