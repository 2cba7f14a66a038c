"""The asynchronous scheduler (deltafl_jax/asynchronous/scheduler.py) against an independent
event simulation written with heapq, and its invariants: the ring of versions, availability,
checkpoints and bad settings."""

import heapq

import numpy as np
import pytest

from deltafl_jax.errors import ConfigError
from deltafl_jax.asynchronous.rule import polynomial
from deltafl_jax.asynchronous.scheduler import AsyncScheduler, check_ring_fits, ring_size
from deltafl_jax.sampling.availability import Bernoulli, Markov


def speeds_file(tmp_path, seconds):
    path = tmp_path / "speeds.txt"
    np.savetxt(path, seconds)
    return path


def heap_reference(seconds, K, steps, max_staleness=None):
    """Every client online and always training (C = N): FedBuff's events with a heap of
    (end, client, base, start); a finished client starts again at once, after the server
    step its update completed."""
    heap = [(float(d), c, 0, 0.0) for c, d in enumerate(seconds)]
    heapq.heapify(heap)
    version, buffer, out = 0, [], []
    while len(out) < steps:
        end, c, base, start = heapq.heappop(heap)
        tau = version - base
        if max_staleness is None or tau <= max_staleness:
            buffer.append((c, base, tau, start, end))
        if len(buffer) == K:
            out.append((end, buffer))
            buffer, version = [], version + 1
        heapq.heappush(heap, (end + float(seconds[c]), c, version, end))
    return out


def scheduler(seconds, K, S=None, C=None, seed=3, availability=None):
    table = np.asarray(seconds, np.float64)
    return AsyncScheduler(num_clients=table.size, concurrency=C or table.size, buffer_size=K,
                          max_staleness=S, seconds=lambda ids: table[ids], seed=seed,
                          availability=availability)


@pytest.mark.parametrize("S", [None, 1])
def test_matches_heap_simulation(tmp_path, S):
    rng = np.random.default_rng(0)
    path = speeds_file(tmp_path, rng.lognormal(0.0, 1.0, size=7))
    seconds = np.loadtxt(path)
    ref = heap_reference(seconds, K=3, steps=12, max_staleness=S)
    sch = scheduler(seconds, K=3, S=S)
    dropped = 0
    for v, (time, buf) in enumerate(ref, start=1):
        step = sch.next_step()
        assert step.version == v and step.time == time
        c, base, tau, start, end = map(np.asarray, zip(*buf))
        np.testing.assert_array_equal(step.clients, c)
        np.testing.assert_array_equal(step.base, base)
        np.testing.assert_array_equal(step.staleness, tau)
        np.testing.assert_array_equal(step.start, start)
        np.testing.assert_array_equal(step.end, end)
        dropped += step.dropped
    worst = max(max(b[2] for b in buf) for _, buf in ref)
    assert worst == S if S is not None else worst > 1   # stale updates do occur
    if S is not None:
        assert dropped > 0


def test_ties_broken_by_client_id(tmp_path):
    seconds = np.loadtxt(speeds_file(tmp_path, [2.0, 1.0, 2.0, 1.0, 3.0]))
    ref = heap_reference(seconds, K=3, steps=8)
    sch = scheduler(seconds, K=3)
    for time, buf in ref:
        step = sch.next_step()
        np.testing.assert_array_equal(step.clients, [b[0] for b in buf])
        np.testing.assert_array_equal(step.base, [b[1] for b in buf])
        assert step.time == time


def test_ring_keeps_every_version_in_use():
    """A ring replayed from the steps' own writes holds each update's base version and the
    current version at every step, within V = min(S + 2, C + K) slots."""
    rng = np.random.default_rng(1)
    for C, K, S in [(6, 2, None), (6, 3, 2), (4, 4, 0), (8, 1, 5)]:
        sch = scheduler(rng.lognormal(0.0, 1.5, size=20), K=K, S=S, C=C, seed=C + K)
        V = ring_size(C, K, S)
        assert sch.V == V
        ring = {0: 0}
        for _ in range(40):
            step = sch.next_step()
            assert all(ring[int(s)] == int(b) for s, b in zip(step.slots, step.base))
            assert ring[step.current_slot] == step.version - 1
            assert 0 <= step.new_slot < V
            ring[step.new_slot] = step.version
            if S is not None:
                assert step.staleness.max() <= S


def test_starts_idle_online_clients():
    avail = Bernoulli(np.full(30, 0.4))
    seconds = np.random.default_rng(2).uniform(1.0, 5.0, size=30)
    sch = scheduler(seconds, K=3, C=8, seed=5, availability=avail)
    for _ in range(15):
        step = sch.next_step()
        for c, base in zip(step.clients, step.base):
            assert c in avail.online(5, int(base))
        live = sch.flight["client"][sch.flight["client"] >= 0]
        assert np.unique(live).size == live.size
    again = scheduler(seconds, K=3, C=8, seed=5, availability=avail)
    other = scheduler(seconds, K=3, C=8, seed=6, availability=avail)
    a = [again.next_step().clients for _ in range(15)]
    b = [other.next_step().clients for _ in range(15)]
    fresh = scheduler(seconds, K=3, C=8, seed=5, availability=avail)
    np.testing.assert_array_equal(np.concatenate(a),
                                  np.concatenate([fresh.next_step().clients
                                                  for _ in range(15)]))
    assert not np.array_equal(np.concatenate(a), np.concatenate(b))


@pytest.mark.parametrize("markov", [False, True])
def test_state_restores_mid_run(tmp_path, markov):
    """Nine steps straight equal four, a save through an .npz and five more from a fresh
    scheduler (and, for a Markov availability, a fresh model: its chain is restored)."""
    seconds = np.random.default_rng(3).lognormal(0.0, 1.0, size=12)

    def avail():
        return Markov(np.full(12, 0.6), 0.3) if markov else None

    whole = scheduler(seconds, K=3, S=2, C=6, availability=avail())
    expected = [whole.next_step() for _ in range(9)]
    first = scheduler(seconds, K=3, S=2, C=6, availability=avail())
    for _ in range(4):
        first.next_step()
    np.savez(tmp_path / "s.npz", **first.state())
    with np.load(tmp_path / "s.npz") as saved:
        resumed = scheduler(seconds, K=3, S=2, C=6, availability=avail())
        resumed.restore(dict(saved))
    for want in expected[4:]:
        got = resumed.next_step()
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_a_checkpoint_without_the_clients_counts_is_refused_by_its_cause():
    """A scheduler state saved before the per-client counts existed cannot be continued
    (the counts cannot be rebuilt); the error says so rather than blaming the settings."""
    from deltafl_jax.errors import CheckpointMismatch
    sch = scheduler(np.ones(10), K=2, C=4)
    sch.next_step()
    old = {k: v for k, v in sch.state().items() if k not in ("started", "stale")}
    with pytest.raises(CheckpointMismatch, match="before the scheduler counted"):
        scheduler(np.ones(10), K=2, C=4).restore(old)
    with pytest.raises(CheckpointMismatch, match="does not match"):
        scheduler(np.ones(10), K=2, C=5).restore(sch.state())


def test_bad_settings_name_the_flag():
    with pytest.raises(ConfigError, match="--buffer_size=5: more than --concurrency=4"):
        scheduler(np.ones(10), K=5, C=4)
    with pytest.raises(ConfigError, match="--concurrency=11"):
        scheduler(np.ones(10), K=2, C=11)
    with pytest.raises(ConfigError, match="--max_staleness=-1"):
        scheduler(np.ones(10), K=2, C=4, S=-1)
    with pytest.raises(ConfigError, match="model versions"):
        check_ring_fits(ring_size(20, 10, None), 2**20, 10 * 2**20)


def test_staleness_weight():
    np.testing.assert_allclose(polynomial([0, 3, 8]), [1.0, 0.5, 1.0 / 3.0])


def test_settings_group_refuses_bad_flags():
    from deltafl_jax.declared import declared
    from deltafl_jax.asynchronous.scheduler import AsyncSettings
    assert {f.name for _, f in declared(AsyncSettings)} == {"concurrency", "buffer_size",
                                                            "max_staleness"}
    assert AsyncSettings(concurrency=20, buffer_size=10, max_staleness=3).ring == 5
    with pytest.raises(ConfigError, match="--buffer_size=21"):
        AsyncSettings(concurrency=20, buffer_size=21).check()
    with pytest.raises(ConfigError, match="--concurrency=0"):
        AsyncSettings(concurrency=0, buffer_size=1).check()
    with pytest.raises(ConfigError, match="--concurrency=20: more than the 8"):
        AsyncSettings().check(8)


def test_job_durations_time_the_planned_steps():
    """A uniform device of 0.01 s an example and 1000 B/s, a model of 500 bytes: 1 s of
    transfer; two epochs of batches of 4 over 10 examples, or 3 steps of 4 examples."""
    from deltafl_jax.sampling.plan import LocalWork
    from deltafl_jax.asynchronous.scheduler import job_durations
    from deltafl_jax.sampling.speeds import DeviceSpeeds
    speeds = DeviceSpeeds(3, 0.01, 1000.0)
    sizes = np.asarray([10, 3, 4])
    epochs = job_durations(speeds, sizes, LocalWork(batch_size=4, local_epochs=2), 500)
    np.testing.assert_allclose(epochs(np.asarray([0, 1, 2])), [1.2, 1.06, 1.08])
    steps = job_durations(speeds, sizes, LocalWork(batch_size=4, local_steps=3), 500)
    np.testing.assert_allclose(steps(np.asarray([1, 0])), [1.12, 1.12])
