"""The report's figures (matplotlib, headless; every function returns the Figure).

Fig. 4 and Figs. 12-13: histograms of the per-client final test error and train loss; Fig. 5
and Figs. 14-15: per-client values against client size; Figs. 6-11: the train-loss and
test-error mean and p90 over rounds; Fig. 16: clients kept per round. The ``*_data``
functions give the plotted arrays, for re-plotting and for tests.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from deltafl_jax.report.tables import Column

HISTOGRAM_BINS = 20        # bins of width 5 % on [0, 1] for errors


def new_figure(nrows: int, ncols: int, width: float, height: float, **kw):
    """A Figure (not bound to pyplot) and its axes grid [nrows][ncols]."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def colors(n: int):
    """n colours of the tab10 cycle."""
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def histogram_data(col: Column, split: str = "test", quantity: str = "error"):
    """(values [N], weights [N]) of the histogram: each client's final value averaged over
    seeds; weights 1/N on the test clients (bars are fractions of clients) and alpha_k on the
    training clients (bars are alpha-weighted fractions), the tables' conventions."""
    sizes, v = col.client_means(split, quantity)
    if split == "train":
        return v, sizes / sizes.sum()
    return v, np.full(v.shape, 1.0 / v.size)


def histogram_figure(cols: Sequence[Column], split: str = "test", quantity: str = "error",
                     percentile: str = "lower"):
    """Fig. 4 (Figs. 12-13): one panel per method, shared bins (5 % wide on [0, 1] for errors),
    bars = fraction of clients (alpha-weighted for training clients, see
    :func:`histogram_data`); the dashed line is the method's 90th percentile as in the tables
    (mean over seeds of each seed's percentile)."""
    n = len(cols)
    fig, axes = new_figure(1, n, 2.6 * n + 0.6, 2.8, sharex=True, sharey=True)
    data = [histogram_data(c, split, quantity) for c in cols]
    if quantity == "error":
        # k / 20 correctly rounded, so that an error such as 3/20 = 6/40 lands in the bin it
        # starts whatever its client's size.
        bins = np.arange(HISTOGRAM_BINS + 1) / HISTOGRAM_BINS
    else:
        finite = np.concatenate([v[np.isfinite(v)] for v, _ in data] + [np.zeros(1)])
        bins = np.linspace(0.0, max(float(finite.max()), 1e-12), HISTOGRAM_BINS + 1)
    metric = f"{split}_{quantity}_p90"
    for ax, c, (v, w), color in zip(axes[0], cols, data, colors(n)):
        ok = np.isfinite(v)        # a diverged client is left out (its mass is missing)
        ax.hist(v[ok], bins=bins, weights=w[ok], color=color, edgecolor="white", linewidth=0.5)
        p90 = float(np.mean(c.values(metric, percentile)))
        if math.isfinite(p90):
            ax.axvline(p90, color="black", linestyle="--", linewidth=1.0,
                       label=f"p90 (table) = {p90:.3f}")
            ax.legend(loc="upper right", fontsize=7, frameon=False)
        ax.set_title(c.label, fontsize=9)
        ax.set_xlabel(f"{split} {'misclassification error' if quantity == 'error' else 'loss'}")
    axes[0][0].set_ylabel("fraction of clients" + (" (α-weighted)" if split == "train" else ""))
    what = "test misclassification error" if (split, quantity) == ("test", "error") else \
        f"{split} {quantity}"
    fig.suptitle(f"{cols[0].setting}: {what} per client (final model, mean over seeds)",
                 fontsize=10)
    return fig


def scatter_figure(cols: Sequence[Column]):
    """Fig. 5 (Figs. 14-15): top row, train loss of each training client against its number of
    examples; bottom row, test error of each test client against its number of examples. One
    column of panels per method; values averaged over seeds."""
    n = len(cols)
    fig, axes = new_figure(2, n, 2.6 * n + 0.6, 5.0, sharex="row", sharey="row")
    for j, (c, color) in enumerate(zip(cols, colors(n))):
        for i, (split, quantity, name) in enumerate((("train", "loss", "train loss"),
                                                     ("test", "error", "test error"))):
            sizes, v = c.client_means(split, quantity)
            ax = axes[i][j]
            ax.scatter(sizes, v, s=8, color=color, alpha=0.7, linewidths=0)
            ax.set_xscale("log")
            ax.set_xlabel(f"examples on the {split} client")
            if j == 0:
                ax.set_ylabel(name)
        axes[0][j].set_title(c.label, fontsize=9)
    fig.suptitle(f"{cols[0].setting}: per-client final values against client size "
                 f"(mean over seeds)", fontsize=10)
    return fig


CURVE_PANELS = (("train_loss_mean", "train loss: mean"), ("train_loss_p90", "train loss: p90"),
                ("test_error_mean", "test error: mean"), ("test_error_p90", "test error: p90"))


def curve_data(col: Column, metric: str, percentile: str = "lower"):
    """(rounds [E], mean over seeds [E], min [E], max [E]) of `metric`, or None (also when
    the column's runs were evaluated at different rounds)."""
    rounds, parts = None, []
    for run, reps in col.parts:
        got = run.curves(percentile)
        if got is None or metric not in got[1]:
            return None
        if rounds is not None and not np.array_equal(rounds, got[0]):
            return None
        rounds = got[0]
        parts.append(np.asarray(got[1][metric])[:, reps])
    v = np.concatenate(parts, axis=1)
    return rounds, v.mean(axis=1), v.min(axis=1), v.max(axis=1)


def curves_figure(cols: Sequence[Column], percentile: str = "lower"):
    """Figs. 6-11: train-loss mean and p90, test-error mean and p90 over rounds; a line per
    method (mean over seeds) with a min/max band over seeds."""
    fig, axes = new_figure(2, 2, 9.0, 6.0, sharex=True)
    for (metric, title), ax in zip(CURVE_PANELS, axes.ravel()):
        for c, color in zip(cols, colors(len(cols))):
            got = curve_data(c, metric, percentile)
            if got is None:
                continue
            rounds, mean, lo, hi = got
            ax.plot(rounds, mean, color=color, label=c.label, marker="." if len(rounds) < 30
                    else None)
            ax.fill_between(rounds, lo, hi, color=color, alpha=0.15, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("communication round")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{cols[0].setting}: performance across rounds ({percentile} percentiles; "
                 f"band: min/max over seeds)", fontsize=10)
    return fig


def kept_data(col: Column):
    """(rounds 1..T, mean [T], min [T], max [T]) of the clients kept per round, or None."""
    parts = []
    for run, reps in col.parts:
        if run.rounds is None:
            return None
        parts.append(np.asarray(run.rounds["num_selected"], np.float64)[:, reps])
    if len({p.shape[0] for p in parts}) != 1:
        return None
    v = np.concatenate(parts, axis=1)
    return np.arange(1, v.shape[0] + 1), v.mean(axis=1), v.min(axis=1), v.max(axis=1)


def kept_figure(cols: Sequence[Column]):
    """Fig. 16: clients kept per round after the filter, mean over seeds, band = min/max."""
    fig, axes = new_figure(1, 1, 8.5, 3.6)
    ax = axes[0][0]
    for c, color in zip(cols, colors(len(cols))):
        got = kept_data(c)
        if got is None:
            continue
        rounds, mean, lo, hi = got
        ax.plot(rounds, mean, color=color, label=c.label, linewidth=1.0)
        ax.fill_between(rounds, lo, hi, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("communication round")
    ax.set_ylabel("clients kept")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{cols[0].setting}: clients kept per round (band: min/max over seeds)",
                 fontsize=10)
    return fig
