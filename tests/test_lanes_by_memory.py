"""Lanes chosen by memory on an accelerator (deltafl_jax/run/placement.py: fit_lanes).

On an accelerator without --clients_per_step the round runs the most lanes, up to the default
(every sampled client), whose footprint fits in MEMORY_SHARE (0.9) of the device's
bytes_limit: the fixed part (data, state, plan, updates) plus L x (the lane's held copies:
3 models, and one step's activations). No test machine has an accelerator:
``placement_backend="gpu"`` plans as on one while running on the CPU, and the device's
bytes_limit (and one lane's step bytes, normally XLA's memory analysis of a compiled step) are
injected. Every expected lane count below is worked out by hand from the stated bytes.
"""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import tiny_config
from deltafl_jax import build_experiment
from deltafl_jax.errors import ConfigError
from deltafl_jax.run import placement
from deltafl_jax.run.estimate import DeviceMemory, Estimate

MB = 2 ** 20
# softmax regression on tiny_synthetic: 60 x 10 kernel + 10 biases, float32
MODEL_BYTES = (60 * 10 + 10) * 4
STEP = 3 * MB   # one lane's step activations, injected
M = 6           # clients per round: the accelerator's default lanes (one replica)


@pytest.mark.parametrize("limit, fixed, per_lane, most, want", [
    (1000, 100, 100, 10, 8),       # 900 - 100 = 800 left: 8 lanes of 100
    (1000, 100, 100, 5, 5),        # 8 would fit: all 5
    (1000, 300, 200, 9, 3),        # 600 left: exactly 3 x 200 (the boundary fits)
    (1000, 301, 200, 9, 2),        # 599 left: 2
    (1000, 800, 100, 4, 1),        # 100 left: one lane
    (1000, 850, 100, 4, 0),        # 50 left: not even one
    (1000, 950, 100, 4, 0),        # the fixed part alone is over 900
    (141 * 10 ** 9, 47 * 10 ** 9, 31 * 10 ** 8, 40, 25),   # 79.9 GB / 3.1 GB = 25.8
])
def test_the_most_lanes_that_fit(limit, fixed, per_lane, most, want):
    assert placement.lanes_that_fit(limit, fixed, per_lane, most) == want


def gpu_run(data, monkeypatch, limit, **extra):
    """The run built as on a GPU whose bytes_limit is `limit`, one lane's step STEP bytes."""
    monkeypatch.setattr(placement, "_bytes_limit", lambda devices: limit)
    monkeypatch.setattr(placement, "lane_step_bytes", lambda model, data, batch: STEP)
    config = tiny_config(thetas=(1.0,), clients_per_round=M, placement_backend="gpu",
                         client_data="device", **extra)
    return build_experiment(config, data)


def test_all_lanes_when_memory_is_ample_fewer_when_not_and_a_refusal_below_one(
        tiny_synthetic, monkeypatch):
    ample = gpu_run(tiny_synthetic, monkeypatch, 10 ** 12)
    fp = ample.program.footprint
    assert ample.placement.lanes == M and ample.placement.jobs == M
    assert fp.lanes == M * 3 * MODEL_BYTES and fp.activations == M * STEP
    fixed = fp.total - fp.lanes - fp.activations
    per_lane = 3 * MODEL_BYTES + STEP
    assert ample.placement.lanes_note == (f"all fit: {fp.total / MB:.1f} MB of "
                                          f"{10 ** 12 / 2 ** 30:.1f} GB")
    # 2.5 lanes' room over the fixed part at 90%: 2 lanes
    limit = int((fixed + 2.5 * per_lane) / 0.9)
    two = gpu_run(tiny_synthetic, monkeypatch, limit)
    assert two.placement.lanes == 2
    assert two.program.footprint.total == fixed + 2 * per_lane <= 0.9 * limit
    left = 0.9 * limit - fixed
    note = (f"by memory: each lane needs {per_lane / MB:.1f} MB, {left / MB:.1f} MB of "
            f"{limit / MB:.1f} MB left after data, state and updates")
    assert two.placement.lanes_note == note
    assert f"; lanes: 2 of {M} jobs ({note})" in two.view().facts.placement_line
    # the sums keep the order of every sampled client in a lane (order_lanes), whatever L
    assert two.placement.order_lanes == ample.placement.order_lanes == M
    # half a lane's room: today's one-line refusal, naming the lanes' flags
    with pytest.raises(ConfigError) as err:
        gpu_run(tiny_synthetic, monkeypatch, int((fixed + 0.5 * per_lane) / 0.9))
    assert "\n" not in str(err.value) and "--batch_size" in str(err.value)
    assert str(err.value).startswith(f"the run needs about {(fixed + per_lane) / MB:.1f} MB")


def test_the_lanes_line_names_the_reason(tiny_synthetic, monkeypatch):
    cpu = build_experiment(tiny_config(thetas=(1.0,), clients_per_round=M), tiny_synthetic)
    assert cpu.view().facts.placement_line.endswith(
        f"; lanes: 2 of {M} jobs (the model's CPU preference)")   # linear: 2 vmapped lanes
    assert cpu.program.footprint.activations == 0                  # no step compiled on CPU
    forced = gpu_run(tiny_synthetic, monkeypatch, 10 ** 12, clients_per_step=4)
    assert placement.lanes_text(forced.placement) == f"lanes: 4 of {M} jobs (--clients_per_step)"
    assert forced.program.footprint.activations == 0
    monkeypatch.setattr(placement, "_bytes_limit", lambda devices: None)   # none reported
    none = dataclasses.replace(forced.placement, lanes=M, lanes_note="", by_memory=True)
    kept, _ = placement.fit_lanes(none, forced.program.footprint, [], lambda: 1 / 0)
    assert kept.lanes == M and kept.lanes_note == "the device reports no memory limit"
    est = Estimate(name="fedavg", num_rounds=1, eval_every=1, build_s=0.0, compile_s=0.0,
                   round_s=0.0, eval_s=0.0, memory=DeviceMemory(0, "x"), flops_per_round=None,
                   train_trips=[1], work={}, backend="cpu", devices=1, replicas=1, lanes=4,
                   lanes_line=placement.lanes_text(forced.placement))
    assert f"  lanes: 4 of {M} jobs (--clients_per_step)" in est.lines()
    assert est.to_json()["lanes_line"] == f"lanes: 4 of {M} jobs (--clients_per_step)"


def test_one_lanes_step_bytes_hold_its_minibatch_and_grow_with_it(tiny_synthetic):
    model = build_experiment(tiny_config(thetas=(1.0,)), tiny_synthetic).model
    small, big = (placement.lane_step_bytes(model, tiny_synthetic, b) for b in (8, 4096))
    row = 60 * 4 + 4   # float32 features and an int32 label
    assert small >= 8 * row
    # the gradient of the [B, 10] logits is an operand of the kernel's gradient (a dot)
    assert big >= 4096 * (row + 10 * 4) and big > small


def test_fewer_lanes_by_memory_train_to_the_same_models(tiny_synthetic, monkeypatch):
    def train(limit):
        exp = gpu_run(tiny_synthetic, monkeypatch, limit)
        state, keys = exp.initial_state(), exp.keys()
        for t in range(2):
            state, _ = exp.round_fn(state, exp.round_data(t, state), keys)
        return exp, [np.asarray(a) for a in jax.tree.leaves(state.params)]

    ample, all_lanes = train(10 ** 12)
    fp = ample.program.footprint
    fixed = fp.total - fp.lanes - fp.activations
    two, by_memory = train(int((fixed + 2.5 * (3 * MODEL_BYTES + STEP)) / 0.9))
    assert (ample.placement.lanes, two.placement.lanes) == (M, 2)
    for a, b in zip(all_lanes, by_memory):   # float32, learning rate 0.05 (stable)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_an_asynchronous_step_on_fewer_lanes_by_memory_trains_the_same(tiny_synthetic,
                                                                       monkeypatch):
    """FedBuff's server step (K = 3 slots): its step is rebuilt on the lanes that fit."""
    from conftest import run_rounds_history
    from deltafl_jax.run import program
    monkeypatch.setattr(placement, "lane_step_bytes", lambda model, data, batch: STEP)
    built, real = [], program.BufferedRun   # the lanes each server step is built on
    monkeypatch.setattr(program, "BufferedRun", lambda model, replicas, local, **kw: (
        built.append(local.lanes), real(model, replicas, local, **kw))[1])

    def step(limit):
        monkeypatch.setattr(placement, "_bytes_limit", lambda devices: limit)
        exp = build_experiment(tiny_config(
            algorithm="fedbuff", thetas=(1.0,), client_speed="lognormal", concurrency=5,
            buffer_size=3, max_staleness=2, placement_backend="gpu", client_data="device"),
            tiny_synthetic)
        state, _ = run_rounds_history(exp, 2)
        assert built[-1] == exp.placement.lanes
        return exp, [np.asarray(a) for a in jax.tree.leaves(exp.served_params(state))]

    ample, all_lanes = step(10 ** 12)
    fp = ample.program.footprint
    fixed = fp.total - fp.lanes - fp.activations
    two, by_memory = step(int((fixed + 2.5 * (3 * MODEL_BYTES + STEP)) / 0.9))
    assert (ample.placement.lanes, two.placement.lanes) == (3, 2)
    for a, b in zip(all_lanes, by_memory):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
