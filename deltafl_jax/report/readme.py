"""The README's result tables, generated from run directories so that they cannot go stale.

A table sits in README.md between ``<!-- table: NAME -->`` and ``<!-- /table -->`` markers;
:func:`render` builds it from the runs' ``summary.json`` (final per-client metrics of every
replica): one column per method or theta, rows for the p90 and the mean of the test error (in
%) and the p90 of the alpha-weighted train loss, each the mean +- std over seeds (ddof = 0), the
lowest mean of a row in bold. ``python -m experiments.readme_tables`` writes or checks them.

A table's column and row names are the report's (:func:`~deltafl_jax.report.tables.
method_label`), except for an option that every run of the table sets alike (the flagfile's,
e.g. ``--filter=reference``): a table is made from one flagfile, whose page says it once, so
the names do not repeat it (:func:`common_options`); an option that differs between the
table's runs stays in their names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from deltafl_jax.algorithms import registry
from deltafl_jax.outputs.directory import RunReader
from deltafl_jax.report.tables import method_label, seed_std

ROWS = (("test error, 90th percentile", "test_error_p90", 100.0, 2),
        ("test error, mean", "test_error_mean", 100.0, 2),
        ("train loss, 90th percentile (α-weighted)", "train_loss_p90", 1.0, 3))


def run_options(config: Mapping[str, Any]) -> Dict[str, Any]:
    """{flag: value} of every option of a run's algorithm, as its summary.json stores them
    (the defaults for those it does not hold); {} for an algorithm that is not registered."""
    spec = registry.find(str(config.get("algorithm", "")))
    if spec is None:
        return {}
    return dataclasses.asdict(spec.stored_options(config))


def common_options(configs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """{flag: value} of the options that every run of a table which has the option sets to
    the same value (e.g. {"filter": "reference"} for a flagfile's --filter=reference)."""
    values: Dict[str, List[Any]] = {}
    for config in configs:
        for flag, value in run_options(config).items():
            values.setdefault(flag, []).append(value)
    return {flag: vs[0] for flag, vs in values.items() if all(v == vs[0] for v in vs)}


def naming_config(config: Mapping[str, Any], common: Mapping[str, Any]) -> Dict[str, Any]:
    """The run's configuration with the table's common options (:func:`common_options`)
    taken out, so that the column names do not repeat them."""
    out = {k: v for k, v in config.items() if k not in common}
    out["options"] = {k: v for k, v in dict(config.get("options") or {}).items()
                      if k not in common}
    return out


def _summaries(run_dirs: Sequence[str]):
    """(RunReader, summary, the configuration its columns are named from) per run."""
    readers = [RunReader(d) for d in run_dirs]
    summaries = [r.summary() for r in readers]
    common = common_options([s.get("config") or {} for s in summaries])
    return [(r, s, naming_config(s.get("config") or {}, common))
            for r, s in zip(readers, summaries)]


def _columns(run_dirs: Sequence[str]) -> List[Tuple[str, Dict[str, List[float]]]]:
    """(label, metric -> values over seeds) per method / swept value, in run order."""
    cols: Dict[str, Dict[str, List[float]]] = {}
    for reader, summary, naming in _summaries(run_dirs):
        final = summary["final"]
        for lab in reader.labels():
            name = method_label(lab, naming)
            col = cols.setdefault(name, {})
            for _, key, _, _ in ROWS:
                col.setdefault(key, []).append(final[lab.key()][key])
    return list(cols.items())


def _cells(cols, key: str, scale: float, digits: int, multi: bool) -> List[str]:
    """Mean (+- std over seeds) of one metric per column, the lowest mean in bold."""
    means = [scale * float(np.mean(c[key])) for _, c in cols]
    best = min(means)
    cells = []
    for (_, c), mean in zip(cols, means):
        text = f"{mean:.{digits}f}"
        text = f"**{text}**" if round(mean, digits) == round(best, digits) else text
        if multi:
            text += f" ± {scale * seed_std(c[key]):.{digits}f}"
        cells.append(text)
    return cells


def render(run_dirs: Sequence[str], max_columns: int = 6) -> str:
    """The markdown table of the runs in `run_dirs`: one column per method or theta, or, past
    `max_columns` of them, one row per method and one column per metric."""
    cols = _columns(run_dirs)
    multi = any(len(c[1]["test_error_p90"]) > 1 for c in cols)
    cells = {key: _cells(cols, key, scale, digits, multi) for _, key, scale, digits in ROWS}
    if len(cols) > max_columns:
        lines = ["| method | " + " | ".join(t for t, _, _, _ in ROWS) + " |",
                 "|---|" + "---|" * len(ROWS)]
        lines += [f"| {name} | " + " | ".join(cells[k][i] for _, k, _, _ in ROWS) + " |"
                  for i, (name, _) in enumerate(cols)]
        return "\n".join(lines)
    lines = ["| | " + " | ".join(name for name, _ in cols) + " |",
             "|---|" + "---|" * len(cols)]
    lines += [f"| {title} | " + " | ".join(cells[key]) + " |" for title, key, _, _ in ROWS]
    return "\n".join(lines)


PERSONAL_COLUMNS = (("mean", "mean"), ("p90", "p90"), ("worst10", "worst 10%"))


def render_personal(run_dirs: Sequence[str]) -> str:
    """The personalised evaluation's table (runs with --client_holdout): one row per method
    and adaptation steps k (k = 0: the served model as it is; "+ FT" rows for k > 0: after k
    steps of the method's adaptation on each client's own data), columns the held-out error (%)
    of unseen devices and of seen clients (mean, p90, worst-10% mean), each the mean +- std over
    seeds, the lowest mean of a column in bold."""
    rows: List[Tuple[str, Dict[str, List[float]]]] = []
    keys = [f"{p}_error_{s}" for p in ("unseen", "seen") for s, _ in PERSONAL_COLUMNS]
    for reader, summary, naming in _summaries(run_dirs):
        final, config = summary["final"], summary.get("config", {})
        mine: Dict[str, Dict[str, List[float]]] = {}
        for lab in reader.labels():
            for k in config.get("finetune_steps") or (0,):
                name = method_label(lab, naming) + (f" + FT ({k} steps)" if k else "")
                col = mine.setdefault(name, {})
                for key in keys:
                    fam = key.replace("seen_error", f"seen_ft{k}_error") if k else key
                    col.setdefault(key, []).append(final[lab.key()][fam])
        rows += list(mine.items())
    multi = any(len(c["unseen_error_mean"]) > 1 for _, c in rows)
    cells = {key: _cells(rows, key, 100.0, 1, multi) for key in keys}
    head = [f"unseen {t}" for _, t in PERSONAL_COLUMNS] + [f"seen {t}" for _, t in
                                                           PERSONAL_COLUMNS]
    lines = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    lines += [f"| {name} | " + " | ".join(cells[k][i] for k in keys) + " |"
              for i, (name, _) in enumerate(rows)]
    return "\n".join(lines)


AVAILABILITY_COLUMNS = (("seen_error_mean", "mean"), ("seen_error_p90", "p90"),
                        ("seen_error_worst10", "worst 10%"),
                        ("seen_avail_q1_error_mean", "least available fifth: mean"),
                        ("seen_avail_q1_error_p90", "least available fifth: p90"),
                        ("seen_avail_q1_error_worst10", "least available fifth: worst 10%"),
                        ("seen_avail_q5_error_p90", "most available fifth: p90"))


def render_availability(run_dirs: Sequence[str]) -> str:
    """The table of runs with availability and ``--client_holdout``: one row per method,
    columns the seen clients' held-out error (%): over all of them, and over the fifth of them
    least (and most) often online by the availability model (``seen_avail_q{j}``:
    :mod:`deltafl_jax.evaluation.by_availability`), each the mean +- std over seeds, the lowest
    mean of a column in bold."""
    rows: Dict[str, Dict[str, List[float]]] = {}
    for reader, summary, naming in _summaries(run_dirs):
        final = summary["final"]
        for lab in reader.labels():
            col = rows.setdefault(method_label(lab, naming), {})
            for key, _ in AVAILABILITY_COLUMNS:
                col.setdefault(key, []).append(final[lab.key()][key])
    items = list(rows.items())
    multi = any(len(c["seen_error_mean"]) > 1 for _, c in items)
    cells = {key: _cells(items, key, 100.0, 1, multi) for key, _ in AVAILABILITY_COLUMNS}
    lines = ["| method | " + " | ".join(t for _, t in AVAILABILITY_COLUMNS) + " |",
             "|---|" + "---|" * len(AVAILABILITY_COLUMNS)]
    lines += [f"| {name} | " + " | ".join(cells[k][i] for k, _ in AVAILABILITY_COLUMNS) + " |"
              for i, (name, _) in enumerate(items)]
    return "\n".join(lines)


def cells(table: str) -> Tuple[List[str], List[List[str]]]:
    """(the names: the header row's cells and each row's first cell; the numbers: every other
    cell, row by row) of a Markdown table."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines() if line.strip()]
    rows = [r for r in rows if not all(set(c) <= set("-: ") for c in r)]   # the rule line
    if not rows:
        return [], []
    names = rows[0] + [r[0] for r in rows[1:]]
    return names, [r[1:] for r in rows[1:]]


def difference(page: str, run: str) -> str:
    """What differs between a page's table and the run's: '' (nothing), 'the numbers', 'the
    column and row names (the numbers match)', or 'the numbers and the names'."""
    (page_names, page_numbers), (run_names, run_numbers) = cells(page), cells(run)
    numbers, names = page_numbers != run_numbers, page_names != run_names
    if numbers and names:
        return "the numbers and the column and row names"
    if numbers:
        return "the numbers"
    return "the column and row names (the numbers match)" if names else ""


def _pattern(name: str):
    """The block of table `name`; an empty block (the markers on consecutive lines) too."""
    return re.compile(r"(<!-- table: " + re.escape(name) + r" -->\n)(.*?)\n?(<!-- /table -->)",
                      re.S)


def replace(readme: str, name: str, table: str) -> str:
    """`readme` with table `name` replaced; KeyError if its markers are missing."""
    pattern = _pattern(name)
    if not pattern.search(readme):
        raise KeyError(f"README has no '<!-- table: {name} -->' ... '<!-- /table -->' block")
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(3), readme)


def current(readme: str, name: str) -> str:
    m = _pattern(name).search(readme)
    if not m:
        raise KeyError(f"README has no '<!-- table: {name} -->' block")
    return m.group(2)
