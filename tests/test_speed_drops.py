"""Which devices the deadline drops (the report's table by compute-speed quintile, against a
NumPy hand computation from clients.npz and the clients' speeds), and the virtual clock on the
live progress bar."""

import io
import os
import types

import numpy as np
import pytest

from conftest import tiny_config
from deltafl_jax import run_experiment
from deltafl_jax.run.experiment import build_experiment


def _hand_rates(selected, dropped, x):
    """[R, 5] by hand: rank the clients by seconds per example (ties by index), client of rank
    r in fifth floor(5 r / N), and per fifth sum(dropped) / sum(selected), one client at a
    time."""
    N = len(x)
    order = sorted(range(N), key=lambda i: (x[i], i))
    fifth = {c: (5 * r) // N for r, c in enumerate(order)}
    out = np.full((len(selected), 5), np.nan)
    for r in range(len(selected)):
        for j in range(5):
            sel = sum(selected[r][c] for c in range(N) if fifth[c] == j)
            drop = sum(dropped[r][c] for c in range(N) if fifth[c] == j)
            if sel > 0:
                out[r, j] = drop / sel
    return out


def test_drop_rates_by_speed_quintile_equal_a_hand_computation():
    """Seven clients, two replicas, a tie in speed and a fifth never selected (hand case)."""
    from deltafl_jax.report.speed_drops import drop_rates, speed_quintiles
    x = np.array([0.02, 0.005, 0.01, 0.01, 0.03, 0.001, 0.008])
    selected = np.array([[4, 3, 0, 2, 5, 1, 6], [2, 2, 0, 0, 1, 3, 1]])
    dropped = np.array([[3, 0, 0, 1, 5, 0, 2], [1, 0, 0, 0, 1, 0, 1]])
    q = speed_quintiles(x)
    # ranks: 5 (0.001), 1, 6, 2, 3 (tie, lower index first), 0, 4 -> fifths 0,0,1,2,2,3,4
    np.testing.assert_array_equal(q, [3, 0, 2, 2, 4, 0, 1])
    got = drop_rates(selected, dropped, q)
    np.testing.assert_allclose(got, _hand_rates(selected, dropped, x), equal_nan=True)
    np.testing.assert_allclose(got[0], [0 / 4, 2 / 6, 1 / 2, 3 / 4, 5 / 5])
    assert np.isnan(got[1, 2]) and got[1, 0] == pytest.approx(0 / 5)


@pytest.mark.slow   # two runs and two reports: CI's second step
def test_the_report_tables_the_deadlines_drops_by_speed(tiny_synthetic, tmp_path):
    """A deadline run's report holds the drop table beside the virtual-time figure: each cell
    the seeds' mean of the hand computation from clients.npz and the run's own speeds (which
    the report rebuilds from the config); a run without the clock has no table."""
    from deltafl_jax import report
    from deltafl_jax.report.speed_drops import column_drop_rates
    base = dict(algorithm="fedavg", thetas=(1.0,), seeds=(1, 2), clients_per_round=4,
                batch_size=8, client_speed="lognormal", over_select=1.5)
    probe = build_experiment(tiny_config(**base), tiny_synthetic)
    sizes = tiny_synthetic.train.sizes
    ids = np.arange(sizes.size)
    x = probe.clock.speeds.per_example_s(ids)
    d, C = int(np.prod(tiny_synthetic.train.feature_shape)), tiny_synthetic.num_classes
    model_bytes = 4 * (d * C + C)          # the linear model's float32 W [d, C] and bias [C]
    jobs = x * sizes + 2 * model_bytes / probe.clock.speeds.bandwidth_Bps(ids)
    deadline = float(np.quantile(jobs, 0.5))   # about half the clients miss it
    out = str(tmp_path / "run")
    run_experiment(tiny_config(**base, round_deadline=deadline, num_rounds=6, eval_every=3,
                               output_dir=out), tiny_synthetic)
    with np.load(os.path.join(out, "clients.npz")) as c:
        selected, dropped = c["train_rounds_selected"], c["train_rounds_dropped"]
    assert dropped.sum() > 0
    want = _hand_rates(selected, dropped, x)
    (run,), _ = report.load([out])
    (col,) = report.columns([run])
    ms, rates = column_drop_rates(col)
    np.testing.assert_allclose(rates, want, equal_nan=True)
    order = np.argsort(x, kind="stable")
    np.testing.assert_allclose(ms[0], x[order[:-(-len(x) // 5)]].mean())   # ranks < N / 5
    written = report.write_report([run], str(tmp_path / "rep"))
    text = open(written["report"]).read()
    figure = text.index("virtual_time_error_")
    table = text.index("Drop rate by compute-speed quintile")
    assert figure < table < text.index("## Files")
    row = next(l for l in text[table:].splitlines() if l.startswith(f"| {col.label} |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:6]
    for j, cell in enumerate(cells):
        m = np.nanmean(want[:, j]) if np.any(np.isfinite(want[:, j])) else None
        assert cell == "—" if m is None else float(cell.split()[0]) == pytest.approx(
            100 * m, abs=0.051)
    plain = str(tmp_path / "plain")
    run_experiment(tiny_config(num_rounds=2, eval_every=2, output_dir=plain), tiny_synthetic)
    (plain_run,), _ = report.load([plain])
    text = open(report.write_report([plain_run], str(tmp_path / "rep2"))["report"]).read()
    assert "Drop rate by compute-speed quintile" not in text


def _context(T=10):
    from deltafl_jax.run.callbacks import RunContext
    facts = types.SimpleNamespace(classify=True, config=None)
    return RunContext(view=types.SimpleNamespace(facts=facts, labels=[]), num_rounds=T,
                      output_dir=None)


def test_the_progress_bar_shows_the_virtual_clock():
    """On the clock the live bar ends with the round's virtual time (the seeds' mean and
    range, in s below two minutes, min below two hours); a shorter bar after a longer one
    blanks what is left; without the clock the bar has no virtual time."""
    from deltafl_jax.run.progress import Progress
    stream = io.StringIO()
    progress = Progress(log=lambda s: None, stream=stream, bar=True)
    progress.on_round_end(_context(), 3, {"virtual_time": np.array([30.0, 90.0])})
    first = stream.getvalue()
    assert "round 3/10" in first and first.rstrip().endswith("virtual 60 s [30, 90]")
    progress.on_round_end(_context(), 4, {"virtual_time": np.array([600.0, 600.0])})
    second = stream.getvalue()[len(first):]
    assert second.rstrip().endswith("virtual 10 min")
    assert len(second) >= len(first) - 1     # \r then at least the previous bar's width
    stream = io.StringIO()
    Progress(log=lambda s: None, stream=stream, bar=True).on_round_end(_context(), 3, {})
    assert "round 3/10" in stream.getvalue() and "virtual" not in stream.getvalue()
