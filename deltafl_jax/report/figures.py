"""The report's figures (matplotlib, headless; every function returns the Figure).

Fig. 4 and Figs. 12-13: histograms of the per-client final test error and train loss; Fig. 5
and Figs. 14-15: per-client values against client size; Figs. 6-11: the train-loss and
test-error mean and p90 over rounds; Fig. 16: clients kept per round. The ``*_data``
functions give the plotted arrays, for re-plotting and for tests; errors are fractions there,
and the axes show them in percent, as the tables do (:func:`percent_axis`). The personalised
evaluation (``--client_holdout``) has its own figure (:func:`personal_figure`).

Every figure takes the columns in the report's order (FedAvg first, then the registry's
order: :func:`deltafl_jax.report.tables.ordered`) and draws each method in its own style
(:func:`method_styles`: a colour of the Okabe–Ito colour-blind-safe palette, a marker and,
past the palette's eight colours, a line style), the same in every figure of a report. A
method whose values are identical to an earlier one's (Ditto's and APFL's global model are
FedAvg's) is said so in its legend entry or panel title, and its markers are offset so that
both stay visible.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.evaluation.metrics import percentiles
from deltafl_jax.evaluation.sample import lower_rank
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


SIZE_TICK_MANTISSAS = ((1.0,), (1.0, 2.0, 5.0), (1.0, 2.0, 3.0, 5.0),
                       (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0))


def size_ticks(lo: float, hi: float) -> List[float]:
    """Tick values of a log axis of client sizes on [lo, hi]: the powers of ten, or, when
    fewer than three of them fall in the range, the coarsest of 1-2-5, 1-2-3-5 and finer
    multiples that gives three, at most six of them in any case (every other one dropped)."""
    lo, hi = max(lo, 1e-12), max(hi, lo * (1 + 1e-9))
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    ticks: List[float] = []
    for subs in SIZE_TICK_MANTISSAS:
        ticks = [float(f"{m * 10.0 ** e:.6g}") for e in decades for m in subs
                 if lo <= m * 10.0 ** e <= hi]
        if len(ticks) >= 3:
            break
    while len(ticks) > 6:
        ticks = ticks[::2]
    return ticks


def log_size_axis(axis) -> None:
    """A log axis of client sizes with plain labels at :func:`size_ticks` of its current
    limits (set the limits first) and none at the minor ticks, so that labels do not
    overlap, also on a range of less than a decade (clients of 100 to 400 examples)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter
    axis.set_major_locator(FixedLocator(size_ticks(*sorted(axis.get_view_interval()))))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


# Okabe & Ito's colour-blind-safe palette (Color Universal Design, 2008), black last, without
# its yellow (#F0E442: a contrast of 1.3 against white, a line or band nearly invisible).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000")
MIN_CONTRAST = 2.0      # WCAG contrast ratio of every colour against the white background
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*", "d", "H", "8")
LINESTYLES = ("-", "--", "-.", ":")              # change each time the palette starts over
HATCHES = ("", "////", "....", "xxxx")            # bars: one per round of the palette


@dataclasses.dataclass(frozen=True)
class Style:
    """How a figure draws one method: colour, marker, line style and (bars) hatching."""
    color: str
    marker: object      # a matplotlib marker: a name, or (sides, 0 polygon / 1 star, angle)
    linestyle: str
    hatch: str


def relative_luminance(rgb) -> np.ndarray:
    """[...] WCAG 2.x relative luminance of sRGB colours [..., 3] in [0, 1]."""
    rgb = np.asarray(rgb, np.float64)
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    return lin @ np.array([0.2126, 0.7152, 0.0722])


def cielab(rgb) -> np.ndarray:
    """[..., 3] CIE L*a*b* (D65) of sRGB colours [..., 3] in [0, 1]."""
    rgb = np.asarray(rgb, np.float64)
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = lin @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                          [0.0193, 0.1192, 0.9505]]).T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]),
                     200 * (f[..., 1] - f[..., 2])], axis=-1)


@functools.lru_cache(maxsize=1)
def colour_candidates() -> np.ndarray:
    """[K, 3] sRGB colours a method past :data:`PALETTE` may take: a grid of hues, saturations
    and values, kept where the contrast against white is at least :data:`MIN_CONTRAST`."""
    from matplotlib.colors import hsv_to_rgb
    hsv = np.array([(h / 36.0, s, v) for h in range(36) for s in (0.55, 0.8, 1.0)
                    for v in (0.4, 0.6, 0.8)])
    rgb = hsv_to_rgb(hsv)
    return rgb[1.05 / (relative_luminance(rgb) + 0.05) >= MIN_CONTRAST]


_COLOURS: List[str] = list(PALETTE)


def colour(i: int) -> str:
    """The i-th method's colour: :data:`PALETTE`, then, one at a time, the candidate
    (:func:`colour_candidates`) farthest in CIELAB from every colour given so far (the
    greedy farthest-point rule), so that any count of methods gets distinct colours."""
    from matplotlib.colors import to_hex, to_rgb
    while len(_COLOURS) <= i:
        cand = colour_candidates()
        taken = cielab(np.array([to_rgb(c) for c in _COLOURS]))          # [M, 3]
        far = np.linalg.norm(cielab(cand)[:, None] - taken[None], axis=-1).min(axis=1)
        _COLOURS.append(to_hex(cand[int(np.argmax(far))]))
    return _COLOURS[i]


def marker(i: int):
    """The i-th method's marker: :data:`MARKERS`, then regular polygons and stars of 3 to 8
    sides turned by an odd multiple of 1/8, 1/16, ... of their symmetry angle 360°/sides (the
    named markers are turned by 0, 1/4, 1/2 or 3/4 of it), so every method has its own."""
    if i < len(MARKERS):
        return MARKERS[i]
    j = i - len(MARKERS)
    turn, k = j // 12, 3                 # the turn-th odd fraction of 1/8, 1/16, ...
    while turn >= 2 ** (k - 1):
        turn, k = turn - 2 ** (k - 1), k + 1
    sides = 3 + j % 6
    return (sides, (j // 6) % 2, 360.0 / sides * (2 * turn + 1) / 2 ** k)


def style(i: int) -> Style:
    """The style of the i-th method of a report (0-based, in the report's order): its own
    colour (:func:`colour`) and its own marker (:func:`marker`) for any count of methods, the
    line style and the bars' hatching changing each time the palette's colours are used up."""
    turn = i // len(PALETTE)
    return Style(colour(i), marker(i), LINESTYLES[turn % len(LINESTYLES)],
                 HATCHES[turn % len(HATCHES)])


def method_styles(labels: Sequence[str]) -> Dict[str, Style]:
    """{label: Style} of a report's methods, given in the report's order (each label once)."""
    return {label: style(i) for i, label in enumerate(dict.fromkeys(labels))}


IDENTICAL_RTOL = 1e-6    # float32 round-off: one model evaluated in programs of other sizes


def identical_to(named_arrays: Sequence[Tuple[str, Optional[np.ndarray]]]) -> Dict[str, str]:
    """{label: the first earlier label whose array is equal} (to within float32 round-off,
    :data:`IDENTICAL_RTOL`; NaN equal to NaN): the methods whose curve, histogram or points
    would hide behind an earlier one's (Ditto's and APFL's global model is FedAvg's)."""
    out: Dict[str, str] = {}
    for i, (label, a) in enumerate(named_arrays):
        if a is None:
            continue
        for other, b in named_arrays[:i]:
            if b is not None and other not in out and a.shape == b.shape and \
                    np.allclose(a, b, rtol=IDENTICAL_RTOL, atol=0.0, equal_nan=True):
                out[label] = other
                break
    return out


def wrap_label(text: str, width: int = 30) -> str:
    """`text` on lines of at most `width` characters where it can: broken at spaces, and a
    word longer than `width` after one of '_', '/', '-', ',' or ']' in it, never between two
    letters or digits ('trace_fedscale_trace' -> 'trace_fedscale_' / 'trace')."""
    pieces: List[Tuple[str, str]] = []        # (joiner to the previous piece, piece)
    for word in text.split():
        joiner = " "
        while len(word) > width:
            cuts = [m.end() for m in re.finditer(r"[_/\-,\]]", word[:width])]
            if not cuts:
                break
            pieces.append((joiner, word[:cuts[-1]]))
            word, joiner = word[cuts[-1]:], ""
        pieces.append((joiner, word))
    lines: List[str] = []
    for joiner, piece in pieces:
        if lines and len(lines[-1]) + len(joiner) + len(piece) <= width:
            lines[-1] += joiner + piece
        else:
            lines.append(piece)
    return "\n".join(lines)


def figure_title(fig, text: str, fontsize: float = 10.0) -> None:
    """The figure's suptitle, each line wrapped (:func:`wrap_label`) to the characters its
    width holds at `fontsize`, so that a title never runs past the figure's edges."""
    width = max(20, int(fig.get_size_inches()[0] * 72.0 / (0.56 * fontsize)) - 2)
    fig.suptitle("\n".join(wrap_label(line, width) for line in text.split("\n")),
                 fontsize=fontsize)


def title_text(label: str, same_as: Optional[str] = None, width: int = 30) -> str:
    """A panel title: the method's label wrapped to `width` characters (:func:`wrap_label`),
    then '(identical to X)' when its values are those of an earlier method."""
    text = wrap_label(label, width)
    return text + ("\n" + wrap_label(f"(identical to {same_as})", width) if same_as else "")


def panel_grid(n: int, max_cols: int = 4) -> Tuple[int, int]:
    """(rows, columns) of a grid of n panels, at most `max_cols` wide."""
    cols = max(1, min(n, max_cols))
    return math.ceil(n / cols), cols


# Methods per figure file of the per-method grids: fig4/12 at most 4 rows of 4 panels (10.8 in,
# 1,190 px at the report's 110 dpi), fig5 at most 2 rows of method pairs of panels (9.8 in);
# a setting with more methods gets several pages (:func:`pages`).
PAGE_METHODS = {"histogram": 16, "scatter": 8}


def pages(items: Sequence, per_page: int) -> List[List]:
    """`items` cut into pages of at most `per_page`, as equal as the count allows."""
    items = list(items)
    count = max(1, math.ceil(len(items) / per_page))
    size = math.ceil(len(items) / count)
    return [items[k:k + size] for k in range(0, len(items), size)] or [[]]


LEGEND_CHAR_IN = 0.06     # about the width of a character of the legends' 7-point font
LEGEND_ROW_IN = 0.17      # and the height of one of their rows, in inches


def legend_layout(labels: Sequence[str], width: float) -> Tuple[int, float]:
    """(columns, height in inches) of a legend of `labels` below the axes of a figure `width`
    inches wide: as many columns of the longest label as fit, so that the axes keep their
    width whatever the count and length of the methods' labels."""
    longest = max([len(line) for t in labels for line in t.split("\n")] or [1])
    ncols = max(1, min(len(labels), int((width - 0.3) // (LEGEND_CHAR_IN * longest + 0.6))))
    return ncols, LEGEND_ROW_IN * math.ceil(len(labels) / ncols) + 0.2


def legend_below(fig, handles, labels) -> None:
    """The figure's legend below its axes, in :func:`legend_layout`'s columns (a figure made
    with that layout's height added)."""
    if handles:
        ncols, _ = legend_layout(labels, fig.get_size_inches()[0])
        fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncols=ncols)


def error_limits(ax) -> None:
    """The y range of an axis of errors (fractions) kept to [0, 1] and a margin of 5% of the
    range above 1 when the data lie in [0, 1]: matplotlib widens a flat line of zeros to
    [-0.05, 0.05], an error below 0 that no run can have (and a flat line of ones to
    [0.95, 1.05]). The 'error' of a dataset without classes (any value) is left as drawn."""
    lo, hi = ax.get_ylim()
    data = ax.dataLim
    if not (np.isfinite([data.y0, data.y1]).all() and 0.0 <= data.y0 and data.y1 <= 1.0):
        return
    lo = max(lo, 0.0)
    hi = min(hi, 1.0 + 0.05 * (1.0 - lo))
    ax.set_ylim(lo, hi if hi > lo else lo + 0.05)


ROUND_AXIS = "communication round"
STEP_AXIS = "server step (one aggregation of a buffer of updates)"


def round_axis(col: Column) -> str:
    """What the rounds of a column's runs count: :data:`STEP_AXIS` for an asynchronous method
    (FedBuff, FedAsync: a round is a server step, one aggregation of K updates computed on
    older models), else :data:`ROUND_AXIS` (a synchronous round of a cohort)."""
    return STEP_AXIS if asynchronous(col.run.labels[col.replicas[0]].algorithm) else ROUND_AXIS


def asynchronous(algorithm: str) -> bool:
    """Whether the registry's `algorithm` aggregates asynchronously (its spec's
    ``asynchronous`` server step); False for an algorithm that is not registered."""
    from deltafl_jax.algorithms import registry
    spec = registry.find(algorithm)
    return spec is not None and spec.asynchronous is not None


def histogram_data(col: Column, split: str = "test", quantity: str = "error"):
    """(values [N], weights [N]) of the histogram: each client's final value averaged over
    seeds; weights 1/N on the test clients (bars are fractions of clients) and alpha_k on the
    training clients (bars are alpha-weighted fractions), the tables' conventions. A run that
    evaluated a sample of clients gives its sampled clients, each weighing 1/K (the training
    draws were made with probability alpha_k: :meth:`Column.client_weights`)."""
    _, v = col.client_means(split, quantity)
    return v, col.client_weights(split)


def bars_p90(values, weights, percentile: str, sampled: bool) -> float:
    """The 90th percentile of the bars' values: the lower weighted quantile (or NumPy's linear
    one); for one run's sample (equal weights), the ceil(0.9 K)-th smallest value, as
    :func:`deltafl_jax.evaluation.sample.summarize_sample` takes it. It is not the table's p90 when
    there are several seeds: the bars are each client's value averaged over the seeds, the
    table's p90 the mean over the seeds of each seed's p90 (:func:`table_p90`)."""
    if sampled and percentile == "lower":
        return float(np.sort(values)[lower_rank(values.size, 90) - 1])
    return float(percentiles(values[None], None if percentile == "linear" else weights, [90],
                             percentile)[0, 0])


def table_p90(col: Column, split: str, quantity: str, percentile: str = "lower") -> float:
    """The report's table cell of the column's 90th percentile (`split`_`quantity`_p90): the
    mean over the seeds of each seed's percentile, in the metric's unit (fractions)."""
    return float(np.mean(col.values(f"{split}_{quantity}_p90", percentile)))


def mark_p90(ax, table_value: float, percent: bool) -> None:
    """The dashed line at the table's 90th percentile (:func:`table_p90`, the number its cell
    prints), labelled 'p90 = ...' along the line as the table prints it (in % for errors);
    nothing when it is not finite (a diverged seed)."""
    if not math.isfinite(table_value):
        return
    from matplotlib import patheffects
    show = percent_text if percent else (lambda x: f"{x:.3f}")
    ax.axvline(table_value, color="black", linestyle="--", linewidth=1.0,
               path_effects=[patheffects.withStroke(linewidth=2.5, foreground="white")])
    ax.text(table_value, 0.98, f" p90 = {show(table_value)}", transform=ax.get_xaxis_transform(),
            rotation=90, ha="right", va="top", fontsize=7,
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.7, pad=0.5))


def histogram_bins(data, quantity: str) -> np.ndarray:
    """The shared bins: 20 of width 5 % on [0, 1] for errors (k / 20 correctly rounded, so
    that an error such as 3/20 = 6/40 lands in the bin it starts whatever its client's size),
    else 20 on [0, the largest finite value]."""
    if quantity == "error":
        return np.arange(HISTOGRAM_BINS + 1) / HISTOGRAM_BINS
    finite = np.concatenate([v[np.isfinite(v)] for v, _ in data] + [np.zeros(1)])
    return np.linspace(0.0, max(float(finite.max()), 1e-12), HISTOGRAM_BINS + 1)


def histogram_figure(cols: Sequence[Column], split: str = "test", quantity: str = "error",
                     percentile: str = "lower", styles: Optional[Dict[str, Style]] = None):
    """Fig. 4 (Figs. 12-13): one panel per method in a grid of at most four columns, in the
    report's order, shared bins (:func:`histogram_bins`), bars = fraction of clients
    (alpha-weighted for training clients, see :func:`histogram_data`) in the method's colour;
    the dashed line is the table's 90th percentile (:func:`mark_p90`). A method whose values
    equal an earlier one's says so in its title. `styles`: the report's, when `cols` is a
    page of a setting's methods (:func:`pages`)."""
    n = len(cols)
    rows, ncols = panel_grid(n)
    fig, axes = new_figure(rows, ncols, 2.9 * ncols + 0.5, 2.5 * rows + 0.8, sharex=True,
                           sharey=True)
    data = [histogram_data(c, split, quantity) for c in cols]
    bins = histogram_bins(data, quantity)
    styles = styles or method_styles([c.label for c in cols])
    same = identical_to([(c.label, v) for c, (v, _) in zip(cols, data)])
    for i, (c, (v, w)) in enumerate(zip(cols, data)):
        ax = axes[i // ncols][i % ncols]
        ok = np.isfinite(v)        # a diverged client is left out (its mass is missing)
        ax.hist(v[ok], bins=bins, weights=w[ok], color=styles[c.label].color,
                hatch=styles[c.label].hatch, edgecolor="white", linewidth=0.5)
        mark_p90(ax, table_p90(c, split, quantity, percentile), quantity == "error")
        ax.set_title(title_text(c.label, same.get(c.label)), fontsize=9)
        if quantity == "error":
            percent_axis(ax.xaxis)
        if i + ncols >= n:          # the lowest panel of its grid column
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel(f"{split} misclassification error (%)" if quantity == "error"
                          else f"{split} loss", fontsize=8)
    for i in range(n, rows * ncols):
        axes[i // ncols][i % ncols].set_visible(False)
    for r in range(rows):
        axes[r][0].set_ylabel("fraction of clients" + (" (α-weighted)" if split == "train"
                                                       else ""), fontsize=8)
    what = "test misclassification error" if (split, quantity) == ("test", "error") else \
        f"{split} {quantity}"
    figure_title(fig, f"{cols[0].setting}: {what} per client (final model, mean over seeds; "
                 f"dashed: the table's p90){sample_note(cols)}", fontsize=10)
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


SCATTER_ROWS = (("train", "loss", "train loss"), ("test", "error", "test error"))


def scatter_figure(cols: Sequence[Column], styles: Optional[Dict[str, Style]] = None):
    """Fig. 5 (Figs. 14-15): per method, a train-loss panel (each training client's loss
    against its number of examples) above a test-error panel (each test client's error); the
    methods in a grid of at most four columns, in the report's order and colours; values
    averaged over seeds. Panels of one quantity share their axes' limits; `styles` as
    :func:`histogram_figure`'s."""
    n = len(cols)
    grid_rows, ncols = panel_grid(n)
    fig, axes = new_figure(2 * grid_rows, ncols, 2.9 * ncols + 0.6, 4.6 * grid_rows + 0.6)
    styles = styles or method_styles([c.label for c in cols])
    drawn: Dict[int, List] = {0: [], 1: []}
    for j, c in enumerate(cols):
        for i, (split, quantity, name) in enumerate(SCATTER_ROWS):
            sizes, v = c.client_means(split, quantity)
            ax = axes[2 * (j // ncols) + i][j % ncols]
            st = styles[c.label]
            ax.scatter(sizes, v, s=9, color=st.color, marker=st.marker, alpha=0.7,
                       linewidths=0)
            ax.set_xscale("log")
            ax.set_xlabel(f"examples on the {split} client", fontsize=8)
            if quantity == "error":
                percent_axis(ax.yaxis)
            if j % ncols == 0:
                ax.set_ylabel(name + (" (%)" if quantity == "error" else ""), fontsize=8)
            drawn[i].append(ax)
        axes[2 * (j // ncols)][j % ncols].set_title(wrap_label(c.label, 30), fontsize=9)
    for i in (0, 1):
        share_limits(drawn[i])
    for j in range(n, grid_rows * ncols):
        for i in (0, 1):
            axes[2 * (j // ncols) + i][j % ncols].set_visible(False)
    figure_title(fig, f"{cols[0].setting}: per-client final values against client size "
                 f"(mean over seeds){sample_note(cols)}", fontsize=10)
    return fig


def share_limits(axes) -> None:
    """One x range and one y range for every axis of `axes` (the union of their data
    limits), then readable log-size ticks (:func:`log_size_axis`)."""
    if not axes:
        return
    xs = [ax.get_xlim() for ax in axes]
    ys = [ax.get_ylim() for ax in axes]
    for ax in axes:
        ax.set_xlim(min(x[0] for x in xs), max(x[1] for x in xs))
        ax.set_ylim(min(y[0] for y in ys), max(y[1] for y in ys))
        log_size_axis(ax.xaxis)


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


def curves_figure(cols: Sequence[Column], percentile: str = "lower", xlabel: str = ROUND_AXIS,
                  styles: Optional[Dict[str, Style]] = None):
    """Figs. 6-11: train-loss mean and p90, test-error mean and p90 over rounds; a line per
    method (mean over seeds, in its style) with a min/max band over seeds. A method whose four
    curves equal an earlier one's is named '(identical to X)' in the legend and drawn dashed
    with its markers offset (:func:`draw_curve`). `xlabel`: what a round counts
    (:func:`round_axis`; the columns given share it); `styles`: the report's, when `cols` is
    a part of a setting."""
    fig, axes = new_figure(2, 2, 10.5, 6.0 + legend_layout(legend_labels(cols), 10.5)[1],
                           sharex=True)
    styles = styles or method_styles([c.label for c in cols])
    got = {c.label: [curve_data(c, m, percentile) for m, _ in CURVE_PANELS] for c in cols}
    same = identical_to([(c.label, None if None in got[c.label] else
                          np.concatenate([np.concatenate([g[1], g[2], g[3]])
                                          for g in got[c.label]])) for c in cols])
    ties = {c.label: [d.label for d in cols if same.get(d.label, d.label) ==
                      same.get(c.label, c.label)] for c in cols}
    for k, ((metric, title), ax) in enumerate(zip(CURVE_PANELS, axes.ravel())):
        for c in cols:
            if got[c.label][k] is None:
                continue
            label = c.label + (f" (identical to {same[c.label]})" if c.label in same else "")
            draw_curve(ax, got[c.label][k], styles[c.label], label,
                       ties[c.label].index(c.label), len(ties[c.label]))
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if "error" in metric:
            percent_axis(ax.yaxis)
            error_limits(ax)
    for ax in axes[1]:
        ax.set_xlabel(xlabel)
    legend_below(fig, *axes[0][0].get_legend_handles_labels())
    what = "rounds" if xlabel == ROUND_AXIS else "server steps"
    figure_title(fig, f"{cols[0].setting}: performance across {what} ({percentile} percentiles; "
                 f"band: min/max over seeds)", fontsize=10)
    return fig


def legend_labels(cols: Sequence[Column]) -> List[str]:
    """The longest legend entries the columns can have (a label with '(identical to X)')."""
    longest = max([len(c.label) for c in cols] or [0])
    return [c.label + " " * (longest + 16 - len(c.label)) for c in cols]


def draw_curve(ax, got, st: Style, label: str, tie: int, ties: int) -> None:
    """One method's line (mean over seeds) and band (min/max) on `ax`. The `tie`-th of `ties`
    identical curves (0: the first) is drawn dashed when tie > 0, its markers at every
    `ties`-th evaluation starting at the `tie`-th, so that each stays visible."""
    rounds, mean, lo, hi = got
    marks = len(rounds) < 30 or ties > 1
    ax.plot(rounds, mean, color=st.color, label=label, marker=st.marker if marks else None,
            markersize=4, linestyle=(0, (4, 2 * tie)) if tie else st.linestyle,
            markevery=(tie % max(1, len(rounds)), ties) if ties > 1 else None,
            zorder=3 + tie)
    ax.fill_between(rounds, lo, hi, color=st.color, alpha=0.15, linewidth=0)


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


def kept_figure(cols: Sequence[Column], xlabel: str = ROUND_AXIS,
                styles: Optional[Dict[str, Style]] = None):
    """Fig. 16: clients kept per round after the filter (an asynchronous run: the updates
    aggregated per server step), mean over seeds, band = min/max; `xlabel` and `styles` as
    :func:`curves_figure`'s."""
    fig, axes = new_figure(1, 1, 9.5, 3.6 + legend_layout(legend_labels(cols), 9.5)[1])
    ax = axes[0][0]
    styles = styles or method_styles([c.label for c in cols])
    got = {c.label: kept_data(c) for c in cols}
    same = identical_to([(c.label, None if got[c.label] is None else got[c.label][1])
                         for c in cols])
    for c in cols:
        if got[c.label] is None:
            continue
        rounds, mean, lo, hi = got[c.label]
        st = styles[c.label]
        tie = sum(1 for d in cols[:cols.index(c)] if same.get(d.label, d.label) ==
                  same.get(c.label, c.label))
        label = c.label + (f" (identical to {same[c.label]})" if c.label in same else "")
        ax.plot(rounds, mean, color=st.color, label=label, linewidth=1.0,
                linestyle=(0, (4, 2 * tie)) if tie else st.linestyle, zorder=3 + tie)
        ax.fill_between(rounds, lo, hi, color=st.color, alpha=0.2, linewidth=0)
    ax.set_xlabel(xlabel)
    kept = "clients kept" if xlabel == ROUND_AXIS else "updates aggregated"
    ax.set_ylabel(kept)
    ax.grid(alpha=0.3)
    legend_below(fig, *ax.get_legend_handles_labels())
    per = "round" if xlabel == ROUND_AXIS else "server step"
    ax.set_title(f"{cols[0].setting}: {kept} per {per} (band: min/max over seeds)",
                 fontsize=10)
    return fig


PERSONAL_STATS = (("mean", "mean"), ("p90", "p90"), ("worst10", "worst 10%"))


def personal_families(cols: Sequence[Column]) -> List[str]:
    """The personalised evaluation's families of the columns' runs ('unseen', 'seen',
    'unseen_ft5', ...), in the order of the report's personalised tables (by adaptation
    steps, unseen devices first)."""
    from deltafl_jax.report.tables import personal_tables
    out: List[str] = []
    for spec in personal_tables(cols):
        family = spec.metric.rpartition("_error_")[0]
        if family not in out:
            out.append(family)
    return out


def family_title(family: str) -> str:
    """'unseen_ft5' -> 'unseen devices, after 5 adaptation steps'."""
    population, _, k = family.partition("_ft")
    who = "unseen devices (test clients)" if population == "unseen" else \
        "seen clients (the model served to each)"
    return f"{who}, " + (f"after {k} adaptation steps" if k else "no adaptation")


def held_out_title(families: Sequence[str]) -> str:
    """What the held-out figure shows: the error on each client's held-out examples
    (``--client_holdout``) of the model served to it (a personal one only where the method
    keeps one: Ditto, APFL), 'and after k adaptation steps' when the run fine-tuned: it is a
    personalised evaluation only when something was personalised."""
    steps = sorted({int(f.partition("_ft")[2]) for f in families if "_ft" in f})
    after = f", and after {'/'.join(map(str, steps))} adaptation steps" if steps else ""
    return f"held-out error per client (--client_holdout) of the model served{after}"


def personal_data(col: Column, family: str, percentile: str = "lower"):
    """([3] mean over seeds, [3] min, [3] max) of the family's held-out error (mean, p90,
    worst-10% mean: :data:`PERSONAL_STATS`), or None when the column's runs have none."""
    try:
        v = np.stack([col.values(f"{family}_error_{stat}", percentile)
                      for stat, _ in PERSONAL_STATS])
    except KeyError:
        return None
    return v.mean(axis=1), v.min(axis=1), v.max(axis=1)


def personal_figure(cols: Sequence[Column], percentile: str = "lower"):
    """The personalised evaluation (``--client_holdout``): one panel per family (unseen
    devices and seen clients, without and after adaptation steps), grouped bars of the
    held-out error's mean, p90 and worst-10% mean (in %) per method in its colour, the bar the
    mean over seeds, the whisker the min/max over seeds; None when no run has one."""
    families = personal_families(cols)
    if not families:
        return None
    styles = method_styles([c.label for c in cols])
    have = [c for c in cols if personal_data(c, families[0], percentile) is not None]
    rows, ncols = panel_grid(len(families), 2)
    width = 5.2 * ncols + 0.6
    fig, axes = new_figure(rows, ncols, width, 3.2 * rows + 0.9 +
                           legend_layout([c.label for c in have], width)[1], sharey=True)
    width = 0.8 / max(1, len(have))
    x = np.arange(len(PERSONAL_STATS))
    for f, family in enumerate(families):
        ax = axes[f // ncols][f % ncols]
        for j, c in enumerate(have):
            got = personal_data(c, family, percentile)
            if got is None:
                continue
            mean, lo, hi = got
            ax.bar(x - 0.4 + (j + 0.5) * width, mean, width, color=styles[c.label].color,
                   hatch=styles[c.label].hatch, edgecolor="white", linewidth=0.5,
                   yerr=np.stack([mean - lo, hi - mean]), capsize=2, label=c.label,
                   error_kw=dict(linewidth=0.8))
        ax.set_xticks(x, [name for _, name in PERSONAL_STATS])
        percent_axis(ax.yaxis)
        ax.set_title(family_title(family), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for f in range(len(families), rows * ncols):
        axes[f // ncols][f % ncols].set_visible(False)
    for r in range(rows):
        axes[r][0].set_ylabel("held-out error (%)", fontsize=8)
    legend_below(fig, *axes[0][0].get_legend_handles_labels())
    figure_title(fig, f"{cols[0].setting}: {held_out_title(families)}\n(bars: mean over seeds; "
                 f"whiskers: min/max over seeds)", fontsize=10)
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


def draw_means(ax, means, points, styles: Dict[str, Style]) -> None:
    """Fig. 3, left: the means mu_k and the models w (points: {label: [2] or None}), each in
    its method's style."""
    ax.scatter(means[:, 0], means[:, 1], marker="o", s=40, color="black", zorder=3)
    for k, (x, y) in enumerate(means):
        ax.annotate(f"μ{k + 1}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    closed = np.vstack([means, means[:1]])
    ax.plot(closed[:, 0], closed[:, 1], color="grey", linewidth=0.8)
    for label, w in points.items():
        if w is not None:
            ax.scatter([w[0]], [w[1]], marker="*", s=120, color=styles[label].color,
                       label=label, zorder=4)
    pad = 0.35 * max(float(np.ptp(means[:, 0])), float(np.ptp(means[:, 1])), 1e-6)
    ax.set_xlim(means[:, 0].min() - pad, means[:, 0].max() + pad)
    ax.set_ylim(means[:, 1].min() - pad, means[:, 1].max() + pad)
    ax.set_aspect("equal", adjustable="box")
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


def draw_histogram(ax, alpha, theta, losses, styles: Dict[str, Style]) -> None:
    """Fig. 3, right: histogram of F(w; p_pi) for pi uniform on P_theta, one per model; the
    dashed lines are the worst (largest) loss of each."""
    pi = uniform_mixtures(alpha, theta)
    values = {label: pi @ f for label, f in losses.items()}
    lo = min(float(v.min()) for v in values.values())
    hi = max(float(v.max()) for v in values.values())
    bins = np.linspace(lo, hi, 41)
    for label, v in values.items():
        color = styles[label].color
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
    styles = method_styles([c.label for c in cols])     # the report's order, as elsewhere
    cols = sorted(cols, key=lambda c: -float(c.run.labels[c.replicas[0]].theta))
    alpha, theta, losses = mixture_data(cols)
    labels = list(losses)
    panels = (1 if means is not None else 0) + (1 if len(alpha) == 3 else 0) + 1
    fig, axes = new_figure(1, panels, 4.2 * panels, 3.8)
    axes = list(axes[0])
    if means is not None:
        draw_means(axes.pop(0), np.asarray(means, np.float64), points or {}, styles)
    if len(alpha) == 3:
        draw_simplex(axes.pop(0), fig, alpha, theta, losses[labels[0]], losses[labels[-1]],
                     (labels[0], labels[-1]))
    draw_histogram(axes.pop(0), alpha, theta, losses, styles)
    figure_title(fig, f"{cols[0].setting}: Fig. 3, losses over mixtures of the training "
                 f"distributions (final models, mean over seeds)", fontsize=10)
    return fig


# --------------------------------------------------------------------------------------------
# Labels of points that do not overprint one another (the leaderboard's frontier)

LABEL_RINGS = (3.0, 9.0, 16.0, 25.0, 36.0, 50.0)    # offsets from the point, in points
LABEL_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
LEADER_FROM = 1          # from this ring on a thin line joins the label to its point


def label_candidates():
    """The offsets (points) tried for a label, nearest first: :data:`LABEL_DIRECTIONS` at each
    of :data:`LABEL_RINGS`, with the alignment that keeps the text on that side."""
    side = {1: ("left", "bottom"), -1: ("right", "top"), 0: ("center", "center")}
    for k, r in enumerate(LABEL_RINGS):
        for dx, dy in LABEL_DIRECTIONS:
            yield k, (dx * r, dy * r), side[dx][0], side[dy][1]


def place_labels(ax, items, marks, fontsize: float = 6.0) -> List[int]:
    """Annotate the points of `items` [(x, y, text, colour)] (in data coordinates) so that no
    label overlaps another, a point of `marks` [(x, y, radius in points)] or the axes' frame:
    each label takes the first free place of :func:`label_candidates` (greedy, in the order
    given: put the important ones first), joined to its point by a thin line when it sits
    farther out. Lays the figure out first and keeps that layout (its engine set to none), so
    the places hold when it is saved. Returns the indices of the items whose label found no
    place (not drawn)."""
    fig = ax.figure
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    scale = fig.dpi / 72.0
    taken = []
    for x, y, radius in marks:
        cx, cy = ax.transData.transform((x, y))
        r = radius * scale
        taken.append((cx - r, cy - r, cx + r, cy + r))
    lost = []
    for i, (x, y, text, color) in enumerate(items):
        probe = ax.text(0, 0, text, fontsize=fontsize)
        size = probe.get_window_extent(renderer)
        probe.remove()
        px, py = ax.transData.transform((x, y))
        for ring, (dx, dy), ha, va in label_candidates():
            x0 = px + dx * scale - {"left": 0.0, "center": 0.5, "right": 1.0}[ha] * size.width
            y0 = py + dy * scale - {"bottom": 0.0, "center": 0.5, "top": 1.0}[va] * size.height
            box = (x0 - 1, y0 - 1, x0 + size.width + 1, y0 + size.height + 1)
            inside = frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] and \
                box[3] <= frame.y1
            if inside and not any(box[0] < t[2] and t[0] < box[2] and box[1] < t[3] and
                                  t[1] < box[3] for t in taken):
                taken.append(box)
                ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                            fontsize=fontsize, color=color, ha=ha, va=va, annotation_clip=False,
                            arrowprops=None if ring < LEADER_FROM else dict(
                                arrowstyle="-", color=color, linewidth=0.5, shrinkA=0,
                                shrinkB=3))
                break
        else:
            lost.append(i)
    return lost
