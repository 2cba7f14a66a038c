"""deal_jobs against a plain Python dealer written from its definition: jobs with steps > 0,
longest first (ties in job order), dealt to lanes in snake order 0..c-1, c-1..0, ..."""

import jax
import numpy as np
import pytest

from deltafl_jax.engine import deal_jobs as deal_jobs_eager

# One program per (jobs, lanes) shape rather than one per operation run eagerly.
deal_jobs = jax.jit(deal_jobs_eager, static_argnums=1)


def python_deal(steps, lanes):
    order = sorted((j for j, s in enumerate(steps) if s > 0), key=lambda j: (-steps[j], j))
    per_lane = [[] for _ in range(lanes)]
    for pos, j in enumerate(order):
        row, col = divmod(pos, lanes)
        per_lane[col if row % 2 == 0 else lanes - 1 - col].append(j)
    return per_lane


@pytest.mark.parametrize("lanes", [1, 2, 3, 7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deal_jobs_matches_the_definition(lanes, seed):
    rng = np.random.default_rng(seed)
    steps = rng.integers(0, 9, size=23) * (rng.random(23) < 0.7)
    deal = deal_jobs(np.asarray(steps, np.int32), lanes)
    want = python_deal(list(steps), lanes)
    J = len(steps)
    jobs = np.asarray(deal.jobs)
    for lane in range(lanes):
        n = int(deal.length[lane])
        assert list(jobs[lane, :n]) == want[lane]
        assert (jobs[lane, n:] == J).all()
        assert int(deal.load[lane]) == sum(steps[j] for j in want[lane])
    assert int(deal.trips) == max(sum(steps[j] for j in w) for w in want)


def test_snake_dealing_balances_equal_jobs():
    deal = deal_jobs(np.full((12,), 5, np.int32), 4)
    assert list(np.asarray(deal.load)) == [15, 15, 15, 15] and int(deal.trips) == 15


def test_cpu_lanes_per_device_hand_cases():
    from deltafl_jax.models import LanePreferences
    unrolled = LanePreferences(cpu_lanes=2, cpu_lane_mode="unroll")
    assert [unrolled.lanes(100, "cpu", d) for d in (1, 2, 4)] == [2, 1, 1]
    assert unrolled.lanes(1, "cpu", 1) == 1
    assert LanePreferences(cpu_lanes=4, cpu_lane_mode="unroll").lanes(100, "cpu", 2) == 2
    vmapped = LanePreferences(cpu_lanes=2)
    assert [vmapped.lanes(100, "cpu", d) for d in (1, 2, 4)] == [2, 2, 2]
    assert vmapped.lanes(100, "gpu", 2) == 100   # accelerators: the placement decides


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_deal_rows_are_each_jobs_place_in_the_lanes_table(lanes):
    from deltafl_jax.engine.lanes import deal_rows as deal_rows_eager
    deal_rows = jax.jit(deal_rows_eager, static_argnums=1)
    rng = np.random.default_rng(lanes)
    steps = rng.integers(0, 9, size=17) * (rng.random(17) < 0.7)
    deal = deal_jobs(np.asarray(steps, np.int32), lanes)
    Q = np.asarray(deal.jobs).shape[1]
    want = np.full(len(steps), lanes * Q)            # not dealt: one past the last row
    for lane, jobs in enumerate(python_deal(list(steps), lanes)):
        for q, j in enumerate(jobs):
            want[j] = lane * Q + q
    np.testing.assert_array_equal(np.asarray(deal_rows(deal, len(steps))), want)


def sequential_sums(table, rows):
    """NumPy: for each replica r, 0 + table[rows[r, 0]] + table[rows[r, 1]] + ... in float32,
    one row at a time, skipping rows past the table."""
    total = np.zeros((rows.shape[0],) + table.shape[1:], table.dtype)
    for k in range(rows.shape[1]):
        for r in range(rows.shape[0]):
            if rows[r, k] < table.shape[0]:
                total[r] = total[r] + table[rows[r, k]]
    return total


@pytest.mark.parametrize("chunk_bytes", [None, 64])
@pytest.mark.parametrize("devices", [1, 2, 3])
def test_device_ordered_sum_adds_one_row_at_a_time_on_any_device_count(devices, chunk_bytes):
    """The devices' slot tables (each row cut into one block per device) stacked in device
    order are added row by row in the given order, bit for bit, on every device (devices
    simulated by a named vmap axis); magnitudes over six decades make the result depend on
    the order, and leaves of 21, 7 and 1 elements do not divide into 2 or 3 blocks. With
    64-byte chunks the kernel's and the bias's blocks cross in several permutes each (5 rows
    of 11 columns: 4 chunks of 3, the last one redoing a column), to the same bits."""
    from deltafl_jax.engine.lanes import device_ordered_sum, slot_blocks
    from deltafl_jax.engine.mesh import DeviceAxis
    rng = np.random.default_rng(devices)
    D, S, R, m = devices, 5, 3, 6

    def draw(*shape):
        scale = 10.0 ** rng.integers(-3, 4, size=(D, S) + (1,) * len(shape))
        return (rng.standard_normal((D, S) + shape) * scale).astype(np.float32)

    tables = {"kernel": draw(3, 7), "bias": draw(7), "weight": draw()}
    rows = rng.integers(0, D * S, size=(R, m)).astype(np.int32)
    rows[rng.random((R, m)) < 0.2] = D * S            # jobs that add nothing
    axis = DeviceAxis(count=D, name="d" if D > 1 else None)
    like = {k: jax.ShapeDtypeStruct((R,) + v.shape[2:], v.dtype) for k, v in tables.items()}

    def one_device(t):
        return device_ordered_sum(t, rows, axis, like, chunk_bytes=chunk_bytes)

    @jax.jit   # one program, not one per operation
    def every_device(tables):
        cut = jax.vmap(lambda t: slot_blocks(t, D))(tables)      # [D devices, D blocks, S, k]
        return jax.vmap(one_device, axis_name="d")(cut)

    got = every_device(tables)
    for name, table in tables.items():
        want = sequential_sums(table.reshape((D * S,) + table.shape[2:]), rows)
        for d in range(D):
            np.testing.assert_array_equal(np.asarray(got[name][d]), want, err_msg=name)
    assert not np.array_equal(sequential_sums(tables["kernel"].reshape(D * S, 3, 7),
                                              rows[:, ::-1]),
                              sequential_sums(tables["kernel"].reshape(D * S, 3, 7), rows))
