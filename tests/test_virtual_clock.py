"""The virtual clock of synchronous rounds in a run: who the deadline and over-selection keep,
the local steps the plan trains, the clock's time in the outputs, its end of the run, its
checkpoint, and the refusals, against a NumPy reference written from FedScale's formula
(a job lasts per_example_s x examples + 2 model_bytes / bandwidth; the m first to finish by
the deadline are kept, ties by client id; a round lasts until the m-th arrival, or the
deadline when fewer arrive)."""

import json
import os

import numpy as np
import pytest

from conftest import refused_over_a_finished_run, run_runner, tiny_config
from deltafl_jax import run_experiment
from deltafl_jax.run.experiment import build_experiment
from deltafl_jax.sampling import plan as plan_lib
from deltafl_jax.sampling.samplers import Cohort, sample_clients

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "tests", "tiny.flags")


def _model_bytes(data):
    """The linear model's float32 bytes: W [d, C] and its bias [C] (counted by hand)."""
    d = int(np.prod(data.train.feature_shape))
    return 4 * (d * data.num_classes + data.num_classes)


def _examples(steps, n, B):
    """E(s): examples of a client's first s steps under --local_epochs (epochs of n cut into
    ceil(n / B) batches, the last holding what is left), one step at a time."""
    done, per = 0, -(-n // B)
    for s in range(steps):
        done += min(B, n - (s % per) * B)
    return done


def _reference_round(speeds, sizes, ids, m, B, bytes_, deadline, partial):
    """(kept ids sorted, their steps, the round's seconds, late count) of one selected set."""
    x = speeds.per_example_s(ids)
    transfer = 2.0 * bytes_ / speeds.bandwidth_Bps(ids)
    arrivals = []
    late = 0
    for i, c in enumerate(ids):
        n = int(sizes[c])
        planned = -(-n // B)            # one epoch
        full = transfer[i] + x[i] * n
        if deadline is None or full <= deadline:
            arrivals.append((full, int(c), planned))
            continue
        late += 1
        if partial:
            s = max([k for k in range(planned + 1)
                     if transfer[i] + x[i] * _examples(k, n, B) <= deadline])
            if s > 0:
                arrivals.append((transfer[i] + x[i] * _examples(s, n, B), int(c), s))
    arrivals.sort()
    kept = arrivals[:m]
    if len(kept) == m:
        seconds = kept[-1][0]
    else:
        seconds = deadline if deadline is not None else max([a[0] for a in kept], default=0.0)
    kept.sort(key=lambda a: a[1])
    return (np.array([a[1] for a in kept], np.int64), np.array([a[2] for a in kept], np.int64),
            float(seconds), late)


def _config(**kw):
    base = dict(algorithm="fedavg", thetas=(1.0,), seeds=(1, 2), clients_per_round=4,
                batch_size=8, client_speed="lognormal", over_select=1.5)
    base.update(kw)
    return tiny_config(**base)


def _deadline(exp, q=0.4):
    """A deadline that some clients miss: the q-quantile of the clients' one-epoch jobs."""
    sizes = exp.data.train.sizes
    ids = np.arange(sizes.size)
    speeds = exp.clock.speeds
    full = speeds.per_example_s(ids) * sizes + 2.0 * _model_bytes(exp.data) / \
        speeds.bandwidth_Bps(ids)
    return float(np.quantile(full, q))


@pytest.mark.parametrize("partial", [False, True])
def test_the_kept_cohorts_and_the_clock_equal_a_host_reference_over_1000_rounds(
        tiny_synthetic, partial):
    probe = build_experiment(_config(), tiny_synthetic)
    d = _deadline(probe)
    exp = build_experiment(_config(round_deadline=d, partial_work=partial), tiny_synthetic)
    N, m, M, B = tiny_synthetic.train.num_clients, 4, 6, 8
    assert exp.clock.slots == M and exp.num_sampled == m
    sizes, speeds, bytes_ = exp.data.train.sizes, exp.clock.speeds, _model_bytes(exp.data)
    now = np.zeros(2)
    late_any = cut_any = 0
    for t in range(1000):
        cohorts, steps = exp.kept_cohorts(t)
        counted = exp.count_round(t)
        for g, seed in enumerate((1, 2)):
            ids = sample_clients(seed, t, N, M)
            kept, kept_steps, seconds, late = _reference_round(speeds, sizes, ids, m, B,
                                                               bytes_, d, partial)
            k = kept.size
            np.testing.assert_array_equal(cohorts[g].clients[:k], kept)
            assert cohorts[g].present.sum() == k
            np.testing.assert_array_equal(steps[g][:k], kept_steps)
            assert np.all(steps[g][k:] == 0)
            now[g] += seconds
            assert counted["num_dropped"][g] == M - k
            assert counted["num_late"][g] == late
            late_any += late
            cut_any += int(np.sum(kept_steps < -(-sizes[kept] // B)))
        np.testing.assert_allclose(counted["virtual_time"], now, rtol=1e-12)
    assert late_any > 0                   # the deadline was missed
    assert (cut_any > 0) == partial       # and partial work kept partial jobs


def test_the_plan_trains_the_steps_the_clock_kept(tiny_synthetic):
    """With partial work, the plan's steps are the kept steps (fewer than an epoch for a late
    client) and its other streams are those of the same cohort planned without a cap."""
    probe = build_experiment(_config(), tiny_synthetic)
    exp = build_experiment(_config(round_deadline=_deadline(probe, 0.6), partial_work=True),
                           tiny_synthetic)
    capped = 0
    for t in range(30):
        cohorts, steps = exp.kept_cohorts(t)
        exp.count_round(t)
        got = plan_lib.make_round_plan(exp.seeds, t, exp.data.train.offsets, 4, exp.run.work,
                                       exp.program.caps, cohorts=cohorts, steps=steps)
        free = plan_lib.make_round_plan(exp.seeds, t, exp.data.train.offsets, 4, exp.run.work,
                                        exp.program.caps, cohorts=cohorts)
        np.testing.assert_array_equal(got.steps, steps)
        for name in ("clients", "sizes", "train_idx", "train_start", "seg_len", "eval_idx"):
            np.testing.assert_array_equal(getattr(got, name), getattr(free, name))
        capped += int(np.sum(got.steps < free.steps))
    assert capped > 0


def test_make_round_plan_caps_steps_per_slot():
    """A hand case: clients of 10 and 25 examples, B = 4, one epoch: 3 and 7 steps; a cap of
    (2, 9) leaves (2, 7)."""
    offsets = np.array([0, 10, 35])
    work = plan_lib.LocalWork(batch_size=4)
    caps = plan_lib.capacities(np.diff(offsets), 2, work, 4)
    cohort = Cohort(np.array([0, 1], np.int32), np.array([True, True]), np.ones(2))
    plan = plan_lib.make_round_plan((1,), 0, offsets, 2, work, caps, cohorts=[cohort],
                                    steps=np.array([[2, 9]]))
    np.testing.assert_array_equal(plan.steps, [[2, 7]])


def test_a_deadline_run_writes_the_clock_and_the_drops(tiny_synthetic, tmp_path):
    probe = build_experiment(_config(), tiny_synthetic)
    d = _deadline(probe)
    out = str(tmp_path / "run")
    T = 4
    run_experiment(_config(round_deadline=d, num_rounds=T, eval_every=2, output_dir=out),
                   tiny_synthetic)
    N, m, M = tiny_synthetic.train.num_clients, 4, 6
    speeds, sizes, bytes_ = probe.clock.speeds, tiny_synthetic.train.sizes, \
        _model_bytes(tiny_synthetic)
    now, selected, dropped, kept_n = np.zeros(2), np.zeros((2, N)), np.zeros((2, N)), []
    times = []
    for t in range(T):
        row = []
        for g, seed in enumerate((1, 2)):
            ids = sample_clients(seed, t, N, M)
            kept, _, seconds, _ = _reference_round(speeds, sizes, ids, m, 8, bytes_, d, False)
            now[g] += seconds
            selected[g, ids] += 1
            dropped[g, np.setdiff1d(ids, kept)] += 1
            row.append(kept.size)
        kept_n.append(row)
        times.append(now.copy())
    with np.load(os.path.join(out, "rounds.npz")) as r:
        np.testing.assert_allclose(r["virtual_time"], np.array(times), rtol=1e-12)
        np.testing.assert_array_equal(r["num_selected"], np.array(kept_n))
        np.testing.assert_array_equal(r["num_dropped"], M - np.array(kept_n))
    with np.load(os.path.join(out, "clients.npz")) as c:
        np.testing.assert_array_equal(c["train_rounds_selected"], selected)
        np.testing.assert_array_equal(c["train_rounds_dropped"], dropped)
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    for rec in recs:
        g = rec["seed"] - 1
        assert rec["virtual_time"] == pytest.approx(times[rec["round"] - 1][g], rel=1e-12)


def test_stop_at_virtual_time_ends_the_run_complete(tiny_synthetic, tmp_path):
    """The run ends at the first round after which every seed's clock is at or past the
    time, evaluated and written (summary.json says why)."""
    out = str(tmp_path / "run")
    probe = build_experiment(_config(), tiny_synthetic)
    N, M, m = tiny_synthetic.train.num_clients, 6, 4
    speeds, sizes, bytes_ = probe.clock.speeds, tiny_synthetic.train.sizes, \
        _model_bytes(tiny_synthetic)
    now, ends = np.zeros(2), []
    for t in range(20):
        for g, seed in enumerate((1, 2)):
            now[g] += _reference_round(speeds, sizes, sample_clients(seed, t, N, M), m, 8,
                                       bytes_, None, False)[2]
        ends.append(now.min())
    stop = float((ends[2] + ends[3]) / 2)   # reached after round 4
    result = run_experiment(_config(num_rounds=20, eval_every=3, output_dir=out,
                                    stop_at_virtual_time=stop), tiny_synthetic)
    assert result.rounds_done == 4 and not result.stopped
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["ended"]["round"] == 4
    assert "--stop_at_virtual_time" in summary["ended"]["reason"]
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert sorted({r["round"] for r in recs}) == [3, 4]


@pytest.mark.parametrize("args,message", [
    (["--client_speed=uniform", "--round_deadline=0"], "--round_deadline"),
    (["--client_speed=uniform", "--round_deadline=-3"], "--round_deadline"),
    (["--round_deadline=5"], "--round_deadline needs a virtual clock"),
    (["--client_speed=uniform", "--over_select=3"], "exceeds the 10 training clients"),
    (["--client_speed=uniform", "--round_deadline=5", "--algorithm=scaffold", "--thetas=1"],
     "--algorithm=scaffold needs a fixed cohort"),
    (["--client_speed=uniform", "--over_select=1.3", "--client_sampling=poisson"],
     "--over_select with --client_sampling=poisson"),
    (["--client_speed=uniform", "--round_deadline=0.001"], "no client can meet it"),
])
def test_what_the_clock_cannot_run_exits_2_with_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    code, err, _ = run_runner([f"--flagfile={TINY}", f"--output_dir={out}", *args], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists()


def test_a_deadline_no_client_can_meet_is_refused_by_the_command(tiny_synthetic, tmp_path):
    """A subprocess with --overwrite into a folder holding a finished run: one line, exit
    2, the folder byte-identical."""
    refused_over_a_finished_run(tmp_path, tiny_synthetic, "--client_speed=lognormal",
                                "--round_deadline=1e-6",
                                message="--round_deadline=1e-06: no client can meet it")


@pytest.mark.slow
def test_a_clocked_run_killed_and_rerun_is_bit_identical(tmp_path):
    """SIGKILL after a checkpoint, rerun: the same outputs, bit for bit, as a run never
    stopped (the clock and the drop counts come back from the checkpoint)."""
    from test_resume import killed_and_rerun
    out = killed_and_rerun(tmp_path, "--algorithm=fedavg", "--thetas=1",
                           "--client_speed=lognormal", "--round_deadline=3", "--partial_work",
                           "--over_select=1.3")
    with np.load(os.path.join(out, "rounds.npz")) as r:
        assert r["num_dropped"].sum() > 0 and np.all(np.diff(r["virtual_time"], axis=0) > 0)


def test_seed_curves_on_common_times_are_step_functions():
    """Two seeds evaluated at their own virtual times (hand case): on the union of the times
    both cover, each seed holds its last evaluation."""
    from deltafl_jax.report.virtual_time import on_common_times
    a = (np.array([10.0, 20.0, 30.0]), np.array([0.9, 0.6, 0.5]))
    b = (np.array([12.0, 25.0, 28.0]), np.array([0.8, 0.7, 0.4]))
    times, mean, lo, hi = on_common_times([a, b])
    np.testing.assert_array_equal(times, [12.0, 20.0, 25.0, 28.0])
    np.testing.assert_allclose(lo, [0.8, 0.6, 0.6, 0.4])
    np.testing.assert_allclose(hi, [0.9, 0.8, 0.7, 0.6])
    np.testing.assert_allclose(mean, [0.85, 0.7, 0.65, 0.5])


def check_curve_against_the_files(col, run_dir):
    """The error against virtual time that the report draws of a run of seeds 1, 2, 4 rounds
    evaluated every 2 (a report column `col`), hand-read from the run's rounds.npz and
    metrics.jsonl: it starts at the later seed's first evaluation and ends at the earlier
    seed's last; its first point is the mean over seeds of each seed's last evaluation at or
    before that time. (tests/test_async_run.py checks a FedBuff run's curve with it too.)"""
    from deltafl_jax.report.virtual_time import clock_data
    with np.load(os.path.join(run_dir, "rounds.npz")) as r:
        clock = r["virtual_time"]
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    p90 = {(x["round"], x["seed"]): x["test_error_p90"] for x in recs}
    times, mean, _, _ = clock_data(col, "test_error_p90")
    assert times[0] == max(clock[1]) and times[-1] == min(clock[3])
    want = [p90[(2 if times[0] < clock[3, g] else 4, g + 1)] for g in range(2)]
    assert mean[0] == pytest.approx(np.mean(want), abs=1e-6)


def test_the_report_draws_the_error_against_virtual_time(tiny_synthetic, tmp_path):
    """A clocked run's report holds the figure, drawn from the run's own virtual times and
    evaluations; a run without the clock has none."""
    from deltafl_jax import report
    clocked, plain = str(tmp_path / "clocked"), str(tmp_path / "plain")
    run_experiment(_config(num_rounds=4, eval_every=2, output_dir=clocked), tiny_synthetic)
    run_experiment(tiny_config(num_rounds=2, eval_every=2, output_dir=plain), tiny_synthetic)
    (run,), _ = report.load([clocked])
    (col,) = report.columns([run])
    check_curve_against_the_files(col, clocked)
    out = report.write_report([run], str(tmp_path / "rep"))
    assert any("virtual_time_error" in f for f in out["figures"])
    (plain_run,), _ = report.load([plain])
    out = report.write_report([plain_run], str(tmp_path / "rep2"))
    assert not any("virtual_time_error" in f for f in out["figures"])


def test_the_clock_alone_changes_no_result(tiny_synthetic, tmp_path):
    """--client_speed without a deadline or over-selection only measures: the same cohorts,
    steps and models as a run without it, which writes nothing of the clock."""
    out = str(tmp_path / "run")
    # 6 of the 12 clients a round: tiny_config's round program, compiled by other tests too
    plain = run_experiment(tiny_config(num_rounds=3, eval_every=3, output_dir=out),
                           tiny_synthetic)
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert all("virtual_time" not in r for r in recs)
    with np.load(os.path.join(out, "rounds.npz")) as r:
        assert not {"virtual_time", "num_dropped", "num_late", "round_seconds"} & set(r.files)
    with np.load(os.path.join(out, "clients.npz")) as c:
        assert not {"train_rounds_selected", "train_rounds_dropped"} & set(c.files)
    clocked = run_experiment(tiny_config(num_rounds=3, eval_every=3, client_speed="lognormal"),
                             tiny_synthetic)
    for k in ("num_selected", "train_real_examples"):
        np.testing.assert_array_equal(plain.per_round[k], clocked.per_round[k], err_msg=k)
    import jax
    jax.tree.map(np.testing.assert_array_equal, plain.served, clocked.served)
    assert np.all(np.diff(clocked.per_round["virtual_time"], axis=0) > 0)
