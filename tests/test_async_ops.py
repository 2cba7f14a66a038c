"""An asynchronous run's tail by availability and its estimate: the per-client counts it
records (jobs started, updates aggregated, stale drops) and their sums by availability
quintile against a NumPy event simulation of FedBuff's scheduler; the report's table of the
updates aggregated by quintile against NumPy from clients.npz; ``--estimate`` of FedBuff
runs (deltafl_jax/run/buffered.py, deltafl_jax/evaluation/by_availability.py,
deltafl_jax/report/availability.py, deltafl_jax/run/estimate.py)."""

import json
import os
import re

import numpy as np
import pytest

from conftest import run_runner, tiny_config
from deltafl_jax import run_experiment
from deltafl_jax.evaluation.by_availability import count_split
from deltafl_jax.run import resolve as resolve_lib
from deltafl_jax.run.buffered import async_speeds
from deltafl_jax.asynchronous.scheduler import job_durations
from deltafl_jax.sampling.plan import LocalWork

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "tests", "tiny.flags")
FLAGFILE = os.path.join(REPO, "experiments", "async_synthetic_fedbuff.flags")
SEEDS, STEPS, EVERY, C, K, S, B = (1, 2), 6, 3, 5, 3, 1, 8
COUNTS = ("jobs_started", "updates_aggregated", "updates_stale")


def event_counts(seconds, online, num_clients, seed, steps):
    """FedBuff's events written from the scheduler's rules (deltafl_jax/sampling/
    asynchronous.py's docstring), with a list of slots: C slots start idle online clients
    (online at the current version; the job's client drawn uniformly among them, sorted, by
    default_rng([seed, serial, 0xA5C1])); the job that ends first (ties: the lower client)
    completes; an update more than S versions old is dropped, else buffered; K buffered
    updates make a server step; the freed slots start new jobs (after the step). Returns
    [steps] of (started, aggregated, stale) [N] counts after each step."""
    slots = [None] * C                   # (end, client, base)
    version, clock, serial, buffer = 0, 0.0, 0, []
    started, aggregated, stale = (np.zeros(num_clients, np.int64) for _ in range(3))

    def fill():
        nonlocal serial
        for j in [j for j in range(C) if slots[j] is None]:
            busy = {s[1] for s in slots if s is not None}
            idle = [c for c in sorted(int(c) for c in online(version)) if c not in busy]
            if not idle:
                continue
            client = idle[np.random.default_rng([seed, serial, 0xA5C1]).integers(len(idle))]
            slots[j] = (clock + float(seconds(np.asarray([client]))[0]), client, version)
            serial += 1
            started[client] += 1

    fill()
    out = []
    while len(out) < steps:
        j = min((j for j in range(C) if slots[j] is not None),
                key=lambda j: (slots[j][0], slots[j][1]))
        end, client, base = slots[j]
        slots[j], clock = None, end
        if version - base > S:
            stale[client] += 1
        else:
            buffer.append(client)
        if len(buffer) == K:
            version += 1
            for c in buffer:
                aggregated[c] += 1
            buffer = []
            fill()
            out.append((started.copy(), aggregated.copy(), stale.copy()))
        else:
            fill()
    return out


def numpy_quintiles(rates):
    """Rank by rate, ties by index; the client of rank r of N in fifth floor(5 r / N)."""
    N = len(rates)
    order = sorted(range(N), key=lambda i: (rates[i], i))
    q = np.empty(N, np.int64)
    for r, c in enumerate(order):
        q[c] = (5 * r) // N
    return q


def async_config(out=None, **kw):
    base = dict(algorithm="fedbuff", thetas=(1.0,), seeds=SEEDS, num_rounds=STEPS,
                eval_every=EVERY, batch_size=B, client_speed="lognormal", concurrency=C,
                buffer_size=K, max_staleness=S, availability="bernoulli",
                availability_probs="less_data", output_dir=out, save_models=False)
    return tiny_config(**{**base, **kw})


@pytest.fixture(scope="module")
def async_run(tiny_synthetic, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("async") / "run")
    config = async_config(out)
    run_experiment(config, tiny_synthetic)
    return config, out


def test_counts_by_availability_equal_an_event_simulation(async_run, tiny_synthetic):
    """Bernoulli availability with p_i = n_i^-1/2 / max_j n_j^-1/2 (FLGo's LDF), C = 5 of 12
    clients, K = 3, S = 1: clients.npz's per-client jobs started, updates aggregated and
    stale drops equal the NumPy event simulation's, its availability rates are p_i, and every
    evaluation's (steps 3 and 6) sums by availability quintile are NumPy's of the counts
    after that step; the test devices' error is split by quintile too."""
    config, out = async_run
    train = tiny_synthetic.train
    N = train.num_clients
    p = train.sizes.astype(np.float64) ** -0.5
    p = p / p.max()
    q = numpy_quintiles(p)
    availability = resolve_lib.resolve(config, tiny_synthetic).availability
    model_bytes = 4 * (int(np.prod(train.feature_shape)) + 1) * tiny_synthetic.num_classes
    seconds = job_durations(async_speeds(config.timing, N, config.data.data_seed), train.sizes,
                            LocalWork(batch_size=B, local_epochs=1), model_bytes)
    sims = [event_counts(seconds, lambda v, s=seed: availability.online(s, v), N, seed, STEPS)
            for seed in SEEDS]
    with np.load(os.path.join(out, "clients.npz")) as c:
        for i, name in enumerate(COUNTS):
            np.testing.assert_array_equal(c[f"train_{name}"], [s[-1][i] for s in sims], name)
        np.testing.assert_allclose(c["train_availability_rate"], [p, p], rtol=1e-12)
    assert sims[0][-1][2].sum() + sims[1][-1][2].sum() > 0       # stale drops do occur
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [(r["round"], r["seed"]) for r in recs] == [(3, 1), (3, 2), (6, 1), (6, 2)]
    for rec in recs:
        counts = sims[SEEDS.index(rec["seed"])][rec["round"] - 1]
        for j in range(5):
            for i, name in enumerate(COUNTS):
                assert rec[f"train_avail_q{j + 1}_{name}"] == counts[i][q == j].sum(), name
            assert rec[f"train_avail_q{j + 1}_rate_mean"] == pytest.approx(p[q == j].mean())
            assert rec[f"train_avail_q{j + 1}_clients"] == np.sum(q == j)
    test_rates = resolve_lib.test_availability(config, tiny_synthetic).rates()
    tq = numpy_quintiles(test_rates)
    with np.load(os.path.join(out, "clients.npz")) as c:
        err = c["test_error"]
    for r, rec in enumerate(recs[2:]):
        for j in range(5):
            assert rec[f"test_avail_q{j + 1}_error_mean"] == pytest.approx(
                err[r][tq == j].mean())


def test_count_split_by_hand():
    """Seven clients (a tie in rate), two replicas, and a sample of four of them: the sums per
    fifth of the population's ranks, computed by hand."""
    rates = np.array([0.3, 0.1, 0.3, 0.9, 0.05, 0.5, 0.2])
    # ranks: 4 (0.05), 1, 6, 0, 2 (tie, lower index first), 5, 3 -> fifths by floor(5 r / 7)
    counts = np.array([[1, 2, 3, 4, 5, 6, 7], [0, 1, 0, 1, 0, 1, 0]])
    got = count_split({"x": counts}, rates)
    fifth = {4: 0, 1: 0, 6: 1, 0: 2, 2: 2, 5: 3, 3: 4}
    for j in range(5):
        members = [c for c, f in fifth.items() if f == j]
        np.testing.assert_array_equal(got[f"q{j + 1}_x"], counts[:, members].sum(axis=1))
        assert got[f"q{j + 1}_clients"].tolist() == [len(members)] * 2
        assert got[f"q{j + 1}_rate_mean"][0] == pytest.approx(rates[members].mean())
    sample = count_split({"x": counts[:, [3, 4, 0, 2]]}, rates, clients=[3, 4, 0, 2])
    assert [sample[f"q{j}_x"][0] for j in range(1, 6)] == [5, 0, 1 + 3, 0, 4]
    assert [sample[f"q{j}_clients"][0] for j in range(1, 6)] == [1, 0, 2, 0, 1]


def test_the_report_tables_the_updates_by_availability(async_run, tiny_synthetic):
    """The report's table: each quintile's share of the updates aggregated and the stale
    share, the seeds' mean of NumPy's from clients.npz and the rates the run recorded; a
    synchronous run without availability has no table."""
    from deltafl_jax import report
    from deltafl_jax.report.availability import share_table, update_shares
    _, out = async_run
    with np.load(os.path.join(out, "clients.npz")) as c:
        agg, stale = c["train_updates_aggregated"], c["train_updates_stale"]
        q = numpy_quintiles(c["train_availability_rate"][0])
    want = np.stack([agg[:, q == j].sum(axis=1) / agg.sum(axis=1) for j in range(5)], axis=1)
    stale_share = stale.sum(axis=1) / (stale.sum(axis=1) + agg.sum(axis=1))
    (run,), _ = report.load([out])
    (col,) = report.columns([run])
    _, shares, got_stale = update_shares(col)
    np.testing.assert_allclose(shares, want)
    np.testing.assert_allclose(got_stale, stale_share)
    row = next(line for line in share_table([col]).splitlines()
               if line.startswith(f"| {col.label} |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    for j in range(5):
        assert float(cells[j].split()[0]) == pytest.approx(100 * want[:, j].mean(), abs=0.051)
    assert float(cells[5].split()[0]) == pytest.approx(100 * stale_share.mean(), abs=0.051)
    (plain,), _ = report.load([_plain_run(tiny_synthetic, os.path.dirname(out))])
    assert share_table(report.columns([plain])) is None


@pytest.mark.slow   # figures: CI's second step
def test_the_report_of_an_async_run_has_the_tail_by_availability(async_run, tmp_path):
    """report.md of the FedBuff run: the figure of the error by availability quintile (its
    test devices) and the section of the updates by availability quintile, whose table is
    :func:`share_table`'s."""
    from deltafl_jax import report
    from deltafl_jax.report.availability import share_table
    _, out = async_run
    (run,), _ = report.load([out])
    written = report.write_report([run], str(tmp_path / "rep"))
    text = open(written["report"]).read()
    assert "availability_error_" in text
    section = text.index("## Updates by availability quintile")
    assert section < text.index("## Files")
    assert share_table(report.columns([run])) in text[section:]


def _plain_run(data, parent):
    out = os.path.join(parent, "plain")
    run_experiment(tiny_config(num_rounds=1, eval_every=1, output_dir=out), data)
    return out


def _block(stdout):
    """The figures of the printed estimate block."""
    b = {}
    for line in stdout.splitlines():
        m = re.match(r"estimate of (\S+): (\d+) replicas, (\d+) server steps", line)
        if m:
            b.update(name=m.group(1), replicas=int(m.group(2)), header_steps=int(m.group(3)))
        m = re.match(r"\s+(build|compile|projected run)\s+([0-9.]+) s", line)
        if m:
            b[m.group(1).split()[0]] = float(m.group(2))
        m = re.match(r"\s+(server steps|evaluations)\s+(\d+) x ([0-9.]+) s = ([0-9.]+) s",
                     line)
        if m:
            key = m.group(1).split()[0]
            b[key], b[f"{key}_s"] = int(m.group(2)), float(m.group(3))
        m = re.match(r"\s+version ring\s+([0-9.]+) MB: (\d+) model versions x (\d+) replicas",
                     line)
        if m:
            b["ring"] = (float(m.group(1)), int(m.group(2)), int(m.group(3)))
        if line.strip().startswith("virtual stop"):
            b["stop"] = line
    return b


def test_estimate_of_the_synthetic_fedbuff_flagfile(tmp_path, capsys):
    """--estimate on async_synthetic_fedbuff.flags (one seed, 4 server steps, a virtual stop):
    one block over 4 server steps that adds up, the ring of V = C + K = 30 versions of the
    linear model (60 features x 10 classes and the bias, float32), the note that the virtual
    stop may end the run earlier; nothing written."""
    out = tmp_path / "run"
    code, err, stdout = run_runner(
        [f"--flagfile={FLAGFILE}", f"--output_dir={out}", "--seeds=1", "--num_rounds=4",
         "--eval_every=2", "--estimate", "--estimate_rounds=2", "--stop_at_virtual_time=30"],
        capsys)
    assert code == 0, err
    b = _block(stdout)
    assert b["name"] == "fedbuff" and b["header_steps"] == 4 and b["server"] == 4
    assert b["evaluations"] == 2
    parts = b["build"] + b["compile"] + 4 * b["server_s"] + 2 * b["evaluations_s"]
    assert b["projected"] == pytest.approx(parts, abs=5e-3)
    assert 0 < b["server_s"] < 60
    mb, versions, replicas = b["ring"]
    assert (versions, replicas) == (30, 1)
    assert mb == pytest.approx(30 * 4 * (60 * 10 + 10) / 2 ** 20, abs=0.051)
    assert "--stop_at_virtual_time=30 s may end the run before its 4 server steps" in b["stop"]
    assert not out.exists()


@pytest.mark.slow
def test_estimate_of_a_fedasync_run_on_the_tiny_flagfile(tmp_path, capsys):
    """FedAsync (K = 1) with --max_staleness=2: the ring of min(S + 2, C + K) = 4 versions of
    each of the 2 seeds' replicas; the timed steps are the run's own step (its metrics reach
    the recorder, so the evaluation's records have their K)."""
    out = tmp_path / "run"
    code, err, stdout = run_runner(
        [f"--flagfile={TINY}", f"--output_dir={out}", "--algorithm=fedasync", "--thetas=1",
         "--concurrency=4", "--max_staleness=2", "--estimate", "--estimate_rounds=2"], capsys)
    assert code == 0, err
    b = _block(stdout)
    assert b["name"] == "fedasync" and b["server"] == 6 and b["ring"][1:] == (4, 2)
    assert "stop" not in b
    assert not out.exists()
