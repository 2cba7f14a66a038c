"""Which folders a run writes into: an absent or empty folder, or a run of this
package (deltafl_jax.outputs.directory.inspect_dir: every entry one a run writes, and its marker or, for
a run written before the marker, its summary.json / metrics.jsonl / checkpoints/). A source
folder, the parent of runs and a folder holding other files are refused with one line and exit
code 2, with or without --overwrite, and are left byte for byte as they were."""

import hashlib
import json
import os
import shutil

import pytest

from conftest import run_runner
from deltafl_jax.outputs import directory as outputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--dataset=synthetic", "--synthetic_num_clients=16", "--synthetic_max_examples=60",
        "--synthetic_shared=0.8", "--model=linear", "--thetas=1,0.5", "--seeds=1",
        "--num_rounds=2", "--clients_per_round=3", "--batch_size=8", "--eval_every=2",
        "--tensorboard=no", "--nosave_models", "--checkpoint_every=2",
        "--checkpoint_every_s=0"]


def snapshot(folder):
    """Every path under `folder` (folders too) -> the sha256 of its bytes (None for a folder)."""
    out = {}
    for here, dirs, files in os.walk(folder):
        for d in dirs:
            out[os.path.relpath(os.path.join(here, d), folder)] = None
        for f in files:
            with open(os.path.join(here, f), "rb") as fh:
                out[os.path.relpath(os.path.join(here, f), folder)] = \
                    hashlib.sha256(fh.read()).hexdigest()
    return out


def run(capsys, out, *extra):
    return run_runner([*TINY, f"--output_dir={out}", *extra], capsys)


def refused(capsys, folder, *extra):
    """Run into `folder` with and without --overwrite: exit 2, one line, nothing changed."""
    before = snapshot(folder)
    assert before, "the folder must hold something"
    messages = []
    for flags in ((), ("--overwrite",)):
        code, err, _ = run(capsys, folder, *extra, *flags)
        lines = [l for l in err.splitlines() if l.strip()]
        assert code == 2 and len(lines) == 1, err
        messages.append(lines[0])
        assert snapshot(folder) == before
    return messages


@pytest.fixture(scope="module")
def parent_of_runs(tmp_path_factory):
    """A two-method run: <parent>/fedavg/ and <parent>/deltafl/ (README's runs/dp_synthetic)."""
    parent = tmp_path_factory.mktemp("two") / "compare"
    from experiments import run as runner
    runner.FLAGS.unparse_flags()
    try:
        runner.main(runner.parse_flags_or_fail(["run", *TINY, "--algorithm=fedavg,deltafl",
                                                f"--output_dir={parent}"]))
    except SystemExit as e:
        assert e.code in (0, None)
    assert sorted(os.listdir(parent)) == ["deltafl", "fedavg"]
    return parent


def test_a_source_folder_is_refused(tmp_path, capsys):
    source = tmp_path / "experiments"
    shutil.copytree(os.path.join(REPO, "experiments"), source,
                    ignore=shutil.ignore_patterns("__pycache__"))
    single, _ = refused(capsys, source)
    assert single.startswith(f"error: --output_dir={source} is not a run of deltafl_jax: it "
                             f"holds ")
    assert "(--overwrite replaces a run, never other files)" in single
    # Several methods write <folder>/<method>/: the folder itself is refused too.
    (several, _) = refused(capsys, source, "--algorithm=fedavg,deltafl")
    assert f"--output_dir={source} holds " in several and "deltafl/, fedavg/" in several


def test_the_parent_of_runs_is_refused(parent_of_runs, capsys):
    message, _ = refused(capsys, parent_of_runs)
    assert message == (f"error: --output_dir={parent_of_runs} is not a run but holds runs "
                       f"(deltafl, fedavg); name a directory of its own, e.g. "
                       f"{parent_of_runs}/NAME (--overwrite replaces a run, never a folder of "
                       f"them)")
    # The same two-method command into it continues to be accepted (its own sub-runs): it is
    # refused only as finished runs are, naming the results they hold.
    before = snapshot(parent_of_runs)
    code, err, _ = run(capsys, parent_of_runs, "--algorithm=fedavg,deltafl")
    assert code == 2 and "already holds results" in err
    assert snapshot(parent_of_runs) == before


def test_a_folder_holding_other_files_is_refused(tmp_path, capsys):
    folder = tmp_path / "mine"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "x.csv").write_text("1,2\n")
    (folder / "notes.txt").write_text("mine")
    message, _ = refused(capsys, folder)
    assert "it holds data/, notes.txt (not files a run writes)" in message
    # A run's own files beside someone else's: still not a run.
    (folder / "summary.json").write_text("{}")
    (folder / outputs.MARKER).write_text(json.dumps({"written_by": "deltafl_jax"}))
    refused(capsys, folder)


def test_runs_and_empty_folders_are_accepted(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err, _ = run(capsys, empty)
    assert code == 0, err
    assert outputs.inspect_dir(str(empty)).kind == "run"
    mark = json.load(open(empty / outputs.MARKER))
    assert mark["written_by"] == "deltafl_jax" and mark["settings"]["num_rounds"] == 2
    # A finished run is replaced with --overwrite, refused without.
    before = snapshot(empty)
    code, err, _ = run(capsys, empty)
    assert code == 2 and "already holds results" in err and snapshot(empty) == before
    code, err, _ = run(capsys, empty, "--overwrite", "--learning_rate=0.05")
    assert code == 0, err
    # A run written before the marker existed is still a run (its summary.json).
    os.remove(empty / outputs.MARKER)
    assert outputs.inspect_dir(str(empty)).kind == "run"
    code, err, _ = run(capsys, empty, "--overwrite")
    assert code == 0, err


def test_a_stopped_run_of_other_settings_is_refused(tmp_path, capsys):
    """A run stopped before its first checkpoint is started afresh by the same command; by
    another one (its marker holds the settings), refused naming the flags."""
    out = tmp_path / "stopped"
    code, err, _ = run(capsys, out)
    assert code == 0, err
    for name in ("summary.json", "clients.npz", "checkpoints"):   # as if killed early
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    before = snapshot(out)
    code, err, _ = run(capsys, out, "--learning_rate=0.3")
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "--learning_rate differ" in lines[0], err
    assert snapshot(out) == before
    code, err, stdout = run(capsys, out)
    assert code == 0, err
    assert "stopped before its first checkpoint; starting it afresh" in stdout


def test_someones_summary_and_metrics_are_not_a_run(tmp_path, capsys):
    """A run's file names that this package did not write (no marker, no run's own fields):
    'not a run', with and without --overwrite (which replaced them before), nothing changed.
    tests/test_output_folders.py checks the same by subprocess (slow)."""
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"accuracy": 0.91}) + "\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "loss": 0.5}) + "\n")
    for message in refused(capsys, folder):
        assert message == (f"error: --output_dir={folder} is not a run of deltafl_jax: it holds "
                           f"metrics.jsonl, summary.json but no deltafl_run.json, the mark of a "
                           f"run this package wrote; choose a new or empty directory "
                           f"(--overwrite replaces a run, never other files)")


def test_an_output_dir_inside_a_run_is_refused(tmp_path, capsys):
    """Inside a finished run (a copy of the one kept in tests/fixtures: its folder, or its
    checkpoints/), with or without --overwrite: one line, exit 2, the run byte for byte as it
    was."""
    out = tmp_path / "run"
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "resume_before_32"), out)
    before = snapshot(out)
    for inner in (out / "sub", out / "checkpoints"):
        for flags in ((), ("--overwrite",)):
            code, err, _ = run(capsys, inner, *flags)
            lines = [l for l in err.splitlines() if l.strip()]
            assert code == 2 and lines == [
                f"error: --output_dir={inner} lies inside the run {os.path.realpath(out)}, "
                f"which could then no longer be continued; choose a directory outside it"], err
            assert snapshot(out) == before
