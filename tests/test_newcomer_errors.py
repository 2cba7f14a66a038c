"""What a new user hits at the edges, each answered in one line:

- the command line: a layer over itself (``ditto+ditto``, ``ditto+adam+ditto``), a flagfile
  that is not text, and a count so large that a plan's index stream outgrows int32 or the
  host's memory (``--finetune_steps``, ``--local_epochs``, ``--local_steps``, ``--batch_size``,
  ``--eval_chunk``) are one line on stderr, exit code 2, and no output folder (in process here;
  by subprocess in the slow tests, without 'Traceback');
- serving: ``for_client`` refuses anything but an integer in 0..N-1; ``load_model`` on a folder
  of runs lists them; an unregistered model says how to register it; inputs of the wrong shape
  name both shapes;
- checkpoints: a damaged one is moved aside (``damaged-<round>``), not deleted, and orbax's own
  log lines about it are silenced;
- privacy: a large default delta (1/N^1.1 at a small N) is warned about; summary.json's privacy
  block holds each replica's epsilon (the final evaluation's ``dp_epsilon``);
- resume: ``--target_accuracy`` changes no training and may change across a resume, also of a
  run whose saved fingerprint still holds it.
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import run_runner, tiny_config

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TINY = os.path.join(HERE, "tiny.flags")


def one_line_refusal(code, err, out):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert not os.path.exists(out)
    return lines[0]


# -- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["ditto+ditto", "ditto+adam+ditto"])
def test_a_layer_over_itself_is_one_line(tmp_path, capsys, entry):
    out = str(tmp_path / "out")
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--algorithm={entry}", "--thetas=1",
                               f"--output_dir={out}"], capsys)
    line = one_line_refusal(code, err, out)
    assert f"--algorithm entry {entry!r}" in line and "--ditto_lambda" in line


def test_the_layer_over_another_method_still_composes():
    from deltafl_jax.algorithms import registry
    from deltafl_jax.errors import ConfigError
    assert registry.find("ditto+ditto") is None
    with pytest.raises(ConfigError, match="ditto layer over ditto"):
        registry.get("ditto+ditto")
    flags = [s.flag for s in registry.get("deltafl+ditto").sweeps()]
    assert flags == ["thetas", "ditto_lambda"]


@pytest.mark.parametrize("nested", [False, True], ids=["given", "named_by_another_flagfile"])
def test_a_flagfile_that_is_not_text_is_one_line(tmp_path, capsys, nested):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes([0xD4, 0x00, 0xFF, 0x81]) * 50)
    given = binary
    if nested:
        given = tmp_path / "outer.flags"
        given.write_text(f"--dataset=synthetic\n--flagfile={binary}\n")
    out = str(tmp_path / "out")
    code, err, _ = run_runner([f"--flagfile={given}", f"--output_dir={out}"], capsys)
    line = one_line_refusal(code, err, out)
    assert f"--flagfile={binary} is not a text file" in line and "byte 0" in line


# flags -> the flag the one line names
HUGE = {
    "finetune_steps": (["--client_holdout=0.2", "--finetune_steps=0,100000000000"],
                       "--finetune_steps=100000000000"),
    "local_epochs": (["--local_epochs=100000000000"], "--local_epochs=100000000000"),
    "local_steps": (["--local_steps=100000000000"], "--local_steps=100000000000"),
    "batch_size": (["--batch_size=100000000000"], "--batch_size=100000000000"),
    "eval_chunk": (["--eval_chunk=100000000000"], "--eval_chunk=100000000000"),
}


@pytest.mark.parametrize("name", sorted(HUGE))
def test_a_stream_too_long_to_index_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                          name):
    flags, named = HUGE[name]
    out = str(tmp_path / "out")
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", *flags], capsys)
    line = one_line_refusal(code, err, out)
    assert named in line and "int32" in line, line


def test_stream_limits_int32_and_host_memory(monkeypatch):
    from deltafl_jax.errors import ConfigError
    from deltafl_jax.run import placement
    limit = 2 ** 31 - 1   # the largest int32
    placement.check_streams([("--a", limit, 4 * limit)])  # fits where the host has 16 GB+
    with pytest.raises(ConfigError, match="--a: a stream of 2,147,483,648 examples"):
        placement.check_streams([("--a", limit + 1, 4)])
    monkeypatch.setattr(placement, "host_memory", lambda: 1000)
    placement.check_streams([("--a", 100, 200), ("--b", 100, 300)])   # 500 = half of 1000
    with pytest.raises(ConfigError, match="^--b: the plans need"):
        placement.check_streams([("--a", 100, 200), ("--b", 100, 301)])


def test_the_personal_adaptation_stream_is_counted_as_the_evaluation_allocates_it(
        tiny_synthetic):
    """The stream that block_plan allocates (ceil(k B / a) passes over each of a block's K
    largest adaptation sets) is what the resolve step checks, computed here by hand."""
    from deltafl_jax.evaluation.holdout import hold_out
    from deltafl_jax.run import resolve
    config = tiny_config(client_holdout=0.2, finetune_steps=(0, 7), batch_size=8)
    data = hold_out(tiny_synthetic, 0.2, 0)
    streams = resolve._streams(config, data, resolve.plan_lib.LocalWork(8, 1, None), 6, 1,
                               False)
    flags, entries, nbytes = streams[-1]
    want = 0
    for split in (data.train, data.holdout.test_adapt):   # every client fits in one block
        a = np.sort(split.sizes)[::-1].astype(np.int64)
        want = max(want, int(np.sum(-(-(7 * 8) // a) * a)))
    assert flags == "--finetune_steps=7 with --batch_size=8"
    assert (entries, nbytes) == (want, 4 * want)


# -- serving ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ditto_run(tmp_path_factory):
    """A finished 2-round Ditto run with its personal models saved."""
    from deltafl_jax import run_experiment
    out = str(tmp_path_factory.mktemp("serving") / "ditto")
    config = tiny_config(algorithm="ditto", thetas=(1.0,), ditto_lambda=(1.0,), num_rounds=2,
                         eval_every=2, output_dir=out, save_models=True, tensorboard=False)
    run_experiment(config)
    return out


def test_for_client_refuses_anything_but_a_training_client(ditto_run):
    from deltafl_jax import load_model
    from deltafl_jax.errors import DeltaFLError
    from deltafl_jax.outputs.serving import LoadedModel
    served = load_model(ditto_run, seed=1)
    n = json.load(open(os.path.join(ditto_run, "summary.json")))["dataset"]["num_train_clients"]
    assert served.num_clients == n
    for bad in (1.5, -1, n, True, "1", None):
        with pytest.raises(DeltaFLError, match=rf"training client .* is not in 0\.\.{n - 1} "
                                               rf"\(for_client takes the integer index"):
            served.for_client(bad)
    own = served.for_client(np.int64(2))
    import jax
    for got, every in zip(jax.tree.leaves(own.params), jax.tree.leaves(served.personal)):
        assert np.array_equal(got, np.asarray(every)[2])
    glob = LoadedModel(params=served.params, model=served.model, labels=served.labels,
                       num_clients=n)   # a global model: the same model for every client
    assert glob.for_client(n - 1) is glob
    with pytest.raises(DeltaFLError):
        glob.for_client(1.5)
    with pytest.raises(DeltaFLError):
        glob.for_client(n)


def test_load_model_on_a_folder_of_runs_lists_them(ditto_run, tmp_path):
    from deltafl_jax import load_model
    from deltafl_jax.errors import DeltaFLError
    shutil.copytree(ditto_run, tmp_path / "ditto")
    shutil.copytree(ditto_run, tmp_path / "deltafl+ditto" / "seed_1")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DeltaFLError, match=re.escape(
            f"{tmp_path} holds 2 runs, not one: deltafl+ditto/seed_1, ditto; load one of them")):
        load_model(str(tmp_path), seed=1)


def test_an_unregistered_model_says_how_to_register_it(ditto_run, tmp_path):
    from deltafl_jax import load_model
    out = tmp_path / "custom"
    shutil.copytree(ditto_run, out)
    index = json.load(open(out / "models" / "index.json"))
    index["model"] = "two_layer"
    (out / "models" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"unknown model 'two_layer'.*"
                                         r"register_model\('two_layer', \.\.\.\).*--model_module"):
        load_model(str(out), seed=1)


def test_inputs_of_another_shape_name_both_shapes(ditto_run, tiny_synthetic):
    from deltafl_jax import load_model
    from deltafl_jax.errors import DeltaFLError
    served = load_model(ditto_run, seed=1)
    d = tiny_synthetic.feature_shape[0]
    with pytest.raises(DeltaFLError, match=re.escape(
            f"inputs of shape (3, {d + 1}) do not fit model 'linear', which takes a batch of "
            f"shape (B, {d})")):
        served.predict(np.zeros((3, d + 1), np.float32))
    with pytest.raises(DeltaFLError, match=re.escape("(one example: x[None])")):
        served.predict(np.zeros((d,), np.float32))
    assert served.predict(np.zeros((3, d), np.float32)).shape == (3, 10)


# -- checkpoints -----------------------------------------------------------------------------

def _files(folder):
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def _scramble(step_dir):
    """Every file of the step overwritten with bytes that are neither JSON nor UTF-8."""
    for path in _files(step_dir):
        with open(os.path.join(step_dir, path), "wb") as f:
            f.write(bytes([0xC9, 0x81, 0xFE]) * 20)


def test_a_damaged_checkpoint_is_set_aside_and_orbax_stays_silent(tmp_path, capsys, caplog):
    from test_checkpoint import FINGERPRINT, assert_trees_identical, make_state
    from deltafl_jax.run.checkpoint import Checkpointer
    with Checkpointer(str(tmp_path)) as checkpointer:
        for r in (2, 3):
            checkpointer.save(r, make_state(r), FINGERPRINT)
    _scramble(str(tmp_path / "3"))
    damaged = _files(str(tmp_path / "3"))
    capsys.readouterr()
    caplog.set_level(logging.DEBUG)
    with Checkpointer(str(tmp_path)) as checkpointer:
        round, restored = checkpointer.restore(make_state(0))
        assert round == 2 and checkpointer.rounds() == [2]
        assert_trees_identical(restored, make_state(2))
        lines = capsys.readouterr().err.strip().splitlines()
        aside = str(tmp_path / "damaged-3")
        assert len(lines) == 1 and f"moved to {aside}, falling back to round 2" in lines[0]
        assert _files(aside) == damaged   # kept as it was
        checkpointer.save(3, make_state(3), FINGERPRINT)   # round 3 can be saved again
        assert checkpointer.restore(make_state(0))[0] == 3
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []
    _scramble(str(tmp_path / "3"))   # damaged again: a second name beside the first
    with Checkpointer(str(tmp_path)) as checkpointer:
        assert checkpointer.restore(make_state(0))[0] == 2
    assert sorted(os.listdir(tmp_path)) == ["2", "damaged-3", "damaged-3-2"]


# -- privacy ---------------------------------------------------------------------------------

def test_a_large_default_delta_is_warned_about(tiny_synthetic, capsys):
    from deltafl_jax.privacy.dp import Privacy
    from deltafl_jax.run.resolve import resolve
    line = Privacy(clip=0.5).delta_warning(20)
    assert f"1/N^1.1 = {20 ** -1.1:.3g} at N = 20 " in line and "set --dp_delta" in line
    assert Privacy(clip=0.5).delta_warning(10_000) is None   # 4e-5
    assert Privacy(clip=0.5, delta=0.03).delta_warning(20) is None   # the user's own
    config = tiny_config(algorithm="fedavg", thetas=(1.0,), weighting="unweighted",
                         dp_clip=0.5, dp_noise_multiplier=(1.0, 2.0))
    capsys.readouterr()
    run = resolve(config, tiny_synthetic)
    n = tiny_synthetic.train.num_clients
    assert capsys.readouterr().err.strip().splitlines() == [Privacy(clip=0.5).delta_warning(n)]
    # summary.json's privacy block: epsilon at delta after the run's rounds, per replica (the
    # final evaluation's dp_epsilon: Accounting.epsilons at the last round)
    block = run.accounting.describe(run.replicas.labels)
    eps = run.accounting.epsilons(config.num_rounds)
    assert block["rounds"] == config.num_rounds
    assert block["epsilon"] == {lab.key(): float(e) for lab, e in zip(run.replicas.labels, eps)}
    assert eps[0] > eps[1] > 0   # z = 2 spends less than z = 1


@pytest.mark.slow   # a whole private run
def test_summary_privacy_block_holds_each_replicas_epsilon(tmp_path, capsys):
    out = tmp_path / "private"
    code, err, _ = run_runner([f"--flagfile={TINY}", "--algorithm=fedavg", "--thetas=1",
                               "--weighting=unweighted", "--dp_clip=0.5",
                               "--dp_noise_multiplier=1,2", "--dp_delta=1e-5",
                               f"--output_dir={out}"], capsys)
    assert code == 0, err
    summary = json.load(open(out / "summary.json"))
    block, final = summary["privacy"], summary["final"]
    assert block["rounds"] == 6
    assert block["epsilon"] == {k: v["dp_epsilon"] for k, v in final.items()}
    eps = sorted(set(block["epsilon"].values()))
    assert len(eps) == 2 and 0 < eps[0] < eps[1]   # z = 2 spends less than z = 1


def test_the_personalisation_flagfiles_comment_names_what_it_runs():
    """Every theta of --thetas is trained by Delta-FL and by Ditto over Delta-FL: the comment
    names each of them for both."""
    with open(os.path.join(REPO, "experiments", "personalize_synthetic.flags")) as f:
        text = f.read()
    thetas = re.search(r"^--thetas=(.*)$", text, re.M).group(1).split(",")
    comment = " ".join(line[1:].strip() for line in text.splitlines() if line.startswith("#"))
    for method in ("Delta-FL at", "Ditto over Delta-FL ("):
        said = comment[comment.index(method):][:60].split(")")[0].split(",")[0]
        for theta in thetas:
            assert theta in said, (method, said)


# -- resume ----------------------------------------------------------------------------------

def test_target_accuracy_is_not_part_of_what_a_resume_must_match():
    from deltafl_jax.run.resume import fingerprint_diff, settings
    old = {"learning_rate": 0.05, "target_accuracy": 0.5}   # saved before: it held the target
    assert fingerprint_diff(old, {"learning_rate": 0.05}) == []
    assert fingerprint_diff(old, {"learning_rate": 0.1}) == ["learning_rate"]
    assert "target_accuracy" not in settings(tiny_config(target_accuracy=0.7))


@pytest.mark.slow   # a continued run
def test_a_run_saved_with_the_target_in_its_fingerprint_continues_with_another(tmp_path,
                                                                                capsys):
    import jax
    fixture = os.path.join(HERE, "fixtures", "resume_before_32")
    with open(os.path.join(fixture, "checkpoints", "2", "meta", "metadata")) as f:
        saved = json.load(f)["fingerprint"]
    assert saved["target_accuracy"] == 0.5
    if saved["jax_version"] != jax.__version__:
        pytest.skip(f"the fixture was written with jax {saved['jax_version']}")
    out = str(tmp_path / "continued")
    shutil.copytree(fixture, out)
    from test_resume_before_32 import FLAGS
    code, err, stdout = run_runner([*FLAGS, f"--output_dir={out}", "--num_rounds=3",
                                    "--target_accuracy=0.9"], capsys)
    assert code == 0, err
    assert "continuing" in stdout
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["config"]["target_accuracy"] == 0.9


# -- end to end, by subprocess ---------------------------------------------------------------

def _command(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


CLI_CASES = {
    "ditto+ditto": ["--algorithm=ditto+ditto", "--thetas=1"],
    "ditto+adam+ditto": ["--algorithm=ditto+adam+ditto", "--thetas=1"],
    "finetune_steps": HUGE["finetune_steps"][0],
    "local_epochs": HUGE["local_epochs"][0],
}


@pytest.mark.slow   # a process start each (jax's import): CI's second step
@pytest.mark.parametrize("name", sorted(CLI_CASES) + ["binary flagfile"])
def test_the_command_refuses_in_one_line_by_subprocess(tmp_path, name):
    out = str(tmp_path / "out")
    if name == "binary flagfile":
        binary = tmp_path / "data.bin"
        binary.write_bytes(bytes(range(128, 256)) * 4)
        args = [f"--flagfile={binary}"]
    else:
        args = [f"--flagfile={TINY}", *CLI_CASES[name]]
    done = _command(*args, f"--output_dir={out}")
    one_line_refusal(done.returncode, done.stderr, out)


@pytest.mark.slow   # two runs by subprocess
def test_a_damaged_checkpoint_is_one_warning_line_by_subprocess(tmp_path):
    out = str(tmp_path / "run")
    resume_flags = os.path.join(HERE, "resume.flags")
    done = _command(f"--flagfile={resume_flags}", "--num_rounds=4", f"--output_dir={out}")
    assert done.returncode == 0, done.stderr
    _scramble(os.path.join(out, "checkpoints", "4"))
    done = _command(f"--flagfile={resume_flags}", "--num_rounds=6", f"--output_dir={out}")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    aside = os.path.join(out, "checkpoints", "damaged-4")
    assert len(lines) == 1 and f"moved to {aside}, falling back to round 2" in lines[0], \
        done.stderr
    assert os.path.isdir(aside)


@pytest.mark.slow   # a subprocess under an 8 GB address-space limit
def test_data_larger_than_the_host_is_one_line_by_subprocess(tmp_path):
    """--synthetic_num_clients=1e11 cannot be generated: the MemoryError is one line, exit 2,
    and no output folder (the limit makes the failure quick and the machine safe)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    out = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--flagfile=experiments/synthetic.flags",
         "--synthetic_num_clients=100000000000", "--num_rounds=1", f"--output_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=600, preexec_fn=limit)
    line = one_line_refusal(proc.returncode, proc.stderr, out)
    assert "ran out of memory" in line and "--synthetic_num_clients" in line
