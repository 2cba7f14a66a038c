"""Results as the papers show them: tables over seeds, per-client figures, curves over rounds.

Reads the directories that :func:`deltafl_jax.run_experiment` writes (see
:mod:`deltafl_jax.outputs.directory`) and builds what Section 5 and Appendix C.3 of *Device
Heterogeneity in Federated Learning: A Superquantile Approach* show:

- Table 2 (90th percentile) and Table 3 (mean) of the per-client test misclassification error,
  in %, mean +- std over seeds, one column per algorithm / conformity level theta /
  baseline hyper-parameter value, one row per dataset and model; the alpha-weighted
  train-loss mean and 90th percentile likewise;
- Fig. 4 (and Figs. 12-13): histograms of the per-client test error (and train loss) of the
  final models, each client's value averaged over seeds (App. C.3);
- Fig. 5 (and Figs. 14-15): scatter of the train loss and of the test error of each client
  against its number of examples;
- Figs. 6-11: train-loss mean and p90, test-error mean and p90 over rounds;
- Fig. 16: clients kept per round by the filter, mean over seeds with a min/max band;
- the error by availability quintile of the clients, for runs given their availability
  (:mod:`~deltafl_jax.report.availability`);
- for runs on the virtual clock, the test error against virtual time
  (:mod:`~deltafl_jax.report.virtual_time`) and, beside it, the table of the deadline's drop
  rate by compute-speed quintile (:mod:`~deltafl_jax.report.speed_drops`);
- the clients x classes heat map of a run that partitioned its data with ``--partition``
  (:mod:`~deltafl_jax.report.partition`);
- Fig. 3 (Gaussian toy runs): the means and models, the loss of every mixture of the three
  clients (theta-model minus FedAvg) and the histogram of mixture losses for mixtures drawn
  uniformly with conformity >= theta.

Conventions (App. C.2.3): train losses are weighted by alpha_k (proportional to n_k) over the
training clients, test errors are unweighted over the test clients. Percentiles are the lower
weighted quantile (the smallest client value whose cumulative weight reaches the level) by
default; ``percentile="linear"`` is NumPy's linear interpolation, unweighted, as the
reference scripts computed it. Every number is recomputed from the per-client arrays
(``clients.npz`` for the final models, ``clients_history.npz`` for the curves) with
:func:`deltafl_jax.evaluation.metrics.summarize`, so that either convention applies to any run.

Runs that are missing or incomplete are skipped with a one-line reason, never an exception:
:func:`load` returns them next to the runs it could read.

Notebooks: :func:`load_runs` returns tidy rows (a pandas DataFrame when pandas is installed,
else a list of dicts); :func:`write_report` is what ``python -m experiments.report`` runs.
Runs still in progress (metrics.jsonl but no summary.json yet) are skipped, saying so.

Modules: :mod:`~deltafl_jax.report.io` (reading runs through
:class:`deltafl_jax.outputs.directory.RunReader`), :mod:`~deltafl_jax.report.tables` (columns, method
names, markdown tables), :mod:`~deltafl_jax.report.rows` (tidy rows, CSV, DataFrames), :mod:`~deltafl_jax.report.figures` (matplotlib) and
:mod:`~deltafl_jax.report.document` (report.md). This package re-exports their public names,
each imported from its module on first use (PEP 562's module ``__getattr__``): reading runs
(:func:`load`) imports NumPy only, the tables JAX (the metrics), the figures matplotlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltafl_jax.lazy_exports import lazy_attributes

if TYPE_CHECKING:
    from deltafl_jax.report.document import CONVENTIONS, write_report
    from deltafl_jax.report.figures import (CURVE_PANELS, HISTOGRAM_BINS, curve_data,
                                            curves_figure, histogram_data, histogram_figure,
                                            kept_data, kept_figure, mixture_data,
                                            mixture_figure, scatter_figure, uniform_mixtures)
    from deltafl_jax.report.io import (KINDS, Run, RunError, curves_from_history,
                                       curves_from_records, find_run_dirs, load, read_run)
    from deltafl_jax.report.rows import load_runs, tidy_rows, write_csv
    from deltafl_jax.report.tables import (BEST_MARK, TABLES, Cell, Column, TableSpec,
                                           best_columns, columns, markdown_table, method_label,
                                           run_columns, runs_table, settings, table)

# Each public name -> the module that defines it.
_EXPORTS = {
    **dict.fromkeys(["CONVENTIONS", "write_report"], "deltafl_jax.report.document"),
    **dict.fromkeys(["CURVE_PANELS", "HISTOGRAM_BINS", "curve_data", "curves_figure",
                     "histogram_data", "histogram_figure", "kept_data", "kept_figure",
                     "mixture_data", "mixture_figure", "scatter_figure", "uniform_mixtures"],
                    "deltafl_jax.report.figures"),
    **dict.fromkeys(["KINDS", "Run", "RunError", "curves_from_history", "curves_from_records",
                     "find_run_dirs", "load", "read_run"], "deltafl_jax.report.io"),
    **dict.fromkeys(["load_runs", "tidy_rows", "write_csv"], "deltafl_jax.report.rows"),
    **dict.fromkeys(["BEST_MARK", "TABLES", "Cell", "Column", "TableSpec", "best_columns",
                     "columns", "markdown_table", "method_label", "run_columns", "runs_table",
                     "settings", "table"], "deltafl_jax.report.tables"),
}

__all__ = [
    "KINDS", "Run", "RunError", "curves_from_history", "curves_from_records", "find_run_dirs",
    "load", "load_runs", "read_run", "tidy_rows", "write_csv",
    "BEST_MARK", "TABLES", "Cell", "Column", "TableSpec",
    "best_columns", "columns",
    "markdown_table", "method_label", "run_columns", "runs_table", "settings", "table",
    "CURVE_PANELS", "HISTOGRAM_BINS", "curve_data", "curves_figure", "histogram_data",
    "histogram_figure", "kept_data", "kept_figure", "mixture_data", "mixture_figure",
    "scatter_figure", "uniform_mixtures",
    "CONVENTIONS", "write_report",
]


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, __all__)
