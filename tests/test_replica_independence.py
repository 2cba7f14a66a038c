"""A replica's trajectory does not depend on the other replicas of its program: FedAvg trained
alone, as Delta-FL's theta = 1 replica among twelve (thetas 1, 0.8, 0.5, 0.1 x 3 seeds), and as
the global model of Ditto's replicas are the same bit for bit. Each replica adds its clients'
updates in the order in which they finish were it dealt alone to the lanes
(:func:`deltafl_jax.engine.lanes.finish_order`), checked here against a step-by-step simulation
of the lanes."""

import jax
import numpy as np
import pytest

from conftest import run_rounds_history, tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.engine.lanes import finish_order as finish_order_eager

ROUNDS = 10
# One program per (jobs, lanes) shape, not one compile per operation run eagerly.
finish_order = jax.jit(finish_order_eager, static_argnums=1)


def simulated_finish_order(steps, lanes):
    """The lanes run step by step: jobs dealt longest first (ties by slot) in snake order
    (lane 0..c-1, then c-1..0, ...), each lane its jobs back to back; at the end of each step
    the lanes that finish a job report it in lane order. Jobs without steps come last."""
    order = sorted((j for j in range(len(steps)) if steps[j] > 0), key=lambda j: -steps[j])
    queues = [[] for _ in range(lanes)]
    for pos, j in enumerate(order):
        row, col = divmod(pos, lanes)
        queues[col if row % 2 == 0 else lanes - 1 - col].append(j)
    left = [steps[q[0]] if q else 0 for q in queues]
    done = []
    while any(queues):
        for lane in range(lanes):
            if not queues[lane]:
                continue
            left[lane] -= 1
            if left[lane] == 0:
                done.append(queues[lane].pop(0))
                left[lane] = steps[queues[lane][0]] if queues[lane] else 0
    return done + [j for j in range(len(steps)) if steps[j] == 0]


def test_finish_order_hand_case():
    # longest first: job 0 (3 steps) to lane 0, job 2 (2) to lane 1, then (snake) job 1 (1)
    # to lane 1: job 2 ends at step 2, jobs 0 and 1 at step 3 (lane 0 first); job 3 never runs
    np.testing.assert_array_equal(finish_order(np.array([3, 1, 2, 0], np.int32), 2),
                                  [2, 0, 1, 3])


@pytest.mark.parametrize("lanes", [1, 2, 3, 5])
def test_finish_order_equals_a_simulation_of_the_lanes(lanes):
    rng = np.random.default_rng(lanes)
    for _ in range(20):
        steps = rng.integers(0, 6, size=11).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(finish_order(steps, lanes)),
                                      simulated_finish_order(list(steps), lanes))


def final_params(data, **cfg):
    exp = build_experiment(tiny_config(**cfg), data)
    state, _ = run_rounds_history(exp, ROUNDS)
    return exp, [np.asarray(x) for x in jax.tree.leaves(state.params)]


def replica(exp, **label):
    rows = [r for r, lab in enumerate(exp.replicas.labels)
            if all(getattr(lab, k) == v for k, v in label.items())]
    assert len(rows) == 1, (label, exp.replicas.labels)
    return rows[0]


@pytest.fixture
def fedavg_alone(tiny_synthetic):
    return final_params(tiny_synthetic, **COMMON, algorithm="fedavg", thetas=(), seeds=(1,))[1]


# Eight of the twelve training clients a round, jobs of ragged lengths on the CPU's two lanes,
# at a learning rate in SGD's stable regime.
COMMON = dict(clients_per_round=8, learning_rate=0.05, num_rounds=ROUNDS)


def test_fedavg_alone_equals_fedavg_in_the_deltafl_grid(fedavg_alone, tiny_synthetic):
    exp, grid = final_params(tiny_synthetic, **COMMON, algorithm="deltafl", thetas=(1.0, 0.8, 0.5, 0.1),
                             seeds=(1, 2, 3))
    assert exp.placement.lanes > 1   # jobs of several replicas share lanes
    r = replica(exp, theta=1.0, seed=1)
    for alone, together in zip(fedavg_alone, grid):
        np.testing.assert_array_equal(together[r], alone[0])


@pytest.mark.slow   # a third program to compile: CI's second step
def test_fedavg_alone_equals_ditto_global_models(fedavg_alone, tiny_synthetic):
    exp, grid = final_params(tiny_synthetic, **COMMON, algorithm="ditto", thetas=(), ditto_lambda=(0.1, 1.0),
                             seeds=(2, 1))
    for lam in (0.1, 1.0):
        r = replica(exp, seed=1, param_value=lam)
        for alone, together in zip(fedavg_alone, grid):
            np.testing.assert_array_equal(together[r], alone[0])


def test_default_host_devices_is_one_per_usable_core():
    import os
    from deltafl_jax.engine.mesh import default_host_devices
    assert default_host_devices() == len(os.sched_getaffinity(0))


def _cli_run(tmp_path, name, devices=None, xla_flags=None):
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    out = tmp_path / name
    argv = [sys.executable, "-m", "experiments.run", f"--flagfile={here}/tiny.flags",
            "--model=mlp", "--clients_per_round=6", f"--output_dir={out}"]
    proc = subprocess.run(argv + ([f"--devices={devices}"] if devices else []),
                          capture_output=True, text=True, timeout=900, env=env,
                          cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, np.load(out / "rounds.npz"), np.load(out / "clients.npz")


LAYOUT = ("device_", "train_trips", "eval_trips", "train_padded", "eval_padded")


@pytest.mark.slow   # three end-to-end runs in subprocesses: CI's second step
def test_a_cpu_run_uses_every_core_by_default_and_equals_one_device(tmp_path):
    """Without --devices a CPU run splits the host into one device per core (here also 3 fake
    devices from XLA_FLAGS), and its outputs equal --devices=1 bit for bit: the same models,
    per-client errors and round metrics, only the per-device work differs."""
    import os
    out1, r1, c1 = _cli_run(tmp_path, "one", devices=1)
    assert "placement: 1 cpu device(s)" in out1, out1
    cores = len(os.sched_getaffinity(0))
    for name, flags, count in (("default", None, cores),
                               ("three", "--xla_force_host_platform_device_count=3", 3)):
        out, r, c = _cli_run(tmp_path, name, xla_flags=flags)
        assert f"placement: {count} cpu device(s)" in out, out
        assert sorted(c.files) == sorted(c1.files)
        for k in c1.files:
            np.testing.assert_array_equal(c[k], c1[k], err_msg=k)
        for k in r1.files:
            if not k.startswith(LAYOUT):
                np.testing.assert_array_equal(r[k], r1[k], err_msg=k)
