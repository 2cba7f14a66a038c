"""The report's columns and tables: which replicas form a method, how a method is named in the
papers' style, and the markdown tables (Tables 2 and 3, the train-loss tables, the runs).

A :class:`Column` is the replicas of one run that differ only by seed; runs on the same data
and model share a table row (:func:`columns`). Cells are mean +- std over seeds, the std being
the population standard deviation of the seeds' values (ddof = 0, as ``np.std``;
:data:`SEED_STD_DDOF`, :func:`seed_std`; pandas' ``std()`` is the sample one, ddof = 1).
A run evaluated on sampled clients (``--eval_clients``, :mod:`deltafl_jax.evaluation.sample`) keeps
each metric's confidence interval as ``METRIC_lo`` / ``METRIC_hi`` in summary.json's "final";
its cells then show ``[lo, hi]`` after mean +- std: the means over the seeds of each seed's
bounds (:data:`INTERVAL_NOTE`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from deltafl_jax.algorithms import registry
from deltafl_jax.algorithms.naming import label_parts, method_name, method_order
from deltafl_jax.optimizers.server import from_run_config
from deltafl_jax.replicas.labels import ReplicaLabel

if TYPE_CHECKING:
    from deltafl_jax.report.io import Run


# The one convention of every "mean ± std over seeds" of the package (report tables, the
# README's tables, load_runs' documented aggregation): the population standard deviation.
SEED_STD_DDOF = 0
STD_NOTE = ("mean ± std over seeds; std is the population standard deviation of the seeds' "
            "values (ddof = 0, as np.std; pandas' .std() gives ddof = 1)")


def seed_std(values) -> float:
    """The std of a cell: over the seeds' values, with ddof = :data:`SEED_STD_DDOF`."""
    return float(np.std(np.asarray(values, np.float64), ddof=SEED_STD_DDOF))


def fmt_value(v) -> str:
    """A number as '%g' (0.5, 10, 0.01); anything else as str."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float, np.integer, np.floating)):
        return f"{float(v):g}"
    return str(v)


def method_label(label: Union[ReplicaLabel, Mapping[str, Any]],
                 run_config: Optional[Mapping[str, Any]] = None) -> str:
    """A column name in the paper's style: 'FedAvg', 'Δ-FL, θ = 0.5', 'q-FFL, q = 10', from
    the algorithm's spec (:func:`~deltafl_jax.algorithms.naming.method_name`: its display
    name, its sweep's symbol, and what its options name, e.g. Delta-FL's reference filter).
    Further grid coordinates (e.g. a tuning grid's learning rate) are appended as
    'name = value'.

    A label dict (``ReplicaLabel.to_json()``) is accepted too. `run_config` is the run's
    configuration as summary.json stores it; an algorithm that is not registered is named
    by its registry name.
    """
    if not isinstance(label, ReplicaLabel):
        label = ReplicaLabel.from_json(label)
    spec = registry.find(label.algorithm)
    if spec is None:
        return ", ".join(label_parts(label.algorithm, label))
    return method_name(spec, label, run_config)


@dataclasses.dataclass(eq=False)
class Column:
    """The replicas that differ only by seed: one table cell per setting.

    setting: the row ('dataset / model'); label: the column, unique within the setting;
    replicas: indices into the run's arrays, in seed order; seeds: their seeds (of every
    part); identity: the replicas' ``ReplicaLabel.method_key()``. `more` holds further
    (run, replicas) parts: the other seeds' runs when each seed is its own dataset
    (``--resample_writers_per_seed``, :mod:`deltafl_jax.replicas.seed_programs`).
    """

    run: "Run"
    setting: str
    label: str
    replicas: List[int]
    seeds: List[int]
    identity: Tuple
    more: List[Tuple["Run", List[int]]] = dataclasses.field(default_factory=list)

    @property
    def parts(self) -> List[Tuple["Run", List[int]]]:
        """(run, replica indices) of every run that holds replicas of this column."""
        return [(self.run, self.replicas)] + list(self.more)

    def values(self, metric: str, percentile: str = "lower") -> np.ndarray:
        """[S] per-seed final values of `metric` (e.g. 'test_error_p90')."""
        return np.concatenate([np.asarray(run.final(percentile)[metric])[reps]
                               for run, reps in self.parts])

    def interval(self, metric: str) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """([S] lower, [S] upper) per-seed confidence bounds of `metric`'s final value, from
        summary.json's "final" (``metric_lo`` / ``metric_hi``, written by runs that sample
        their evaluation clients); None when a seed has none."""
        lo, hi = [], []
        for run, reps in self.parts:
            final = run.summary.get("final", {})
            for r in reps:
                got = final.get(run.keys[r], {})
                if f"{metric}_lo" not in got or f"{metric}_hi" not in got:
                    return None
                lo.append(float(got[f"{metric}_lo"]))
                hi.append(float(got[f"{metric}_hi"]))
        return np.asarray(lo), np.asarray(hi)

    def client_means(self, split: str, quantity: str) -> Tuple[np.ndarray, np.ndarray]:
        """(n_k [N], per-client value [N] averaged over seeds) for split 'train'/'test' and
        quantity 'loss'/'error' (App. C.3: each client's metric averaged over the seeds).
        When the seeds are different datasets, every seed's clients are pooled. A run that
        evaluated a sample of clients (``--eval_clients``) gives its sampled clients (the same
        sample for every replica of the run; training: the K draws, repeats included)."""
        sizes, means = [], []
        for run, reps in self.parts:
            arr = np.asarray(run.clients[f"{split}_{quantity}"], np.float64)[reps]
            sizes.append(run.client_sizes(split))
            means.append(arr.mean(axis=0))
        return np.concatenate(sizes), np.concatenate(means)

    def client_weights(self, split: str) -> np.ndarray:
        """[N] the weight of each value of :meth:`client_means` in the figures, summing to 1:
        the examples (training, alpha_k ∝ n_k) or the clients (test) that it stands for. An
        evaluated client stands for itself; a sampled one for its share of the population
        (training: each of the K draws, made with probability alpha_k, for sum n / K
        examples; test: each of the K uniform draws for N_test / K clients), so the weights
        of one sampled run are 1/K and its weighted mean is the mean that metrics.jsonl
        records."""
        parts = []
        for run, _ in self.parts:
            sizes = run.client_sizes(split).astype(np.float64)
            if run.sampled(split):
                population = np.asarray(run.clients[f"{split}_sizes"])
                total = float(population.sum()) if split == "train" else float(population.size)
                parts.append(np.full(sizes.size, total / sizes.size))
            else:
                parts.append(sizes if split == "train" else np.ones(sizes.size))
        w = np.concatenate(parts)
        return w / w.sum()

    @property
    def sampled(self) -> bool:
        """Every run of the column evaluated a sample of clients (``--eval_clients``)."""
        return all(run.sampled("train") for run, _ in self.parts)


def run_columns(run: "Run") -> List[Tuple[str, Tuple, List[int], List[int]]]:
    """(label, identity, replicas, seeds) per method of one run, in replica order."""
    order: Dict[Tuple, List[int]] = {}
    for r, lab in enumerate(run.labels):
        order.setdefault(lab.method_key(), []).append(r)
    return [(method_label(run.labels[rs[0]], run.config), ident, rs,
             [run.labels[r].seed for r in rs]) for ident, rs in order.items()]


def columns(runs: Sequence["Run"]) -> List[Column]:
    """Every (setting, method) column over the runs, in the report's order (:func:`ordered`).

    Runs with the same dataset, model and data settings share a row, so that several runs
    (e.g. FedAvg and Delta-FL, or a baseline) sit side by side. In a row whose columns come
    from several runs, every column gets its run's name appended ('Δ-FL, θ = 0.5 [run_a]').
    """
    # Rows: setting keys; two keys with the same display name get the run name appended.
    display: Dict[Tuple, str] = {}
    for run in runs:
        if run.setting_key not in display:
            name = run.setting
            if name in display.values():
                name = f"{name} ({run.name})"
            display[run.setting_key] = name
    cols = [Column(run=run, setting=display[run.setting_key], label=label, replicas=rs,
                   seeds=seeds, identity=ident)
            for run in runs for label, ident, rs, seeds in run_columns(run)]
    by_cell: Dict[Tuple[str, str], List[Column]] = {}
    for c in cols:
        by_cell.setdefault((c.setting, c.label), []).append(c)
    merged = set()
    for same_cell in by_cell.values():
        if len(same_cell) > 1 and seed_programs_of_one_column(same_cell):
            same_cell[0].more = [(c.run, c.replicas) for c in same_cell[1:]]
            same_cell[0].seeds = [s for c in same_cell for s in c.seeds]
            merged.update(id(c) for c in same_cell[1:])
    cols = [c for c in cols if id(c) not in merged]
    # A row whose columns come from several runs names every column's run (the seeds' runs
    # of one column count as one run, named by their common directory).
    row_runs: Dict[str, set] = {}
    for c in cols:
        row_runs.setdefault(c.setting, set()).add(column_run_name(c))
    for c in cols:
        if len(row_runs[c.setting]) > 1:
            c.label = f"{c.label} [{column_run_name(c)}]"
    return ordered(cols)


def column_order(col: Column) -> Tuple:
    """The sort key of a column within its row: FedAvg first, then the registry's order
    (:func:`~deltafl_jax.algorithms.naming.method_order`)."""
    label = col.run.labels[col.replicas[0]]
    return method_order(label.algorithm, label)


def ordered(cols: Sequence[Column]) -> List[Column]:
    """The columns in the report's order, used by its tables and its figures alike: the rows
    (settings) in first-seen order, within a row FedAvg first, then the methods in the
    registry's order (:func:`column_order`); the columns of one method keep their run's order
    (for Δ-FL, its --thetas)."""
    rows = settings(cols)
    return sorted(cols, key=lambda c: (rows.index(c.setting), column_order(c)))


def column_run_name(col: Column) -> str:
    """The run a column comes from: its run's name, or, when each seed is its own run, the
    name of the directory that holds them all."""
    if not col.more:
        return col.run.name
    paths = [os.path.abspath(run.path) for run, _ in col.parts]
    return os.path.basename(os.path.commonpath(paths)) or col.run.name


def seed_programs_of_one_column(same_cell: Sequence[Column]) -> bool:
    """Columns of runs that are the per-seed programs of one experiment (each seed its own
    dataset, --resample_writers_per_seed) and hold different seeds: they form one column."""
    seeds = [s for c in same_cell for s in c.seeds]
    return (all(c.run.resampled_per_seed for c in same_cell)
            and len(set(seeds)) == len(seeds))


BEST_MARK = "†"
BEST_NOTE = ("† each baseline at its best swept value (q, μ, t, γ_λ, FedAvg-Sub's clients; "
             "with the server learning rate η_s when a run sweeps it), once per server step, "
             "the one with the smallest mean over seeds of the test 90th percentile, as the "
             "papers' tables (CISS 2021 Sec. V: \"report q with the smallest 90th percentile of "
             "misclassification error on test devices\"); Δ-FL's θ are all shown. Every value "
             "is in final.csv.")


def column_algorithm(col: Column) -> str:
    return col.run.labels[col.replicas[0]].algorithm


def column_is_tuned(col: Column) -> bool:
    """The column's swept value is a hyper-parameter to tune (``Sweep.tuned``: a baseline's
    q, mu, t, ...), not a model the user asks for (Delta-FL's theta). A column of an algorithm
    that is not registered counts as tuned."""
    label = col.run.labels[col.replicas[0]]
    spec = registry.find(label.algorithm)
    sweep = spec.sweep_of(label) if spec is not None else None
    return sweep is None or sweep.tuned


def server_step(run_config) -> Tuple:
    """What identifies a run's server step: the optimizer, its settings, and its learning rate
    unless the run sweeps several (its columns then name it, and --best picks among them)."""
    server = from_run_config(run_config or {})
    lrs = server.learning_rates
    return (server.name, server.settings(), lrs if len(lrs) == 1 else "swept")


def best_columns(cols: Sequence[Column], percentile: str = "lower",
                 metric: str = "test_error_p90") -> List[Column]:
    """The columns with each baseline's sweep cut to its best value: within a row, the
    columns of one algorithm and one server step (:func:`server_step`: FedAdam's q-FFL is
    not q-FFL) whose swept value is tuned (:func:`column_is_tuned`: not Δ-FL, whose θ are all
    kept, nor FedAvg) keep only the one with the smallest mean `metric` over seeds (ties: the
    first; a swept server learning rate is tuned with it), marked with :data:`BEST_MARK` in
    its label. A baseline with one value is kept as it is."""
    groups: Dict[Tuple, List[Column]] = {}
    for c in cols:
        if column_is_tuned(c):
            groups.setdefault((c.setting, column_algorithm(c), server_step(c.run.config)),
                              []).append(c)
    dropped = set()
    for group in groups.values():
        if len(group) < 2:
            continue
        means = [float(np.mean(c.values(metric, percentile))) for c in group]
        finite = [i for i, m in enumerate(means) if math.isfinite(m)]
        if not finite:
            continue
        win = min(finite, key=lambda i: means[i])
        group[win].label = f"{group[win].label} {BEST_MARK}"
        dropped.update(id(c) for i, c in enumerate(group) if i != win)
    return [c for c in cols if id(c) not in dropped]


def settings(cols: Sequence[Column]) -> List[str]:
    """The rows (settings) in first-seen order."""
    out = []
    for c in cols:
        if c.setting not in out:
            out.append(c.setting)
    return out


@dataclasses.dataclass(frozen=True)
class TableSpec:
    metric: str
    title: str
    percent: bool


TABLES = (
    TableSpec("test_error_p90", "Table 2: 90th percentile of the misclassification error (in %) "
              "on the test clients", True),
    TableSpec("test_error_mean", "Table 3: mean of the misclassification error (in %) on the "
              "test clients", True),
    TableSpec("train_loss_mean", "Train loss: alpha-weighted mean over the training clients",
              False),
    TableSpec("train_loss_p90", "Train loss: 90th percentile (alpha-weighted) over the "
              "training clients", False),
    TableSpec("test_error_worst10", "Worst 10%: mean misclassification error (in %) of the "
              "worst 10% of the test clients (the superquantile at 0.9)", True),
    TableSpec("test_error_std", "Std of the misclassification error (in %) over the test "
              "clients (ddof = 0)", True),
    TableSpec("test_share_below_target", "Share (in %) of the test clients whose accuracy is "
              "below the target (--target_accuracy)", True),
)


def personal_tables(cols: Sequence[Column]) -> Tuple[TableSpec, ...]:
    """The personalised evaluation's tables of the runs that made one (--client_holdout):
    per family (unseen devices after k adaptation steps, seen clients), the mean, p90 and
    worst-10% held-out error."""
    names: List[str] = []
    for c in cols:
        for key in c.run.final():
            name = key[:-len("_error_worst10")]
            if key.endswith("_error_worst10") and name.partition("_ft")[0] in (
                    "seen", "unseen") and name not in names:
                names.append(name)
    specs = []
    for name in sorted(names, key=lambda n: (int(n.partition("_ft")[2] or 0),
                                             n.startswith("seen"))):
        population, _, k = name.partition("_ft")
        who = ("unseen devices (test clients)" if population == "unseen" else
               "seen clients (training clients, their own model)")
        after = f"after {k} adaptation steps" if k else "without adaptation"
        for stat, what in (("mean", "mean"), ("p90", "90th percentile"),
                           ("worst10", "worst-10% mean")):
            specs.append(TableSpec(f"{name}_error_{stat}", f"Personalised: {what} of the "
                                   f"held-out error (in %) of {who}, {after}", True))
    return tuple(specs)


def available(cols: Sequence[Column], metric: str, percentile: str = "lower") -> bool:
    """Every column's runs have `metric` (a regression has no ``test_share_below_target``)."""
    return all(metric in run.final(percentile) for c in cols for run, _ in c.parts)


INTERVAL_NOTE = ("[lo, hi] after a cell: the run evaluated a sample of clients "
                 "(--eval_clients); the means over the seeds of each seed's confidence "
                 "interval (95% by default) for the metric (percentiles: distribution-free, "
                 "from order statistics; means: "
                 "normal approximation); ±inf where too few clients were sampled.")


@dataclasses.dataclass(frozen=True)
class Cell:
    mean: float
    std: float
    values: Tuple[float, ...]   # per seed, in the table's unit (% for errors)
    seeds: Tuple[int, ...]
    lo: Optional[float] = None  # sampled evaluation: mean over seeds of the lower bounds
    hi: Optional[float] = None


def table(cols: Sequence[Column], metric: str, percentile: str = "lower",
          percent: bool = False):
    """(rows, column labels, {(row, label): Cell}); mean and std (:func:`seed_std`) over seeds, and
    the means of the seeds' interval bounds when the runs recorded them (lower percentiles
    only: the intervals are of the lower quantile)."""
    rows = settings(cols)
    labels: List[str] = []
    cells: Dict[Tuple[str, str], Cell] = {}
    scale = 100.0 if percent else 1.0
    for c in cols:
        if c.label not in labels:
            labels.append(c.label)
        v = c.values(metric, percentile) * scale
        bounds = c.interval(metric) if percentile == "lower" else None
        lo, hi = (None, None) if bounds is None else (float(np.mean(b)) * scale for b in bounds)
        cells[(c.setting, c.label)] = Cell(mean=float(np.mean(v)), std=seed_std(v),
                                           values=tuple(float(x) for x in v),
                                           seeds=tuple(c.seeds), lo=lo, hi=hi)
    return rows, labels, cells


def format_cell(cell: Cell, digits: int) -> str:
    """'mean ± std' with `digits` decimals, then ' [lo, hi]' when the cell has an interval;
    'nan (diverged)' when not finite."""
    if not (math.isfinite(cell.mean) and math.isfinite(cell.std)):
        return "nan (diverged)"
    text = f"{cell.mean:.{digits}f} ± {cell.std:.{digits}f}"
    if cell.lo is not None and cell.hi is not None:
        text += f" [{cell.lo:.{digits}f}, {cell.hi:.{digits}f}]"
    return text


def markdown_table(cols: Sequence[Column], spec: TableSpec, percentile: str = "lower") -> str:
    """The table in the paper's layout; the lowest mean of each row is in bold."""
    rows, labels, cells = table(cols, spec.metric, percentile, spec.percent)
    digits = 2 if spec.percent else 4
    lines = ["| Dataset / model | " + " | ".join(labels) + " |",
             "|---|" + "---|" * len(labels)]
    for row in rows:
        finite = [cells[(row, l)].mean for l in labels
                  if (row, l) in cells and math.isfinite(cells[(row, l)].mean)]
        best = min(finite) if finite else None
        out = []
        for l in labels:
            cell = cells.get((row, l))
            if cell is None:
                out.append("—")
                continue
            text = format_cell(cell, digits)
            if best is not None and len(finite) > 1 and \
                    round(cell.mean, digits) == round(best, digits):
                text = f"**{text}**"
            out.append(text)
        lines.append(f"| {row} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def run_options(run_config: Mapping[str, Any]) -> str:
    """The options of a run that differ from their defaults, e.g. 'filter=reference' ('—'
    when none; '?' for an algorithm that is not registered)."""
    spec = registry.find(str(run_config.get("algorithm", "")))
    if spec is None:
        return "?"
    given, default = spec.stored_options(run_config), spec.options_type()
    changed = [f"{f.name}={fmt_value(getattr(given, f.name))}"
               for f in dataclasses.fields(given)
               if getattr(given, f.name) != getattr(default, f.name)]
    return ", ".join(changed) or "—"


def server_text(run_config) -> str:
    """'w + Δ' for the plain step, else the optimizer and its settings."""
    server = from_run_config(run_config or {})
    return "w + Δ" if server.is_default else server.describe()


def runs_table(runs: Sequence["Run"]) -> str:
    """One markdown row per run: data, model, algorithm and its options, rounds, schedule,
    seeds, time."""
    lines = ["| run | dataset (train / test clients, median n_k) | model | algorithm | options "
             "| server step | rounds | m | γ₀ (÷c every t₀) | λ | seeds | replicas | wall time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        c, d = run.config, run.summary.get("dataset", {})
        lr = fmt_value(c.get("learning_rate", "?"))
        if c.get("lr_decay_every") and c.get("lr_decay", 1) != 1:
            lr += f" (÷{c['lr_decay']:g} every {c['lr_decay_every']})"
        seeds = ",".join(str(s) for s in c.get("seeds", []))
        total = run.summary.get("timing", {}).get("total_s")
        lines.append(
            f"| `{run.path}` | {run.dataset} ({d.get('num_train_clients', '?')} / "
            f"{d.get('num_test_clients', '?')}, {d.get('median_examples', '?')}) | {run.model} | "
            f"{c.get('algorithm', '?')} | {run_options(c)} | {server_text(c)} | "
            f"{run.num_rounds} | "
            f"{c.get('clients_per_round', '?')} | {lr} | {fmt_value(c.get('l2_reg', 0))} | "
            f"{seeds} | {len(run.labels)} | {'' if total is None else f'{total:.0f} s'} |")
    return "\n".join(lines)
