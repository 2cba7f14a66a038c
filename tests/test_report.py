"""Reports of real tiny runs: the tables against metrics.jsonl and against NumPy written another
way (percentiles by repeating each loss n_k times), the figures' plotted arrays, the CSV files,
and runs that are missing or incomplete (skipped with one line, never a crash)."""

import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import run_command
from deltafl_jax import DataConfig, ExperimentConfig, run_experiment
from deltafl_jax import report
from deltafl_jax.replicas.labels import ReplicaLabel
from experiments import report as report_cli

REPO = os.path.dirname(os.path.dirname(__file__))
TINY_DATA = DataConfig("synthetic", synthetic_num_clients=20, synthetic_max_examples=120,
                       synthetic_shared=0.8)


def tiny_run(out_dir, **overrides):
    """A run of tests/tiny.flags' size, written to out_dir."""
    base = dict(data=TINY_DATA, model="linear", algorithm="deltafl", thetas=(1.0, 0.5),
                seeds=(1, 2), num_rounds=6, clients_per_round=4, batch_size=16,
                learning_rate=0.05, eval_every=3, output_dir=str(out_dir), save_models=False,
                verbose=False)
    base.update(overrides)
    run_experiment(ExperimentConfig(**base))
    return str(out_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    delta = tiny_run(root / "delta")
    fedavg = tiny_run(root / "fedavg", algorithm="fedavg", thetas=(), seeds=(1, 2, 3),
                      learning_rate=0.1)
    return {"delta": delta, "fedavg": fedavg, "root": str(root)}


def cli(argv, capsys=None):
    """experiments.report in-process (conftest.run_command): (exit code, stderr, stdout)."""
    return run_command(report_cli, argv, capsys)


# --------------------------------------------------------------------------------------------
# Independent references


def lower_percentile(values, counts, percent):
    """The reference code's rule: repeat value k counts[k] times, sort, take index
    ceil(N p) - 1, in exact integer arithmetic."""
    rep = np.sort(np.repeat(np.asarray(values, np.float64), np.asarray(counts, np.int64)))
    k = -(-len(rep) * percent // 100)
    return rep[max(k - 1, 0)]


def reference_final(run_dir, percentile):
    """(theta or algorithm, seed) -> metrics, from clients.npz with NumPy only."""
    z = np.load(os.path.join(run_dir, "clients.npz"))
    n = z["train_sizes"]
    out = {}
    for r, key in enumerate(z["replica_keys"]):
        tl, te = z["train_loss"][r], z["test_error"][r]
        if percentile == "lower":
            p_train = lower_percentile(tl, n, 90)
            p_test = lower_percentile(te, np.ones_like(te, dtype=np.int64), 90)
        else:
            p_train, p_test = np.percentile(tl, 90), np.percentile(te, 90)
        out[str(key)] = {"train_loss_mean": np.sum(tl * n) / np.sum(n),
                         "train_loss_p90": p_train,
                         "test_error_mean": te.sum() / te.size, "test_error_p90": p_test}
    return out


def last_records(run_dir):
    records = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    last = max(r["round"] for r in records)
    return [r for r in records if r["round"] == last]


def parse_tables(md):
    """Section title -> (column labels, {row: [cell text]})."""
    tables, title, lines = {}, None, md.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            title = line[3:]
        elif line.startswith("| Dataset / model") and title:
            header = [c.strip() for c in line.strip("|").split("|")][1:]
            rows = {}
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                cells = [c.strip() for c in body.strip("|").split("|")]
                rows[cells[0]] = cells[1:]
            tables[title] = (header, rows)
    return tables


def cell_numbers(text):
    mean, std = text.replace("**", "").split("±")
    return float(mean), float(std)


def table_of(tables, prefix):
    (title,) = [t for t in tables if t.startswith(prefix)]
    return tables[title]


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("percentile", ["lower", "linear"])
def test_tables_against_metrics_jsonl_and_numpy(runs, tmp_path, capsys, percentile):
    out = tmp_path / "rep"
    code, err, stdout = cli([runs["delta"], runs["fedavg"], f"--out={out}",
                             f"--percentile={percentile}"], capsys)
    assert code == 0, err
    assert "wrote" in stdout and os.path.exists(out / "report.md")
    md = open(out / "report.md").read()
    tables = parse_tables(md)
    assert ("linear interpolation" in md) and ("α_k" in md) and ("unweighted" in md)

    ref = {name: reference_final(runs[name], percentile) for name in ("delta", "fedavg")}
    jsonl = {name: last_records(runs[name]) for name in ("delta", "fedavg")}
    # Column -> (run, replica keys); the row holds two runs, so every column names its run.
    columns = {"FedAvg [delta]": ("delta", ["theta=1_seed=1", "theta=1_seed=2"]),
               "Δ-FL, θ = 0.5 [delta]": ("delta", ["theta=0.5_seed=1", "theta=0.5_seed=2"]),
               "FedAvg [fedavg]": ("fedavg", [f"theta=1_seed={s}" for s in (1, 2, 3)])}
    specs = {"Table 2": ("test_error_p90", 100.0), "Table 3": ("test_error_mean", 100.0),
             "Train loss: alpha-weighted mean": ("train_loss_mean", 1.0),
             "Train loss: 90th": ("train_loss_p90", 1.0)}
    for prefix, (metric, scale) in specs.items():
        header, rows = table_of(tables, prefix)
        assert sorted(header) == sorted(columns)
        assert list(rows) == ["synthetic / linear"]
        digits = 2 if scale == 100.0 else 4
        for label, (run, keys) in columns.items():
            mean, std = cell_numbers(rows["synthetic / linear"][header.index(label)])
            per_seed = np.array([ref[run][k][metric] for k in keys]) * scale
            assert mean == pytest.approx(per_seed.mean(), abs=0.51 * 10 ** -digits)
            assert std == pytest.approx(per_seed.std(), abs=0.51 * 10 ** -digits)
            if percentile == "lower" or metric.endswith("mean"):
                # metrics.jsonl (the runner's own summary) says the same.
                logged = np.array([r[metric] for r in jsonl[run]
                                   if f"theta={r['theta']:g}_seed={r['seed']}" in keys])
                assert len(logged) == len(keys)
                np.testing.assert_allclose(np.sort(logged * scale), np.sort(per_seed),
                                           rtol=1e-6)

    # final.csv carries the unrounded values.
    with open(out / "final.csv") as f:
        final = list(csv.DictReader(f))
    assert len(final) == 4 + 3
    for row in final:
        want = ref[row["run"]][row["replica"]]
        for metric in ("train_loss_mean", "train_loss_p90", "test_error_mean",
                       "test_error_p90"):
            assert float(row[metric]) == pytest.approx(want[metric], rel=1e-6, abs=1e-7)


@pytest.fixture(scope="module")
def delta_report(runs, tmp_path_factory):
    """The folder of ``experiments.report`` (in-process) on the delta run alone, at the
    defaults: written once, read by the tests below."""
    out = tmp_path_factory.mktemp("delta_report") / "rep"
    code, err, _ = cli([runs["delta"], f"--out={out}"])
    assert code == 0, err
    return out


def test_bold_marks_the_lowest_mean_of_the_row(delta_report):
    header, rows = table_of(parse_tables(open(delta_report / "report.md").read()), "Table 2")
    cells = rows["synthetic / linear"]
    means = [cell_numbers(c)[0] for c in cells]
    bold = [c.startswith("**") for c in cells]
    assert header == ["FedAvg", "Δ-FL, θ = 0.5"]
    assert bold == [m == min(means) for m in means]


@pytest.fixture(scope="module")
def delta_columns(runs):
    """(columns of the delta run, its clients.npz, method label -> replica indices)."""
    runs_read, skipped = report.load([runs["delta"]])
    assert skipped == []
    cols = report.columns(runs_read)
    assert [c.label for c in cols] == ["FedAvg", "Δ-FL, θ = 0.5"]
    z = dict(np.load(os.path.join(runs["delta"], "clients.npz")))
    keys = list(z["replica_keys"])
    reps = {"FedAvg": [keys.index("theta=1_seed=1"), keys.index("theta=1_seed=2")],
            "Δ-FL, θ = 0.5": [keys.index("theta=0.5_seed=1"), keys.index("theta=0.5_seed=2")]}
    return cols, z, reps


def test_histograms_plot_the_seed_averaged_per_client_values(delta_columns):
    cols, z, reps = delta_columns
    # Fig. 4: bars are the fractions of test clients per bin of the seed-averaged error.
    fig = report.histogram_figure(cols, "test", "error")
    for ax in fig.axes[:2]:
        r = reps[ax.get_title()]
        err = z["test_error"][r].mean(axis=0)
        bars = ax.patches
        edges = np.array([b.get_x() for b in bars] + [bars[-1].get_x() + bars[-1].get_width()])
        # 5 %-wide bins on [0, 1] (rebuilt exactly: errors like 1/4 sit on the edges).
        np.testing.assert_allclose(edges, np.arange(21) / 20, atol=1e-12)
        counts, _ = np.histogram(err, bins=np.arange(21) / 20)
        np.testing.assert_allclose([b.get_height() for b in bars], counts / err.size)
        # The dashed line: the table's p90 (the mean over the seeds of each seed's p90, not
        # the p90 of the seed-averaged bars), labelled along it in percent as the table
        # prints it.
        table = np.mean([lower_percentile(z["test_error"][i], np.ones(err.size, int), 90)
                         for i in r])
        assert ax.lines[0].get_xdata()[0] == pytest.approx(table, rel=1e-6)
        (text,) = [t.get_text() for t in ax.texts if "p90" in t.get_text()]
        assert text.strip() == f"p90 = {100 * table:.2f}"
        # Errors in percent, as in the tables.
        assert ax.xaxis.get_major_formatter()(0.575, 0) == "57.5"
        assert "(%)" in ax.get_xlabel()
    # Train-loss histogram: bars are alpha-weighted.
    fig = report.histogram_figure(cols, "train", "loss")
    for ax in fig.axes[:2]:
        loss = z["train_loss"][reps[ax.get_title()]].mean(axis=0)
        bars = ax.patches
        edges = np.array([b.get_x() for b in bars] + [bars[-1].get_x() + bars[-1].get_width()])
        mass, _ = np.histogram(loss, bins=edges, weights=z["train_sizes"])
        np.testing.assert_allclose([b.get_height() for b in bars],
                                   mass / z["train_sizes"].sum(), atol=1e-12)
        # The line sits at the table's alpha-weighted p90 (mean over the seeds).
        table = np.mean([lower_percentile(z["train_loss"][i], z["train_sizes"], 90)
                         for i in reps[ax.get_title()]])
        assert ax.lines[0].get_xdata()[0] == pytest.approx(table, rel=1e-5)


def test_scatter_plots_client_size_against_the_seed_averaged_values(delta_columns):
    cols, z, reps = delta_columns
    # Fig. 5: scatter of (n_k, value averaged over seeds).
    fig = report.scatter_figure(cols)
    top, bottom = fig.axes[:2], fig.axes[2:4]
    for j, label in enumerate(["FedAvg", "Δ-FL, θ = 0.5"]):
        r = reps[label]
        np.testing.assert_allclose(
            top[j].collections[0].get_offsets(),
            np.column_stack([z["train_sizes"], z["train_loss"][r].mean(0)]))
        np.testing.assert_allclose(
            bottom[j].collections[0].get_offsets(),
            np.column_stack([z["test_sizes"], z["test_error"][r].mean(0)]))
        assert bottom[j].yaxis.get_major_formatter()(0.25, 0) == "25"
    # The log axes' tick labels do not overlap once drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    for ax in fig.axes[:4]:
        boxes = sorted((b.x0, b.x1) for t in ax.xaxis.get_ticklabels(which="both")
                       if t.get_visible() and t.get_text()
                       for b in [t.get_window_extent()])
        assert boxes, ax.get_xlabel()
        assert all(a[1] <= b[0] for a, b in zip(boxes, boxes[1:])), boxes


def test_curves_and_kept_clients_plot_the_per_round_data(runs, delta_columns):
    cols, _, _ = delta_columns
    # Figs. 6-11: mean over seeds at every evaluation, as metrics.jsonl logged it.
    records = [json.loads(l) for l in open(os.path.join(runs["delta"], "metrics.jsonl"))]
    fig = report.curves_figure(cols)
    metrics = ["train_loss_mean", "train_loss_p90", "test_error_mean", "test_error_p90"]
    for ax, metric in zip(fig.axes[:4], metrics):
        lines = {l.get_label(): l for l in ax.lines}
        for label, theta in (("FedAvg", 1.0), ("Δ-FL, θ = 0.5", 0.5)):
            rounds = sorted({r["round"] for r in records})
            want = [np.mean([r[metric] for r in records
                             if r["round"] == t and r["theta"] == theta]) for t in rounds]
            np.testing.assert_array_equal(lines[label].get_xdata(), rounds)
            np.testing.assert_allclose(lines[label].get_ydata(), want, rtol=2e-6)

    # Fig. 16: clients kept per round, mean over seeds and a min/max band.
    rz = np.load(os.path.join(runs["delta"], "rounds.npz"))
    rkeys = list(rz["replica_keys"])
    fig = report.kept_figure(cols)
    ax = fig.axes[0]
    for j, label in enumerate(["FedAvg", "Δ-FL, θ = 0.5"]):
        theta = "1" if label == "FedAvg" else "0.5"
        sel = rz["num_selected"][:, [rkeys.index(f"theta={theta}_seed={s}") for s in (1, 2)]]
        line = [l for l in ax.lines if l.get_label() == label][0]
        np.testing.assert_array_equal(line.get_xdata(), np.arange(1, 7))
        np.testing.assert_allclose(line.get_ydata(), sel.mean(axis=1))
        band = ax.collections[j].get_paths()[0].vertices
        for t in range(6):
            ys = band[np.isclose(band[:, 0], t + 1), 1]
            assert ys.min() == sel[t].min() and ys.max() == sel[t].max()
    assert rz["num_selected"][:, rkeys.index("theta=1_seed=1")].tolist() == [4] * 6


def test_clients_csv_holds_every_final_per_client_value(runs, delta_report):
    z = np.load(os.path.join(runs["delta"], "clients.npz"))
    with open(delta_report / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    R, n_train = z["train_loss"].shape
    n_test = z["test_loss"].shape[1]
    assert len(rows) == R * (n_train + n_test)
    keys = list(z["replica_keys"])
    for row in rows:
        r, k = keys.index(row["replica"]), int(row["client_index"])
        split = row["split"]
        assert float(row["loss"]) == z[f"{split}_loss"][r, k]
        assert float(row["error"]) == z[f"{split}_error"][r, k]
        assert int(row["num_examples"]) == z[f"{split}_sizes"][k]
        assert row["client_id"] == str(z[f"{split}_client_ids"][k])
    for name in ("fig4_hist_test_error_synthetic_linear.png", "fig5_scatter_synthetic_linear.png",
                 "fig6_curves_synthetic_linear.png",
                 "fig16_kept_clients_synthetic_linear.png"):
        assert os.path.getsize(delta_report / name) > 1000, name
        assert f"]({name})" in open(delta_report / "report.md").read()


def test_missing_and_incomplete_runs_are_skipped_with_one_line(runs, tmp_path, capsys):
    missing = tmp_path / "nope"
    cut = tmp_path / "cut"            # stopped before the end: only metrics.jsonl
    cut.mkdir()
    shutil.copy(os.path.join(runs["delta"], "metrics.jsonl"), cut / "metrics.jsonl")
    broken = tmp_path / "broken"      # summary.json but a truncated clients.npz
    shutil.copytree(runs["delta"], broken)
    with open(broken / "clients.npz", "r+b") as f:
        f.truncate(100)
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "rep"
    code, err, _ = cli([runs["delta"], str(missing), str(cut), str(broken), str(empty),
                        f"--out={out}"], capsys)
    assert code == 0, err
    lines = [l for l in err.splitlines() if l.startswith("skipped")]
    assert len(lines) == 4
    assert lines[0] == f"skipped {missing}: no such directory"
    assert lines[1].startswith(f"skipped {cut}: in progress (or stopped): no summary.json yet")
    assert "the last at round 6" in lines[1]
    assert lines[2].startswith(f"skipped {broken}: clients.npz cannot be read")
    assert lines[3].startswith(f"skipped {empty}: not a run directory")
    md = open(out / "report.md").read()
    assert all(f"- {l}" in md for l in lines)
    assert "| synthetic / linear |" in md

    # Nothing usable: one line, exit code 2, no report.
    out2 = tmp_path / "rep2"
    code, err, _ = cli([str(missing), str(cut), f"--out={out2}"], capsys)
    assert code == 2
    assert err.splitlines()[-1].startswith("error: no complete run among")
    assert not (out2 / "report.md").exists()


@pytest.mark.parametrize("argv,message", [
    ([], "error: no run directory given"),
    (["RUN"], "error: --out is required"),
    (["RUN", "--out=OUT", "--percentile=cubic"], "error: flag --percentile=cubic"),
    (["RUN", "--out=FILE"], "exists and is not a directory"),
])
def test_bad_input_exits_2_with_one_line(runs, tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("x")
    argv = [a.replace("RUN", runs["delta"]).replace("OUT", str(tmp_path / "o"))
            .replace("FILE", str(tmp_path / "file")) for a in argv]
    code, err, _ = cli(argv, capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.report", str(tmp_path / "none"),
                           f"--out={tmp_path / 'o'}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"skipped {tmp_path / 'none'}: no such directory",
        f"error: no complete run among {tmp_path / 'none'} (see the lines above)"]


def test_a_run_without_history_uses_metrics_jsonl_for_lower_curves_only(runs, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(runs["delta"], old)
    os.remove(old / "clients_history.npz")
    (run,), _ = report.load([str(old)])
    assert any("no clients_history.npz" in n for n in run.notes)
    rounds, per = run.curves("lower")
    records = [json.loads(l) for l in open(old / "metrics.jsonl")]
    for r, key in enumerate(run.keys):
        mine = [x for x in records if f"theta={x['theta']:g}_seed={x['seed']}" == key]
        np.testing.assert_array_equal(rounds, [x["round"] for x in mine])
        np.testing.assert_array_equal(per["test_error_p90"][:, r],
                                      [x["test_error_p90"] for x in mine])
    assert run.curves("linear") is None
    out = report.write_report([run], str(tmp_path / "rep"), percentile="linear")
    assert not any("fig6_curves" in f for f in out["figures"])
    assert any("no curves for FedAvg, Δ-FL, θ = 0.5" in n for n in out["notes"])


def test_linear_curves_are_recomputed_from_the_client_history(runs):
    (run,), _ = report.load([runs["delta"]])
    h = np.load(os.path.join(runs["delta"], "clients_history.npz"))
    rounds, per = run.curves("linear")
    np.testing.assert_array_equal(rounds, h["rounds"])
    np.testing.assert_allclose(per["test_error_p90"],
                               np.percentile(h["test_error"].astype(np.float64), 90, axis=2))
    np.testing.assert_allclose(per["train_loss_p90"],
                               np.percentile(h["train_loss"].astype(np.float64), 90, axis=2))


def test_load_runs_gives_tidy_rows_and_a_dataframe_only_with_pandas(runs, monkeypatch):
    log = []
    rows = report.load_runs([runs["root"], "/nonexistent/run"], as_frame=False,
                            log=log.append)
    assert log == ["skipped /nonexistent/run: no such directory"]
    assert {r["method"] for r in rows} == {"FedAvg [delta]", "Δ-FL, θ = 0.5 [delta]",
                                           "FedAvg [fedavg]"}
    assert len(rows) == 4 + 3
    ref = reference_final(runs["delta"], "lower")
    for row in rows:
        if row["run"] == "delta":
            assert row["test_error_p90"] == pytest.approx(ref[row["replica"]]["test_error_p90"],
                                                          rel=1e-6)
    kept = report.load_runs(runs["delta"], kind="kept", as_frame=False)
    assert len(kept) == 4 * 6 and {r["num_selected"] for r in kept} <= set(range(1, 5))

    monkeypatch.setitem(sys.modules, "pandas", None)          # pandas not installed
    assert isinstance(report.load_runs(runs["delta"]), list)
    with pytest.raises(ImportError, match="needs pandas"):
        report.load_runs(runs["delta"], as_frame=True)

    made = []
    fake = types.ModuleType("pandas")
    fake.DataFrame = lambda rows: made.append(rows) or "frame"
    monkeypatch.setitem(sys.modules, "pandas", fake)          # pandas installed
    assert report.load_runs(runs["delta"], kind="curves") == "frame"
    assert len(made[0]) == 4 * 2 and {r["round"] for r in made[0]} == {3, 6}
    with pytest.raises(ValueError, match="unknown kind"):
        report.load_runs(runs["delta"], kind="nope")


def readme_notebook_snippet():
    """The documentation's Python block that calls load_runs (docs/guides/reports.md), as
    written."""
    with open(os.path.join(REPO, "docs", "guides", "reports.md")) as f:
        text = f.read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if "load_runs(" in b]
    assert len(found) == 1, found
    return found[0]


def test_the_readmes_load_runs_snippet_runs_as_written(runs, delta_report, tmp_path,
                                                       monkeypatch):
    """The snippet needs pandas, which the README's install command (the test extra) brings;
    it reads runs/synthetic relative to the working directory."""
    code = readme_notebook_snippet()
    assert 'load_runs("runs/synthetic")' in code and ".groupby(" in code
    os.makedirs(tmp_path / "runs")
    shutil.copytree(runs["delta"], tmp_path / "runs" / "synthetic")
    monkeypatch.chdir(tmp_path)
    lines = code.strip().splitlines()
    scope = {}
    exec("\n".join(lines[:-1]), scope)
    got = eval(lines[-1], scope)                        # the cell's displayed value
    import pandas
    assert isinstance(scope["df"], pandas.DataFrame)
    ref = reference_final(runs["delta"], "lower")
    by_method = {"FedAvg": [], "Δ-FL, θ = 0.5": []}
    for key, final in ref.items():
        by_method["FedAvg" if key.startswith("theta=1_") else "Δ-FL, θ = 0.5"].append(
            final["test_error_p90"])
    assert sorted(got.index) == sorted(by_method)
    # One std convention: the snippet's std is the report's (ddof = 0), which for
    # two seeds is 1/sqrt(2) of pandas' default sample std.
    md = open(delta_report / "report.md").read()   # the report of the same run
    header, rows = table_of(parse_tables(md), "Table 2")
    for method, values in by_method.items():
        assert got.loc[method, "mean"] == pytest.approx(np.mean(values), rel=1e-6)
        assert got.loc[method, "std"] == pytest.approx(np.std(values, ddof=0), rel=1e-6)
        assert got.loc[method, "std"] != pytest.approx(np.std(values, ddof=1), rel=1e-3)
        mean, std = cell_numbers(rows["synthetic / linear"][header.index(method)])
        assert std == pytest.approx(100 * got.loc[method, "std"], abs=0.0051)
    assert "ddof = 0" in md


def test_column_names_follow_the_papers_tables():
    L = ReplicaLabel
    cases = [(L("deltafl", 1.0, 1), "exact", "FedAvg"),
             (L("deltafl", 1.0, 1), "reference", "FedAvg"),
             (L("fedavg", 1.0, 2), "exact", "FedAvg"),
             (L("deltafl", 0.8, 1), "exact", "Δ-FL, θ = 0.8"),
             (L("deltafl", 0.5, 1), "reference", "Δ-FL, θ = 0.5 (reference filter)"),
             (L("qffl", 1.0, 1, "qffl_q", 10.0), "exact", "q-FFL, q = 10"),
             (L("afl_qffl", 1.0, 1, "qffl_q", 10.0), "exact", "AFL (q-FFL proxy), q = 10"),
             (L("afl", 1.0, 1, "afl_lambda_lr", 0.01), "exact", "AFL, γ_λ = 0.01"),
             (L("term", 1.0, 1, "term_t", 0.1), "exact", "TERM, t = 0.1"),
             (L("fedprox", 1.0, 1, "fedprox_mu", 0.01), "exact", "FedProx, μ = 0.01"),
             (L("fedavg_sub", 0.5, 3), "reference", "FedAvg-Sub, θ = 0.5"),
             (L("fedavg_sub", 1.0, 3, "fedavg_sub_clients", 4.0), "exact",
              "FedAvg-Sub, clients = 4"),
             (L("deltafl_alt", 0.5, 1, extra=(("eta_every", 5.0),)), "reference",
              "Δ-FL (alternating), θ = 0.5 (reference filter), T_η = 5"),
             (L("fedavg", 1.0, 1, extra=(("learning_rate", 0.1), ("lr_decay", 2.0))), "exact",
              "FedAvg, learning_rate = 0.1, lr_decay = 2"),
             (L("gone", 0.5, 1, extra=(("x", 2.0),)), "exact", "gone, θ = 0.5, x = 2")]
    for label, filt, want in cases:
        # summary.json's config: the options mapping, or (older runs) the top level.
        for run_config in ({"options": {"filter": filt}}, {"filter": filt}):
            assert report.method_label(label, run_config) == want
            assert report.method_label(label.to_json(), run_config) == want
        if filt == "exact":
            assert report.method_label(label) == want
    # A tuning grid's label dict of older runs, with its own "key".
    old = {"algorithm": "fedavg", "theta": 1.0, "learning_rate": 0.1, "lr_decay": 2.0,
           "seed": 1, "key": "lr=0.1_decay=2_seed=1"}
    assert report.method_label(old) == "FedAvg, learning_rate = 0.1, lr_decay = 2"


def test_best_cuts_the_tuned_sweeps_and_keeps_every_theta():
    """--best keeps one column of a sweep marked tuned (q of q-FFL; an algorithm that is not
    registered counts as a baseline) and every column of Delta-FL's and deltafl_alt's theta
    and T_eta."""
    L = ReplicaLabel
    labels = [L("deltafl", 1.0, 1), L("deltafl", 0.5, 1), L("qffl", 1.0, 1, "qffl_q", 0.1),
              L("qffl", 1.0, 1, "qffl_q", 1.0),
              L("deltafl_alt", 0.5, 1, extra=(("eta_every", 1.0),)),
              L("deltafl_alt", 0.5, 1, extra=(("eta_every", 5.0),)),
              L("gone", 1.0, 1, "x", 1.0), L("gone", 1.0, 1, "x", 2.0)]
    p90 = np.array([0.5, 0.4, 0.3, 0.2, 0.6, 0.1, 0.9, 0.8])
    run = types.SimpleNamespace(labels=labels, config={},
                                final=lambda percentile: {"test_error_p90": p90})
    cols = [report.Column(run=run, setting="s", label=f"c{r}", replicas=[r], seeds=[1],
                          identity=(r,)) for r in range(len(labels))]
    kept = report.best_columns(cols)
    assert [c.replicas[0] for c in kept] == [0, 1, 3, 4, 5, 7]
    assert [c.replicas[0] for c in kept if c.label.endswith(report.BEST_MARK)] == [3, 7]


def test_best_keeps_each_server_step_of_a_baseline():
    """q-FFL with the plain step and q-FFL with Adam's (--algorithm=qffl,qffl+adam) are two
    methods: --best keeps the best q of each; within a run that sweeps the server learning
    rate, the best (q, eta) pair."""
    L = ReplicaLabel
    qs = [L("qffl", 1.0, 1, "qffl_q", 0.1), L("qffl", 1.0, 1, "qffl_q", 1.0)]

    def run(config, p90, labels=qs):
        return types.SimpleNamespace(labels=labels, config=config,
                                     final=lambda percentile: {"test_error_p90": np.array(p90)})
    plain = run({"server_optimizer": "sgd", "server_lr": [1.0]}, [0.5, 0.4])
    adam = run({"server_optimizer": "adam", "server_lr": [0.03]}, [0.2, 0.3])
    swept = run({"server_optimizer": "adam", "server_lr": [0.01, 0.03]}, [0.6, 0.1, 0.7, 0.2],
                [dataclasses.replace(q, extra=(("server_lr", eta),)) for q in qs
                 for eta in (0.01, 0.03)])
    cols = [report.Column(run=r, setting="s", label=f"{i}{k}", replicas=[k], seeds=[1],
                          identity=(i, k))
            for i, r in enumerate((plain, adam, swept)) for k in range(len(r.labels))]
    kept = report.best_columns(cols)
    assert [(c.label.split()[0], c.label.endswith(report.BEST_MARK)) for c in kept] == [
        ("01", True), ("10", True), ("21", True)]


def test_a_run_of_a_newer_output_format_is_skipped_with_one_line(runs, tmp_path):
    new = tmp_path / "new"
    shutil.copytree(runs["delta"], new)
    summary = json.load(open(new / "summary.json"))
    summary["schema_version"] = 99
    json.dump(summary, open(new / "summary.json", "w"))
    log = []
    got, skipped = report.load([runs["delta"], str(new)], log=log.append)
    assert [r.path for r in got] == [runs["delta"]]
    assert log == skipped and len(skipped) == 1
    assert skipped[0].startswith(f"skipped {new}: summary.json has output format version 99")


def test_a_report_is_never_written_into_a_run(runs, tmp_path, capsys):
    """A run's folder holds only what a run writes, so that it can be rerun or
    continued; --out inside a reported run, or on a run, is refused with one line."""
    run_dir = tmp_path / "delta"
    shutil.copytree(runs["delta"], run_dir)
    for out in (run_dir / "report", run_dir, runs["fedavg"]):
        before = sorted(os.listdir(run_dir))
        code, err, _ = cli([str(run_dir), f"--out={out}"], capsys)
        lines = [l for l in err.splitlines() if l.strip()]
        assert code == 2 and len(lines) == 1, err
        assert ("is inside the run" in lines[0]) or ("is a run of deltafl_jax" in lines[0])
        assert sorted(os.listdir(run_dir)) == before


def test_runs_below_a_run_are_named_as_skipped(runs, tmp_path):
    """A folder that is a run and also holds one (an output folder of a run nested in
    another) is reported alone, and the report says which runs it leaves out."""
    outer = tmp_path / "outer"
    shutil.copytree(runs["delta"], outer)
    shutil.copytree(runs["fedavg"], outer / "fedavg")
    log = []
    loaded, skipped = report.load([str(outer)], log=log.append)
    assert [r.path for r in loaded] == [str(outer)]
    assert skipped == log == [f"skipped {outer / 'fedavg'}: inside the run {outer}, which is "
                              f"reported alone (name them to report them)"]
