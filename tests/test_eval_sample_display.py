"""Showing the intervals of a sampled evaluation (deltafl_jax.evaluation.sample): the progress line,
the closing table, the report's cells; and that the ``_lo`` / ``_hi`` summary keys flow
into metrics.jsonl (and back) unchanged. Hand-made summaries and runs, no training."""

import types

import numpy as np

from deltafl_jax.evaluation.sample import summarize_sample
from deltafl_jax.outputs.directory import RunReader, RunWriter, metrics_records
from deltafl_jax.replicas.labels import ReplicaLabel, replica_names
from deltafl_jax.report.document import markdown
from deltafl_jax.report.io import Run
from deltafl_jax.report.tables import TABLES, columns, markdown_table
from deltafl_jax.run.callbacks import Evaluation, RunContext
from deltafl_jax.run.progress import error_table, evaluation_line

LABELS = [ReplicaLabel("deltafl", 0.5, 1), ReplicaLabel("deltafl", 0.5, 2),
          ReplicaLabel("deltafl", 1.0, 1)]


def _summary(with_ci=True):
    s = {"train_loss_mean": np.array([0.5, 0.7, 0.9]),
         "test_error_mean": np.array([0.30, 0.32, 0.40]),
         "test_error_p90": np.array([0.41, 0.43, 0.55]),
         "test_loss_mean": np.array([1.0, 1.1, 1.2])}
    if with_ci:
        s["test_error_p90_lo"] = np.array([0.38, 0.40, 0.50])
        s["test_error_p90_hi"] = np.array([0.449, 0.451, np.inf])
    return s


def _run_context(loss_kind="cross_entropy"):
    view = types.SimpleNamespace(facts=types.SimpleNamespace(classify=loss_kind != "squared"),
                                 names=replica_names(LABELS, "Δ-FL"))
    return RunContext(view=view, num_rounds=10)


def test_progress_line_shows_the_p90_interval():
    run = _run_context()
    ev = Evaluation(round=5, per_client={}, summary=_summary(), records=[], elapsed_s=10.0)
    line = evaluation_line(run, ev)
    # θ = 0.5: the means over its two seeds of each bound: (38 + 40) / 2, (44.9 + 45.1) / 2
    assert "θ=0.5: train loss 0.600, test err mean 31.0% p90 42.0% [39.0, 45.0]" in line
    assert "θ=1: train loss 0.900, test err mean 40.0% p90 55.0% [50.0, inf]" in line
    plain = evaluation_line(run, Evaluation(round=5, per_client={}, summary=_summary(False),
                                            records=[], elapsed_s=10.0))
    assert "p90 42.0% |" in plain and "[" not in plain.split("|", 1)[1]
    squared = evaluation_line(_run_context("squared"), ev)
    assert "test loss mean 0.310 p90 0.420 [0.390, 0.450]" in squared


def test_closing_table_interval_column():
    finals = [{k: float(v[r]) for k, v in _summary().items()} for r in range(3)]
    lines = error_table([("θ=0.5", finals[:2]), ("θ=1", finals[2:])])
    assert lines[0].endswith("seeds  p90 interval")
    assert lines[1].split()[1:] == ["31.00%", "42.00%", "2", "[39.00,", "45.00]"]
    assert lines[2].split()[-2:] == ["[50.00,", "inf]"]
    plain = error_table([("θ=0.5", [{k: float(v[0]) for k, v in _summary(False).items()}])])
    assert plain[0].endswith("seeds") and plain[1].split()[-1] == "1"


def test_interval_keys_flow_into_metrics_jsonl(tmp_path):
    """metrics_records copies every summary key (the loop writes its records to
    metrics.jsonl); an infinite bound survives the JSON round trip."""
    rng = np.random.default_rng(0)
    summary = summarize_sample(rng.random((3, 4)), rng.random((3, 4)), rng.random((3, 4)),
                               [50, 90])
    metrics = {"num_selected": np.array([4, 4, 4]), "num_rejected": np.array([0, 1, 0])}
    records = metrics_records(3, [lab.to_json() for lab in LABELS], summary, metrics, 1.5)
    writer = RunWriter(str(tmp_path))
    writer.append_metrics(records)
    back = RunReader(str(tmp_path)).records()
    assert len(back) == 3
    for r, rec in enumerate(back):
        for key, v in summary.items():
            assert rec[key] == float(v[r]), key
    assert back[0]["test_error_p90_hi"] == np.inf       # K = 4 is too few at 95%
    assert back[0]["train_loss_p50_lo"] == -np.inf


def _hand_run(with_ci):
    """A Run as report.io reads one: two seeds of one method, final per-client arrays."""
    labels = LABELS[:2]
    keys = [lab.key() for lab in labels]
    train = np.array([[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.5]])
    test = np.array([[0.0, 0.25, 0.5, 1.0], [0.25, 0.25, 0.5, 0.75]])
    clients = {"train_loss": train, "train_sizes": np.array([1, 1, 1, 1]),
               "test_error": test, "test_loss": test, "test_sizes": np.array([4, 4, 4, 4])}
    final = {k: {} for k in keys}
    if with_ci:
        for k, (lo, hi) in zip(keys, [(0.30, 0.60), (0.40, 0.90)]):
            final[k] = {"test_error_p90_lo": lo, "test_error_p90_hi": hi,
                        "train_loss_p90_lo": 0.3, "train_loss_p90_hi": np.inf}
    summary = {"config": {"algorithm": "deltafl", "num_rounds": 3},
               "dataset": {"name": "toy"}, "model": "linear", "final": final}
    return Run(path="x", name="x", summary=summary, labels=labels, keys=keys,
               clients=clients, history=None, rounds=None, records=[],
               record_replicas=[], notes=[])


def test_report_cells_show_the_interval():
    spec_p90, spec_mean = TABLES[0], TABLES[1]
    cols = columns([_hand_run(True)])
    table = markdown_table(cols, spec_p90)
    # test p90 per seed: lower quantile ceil(0.9 * 4) = 4th value: 100%, 75% -> 87.5 ± 12.5;
    # the interval: means of the seeds' bounds, in %: [35.00, 75.00]
    assert "| toy / linear | 87.50 ± 12.50 [35.00, 75.00] |" in table
    assert "[" not in markdown_table(cols, spec_mean)          # no interval recorded
    assert "[0.3000, inf]" in markdown_table(cols, TABLES[3])
    assert "[" not in markdown_table(cols, spec_p90, "linear")  # intervals are of 'lower'
    plain = columns([_hand_run(False)])
    assert "| toy / linear | 87.50 ± 12.50 |" in markdown_table(plain, spec_p90)
    md = markdown([cols[0].run], cols, "lower", [], [], [])
    assert "--eval_clients" in md
    assert "--eval_clients" not in markdown([plain[0].run], plain, "lower", [], [], [])
