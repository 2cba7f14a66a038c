"""Results as the papers show them: tables over seeds, per-client figures, curves over rounds.

Reads the directories that :func:`deltafl_jax.run_experiment` writes (see
:mod:`deltafl_jax.outputs`) and builds what Section 5 and Appendix C.3 of *Device
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
- Fig. 16: clients kept per round by the filter, mean over seeds with a min/max band.

Conventions (App. C.2.3): train losses are weighted by alpha_k (proportional to n_k) over the
training clients, test errors are unweighted over the test clients. Percentiles are the lower
weighted quantile (the smallest client value whose cumulative weight reaches the level) by
default; ``percentile="linear"`` is NumPy's linear interpolation, unweighted, as the
reference scripts computed it. Every number is recomputed from the per-client arrays
(``clients.npz`` for the final models, ``clients_history.npz`` for the curves) with
:func:`deltafl_jax.metrics.summarize`, so that either convention applies to any run.

Runs that are missing or incomplete are skipped with a one-line reason, never an exception:
:func:`load` returns them next to the runs it could read.

Notebooks: :func:`load_runs` returns tidy rows (a pandas DataFrame when pandas is installed,
else a list of dicts); :func:`write_report` is what ``python -m experiments.report`` runs.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import sys
import zipfile
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from deltafl_jax.config import PERCENTILES
from deltafl_jax.metrics import PERCENTILE_METHODS, summarize
from deltafl_jax.outputs import replica_key

ALGORITHM_NAMES = {"deltafl": "Δ-FL", "fedavg": "FedAvg", "qffl": "q-FFL", "afl": "AFL",
                   "afl_qffl": "AFL (q-FFL proxy)", "term": "TERM", "fedprox": "FedProx",
                   "fedavg_sub": "FedAvg-Sub"}
# How a baseline's swept flag (its replicas' param_name) reads in a column name.
PARAM_NAMES = {"qffl_q": "q", "fedprox_mu": "μ", "term_t": "t", "afl_lambda_lr": "γ_λ",
               "fedavg_sub_clients": "clients"}
# Label fields that name a replica but not its method (a column groups replicas by the rest).
_NOT_METHOD = ("seed", "key")
HISTOGRAM_BINS = 20        # bins of width 5 % on [0, 1] for errors
KINDS = ("final", "curves", "clients", "kept")


class RunError(ValueError):
    """A run directory that cannot be reported; the message is one line."""


# --------------------------------------------------------------------------------------------
# Reading runs


@dataclasses.dataclass(eq=False)
class Run:
    """One run directory, read back.

    labels[r] names replica r (theta or swept value, seed, algorithm); ``clients`` holds the
    final per-client arrays [R, N]; ``history`` the same at every evaluation [E, R, N] (None
    for runs older than clients_history.npz); ``rounds`` the per-round arrays [T, R] (None if
    rounds.npz is missing); ``records`` the lines of metrics.jsonl; ``notes`` what is missing
    but not needed for the tables.
    """

    path: str
    name: str
    summary: Dict[str, Any]
    labels: List[Dict[str, Any]]
    keys: List[str]
    clients: Dict[str, np.ndarray]
    history: Optional[Dict[str, np.ndarray]]
    rounds: Optional[Dict[str, np.ndarray]]
    records: List[Dict[str, Any]]
    notes: List[str]
    _cache: Dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def config(self) -> Dict[str, Any]:
        return self.summary.get("config", {})

    @property
    def dataset(self) -> str:
        return str(self.summary.get("dataset", {}).get("name", "?"))

    @property
    def model(self) -> str:
        return str(self.summary.get("model", self.config.get("model", "?")))

    @property
    def num_rounds(self) -> int:
        return int(self.config.get("num_rounds", 0))

    @property
    def setting_key(self) -> Tuple[str, ...]:
        """Runs share a table row when their data and model are the same."""
        data = json.dumps(self.config.get("data", {}), sort_keys=True)
        stats = json.dumps(self.summary.get("dataset", {}), sort_keys=True)
        return (self.dataset, self.model, data, stats)

    @property
    def setting(self) -> str:
        return f"{self.dataset} / {self.model}"

    def final(self, percentile: str = "lower") -> Dict[str, np.ndarray]:
        """Metric name -> [R] for the final models, recomputed from clients.npz."""
        key = ("final", percentile)
        if key not in self._cache:
            c = self.clients
            self._cache[key] = summarize(c["train_loss"], c["train_sizes"], c["test_error"],
                                         c["test_loss"], PERCENTILES, percentile)
        return self._cache[key]

    def curves(self, percentile: str = "lower"):
        """(rounds [E], metric name -> [E, R]) at every evaluation, or None.

        Recomputed from clients_history.npz; a run without it falls back on metrics.jsonl,
        whose percentiles are the lower quantile (so only for ``percentile="lower"``).
        """
        key = ("curves", percentile)
        if key in self._cache:
            return self._cache[key]
        out = None
        if self.history is not None:
            h = self.history
            per_eval = [summarize(h["train_loss"][e], self.clients["train_sizes"],
                                  h["test_error"][e], h["test_loss"][e], PERCENTILES, percentile)
                        for e in range(len(h["rounds"]))]
            out = (np.asarray(h["rounds"], np.int64),
                   {k: np.stack([p[k] for p in per_eval]) for k in per_eval[0]})
        elif percentile == "lower" and self.records:
            out = _curves_from_records(self.records, self.keys)
        self._cache[key] = out
        return out


def _curves_from_records(records, keys):
    rounds = sorted({int(r["round"]) for r in records})
    where = {k: i for i, k in enumerate(keys)}
    names = [k for k in records[0] if k.startswith(("train_loss_", "test_error_", "test_loss_"))]
    out = {n: np.full((len(rounds), len(keys)), np.nan) for n in names}
    row = {t: i for i, t in enumerate(rounds)}
    for rec in records:
        r = where.get(replica_key(rec))
        if r is None:
            continue
        for n in names:
            if n in rec:
                out[n][row[int(rec["round"])], r] = float(rec[n])
    return np.asarray(rounds, np.int64), out


def _load_npz(path) -> Dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise RunError(f"{os.path.basename(path)} cannot be read ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _read_records(path) -> Tuple[List[dict], Optional[str]]:
    records, problem = [], None
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                problem = f"metrics.jsonl line {i + 1} is not JSON (a run cut off while writing?)"
    return records, problem


def read_run(path: str, name: Optional[str] = None) -> Run:
    """Read one run directory. Raises :class:`RunError` (one line) if it cannot be reported:
    missing, not a run, incomplete (no summary.json or clients.npz) or inconsistent."""
    if not os.path.exists(path):
        raise RunError("no such directory")
    if not os.path.isdir(path):
        raise RunError("not a directory")
    files = set(os.listdir(path))
    metrics_path = os.path.join(path, "metrics.jsonl")
    if "summary.json" not in files:
        if "metrics.jsonl" in files:
            records, _ = _read_records(metrics_path)
            last = max((int(r.get("round", 0)) for r in records), default=0)
            raise RunError(f"incomplete run: no summary.json (metrics.jsonl has "
                           f"{len(records)} record(s), the last at round {last}; still running "
                           f"or stopped?)")
        raise RunError("not a run directory (no summary.json, metrics.jsonl or clients.npz)")
    try:
        with open(os.path.join(path, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"summary.json cannot be read ({_one_line(e)})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("replicas"), list):
        raise RunError("summary.json has no list of replicas")
    if "clients.npz" not in files:
        raise RunError("incomplete run: summary.json but no clients.npz (per-client arrays)")
    clients = _load_npz(os.path.join(path, "clients.npz"))
    need = ("train_loss", "train_error", "test_loss", "test_error", "train_sizes", "test_sizes",
            "replica_keys")
    missing = [k for k in need if k not in clients]
    if missing:
        raise RunError(f"clients.npz lacks {', '.join(missing)}")
    labels = [dict(l) for l in summary["replicas"]]
    keys = [str(k) for k in clients["replica_keys"]]
    R = len(labels)
    if [replica_key(l) for l in labels] != keys:
        raise RunError("the replicas of summary.json and clients.npz do not match")
    n_train, n_test = len(clients["train_sizes"]), len(clients["test_sizes"])
    for k, n in (("train_loss", n_train), ("train_error", n_train), ("test_loss", n_test),
                 ("test_error", n_test)):
        if clients[k].shape != (R, n):
            raise RunError(f"clients.npz {k} has shape {clients[k].shape}, expected {(R, n)}")
    if np.any(clients["train_sizes"] <= 0):
        raise RunError("clients.npz has a training client without examples")
    notes = []
    history = None
    if "clients_history.npz" in files:
        try:
            history = _load_npz(os.path.join(path, "clients_history.npz"))
            E = len(history.get("rounds", []))
            for k, n in (("train_loss", n_train), ("test_loss", n_test),
                         ("test_error", n_test)):
                if k not in history or history[k].shape != (E, R, n):
                    raise RunError(f"clients_history.npz {k} does not have shape {(E, R, n)}")
        except RunError as e:
            notes.append(f"{e}; curves come from metrics.jsonl")
            history = None
    else:
        notes.append("no clients_history.npz; curves come from metrics.jsonl (lower "
                     "percentiles only)")
    rounds = None
    if "rounds.npz" in files:
        try:
            rounds = _load_npz(os.path.join(path, "rounds.npz"))
            if rounds.get("num_selected", np.zeros((0, 0))).ndim != 2 or \
                    rounds["num_selected"].shape[1] != R:
                raise RunError("rounds.npz has no num_selected [rounds, replicas]")
        except RunError as e:
            notes.append(f"{e}; no kept-clients figure for this run")
            rounds = None
    else:
        notes.append("no rounds.npz; no kept-clients figure for this run")
    records: List[dict] = []
    if "metrics.jsonl" in files:
        records, problem = _read_records(metrics_path)
        if problem:
            notes.append(problem)
        last = max((int(r.get("round", 0)) for r in records), default=0)
        T = int(summary.get("config", {}).get("num_rounds", last))
        if last != T:
            notes.append(f"metrics.jsonl ends at round {last}, the run had {T} rounds")
    else:
        notes.append("no metrics.jsonl")
    return Run(path=path, name=name or os.path.basename(os.path.normpath(path)),
               summary=summary, labels=labels, keys=keys, clients=clients, history=history,
               rounds=rounds, records=records, notes=notes)


def find_run_dirs(paths: Iterable[str]) -> List[str]:
    """The given directories; a directory that is not itself a run but holds run
    directories (e.g. ``runs/``) stands for them, sorted by name."""
    out = []
    for p in paths:
        if os.path.isdir(p) and not _looks_like_run(p):
            subs = sorted(os.path.join(p, d) for d in os.listdir(p)
                          if os.path.isdir(os.path.join(p, d)) and
                          _looks_like_run(os.path.join(p, d)))
            if subs:
                out.extend(subs)
                continue
        out.append(p)
    return out


def _looks_like_run(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f))
               for f in ("summary.json", "metrics.jsonl", "clients.npz"))


def load(paths: Iterable[str], log: Optional[Callable[[str], None]] = None
         ) -> Tuple[List[Run], List[str]]:
    """Read the runs under `paths` (see :func:`find_run_dirs`).

    Returns (runs, skipped): the runs that can be reported, and one line per run that cannot
    ("PATH: reason"). Each skipped line is also passed to `log`.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    dirs = find_run_dirs([os.fspath(p) for p in paths])
    names = [os.path.basename(os.path.normpath(d)) or d for d in dirs]
    runs, skipped = [], []
    for d, n in zip(dirs, names):
        name = n if names.count(n) == 1 else os.path.normpath(d)
        try:
            runs.append(read_run(d, name))
        except RunError as e:
            line = f"skipped {d}: {e}"
            skipped.append(line)
            if log:
                log(line)
    return runs, skipped


# --------------------------------------------------------------------------------------------
# Methods (table columns) and settings (table rows)


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float, np.integer, np.floating)):
        return f"{float(v):g}"
    return str(v)


def method_label(label: Dict[str, Any], filter: str = "exact") -> str:
    """A column name in the paper's style: 'FedAvg', 'Δ-FL, θ = 0.5', 'q-FFL, q = 10'
    (a baseline's swept flag, e.g. ``qffl_q``, reads as in :data:`PARAM_NAMES`).

    Delta-FL at theta = 1 is FedAvg (bit for bit) and is labelled so. Label fields other than
    the algorithm, theta, the swept parameter and the seed (e.g. a tuning grid's learning
    rate) are appended as 'name = value'.
    """
    alg = str(label.get("algorithm", "deltafl"))
    pretty = ALGORITHM_NAMES.get(alg, alg)
    theta = label.get("theta")
    if label.get("param_name") not in (None, "theta"):
        pname = PARAM_NAMES.get(str(label["param_name"]), str(label["param_name"]))
        head = f"{pretty}, {pname} = {_fmt_value(label.get('param_value'))}"
    elif alg in ("deltafl", "fedavg") and theta is not None and float(theta) == 1.0:
        head = "FedAvg"
    elif theta is not None:
        head = f"{pretty}, θ = {_fmt_value(theta)}"
        if alg == "deltafl" and filter != "exact":
            head += f" ({filter} filter)"
    else:
        head = pretty
    skip = {"algorithm", "theta", "param_name", "param_value"} | set(_NOT_METHOD)
    extras = [f"{k} = {_fmt_value(v)}" for k, v in label.items() if k not in skip]
    return ", ".join([head] + extras)


@dataclasses.dataclass(eq=False)
class Column:
    """The replicas of one run that differ only by seed: one table cell per setting.

    setting: the row ('dataset / model'); label: the column, unique within the setting;
    replicas: indices into the run's arrays, in seed order; seeds: their seeds.
    """

    run: Run
    setting: str
    label: str
    replicas: List[int]
    seeds: List[int]
    identity: Tuple

    def values(self, metric: str, percentile: str = "lower") -> np.ndarray:
        """[S] per-seed final values of `metric` (e.g. 'test_error_p90')."""
        return np.asarray(self.run.final(percentile)[metric])[self.replicas]

    def client_means(self, split: str, quantity: str) -> Tuple[np.ndarray, np.ndarray]:
        """(n_k [N], per-client value [N] averaged over seeds) for split 'train'/'test' and
        quantity 'loss'/'error' (App. C.3: each client's metric averaged over the seeds)."""
        arr = np.asarray(self.run.clients[f"{split}_{quantity}"], np.float64)[self.replicas]
        return np.asarray(self.run.clients[f"{split}_sizes"]), arr.mean(axis=0)


def _method_identity(label: Dict[str, Any]) -> Tuple:
    return tuple((k, _fmt_value(v)) for k, v in label.items() if k not in _NOT_METHOD)


def run_columns(run: Run) -> List[Tuple[str, Tuple, List[int], List[int]]]:
    """(label, identity, replicas, seeds) per method of one run, in replica order."""
    order: Dict[Tuple, List[int]] = {}
    for r, lab in enumerate(run.labels):
        order.setdefault(_method_identity(lab), []).append(r)
    filt = str(run.config.get("filter", "exact"))
    out = []
    for ident, rs in order.items():
        out.append((method_label(run.labels[rs[0]], filt), ident, rs,
                    [int(run.labels[r].get("seed", 0)) for r in rs]))
    return out


def columns(runs: Sequence[Run]) -> List[Column]:
    """Every (setting, method) column over the runs.

    Runs with the same dataset, model and data settings share a row, so that several runs
    (e.g. FedAvg and Delta-FL, or a baseline) sit side by side. Two columns of one row with the
    same label (e.g. FedAvg from two runs) get the run's name appended.
    """
    # Rows: setting keys; two keys with the same display name get the run name appended.
    display: Dict[Tuple, str] = {}
    for run in runs:
        if run.setting_key not in display:
            name = run.setting
            if name in display.values():
                name = f"{name} ({run.name})"
            display[run.setting_key] = name
    cols = []
    for run in runs:
        for label, ident, rs, seeds in run_columns(run):
            cols.append(Column(run=run, setting=display[run.setting_key], label=label,
                               replicas=rs, seeds=seeds, identity=ident))
    by_cell: Dict[Tuple[str, str], List[Column]] = {}
    for c in cols:
        by_cell.setdefault((c.setting, c.label), []).append(c)
    for group in by_cell.values():
        if len(group) > 1:
            for c in group:
                c.label = f"{c.label} [{c.run.name}]"
    return cols


def settings(cols: Sequence[Column]) -> List[str]:
    out = []
    for c in cols:
        if c.setting not in out:
            out.append(c.setting)
    return out


# --------------------------------------------------------------------------------------------
# Tables


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
)


@dataclasses.dataclass(frozen=True)
class Cell:
    mean: float
    std: float
    values: Tuple[float, ...]   # per seed, in the table's unit (% for errors)
    seeds: Tuple[int, ...]


def table(cols: Sequence[Column], metric: str, percentile: str = "lower",
          percent: bool = False):
    """(rows, column labels, {(row, label): Cell}); mean and std (ddof=0) over seeds."""
    rows = settings(cols)
    labels: List[str] = []
    cells: Dict[Tuple[str, str], Cell] = {}
    for c in cols:
        if c.label not in labels:
            labels.append(c.label)
        v = c.values(metric, percentile) * (100.0 if percent else 1.0)
        cells[(c.setting, c.label)] = Cell(mean=float(np.mean(v)), std=float(np.std(v)),
                                           values=tuple(float(x) for x in v),
                                           seeds=tuple(c.seeds))
    return rows, labels, cells


def _fmt_cell(cell: Cell, digits: int) -> str:
    if not (math.isfinite(cell.mean) and math.isfinite(cell.std)):
        return "nan (diverged)"
    return f"{cell.mean:.{digits}f} ± {cell.std:.{digits}f}"


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
            text = _fmt_cell(cell, digits)
            if best is not None and len(finite) > 1 and \
                    round(cell.mean, digits) == round(best, digits):
                text = f"**{text}**"
            out.append(text)
        lines.append(f"| {row} | " + " | ".join(out) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Figure data and figures (matplotlib, headless; each function returns the Figure)


def _figure(nrows: int, ncols: int, width: float, height: float, **kw):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _colors(n: int):
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
    fig, axes = _figure(1, n, 2.6 * n + 0.6, 2.8, sharex=True, sharey=True)
    data = [histogram_data(c, split, quantity) for c in cols]
    if quantity == "error":
        # k / 20 correctly rounded, so that an error such as 3/20 = 6/40 lands in the bin it
        # starts whatever its client's size.
        bins = np.arange(HISTOGRAM_BINS + 1) / HISTOGRAM_BINS
    else:
        finite = np.concatenate([v[np.isfinite(v)] for v, _ in data] + [np.zeros(1)])
        bins = np.linspace(0.0, max(float(finite.max()), 1e-12), HISTOGRAM_BINS + 1)
    metric = f"{split}_{quantity}_p90"
    for ax, c, (v, w), color in zip(axes[0], cols, data, _colors(n)):
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
    fig, axes = _figure(2, n, 2.6 * n + 0.6, 5.0, sharex="row", sharey="row")
    for j, (c, color) in enumerate(zip(cols, _colors(n))):
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
    """(rounds [E], mean over seeds [E], min [E], max [E]) of `metric`, or None."""
    got = col.run.curves(percentile)
    if got is None or metric not in got[1]:
        return None
    rounds, per = got
    v = np.asarray(per[metric])[:, col.replicas]
    return rounds, v.mean(axis=1), v.min(axis=1), v.max(axis=1)


def curves_figure(cols: Sequence[Column], percentile: str = "lower"):
    """Figs. 6-11: train-loss mean and p90, test-error mean and p90 over rounds; a line per
    method (mean over seeds) with a min/max band over seeds."""
    fig, axes = _figure(2, 2, 9.0, 6.0, sharex=True)
    for (metric, title), ax in zip(CURVE_PANELS, axes.ravel()):
        for c, color in zip(cols, _colors(len(cols))):
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
    r = col.run.rounds
    if r is None:
        return None
    v = np.asarray(r["num_selected"], np.float64)[:, col.replicas]
    return np.arange(1, v.shape[0] + 1), v.mean(axis=1), v.min(axis=1), v.max(axis=1)


def kept_figure(cols: Sequence[Column]):
    """Fig. 16: clients kept per round after the filter, mean over seeds, band = min/max."""
    fig, axes = _figure(1, 1, 8.5, 3.6)
    ax = axes[0][0]
    for c, color in zip(cols, _colors(len(cols))):
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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "run"


# --------------------------------------------------------------------------------------------
# Tidy rows (load_runs, CSV files)


def _label_fields(col: Column, r: int) -> Dict[str, Any]:
    lab = col.run.labels[r]
    return {"run": col.run.name, "setting": col.setting, "method": col.label,
            "algorithm": lab.get("algorithm", ""), "theta": lab.get("theta", ""),
            "param_name": lab.get("param_name", ""), "param_value": lab.get("param_value", ""),
            "seed": lab.get("seed", ""), "replica": col.run.keys[r]}


def tidy_rows(cols: Sequence[Column], kind: str = "final", percentile: str = "lower"
              ) -> List[Dict[str, Any]]:
    """Rows for one `kind`:

    - ``final``: one per replica, the final metrics (recomputed under `percentile`);
    - ``curves``: one per replica and evaluation round;
    - ``clients``: one per replica and client: split, client id, n_k, final loss and error;
    - ``kept``: one per replica and round: clients kept, updates rejected.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    rows: List[Dict[str, Any]] = []
    for col in cols:
        run = col.run
        if kind == "final":
            fin = run.final(percentile)
            for r in col.replicas:
                rows.append({**_label_fields(col, r), "round": run.num_rounds,
                             **{k: float(v[r]) for k, v in fin.items()}})
        elif kind == "curves":
            got = run.curves(percentile)
            if got is None:
                continue
            rounds, per = got
            for r in col.replicas:
                for e, t in enumerate(rounds):
                    rows.append({**_label_fields(col, r), "round": int(t),
                                 **{k: float(v[e, r]) for k, v in per.items()}})
        elif kind == "clients":
            c = run.clients
            for r in col.replicas:
                base = _label_fields(col, r)
                for split in ("train", "test"):
                    ids = c.get(f"{split}_client_ids", np.arange(len(c[f"{split}_sizes"])))
                    for k in range(len(c[f"{split}_sizes"])):
                        rows.append({**base, "split": split, "client_index": k,
                                     "client_id": str(ids[k]),
                                     "num_examples": int(c[f"{split}_sizes"][k]),
                                     "loss": float(c[f"{split}_loss"][r, k]),
                                     "error": float(c[f"{split}_error"][r, k])})
        else:
            rr = run.rounds
            if rr is None:
                continue
            for r in col.replicas:
                base = _label_fields(col, r)
                for t in range(rr["num_selected"].shape[0]):
                    row = {**base, "round": t + 1,
                           "num_selected": int(rr["num_selected"][t, r])}
                    if "num_rejected" in rr:
                        row["num_rejected"] = int(rr["num_rejected"][t, r])
                    rows.append(row)
    return rows


def load_runs(paths, kind: str = "final", percentile: str = "lower",
              as_frame: Optional[bool] = None, log: Optional[Callable[[str], None]] = None):
    """Tidy data of one or more run directories, for notebooks (e.g. Colab).

    Args:
      paths: a run directory, a directory of runs, or a list of them.
      kind: ``"final"`` (one row per replica: the final metrics), ``"curves"`` (per replica and
        evaluation), ``"clients"`` (per replica and client) or ``"kept"`` (per replica and
        round); see :func:`tidy_rows`.
      percentile: ``"lower"`` (weighted lower quantile) or ``"linear"`` (NumPy's).
      as_frame: None gives a pandas DataFrame when pandas can be imported and a list of dicts
        otherwise; True requires pandas; False always gives the list.
      log: receives one line per run that is missing or incomplete (default: stderr).

    Example::

        df = deltafl_jax.report.load_runs("runs/synthetic")
        df.groupby("method")["test_error_p90"].agg(["mean", "std"])
    """
    if percentile not in PERCENTILE_METHODS:
        raise ValueError(f"percentile must be one of {', '.join(PERCENTILE_METHODS)}, got "
                         f"{percentile!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    log = log if log is not None else (lambda s: print(s, file=sys.stderr))
    runs, _ = load(paths, log=log)
    rows = tidy_rows(columns(runs), kind, percentile)
    if as_frame is False:
        return rows
    try:
        import pandas
    except ImportError:
        if as_frame:
            raise ImportError("load_runs(as_frame=True) needs pandas (pip install pandas)") \
                from None
        return rows
    return pandas.DataFrame(rows)


def write_csv(path: str, rows: List[Dict[str, Any]]) -> None:
    fields: List[str] = []
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()})


# --------------------------------------------------------------------------------------------
# The report


CONVENTIONS = {
    "lower": "the **lower weighted quantile**: the smallest client value whose cumulative "
             "weight reaches the level (the rule of the filter's η; with weights n_k it is "
             "the reference code's v[ceil(N p) − 1] on values repeated n_k times)",
    "linear": "**NumPy's linear interpolation** (`np.percentile`, method 'linear'), "
              "*unweighted* for the train losses too, as the reference scripts computed it",
}


def _run_table(runs: Sequence[Run]) -> str:
    lines = ["| run | dataset (train / test clients, median n_k) | model | algorithm | filter | "
             "rounds | m | γ₀ (÷c every t₀) | λ | seeds | replicas | wall time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        c, d = run.config, run.summary.get("dataset", {})
        lr = _fmt_value(c.get("learning_rate", "?"))
        if c.get("lr_decay_every") and c.get("lr_decay", 1) != 1:
            lr += f" (÷{c['lr_decay']:g} every {c['lr_decay_every']})"
        seeds = ",".join(str(s) for s in c.get("seeds", []))
        total = run.summary.get("timing", {}).get("total_s")
        lines.append(
            f"| `{run.path}` | {run.dataset} ({d.get('num_train_clients', '?')} / "
            f"{d.get('num_test_clients', '?')}, {d.get('median_examples', '?')}) | {run.model} | "
            f"{c.get('algorithm', '?')} | {c.get('filter', '?')} | {run.num_rounds} | "
            f"{c.get('clients_per_round', '?')} | {lr} | {_fmt_value(c.get('l2_reg', 0))} | {seeds} | "
            f"{len(run.labels)} | {'' if total is None else f'{total:.0f} s'} |")
    return "\n".join(lines)


def write_report(runs: Sequence[Run], out_dir: str, percentile: str = "lower",
                 skipped: Sequence[str] = (), dpi: int = 110,
                 log: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Write report.md, the PNG figures and the CSV files into `out_dir`.

    Returns {"report": path, "figures": [paths], "csv": [paths], "notes": [lines]}.
    """
    if percentile not in PERCENTILE_METHODS:
        raise ValueError(f"percentile must be one of {', '.join(PERCENTILE_METHODS)}")
    if not runs:
        raise ValueError("no run to report")
    log = log or (lambda s: None)
    os.makedirs(out_dir, exist_ok=True)
    cols = columns(runs)
    notes: List[str] = []
    for run in runs:
        notes.extend(f"{run.name}: {n}" for n in run.notes)
        if run.summary.get("dataset", {}).get("num_classes", 1) == 0:
            notes.append(f"{run.name}: the dataset has no classes; its 'error' columns are not "
                         "misclassification errors")
    figures: List[Tuple[str, str, str]] = []   # (setting, caption, file)

    def save(fig, name, setting, caption):
        path = os.path.join(out_dir, name)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=dpi)
        figures.append((setting, caption, name))

    for setting in settings(cols):
        sc = [c for c in cols if c.setting == setting]
        slug = _slug(setting)
        save(histogram_figure(sc, "test", "error", percentile),
             f"fig4_hist_test_error_{slug}.png", setting,
             "Fig. 4: histogram of the per-client test misclassification error")
        save(histogram_figure(sc, "train", "loss", percentile),
             f"fig12_hist_train_loss_{slug}.png", setting,
             "Figs. 12–13: histogram of the per-client train loss (α-weighted)")
        save(scatter_figure(sc), f"fig5_scatter_{slug}.png", setting,
             "Fig. 5: train loss and test error per client against its number of examples")
        no_curves = [c.label for c in sc if curve_data(c, "train_loss_mean", percentile) is None]
        if no_curves:
            why = ("neither clients_history.npz nor metrics.jsonl" if percentile == "lower" else
                   f"no clients_history.npz to recompute {percentile} percentiles from")
            notes.append(f"{setting}: no curves for {', '.join(no_curves)} ({why})")
        if len(no_curves) < len(sc):
            save(curves_figure(sc, percentile), f"fig6_curves_{slug}.png", setting,
                 "Figs. 6–11: train loss and test error over rounds")
        if any(kept_data(c) is not None for c in sc):
            save(kept_figure(sc), f"fig16_kept_clients_{slug}.png", setting,
                 "Fig. 16: clients kept per round")

    csv_files = []
    for kind, name in (("final", "final.csv"), ("clients", "clients.csv"),
                       ("curves", "curves.csv"), ("kept", "kept_clients.csv")):
        rows = tidy_rows(cols, kind, percentile)
        write_csv(os.path.join(out_dir, name), rows)
        csv_files.append(name)

    seeds = sorted({len(c.seeds) for c in cols})
    md = ["# Δ-FL report", "",
          f"{len(runs)} run(s); {len(cols)} method column(s); "
          f"{'/'.join(map(str, seeds))} seed(s) per column. Final models (end of each run's "
          f"round budget).", "",
          "## Conventions", "",
          "- **Train losses** F_k are weighted by α_k ∝ n_k over the training clients (mean "
          "and percentiles); they include (λ/2)‖w‖² when λ > 0.",
          "- **Test errors** (misclassification rates) are unweighted over the test clients.",
          f"- **Percentiles** use {CONVENTIONS[percentile]}"
          + (" (`--percentile=linear` gives NumPy's linear interpolation, as the reference "
             "scripts)." if percentile == "lower" else "."),
          "- Every number is recomputed from the per-client arrays (`clients.npz`, "
          "`clients_history.npz` for the curves), not read from `metrics.jsonl`.",
          "- Cells are **mean ± std over seeds** (population std, ddof = 0); the lowest mean "
          "of each row is in bold. Δ-FL at θ = 1 is FedAvg and is labelled so.", ""]
    for spec in TABLES:
        md += [f"## {spec.title}", "", markdown_table(cols, spec, percentile), ""]
    md += ["## Runs", "", _run_table(runs), ""]
    if skipped or notes:
        md += ["## Skipped runs and notes", ""]
        md += [f"- {s}" for s in skipped] + [f"- {n}" for n in notes] + [""]
    md += ["## Figures", ""]
    for setting, caption, name in figures:
        md += [f"**{setting}. {caption}.**", "", f"![{caption}]({name})", ""]
    md += ["## Files", "",
           "- `final.csv`: one row per replica (method, seed) with the final metrics above.",
           "- `clients.csv`: one row per replica and client: split, client id, number of "
           "examples, final loss and error (re-plot Figs. 4–5 from it).",
           "- `curves.csv`: one row per replica and evaluation round (Figs. 6–11).",
           "- `kept_clients.csv`: one row per replica and round: clients kept, updates "
           "rejected (Fig. 16).", ""]
    report_path = os.path.join(out_dir, "report.md")
    with open(report_path, "w") as f:
        f.write("\n".join(md))
    for n in notes:
        log(f"note: {n}")
    return {"report": report_path, "figures": [os.path.join(out_dir, f[2]) for f in figures],
            "csv": [os.path.join(out_dir, f) for f in csv_files], "notes": notes}
