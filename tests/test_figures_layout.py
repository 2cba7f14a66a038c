"""The figures of a report over many runs and of a leaderboard with many methods, as a reader
sees them (issue 51): a distinct colour and marker per method for any count, every colour
visible on white; labels that do not overprint (the renderer's boxes); titles that do not break
a word; no page taller than a screen, no matplotlib warning; asynchronous server steps apart
from synchronous rounds; an error axis that does not go below 0; availability that is the same
for every client drawn as one group, said why; the tail by availability quintile tabled beside
its figure; runs of different set-ups pooled in one row said so."""

import itertools
import os
import re
import warnings

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex, to_rgb
from matplotlib.markers import MarkerStyle
from matplotlib.text import Text

from deltafl_jax import report
from deltafl_jax.outputs.directory import RunReader, RunWriter
from deltafl_jax.report import figures
from deltafl_jax.studies import leaderboard as lb
from tests.test_figures import color_of, fake_run, record


def wcag_contrast_with_white(hex_colour):
    """WCAG 2.x contrast ratio of an sRGB colour against white, from the standard's
    definition (relative luminance of the linearised channels)."""
    c = np.array(to_rgb(hex_colour))
    lin = np.where(c <= 0.03928, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    lum = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return 1.05 / (lum + 0.05)


def lab(hex_colour):
    """CIE L*a*b* (D65) of an sRGB colour, from the CIE definitions (sRGB -> XYZ -> Lab)."""
    c = np.array(to_rgb(hex_colour))
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    x, y, z = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                        [0.0193339, 0.1191920, 0.9503041]]) @ lin / [0.95047, 1.0, 1.08883]

    def f(t):
        return t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116

    return np.array([116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))])


def marker_shape(marker):
    """The marker's outline as drawn (its path through its transform), rounded."""
    m = MarkerStyle(marker)
    return str(m.get_path().transformed(m.get_transform()).vertices.round(3).tolist())


def test_forty_methods_each_their_own_visible_colour_and_marker():
    styles = [figures.style(i) for i in range(40)]
    colours = [s.color for s in styles]
    assert len(set(colours)) == 40                          # the palette repeated past 8
    assert len({marker_shape(s.marker) for s in styles}) == 40
    # every colour readable on the white background (the palette's yellow was 1.3)
    assert min(wcag_contrast_with_white(c) for c in colours) >= 2.0
    # and far apart: CIE76 distance between any two of the first 20 at least 20
    first = [lab(c) for c in colours[:20]]
    assert min(np.linalg.norm(a - b) for a, b in itertools.combinations(first, 2)) >= 20
    # a report's styles do not depend on the count: the same method, the same style
    assert figures.method_styles(["a", "b", "c"])["c"] == styles[2]


def overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def clustered_record(count):
    """A leaderboard record whose methods' points crowd one spot (the issue's frontier)."""
    rec = record(["fedavg", "deltafl", "fedprox", "qffl", "afl", "term", "scaffold", "ditto",
                  "feddyn", "apfl", "gifair", "fedmgda", "drfa", "propfair"][:count])
    for i, m in enumerate(rec["methods"]):
        for j, entry in enumerate(m["final"].values()):
            entry["test_error_mean"] = [0.40 + 0.001 * ((3 * i + j) % 5)]
            entry["test_error_p90"] = [0.88 + 0.001 * ((2 * i + 3 * j) % 4)]
    return rec


def test_frontier_labels_do_not_overprint():
    fig = lb.frontier_plot(clustered_record(14))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]
    frame = ax.get_window_extent(renderer)
    for a, b in itertools.combinations(boxes, 2):
        assert not overlaps(a, b), (a, b)
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 for b in boxes)
    # every parameter is either written beside its point or named in the title
    written = [t.get_text() for t in ax.texts]
    title = ax.get_title()
    assert len(written) + (title.count(",") + 1 if "no room" in title else 0) == 28


@pytest.mark.parametrize("text", ["Δ-FL, θ = 0.5 [trace_fedscale_trace]",
                                  "FedAvg [availability_synthetic_corrected_long]",
                                  "q-FFL, q = 0.001 [qffl]"])
def test_labels_wrap_between_words_only(text):
    got = figures.wrap_label(text, 20)
    # each line break stands for a space, or comes after one of _ / - , ]: undone, the text
    rebuilt = re.sub(r"(?<=[_/\-,\]])\n", "", got).replace("\n", " ")
    assert rebuilt == text, (got, text)
    assert max(len(line) for line in got.split("\n")) <= 20


def many_runs(root, count, rounds=None, algorithm="fedprox", param="fedprox_mu"):
    """`count` runs of two swept values each (2 count methods), named by long run names."""
    for k in range(count):
        fake_run(root / f"trace_fedscale_trace_{k}", algorithm, param, (0.1 + k, 1.0 + k))
    if rounds is not None:        # one run with another round budget
        path = root / "trace_fedscale_trace_0"
        summary = {k: v for k, v in RunReader(str(path)).summary().items()
                   if k != "schema_version"}
        summary["config"]["num_rounds"] = rounds
        RunWriter(str(path)).write_summary(summary)


def tick_boxes(fig, renderer, axis="x"):
    """The boxes of the drawn tick labels of the figure's visible axes (within their view)."""
    out = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        lo, hi = sorted(getattr(ax, f"get_{axis}lim")())
        for t in getattr(ax, f"get_{axis}ticklabels")():
            at = t.get_position()[0 if axis == "x" else 1]
            if t.get_visible() and t.get_text() and lo - 1e-9 <= at <= hi + 1e-9:
                out.append(t.get_window_extent(renderer))
    return out


@pytest.fixture(scope="module")
def big_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    many_runs(root, 10, rounds=300)
    runs, skipped = report.load([str(root)])
    assert skipped == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no layout warning, nor any other
        got = report.write_report(runs, str(tmp_path_factory.mktemp("out") / "r"), dpi=40)
    return got, open(got["report"]).read()


@pytest.mark.slow   # a report of 20 methods drawn and saved (35 s): CI's second step
def test_a_report_of_many_methods_pages_its_grids_and_keeps_their_styles(big_report):
    got, md = big_report
    drawn = got["drawn"]
    for name, fig in drawn.items():            # at most about 1,800 px tall at 110 dpi
        assert fig.get_size_inches()[1] <= 16.5, (name, fig.get_size_inches())
    scatter = sorted(n for n in drawn if n.startswith("fig5_"))
    assert len(scatter) == 3                     # 20 methods, at most 8 per page
    titles = [ax.get_title().replace("\n", " ") for n in scatter for ax in drawn[n].axes
              if ax.get_visible() and ax.get_title()]
    assert len(titles) == len(set(titles)) == 20
    assert "trace_fedscale_tr ace" not in " ".join(titles)
    # each method its colour on every page and in the curves
    curves = {ln.get_label(): ln.get_color() for ln in drawn["fig6_curves_synthetic_linear.png"]
              .axes[0].lines if not ln.get_label().startswith("_")}
    for n in scatter:
        for ax in drawn[n].axes:
            if ax.get_visible() and ax.get_title():
                label = ax.get_title().replace("\n", " ").replace("_ ", "_")
                assert color_of(ax.collections[0]) == to_hex(curves[label])
    # titles and tick labels of the histograms' pages do not collide
    for n in (n for n in drawn if n.startswith("fig4_")):
        fig = drawn[n]
        FigureCanvasAgg(fig).draw()
        r = fig.canvas.get_renderer()
        boxes = [ax.title.get_window_extent(r) for ax in fig.axes if ax.get_visible()] + \
            tick_boxes(fig, r)
        for a, b in itertools.combinations(boxes, 2):
            assert not overlaps(a, b)
    # runs of another round budget pooled in the row are said so
    assert "pools runs of different set-ups" in md and "300 rounds" in md and "6 rounds" in md


def setting_columns(root):
    runs, skipped = report.load([str(root)])
    assert skipped == []
    from deltafl_jax.report.tables import columns
    return columns(runs)


def test_asynchronous_server_steps_never_share_the_round_axis(tmp_path):
    from deltafl_jax.report import document
    fake_run(tmp_path / "delta", "deltafl", None, (1.0, 0.5))
    fake_run(tmp_path / "buff", "fedbuff", None, (1.0,))
    cols = setting_columns(tmp_path)
    notes = []
    got = {name: fig for fig, name, _ in document.round_figures(cols, "s", "lower", notes)}
    assert sorted(got) == ["fig16_kept_clients_s.png", "fig16_kept_clients_s_server_steps.png",
                           "fig6_curves_s.png", "fig6_curves_s_server_steps.png"]

    def drawn(fig):
        return {ln.get_label() for ax in fig.axes for ln in ax.lines
                if not ln.get_label().startswith("_")}

    assert drawn(got["fig6_curves_s.png"]) == {"FedAvg [delta]", "Δ-FL, θ = 0.5 [delta]"}
    assert drawn(got["fig6_curves_s_server_steps.png"]) == {"FedBuff [buff]"}
    for name, fig in got.items():
        xlabels = {ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()}
        assert xlabels == {figures.STEP_AXIS if "server_steps" in name else
                           figures.ROUND_AXIS}, (name, xlabels)


def test_errors_all_zero_keep_the_axis_at_or_above_zero(tmp_path):
    path = fake_run(tmp_path / "delta", "deltafl", None, (1.0, 0.5))
    history = dict(np.load(os.path.join(path, "clients_history.npz")))
    history["test_error"] = np.zeros_like(history["test_error"])
    RunWriter(path).write_clients_history(history)
    fig = figures.curves_figure(setting_columns(tmp_path))
    for ax in fig.axes:
        if "error" in ax.get_title():
            lo, hi = ax.get_ylim()
            assert lo == 0.0 and 0.0 < hi <= 0.1, (ax.get_title(), lo, hi)   # not -4% to 4%


def with_availability(path, rates):
    """A fabricated run's summary.json given a test-device split by availability quintile:
    quintile j's error (mean, p90, worst 10%) = 0.1 j + 0.01 seed + (0, 0.05, 0.08), its mean
    rate rates[j - 1], and the whole population's error the same as q3's."""
    reader = RunReader(path)
    summary = {k: v for k, v in reader.summary().items() if k != "schema_version"}
    final = {}
    for key, lab in zip(reader.keys(), summary["replicas"]):
        row = {}
        for stat, off in (("mean", 0.0), ("p90", 0.05), ("worst10", 0.08)):
            for j in range(1, 6):
                row[f"test_avail_q{j}_error_{stat}"] = 0.1 * j + 0.01 * lab["seed"] + off
                row[f"test_avail_q{j}_rate_mean"] = rates[j - 1]
            row[f"test_error_{stat}"] = 0.3 + 0.01 * lab["seed"] + off
        final[key] = row
    summary["final"] = final
    RunWriter(path).write_summary(summary)


def test_uniform_availability_draws_one_group_and_says_why(tmp_path):
    from deltafl_jax.report import availability, document
    for name in ("delta", "mifa"):
        with_availability(fake_run(tmp_path / name, "deltafl", None, (1.0, 0.5)), [0.2] * 5)
    cols = setting_columns(tmp_path)
    fig = availability.availability_figure(cols)
    panels = [ax for ax in fig.axes if ax.get_title()]
    for ax, off in zip(panels, (0.0, 0.05, 0.08)):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["all clients\n(rate 0.2 each)"]
        # a point per method (no line over quintiles): the whole population's error, mean
        # over seeds 1 and 2, whiskers at the seeds' values
        assert [c.get_label() for c in ax.containers] == [c.label for c in cols]
        points = [c.lines[0] for c in ax.containers]
        for ln in points:
            assert len(ln.get_xdata()) == 1
            assert float(ln.get_ydata()[0]) == pytest.approx(0.315 + off)
        assert all(len(ln.get_xdata()) <= 2 for ln in ax.lines)
    assert "quintiles would" in fig._suptitle.get_text().replace("\n", " ")
    assert document.tail_section(cols) == []
    notes = []
    document.setting_figures(cols, "synthetic / linear", "lower", notes)
    assert any("same availability (0.2)" in n for n in notes)


@pytest.mark.slow   # 8 fabricated runs and a drawn figure (2 s): CI's second step
def test_quintile_ticks_do_not_run_together_and_the_tail_is_tabled(tmp_path):
    from deltafl_jax.report import availability, document
    rates = [0.0331, 0.0982, 0.165, 0.301, 0.55]
    for k in range(4):                     # 8 methods with long labels
        with_availability(fake_run(tmp_path / f"trace_fedscale_trace_{k}", "fedprox",
                                   "fedprox_mu", (0.1 + k, 1.0 + k)), rates)
    cols = setting_columns(tmp_path)
    fig = availability.availability_figure(cols)
    FigureCanvasAgg(fig).draw()
    boxes = tick_boxes(fig, fig.canvas.get_renderer())
    assert len(boxes) == 3 * 5
    for a, b in itertools.combinations(boxes, 2):
        assert not overlaps(a, b), (a, b)
    md = "\n".join(document.tail_section(cols))
    rows = [line for line in md.splitlines() if line.startswith("| FedProx")]
    assert len(rows) == 2 * 8                 # p90 and worst 10% of each method
    assert "q1 (0.0331)" in md and "q5 (0.55)" in md
    # p90 of quintile j: 0.1 j + 0.05 + 0.015 (seeds 1, 2: the mean and its [min, max]), in %
    cells = [c.strip() for c in rows[0].split("|")[3:8]]
    assert cells == [f"{100 * (0.1 * j + 0.065):.1f} [{100 * (0.1 * j + 0.06):.1f}, "
                     f"{100 * (0.1 * j + 0.07):.1f}]" for j in range(1, 6)]


def test_held_out_figure_is_titled_by_what_it_shows(tmp_path):
    fake_run(tmp_path / "delta", "deltafl", None, (1.0, 0.5), personal=True)
    fig = figures.personal_figure(setting_columns(tmp_path))
    title = fig._suptitle.get_text().replace("\n", " ")
    assert "personalised evaluation" not in title
    assert "held-out error per client (--client_holdout) of the model served, and after 5 " \
        "adaptation steps" in title


def test_a_corrected_delta_fl_is_named_with_its_correction():
    from deltafl_jax.replicas.labels import ReplicaLabel
    from deltafl_jax.report.tables import method_label
    lab = ReplicaLabel("deltafl", 0.5, 1)
    assert method_label(lab, {"options": {"deltafl_participation": "fedau"}}) == \
        "Δ-FL, θ = 0.5 (FedAU-corrected)"
    assert method_label(lab, {"options": {"deltafl_participation": "none"}}) == "Δ-FL, θ = 0.5"
    assert method_label(ReplicaLabel("deltafl", 1.0, 1), {}) == "FedAvg"


def test_error_limits_leave_errors_of_a_dataset_without_classes_as_drawn():
    fig, axes = figures.new_figure(1, 2, 4, 2)
    axes[0][0].plot([1, 2, 3], [0.5, 3.0, 2.0])      # a regression's 'error': not a fraction
    axes[0][1].plot([1, 2, 3], [0.9, 1.0, 1.0])      # fractions up to 1
    for ax in axes[0]:
        figures.error_limits(ax)
    assert axes[0][0].get_ylim()[1] > 3.0 and axes[0][0].get_ylim()[0] < 0.5
    lo, hi = axes[0][1].get_ylim()
    assert 0.0 <= lo < 0.9 and 1.0 < hi <= 1.0 + 0.05 * (1.0 - lo) + 1e-12
