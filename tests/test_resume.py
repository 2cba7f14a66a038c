"""Kill a run and rerun the same command: it resumes from its newest checkpoint and ends with
outputs bit-identical to an uninterrupted run. The runs are real subprocesses of
``python -m experiments.run``, killed with SIGKILL at a random round or stopped with SIGTERM."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import flax.serialization
import jax
import numpy as np
import pytest

pytestmark = pytest.mark.slow   # subprocess runs: CI's second step (see .ci/run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = os.path.join(REPO, "tests", "resume.flags")


def command(out, *extra):
    return [sys.executable, "-m", "experiments.run", f"--flagfile={FLAGS}", f"--output_dir={out}",
            *extra]


def run(out, *extra):
    return subprocess.run(command(out, *extra), cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def saved_rounds(out):
    d = os.path.join(out, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def start_and_kill(out, sig, *extra, after_checkpoint=None):
    """Start a run; once its checkpoint after round `after_checkpoint` exists (random when
    None), send `sig`. Returns the finished process."""
    target = after_checkpoint or random.Random(len(str(out))).choice([2, 4, 6, 8, 10])
    proc = subprocess.Popen(command(out, *extra), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if saved_rounds(out) and max(saved_rounds(out)) >= target:
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    proc.stdout_text, proc.stderr_text = proc.communicate(timeout=240)
    return proc


def records(out):
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    for r in recs:
        r.pop("elapsed_s")
    return recs


def assert_same_outputs(a, b):
    assert records(a) == records(b)
    for name in ("rounds.npz", "clients.npz", "clients_history.npz"):
        with np.load(os.path.join(a, name)) as x, np.load(os.path.join(b, name)) as y:
            assert sorted(x.files) == sorted(y.files)
            for k in x.files:
                np.testing.assert_array_equal(x[k], y[k], err_msg=f"{name}:{k}")
    for f in sorted(os.listdir(os.path.join(a, "models"))):
        if f.endswith(".msgpack"):
            ta = flax.serialization.msgpack_restore(open(os.path.join(a, "models", f), "rb").read())
            tb = flax.serialization.msgpack_restore(open(os.path.join(b, "models", f), "rb").read())
            jax.tree.map(np.testing.assert_array_equal, ta, tb)



def killed_and_rerun(tmp_path, *flags, after_checkpoint=10) -> str:
    """A run with `flags` SIGKILLed after its checkpoint of round `after_checkpoint`, then run
    again: asserts it resumed once and ended with the same outputs, bit for bit, as the same
    run never stopped; returns the resumed run's folder."""
    whole = str(tmp_path / "whole")
    done = run(whole, *flags)
    assert done.returncode == 0, done.stderr
    out = str(tmp_path / "run")
    proc = start_and_kill(out, signal.SIGKILL, *flags, after_checkpoint=after_checkpoint)
    assert proc.returncode == -signal.SIGKILL
    resumed = run(out, *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("resuming") == 1, resumed.stdout
    assert_same_outputs(out, whole)
    return out

# The runs that are killed: Delta-FL, Tilted-ERM (algorithm state), Delta-FL with a server
# optimizer swept over two learning rates (Adam's moments in the state: theta x eta x seeds =
# 8 replicas), SCAFFOLD (per-client control variates), private Delta-FL (noise), private
# Delta-FL under Poisson sampling with an adaptive clip, and DP-FTRL (BandMF).
RUNS = {"deltafl": ("--algorithm=deltafl",), "term": ("--algorithm=term",),
        "fedadam": ("--algorithm=deltafl", "--server_optimizer=adam", "--server_lr=0.01,0.03"),
        "scaffold": ("--algorithm=scaffold", "--thetas=1"),
        # Private Delta-FL: the noise of the update and of the quantile's sums from the round
        # keys, two noise multipliers as replicas.
        "private": ("--algorithm=deltafl", "--weighting=unweighted", "--quantile=secagg_mm",
                    "--mm_iters=3", "--dp_clip=0.5", "--dp_noise_multiplier=0.5,2"),
        # Ditto over Delta-FL: the personal models in the per-client state, the held-out
        # evaluation of seen clients and unseen devices after adaptation, the saved personal
        # models; Adam as the client optimizer (its state starts afresh at each job).
        # DRFA: each replica's clients drawn from its lambda in the state (a plan per
        # replica), and the second sample of the round.
        "drfa": ("--algorithm=drfa", "--drfa_lambda_lr=0.01,0.1", "--local_steps=3"),
        "ditto": ("--algorithm=deltafl+ditto", "--ditto_lambda=0.5", "--client_holdout=0.2",
                  "--finetune_steps=0,2", "--client_optimizer=adam"),
        # Poisson client sampling (the cohorts from (seed, round)) with private Delta-FL's
        # fixed denominator and adaptive clipping (each replica's clip in the state).
        "poisson": ("--algorithm=deltafl", "--weighting=unweighted", "--quantile=secagg_mm",
                    "--mm_iters=3", "--client_sampling=poisson", "--dp_clip=adaptive",
                    "--dp_kept_weight=expected", "--dp_noise_multiplier=0.5,2"),
        # DP-FTRL: cyclic groups and BandMF's noise history in the state.
        "bandmf": ("--algorithm=fedavg", "--thetas=1", "--weighting=unweighted",
                   "--client_sampling=cyclic", "--dp_clip=0.5", "--dp_mechanism=bandmf",
                   "--dp_noise_multiplier=0.5,2")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    outs = {}
    for name, flags in RUNS.items():
        out = str(tmp_path_factory.mktemp("whole") / name)
        proc = run(out, *flags)
        assert proc.returncode == 0, proc.stderr
        outs[name] = out
    return outs


@pytest.mark.parametrize("name", sorted(RUNS))
def test_sigkill_then_rerun_is_bit_identical(uninterrupted, tmp_path, name):
    out = str(tmp_path / "run")
    proc = start_and_kill(out, signal.SIGKILL, *RUNS[name])
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(out, "summary.json"))
    resumed = run(out, *RUNS[name])
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("resuming") == 1, resumed.stdout   # said once
    assert_same_outputs(out, uninterrupted[name])


def test_swept_server_optimizer_run_serves_its_models(uninterrupted):
    from deltafl_jax import load_model
    out = uninterrupted["fedadam"]
    with open(os.path.join(out, "summary.json")) as f:
        keys = list(json.load(f)["final"])
    assert len(keys) == 8 and "theta=0.5_server_lr=0.03_seed=1" in keys
    model = load_model(out, theta=0.5, server_lr=0.03, seed=1)
    other = load_model(out, theta=0.5, server_lr=0.01, seed=1)
    assert model.labels["server_lr"] == 0.03
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(model.params), jax.tree.leaves(other.params)))


def test_sigterm_leaves_a_checkpoint_and_a_clean_exit(uninterrupted, tmp_path):
    out = str(tmp_path / "run")
    proc = start_and_kill(out, signal.SIGTERM, after_checkpoint=6)
    assert proc.returncode == 143, proc.stderr_text
    assert "Traceback" not in proc.stderr_text
    assert "run the same command again to resume" in proc.stdout_text
    assert saved_rounds(out) and not os.path.exists(os.path.join(out, "summary.json"))
    resumed = run(out)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_outputs(out, uninterrupted["deltafl"])


def test_changed_flag_on_resume_exits_2_naming_it(tmp_path):
    out = str(tmp_path / "run")
    proc = start_and_kill(out, signal.SIGKILL, after_checkpoint=4)
    assert proc.returncode == -signal.SIGKILL
    before = open(os.path.join(out, "metrics.jsonl")).read()
    bad = run(out, "--learning_rate=0.1")
    assert bad.returncode == 2
    lines = [l for l in bad.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "--learning_rate" in lines[0], bad.stderr
    assert open(os.path.join(out, "metrics.jsonl")).read() == before


def test_corrupted_latest_checkpoint_falls_back_to_the_previous(uninterrupted, tmp_path):
    out = str(tmp_path / "run")
    proc = start_and_kill(out, signal.SIGKILL, after_checkpoint=8)
    assert proc.returncode == -signal.SIGKILL
    rounds = saved_rounds(out)
    assert len(rounds) >= 2   # 2 kept (3 if killed between a save and the old one's deletion)
    newest = os.path.join(out, "checkpoints", str(rounds[-1]))
    victims = [os.path.join(d, f) for d, _, fs in os.walk(newest) for f in fs
               if os.path.getsize(os.path.join(d, f)) > 64]
    with open(max(victims, key=os.path.getsize), "r+b") as f:
        f.truncate(16)
    resumed = run(out)
    assert resumed.returncode == 0, resumed.stderr
    assert f"round {rounds[-2]} of" in resumed.stdout
    assert "warning" in resumed.stderr.lower()
    assert_same_outputs(out, uninterrupted["deltafl"])


def test_overwrite_starts_afresh(tmp_path):
    out = str(tmp_path / "run")
    proc = start_and_kill(out, signal.SIGKILL, after_checkpoint=4)
    again = run(out, "--overwrite", "--num_rounds=4", "--eval_every=2")
    assert again.returncode == 0, again.stderr
    assert "resuming" not in again.stdout
    assert [r["round"] for r in records(out)] == [2, 2, 2, 2, 4, 4, 4, 4]


def test_checkpoint_of_two_devices_resumes_on_one(uninterrupted, tmp_path):
    out = str(tmp_path / "run")
    env2 = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.Popen(command(out, "--devices=2"), cwd=REPO, env=env2,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if saved_rounds(out) and max(saved_rounds(out)) >= 6:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.communicate(timeout=240)
    assert saved_rounds(out)
    resumed = run(out, "--devices=1")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout
    # Rounds before the kill ran on 2 devices: equal to the 1-device run up to float rounding.
    a, b = records(out), records(uninterrupted["deltafl"])
    assert [(r["round"], r["num_selected"]) for r in a] == [(r["round"], r["num_selected"])
                                                            for r in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x["test_error_mean"], y["test_error_mean"], rtol=1e-5)
        np.testing.assert_allclose(x["train_loss_mean"], y["train_loss_mean"], rtol=1e-5)


def test_killed_before_its_first_checkpoint_starts_afresh(uninterrupted, tmp_path):
    """README, Long runs: a run killed with SIGKILL before its first timed checkpoint (the
    default --checkpoint_every_s) has nothing to resume from; the same command starts it
    afresh, saying so in one line, and ends as an uninterrupted run. A finished run is never
    clobbered."""
    out = str(tmp_path / "run")
    timed = ("--checkpoint_every=0", "--checkpoint_every_s=120")
    proc = subprocess.Popen(command(out, *timed), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not os.path.exists(metrics):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.exists(metrics) and saved_rounds(out) == []
    again = run(out, *timed)
    assert again.returncode == 0, again.stderr
    assert "stopped before its first checkpoint; starting it afresh" in again.stdout
    assert "resuming" not in again.stdout
    assert_same_outputs(out, uninterrupted["deltafl"])
    before = open(metrics).read()
    finished = run(out, *timed)
    assert finished.returncode == 2 and "already holds results" in finished.stderr
    assert open(metrics).read() == before
