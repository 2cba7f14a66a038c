"""A run checkpointed by the code before the configuration was declared once (issue 32) resumes
after it: ``tests/fixtures/resume_before_32/`` is a finished 2-round run written by that code
with

    python -m experiments.run --flagfile=tests/resume.flags --thetas=1.0,0.5 --seeds=1 \
        --synthetic_num_clients=12 --num_rounds=2 --eval_every=1 --server_optimizer=adam \
        --server_lr=0.03 --client_optimizer=momentum --l2_reg=0.01 --output_dir=DIR

and the same command with ``--num_rounds=4`` continues it from its checkpoint to the outputs of
an uninterrupted 4-round run. The resume fingerprint holds flag names and values, not the
configuration's Python layout, so a new layout must leave it as it was.

The fixture's two rounds were computed before each replica's sums were given their own order
(a program of several replicas then rounded its last bits differently), so the continuation
keeps the fixture's records bit for bit and reaches the uninterrupted run's within 1e-5
relative (a stable learning rate), its integer records exactly."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import run_runner
from test_continue import models, npz, records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "resume_before_32")
FLAGS = [f"--flagfile={os.path.join(REPO, 'tests', 'resume.flags')}", "--thetas=1.0,0.5",
         "--seeds=1", "--synthetic_num_clients=12", "--eval_every=1",
         "--server_optimizer=adam", "--server_lr=0.03", "--client_optimizer=momentum",
         "--l2_reg=0.01"]


def _saved_fingerprint():
    with open(os.path.join(FIXTURE, "checkpoints", "2", "meta", "metadata")) as f:
        return json.load(f)["fingerprint"]


def close_records(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for k in x:
            if isinstance(x[k], float):
                np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-7, err_msg=k)
            else:
                assert x[k] == y[k], k


def close_arrays(a, b, what):
    assert sorted(a) == sorted(b), what
    for k in a:
        if np.issubdtype(a[k].dtype, np.floating):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=f"{what}:{k}")
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}:{k}")


@pytest.mark.slow   # a long check: CI's second step keeps the fast tests within 4 minutes
def test_a_run_checkpointed_before_the_change_continues_to_the_uninterrupted_run(tmp_path,
                                                                                  capsys):
    saved = _saved_fingerprint()
    if saved["jax_version"] != jax.__version__:
        pytest.skip(f"the fixture was written with jax {saved['jax_version']}, this is "
                    f"{jax.__version__} (a resume across jax versions is refused)")
    out, whole = str(tmp_path / "continued"), str(tmp_path / "whole")
    shutil.copytree(FIXTURE, out)
    shorter = records(out)
    code, err, stdout = run_runner([*FLAGS, f"--output_dir={out}", "--num_rounds=4"], capsys)
    assert code == 0, err
    assert (f"deltafl_jax: continuing {out} from its checkpoint after round 2, to round 4"
            in stdout)
    code, err, _ = run_runner([*FLAGS, f"--output_dir={whole}", "--num_rounds=4"], capsys)
    assert code == 0, err
    assert [r for r in records(out) if r["round"] <= 2] == shorter
    close_records(records(out), records(whole))
    for name in ("rounds.npz", "clients.npz", "clients_history.npz"):
        close_arrays(npz(os.path.join(out, name)), npz(os.path.join(whole, name)), name)
    a, b = models(out), models(whole)
    assert sorted(a) == sorted(b) and a
    for f in a:
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
                     a[f], b[f])


def test_the_fixtures_fingerprint_names_the_flags():
    """The saved fingerprint is flat, keyed by flag names (what a new layout must reproduce)."""
    saved = _saved_fingerprint()
    for flag in ("server_optimizer", "server_lr", "server_beta2", "client_optimizer",
                 "client_momentum", "dp_clip", "dataset", "synthetic_num_clients", "thetas",
                 "filter", "num_rounds"):
        assert flag in saved, flag
    assert saved["server_optimizer"] == "adam" and saved["server_lr"] == [0.03]
