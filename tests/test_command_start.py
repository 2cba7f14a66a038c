"""The data commands and the report answer a command line they refuse (a misspelt flag, a
missing source, no run given) and ``--help`` before they import JAX, Flax, optax, orbax,
TensorFlow, tensorflow-datasets, matplotlib or SciPy: each is run in a fresh interpreter, as
``python -m`` runs it, and the modules it imported are read back after it exits. (The
experiment commands define their flags from the algorithms' declarations, which import JAX.)"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("jax", "flax", "optax", "orbax", "tensorflow", "tensorflow_datasets", "matplotlib",
         "scipy")

# Runs `module` with `argv` as `python -m module argv` does, then writes its exit code and the
# heavy libraries it imported to the file named first.
PROBE = """
import json, runpy, sys
out, module, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = [module] + argv
code = 0
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(%r)))
with open(out, "w") as f:
    json.dump({"code": code, "heavy": heavy}, f)
""" % json.dumps(HEAVY)

CASES = [
    ("experiments.report", [], "error: no run directory given"),
    ("data_prep.prepare", ["--dataset=femnist", "--data_dir={tmp}"],
     "error: femnist: no prepared data and no source"),
    ("data_prep.stats", ["--dataset=sent140", "--data_dir={tmp}"], "error: "),
    ("data_prep.prepare", ["--bad_flag"], "error: Unknown command line flag 'bad_flag'"),
]


def probe(tmp_path, module, argv):
    """(exit code, stdout, stderr, the heavy libraries imported) of `python -m module argv`."""
    result = tmp_path / "probe.json"
    argv = [a.replace("{tmp}", str(tmp_path / "data")) for a in argv]
    proc = subprocess.run([sys.executable, "-c", PROBE, str(result), module, *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 or "Traceback" not in proc.stderr, proc.stderr
    found = json.loads(result.read_text())
    return found["code"], proc.stdout, proc.stderr, found["heavy"]


@pytest.mark.parametrize("module,argv,line", CASES,
                         ids=[f"{m}{' ' if a else ''}{' '.join(a)}" for m, a, _ in CASES])
def test_a_refused_command_line_is_answered_before_the_heavy_imports(tmp_path, module, argv,
                                                                    line):
    code, out, err, heavy = probe(tmp_path, module, argv)
    assert code == 2, err
    assert out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert err.startswith(line), err
    assert heavy == [], f"{module} imported {', '.join(heavy)} before refusing {argv}"
    assert not os.path.exists(tmp_path / "data")


@pytest.mark.parametrize("module", ["data_prep.prepare", "data_prep.stats"])
def test_help_is_printed_before_the_heavy_imports(tmp_path, module):
    code, out, err, heavy = probe(tmp_path, module, ["--help"])
    assert code == 0, err
    assert out.startswith(f"usage: python -m {module} ") and "--flagfile=FILE" in out
    assert heavy == [], f"{module} --help imported {', '.join(heavy)}"


@pytest.mark.parametrize("module", ["data_prep.prepare", "experiments.report"])
def test_help_into_a_closed_pipe_ends_quietly(module):
    """``python -m MODULE --help | head -1``: the reader has gone before the help is written
    (here the pipe's read end is closed first, so the write fails every time); the command
    exits 0 with nothing on stderr, no BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
