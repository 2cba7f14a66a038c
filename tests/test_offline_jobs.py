"""Clients that go offline in the middle of a job, against references written from the rule:

- a job that would arrive a seconds after it starts survives iff its client stays online
  for at least a seconds; under ``--mean_online_seconds=T`` that online time is exponential
  with mean T, E = -T ln U, U = ((SplitMix64(key + golden (c + 1)) >> 11) + 1) 2^-53 with
  key = SeedSequence([seed, round, 0x0FF1, 1]) (written below in Python integers), so it
  survives with probability exp(-a / T);
- the m first to arrive (ties by id) among those neither past the deadline nor lost are kept;
  a round lasts until the m-th arrival, or when fewer arrive the deadline, or with no
  deadline the later of the last arrival and the last loss;
- under ``--availability=trace`` the client must be online over the whole job: the trace's
  overlapping or touching intervals joined, from the round's trace time;
- asynchronous runs: a lost job ends at the moment its client goes offline, its slot starts
  a new client (a heapq event simulation below).
"""

import heapq
import math
import os
import pickle

import numpy as np
import pytest

from conftest import refused_over_a_finished_run, run_runner, tiny_config
from deltafl_jax.run.experiment import build_experiment
from deltafl_jax.sampling.samplers import sample_clients

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "tests", "tiny.flags")
M64 = 2 ** 64


def _session(T, seed, index, client, word=1):
    """E = -T ln U of the rule (module docstring), in Python integers."""
    key = int(np.random.SeedSequence([seed, index, 0x0FF1, word]).generate_state(
        1, np.uint64)[0])
    x = (key + 0x9E3779B97F4A7C15 * (client + 1)) % M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % M64
    x ^= x >> 31
    return -T * math.log(((x >> 11) + 1) * 2.0 ** -53)


def _model_bytes(data):
    d = int(np.prod(data.train.feature_shape))
    return 4 * (d * data.num_classes + data.num_classes)


def _config(**kw):
    base = dict(algorithm="fedavg", thetas=(1.0,), seeds=(1, 2), clients_per_round=4,
                batch_size=8, client_speed="lognormal", over_select=1.5)
    base.update(kw)
    return tiny_config(**base)


def _full_jobs(exp):
    """[N] each client's one-epoch job: x_c n_c + 2 D / w_c (FedScale's formula)."""
    sizes = exp.data.train.sizes
    ids = np.arange(sizes.size)
    speeds = exp.clock.speeds
    return speeds.per_example_s(ids) * sizes + 2.0 * _model_bytes(exp.data) / \
        speeds.bandwidth_Bps(ids)


def _reference_round(full, ids, m, deadline, T, seed, t):
    """(kept ids sorted, round seconds, late ids, lost ids, [(a, survived)] of the jobs
    in time) of one selected set, from the rule."""
    arrivals, late, lost, trials, gone = [], [], [], [], []
    for c in ids:
        c = int(c)
        a = float(full[c])
        if deadline is not None and a > deadline:
            late.append(c)
            continue
        e = _session(T, seed, t, c)
        trials.append((a, e >= a))
        if e < a:
            lost.append(c)
            gone.append(e)
            continue
        arrivals.append((a, c))
    arrivals.sort()
    kept = arrivals[:m]
    if len(kept) == m:
        seconds = kept[-1][0]
    elif deadline is not None:
        seconds = deadline
    else:
        seconds = max([a for a, _ in kept] + gone + [0.0])
    return sorted(c for _, c in kept), seconds, late, lost, trials


@pytest.mark.parametrize("with_deadline", [False, True])
def test_kept_cohorts_and_survival_over_1000_rounds_equal_the_rule(tiny_synthetic,
                                                                    with_deadline):
    """10^3 rounds, two seeds, 6 selected for 4: the kept cohort, the round's time, the drops
    by cause equal the reference exactly; the survival frequency of the jobs in time is
    exp(-a / T) within 4 binomial standard deviations, in all and in each third of the jobs
    by duration (slow devices are lost more)."""
    probe = build_experiment(_config(), tiny_synthetic)
    full = _full_jobs(probe)
    T = float(np.median(full))
    d = float(np.quantile(full, 0.8)) if with_deadline else None
    exp = build_experiment(_config(round_deadline=d, mean_online_seconds=T), tiny_synthetic)
    N, m, M = tiny_synthetic.train.num_clients, 4, 6
    now = np.zeros(2)
    late_n, lost_n = np.zeros((2, N), np.int64), np.zeros((2, N), np.int64)
    trials = []
    for t in range(1000):
        cohorts, _ = exp.kept_cohorts(t)
        counted = exp.count_round(t)
        for g, seed in enumerate((1, 2)):
            ids = sample_clients(seed, t, N, M)
            kept, seconds, late, lost, tr = _reference_round(full, ids, m, d, T, seed, t)
            trials += tr
            k = len(kept)
            assert cohorts[g].present.sum() == k
            np.testing.assert_array_equal(cohorts[g].clients[:k], kept)
            assert counted["num_offline"][g] == len(lost)
            assert counted["num_dropped"][g] == M - k
            late_n[g, late] += 1
            lost_n[g, lost] += 1
            now[g] += seconds
        np.testing.assert_allclose(counted["virtual_time"], now, rtol=1e-12)
    counts = dict(exp.participation_arrays())
    np.testing.assert_array_equal(counts["train_rounds_offline"], lost_n)
    assert ("train_rounds_late" in counts) == with_deadline
    if with_deadline:
        np.testing.assert_array_equal(counts["train_rounds_late"], late_n)
        assert late_n.sum() > 0
    a = np.array([x for x, _ in trials])
    s = np.array([y for _, y in trials], np.float64)
    p = np.exp(-a / T)
    cuts = np.quantile(a, [1 / 3, 2 / 3])
    groups = [np.ones(a.size, bool), a <= cuts[0], (a > cuts[0]) & (a <= cuts[1]), a > cuts[1]]
    for sel in groups:
        bound = 4.0 * math.sqrt(float(np.sum(p[sel] * (1 - p[sel]))))
        assert abs(s[sel].sum() - p[sel].sum()) <= bound, (s[sel].sum(), p[sel].sum(), bound)
    assert s[groups[1]].mean() > s[groups[3]].mean()


def _fedscale_trace(path):
    """Four devices (FedScale's client_behave_trace format), hand-made:
    k0 online [0, 100]; k1 [0, 10] and [10, 50] (touching: online until 50);
    k2 [0, 5] and [20, 30] (offline between); k3 [0, 40] and [2, 10] (overlapping)."""
    traces = {"k0": {"active": [0], "inactive": [100], "finish_time": 1000},
              "k1": {"active": [0, 10], "inactive": [10, 50], "finish_time": 1000},
              "k2": {"active": [0, 20], "inactive": [5, 30], "finish_time": 1000},
              "k3": {"active": [0, 2], "inactive": [40, 10], "finish_time": 1000}}
    with open(path, "wb") as f:
        pickle.dump(traces, f)


def test_a_trace_keeps_the_jobs_online_over_their_whole_interval(tmp_path):
    """Hand case: at t = 0 the devices stay online 100, 50, 5 and 40 s; at t = 20 (k3 in its
    overlapping intervals) 80, 30, 10 and 20 s; at t = 100, 0 s for k0 and offline for the
    rest. Jobs of 60, 55, 25 and 39 s (one example a second) at t = 0 keep clients 0 and 3:
    client 1 goes offline at 50 s, client 2 at 5 s (FedScale's check at the arrival alone,
    25 s, would find k2 online again); the round lasts until the last arrival (60 s, later
    than the losses at 5 and 50 s)."""
    from deltafl_jax.sampling.plan import LocalWork
    from deltafl_jax.sampling.availability import AvailabilitySettings, build_availability
    from deltafl_jax.sampling.offline import TraceStretches
    from deltafl_jax.sampling.samplers import Cohort
    from deltafl_jax.sampling.speeds import DeviceSpeeds, TimingSettings
    from deltafl_jax.sampling.timeline import VirtualClock
    path = str(tmp_path / "trace.pkl")
    _fedscale_trace(path)
    model = build_availability(AvailabilitySettings(model="trace", trace=path,
                                                    round_seconds=100.0),
                               num_clients=4, sizes=np.full(4, 30), label_counts=None,
                               num_rounds=2)
    stretches = TraceStretches(model.traces)
    np.testing.assert_array_equal(stretches.online_for(0.0), [100, 50, 5, 40])
    np.testing.assert_array_equal(stretches.online_for(20.0), [80, 30, 10, 20])
    np.testing.assert_array_equal(stretches.online_for(100.0), [0, -np.inf, -np.inf, -np.inf])
    settings = TimingSettings(client_speed="uniform", client_speed_example_s=1.0)
    speeds = DeviceSpeeds(4, 1.0, 1e12)
    sizes = np.array([60, 55, 25, 39])
    clock = VirtualClock(settings, speeds, (1,), sizes, 4, LocalWork(batch_size=8), 1,
                         availability=model)
    cohort = Cohort(np.arange(4, dtype=np.int32), np.ones(4, bool), np.ones(4))
    kept, steps = clock.select(0, [cohort])
    assert kept[0].present.sum() == 2
    np.testing.assert_array_equal(kept[0].clients[:2], [0, 3])
    np.testing.assert_array_equal(steps[0][:2], [8, 5])        # ceil(n / 8): whole epochs
    counted = clock.count(0)
    assert counted["num_offline"][0] == 2 and counted["num_dropped"][0] == 2
    assert counted["round_seconds"][0] == pytest.approx(60.0, abs=1e-9)
    np.testing.assert_array_equal(clock.offline_rounds, [[0, 1, 1, 0]])


def _reference_async(table, C, K, seed, T, steps):
    """A heapq event simulation of the rule: C jobs start at 0 (serials 0..C-1), each client
    drawn uniformly among the idle ones by default_rng([seed, serial, 0xA5C1]); a job of
    duration d whose session E < d ends lost at start + E; events by (time, client); a
    completion is buffered, K buffered make a server step; every event starts one job."""
    N = len(table)
    heap, busy = [], set()
    state = {"serial": 0, "version": 0, "lost": 0, "clock": 0.0}
    out, buffer = [], []
    lost_by = np.zeros(N, np.int64)

    def start():
        idle = sorted(set(range(N)) - busy)
        rng = np.random.default_rng([seed, state["serial"], 0xA5C1])
        c = idle[rng.integers(len(idle))]
        d = table[c]
        e = _session(T, seed, state["serial"], c, word=2)
        lost = e < d
        heapq.heappush(heap, (state["clock"] + (e if lost else d), c, lost, state["version"]))
        busy.add(c)
        state["serial"] += 1

    for _ in range(C):
        start()
    while len(out) < steps:
        end, c, lost, base = heapq.heappop(heap)
        busy.discard(c)
        state["clock"] = end
        if lost:
            state["lost"] += 1
            lost_by[c] += 1
        else:
            buffer.append((c, base))
            if len(buffer) == K:
                state["version"] += 1
                out.append((end, [b[0] for b in buffer], [b[1] for b in buffer],
                            state["lost"], lost_by.copy()))
                buffer, state["lost"] = [], 0
        start()
    return out


def test_asynchronous_jobs_lost_mid_job_equal_an_event_simulation():
    """Six clients of fixed durations, C = 3, K = 2, sessions of mean 3 s: every server
    step's time, clients, base versions and jobs lost since the previous step equal the
    reference's, and some jobs are lost; a scheduler restored from another's state in the
    middle goes on identically."""
    from deltafl_jax.asynchronous.scheduler import AsyncScheduler
    table = np.array([1.0, 2.5, 4.0, 1.5, 3.0, 6.0])

    def make():
        return AsyncScheduler(num_clients=6, concurrency=3, buffer_size=2, max_staleness=None,
                              seconds=lambda ids: table[np.asarray(ids)], seed=7,
                              mean_online_seconds=3.0)
    ref = _reference_async(table, 3, 2, 7, 3.0, 12)
    sch = make()
    got = [sch.next_step() for _ in range(12)]
    for step, (time, clients, base, lost, _) in zip(got, ref):
        assert step.time == pytest.approx(time, rel=1e-12)
        assert step.clients.tolist() == clients and step.base.tolist() == base
        assert step.lost == lost
    assert sum(s.lost for s in got) > 0
    # each client's jobs lost so far, after the last step (the refill after it loses none)
    np.testing.assert_array_equal(sch.lost_by, ref[-1][4])
    a = make()
    for _ in range(5):
        a.next_step()
    b = make()
    b.restore(a.state())
    for _ in range(7):
        x, y = a.next_step(), b.next_step()
        assert x.time == y.time and x.clients.tolist() == y.clients.tolist()
        assert x.lost == y.lost
    np.testing.assert_array_equal(a.lost_by, b.lost_by)


def test_without_the_flag_nothing_changes(tiny_synthetic):
    """No --mean_online_seconds (and no trace): the kept cohorts are those of a clock that
    cannot lose a job, and the outputs hold no offline counts."""
    exp = build_experiment(_config(round_deadline=None), tiny_synthetic)
    assert not exp.clock.goes_offline
    for t in range(20):
        exp.kept_cohorts(t)
        assert "num_offline" not in exp.count_round(t)
    assert not {"train_rounds_offline", "train_rounds_late"} & set(exp.participation_arrays())
    assert "offline_rounds" not in exp.clock.state()


def test_the_drop_table_shows_each_cause():
    """A column whose clients.npz holds the counts by cause gets a row per cause, each cell
    the quintile's cause drops over its selections (hand case: 5 clients, one per
    quintile)."""
    import types

    from deltafl_jax.report import speed_drops
    clients = {"train_sizes": np.full(5, 10),
               "train_rounds_selected": np.array([[4, 4, 4, 4, 4]]),
               "train_rounds_dropped": np.array([[0, 1, 2, 3, 4]]),
               "train_rounds_late": np.array([[0, 0, 1, 2, 2]]),
               "train_rounds_offline": np.array([[0, 1, 1, 1, 2]])}
    run = types.SimpleNamespace(config={"client_speed": "uniform"}, clients=clients)
    col = types.SimpleNamespace(label="FedAvg", parts=[(run, [0])])
    x = np.array([0.001, 0.002, 0.003, 0.004, 0.005])
    orig = speed_drops.run_per_example_s
    speed_drops.run_per_example_s = lambda r: x
    try:
        table = speed_drops.drop_table([col])
    finally:
        speed_drops.run_per_example_s = orig
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines()[2:]}
    assert rows["FedAvg"] == ["0.0", "25.0", "50.0", "75.0", "100.0", "50.0"]
    assert rows["FedAvg: deadline"] == ["0.0", "0.0", "25.0", "50.0", "50.0", "25.0"]
    assert rows["FedAvg: offline"] == ["0.0", "25.0", "25.0", "25.0", "50.0", "25.0"]


@pytest.mark.parametrize("args,message", [
    (["--client_speed=uniform", "--mean_online_seconds=0"], "--mean_online_seconds=0: must be"),
    (["--client_speed=uniform", "--mean_online_seconds=-2"], "--mean_online_seconds=-2: must"),
    (["--client_speed=uniform", "--mean_online_seconds=nan"], "--mean_online_seconds=nan"),
    (["--client_speed=uniform", "--mean_online_seconds=inf"], "--mean_online_seconds=inf"),
    (["--mean_online_seconds=5"], "--mean_online_seconds needs a virtual clock"),
    (["--client_speed=uniform", "--mean_online_seconds=1e-9"], "no job would be aggregated"),
    (["--client_speed=uniform", "--mean_online_seconds=5", "--algorithm=scaffold",
      "--thetas=1"], "--algorithm=scaffold needs a fixed cohort"),
])
def test_bad_sessions_exit_2_with_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", *args], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists()


@pytest.mark.slow
def test_a_bad_session_leaves_a_finished_run_untouched(tiny_synthetic, tmp_path):
    """A subprocess with --overwrite into a folder holding a finished run: one line, exit 2,
    the folder byte-identical."""
    refused_over_a_finished_run(tmp_path, tiny_synthetic, "--client_speed=lognormal",
                                "--mean_online_seconds=-1",
                                message="--mean_online_seconds=-1: must be > 0 seconds")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ("--algorithm=fedavg", "--over_select=1.5"),
    ("--algorithm=fedbuff", "--concurrency=6", "--buffer_size=3"),
], ids=["synchronous", "fedbuff"])
def test_a_run_losing_jobs_killed_and_rerun_is_bit_identical(tmp_path, flags):
    """SIGKILL after a checkpoint, rerun: the same outputs, bit for bit (the offline counts,
    the jobs in flight that will be lost and the losses not yet reported come back)."""
    from test_resume import killed_and_rerun
    out = killed_and_rerun(tmp_path, *flags, "--thetas=1", "--client_speed=lognormal",
                           "--mean_online_seconds=3")
    with np.load(os.path.join(out, "rounds.npz")) as r:
        lost = r["num_offline"] if "num_offline" in r.files else r["lost_jobs"]
        assert lost.sum() > 0
    with np.load(os.path.join(out, "clients.npz")) as c:   # the same losses, per client
        per_client = c["train_rounds_offline"] if "num_offline" in r.files else \
            c["train_jobs_lost"]
        assert per_client.sum() == lost.sum()
