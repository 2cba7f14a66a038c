"""The report's figures (matplotlib, headless; every function returns the Figure).

Fig. 4 and Figs. 12-13: histograms of the per-client final test error and train loss; Fig. 5
and Figs. 14-15: per-client values against client size; Figs. 6-11: the train-loss and
test-error mean and p90 over rounds; Fig. 16: clients kept per round. The ``*_data``
functions give the plotted arrays, for re-plotting and for tests; errors are fractions there,
and the axes show them in percent, as the tables do (:func:`percent_axis`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from deltafl_jax.eval_sample import lower_rank
from deltafl_jax.metrics import percentiles
from deltafl_jax.report.tables import Column

HISTOGRAM_BINS = 20        # bins of width 5 % on [0, 1] for errors


def new_figure(nrows: int, ncols: int, width: float, height: float, **kw):
    """A Figure (not bound to pyplot) and its axes grid [nrows][ncols]."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def percent_text(v: float) -> str:
    """A fraction as the tables print a percentage: 0.5711 -> '57.11'."""
    return f"{100.0 * v:.2f}"


def percent_axis(axis) -> None:
    """Tick labels of a matplotlib x or y axis that holds fractions, in percent (0.25 -> 25)."""
    from matplotlib.ticker import FuncFormatter
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{100.0 * v:.4g}"))


def log_size_axis(axis) -> None:
    """A log axis of client sizes with plain labels at 1, 2 and 5 times the powers of ten
    (at most about six of them) and none at the minor ticks, so that labels do not overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0), numticks=6))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def colors(n: int):
    """n colours of the tab10 cycle."""
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def histogram_data(col: Column, split: str = "test", quantity: str = "error"):
    """(values [N], weights [N]) of the histogram: each client's final value averaged over
    seeds; weights 1/N on the test clients (bars are fractions of clients) and alpha_k on the
    training clients (bars are alpha-weighted fractions), the tables' conventions. A run that
    evaluated a sample of clients gives its sampled clients, each weighing 1/K (the training
    draws were made with probability alpha_k: :meth:`Column.client_weights`)."""
    _, v = col.client_means(split, quantity)
    return v, col.client_weights(split)


def bars_p90(values, weights, percentile: str, sampled: bool) -> float:
    """The 90th percentile of the bars: the lower weighted quantile (or NumPy's linear one);
    for one run's sample (equal weights), the ceil(0.9 K)-th smallest value, as
    :func:`deltafl_jax.eval_sample.summarize_sample` takes it."""
    if sampled and percentile == "lower":
        return float(np.sort(values)[lower_rank(values.size, 90) - 1])
    return float(percentiles(values[None], None if percentile == "linear" else weights, [90],
                             percentile)[0, 0])


def mark_p90(ax, values, weights, table_p90: float, percentile: str, percent: bool,
             sampled: bool = False) -> None:
    """The dashed line at the 90th percentile of the plotted bars (seed-averaged values, the
    bars' weights), labelled along the line; the table's value (the mean over seeds of each
    seed's percentile) is named beside it when it prints differently."""
    if values.size == 0:
        return
    p90 = bars_p90(values, weights, percentile, sampled)
    show = percent_text if percent else (lambda x: f"{x:.3f}")
    text = f" p90 = {show(p90)}"
    if math.isfinite(table_p90) and show(table_p90) != show(p90):
        text += f" (table: {show(table_p90)})"
    ax.axvline(p90, color="black", linestyle="--", linewidth=1.0)
    ax.text(p90, 0.98, text, transform=ax.get_xaxis_transform(), rotation=90, ha="right",
            va="top", fontsize=7,
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.7, pad=0.5))


def histogram_figure(cols: Sequence[Column], split: str = "test", quantity: str = "error",
                     percentile: str = "lower"):
    """Fig. 4 (Figs. 12-13): one panel per method, shared bins (5 % wide on [0, 1] for errors),
    bars = fraction of clients (alpha-weighted for training clients, see
    :func:`histogram_data`); the dashed line is the 90th percentile of the bars, with the
    tables' value (mean over seeds of each seed's percentile) beside it where it differs
    (:func:`mark_p90`)."""
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
        mark_p90(ax, v[ok], w[ok], float(np.mean(c.values(metric, percentile))), percentile,
                 quantity == "error", sampled=c.sampled and len(c.parts) == 1 and ok.all())
        ax.set_title(c.label, fontsize=9)
        if quantity == "error":
            percent_axis(ax.xaxis)
            ax.set_xlabel(f"{split} misclassification error (%)")
        else:
            ax.set_xlabel(f"{split} loss")
    axes[0][0].set_ylabel("fraction of clients" + (" (α-weighted)" if split == "train" else ""))
    what = "test misclassification error" if (split, quantity) == ("test", "error") else \
        f"{split} {quantity}"
    fig.suptitle(f"{cols[0].setting}: {what} per client (final model, mean over seeds)"
                 f"{sample_note(cols)}", fontsize=10)
    return fig


def sample_note(cols: Sequence[Column]) -> str:
    """A second title line, 'the clients of the evaluation's sample (K per split)', when a
    column's run evaluated a sample (``--eval_clients``), else ''."""
    sizes = sorted({run.client_indices("test").size for c in cols for run, _ in c.parts
                    if run.sampled("test")})
    if not sizes:
        return ""
    return (f"\nthe clients of the last evaluation's sample ({'/'.join(map(str, sizes))} per "
            f"split)")


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
            log_size_axis(ax.xaxis)
            ax.set_xlabel(f"examples on the {split} client")
            if quantity == "error":
                percent_axis(ax.yaxis)
            if j == 0:
                ax.set_ylabel(name + (" (%)" if quantity == "error" else ""))
        axes[0][j].set_title(c.label, fontsize=9)
    fig.suptitle(f"{cols[0].setting}: per-client final values against client size "
                 f"(mean over seeds){sample_note(cols)}", fontsize=10)
    return fig


CURVE_PANELS = (("train_loss_mean", "train loss: mean"), ("train_loss_p90", "train loss: p90"),
                ("test_error_mean", "test error (%): mean"),
                ("test_error_p90", "test error (%): p90"))


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
        if "error" in metric:
            percent_axis(ax.yaxis)
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


# --------------------------------------------------------------------------------------------
# Fig. 3: the loss over mixtures of the training distributions (the Gaussian toy)

MIXTURE_SAMPLES = 20000     # mixtures drawn uniformly from P_theta for the histogram
SIMPLEX_STEPS = 60          # grid of the simplex panel: pi = (i, j, k) / SIMPLEX_STEPS


def simplex_grid(steps: int = SIMPLEX_STEPS) -> np.ndarray:
    """[P, 3] every pi = (i, j, k) / steps with i + j + k = steps."""
    return np.array([(i, j, steps - i - j) for i in range(steps + 1)
                     for j in range(steps + 1 - i)], np.float64) / steps


def uniform_mixtures(alpha: np.ndarray, theta: float, count: int = MIXTURE_SAMPLES,
                     seed: int = 0) -> np.ndarray:
    """[count, N] mixture weights drawn uniformly from P_theta = {pi in the simplex:
    pi_k <= alpha_k / theta} (the mixtures of conformity >= theta, Definition 1): uniform
    draws on the simplex (Dirichlet(1, ..., 1)) kept when they satisfy the caps."""
    rng = np.random.default_rng(seed)
    caps = np.asarray(alpha, np.float64) / theta
    kept, total = [], 0
    for _ in range(1000):
        pi = rng.dirichlet(np.ones(len(caps)), size=4 * count)
        pi = pi[np.all(pi <= caps, axis=1)]
        kept.append(pi)
        total += len(pi)
        if total >= count:
            break
    return np.concatenate(kept)[:count]


def mixture_data(cols: Sequence[Column]):
    """(alpha [N], theta, {label: F_k(w) [N], mean over seeds}) of a Gaussian-toy setting: the
    final per-client training losses, from which every mixture loss follows, F(w; p_pi) =
    sum_k pi_k F_k(w) (pi_k weights the samples of client k). theta: the smallest level < 1
    among the columns (the paper's 2/3), or 1."""
    losses = {c.label: c.client_means("train", "loss")[1] for c in cols}
    thetas = [c.run.labels[c.replicas[0]].theta for c in cols]
    below = [float(t) for t in thetas if float(t) < 1.0]
    return cols[0].client_weights("train"), min(below) if below else 1.0, losses


def conformity_polygon(caps: np.ndarray) -> np.ndarray:
    """[V, 3] the vertices, in order around it, of {pi in the 2-simplex: pi_k <= caps_k}: the
    feasible points with two coordinates at a bound (0 or their cap)."""
    caps = np.minimum(np.asarray(caps, np.float64), 1.0)
    found = []
    for k in range(3):
        i, j = [a for a in range(3) if a != k]
        for vi in (0.0, caps[i]):
            for vj in (0.0, caps[j]):
                pi = np.zeros(3)
                pi[i], pi[j], pi[k] = vi, vj, 1.0 - vi - vj
                if -1e-12 <= pi[k] <= caps[k] + 1e-12:
                    found.append(np.round(pi, 12))
    verts = np.unique(np.array(found), axis=0)
    xy = barycentric_xy(verts)
    angle = np.arctan2(*(xy - xy.mean(axis=0)).T[::-1])
    return verts[np.argsort(angle)]


def barycentric_xy(pi: np.ndarray) -> np.ndarray:
    """[P, 2] points of the triangle with corners q1 = (0, 0), q2 = (1, 0), q3 = (1/2, sqrt3/2)."""
    return np.stack([pi[:, 1] + 0.5 * pi[:, 2], (np.sqrt(3) / 2) * pi[:, 2]], axis=1)


def draw_means(ax, means, points) -> None:
    """Fig. 3, left: the means mu_k and the models w (points: {label: [2] or None})."""
    ax.scatter(means[:, 0], means[:, 1], marker="o", s=40, color="black", zorder=3)
    for k, (x, y) in enumerate(means):
        ax.annotate(f"μ{k + 1}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    closed = np.vstack([means, means[:1]])
    ax.plot(closed[:, 0], closed[:, 1], color="grey", linewidth=0.8)
    for (label, w), color in zip(points.items(), colors(len(points))):
        if w is not None:
            ax.scatter([w[0]], [w[1]], marker="*", s=120, color=color, label=label, zorder=4)
    pad = 0.35 * max(float(np.ptp(means[:, 0])), float(np.ptp(means[:, 1])), 1e-6)
    ax.set_xlim(means[:, 0].min() - pad, means[:, 0].max() + pad)
    ax.set_ylim(means[:, 1].min() - pad, means[:, 1].max() + pad)
    ax.set_aspect("equal", adjustable="datalim")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("means μ_k of the clients and the models w", fontsize=9)


def draw_simplex(ax, fig, alpha, theta, base, other, names) -> None:
    """Fig. 3, middle: F(w_theta; p_pi) - F(w_1; p_pi) over the simplex of mixtures; the
    dashed hexagon is P_theta (pi_k <= alpha_k / theta)."""
    from matplotlib.colors import TwoSlopeNorm
    pi = simplex_grid()
    diff = pi @ other - pi @ base
    xy = barycentric_xy(pi)
    bound = max(float(np.abs(diff).max()), 1e-12)
    art = ax.tripcolor(xy[:, 0], xy[:, 1], diff, cmap="coolwarm", shading="gouraud",
                       norm=TwoSlopeNorm(0.0, -bound, bound))
    fig.colorbar(art, ax=ax, shrink=0.8).set_label(
        f"F(w; p_π): {names[1]} minus {names[0]}", fontsize=8)
    edge = [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0)]
    ax.plot(*barycentric_xy(np.array(edge, float)).T, color="black", linewidth=0.8)
    if theta < 1.0:
        poly = barycentric_xy(conformity_polygon(np.asarray(alpha) / theta))
        ax.fill(poly[:, 0], poly[:, 1], fill=False, linestyle="--", linewidth=1.2,
                edgecolor="black")
    for k, (x, y) in enumerate(barycentric_xy(np.eye(3))):
        ax.annotate(f"q{k + 1}", (x, y), textcoords="offset points", xytext=(-4, 4 if k == 2
                                                                           else -10), fontsize=8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"loss of every mixture p_π of q1, q2, q3\n(dashed: conformity ≥ {theta:.3g})",
                 fontsize=9)


def draw_histogram(ax, alpha, theta, losses) -> None:
    """Fig. 3, right: histogram of F(w; p_pi) for pi uniform on P_theta, one per model; the
    dashed lines are the worst (largest) loss of each."""
    pi = uniform_mixtures(alpha, theta)
    values = {label: pi @ f for label, f in losses.items()}
    lo = min(float(v.min()) for v in values.values())
    hi = max(float(v.max()) for v in values.values())
    bins = np.linspace(lo, hi, 41)
    for (label, v), color in zip(values.items(), colors(len(values))):
        ax.hist(v, bins=bins, color=color, alpha=0.5, label=label, density=True)
        ax.axvline(float(v.max()), color=color, linestyle="--", linewidth=1.0)
    ax.set_xlabel("F(w; p_π)")
    ax.set_ylabel("density")
    ax.legend(fontsize=7)
    ax.set_title(f"mixtures of conformity ≥ {theta:.3g}, uniform\n(dashed: the worst loss)",
                 fontsize=9)


def mixture_figure(cols: Sequence[Column], means=None, points=None):
    """Fig. 3: left, the Gaussians' means and the models (when `means` is given; `points`:
    {label: w [2] or None}); middle, the loss of the θ-model minus FedAvg's over every mixture
    of three clients (barycentric triangle); right, the histogram of the mixture losses for
    mixtures drawn uniformly with conformity >= θ. Columns: the θ = 1 model first."""
    cols = sorted(cols, key=lambda c: -float(c.run.labels[c.replicas[0]].theta))
    alpha, theta, losses = mixture_data(cols)
    labels = list(losses)
    panels = (1 if means is not None else 0) + (1 if len(alpha) == 3 else 0) + 1
    fig, axes = new_figure(1, panels, 4.2 * panels, 3.8)
    axes = list(axes[0])
    if means is not None:
        draw_means(axes.pop(0), np.asarray(means, np.float64), points or {})
    if len(alpha) == 3:
        draw_simplex(axes.pop(0), fig, alpha, theta, losses[labels[0]], losses[labels[-1]],
                     (labels[0], labels[-1]))
    draw_histogram(axes.pop(0), alpha, theta, losses)
    fig.suptitle(f"{cols[0].setting}: Fig. 3, losses over mixtures of the training "
                 f"distributions (final models, mean over seeds)", fontsize=10)
    return fig
