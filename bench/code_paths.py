r"""How many of the package's files a reader walks, and how big its parts are.

    python -m bench.code_paths [--out=FILE]

Counts the distinct source files under deltafl_jax/ and experiments/ with a function called
(``sys.setprofile``; a module's import and the package's first-use import hooks are not
function calls: :func:`_function_of_ours`), out of all such files: (a) while ``jax.jit(round_fn).lower`` traces one
round of tests/tiny.flags' experiment (the round's compute path), (b) while ``experiments.run``
runs tests/tiny.flags for one round with outputs (a configuration's whole path), and (c) the
files a swept hyper-parameter crosses from its flag to its use: ``--algorithm=ditto`` on
tests/tiny.flags with ``--ditto_lambda`` set to a sentinel value, counting the files with a
frame whose arguments or locals hold that value, directly or as an item of a container they
hold (the options dict, a hyper-parameter tuple, a sweep; not a whole configuration that
holds such a container), until it enters the compiled round as a traced array (the
algorithm's own module, which reads the traced value, is not counted).

And, from the syntax trees of deltafl_jax/, experiments/ and bench/ (:func:`shape_counts`):
functions over 60 lines, the classes with the most fields (annotated class-body names: a
dataclass's or NamedTuple's fields), ``Experiment``'s fields and the package modules its file
imports, and the reads of settings inside deltafl_jax/ by their flat flag name
(``config.server_lr``) against the nested ones (``config.server.learning_rates``).
Figures before and after each change of the layout are in ``bench/results/code_paths_*.json``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import inspect
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("deltafl_jax", "experiments")


def _ours(filename: str):
    rel = os.path.relpath(os.path.abspath(filename), ROOT)
    return rel if rel.split(os.sep)[0] in PACKAGES and rel.endswith(".py") else None


# The first-use import of the package's names (PEP 562, lazy_exports.py since 1ee3776): their
# hooks run whenever a module is imported on first use, not because the path reads them.
IMPORT_HOOKS = {(os.path.join("deltafl_jax", "lazy_exports.py"), "__getattr__"),
                (os.path.join("deltafl_jax", "lazy_exports.py"), "__dir__"),
                (os.path.join("deltafl_jax", "__init__.py"), "__setattr__")}


def _function_of_ours(frame):
    """The file of `frame` when it runs a function of ours: not a module's or a class body's
    code run by an import (no CO_OPTIMIZED flag), nor a first-use import hook
    (:data:`IMPORT_HOOKS`). Counted, those made a module imported on first use inside the walk
    count where the same module imported before the walk did not (5 files on the
    configuration's walk at 5c38704: 58 counted with them, 53 without)."""
    code = frame.f_code
    rel = _ours(code.co_filename)
    if rel is None or not code.co_flags & inspect.CO_OPTIMIZED or \
            (rel, code.co_name) in IMPORT_HOOKS:
        return None
    return rel


class _Files:
    """The files of the functions of ours called while it is entered."""

    def __init__(self):
        self.files = set()

    def __call__(self, frame, event, arg):
        if event == "call":
            rel = _function_of_ours(frame)
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


SENTINEL = 0.123456789   # --ditto_lambda's value while its path is traced


def _holds(value, depth: int = 1) -> bool:
    """Whether `value` is the sentinel, or holds it up to `depth` containers down."""
    if isinstance(value, (float, int)) and not isinstance(value, bool):
        return value == SENTINEL
    if depth == 0 or isinstance(value, (str, bytes, type)):
        return False
    if isinstance(value, dict):
        items = list(value.values())[:64]
    elif isinstance(value, (list, tuple)):
        items = list(value)[:64]
    elif dataclasses.is_dataclass(value):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not callable(value):
        items = list(vars(value).values())[:64]
    else:
        return False
    return any(_holds(v, depth - 1) for v in items)


class _Carriers(_Files):
    """The files of our frames whose arguments (on call) or locals (on return) hold the
    sentinel."""

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        rel = _function_of_ours(frame)
        if rel and rel not in self.files:
            try:
                if any(_holds(v) for v in list(frame.f_locals.values())):
                    self.files.add(rel)
            except Exception:  # pylint: disable=broad-except  (a tracer, a lazy object)
                pass


def hyper_path():
    """(c): the files --ditto_lambda crosses from the command line to the round."""
    from experiments import run as runner
    runner.FLAGS.unparse_flags()
    with tempfile.TemporaryDirectory() as out:
        argv = _tiny_argv(out) + ["--algorithm=ditto", f"--ditto_lambda={SENTINEL!r}"]
        with _Carriers() as seen:
            runner.main(runner.parse_flags_or_fail(argv))
    return seen.files


def _sources(packages=PACKAGES + ("bench",)):
    for pkg in packages:
        for path in sorted(glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)):
            with open(path) as f:
                yield os.path.relpath(path, ROOT), ast.parse(f.read())


def _class_fields(node: ast.ClassDef) -> int:
    return sum(isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)
               for b in node.body)


def _config_reads(tree, flat, groups):
    """(flat, nested) reads of settings: X.name with X a configuration (a name or attribute
    ending in ``config``/``cfg``) and name a flat flag name; X.group.field."""
    flat_reads = nested = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        end = base.id if isinstance(base, ast.Name) else \
            base.attr if isinstance(base, ast.Attribute) else ""
        if end in ("config", "cfg") and node.attr in flat and node.attr not in groups:
            flat_reads += 1
        elif end in groups and isinstance(base, ast.Attribute):
            inner = base.value
            root = inner.id if isinstance(inner, ast.Name) else \
                inner.attr if isinstance(inner, ast.Attribute) else ""
            nested += root in ("config", "cfg")
    return flat_reads, nested


def shape_counts():
    """The syntax-tree counts of the module docstring."""
    from deltafl_jax.run.config import FLAT, GROUPS
    groups = {name for name, _ in GROUPS} | {"online", "timing", "asynchronous"}
    long_functions, classes, flat_reads, nested_reads = [], [], 0, 0
    experiment = {}
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long_functions.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
            elif isinstance(node, ast.ClassDef):
                classes.append((_class_fields(node), f"{rel}:{node.name}"))
                if rel == os.path.join("deltafl_jax", "run", "experiment.py") and \
                        node.name == "Experiment":
                    experiment["fields"] = _class_fields(node)
        if rel == os.path.join("deltafl_jax", "run", "experiment.py"):
            experiment["package_imports"] = sorted({
                n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("deltafl_jax")})
        if rel.startswith("deltafl_jax" + os.sep):
            f, n = _config_reads(tree, FLAT, groups)
            flat_reads, nested_reads = flat_reads + f, nested_reads + n
    classes.sort(reverse=True)
    return {"functions_over_60_lines": long_functions,
            "classes_over_20_fields": [f"{name} ({k})" for k, name in classes if k > 20],
            "largest_classes": [f"{name} ({k})" for k, name in classes[:5]],
            "experiment_fields": experiment.get("fields"),
            "experiment_package_imports": len(experiment.get("package_imports", [])),
            "experiment_imports": experiment.get("package_imports", []),
            "flat_setting_reads_in_package": flat_reads,
            "nested_setting_reads_in_package": nested_reads}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    total = sorted(f for pkg in PACKAGES for f in
                   (os.path.relpath(x, ROOT) for x in glob.glob(os.path.join(ROOT, pkg, "**",
                                                                            "*.py"),
                                                               recursive=True))
                   if not f.endswith("__init__.py") or os.path.getsize(os.path.join(ROOT, f)))
    rnd, cfg, hyp = round_path(), config_path(), hyper_path()
    result = {"package_files": len(total), "round_path_files": len(rnd),
              "config_path_files": len(cfg), "hyper_path_files": len(hyp),
              **shape_counts(), "round_path": sorted(rnd), "config_path": sorted(cfg),
              "hyper_path": sorted(hyp)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
