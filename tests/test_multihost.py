"""Two processes x 2 CPU devices, joined with jax.distributed on localhost, give the same
metrics as one process x 4 devices, and only process 0 writes outputs; both killed with
SIGKILL, they resume from their checkpoint and end bit-identical to an uninterrupted
two-process run."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow   # subprocess runs: CI's second step (see .ci/run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "tests", "tiny.flags")
COMMON = [f"--flagfile={TINY}", "--tensorboard=no", "--nosave_models"]


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env(devices):
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def records(out):
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    for r in recs:
        r.pop("elapsed_s")
    return recs


def test_two_processes_equal_one_process_of_four_devices(tmp_path):
    one = str(tmp_path / "one")
    proc = subprocess.run([sys.executable, "-m", "experiments.run", *COMMON,
                           f"--output_dir={one}", "--devices=4"], cwd=REPO, env=env(4),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = [str(tmp_path / f"proc{i}") for i in range(2)]
    finish(start_pair(outs, free_port(), COMMON, devices=2))
    assert os.path.exists(os.path.join(outs[0], "summary.json"))
    assert not os.path.exists(outs[1])            # process 1 writes nothing
    got, want = records(outs[0]), records(one)
    assert [(r["round"], r["theta"], r["seed"], r["num_selected"]) for r in got] == \
        [(r["round"], r["theta"], r["seed"], r["num_selected"]) for r in want]
    for a, b in zip(got, want):
        for k, v in b.items():
            if isinstance(v, float):
                np.testing.assert_allclose(a[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    summary = json.load(open(os.path.join(outs[0], "summary.json")))
    assert summary["config"]["devices"] is None   # all devices of every process: 2 x 2


def test_unreachable_coordinator_is_an_error_not_a_hang(tmp_path):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "experiments.run", *COMMON,
                           f"--output_dir={tmp_path / 'x'}", "--distributed",
                           f"--coordinator_address=localhost:{port}", "--num_processes=2",
                           "--process_id=1", "--distributed_timeout_s=5"], cwd=REPO,
                          env=env(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "cannot join the distributed run" in proc.stderr
    assert not (tmp_path / "x").exists()


RESUME = [f"--flagfile={os.path.join(REPO, 'tests', 'resume.flags')}", "--num_rounds=12",
          "--nosave_models"]


def start_pair(out, port, flags=None, devices=2):
    """Two processes x `devices` CPU devices of one run of `flags` (default RESUME); `out` one
    output dir for both (as on a shared disk) or a pair, one per process."""
    outs = [out, out] if isinstance(out, str) else list(out)
    return [subprocess.Popen(
        [sys.executable, "-m", "experiments.run", *(RESUME if flags is None else flags),
         f"--output_dir={outs[i]}", "--distributed", f"--coordinator_address=localhost:{port}",
         "--num_processes=2", f"--process_id={i}", "--distributed_timeout_s=60"], cwd=REPO,
        env=env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]


def finish(procs):
    """Wait for both; process 0's stdout."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    return outs[0]


def test_two_processes_killed_resume_bit_identical(tmp_path):
    """Both processes of a run killed with SIGKILL after its checkpoint of round >= 6 (of 12);
    the same two commands again resume it from the checkpoint, and the outputs equal those of
    an uninterrupted two-process run bit for bit."""
    whole = str(tmp_path / "whole")
    finish(start_pair(whole, free_port()))
    out = str(tmp_path / "run")
    procs = start_pair(out, free_port())
    ckpts = os.path.join(out, "checkpoints")
    deadline = time.time() + 300
    while time.time() < deadline and all(p.poll() is None for p in procs):
        done = [int(n) for n in os.listdir(ckpts) if n.isdigit()] if os.path.isdir(ckpts) else []
        if done and max(done) >= 6:
            for p in procs:
                p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    for p in procs:
        p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(out, "summary.json"))
    assert "resuming" in finish(start_pair(out, free_port()))
    assert records(out) == records(whole)
    for name in ("rounds.npz", "clients.npz", "clients_history.npz"):
        with np.load(os.path.join(out, name)) as a, np.load(os.path.join(whole, name)) as b:
            assert sorted(a.files) == sorted(b.files)
            for k in a.files:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name}:{k}")


ASYNC = [f"--flagfile={TINY}", "--tensorboard=no", "--nosave_models", "--algorithm=fedbuff",
         "--thetas=1", "--concurrency=6", "--buffer_size=3", "--max_staleness=1",
         "--client_speed=lognormal", "--availability=bernoulli", "--availability_p=0.7",
         "--num_rounds=8", "--eval_every=4"]
# What differs with the device count by design: the critical path's local-SGD trips of each
# device (its share of the step's jobs).
PER_DEVICE = {"train_trips", "device_train_trips", "device_train_jobs"}


def test_fedbuff_on_two_processes_equals_one_process(tmp_path):
    """FedBuff (C = 6, K = 3, S = 1, lognormal speeds, Bernoulli availability) on two
    processes of one CPU device each, joined with jax.distributed: process 0 writes the
    metrics of one process of one device within 1e-5, and the host's event log exactly (each
    server step's virtual time, updates and stale drops in rounds.npz; each client's jobs
    started, updates aggregated and stale drops in clients.npz); process 1 writes nothing."""
    one = str(tmp_path / "one")
    proc = subprocess.run([sys.executable, "-m", "experiments.run", *ASYNC,
                           f"--output_dir={one}"], cwd=REPO, env=env(1), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = [str(tmp_path / f"proc{i}") for i in range(2)]
    finish(start_pair(outs, free_port(), ASYNC, devices=1))
    assert not os.path.exists(outs[1])            # process 1 writes nothing
    got, want = records(outs[0]), records(one)
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for a, b in zip(got, want):
        for k, v in b.items():
            if isinstance(v, float):
                np.testing.assert_allclose(a[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
            else:
                assert a[k] == v, k
    with np.load(os.path.join(outs[0], "rounds.npz")) as a, \
            np.load(os.path.join(one, "rounds.npz")) as b:
        assert sorted(a.files) == sorted(b.files)
        for k in ("virtual_time", "num_selected", "dropped_updates", "staleness_mean"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert b["dropped_updates"].sum() > 0
        for k in set(b.files) - PER_DEVICE:
            if b[k].dtype.kind == "f":
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)
            else:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    with np.load(os.path.join(outs[0], "clients.npz")) as a, \
            np.load(os.path.join(one, "clients.npz")) as b:
        assert sorted(a.files) == sorted(b.files)
        for k in ("train_jobs_started", "train_updates_aggregated", "train_updates_stale"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        for k in ("train_error", "test_error", "train_loss", "test_loss"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)
