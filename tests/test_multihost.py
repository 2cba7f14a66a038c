"""Two processes x 2 CPU devices, joined with jax.distributed on localhost, give the same
metrics as one process x 4 devices, and only process 0 writes outputs."""

import json
import os
import socket
import subprocess
import sys

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
    port = free_port()
    outs = [str(tmp_path / f"proc{i}") for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.run", *COMMON, f"--output_dir={outs[i]}",
         "--distributed", f"--coordinator_address=localhost:{port}", "--num_processes=2",
         f"--process_id={i}", "--distributed_timeout_s=60"], cwd=REPO, env=env(2),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
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
