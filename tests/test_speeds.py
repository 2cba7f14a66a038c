"""Device speeds (deltafl_jax/sampling/speeds.py) against their laws and FedScale's formula.

The lognormal model over 2 x 10^5 clients against the closed forms of a lognormal law (median,
mean, the spread of the logs, a Kolmogorov-Smirnov test from scipy); its determinism per id
whatever subset is asked; the capacity trace, written here as a pickle, against FedScale's
``get_completion_time`` written out by hand (3 x batch x steps x ms / 1000 seconds of compute,
(upload + download kbit) / kbps of communication, a kbit being bytes x 8 / 1024); the
settings' and the files' errors by their one line.
"""

import dataclasses
import math
import os
import pickle

import numpy as np
import pytest
from scipy import stats

from deltafl_jax.declared import declared
from deltafl_jax.errors import ConfigError
from deltafl_jax.sampling.speeds import (TimingSettings, build_speeds, hashed_uniform,
                                         job_seconds)

CLIENTS = 200_000
SIGMAS = 5.0


def speeds(num_clients=CLIENTS, data_seed=0, **kw):
    return build_speeds(TimingSettings(**kw), num_clients=num_clients, data_seed=data_seed)


def test_none_builds_nothing_and_is_inactive():
    settings = TimingSettings()
    assert not settings.active
    assert build_speeds(settings, num_clients=10, data_seed=0) is None


def test_every_flag_is_a_timing_flag():
    names = {flag.name for _, flag in declared(TimingSettings)}
    assert names == {f.name for f in dataclasses.fields(TimingSettings)}
    assert {"client_speed", "client_speed_trace", "round_deadline", "partial_work",
            "over_select", "stop_at_virtual_time", "mean_online_seconds"} <= names
    assert all(n.startswith("client_speed") for n in names
               - {"round_deadline", "partial_work", "over_select", "stop_at_virtual_time",
                  "mean_online_seconds"})


def test_uniform_is_the_same_for_everyone():
    model = speeds(num_clients=50, client_speed="uniform", client_speed_example_s=0.02,
                   client_speed_kbps=800.0)
    ids = np.array([0, 49, 7, 7])
    np.testing.assert_array_equal(model.per_example_s(ids), 0.02)
    np.testing.assert_array_equal(model.bandwidth_Bps(ids), 800.0 * 1024 / 8)


@pytest.mark.parametrize("mu,sigma,kbps_sigma", [(1.0, 0.6, 0.6), (-0.5, 1.2, 0.3)])
def test_lognormal_follows_its_closed_form(mu, sigma, kbps_sigma):
    model = speeds(client_speed="lognormal", client_speed_mu=mu, client_speed_sigma=sigma,
                   client_speed_kbps_sigma=kbps_sigma, client_speed_example_s=0.005,
                   client_speed_kbps=2000.0, data_seed=3)
    ids = np.arange(CLIENTS)
    x, w = model.per_example_s(ids), model.bandwidth_Bps(ids)
    for values, log_median, s in ((x, math.log(0.005) + mu, sigma),
                                  (w, math.log(2000.0 * 128), kbps_sigma)):
        logs = np.log(values)
        se = s / math.sqrt(CLIENTS)
        assert abs(logs.mean() - log_median) < SIGMAS * se
        # the sample median of a normal: standard error sqrt(pi / 2) s / sqrt(n)
        assert abs(np.median(logs) - log_median) < SIGMAS * math.sqrt(math.pi / 2) * se
        assert abs(logs.std() / s - 1) < SIGMAS / math.sqrt(2 * CLIENTS)
        mean = math.exp(log_median + s * s / 2)
        sd = mean * math.sqrt(math.expm1(s * s))
        assert abs(values.mean() - mean) < SIGMAS * sd / math.sqrt(CLIENTS)
        law = stats.lognorm(s=s, scale=math.exp(log_median))
        assert stats.kstest(values, law.cdf).pvalue > 1e-4
    # compute and bandwidth are drawn independently
    r = np.corrcoef(np.log(x), np.log(w))[0, 1]
    assert abs(r) < SIGMAS / math.sqrt(CLIENTS)


def test_hashed_uniforms_are_uniform_and_pairwise_independent():
    u = hashed_uniform(np.uint64(12345), np.arange(CLIENTS))
    assert u.min() > 0 and u.max() <= 1
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    # consecutive ids are not correlated
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < SIGMAS / math.sqrt(CLIENTS)


def test_lognormal_is_a_function_of_the_id_and_the_data_seed():
    n = 10**6
    model = speeds(num_clients=n, client_speed="lognormal", data_seed=7)
    rng = np.random.default_rng(0)
    ids = rng.choice(n, size=1000, replace=False)
    x, w = model.per_example_s(ids), model.bandwidth_Bps(ids)
    # any subset, in any order, gives each id the same speeds; so does a new model
    again = speeds(num_clients=n, client_speed="lognormal", data_seed=7)
    perm = rng.permutation(ids.size)
    np.testing.assert_array_equal(again.per_example_s(ids[perm]), x[perm])
    np.testing.assert_array_equal(again.bandwidth_Bps(ids[perm]), w[perm])
    for i in ids[:5]:
        assert model.per_example_s(np.array([i]))[0] == x[ids == i][0]
    # the population size does not matter, the data seed does
    small = speeds(num_clients=n + 5, client_speed="lognormal", data_seed=7)
    np.testing.assert_array_equal(small.per_example_s(ids), x)
    other = speeds(num_clients=n, client_speed="lognormal", data_seed=8)
    assert np.mean(other.per_example_s(ids) == x) < 0.01


def test_ids_outside_the_population_are_refused():
    model = speeds(num_clients=5, client_speed="lognormal")
    with pytest.raises(ValueError, match=r"ids in \[0, 5\)"):
        model.per_example_s(np.array([5]))


def write_capacity(tmp_path, data, name="capacity.pkl"):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data))
    return str(path)


CAPACITY = {11: {"computation": 20.0, "communication": 800.0},
            12: {"computation": 55.5, "communication": 12000.0},
            13: {"computation": 8.0, "communication": 95.0}}


def fedscale_completion(compute_ms, kbps, batch_size, local_steps, model_bytes):
    """FedScale's get_completion_time written out: (computation s, communication s)."""
    kbit = model_bytes / 1024.0 * 8.0
    return 3.0 * batch_size * local_steps * compute_ms / 1000.0, (kbit + kbit) / kbps


def test_capacity_trace_gives_fedscales_completion_times(tmp_path):
    path = write_capacity(tmp_path, CAPACITY)
    model = speeds(num_clients=7, client_speed="capacity_trace", client_speed_trace=path)
    devices = list(CAPACITY.values())
    ids = np.arange(7)
    batch, steps, model_bytes = 20, 5, 3_456_789
    got = job_seconds(model, ids, np.full(7, batch * steps), model_bytes)
    for i in ids:                        # client i replays the entry i mod 3 of the file
        d = devices[i % 3]
        compute, comm = fedscale_completion(d["computation"], d["communication"], batch, steps,
                                            model_bytes)
        assert got[i] == pytest.approx(compute + comm, rel=1e-12)
        assert model.per_example_s(np.array([i]))[0] == pytest.approx(
            3.0 * d["computation"] / 1000.0, rel=1e-15)


def test_capacity_trace_assigned_by_seed_is_a_seeded_permutation(tmp_path):
    data = {k: {"computation": float(k + 1), "communication": 100.0} for k in range(10)}
    path = write_capacity(tmp_path, data)

    def devices(seed):
        model = speeds(num_clients=30, client_speed="capacity_trace", client_speed_trace=path,
                       client_speed_assign="seed", data_seed=seed)
        return np.rint(model.per_example_s(np.arange(30)) * 1000 / 3 - 1).astype(int)

    first = devices(1)
    assert sorted(first[:10]) == list(range(10))            # each device once per 10 clients
    np.testing.assert_array_equal(first[10:20], first[:10])  # then again: perm[i mod T]
    np.testing.assert_array_equal(devices(1), first)
    assert not np.array_equal(devices(2), first)


def test_job_seconds_adds_compute_and_both_transfers():
    model = speeds(num_clients=4, client_speed="lognormal", data_seed=2)
    ids = np.array([3, 1])
    examples = np.array([40, 7])
    got = job_seconds(model, ids, examples, 1000)
    want = [model.per_example_s(np.array([i]))[0] * e + 2 * 1000 / model.bandwidth_Bps(
        np.array([i]))[0] for i, e in zip(ids, examples)]
    np.testing.assert_allclose(got, want, rtol=1e-14)


class Boom:
    """A pickle that would create a folder when loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


@pytest.mark.parametrize("content,match", [
    (b"\x80\x04garbage", "not a FedScale client_device_capacity pickle"),
    (pickle.dumps({}), "a capacity trace is a non-empty dict"),
    (pickle.dumps([1, 2]), "a capacity trace is a non-empty dict"),
    (pickle.dumps({4: {"communication": 10.0}}), "device 4 needs a 'computation' > 0"),
    (pickle.dumps({4: {"computation": 3.0, "communication": -1.0}}),
     "device 4 needs a 'communication' > 0, got -1.0"),
    (pickle.dumps({"a": {"computation": "x", "communication": 1.0}}),
     "device 'a' needs a 'computation' > 0"),
    (pickle.dumps({4: 3.0}), "device 4 needs a 'computation' > 0"),
])
def test_bad_capacity_traces_are_refused_in_one_line(tmp_path, content, match):
    path = tmp_path / "bad.pkl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as info:
        speeds(num_clients=3, client_speed="capacity_trace", client_speed_trace=str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--client_speed_trace={path}: ")


def test_a_missing_or_code_naming_trace_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="missing.pkl: cannot read it"):
        speeds(num_clients=3, client_speed="capacity_trace",
               client_speed_trace=str(tmp_path / "missing.pkl"))
    target = tmp_path / "created"
    path = write_capacity(tmp_path, {1: {"computation": 1.0, "communication": 1.0,
                                         "x": Boom(str(target))}})
    with pytest.raises(ConfigError, match="names posix.makedirs|names os.makedirs"):
        speeds(num_clients=3, client_speed="capacity_trace", client_speed_trace=path)
    assert not target.exists()


@pytest.mark.parametrize("kw,match", [
    (dict(client_speed="uniform", round_deadline=0.0), "--round_deadline=0: must be > 0"),
    (dict(client_speed="uniform", round_deadline=-3.0), "--round_deadline=-3: must be > 0"),
    (dict(client_speed="uniform", over_select=0.9), "--over_select=0.9: must be >= 1"),
    (dict(client_speed="uniform", stop_at_virtual_time=0.0),
     "--stop_at_virtual_time=0: must be > 0"),
    (dict(client_speed="uniform", partial_work=True), "--partial_work needs --round_deadline"),
    (dict(round_deadline=5.0), "--round_deadline needs a virtual clock"),
    (dict(over_select=1.3), "--over_select needs a virtual clock"),
    (dict(stop_at_virtual_time=10.0), "--stop_at_virtual_time needs a virtual clock"),
    (dict(client_speed="capacity_trace"), "needs --client_speed_trace=PATH"),
    (dict(client_speed="lognormal", client_speed_sigma=-0.1),
     "--client_speed_sigma=-0.1: must be >= 0"),
    (dict(client_speed="uniform", client_speed_example_s=0.0),
     "--client_speed_example_s=0: must be > 0"),
    (dict(client_speed="uniform", client_speed_kbps=-5.0), "--client_speed_kbps=-5: must be > 0"),
    (dict(client_speed="warp"), "--client_speed must be one of none, uniform"),
])
def test_bad_settings_are_refused_in_one_line(kw, match):
    settings = TimingSettings(**kw)
    with pytest.raises(ConfigError, match=match):
        settings.check()
    with pytest.raises(ConfigError, match=match):
        build_speeds(settings, num_clients=3, data_seed=0)


@pytest.mark.parametrize("r,m,slots", [(1.0, 10, 10), (1.3, 10, 13), (1.3, 7, 10),
                                       (1.5, 1, 2), (2.0, 5, 10)])
def test_over_selection_samples_ceil_r_m_slots(r, m, slots):
    assert TimingSettings(client_speed="uniform", over_select=r).slots(m) == slots
