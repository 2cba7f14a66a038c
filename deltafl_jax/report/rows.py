"""Tidy rows of runs, one row per replica (and round, or client): the data behind
``--csv``, and :func:`load_runs`, a pandas DataFrame of them for notebooks.

The runs are read by :mod:`deltafl_jax.report.io` and grouped into the report's columns by
:mod:`deltafl_jax.report.tables`; this module only flattens them.
"""

from __future__ import annotations

import csv
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from deltafl_jax.evaluation.metrics import PERCENTILE_METHODS
from deltafl_jax.report.io import KINDS, Run, load
from deltafl_jax.report.tables import Column, columns



def label_fields(col: Column, r: int, run: Optional[Run] = None) -> Dict[str, Any]:
    """The columns that name replica r of `run` (default: the column's run) in every tidy
    row."""
    run = run if run is not None else col.run
    lab = run.labels[r]
    return {"run": run.name, "setting": col.setting, "method": col.label,
            "algorithm": lab.algorithm, "theta": lab.theta,
            "param_name": lab.param_name if lab.param_name is not None else "",
            "param_value": lab.param_value if lab.param_value is not None else "",
            "seed": lab.seed, "replica": run.keys[r]}


def final_rows(col: Column, percentile: str) -> List[Dict[str, Any]]:
    rows = []
    for run, reps in col.parts:
        fin = run.final(percentile)
        rows += [{**label_fields(col, r, run), "round": run.num_rounds,
                  **{k: float(v[r]) for k, v in fin.items()}} for r in reps]
    return rows


def curve_rows(col: Column, percentile: str) -> List[Dict[str, Any]]:
    rows = []
    for run, reps in col.parts:
        got = run.curves(percentile)
        if got is None:
            continue
        rounds, per = got
        rows += [{**label_fields(col, r, run), "round": int(t),
                  **{k: float(v[e, r]) for k, v in per.items()}}
                 for r in reps for e, t in enumerate(rounds)]
    return rows


def client_rows(col: Column) -> List[Dict[str, Any]]:
    return [row for run, reps in col.parts for row in run_client_rows(col, run, reps)]


def run_client_rows(col: Column, run: Run, replicas: Sequence[int]) -> List[Dict[str, Any]]:
    """One row per replica and client of clients.npz: every client, or for a run that
    evaluated a sample (``--eval_clients``) each sampled client, with its draw number
    ``draw`` (training draws repeat a client drawn twice)."""
    c, rows = run.clients, []
    for r in replicas:
        base = label_fields(col, r, run)
        for split in ("train", "test"):
            ids = c.get(f"{split}_client_ids", np.arange(len(c[f"{split}_sizes"])))
            sampled = run.sampled(split)
            for j, k in enumerate(run.client_indices(split)):
                rows.append({**base, "split": split, "client_index": int(k),
                             **({"draw": j} if sampled else {}),
                             "client_id": str(ids[k]),
                             "num_examples": int(c[f"{split}_sizes"][k]),
                             "loss": float(c[f"{split}_loss"][r, j]),
                             "error": float(c[f"{split}_error"][r, j])})
    return rows


def kept_rows(col: Column) -> List[Dict[str, Any]]:
    return [row for run, reps in col.parts for row in run_kept_rows(col, run, reps)]


def run_kept_rows(col: Column, run: Run, replicas: Sequence[int]) -> List[Dict[str, Any]]:
    rr, rows = run.rounds, []
    if rr is None:
        return rows
    for r in replicas:
        base = label_fields(col, r, run)
        for t in range(rr["num_selected"].shape[0]):
            row = {**base, "round": t + 1, "num_selected": int(rr["num_selected"][t, r])}
            if "num_rejected" in rr:
                row["num_rejected"] = int(rr["num_rejected"][t, r])
            rows.append(row)
    return rows


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
    make = {"final": lambda c: final_rows(c, percentile),
            "curves": lambda c: curve_rows(c, percentile),
            "clients": client_rows, "kept": kept_rows}[kind]
    return [row for col in cols for row in make(col)]


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
        df.groupby("method")["test_error_p90"].agg(mean="mean", std=lambda v: v.std(ddof=0))

    (ddof = 0: the report's std over seeds, :data:`deltafl_jax.report.tables.SEED_STD_DDOF`;
    pandas' ``std()`` alone is the sample std, ddof = 1.)
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
    """Rows as CSV, columns in first-seen order; floats as repr (unrounded)."""
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
