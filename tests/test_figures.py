"""The report's and the leaderboard's figures as a reader sees them, from the figure objects of
fabricated run folders (written with the package's own writer): each method its own colour and
marker, the same in every figure; panels in a grid sized to their count; FedAvg first, then
the registry's order; methods whose values are identical named so; the histograms' p90 label
the table's number; a figure of the personalised evaluation; tick labels that do not overlap."""

import json
import math
import os
import types

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from deltafl_jax import report
from deltafl_jax.outputs.directory import RunWriter
from deltafl_jax.replicas.labels import ReplicaLabel
from deltafl_jax.studies import leaderboard as lb
from tests.test_report import cell_numbers, parse_tables, table_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_TRAIN, N_TEST, SEEDS, EVALS = 30, 30, (1, 2), (2, 4, 6)
# The fabricated runs: (run name, algorithm, swept values). Ditto's and APFL's global model are
# FedAvg's (the same per-client values), as in a real run on the same seeds.
RUNS = (("apfl", "apfl", "apfl_alpha", (0.5,)), ("delta", "deltafl", None, (1.0, 0.5)),
        ("ditto", "ditto", "ditto_lambda", (1.0,)), ("prox", "fedprox", "fedprox_mu", (0.1,)),
        ("qffl", "qffl", "qffl_q", (1.0,)), ("afl", "afl", "afl_lambda_lr", (0.01,)),
        ("term", "term", "term_t", (1.0,)))
# The order of the report (FedAvg first, then the registry's: Δ-FL, FedProx, q-FFL, AFL, TERM,
# Ditto, APFL), written out by hand.
ORDER = ["FedAvg [delta]", "Δ-FL, θ = 0.5 [delta]", "FedProx, μ = 0.1 [prox]",
         "q-FFL, q = 1 [qffl]", "AFL, γ_λ = 0.01 [afl]", "TERM, t = 1 [term]",
         "Ditto, λ = 1 [ditto]", "APFL, α₀ = 0.5 [apfl]"]


def per_client(rng_seed, value_seed, n):
    """Per-client errors in [0, 1] (multiples of 1/20) of one replica."""
    return np.random.default_rng(1000 * rng_seed + value_seed).integers(0, 21, n) / 20.0


def fake_run(path, algorithm, param, values, personal=False):
    """A finished run of `algorithm` written with RunWriter: summary.json, clients.npz,
    clients_history.npz and rounds.npz (the FedAvg-equivalent replicas, theta = 1 of deltafl
    and Ditto's / APFL's global models, all get the same values)."""
    labels = [ReplicaLabel(algorithm, 1.0, s, param, v) if param else
              ReplicaLabel(algorithm, v, s) for v in values for s in SEEDS]
    code = {v: (0 if (param is None and v == 1.0) or algorithm in ("ditto", "apfl") else
                1 + int(1000 * v) % 97 + 100 * [r[1] for r in RUNS].index(algorithm))
            for v in values}
    seeds_of = [(code[lab.swept()[1]], lab.seed) for lab in labels]
    arrays = {f"{split}_{what}": np.stack([per_client(c, s + (7 if what == "loss" else 0), n)
                                           for c, s in seeds_of])
              for split, n in (("train", N_TRAIN), ("test", N_TEST))
              for what in ("loss", "error")}
    if personal:
        for name in ("unseen", "seen", "unseen_ft5", "seen_ft5"):
            n = N_TEST if name.startswith("unseen") else N_TRAIN
            for what in ("loss", "error"):
                arrays[f"{name}_{what}"] = np.stack(
                    [per_client(c + 50 + len(name), s, n) for c, s in seeds_of])
    data = types.SimpleNamespace(
        train=types.SimpleNamespace(sizes=np.linspace(100, 400, N_TRAIN).astype(int),
                                    client_ids=[f"r{k}" for k in range(N_TRAIN)]),
        test=types.SimpleNamespace(sizes=np.linspace(100, 400, N_TEST).astype(int),
                                   client_ids=[f"t{k}" for k in range(N_TEST)]))
    os.makedirs(path)
    writer = RunWriter(str(path))
    writer.write_clients(arrays, data, labels)
    writer.write_clients_history({
        "rounds": np.array(EVALS),
        **{k: np.stack([arrays[k] * (1 + 1.0 / e) for e in EVALS])
           for k in ("train_loss", "test_loss", "test_error")}})
    writer.write_rounds({"num_selected": np.array([[4 if c == 0 else 3 for c, _ in seeds_of]]
                                                  * EVALS[-1]),
                         "num_rejected": np.zeros((EVALS[-1], len(labels)), int)}, labels)
    config = {"algorithm": algorithm, "num_rounds": EVALS[-1], "seeds": list(SEEDS),
              "data": {"dataset": "synthetic"}, "model": "linear"}
    if personal:
        config["finetune_steps"] = [0, 5]
    writer.write_summary({"replicas": [lab.to_json() for lab in labels],
                          "dataset": {"name": "synthetic", "num_classes": 10}, "model": "linear",
                          "config": config, "final": {}})
    return str(path)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The report of the eight fabricated methods (Δ-FL's run with a personalised evaluation)."""
    root = tmp_path_factory.mktemp("runs")
    for name, algorithm, param, values in RUNS:
        fake_run(root / name, algorithm, param, values, personal=(name == "delta"))
    runs, skipped = report.load([str(root)])
    assert skipped == [] and len(runs) == len(RUNS)
    out = tmp_path_factory.mktemp("report") / "out"
    got = report.write_report(runs, str(out), dpi=60)
    return (str(out), got["drawn"], open(os.path.join(out, "report.md")).read(),
            [os.path.join(str(root), name, "summary.json") for name, *_ in RUNS])


def visible_axes(fig, titled=True):
    return [ax for ax in fig.axes if ax.get_visible() and (ax.get_title() or not titled)]


def color_of(artist):
    from matplotlib.colors import to_hex
    if hasattr(artist, "get_facecolor") and not hasattr(artist, "get_xdata"):
        c = artist.get_facecolor()
        c = c[0] if np.ndim(c) == 2 else c
    else:
        c = artist.get_color()
    return to_hex(c)


def test_histograms_a_grid_in_the_report_order_one_colour_per_method(written):
    _, drawn, _, _ = written
    for name in ("fig4_hist_test_error_synthetic_linear.png",
                 "fig12_hist_train_loss_synthetic_linear.png"):
        fig = drawn[name]
        panels = visible_axes(fig)
        titles = [ax.get_title().split("\n(identical")[0].replace("\n", " ") for ax in panels]
        assert titles == ORDER
        colours = [color_of(ax.patches[0]) for ax in panels]
        assert len(set(colours)) == len(ORDER), colours
        # A grid, not a strip: 8 panels in 2 rows of 4, neither side over 3x the other.
        width, height = fig.get_size_inches()
        assert 1 / 3 <= width / height <= 3, (width, height)
        assert len({round(ax.get_position().y0, 3) for ax in panels}) == 2
        # Ditto's and APFL's values are FedAvg's: their titles say so.
        same = [ax.get_title() for ax in panels if "identical to FedAvg [delta]" in ax.get_title()]
        assert len(same) == 2 and same[0].startswith("Ditto") and same[1].startswith("APFL")
        # The titles do not overlap once drawn.
        FigureCanvasAgg(fig).draw()
        boxes = [ax.title.get_window_extent() for ax in panels]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_the_p90_label_is_the_tables_number(written):
    """The dashed line and its label are the table's p90 cell (the mean over the seeds of each
    seed's p90), not the p90 of the seed-averaged bars, which differs here."""
    _, drawn, md, _ = written
    header, rows = table_of(parse_tables(md), "Table 2")
    cells = dict(zip(header, rows["synthetic / linear"]))
    fig = drawn["fig4_hist_test_error_synthetic_linear.png"]
    cols = {c.label: c for c in report.columns(report.load([os.path.dirname(p) for p in
                                                            written[3]])[0])}
    differ = 0
    for ax in visible_axes(fig):
        label = ax.get_title().split("\n(identical")[0].replace("\n", " ")
        table = cell_numbers(cells[label])[0]
        (text,) = [t.get_text() for t in ax.texts if "p90" in t.get_text()]
        assert text.strip() == f"p90 = {table:.2f}"
        assert 100 * ax.lines[0].get_xdata()[0] == pytest.approx(table, abs=0.005)
        # The p90 of the bars (each client's error averaged over the seeds) is another number.
        v = np.sort(cols[label].client_means("test", "error")[1])
        differ += f"{100 * v[math.ceil(0.9 * v.size) - 1]:.2f}" != f"{table:.2f}"
    assert differ > 0


def test_curves_and_kept_clients_one_style_per_method_identical_ones_said(written):
    _, drawn, _, _ = written
    fig = drawn["fig6_curves_synthetic_linear.png"]
    for ax in visible_axes(fig):
        lines = [l for l in ax.lines if not l.get_label().startswith("_")]
        labels = [l.get_label().split(" (identical")[0] for l in lines]
        assert labels == ORDER
        styles = {(color_of(l), l.get_marker()) for l in lines}
        assert len({color_of(l) for l in lines}) == len(ORDER)
        assert len(styles) == len(ORDER)
        same = {l.get_label() for l in lines if "(identical to FedAvg [delta])" in l.get_label()}
        assert same == {"Ditto, λ = 1 [ditto] (identical to FedAvg [delta])",
                        "APFL, α₀ = 0.5 [apfl] (identical to FedAvg [delta])"}
        # The identical curves' markers sit at different evaluations: each stays visible.
        marked = [tuple(l.get_xdata()[np.arange(len(l.get_xdata()))[l.get_markevery()[0]::
                                                                     l.get_markevery()[1]]])
                  for l in lines if l.get_label().split(" (identical")[0] in
                  ("FedAvg [delta]", "Ditto, λ = 1 [ditto]", "APFL, α₀ = 0.5 [apfl]")]
        assert len(set(marked)) == 3, marked
    fig = drawn["fig16_kept_clients_synthetic_linear.png"]
    lines = [l for l in fig.axes[0].lines if not l.get_label().startswith("_")]
    assert [l.get_label().split(" (identical")[0] for l in lines] == ORDER
    assert len({color_of(l) for l in lines}) == len(ORDER)


def test_each_method_keeps_its_colour_across_the_figures(written):
    _, drawn, _, _ = written
    hist = drawn["fig4_hist_test_error_synthetic_linear.png"]
    by_hist = {ax.get_title().split("\n(identical")[0].replace("\n", " "): color_of(ax.patches[0])
               for ax in visible_axes(hist)}
    curves = drawn["fig6_curves_synthetic_linear.png"].axes[0]
    by_curve = {l.get_label().split(" (identical")[0]: color_of(l) for l in curves.lines
                if not l.get_label().startswith("_")}
    scatter = drawn["fig5_scatter_synthetic_linear.png"]
    by_scatter = {ax.get_title().replace("\n", " "): color_of(ax.collections[0])
                  for ax in visible_axes(scatter)}
    assert by_hist == by_curve == by_scatter


def test_scatter_a_grid_with_readable_ticks(written):
    _, drawn, _, _ = written
    fig = drawn["fig5_scatter_synthetic_linear.png"]
    assert [ax.get_title().replace("\n", " ") for ax in visible_axes(fig)] == ORDER
    width, height = fig.get_size_inches()
    assert 1 / 3 <= width / height <= 3, (width, height)
    FigureCanvasAgg(fig).draw()
    for ax in visible_axes(fig, titled=False):
        # Clients of 100 to 400 examples (less than a decade): labelled 100, 200, 300.
        shown = [t.get_text() for t in ax.xaxis.get_ticklabels() if t.get_visible()
                 and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]]
        assert shown == ["100", "200", "300"], shown
        for axis, lo, hi in ((ax.xaxis, "x0", "x1"), (ax.yaxis, "y0", "y1")):
            boxes = sorted((getattr(b, lo), getattr(b, hi))
                           for t in axis.get_ticklabels(which="both")
                           if t.get_visible() and t.get_text()
                           for b in [t.get_window_extent()])
            assert all(a[1] <= b[0] for a, b in zip(boxes, boxes[1:])), boxes


def test_a_personalised_figure_when_a_run_has_the_evaluation(written, tmp_path):
    out, drawn, md, _ = written
    name = "personal_held_out_error_synthetic_linear.png"
    assert name in drawn and os.path.exists(os.path.join(out, name)) and f"]({name})" in md
    fig = drawn[name]
    panels = visible_axes(fig)
    assert len(panels) == 4       # unseen and seen, without and after 5 adaptation steps
    # The bars are the personalised tables' cells (mean over seeds), per method and statistic.
    tables = parse_tables(md)
    for ax in panels:
        title = ax.get_title()
        population = "unseen devices" if title.startswith("unseen") else "seen clients"
        after = "after 5 adaptation steps" if "after 5" in title else "without adaptation"
        heights = [b.get_height() for b in ax.patches]
        for i, stat in enumerate(("mean", "90th percentile", "worst-10% mean")):
            (key,) = [k for k in tables if k.startswith(f"Personalised: {stat} of")
                      and population in k and after in k]
            header, rows = tables[key]
            for j, label in enumerate(header):
                want = cell_numbers(rows["synthetic / linear"][j])[0]
                assert 100 * heights[j * 3 + i] == pytest.approx(want, abs=0.005)
    # No personalised evaluation, no such figure.
    root = tmp_path / "runs"
    fake_run(root / "delta", "deltafl", None, (1.0, 0.5))
    runs, _ = report.load([str(root)])
    got = report.write_report(runs, str(tmp_path / "out"), dpi=40)
    assert not any(k.startswith("personal_") for k in got["drawn"])


def test_report_tables_put_fedavg_first_then_the_registry_order(written):
    _, _, md, _ = written
    for title in ("Table 2", "Table 3"):
        header, _ = table_of(parse_tables(md), title)
        assert header == ORDER


def record(names):
    """A leaderboard record with every method at two grid points."""
    from deltafl_jax.algorithms import registry
    methods = []
    for i, name in enumerate(names):
        final = {f"p={j}": {"point": {"p": j}, "text": f"p = {j}", "seeds": [1],
                            "test_error_mean": [0.3 + 0.01 * i + 0.002 * j],
                            "test_error_p90": [0.5 + 0.01 * ((5 * i) % len(names)) + 0.01 * j]}
                 for j in (0, 1)}
        methods.append({"name": name, "display": registry.get(name).display_name,
                        "chosen": "p=0", "final": final})
    return {"title": "fabricated", "methods": methods}


def test_frontier_each_method_its_own_colour_and_marker_fedavg_first(tmp_path):
    names = ["deltafl", "fedavg", "fedprox", "qffl", "afl", "term", "scaffold", "ditto",
             "feddyn", "apfl", "gifair", "fedmgda", "drfa", "propfair"]
    path = lb.frontier_figure(record(names), str(tmp_path / "frontier.png"))
    fig = lb.frontier_plot(record(names))
    handles = fig.legends[0].legend_handles
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[0] == "FedAvg"
    assert labels[1] == "Δ-FL"
    styles = [(color_of(h), str(h.get_paths()[0].vertices.round(3).tolist()))
              for h, t in zip(handles, labels) if t != "Pareto frontier"]
    assert len(set(styles)) == len(names)
    # The palette's eight colours go to the first eight methods.
    assert len({c for c, _ in styles[:8]}) == 8
    # Methods whose chosen points coincide are said to.
    assert os.path.getsize(path) > 1000
    both = record(["fedavg", "ditto"])
    both["methods"][1]["final"] = both["methods"][0]["final"]
    fig = lb.frontier_plot(both)
    assert [t.get_text() for t in fig.legends[0].get_texts()][:2] == [
        "FedAvg", "Ditto (same point as FedAvg)"]


@pytest.mark.parametrize("file", sorted(f for f in os.listdir(
    os.path.join(REPO, "experiments", "leaderboard_results")) if f.endswith(".json")))
def test_the_shipped_leaderboard_figures_have_distinct_styles(file):
    with open(os.path.join(REPO, "experiments", "leaderboard_results", file)) as f:
        rec = json.load(f)
    fig = lb.frontier_plot(rec)
    handles = [h for h, t in zip(fig.legends[0].legend_handles, fig.legends[0].get_texts())
               if t.get_text() != "Pareto frontier"]
    styles = {(color_of(h), str(h.get_paths()[0].vertices.round(3).tolist())) for h in handles}
    assert len(styles) == len(handles) == len(rec["methods"])
    assert fig.legends[0].get_texts()[0].get_text() == "FedAvg"
    assert math.isfinite(fig.get_size_inches()[0])
