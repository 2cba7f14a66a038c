"""The report's figure of the test error against virtual time (runs on the virtual clock,
``--client_speed``: :mod:`deltafl_jax.sampling.timeline`).

Each run wrote the virtual time at the end of every round and seed (rounds.npz,
``virtual_time`` [T, R]); the test error's mean and p90 at each evaluation come from the
run's curves (:meth:`deltafl_jax.report.io.Run.curves`). The seeds of a method reach an
evaluation at different virtual times, so each seed's curve is read as a step function (at
virtual time x: its last evaluation at or before x) on the union of the seeds' evaluation
times, from the latest first evaluation to the earliest last one; the line is the mean over
seeds there and the band the min/max.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.report.figures import (error_limits, figure_title, legend_below,
                                        legend_layout, method_styles, new_figure,
                                        percent_axis)
from deltafl_jax.report.tables import Column

CLOCK_PANELS = (("test_error_mean", "test error (%): mean"),
                ("test_error_p90", "test error (%): p90"))
TIME = "virtual_time"


def seed_curves(col: Column, metric: str, percentile: str = "lower"):
    """[(times [E], values [E])] per seed of the column: the virtual time (seconds) at each
    evaluation and `metric` there; None when a run of the column has no clock or no curves."""
    out = []
    for run, reps in col.parts:
        curves = run.curves(percentile)
        if run.rounds is None or TIME not in run.rounds or curves is None or \
                metric not in curves[1]:
            return None
        rounds, values = curves
        clock = np.asarray(run.rounds[TIME], np.float64)
        if len(rounds) == 0 or int(np.max(rounds)) > clock.shape[0]:
            return None
        at = np.asarray(rounds, np.int64) - 1
        for r in reps:
            out.append((clock[at, r], np.asarray(values[metric], np.float64)[:, r]))
    return out


def on_common_times(curves) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray,
                                              np.ndarray]]:
    """(times [K], mean [K], min [K], max [K]) of the seeds' step functions on the union of
    their evaluation times within the span every seed covers; None when that span is
    empty."""
    lo = max(float(t[0]) for t, _ in curves)
    hi = min(float(t[-1]) for t, _ in curves)
    grid = np.unique(np.concatenate([t for t, _ in curves]))
    grid = grid[(grid >= lo) & (grid <= hi)]
    if grid.size == 0:
        return None
    v = np.stack([vals[np.searchsorted(t, grid, side="right") - 1] for t, vals in curves])
    return grid, v.mean(axis=0), v.min(axis=0), v.max(axis=0)


def clock_data(col: Column, metric: str, percentile: str = "lower"):
    """(virtual times [K] seconds, mean [K], min [K], max [K]) of `metric`, or None."""
    curves = seed_curves(col, metric, percentile)
    return None if not curves else on_common_times(curves)


def virtual_time_figure(cols: Sequence[Column], percentile: str = "lower"):
    """The test error's mean and p90 against virtual time (hours), a line per method in its
    style (mean over seeds, band min/max); None when no column's runs have the clock."""
    got = {c.label: [clock_data(c, m, percentile) for m, _ in CLOCK_PANELS] for c in cols}
    if all(g is None for gs in got.values() for g in gs):
        return None
    styles = method_styles([c.label for c in cols])
    fig, axes = new_figure(1, len(CLOCK_PANELS), 10.5,
                           3.7 + legend_layout([c.label for c in cols], 10.5)[1], sharex=True)
    for k, ((metric, title), ax) in enumerate(zip(CLOCK_PANELS, axes[0])):
        for c in cols:
            data = got[c.label][k]
            if data is None:
                continue
            times, mean, lo, hi = data
            st = styles[c.label]
            hours = times / 3600.0
            ax.step(hours, mean, where="post", color=st.color, linestyle=st.linestyle,
                    label=c.label)
            ax.fill_between(hours, lo, hi, step="post", color=st.color, alpha=0.15,
                            linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("virtual time (hours)")
        ax.grid(alpha=0.3)
        percent_axis(ax.yaxis)
        error_limits(ax)
    legend_below(fig, *axes[0][0].get_legend_handles_labels())
    figure_title(fig, f"{cols[0].setting}: test error against virtual time ({percentile} "
                 f"percentiles; each seed's last evaluation so far; band: min/max over seeds)",
                 fontsize=10)
    return fig
