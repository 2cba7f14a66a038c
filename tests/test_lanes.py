"""deal_jobs against a plain Python dealer written from its definition: jobs with steps > 0,
longest first (ties in job order), dealt to lanes in snake order 0..c-1, c-1..0, ..."""

import numpy as np
import pytest

from deltafl_jax.engine import deal_jobs


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
