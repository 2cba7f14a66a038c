"""The availability models (deltafl_jax/sampling/availability.py, traces.py) against their laws.

Each generated model is checked over 10^4 rounds against its stated law (the empirical rate
of every client within binomial bounds from scipy, Markov's transitions and run lengths,
cyclic's period and window against a loop written from the authors' state machine); the
replays against hand-computed cases; the validation errors by their one line.
"""

import json
import os
import pickle

import numpy as np
import pytest
from scipy import stats

from deltafl_jax.declared import declared
from deltafl_jax.errors import CheckpointMismatch, ConfigError, DataError
from deltafl_jax.sampling.availability import (SEED_STREAM, STREAM, AvailabilitySettings,
                                               Bernoulli, Cyclic, Markov, build_availability)

ROUNDS = 10_000
SIGMAS = 5.0      # every bound is five standard deviations (a false alarm ~ 6e-7 per check)


def build(num_clients=20, sizes=None, label_counts=None, num_rounds=100, **kw):
    sizes = np.ones(num_clients, np.int64) if sizes is None else sizes
    return build_availability(AvailabilitySettings(**kw), num_clients=num_clients, sizes=sizes,
                              label_counts=label_counts, num_rounds=num_rounds)


def history(model, seed=1, rounds=ROUNDS):
    """[rounds, N] bool: who is online in each round."""
    out = np.zeros((rounds, model.num_clients), bool)
    for r in range(rounds):
        ids = model.online(seed, r)
        assert ids.dtype == np.int64 and np.all(np.diff(ids) > 0)
        out[r, ids] = True
    return out


def within_binomial(counts, n, p):
    """Every count within the central 1 - 2 Phi(-5) interval of Binomial(n, p)."""
    lo, hi = stats.binom.interval(1 - 2 * stats.norm.sf(SIGMAS), n, p)
    return np.all((counts >= lo) & (counts <= hi)), (counts, lo, hi)


# --------------------------------------------------------------------------------------------
# always and bernoulli


def test_always_is_everyone_every_round():
    model = build(num_clients=7)
    assert model.name == "always"
    np.testing.assert_array_equal(model.online(3, 11), np.arange(7))
    np.testing.assert_array_equal(model.rates(), np.ones(7))
    assert model.state(3) == {}


def test_every_flag_is_prefixed_availability():
    names = [flag.name for _, flag in declared(AvailabilitySettings)]
    assert names[0] == "availability" and all(n.startswith("availability") for n in names)


def test_bernoulli_rates_match_each_clients_probability():
    p = np.array([0.0, 0.02, 0.1, 0.3, 0.5, 0.77, 0.95, 1.0])
    model = Bernoulli(p)
    on = history(model)
    ok, detail = within_binomial(on.sum(axis=0), ROUNDS, p)
    assert ok, detail
    # independence across clients: pairs online together at the product of their rates
    both = (on[:, 3] & on[:, 4]).sum()
    ok, detail = within_binomial(np.array([both]), ROUNDS, p[3] * p[4])
    assert ok, detail


def test_uniform_bernoulli_from_the_settings():
    model = build(num_clients=30, model="bernoulli", p=0.25)
    np.testing.assert_array_equal(model.rates(), np.full(30, 0.25))
    ok, detail = within_binomial(history(model, rounds=4000).sum(axis=0), 4000, 0.25)
    assert ok, detail


def test_data_correlated_probabilities_follow_fedau():
    """p_i = max(p_min, C p_mean <d_i, w>), w ~ Dir(alpha 1_C) from the model's stream,
    written as IBM/fedau's loop over nodes (util/util.py)."""
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 20, size=(40, 10))
    counts[3] = 0
    counts[4] = [0] * 9 + [7]
    model = build(num_clients=40, label_counts=counts, model="bernoulli", probabilities="data",
                  p_mean=0.1, p_min=0.02, alpha=0.1, seed=9)
    w = np.random.default_rng([9, 0, 0xA7A3, 1]).dirichlet(0.1 * np.ones(10))
    expected = []
    for n in range(40):
        total = counts[n].sum()
        dist = counts[n] / total if total else np.zeros(10)
        expected.append(max(0.02, float(np.sum(dist * w)) * (0.1 * 10)))
    np.testing.assert_allclose(model.rates(), expected, rtol=1e-12, atol=0)
    assert model.rates()[3] == 0.02
    # another --availability_seed draws other weights
    other = build(num_clients=40, label_counts=counts, model="bernoulli", probabilities="data",
                  seed=10)
    assert not np.allclose(other.rates(), model.rates())


def test_size_probabilities_follow_flgo_mdf_and_ldf():
    sizes = np.array([1, 4, 16])
    ldf = build(num_clients=3, sizes=sizes, model="bernoulli", probabilities="less_data")
    np.testing.assert_allclose(ldf.rates(), [1.0, 0.5, 0.25])    # n^-0.5 / max
    mdf = build(num_clients=3, sizes=sizes, model="bernoulli", probabilities="more_data",
                size_beta=1.0)
    np.testing.assert_allclose(mdf.rates(), [1 / 16, 4 / 16, 1.0])
    mdf0 = build(num_clients=3, sizes=sizes, model="bernoulli", probabilities="more_data")
    np.testing.assert_allclose(mdf0.rates(), (sizes / 16.0) ** 0.0001)


# --------------------------------------------------------------------------------------------
# markov


def fedau_markov(p, q):
    """(to active, to inactive) as IBM/fedau's WorkerSampler sets them."""
    to_active, to_inactive = q, q * (1 / p - 1)
    if to_inactive > 1:
        to_active /= to_inactive
        to_inactive = 1
    return to_active, to_inactive


@pytest.mark.parametrize("q,ps", [(0.2, [0.2, 0.5, 0.8]), (0.5, [0.1, 0.3])])
def test_markov_transitions_run_lengths_and_rate(q, ps):
    p = np.repeat(ps, 2)
    model = Markov(p, q)
    on = history(model, seed=4)
    for i, pi in enumerate(p):
        b, a = fedau_markov(pi, q)
        x = on[:, i]
        prev, nxt = x[:-1], x[1:]
        # transitions: Binomial(number of on rounds, a) and Binomial(off rounds, b)
        ok, detail = within_binomial(np.array([(prev & ~nxt).sum()]), prev.sum(), a)
        assert ok, (i, "on->off", detail)
        ok, detail = within_binomial(np.array([(~prev & nxt).sum()]), (~prev).sum(), b)
        assert ok, (i, "off->on", detail)
        # complete on-runs are geometric with mean 1 / a
        edges = np.flatnonzero(np.diff(x.astype(np.int8)))
        runs = np.diff(edges)[(x[edges[:-1] + 1])]
        mean, sd = 1 / a, np.sqrt(1 - a) / a
        assert abs(runs.mean() - mean) <= SIGMAS * sd / np.sqrt(runs.size) + 1e-12, (i, runs)
        # the chain's stationary rate p_i (the variance of a two-state chain's mean)
        lam = 1 - a - b
        sd_mean = np.sqrt(pi * (1 - pi) / ROUNDS * (1 + lam) / (1 - lam))
        assert abs(x.mean() - pi) <= SIGMAS * sd_mean, (i, x.mean())
    np.testing.assert_array_equal(model.rates(), p)


def test_markov_draws_equal_a_per_client_loop():
    """Every round's online set equals a loop over the clients written from the module's law:
    round 0 on with probability p_i from SeedSequence([seed, 0, SEED_STREAM, 2]), then one step
    per round from [seed, r, STREAM, 2]'s uniforms, FedAU's transition probabilities
    (fedau_markov), on -> on iff u >= a_i, off -> on iff u < b_i (2: the markov model's word).
    Clients with p_i = 0 (never on) and p_i = 1 (never off) are among them."""
    p = np.concatenate([[0.0, 1.0], np.linspace(0.02, 0.98, 38)])
    q, seed, rounds = 0.3, 5, 60
    model = Markov(p, q)
    on = np.random.default_rng([seed, 0, SEED_STREAM, 2]).random(p.size) < p
    for r in range(rounds):
        if r:
            u = np.random.default_rng([seed, r, STREAM, 2]).random(p.size)
            nxt = np.zeros_like(on)
            for i, pi in enumerate(p):
                b, a = (0.0, 1.0) if pi == 0 else fedau_markov(pi, q)
                nxt[i] = u[i] >= a if on[i] else u[i] < b
            on = nxt
        np.testing.assert_array_equal(model.online(seed, r), np.flatnonzero(on), err_msg=r)
    assert not on[0] and on[1]


def test_markov_starts_from_the_stationary_law():
    model = Markov(np.full(20_000, 0.3), 0.05)
    ok, detail = within_binomial(np.array([model.online(7, 0).size]), 20_000, 0.3)
    assert ok, detail


def test_markov_resume_continues_bit_for_bit():
    p = np.linspace(0.05, 0.95, 50)
    whole = Markov(p, 0.1)
    straight = [whole.online(3, r) for r in range(120)]
    first = Markov(p, 0.1)
    for r in range(60):
        first.online(3, r)
    saved = {k: np.array(v) for k, v in first.state(3).items()}
    resumed = Markov(p, 0.1)
    resumed.restore(3, saved, 60)
    for r in range(60, 120):
        np.testing.assert_array_equal(resumed.online(3, r), straight[r])
    # asked out of order, a round is recomputed from round 0: the same ids
    np.testing.assert_array_equal(Markov(p, 0.1).online(3, 90), straight[90])
    with pytest.raises(CheckpointMismatch, match="ends at round 59, the run resumes at 61"):
        Markov(p, 0.1).restore(3, saved, 61)
    with pytest.raises(CheckpointMismatch, match=r"bool \[50\]"):
        Markov(p, 0.1).restore(3, {"round": saved["round"], "on": saved["on"][:10]}, 60)


# --------------------------------------------------------------------------------------------
# cyclic


def fedau_cyclic(p, cycle, first_switch, rounds):
    """IBM/fedau's WorkerSampler for cyclic-<cycle>, its random start given."""
    active = max(1, int(np.round(cycle * p)))
    inactive = max(1, cycle - active)
    current, to_switch, out = False, first_switch, []
    for _ in range(rounds):
        if to_switch == 0:
            current = not current
            to_switch = active if current else inactive
        to_switch -= 1
        out.append(current)
    return np.array(out)


def test_cyclic_period_and_window_exactly():
    p = np.array([0.05, 0.3, 0.5, 0.84, 1.0, 0.0])
    model = Cyclic(p, 10)
    on = history(model, seed=2)
    phase = model.phase(2)
    for i, pi in enumerate(p):
        np.testing.assert_array_equal(on[:, i], fedau_cyclic(pi, 10, phase[i], ROUNDS))
    # hand-computed: (A, I) = (1, 9), (3, 7), (5, 5), (8, 2), (10, 1), (1, 9)
    np.testing.assert_array_equal(model.on_rounds, [1, 3, 5, 8, 10, 1])
    np.testing.assert_array_equal(model.cycle, [10, 10, 10, 10, 11, 10])
    np.testing.assert_allclose(model.rates(), [0.1, 0.3, 0.5, 0.8, 10 / 11, 0.1])
    assert np.all(phase < [9, 7, 5, 2, 1, 9])
    # another seed, other phases
    assert not np.array_equal(model.phase(2), model.phase(3))


def test_cyclic_labels_follow_flgo_yc():
    """FLGo's YC window, written as its loop (floats), over two periods with beta = 1 (the
    window alone); with beta = 0.5 the rate over 10^4 rounds."""
    counts = np.array([[1, 0, 0, 0, 0], [0, 2, 0, 3, 0], [0, 0, 0, 0, 4], [5, 5, 5, 5, 5],
                       [0, 0, 1, 0, 0]])
    model = build(num_clients=5, label_counts=counts, model="cyclic", cyclic="labels",
                  cyclic_beta=1.0)
    lo, hi, top = [0, 1, 4, 0, 2], [0, 3, 4, 4, 2], 4
    for r in range(48):
        x = 1.0 * (1 + r % 24) / 24
        expected = [i for i in range(5) if x >= lo[i] / top and x <= hi[i] / top]
        np.testing.assert_array_equal(model.online(1, r), expected)
    half = build(num_clients=5, label_counts=counts, model="cyclic", cyclic="labels")
    ok, detail = within_binomial(history(half).sum(axis=0), ROUNDS, half.rates())
    assert ok, detail
    # client 0's window (r >= 0, r <= 0) never holds a round: online at 1 - beta
    assert half.rates()[0] == 0.5 and half.rates()[3] == 1.0


# --------------------------------------------------------------------------------------------
# determinism


@pytest.mark.parametrize("kw", [dict(model="bernoulli", p=0.3), dict(model="markov", p=0.3),
                                dict(model="cyclic", p=0.3, period=20)])
def test_same_seed_same_stream_other_seed_another(kw):
    a, b = build(num_clients=200, **kw), build(num_clients=200, **kw)
    one = [a.online(1, r) for r in range(30)]
    np.testing.assert_array_equal(np.concatenate(one),
                                  np.concatenate([b.online(1, r) for r in range(30)]))
    other = [b.online(2, r) for r in range(30)]
    assert any(not np.array_equal(x, y) for x, y in zip(one, other))


# --------------------------------------------------------------------------------------------
# schedule


def write_schedule(tmp_path, available, name="s.npz", key="available"):
    path = tmp_path / name
    np.savez(path, **{key: available})
    return str(path)


def test_schedule_replays_exactly(tmp_path):
    available = np.random.default_rng(0).random((12, 9)) < 0.4
    model = build(num_clients=9, num_rounds=10, model="schedule",
                  schedule=write_schedule(tmp_path, available))
    for seed in (1, 2):
        for r in range(12):
            np.testing.assert_array_equal(model.online(seed, r), np.flatnonzero(available[r]))
    np.testing.assert_allclose(model.rates(), available[:10].mean(axis=0))


@pytest.mark.parametrize("available,key,match", [
    (np.ones((10, 8), bool), "available", r"must be \[rounds, 9\].*got \[10, 8\]"),
    (np.ones((10, 9), np.int8), "available", "must be bool, got int8"),
    (np.ones((4, 9), bool), "available", "covers 4 rounds, the run has 10"),
    (np.ones((10, 9), bool), "avail", "no array 'available' in it .it holds avail.$"),
    (np.zeros((10, 9), bool), "available", "no client is online in any of the run's 10"),
])
def test_bad_schedules_are_refused(tmp_path, available, key, match):
    path = write_schedule(tmp_path, available, key=key)
    with pytest.raises(DataError, match=match):
        build(num_clients=9, num_rounds=10, model="schedule", schedule=path)


def test_a_schedule_that_is_not_an_npz_is_refused(tmp_path):
    path = tmp_path / "s.npz"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(DataError, match="not a readable .npz"):
        build(num_clients=9, num_rounds=10, model="schedule", schedule=str(path))
    np.save(tmp_path / "one.npy", np.ones((10, 9), bool))
    with pytest.raises(DataError, match="a single .npy array, not an .npz"):
        build(num_clients=9, num_rounds=10, model="schedule", schedule=str(tmp_path / "one.npy"))
    with pytest.raises(DataError, match="not a readable .npz .FileNotFoundError"):
        build(num_clients=9, num_rounds=10, model="schedule", schedule=str(tmp_path / "no.npz"))
    with pytest.raises(ConfigError, match="needs --availability_schedule=PATH"):
        AvailabilitySettings(model="schedule")


# --------------------------------------------------------------------------------------------
# traces


FEDSCALE = {1: {"active": [0, 100], "inactive": [30, 150], "finish_time": 200, "model": "a"},
            2: {"active": [50], "inactive": [60], "finish_time": 100, "model": "b"}}


def write_fedscale(tmp_path, data=FEDSCALE, name="trace.pkl"):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data))
    return str(path)


def test_fedscale_trace_mapped_to_rounds(tmp_path):
    """Round r read at t = 10 r: client 0 and 2 replay key 1 (active while t mod 200 is in
    [0, 30] or [100, 150]: r mod 20 in 0..3 or 10..15), client 1 key 2 (t mod 100 in
    [50, 60]: r mod 10 in {5, 6})."""
    model = build(num_clients=3, num_rounds=40, model="trace", trace=write_fedscale(tmp_path),
                  round_seconds=10.0)
    for r in range(40):
        one = r % 20 in (0, 1, 2, 3, 10, 11, 12, 13, 14, 15)
        expected = [c for c, on in ((0, one), (1, r % 10 in (5, 6)), (2, one)) if on]
        np.testing.assert_array_equal(model.online(5, r), expected)
    np.testing.assert_allclose(model.rates(), [0.5, 0.2, 0.5])
    # a start time shifts the reading: round 0 at t = 55 is in key 2's [50, 60] only
    late = build(num_clients=3, num_rounds=40, model="trace", trace=write_fedscale(tmp_path),
                 round_seconds=10.0, trace_start=55.0)
    np.testing.assert_array_equal(late.online(5, 0), [1])


def test_traces_assigned_by_seed_are_a_permutation(tmp_path):
    data = {k: {"active": [k], "inactive": [k], "finish_time": 1000} for k in range(6)}
    model = build(num_clients=6, num_rounds=1000, model="trace", trace_format="fedscale",
                  trace=write_fedscale(tmp_path, data, "t.bin"), round_seconds=1.0,
                  assign="seed", seed=3)
    first = [int(np.flatnonzero(history(model, rounds=6)[:, c])[0]) for c in range(6)]
    assert sorted(first) == list(range(6)) and first != list(range(6))


def flash_ready(entry, t):
    """FLASH's Timer.ready (PKU-Chengxu/FLASH models/timer.py), as a loop."""
    if not entry["isSuccess"]:
        return False
    now = (int(t - entry["trace_start"]) % int(entry["trace_end"] - entry["trace_start"])
           + entry["trace_start"])
    return any(s <= now <= e for s, e in entry["ready_time"])


def test_flash_trace_mapped_to_rounds(tmp_path):
    """g1: ready while 5 r mod 100 is in [10, 20] or [50, 60]: r mod 20 in {2, 3, 4, 10, 11,
    12}; g2 failed (never); g3 with fractional times (FLASH truncates t - trace_start)."""
    data = {"g1": {"isSuccess": True, "trace_start": 1000, "trace_end": 1100.7,
                   "ready_time": [[1010, 1020], [1050, 1060]]},
            "g2": {"isSuccess": False, "trace_start": None, "trace_end": None,
                   "ready_time": []},
            "g3": {"isSuccess": True, "trace_start": 1000.5, "trace_end": 1040.5,
                   "ready_time": [[1010.5, 1020.5]]}}
    path = tmp_path / "timers.json"
    path.write_text(json.dumps(data))
    model = build(num_clients=3, num_rounds=40, model="trace", trace=str(path),
                  round_seconds=5.0)
    for r in range(40):
        g1 = r % 20 in (2, 3, 4, 10, 11, 12)
        assert g1 == flash_ready(data["g1"], 5.0 * r)
        expected = [c for c, key in enumerate(("g1", "g2", "g3"))
                    if flash_ready(data[key], 5.0 * r)]
        assert (0 in expected) == g1
        np.testing.assert_array_equal(model.online(1, r), expected)
    assert model.rates()[1] == 0.0


STATE_TRACE = "\n".join([
    "2020-01-02 00:00:10\tscreen_lock", "2020-01-02 00:00:20\twifi",
    "2020-01-02 00:00:30\tbattery_charged_on",     # locked, WiFi, charging: ready from 30 s
    "2020-01-02 00:00:40\t55%", "2020-01-02 00:01:00\tscreen_unlock",        # ... to 60 s
    "2020-01-02 00:01:30\tscreen_lock", "2020-01-02 00:01:40\t4g",          # 90 s to 100 s
    "2020-01-02 00:03:20\tscreen_on", ""])                                    # the end: 200 s


def test_flash_state_traces_give_the_timers_ready_times(tmp_path):
    """FLASH's state_traces.json form: ready [[30, 60], [90, 100]], trace 10 s .. 200 s, so
    at t = 10 r: now = 10 + ((10 r - 10) mod 190), ready iff r mod 19 in {3, 4, 5, 6, 9, 10};
    a device with a line FLASH cannot split is never ready; the same ready times given as
    FLASH's cached timer replay the same rounds."""
    data = {"7": {"guid": "a", "model": "phone", "messages": STATE_TRACE},
            "8": {"guid": "b", "model": "phone", "messages": "2020-01-02 00:00:10 no tab\n"},
            "9": {"isSuccess": True, "trace_start": 10, "trace_end": 200,
                  "ready_time": [[30, 60], [90, 100]]}}
    path = tmp_path / "state_traces.json"
    path.write_text(json.dumps(data))
    model = build(num_clients=3, num_rounds=40, model="trace", trace=str(path),
                  round_seconds=10.0)
    on = history(model, rounds=40)
    expected = np.array([r % 19 in (3, 4, 5, 6, 9, 10) for r in range(40)])
    np.testing.assert_array_equal(on[:, 0], expected)
    np.testing.assert_array_equal(on[:, 1], False)
    np.testing.assert_array_equal(on[:, 2], expected)


class Boom:
    """A pickle that would create a folder when loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def test_a_pickle_that_names_code_is_refused_unrun(tmp_path):
    target = tmp_path / "created"
    path = write_fedscale(tmp_path, {1: {"active": [0], "inactive": [1], "finish_time": 5,
                                         "x": Boom(str(target))}})
    with pytest.raises(DataError, match="names posix.makedirs|names os.makedirs"):
        build(num_clients=3, model="trace", trace=path)
    assert not target.exists()


@pytest.mark.parametrize("content,name,match", [
    (b"\x80\x04garbage", "t.pkl", "not a FedScale client_behave_trace pickle"),
    (pickle.dumps([1, 2]), "t.pkl", "a FedScale trace is a non-empty dict"),
    (pickle.dumps({1: {"active": [0, 5], "inactive": [1], "finish_time": 9}}), "t.pkl",
     "client 1: 2 'active' times for 1 'inactive'"),
    (pickle.dumps({1: {"active": [0], "inactive": [1], "finish_time": 0}}), "t.pkl",
     "client 1: 'finish_time' must be > 0"),
    (pickle.dumps({1: {"active": ["x"], "inactive": [1], "finish_time": 3}}), "t.pkl",
     "client 1: 'active' must be a list of numbers"),
    (b"{not json", "t.json", "not FLASH's JSON"),
    (json.dumps({"g": {"isSuccess": True, "trace_start": 0}}).encode(), "t.json",
     "device 'g': a successful trace needs"),
    (json.dumps({"g": {"isSuccess": True, "trace_start": 0, "trace_end": 9,
                       "ready_time": [[1, 2, 3]]}}).encode(), "t.json",
     "'ready_time' must be a list of \\[start, end\\] pairs"),
    (json.dumps({"u": {"messages": "2020-01-02 00:00:10\tphone_on"}}).encode(), "t.json",
     "device 'u': unknown state 'phone_on'"),
    (pickle.dumps({1: {"active": [500], "inactive": [600], "finish_time": 1000}}), "t.pkl",
     "no client is online in any of the 10 rounds"),
])
def test_bad_traces_are_refused(tmp_path, content, name, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        build(num_clients=3, num_rounds=10, model="trace", trace=str(path), round_seconds=1.0)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------
# validation of probabilities


@pytest.mark.parametrize("kw,error,match", [
    (dict(p=1.5), ConfigError, r"--availability_p=1.5: a probability must be in \[0, 1\]"),
    (dict(p_min=-0.1), ConfigError, r"--availability_p_min=-0.1: a probability"),
    (dict(markov_off_on=0.0), ConfigError, r"--availability_markov_off_on=0: a probability"),
    (dict(cyclic_beta=2.0), ConfigError, r"--availability_cyclic_beta=2: a probability"),
    (dict(round_seconds=0.0), ConfigError, "--availability_round_seconds=0: must be > 0"),
    (dict(model="trace"), ConfigError, "needs --availability_trace=PATH"),
])
def test_bad_settings_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        AvailabilitySettings(**kw)


def test_probabilities_above_one_and_never_online_are_refused():
    counts = 5 * np.eye(4, dtype=np.int64)   # client k holds label k only: p_k = 4 p_mean w_k
    with pytest.raises(ConfigError, match=r"gives client \d the availability .*outside \[0, 1\]"):
        build(num_clients=4, label_counts=counts, model="bernoulli", probabilities="data",
              p_mean=1.0)
    with pytest.raises(ConfigError, match="every client has availability 0, no client is ever"):
        build(num_clients=4, model="markov", p=0.0)
    with pytest.raises(ConfigError, match="needs the clients' label counts"):
        build(num_clients=4, model="bernoulli", probabilities="data")


def test_cyclic_keeps_a_client_of_availability_zero_one_round_a_period():
    """FedAU's A_i = max(1, round(P p_i)): p_i = 0 is still on once every P rounds, so cyclic
    is not refused where bernoulli and markov are."""
    model = build(num_clients=5, model="cyclic", p=0.0, period=8)
    on = history(model, rounds=64)
    np.testing.assert_array_equal(on.sum(axis=0), np.full(5, 8))
    with pytest.raises(DataError, match="label counts of 4 clients for 5 clients"):
        build(num_clients=5, label_counts=np.eye(4, dtype=np.int64), model="cyclic",
              cyclic="labels")
