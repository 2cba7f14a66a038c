"""The report of a run that evaluated a sample of clients (``--eval_clients`` below the
population, the default above 10^5 clients): a generated population kept on the host, K
clients of each split per evaluation. ``experiments.report`` must write every table and figure
(the first histogram included), and each is checked here against the run's own
``metrics.jsonl``, the numbers the run logged from the same sample, and against NumPy
recomputations from the per-client rows."""

import csv
import json
import math
import os

import numpy as np
import pytest

from deltafl_jax import DataConfig, ExperimentConfig, load_dataset, run_experiment
from deltafl_jax import report
from deltafl_jax.outputs import directory as outputs
from deltafl_jax.report import figures
from experiments import report as report_cli
from test_report import parse_tables, table_of

K = 40                       # sampled clients per split (the population has 150 + 150)
DATA = DataConfig("synthetic", synthetic_num_clients=300, synthetic_max_examples=80,
                  synthetic_shared=0.8, synthetic_on_demand=True)
LABELS = {"FedAvg": 1.0, "Δ-FL, θ = 0.5": 0.5}
SEEDS = (1, 2)
TABLE_METRICS = {"Table 2": ("test_error_p90", 100.0, 2), "Table 3": ("test_error_mean", 100.0, 2),
                 "Train loss: alpha-weighted mean": ("train_loss_mean", 1.0, 4),
                 "Train loss: 90th": ("train_loss_p90", 1.0, 4)}
FIGURES = ("fig4_hist_test_error_synthetic_linear.png",
           "fig12_hist_train_loss_synthetic_linear.png", "fig5_scatter_synthetic_linear.png",
           "fig6_curves_synthetic_linear.png", "fig16_kept_clients_synthetic_linear.png")


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sampled") / "run"
    config = ExperimentConfig(data=DATA, model="linear", algorithm="deltafl", thetas=(1.0, 0.5),
                              seeds=SEEDS, num_rounds=6, clients_per_round=5, batch_size=16,
                              learning_rate=0.05, eval_every=3, eval_clients=K,
                              client_data="host", output_dir=str(out), save_models=False,
                              verbose=False, tensorboard=False)
    run_experiment(config)
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return str(out), records


def cli(argv, capsys):
    report_cli.FLAGS.unparse_flags()
    code = 0
    try:
        report_cli.main(report_cli.parse_flags_or_fail(["report"] + list(argv)))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def logged(records, theta, seed=None, round=None):
    """The metrics.jsonl records of one method (and seed), at one round (default: the last)."""
    last = max(r["round"] for r in records)
    return [r for r in records if r["theta"] == theta and (seed is None or r["seed"] == seed)
            and r["round"] == (last if round is None else round)]


def lower_order_statistic(values, percent):
    """The ceil(p K / 100)-th smallest of K values (exact integer arithmetic)."""
    v = np.sort(np.asarray(values, np.float64))
    return v[max(-(-percent * v.size // 100), 1) - 1]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def written(sampled_run, tmp_path_factory):
    """The report as the command writes it, and the same report through the Python API (whose
    result holds the drawn matplotlib figures)."""
    run_dir, _ = sampled_run
    root = tmp_path_factory.mktemp("report")
    report_cli.FLAGS.unparse_flags()
    try:
        report_cli.main(report_cli.parse_flags_or_fail(["report", run_dir,
                                                        f"--out={root / 'cli'}"]))
    except SystemExit as e:
        assert e.code in (0, None)
    runs, skipped = report.load([run_dir])
    assert skipped == [] and runs[0].sampled("train") and runs[0].sampled("test")
    api = report.write_report(runs, str(root / "api"))
    return str(root / "cli"), api


def test_the_report_writes_every_table_and_figure(written):
    out, api = written
    md = open(os.path.join(out, "report.md")).read()
    assert sorted(f for f in os.listdir(out) if f.endswith(".png")) == sorted(FIGURES)
    for name in FIGURES:
        assert f"]({name})" in md and os.path.getsize(os.path.join(out, name)) > 1000
    assert sorted(api["drawn"]) == sorted(FIGURES)
    # The command and the Python API write the same report.
    api_dir = os.path.dirname(api["report"])
    for name in ("report.md", "final.csv", "curves.csv", "clients.csv", "kept_clients.csv"):
        assert open(os.path.join(out, name)).read() == open(os.path.join(api_dir, name)).read()
    assert "sample of clients" in md and "each draw weighing 1/K" in md


def test_tables_equal_the_runs_metrics_jsonl(sampled_run, written):
    _, records = sampled_run
    out, _ = written
    tables = parse_tables(open(os.path.join(out, "report.md")).read())
    for prefix, (metric, scale, digits) in TABLE_METRICS.items():
        header, rows = table_of(tables, prefix)
        (cells,) = rows.values()   # one dataset / model row
        assert header == list(LABELS)
        for label, theta in LABELS.items():
            recs = logged(records, theta)
            assert sorted(r["seed"] for r in recs) == list(SEEDS)
            text = cells[header.index(label)].replace("**", "")
            mean_std, interval = text.split(" [")
            mean, std = (float(x) for x in mean_std.split("±"))
            values = np.array([r[metric] for r in recs]) * scale
            tol = 0.51 * 10 ** -digits
            assert mean == pytest.approx(values.mean(), abs=tol)
            assert std == pytest.approx(values.std(ddof=0), abs=tol)   # the stated convention
            lo, hi = (float(x) for x in interval.rstrip("]").split(","))
            assert lo == pytest.approx(np.mean([r[metric + "_lo"] for r in recs]) * scale,
                                       abs=tol)
            assert hi == pytest.approx(np.mean([r[metric + "_hi"] for r in recs]) * scale,
                                       abs=tol)


def test_final_and_curves_csv_equal_metrics_jsonl(sampled_run, written):
    _, records = sampled_run
    out, _ = written
    metric_keys = [k for k in records[0] if k.startswith(("train_loss", "test_error",
                                                          "test_loss"))]
    assert "test_error_p90_lo" in metric_keys and "train_loss_mean_hi" in metric_keys
    final = read_csv(os.path.join(out, "final.csv"))
    assert len(final) == len(LABELS) * len(SEEDS)
    for row in final:
        (rec,) = logged(records, float(row["theta"]), int(row["seed"]))
        for k in metric_keys:   # recomputed from clients.npz (float64): the same numbers
            assert float(row[k]) == pytest.approx(rec[k], rel=1e-12, abs=0), k
    curves = read_csv(os.path.join(out, "curves.csv"))
    assert sorted({int(r["round"]) for r in curves}) == [3, 6]
    assert len(curves) == 2 * len(final)
    for row in curves:
        (rec,) = logged(records, float(row["theta"]), int(row["seed"]), int(row["round"]))
        for k in metric_keys:   # from clients_history.npz, which keeps float32
            assert float(row[k]) == pytest.approx(rec[k], rel=2e-6, abs=1e-7), k


def test_clients_csv_holds_the_sample_and_reproduces_metrics_jsonl(sampled_run, written):
    run_dir, records = sampled_run
    out, _ = written
    rows = read_csv(os.path.join(out, "clients.csv"))
    data = load_dataset(DATA)
    assert len(rows) == len(LABELS) * len(SEEDS) * 2 * K
    for theta in LABELS.values():
        for seed in SEEDS:
            (rec,) = logged(records, theta, seed)
            mine = [r for r in rows if float(r["theta"]) == theta and int(r["seed"]) == seed]
            for split, population in (("train", data.train), ("test", data.test)):
                part = [r for r in mine if r["split"] == split]
                assert [int(r["draw"]) for r in part] == list(range(K))
                idx = np.array([int(r["client_index"]) for r in part])
                assert np.all(np.diff(idx) >= 0) and idx.max() < population.num_clients
                assert [int(r["num_examples"]) for r in part] == list(population.sizes[idx])
                assert [r["client_id"] for r in part] == [str(population.client_ids[k])
                                                         for k in idx]
                loss = np.array([float(r["loss"]) for r in part])
                err = np.array([float(r["error"]) for r in part])
                if split == "train":   # PPS draws: the plain mean and order statistic
                    assert loss.mean() == pytest.approx(rec["train_loss_mean"], rel=1e-12)
                    assert lower_order_statistic(loss, 90) == rec["train_loss_p90"]
                else:                  # uniform draws without replacement
                    assert len(set(idx)) == K
                    assert err.mean() == pytest.approx(rec["test_error_mean"], rel=1e-12)
                    assert lower_order_statistic(err, 90) == rec["test_error_p90"]
                    assert loss.mean() == pytest.approx(rec["test_loss_mean"], rel=1e-12)
    kept = read_csv(os.path.join(out, "kept_clients.csv"))
    assert len(kept) == len(LABELS) * len(SEEDS) * 6
    for rec in records:
        (row,) = [r for r in kept if float(r["theta"]) == rec["theta"]
                  and int(r["seed"]) == rec["seed"] and int(r["round"]) == rec["round"]]
        assert int(row["num_selected"]) == rec["num_selected"]
        assert int(row["num_rejected"]) == rec["num_rejected"]


def panels(fig, count):
    return {ax.get_title(): ax for ax in fig.axes[:count]}


def seed_average(rows, theta, split, what):
    """[K] the per-client values of clients.csv averaged over the seeds, and their sizes."""
    per_seed = [[float(r[what]) for r in rows if float(r["theta"]) == theta
                 and int(r["seed"]) == s and r["split"] == split] for s in SEEDS]
    sizes = [int(r["num_examples"]) for r in rows if float(r["theta"]) == theta
             and int(r["seed"]) == SEEDS[0] and r["split"] == split]
    return np.mean(per_seed, axis=0), np.array(sizes)


@pytest.mark.parametrize("name,split,quantity,metric", [
    ("fig4_hist_test_error_synthetic_linear.png", "test", "error", "test_error"),
    ("fig12_hist_train_loss_synthetic_linear.png", "train", "loss", "train_loss")])
def test_histograms_weigh_each_sampled_client_equally(sampled_run, written, name, split,
                                                      quantity, metric):
    _, records = sampled_run
    out, api = written
    rows = read_csv(os.path.join(out, "clients.csv"))
    fig = api["drawn"][name]
    assert "sample (40 per split)" in fig.get_suptitle()
    for label, ax in panels(fig, len(LABELS)).items():
        theta = LABELS[label]
        v, _ = seed_average(rows, theta, split, quantity)
        bars = ax.patches
        edges = np.array([b.get_x() for b in bars] + [bars[-1].get_x() + bars[-1].get_width()])
        if quantity == "error":   # 5 %-wide bins on [0, 1], rebuilt exactly (errors sit on them)
            np.testing.assert_allclose(edges, np.arange(21) / 20, atol=1e-12)
            edges = np.arange(21) / 20
        counts, _ = np.histogram(v, bins=edges)
        np.testing.assert_allclose([b.get_height() for b in bars], counts / K, atol=1e-12)
        # The bars' weighted mean is the mean metrics.jsonl logged (mean over the seeds): each
        # draw weighs 1/K (the training draws were made with probability alpha_k).
        data_v, data_w = figures.histogram_data(
            [c for c in report.columns(report.load([sampled_run[0]])[0]) if c.label == label][0],
            split, quantity)
        np.testing.assert_allclose(data_w, 1.0 / K)
        np.testing.assert_allclose(np.sort(data_v), np.sort(v), rtol=1e-12)
        assert float(data_v @ data_w) == pytest.approx(
            np.mean([r[f"{metric}_mean"] for r in logged(records, theta)]), rel=1e-12)
        # The dashed line: the table's p90 (the mean of the seeds' logged p90), labelled as
        # the table prints it.
        table = np.mean([r[f"{metric}_p90"] for r in logged(records, theta)])
        assert ax.lines[0].get_xdata()[0] == pytest.approx(table, rel=1e-6)
        show = (lambda x: f"{100 * x:.2f}") if quantity == "error" else (lambda x: f"{x:.3f}")
        (text,) = [t.get_text() for t in ax.texts if "p90" in t.get_text()]
        assert text.strip() == f"p90 = {show(table)}"


def test_scatter_plots_the_sampled_clients_against_their_sizes(sampled_run, written):
    _, records = sampled_run
    out, api = written
    rows = read_csv(os.path.join(out, "clients.csv"))
    fig = api["drawn"]["fig5_scatter_synthetic_linear.png"]
    top, bottom = fig.axes[:2], fig.axes[2:4]
    for j, (label, theta) in enumerate(LABELS.items()):
        assert top[j].get_title() == label
        for ax, split, quantity, metric in ((top[j], "train", "loss", "train_loss_mean"),
                                            (bottom[j], "test", "error", "test_error_mean")):
            v, sizes = seed_average(rows, theta, split, quantity)
            points = ax.collections[0].get_offsets()
            np.testing.assert_allclose(points, np.column_stack([sizes, v]), rtol=1e-12)
            assert points[:, 1].mean() == pytest.approx(
                np.mean([r[metric] for r in logged(records, theta)]), rel=1e-12)


def test_curves_and_kept_clients_figures_follow_metrics_jsonl(sampled_run, written):
    run_dir, records = sampled_run
    _, api = written
    fig = api["drawn"]["fig6_curves_synthetic_linear.png"]
    for ax, metric in zip(fig.axes[:4], ["train_loss_mean", "train_loss_p90", "test_error_mean",
                                         "test_error_p90"]):
        lines = {l.get_label(): l for l in ax.lines}
        for label, theta in LABELS.items():
            np.testing.assert_array_equal(lines[label].get_xdata(), [3, 6])
            want = [np.mean([r[metric] for r in logged(records, theta, round=t)]) for t in (3, 6)]
            np.testing.assert_allclose(lines[label].get_ydata(), want, rtol=2e-6)
    fig = api["drawn"]["fig16_kept_clients_synthetic_linear.png"]
    lines = {l.get_label(): l for l in fig.axes[0].lines}
    for label, theta in LABELS.items():
        np.testing.assert_array_equal(lines[label].get_xdata(), np.arange(1, 7))
        y = lines[label].get_ydata()
        for t in (3, 6):
            assert y[t - 1] == np.mean([r["num_selected"]
                                        for r in logged(records, theta, round=t)])
    assert math.isfinite(float(np.sum(y)))


def test_a_failing_report_leaves_no_folder(sampled_run, tmp_path, capsys, monkeypatch):
    run_dir, _ = sampled_run

    def broken(*args, **kwargs):
        raise RuntimeError("a figure failed")

    monkeypatch.setattr(figures, "scatter_figure", broken)
    fresh = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(RuntimeError, match="a figure failed"):
        cli([run_dir, f"--out={fresh}"], capsys)
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"      # a report's own folder (its marker) with a file added
    outputs.mark_command_dir(str(kept), report_cli.MARKER, "experiments.report")
    marker = (kept / report_cli.MARKER).read_bytes()
    (kept / "notes.md").write_text("mine")
    with pytest.raises(RuntimeError):
        cli([run_dir, f"--out={kept}"], capsys)
    assert sorted(os.listdir(kept)) == [report_cli.MARKER, "notes.md"]
    assert (kept / "notes.md").read_text() == "mine"
    assert (kept / report_cli.MARKER).read_bytes() == marker
    assert sorted(os.listdir(tmp_path)) == ["kept"]
