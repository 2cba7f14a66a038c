"""Runs of FedProx and Ditto written while their hyper-parameters still carried a theta that
nothing read still load and continue: ``tests/fixtures/resume_before_hyper_fields/`` is a
finished 2-round run of both, with a checkpoint after round 2, written by that code with

    python -m experiments.run --dataset=synthetic --synthetic_num_clients=12 \
        --synthetic_max_examples=120 --synthetic_shared=0.8 --model=linear --seeds=1 \
        --clients_per_round=4 --batch_size=16 --learning_rate=0.05 --eval_every=1 \
        --checkpoint_every=2 --checkpoint_every_s=0 --tensorboard=no --devices=1 \
        --algorithm=fedprox,ditto --fedprox_mu=0.1 --ditto_lambda=0.1 --num_rounds=2 \
        --output_dir=DIR

A replica's hyper-parameters are rebuilt from the command line at each run, never stored: the
checkpoint holds the round's state and the summary the replicas' labels, whose theta = 1 does
not come from the hyper-parameters. So the stored labels are the ones the specs give now, and
the same command with ``--num_rounds=4`` continues each run from its checkpoint to the outputs
of an uninterrupted 4-round run: bit for bit on a CPU that computes the fixture's first two
rounds bit for bit, to float32 rounding on one whose kernels round differently."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import run_runner
from deltafl_jax.algorithms import registry
from deltafl_jax.replicas.labels import ReplicaLabel
from test_continue import models, npz, records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "resume_before_hyper_fields")
METHODS = ("fedprox", "ditto")
FLAGS = ["--dataset=synthetic", "--synthetic_num_clients=12", "--synthetic_max_examples=120",
         "--synthetic_shared=0.8", "--model=linear", "--seeds=1", "--clients_per_round=4",
         "--batch_size=16", "--learning_rate=0.05", "--eval_every=1", "--checkpoint_every=2",
         "--checkpoint_every_s=0", "--tensorboard=no", "--devices=1", "--algorithm=fedprox,ditto",
         "--fedprox_mu=0.1", "--ditto_lambda=0.1"]


def _summary(method):
    with open(os.path.join(FIXTURE, method, "summary.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("method", METHODS)
def test_the_stored_labels_are_the_ones_the_spec_gives_now(method):
    spec = registry.get(method)
    stored = [ReplicaLabel.from_json(r) for r in _summary(method)["replicas"]]
    assert [dataclasses.replace(lab, seed=-1) for lab in stored] == [spec.label(0.1)]
    assert stored[0].theta == 1.0
    hyper = spec.hyper_for(stored[0].param_value)
    assert tuple(hyper) == (0.1,) and "theta" not in hyper._fields


@pytest.mark.slow   # two end-to-end runs: CI's second step
def test_a_run_checkpointed_before_the_change_continues_to_the_uninterrupted_run(tmp_path,
                                                                                  capsys):
    with open(os.path.join(FIXTURE, "fedprox", "checkpoints", "2", "meta", "metadata")) as f:
        saved_jax = json.load(f)["fingerprint"]["jax_version"]
    if saved_jax != jax.__version__:
        pytest.skip(f"the fixture was written with jax {saved_jax}, this is {jax.__version__} "
                    f"(a resume across jax versions is refused)")
    out, whole = str(tmp_path / "continued"), str(tmp_path / "whole")
    shutil.copytree(FIXTURE, out)
    shorter = {m: records(os.path.join(out, m)) for m in METHODS}
    code, err, stdout = run_runner([*FLAGS, f"--output_dir={out}", "--num_rounds=4"], capsys)
    assert code == 0, err
    code, err, _ = run_runner([*FLAGS, f"--output_dir={whole}", "--num_rounds=4"], capsys)
    assert code == 0, err
    for m in METHODS:
        a, b = os.path.join(out, m), os.path.join(whole, m)
        assert f"continuing {a} from its checkpoint after round 2, to round 4" in stdout
        assert [r for r in records(a) if r["round"] <= 2] == shorter[m]
        # Bit for bit where this CPU computes the fixture's first two rounds as the machine
        # that wrote it did; another CPU's kernels round differently in the last bits (seen:
        # 2e-8 relative on an AMD EPYC Zen 4), and the continued run starts from the fixture's
        # bits, so there the two runs agree to float32 rounding.
        same = as_equal if [r for r in records(b) if r["round"] <= 2] == shorter[m] else \
            as_close
        same(records(a), records(b), m)
        for name in ("rounds.npz", "clients.npz", "clients_history.npz"):
            x, y = npz(os.path.join(a, name)), npz(os.path.join(b, name))
            assert sorted(x) == sorted(y), name
            for k in x:
                same(x[k], y[k], f"{m} {name}:{k}")
        ma, mb = models(a), models(b)
        assert sorted(ma) == sorted(mb) and ma
        for f in ma:
            jax.tree.map(lambda u, v: same(u, v, f"{m} {f}"), ma[f], mb[f])


def as_equal(x, y, what):
    """Bit for bit: records (lists of dicts) or arrays."""
    if isinstance(x, list):
        assert x == y, what
    else:
        np.testing.assert_array_equal(x, y, err_msg=what)


def as_close(x, y, what, rtol=1e-5):
    """Equal to float32 rounding: records compare their numbers to rtol and the rest exactly;
    arrays of floats to rtol, others exactly."""
    if isinstance(x, list):
        assert len(x) == len(y), what
        for rx, ry in zip(x, y):
            assert sorted(rx) == sorted(ry), what
            for k in rx:
                if isinstance(rx[k], float):
                    assert np.isclose(rx[k], ry[k], rtol=rtol, atol=0), (what, rx["round"], k)
                else:
                    assert rx[k] == ry[k], (what, rx["round"], k)
        return
    x, y = np.asarray(x), np.asarray(y)
    if np.issubdtype(x.dtype, np.floating):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * float(np.max(np.abs(y), initial=0)),
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(x, y, err_msg=what)
