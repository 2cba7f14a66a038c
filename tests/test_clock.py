"""Who finishes a round, and when (deltafl_jax/sampling/clock.py), against an event simulation.

The reference is plain Python: every present client's download, each local step (its batch
read off the plan's layout: an epoch's batches of B with a short last one, or full batches
across back-to-back permutations under --local_steps) and its upload are events in a heap
ordered by (time, client id); a client under --partial_work uploads early when its next step
would not leave time to upload by the deadline; the server accepts uploads in event order
until it holds m or the deadline passes. It is run on 10^3 rounds of random cohorts (random
M, m, empty slots, sizes, local work, speeds, model sizes, deadlines) and compared with
:func:`finish` slot by slot; hand-computed cases pin the timing model's numbers.
"""

import heapq

import numpy as np
import pytest

from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.clock import (SlotJobs, check_deadline, examples_done, finish,
                                        keep_cohort)
from deltafl_jax.sampling.samplers import Cohort
from deltafl_jax.sampling.speeds import TimingSettings, build_speeds

POOL = 40


def batch_examples(n, batch_size, step, full_batches):
    """Examples of local step `step` (from 0): the plan's batch layout walked one by one."""
    if full_batches:
        return batch_size
    per_epoch = -(-n // batch_size)
    b = step % per_epoch
    return min(batch_size, n - b * batch_size)


def reference(x, w, ids, present, planned, sizes, batch_size, model_bytes, m, deadline,
              partial, full_batches):
    """(keep, steps, arrival, round_seconds) by an event-by-event simulation."""
    size = len(ids)
    events = []   # (time, client id, slot, what, steps done, examples done)
    for j in range(size):
        if present[j]:
            heapq.heappush(events, (model_bytes / w[j], int(ids[j]), j, "ready", 0, 0))
    keep, steps = [False] * size, [0] * size
    arrival = [np.inf] * size
    kept, end = 0, None
    while events:
        t, cid, j, what, done, examples = heapq.heappop(events)
        upload = model_bytes / w[j]
        if what == "upload":
            if (deadline is None or t <= deadline) and kept < m:
                keep[j], steps[j], arrival[j] = True, done, t
                kept += 1
                if kept == m:
                    end = t
            continue
        if done < planned[j]:                                    # one more step?
            more = examples + batch_examples(sizes[j], batch_size, done, full_batches)
            finish_at = model_bytes / w[j] + x[j] * more
            if not (partial and finish_at + upload > deadline):
                heapq.heappush(events, (finish_at, cid, j, "step", done + 1, more))
                continue
        if partial and done == 0 and planned[j] > 0:
            continue                                             # nothing to send: dropped
        heapq.heappush(events, (t + upload, cid, j, "upload", done, examples))
    if end is None:
        end = deadline if deadline is not None else max(
            [a for a in arrival if np.isfinite(a)], default=0.0)
    return np.array(keep), np.array(steps), np.array(arrival), end


def random_round(rng, models):
    size = int(rng.integers(1, 13))
    m = int(rng.integers(1, size + 1))
    k = int(rng.integers(0, size + 1)) if rng.random() < 0.9 else size
    ids = np.zeros(size, np.int32)
    ids[:k] = np.sort(rng.choice(POOL, size=k, replace=False))
    present = np.arange(size) < k
    uniform = rng.random() < 0.3            # identical devices: ties broken by client id
    if uniform and rng.random() < 0.5:
        sizes = np.full(size, int(rng.integers(1, 60)))
    else:
        sizes = rng.integers(1, 60, size=size)
    batch_size = int(rng.choice([1, 4, 8, 16]))
    full_batches = bool(rng.random() < 0.5)
    if full_batches:
        planned = np.full(size, int(rng.integers(1, 12)))
    else:
        planned = int(rng.integers(1, 3)) * (-(-sizes // batch_size))
    planned = np.where(present, planned, 0)
    sizes = np.where(present, sizes, 0)
    model_bytes = int(rng.integers(10**4, 10**7))
    return dict(speeds=models["uniform" if uniform else "lognormal"], ids=ids, present=present,
                planned=planned, sizes=sizes, batch_size=batch_size, model_bytes=model_bytes,
                m=m, full_batches=full_batches)


def test_finish_equals_an_event_simulation_on_a_thousand_rounds():
    rng = np.random.default_rng(2026)
    models = {name: build_speeds(TimingSettings(client_speed=name, client_speed_kbps=3000.0,
                                                client_speed_sigma=0.9),
                                 num_clients=POOL, data_seed=5)
              for name in ("uniform", "lognormal")}
    seen = dict(dropped=0, partial=0, cut=0, tie=0, short=0)
    for _ in range(1000):
        r = random_round(rng, models)
        speeds, ids, present = r["speeds"], r["ids"], r["present"]
        x, w = speeds.per_example_s(ids), speeds.bandwidth_Bps(ids)
        full = (2 * r["model_bytes"] / w
                + x * examples_done(r["planned"], r["sizes"], r["batch_size"],
                                    full_batches=r["full_batches"]))
        deadline = None
        if rng.random() < 0.7 and present.any():
            deadline = float(rng.uniform(0.3, 1.2) * full[present].max())
        partial = deadline is not None and bool(rng.random() < 0.5)
        fin = finish(speeds, SlotJobs(ids, present, r["planned"], r["sizes"]), r["batch_size"],
                     r["model_bytes"], m=r["m"], deadline=deadline, partial_work=partial,
                     full_batches=r["full_batches"])
        keep, steps, arrival, end = reference(
            x, w, ids, present, r["planned"], r["sizes"], r["batch_size"], r["model_bytes"],
            r["m"], deadline, partial, r["full_batches"])
        np.testing.assert_array_equal(fin.keep, keep)
        np.testing.assert_array_equal(fin.steps, steps)
        np.testing.assert_allclose(fin.arrival, arrival, rtol=1e-12)
        np.testing.assert_allclose(fin.seconds[present], full[present], rtol=1e-12)
        assert np.all(np.isinf(fin.seconds[~present]))
        assert fin.round_seconds == pytest.approx(end, rel=1e-12)
        kept_steps = fin.steps[fin.keep]
        seen["partial"] += int(np.sum(kept_steps < r["planned"][fin.keep]))
        seen["dropped"] += int(deadline is not None and np.sum(present & (full > deadline)
                                                              & ~fin.keep))
        seen["cut"] += int(present.sum() > r["m"] and fin.keep.sum() == r["m"])
        seen["short"] += int(fin.keep.sum() < r["m"])
        times = fin.arrival[fin.keep]
        seen["tie"] += int(np.unique(times).size < times.size)
    assert min(seen.values()) > 10, seen      # every branch was exercised


def uniform_speeds(num_clients=10, example_s=0.01, kbps=8.0):
    """8 kbit/s = 1024 bytes a second: a 1024-byte model takes 1 s each way."""
    return build_speeds(TimingSettings(client_speed="uniform", client_speed_example_s=example_s,
                                       client_speed_kbps=kbps),
                        num_clients=num_clients, data_seed=0)


def test_hand_computed_deadline_partial_work_and_over_selection():
    speeds = uniform_speeds()
    ids = np.array([2, 5, 7, 9, 0])
    present = np.array([True, True, True, True, False])
    sizes = np.array([100, 250, 30, 50, 0])            # B = 10, one epoch: 10, 25, 3, 5 steps
    planned = np.array([10, 25, 3, 5, 0])
    # full durations: 2 s of transfer + 0.01 s x n: 3.0, 4.5, 2.3, 2.5
    fin = finish(speeds, SlotJobs(ids, present, planned, sizes), 10, 1024, m=4, deadline=None,
                 partial_work=False)
    np.testing.assert_allclose(fin.seconds, [3.0, 4.5, 2.3, 2.5, np.inf])
    assert fin.keep.tolist() == [True, True, True, True, False]
    assert fin.round_seconds == pytest.approx(4.5)
    # over-selection: the 3 first of 4
    fin = finish(speeds, SlotJobs(ids, present, planned, sizes), 10, 1024, m=3, deadline=None,
                 partial_work=False)
    assert fin.keep.tolist() == [True, False, True, True, False]
    assert fin.round_seconds == pytest.approx(3.0)
    # a deadline of 2.9 s: clients 2 and 5 late; fewer than m, so the round waits until 2.9 s
    fin = finish(speeds, SlotJobs(ids, present, planned, sizes), 10, 1024, m=3, deadline=2.9,
                 partial_work=False)
    assert fin.keep.tolist() == [False, False, True, True, False]
    assert fin.round_seconds == 2.9
    # partial work: 0.9 s of compute fit, 9 steps of 10 examples (client 2) and (client 5)
    fin = finish(speeds, SlotJobs(ids, present, planned, sizes), 10, 1024, m=4, deadline=2.9,
                 partial_work=True)
    assert fin.keep.tolist() == [True, True, True, True, False]
    assert fin.steps.tolist() == [9, 9, 3, 5, 0]
    np.testing.assert_allclose(fin.arrival, [2.9, 2.9, 2.3, 2.5, np.inf])
    # a deadline under the transfers alone: nobody, with or without partial work
    for partial in (False, True):
        fin = finish(speeds, SlotJobs(ids, present, planned, sizes), 10, 1024, m=4, deadline=1.5,
                     partial_work=partial)
        assert not fin.keep.any() and fin.round_seconds == 1.5


def test_ties_are_broken_by_client_id():
    speeds = uniform_speeds()
    ids = np.array([8, 3, 6, 1])
    fin = finish(speeds, SlotJobs(ids, np.ones(4, bool), np.full(4, 2), np.full(4, 10)), 5, 1024,
                 m=2, deadline=None, partial_work=False)
    assert ids[fin.keep].tolist() == [3, 1]


@pytest.mark.parametrize("full_batches,sizes,steps,want", [
    # n = 10: batches of 4, 4, 2 an epoch; n = 7: 4, 3, so 3 steps are 7 + 4
    (False, [10, 10, 10, 7], [3, 5, 6, 3], [10, 18, 20, 11]),
    (True, [10, 3], [5, 4], [20, 16]),                          # always B = 4
])
def test_examples_done_follow_the_plans_batches(full_batches, sizes, steps, want):
    got = examples_done(np.array(steps), np.array(sizes), 4, full_batches=full_batches)
    assert got.tolist() == want


def test_keep_cohort_puts_the_kept_in_m_slots_sorted():
    speeds = uniform_speeds()
    cohort = Cohort(np.array([1, 4, 6, 9, 0], np.int32), np.array([1, 1, 1, 1, 0], bool),
                    np.array([0.4, 0.4, 0.4, 0.4, 0.0]))
    sizes = np.array([50, 10, 30, 20, 0])
    slots = SlotJobs(cohort.clients, cohort.present, np.array([5, 1, 3, 2, 0]), sizes)
    fin = finish(speeds, slots, 10, 1024, m=3, deadline=None, partial_work=False)
    kept, steps = keep_cohort(cohort, fin, 3)
    assert kept.clients.tolist() == [4, 6, 9]
    assert kept.present.tolist() == [True, True, True]
    np.testing.assert_array_equal(kept.probabilities, 0.4)
    assert steps.tolist() == [1, 3, 2]
    slots = SlotJobs(cohort.clients, cohort.present, np.array([5, 1, 3, 2, 0]), sizes)
    fin = finish(speeds, slots, 10, 1024, m=3, deadline=2.25, partial_work=False)
    kept, steps = keep_cohort(cohort, fin, 3)
    assert kept.clients.tolist() == [4, 9, 0] and kept.present.tolist() == [True, True, False]
    assert steps.tolist() == [1, 2, 0] and kept.probabilities[2] == 0.0


def test_a_deadline_no_client_can_meet_is_refused():
    speeds = uniform_speeds(num_clients=3)
    sizes, planned = np.array([100, 30, 50]), np.array([10, 3, 5])
    # the fastest full job: client 1, 2 s of transfers + 0.3 s; its first step alone: 2.1 s
    for deadline, partial in ((2.3, False), (2.1, True), (None, False)):
        check_deadline(deadline, speeds, sizes, planned, 10, 1024, partial_work=partial)
    with pytest.raises(ConfigError, match=r"--round_deadline=2.29: no client can meet it in any "
                                          r"round \(the fastest needs 2.3 s for its local work"):
        check_deadline(2.29, speeds, sizes, planned, 10, 1024, partial_work=False)
    with pytest.raises(ConfigError, match=r"the fastest needs 2.1 s for one local step"):
        check_deadline(2.05, speeds, sizes, planned, 10, 1024, partial_work=True)
