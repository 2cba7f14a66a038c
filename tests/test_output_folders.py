"""Output folders end to end, by subprocess (exit code, stderr, the folder's bytes):

- one process at a time per folder (deltafl_jax.run.lock): a second ``experiments.run`` into a
  folder in use, and ``experiments.tune`` / ``experiments.leaderboard`` into a locked one, are
  refused with one line and exit code 2, leaving it as it was; a run killed with SIGKILL leaves
  a folder that the next run takes over and resumes;
- ``experiments.report --out`` and ``experiments.leaderboard --out`` write only into a folder
  that is absent, empty or their own (their marker), never over someone's files;
- whether a folder is a run is decided from its top level: ``--output_dir=/usr``, or a folder
  whose symbolic links loop, is refused at once.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from deltafl_jax import ConfigError, run_experiment
from deltafl_jax.outputs import directory as outputs
from conftest import tiny_config
from deltafl_jax.run import lock
from test_command_start import probe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--dataset=synthetic", "--synthetic_num_clients=16", "--synthetic_max_examples=60",
        "--synthetic_shared=0.8", "--model=linear", "--thetas=1,0.5", "--seeds=1",
        "--clients_per_round=3", "--batch_size=8", "--tensorboard=no", "--nosave_models",
        "--checkpoint_every_s=0"]
BOARD = ["--settings=leaderboard_synthetic_1_1", "--methods=fedavg", "--num_rounds=2",
         "--eval_every=2", "--synthetic_num_clients=40", "--clients_per_round=6",
         "--lr_multipliers=1", "--seeds=1"]
# A guard against a hang, far above a refusal's start-up even on a loaded machine.
GUARD_S = 240


def snapshot(folder):
    """Every path under `folder` (not following links) -> sha256 of its bytes, None for a
    folder, the target for a link."""
    out = {}
    for here, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(here, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = None
            else:
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def command(module, *args, timeout=GUARD_S):
    """`python -m module args` from the repository; (exit code, stderr lines, stdout)."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, [l for l in proc.stderr.splitlines() if l.strip()], proc.stdout


def start(module, *args, log):
    """`python -m module args` started in the background, its output into the file `log`
    (a pipe nobody reads would fill and stall it)."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT)


def wait_for(predicate, what, proc=None, log=None, timeout=GUARD_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def tail(log) -> str:
    with open(log) as f:
        return f.read()[-2000:]


def refused_untouched(folder, module, *args):
    """Run the command: exit 2, one line on stderr, the folder byte for byte as it was."""
    before = snapshot(folder)
    code, err, _ = command(module, *args)
    assert code == 2 and len(err) == 1, err
    assert snapshot(folder) == before
    return err[0]


# --------------------------------------------------------------------------------------------
# One process at a time


@pytest.fixture
def held(tmp_path):
    """An empty folder locked by this process, as a live run holds its folder."""
    folder = tmp_path / "busy"
    folder.mkdir()
    taken = lock.acquire(str(folder))
    yield folder
    taken.release()


def test_run_tune_and_leaderboard_refuse_a_locked_folder(held):
    """Another process holds the folder: each command says so in one line (naming the
    holder's pid), exit 2, and writes nothing, the lock file included."""
    assert sorted(os.listdir(held)) == [outputs.LOCK]
    pid = f"pid {os.getpid()} "
    line = refused_untouched(held, "experiments.run", *TINY, "--num_rounds=2",
                             f"--output_dir={held}")
    assert line.startswith(f"error: --output_dir={held} is in use by another process ({pid}")
    line = refused_untouched(held, "experiments.tune", *TINY, "--num_rounds=2",
                             "--lr_grid=0.1,0.2", "--tune_l2=no", f"--output_dir={held}")
    assert line.startswith(f"error: --output_dir={held} is in use by another process ({pid}")
    line = refused_untouched(held, "experiments.leaderboard", *BOARD, f"--out={held}")
    assert line.startswith(f"error: --out={held} is in use by another process ({pid}")


def test_a_lock_is_exclusive_and_released_whatever_the_exit(tmp_path):
    """flock semantics through the module: refused while another process holds the folder;
    that process killed with SIGKILL frees it (its file stays, unlocked) and the folder is
    taken over; release removes the file and the folders made for it. The holder imports the
    lock without JAX."""
    folder = tmp_path / "a" / "b"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from deltafl_jax.run import lock\n"
         "lock.acquire(sys.argv[1]); print('held', 'jax' in sys.modules, flush=True); "
         "time.sleep(600)",
         str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().split() == ["held", "False"]   # no JAX needed
        assert lock.holder(str(folder)).startswith(f"pid {holder.pid} ")
        with pytest.raises(ConfigError, match=f"^--output_dir={folder} is in use by another "
                                              f"process \\(pid {holder.pid} "):
            lock.acquire(str(folder))
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(folder)) == [outputs.LOCK]   # left behind, unlocked
    assert lock.holder(str(folder)) is None
    again = lock.acquire(str(folder))
    assert json.loads((folder / outputs.LOCK).read_text())["pid"] == os.getpid()
    again.release()
    assert os.listdir(folder) == []
    shutil.rmtree(tmp_path / "a")
    made = lock.acquire(str(folder))         # makes a/ and a/b/ ...
    made.release()                            # ... and removes them, left empty
    assert not (tmp_path / "a").exists()


@pytest.mark.slow   # a run that lasts until it is stopped
def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path):
    """The first run is running (it has written metrics.jsonl); the same command again exits
    2 with one line naming it; the first then stops on SIGTERM with a metrics.jsonl of no duplicate line, one
    record per replica and evaluated round, in order."""
    out = tmp_path / "run"
    argv = [*TINY, "--num_rounds=100000", "--eval_every=1", "--checkpoint_every=5",
            f"--output_dir={out}"]
    log = tmp_path / "first.log"
    first = start("experiments.run", *argv, log=log)
    try:
        wait_for(lambda: (out / outputs.METRICS).exists(), "metrics.jsonl", first, log)
        code, err, _ = command("experiments.run", *argv)
        assert code == 2 and len(err) == 1, err
        assert (out / outputs.LOCK).exists()
        assert err[0].startswith(f"error: --output_dir={out} is in use by another process "
                                 f"(pid {first.pid} ")
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=GUARD_S)
    assert first.returncode == 128 + signal.SIGTERM, tail(log)
    lines = (out / outputs.METRICS).read_text().splitlines()
    records = [json.loads(l) for l in lines]
    assert len(set(lines)) == len(lines)
    rounds = [r["round"] for r in records]
    assert rounds == sorted(rounds)
    keys = [(r["round"], r["theta"]) for r in records]
    assert len(set(keys)) == len(keys) and {r["theta"] for r in records} == {1.0, 0.5}
    assert not (out / outputs.LOCK).exists()


@pytest.mark.slow   # a run killed, then resumed
def test_a_killed_run_is_taken_over_and_resumed(tmp_path):
    """SIGKILL leaves the lock file (unlocked) with the checkpoints; the same command takes
    the folder over, resumes from the newest checkpoint, and its metrics.jsonl holds every
    evaluated round once per replica, as an uninterrupted run of as many rounds writes it."""
    out = tmp_path / "run"
    argv = [*TINY, "--eval_every=1", "--checkpoint_every=2"]
    log = tmp_path / "first.log"
    first = start("experiments.run", *argv, "--num_rounds=100000", f"--output_dir={out}",
                  log=log)

    def steps():
        folder = out / "checkpoints"
        return [int(n) for n in os.listdir(folder) if n.isdigit()] if folder.is_dir() else []

    try:
        wait_for(lambda: (out / outputs.LOCK).exists(), "lock file", first, log)
        wait_for(lambda: bool(steps()), "checkpoint", first, log)
    finally:
        first.kill()
        first.wait()
    assert (out / outputs.LOCK).exists()
    done = max(steps()) + 2
    code, err, stdout = command("experiments.run", *argv, f"--num_rounds={done}",
                                f"--output_dir={out}")
    assert code == 0, err
    assert "resuming" in stdout + "\n".join(err)
    assert not (out / outputs.LOCK).exists()
    fresh = tmp_path / "fresh"
    code, err, _ = command("experiments.run", *argv, f"--num_rounds={done}",
                           f"--output_dir={fresh}")
    assert code == 0, err
    got = [json.loads(l) for l in (out / outputs.METRICS).read_text().splitlines()]
    want = [json.loads(l) for l in (fresh / outputs.METRICS).read_text().splitlines()]
    assert len({(r["round"], r["theta"]) for r in got}) == len(got) == 2 * done
    timeless = lambda r: {k: v for k, v in r.items() if k != "elapsed_s"}
    assert [timeless(r) for r in got] == [timeless(r) for r in want]   # bit for bit


# --------------------------------------------------------------------------------------------
# Folders that are not the command's


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_synthetic):
    """A finished tiny run to report on (in-process: the refusals below need only a run): the
    run of conftest's refused_over_a_finished_run, whose programs the persistent compilation
    cache holds once any test of the run has built them."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_experiment(tiny_config(num_rounds=1, eval_every=1, output_dir=str(out),
                               tensorboard=False), tiny_synthetic, log=lambda line: None)
    return out


def report(argv, capsys):
    """experiments.report in-process: (exit code, stderr)."""
    from experiments import report as report_cli
    report_cli.FLAGS.unparse_flags()
    code = 0
    try:
        report_cli.main(report_cli.parse_flags_or_fail(["report", *argv]))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def users_folder(root, *names):
    folder = root / "mine"
    folder.mkdir()
    for name in names:
        (folder / name).write_text(f"the user's own {name}\n")
    return folder


def test_report_refuses_a_folder_of_other_files(finished_run, tmp_path, capsys):
    """Refused with one line, exit 2, the folder untouched, before JAX and matplotlib are
    imported (the runs are read with NumPy alone); in-process too, for a copy of the
    package's source."""
    folder = users_folder(tmp_path, "report.md", "final.csv")
    before = snapshot(folder)
    code, _, err, heavy = probe(tmp_path, "experiments.report",
                                [str(finished_run), f"--out={folder}"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert snapshot(folder) == before
    assert heavy == [], heavy
    line = lines[0]
    assert line.startswith(f"error: --out={folder} is not a folder of experiments.report (it "
                           f"holds final.csv, report.md and no deltafl_report.json)")
    source = tmp_path / "deltafl_jax"       # a copy of the package's source
    shutil.copytree(os.path.join(REPO, "deltafl_jax"), source,
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = snapshot(source)
    code, err = report([str(finished_run), f"--out={source}"], capsys)
    assert code == 2 and "is not a folder of experiments.report" in err, err
    assert snapshot(source) == before


def test_report_writes_again_into_its_own_folder(finished_run, tmp_path, capsys):
    """A report's folder (its marker) is written again; a file the user added is kept."""
    out = tmp_path / "report"
    code, err = report([str(finished_run), f"--out={out}"], capsys)
    assert code in (0, None), err
    assert json.loads((out / "deltafl_report.json").read_text())["written_by"] == "deltafl_jax"
    first = snapshot(out)
    (out / "notes.md").write_text("mine")
    code, err = report([str(finished_run), f"--out={out}"], capsys)
    assert code in (0, None), err
    assert (out / "notes.md").read_text() == "mine"
    assert set(snapshot(out)) == set(first) | {"notes.md"}


def test_leaderboard_refuses_a_folder_of_other_files(tmp_path):
    folder = users_folder(tmp_path, "leaderboard.md")
    line = refused_untouched(folder, "experiments.leaderboard", *BOARD, f"--out={folder}")
    assert line.startswith(f"error: --out={folder} is not a folder of experiments.leaderboard "
                           f"(it holds leaderboard.md and no deltafl_leaderboard.json)")


def test_tune_refuses_a_folder_of_other_files(tmp_path):
    folder = users_folder(tmp_path, "tuning.md", "notes.txt")
    line = refused_untouched(folder, "experiments.tune", *TINY, f"--output_dir={folder}")
    assert line.startswith(f"error: --output_dir={folder} is not a folder of experiments.tune "
                           f"(it holds notes.txt, tuning.md and no deltafl_tune.json)")


# --------------------------------------------------------------------------------------------
# Decided from the top level


def test_a_large_folder_is_refused_at_once():
    """/usr holds thousands of folders; only its own entries are read."""
    code, err, _ = command("experiments.run", "--flagfile=experiments/synthetic.flags",
                           "--output_dir=/usr")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --output_dir=/usr is not a run of deltafl_jax: it holds ")


def test_links_that_loop_are_not_followed(tmp_path):
    """A folder whose subfolder links back to it twice (a walk that follows links never
    ends): refused at once, untouched, naming the run below it and no more."""
    folder = tmp_path / "loops"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    os.symlink("..", folder / "sub" / "up")
    os.symlink("..", folder / "sub" / "again")
    os.symlink(".", folder / "here")
    (folder / "a_run").mkdir()
    (folder / "a_run" / outputs.MARKER).write_text("{}")
    line = refused_untouched(folder, "experiments.run", *TINY, "--num_rounds=2",
                             f"--output_dir={folder}")
    assert line.startswith(f"error: --output_dir={folder} is not a run but holds runs (a_run);")


# --------------------------------------------------------------------------------------------
# A folder is a run only if this package wrote it; nothing goes inside a run (issue 51)


def test_report_refuses_an_out_inside_a_run_it_does_not_report(finished_run, tmp_path):
    """--out inside a run that the report does not read (runs/long/rep while reporting
    runs/markov), or the run itself: one line, exit 2, the run byte for byte as it was (it
    can still be continued)."""
    other = tmp_path / "markov"
    shutil.copytree(finished_run, other)
    where = os.path.realpath(finished_run)
    for out in (finished_run / "rep", finished_run / "rep" / "deeper",
                finished_run / "checkpoints"):
        line = refused_untouched(finished_run, "experiments.report", str(other), f"--out={out}")
        assert line == (f"error: --out={out} is inside the run {where}; write the report "
                        f"beside it (a run's folder holds only what a run writes)")
    line = refused_untouched(finished_run, "experiments.report", str(other),
                             f"--out={finished_run}")
    assert line == (f"error: --out={finished_run} is a run of deltafl_jax; write the report "
                    f"elsewhere")


def users_results(tmp_path):
    """A folder of someone's own summary.json and metrics.jsonl (not written by this package)."""
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / outputs.SUMMARY).write_text(json.dumps({"accuracy": 0.91, "epochs": 3}) + "\n")
    (folder / outputs.METRICS).write_text("".join(
        json.dumps({"epoch": e, "loss": 1.0 / e}) + "\n" for e in (1, 2, 3)))
    return folder


@pytest.mark.slow   # two start-ups of experiments.run (JAX): test_output_dir checks it in-process
def test_someones_summary_and_metrics_are_not_a_run(tmp_path):
    """Not "a finished run with other settings": a folder that is not a run, refused with and
    without --overwrite (which replaced the files before), nothing replaced."""
    folder = users_results(tmp_path)
    for extra in ((), ("--overwrite",)):
        line = refused_untouched(folder, "experiments.run", *TINY, "--num_rounds=2",
                                 f"--output_dir={folder}", *extra)
        assert line == (f"error: --output_dir={folder} is not a run of deltafl_jax: it holds "
                        f"metrics.jsonl, summary.json but no deltafl_run.json, the mark of a run "
                        f"this package wrote; choose a new or empty directory (--overwrite "
                        f"replaces a run, never other files)")


def test_which_folders_are_runs(tmp_path):
    """A run carries the marker; one written before the marker existed is known by its own
    files (a run of this package kept in tests/fixtures, its marker removed): its checkpoint,
    its summary.json, or its metrics.jsonl, each alone. Someone's files of the same names, or
    a marker of someone else's, are not; nor is a folder inside them."""
    fixture = os.path.join(REPO, "tests", "fixtures", "resume_before_32")
    everything = set(os.listdir(fixture)) - {outputs.MARKER}
    for i, keep in enumerate((everything, {"checkpoints"}, {outputs.SUMMARY},
                              {outputs.METRICS})):
        run = tmp_path / f"run{i}"
        shutil.copytree(fixture, run)
        for entry in set(os.listdir(run)) - keep:
            shutil.rmtree(run / entry) if (run / entry).is_dir() else (run / entry).unlink()
        assert outputs.inspect_dir(str(run)) == outputs.DirState("run"), keep
        assert outputs.enclosing_run(str(run / "rep" / "deeper")) == os.path.realpath(run)
    folder = users_results(tmp_path)
    state = outputs.inspect_dir(str(folder))
    assert (state.kind, state.unmarked) == ("other", True)
    assert outputs.enclosing_run(str(folder / "sub")) is None
    (folder / outputs.MARKER).write_text(json.dumps({"written_by": "someone"}))
    assert outputs.inspect_dir(str(folder)).kind == "other"


@pytest.mark.slow   # three tiny runs
def test_a_run_written_before_the_marker_continues(tmp_path):
    """A finished run whose folder has no marker (written before it existed) is continued to
    more rounds by the same command, bit for bit as an uninterrupted run, and marked."""
    out, fresh = tmp_path / "old", tmp_path / "fresh"
    argv = [*TINY, "--eval_every=1", "--checkpoint_every=1"]
    code, err, _ = command("experiments.run", *argv, "--num_rounds=2", f"--output_dir={out}")
    assert code == 0, err
    os.remove(out / outputs.MARKER)
    code, err, _ = command("experiments.run", *argv, "--num_rounds=4", f"--output_dir={out}")
    assert code == 0, err
    assert json.loads((out / outputs.MARKER).read_text())["written_by"] == "deltafl_jax"
    code, err, _ = command("experiments.run", *argv, "--num_rounds=4", f"--output_dir={fresh}")
    assert code == 0, err
    timeless = lambda path: [{k: v for k, v in json.loads(l).items() if k != "elapsed_s"}
                             for l in path.read_text().splitlines()]
    assert timeless(out / outputs.METRICS) == timeless(fresh / outputs.METRICS)


@pytest.mark.slow   # two start-ups of experiments.run (JAX): test_output_dir checks it in-process
def test_a_run_inside_a_run_is_refused(finished_run):
    """--output_dir inside another run (its folder, or its checkpoints/): one line, exit 2,
    with or without --overwrite, the run left as it was."""
    where = os.path.realpath(finished_run)
    for out, extra in ((finished_run / "sub", ()),
                       (finished_run / "checkpoints", ("--overwrite",))):
        line = refused_untouched(finished_run, "experiments.run", *TINY, "--num_rounds=2",
                                 f"--output_dir={out}", *extra)
        assert line == (f"error: --output_dir={out} lies inside the run {where}, which could "
                        f"then no longer be continued; choose a directory outside it")
